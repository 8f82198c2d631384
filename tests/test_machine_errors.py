"""A configuration this machine cannot serve is one ConfigError, raised before anything loads (no checkpoint is
read, no kernel is launched), and one line from the command."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from m3sdk import ConfigError, EngineConfig
from m3sdk.core import EngineCore, build_core
from m3sdk.core.resolved import resolve


def build(**overrides) -> EngineCore:
    # a checkpoint folder that does not exist: the machine check must come first, before any read
    return build_core(EngineConfig(model="/nonexistent/checkpoint", **overrides))


@pytest.mark.cpu_only
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu(device):
    with pytest.raises(ConfigError, match=r"device='cuda(:1)?' but torch .* (built without CUDA/HIP|sees no GPU)"):
        build(device=device)


@pytest.mark.cpu_only
def test_triton_backend_on_the_cpu_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="attention_backend='triton' runs compiled Triton kernels"):
        build(attention_backend="triton")


def test_triton_backend_on_the_cpu_in_the_interpreter_loads(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve(EngineConfig(device="cpu", attention_backend="triton")).device == torch.device("cpu")


def test_fp8_and_kernels_on_a_gpu_without_them(monkeypatch):
    """An sm_80 part (A100): no kernel tables, no FP8. Its properties stand in for the real part's."""
    props = SimpleNamespace(major=8, minor=0, gcnArchName="", name="NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: props.name)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(ConfigError) as e:
        build(device="cuda:7", kv_cache_dtype="fp8", quantization="fp8")
    assert "NVIDIA A100: m3sdk_kernels needs sm_90 or newer, found sm_80" in str(e.value)
    assert "kv_cache_dtype='fp8', quantization='fp8' needs FP8, which NVIDIA A100 lacks" in str(e.value)


@pytest.mark.cpu_only
def test_the_command_says_it_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "m3sdk.cli", "generate", "hi", "--device", "cuda"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("m3sdk: error: this machine cannot serve the configuration: "
                                                   "device='cuda'"), proc.stderr
