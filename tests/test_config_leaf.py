"""EngineConfig is a leaf: importing it (and building one) loads neither torch nor the kernels; "auto" settings are
resolved once, when the engine is built."""

import subprocess
import sys

import pytest

from m3sdk import EngineConfig


def test_importing_the_config_loads_no_torch():
    code = ("import sys; from m3sdk import EngineConfig, SamplingParams; "
            "EngineConfig(kv_cache_dtype='fp8', speculative='ngram', prefill_nodes=['a:1']); "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'm3sdk_kernels')]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_settings_resolve_against_the_device():
    from m3sdk.core.resolved import resolve

    rc = resolve(EngineConfig(device="cpu"))
    assert (str(rc.device), str(rc.dtype), rc.attention_backend, rc.cuda_graphs, rc.overlap) == (
        "cpu", "torch.float32", "torch", False, False)
    assert (rc.kv_cache_dtype, rc.index_cache_dtype, rc.kv_cache_layout) == ("fp32", "fp32", "plain")
    rc = resolve(EngineConfig(device="cpu", dtype="bfloat16", index_cache_dtype="fp8", overlap_scheduling=True))
    assert (rc.kv_cache_dtype, rc.index_cache_dtype, rc.overlap) == ("bf16", "fp8", True)
    assert not resolve(EngineConfig(device="cpu", overlap_scheduling=True, speculative="ngram")).overlap


def test_bad_values_are_refused_on_creation():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative="medusa")
