"""ResolvedConfig: an EngineConfig with every "auto" decided against this machine and the loaded model, once, when
the engine is built; the parts read it and nothing else resolves a setting."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from m3sdk.config import EngineConfig
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
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto"
                          else config.device)
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
