"""ResolvedConfig: an EngineConfig with every "auto" decided against this machine and the loaded model, once, when
the engine is built; the parts read it and nothing else resolves a setting."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from m3sdk.config import EngineConfig
from m3sdk.errors import ConfigError
from m3sdk_kernels.arch import current_arch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ResolvedConfig:
    engine: EngineConfig  # as the user gave it
    model_path: Path
    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # "torch" | "triton"
    cuda_graphs: bool
    overlap: bool  # overlapped steps (never with speculative decoding)
    kv_cache_layout: str  # "plain" | "shuffle"
    kv_cache_dtype: str  # "bf16" | "fp8" | "fp32"
    index_cache_dtype: str
    max_model_len: int = 0  # set once the model and the cache budget are known (0 before)


def resolve(config: EngineConfig) -> ResolvedConfig:
    """Every "auto" decided, after checking that this machine can serve the configuration at all (ConfigError, before
    anything loads: the device is not there, the kernels have no tables for its GPU, attention_backend="triton" has
    no GPU outside the Triton interpreter, or FP8 is asked of a device without it)."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto"
                          else config.device)
    problems = _machine_problems(config, device)
    if problems:
        raise ConfigError("this machine cannot serve the configuration: " + "; ".join(problems))
    # CPUs have slow, lossy bf16 matmuls; GPUs are built for it
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if config.dtype == "auto" \
        else _DTYPES[config.dtype]
    backend = config.attention_backend if config.attention_backend != "auto" else (
        "triton" if device.type == "cuda" else "torch")
    kv = config.kv_cache_dtype if config.kv_cache_dtype != "auto" else (
        "bf16" if dtype == torch.bfloat16 else "fp32")
    return ResolvedConfig(
        engine=config, model_path=config.model_path(), device=device, dtype=dtype, attention_backend=backend,
        cuda_graphs=cuda_graphs_wanted(config, device, backend),
        # a drafter proposes from the host's tokens of the step before: no overlap with one
        overlap=config.speculative is None and (device.type == "cuda" if config.overlap_scheduling is None
                                                else config.overlap_scheduling),
        # "auto": plain on the CPU and on Hopper (measured faster there), SHUFFLE on AMD Instinct
        kv_cache_layout=config.kv_cache_layout if config.kv_cache_layout != "auto" else (
            current_arch(device).kv_layout if device.type == "cuda" else "plain"),
        kv_cache_dtype=kv, index_cache_dtype=kv if config.index_cache_dtype == "auto" else config.index_cache_dtype)


def cuda_graphs_wanted(config: EngineConfig, device: torch.device, attention_backend: str) -> bool:
    """None: on for a CUDA device with the triton backend."""
    if config.cuda_graphs is None:
        return device.type == "cuda" and attention_backend == "triton"
    return config.cuda_graphs and device.type == "cuda"


def _machine_problems(config: EngineConfig, device: torch.device) -> list[str]:
    problems = []
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            built = "built without CUDA/HIP" if torch.version.cuda is None and torch.version.hip is None \
                else "sees no GPU"
            return [f"device={config.device!r} but torch {torch.__version__} {built}: use device='cpu' or 'auto'"]
        if (device.index or 0) >= count:
            return [f"device={config.device!r} but this machine has {count} GPU(s)"]
        try:
            current_arch(device)
        except RuntimeError as e:  # the kernels (norms, router, attention) run on every GPU the engine uses
            problems.append(f"{torch.cuda.get_device_name(device)}: {e}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if config.attention_backend == "triton" and device.type != "cuda" and not interpreted:
        problems.append("attention_backend='triton' runs compiled Triton kernels, which need a GPU; this engine is "
                        "on the CPU: use 'auto' or 'torch' (or TRITON_INTERPRET=1 to run them in the interpreter)")
    fp8 = [f"{name}='fp8'" for name in ("kv_cache_dtype", "index_cache_dtype") if getattr(config, name) == "fp8"]
    fp8 += [f"quantization={config.quantization!r}"] if config.quantization != "none" else []
    if fp8 and not _has_fp8(device):
        problems.append(f"{', '.join(fp8)} needs FP8, which {torch.cuda.get_device_name(device)} lacks "
                        "(NVIDIA sm_89 or newer, AMD gfx942 / gfx950)")
    return problems


def _has_fp8(device: torch.device) -> bool:
    """FP8 storage and math: the CPU (torch's emulation, the kernels' references), NVIDIA Ada/Hopper and newer,
    AMD MI300 (fnuz) and MI355."""
    if device.type != "cuda":
        return True
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        return props.gcnArchName.split(":")[0] in ("gfx942", "gfx950")
    return (props.major, props.minor) >= (8, 9)
