"""EngineConfig: the engine-level knobs, validated on creation. Unknown fields are a TypeError.

"auto" values are resolved against the machine when the engine starts (`resolve_*` below), so one config
serves a CPU laptop and a GPU node alike.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from m3sdk.errors import ConfigError
from m3sdk.model.quantize import QUANTIZATIONS
from m3sdk.speculative.base import SpecConfig
from m3sdk_kernels.arch import current_arch

BUNDLED_MODELS = {"m3-tiny": Path(__file__).parent / "assets" / "m3-tiny"}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CACHE_DTYPES = ("auto", "bf16", "fp8", "fp32")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "m3-tiny"  # a checkpoint folder, or the name of a bundled model
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" (bfloat16 on a GPU, float32 on a CPU) | "float32" | "bfloat16"
    max_model_len: int | None = None  # prompt + generated tokens; None: the model's, shrunk to fit the cache
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    max_waiting_requests: int = 1024  # admitted but not yet running; beyond it EngineOverloadedError
    # Per request: stop strings (and stop token ids) and the characters of one stop string. Every step matches each
    # stream's new text against its stop strings, so 100,000 of them (or one of 10 MB) would slow every stream.
    max_stop_strings: int = 64
    max_stop_length: int = 1024
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: gpu_memory_fraction (or a CPU default)
    gpu_memory_fraction: float = 0.9  # of the device memory free after loading the model
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "bf16" | "fp8" | "fp32"
    kv_cache_layout: str = "auto"  # "auto" (the platform's measured default, m3sdk_kernels.arch) | "plain" | "shuffle"
    index_cache_dtype: str = "auto"  # indexer keys of sparse layers; "auto": as kv_cache_dtype
    enable_prefix_caching: bool = True
    # Remote prefill (docs/disaggregation.md): prompts with at least remote_prefill_min_tokens tokens to compute
    # go to the least loaded of prefill_nodes ("host:port"); if that fails, "local" prefills here, "error" raises
    # PrefillNodeError. Needs the `ucx` extra.
    prefill_nodes: tuple[str, ...] = ()
    remote_prefill_min_tokens: int = 512
    prefill_fallback: str = "local"
    prefill_timeout: float = 60.0  # seconds per remote prefill, enforced on both sides
    prefill_token: str | None = None  # the shared token the prefill nodes require, if any
    prefill_tls_root_cert: str | None = None  # PEM file of the CA that signed the nodes' certificates: TLS
    # A registered name, or a factory (cache_manager, config) -> Scheduler, e.g. a Scheduler class.
    scheduler: str | Callable[..., Any] = "continuous"
    attention_backend: str = "auto"  # "auto" (triton on a GPU, torch on a CPU) | "torch" | "triton"
    cache_manager: str = "paged"
    # Speculative decoding: None (off), "ngram" | "eagle3" | "eagle3:/path/to/head" | "mtp", or a dict
    # {"method", "num_speculative_tokens", "model", ...}; normalized to a SpecConfig (m3sdk/speculative/base.py).
    speculative: SpecConfig | str | dict | None = None
    # Tensor parallel over this many ranks (processes; one GPU each, or gloo on a CPU), docs/serving.md.
    # expert_parallel: whole experts per rank (needs num_experts % ranks == 0), else every expert's width is split
    # (the default: pairs routed to another rank's experts still run as weight-0 pairs on a local expert, so whole
    # experts measured 1.12x slower per TP=2 batch-64 decode step on the H200, docs/perf.md).
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    # Replay decode and verify steps from captured CUDA graphs; None: on for a CUDA device with the triton backend.
    cuda_graphs: bool | None = None
    # Overlap host scheduling with the device step (docs/engine.md): while step N runs, schedule and launch step
    # N+1 from N's tokens still on the device; the host's bookkeeping of N (append, stop checks, streaming) lags
    # one step. None: on for a CUDA device. Off with speculative decoding (its drafts need the host's tokens).
    overlap_scheduling: bool | None = None
    # Weights quantized at load (m3sdk/model/quantize.py): "fp8" = FP8 W8A8 attention, dense MLPs and shared
    # experts; "mxfp4" = that plus MXFP4 routed experts. Experts a checkpoint stores quantized stay as stored.
    quantization: str = "none"
    # A progress bar on stderr while the weights load (the CLI turns it on; an embedded engine stays silent).
    show_progress: bool = False

    def __post_init__(self) -> None:
        problems = []
        nodes = self.prefill_nodes
        if isinstance(nodes, str) or not all(isinstance(n, str) and ":" in n for n in nodes):
            problems.append(f"prefill_nodes must be a list of 'host:port' strings, got {nodes!r}")
        else:
            object.__setattr__(self, "prefill_nodes", tuple(nodes))
        if not _is_int(self.remote_prefill_min_tokens) or self.remote_prefill_min_tokens < 1:
            problems.append(f"remote_prefill_min_tokens must be an int >= 1, got {self.remote_prefill_min_tokens!r}")
        if self.prefill_fallback not in ("local", "error"):
            problems.append(f"prefill_fallback must be 'local' or 'error', got {self.prefill_fallback!r}")
        if isinstance(self.prefill_timeout, bool) or not isinstance(self.prefill_timeout, int | float) \
                or not self.prefill_timeout > 0:
            problems.append(f"prefill_timeout must be a positive number of seconds, got {self.prefill_timeout!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "tensor_parallel_size",
                     "max_stop_strings", "max_stop_length"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                problems.append(f"{name} must be an int >= 1, got {value!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            problems.append(f"max_model_len must be an int >= 2 or None, got {self.max_model_len!r}")
        if _is_int(self.max_num_seqs) and _is_int(self.max_num_batched_tokens) \
                and self.max_num_batched_tokens < self.max_num_seqs:
            problems.append("max_num_batched_tokens must be >= max_num_seqs (each running request decodes)")
        if self.kv_cache_memory is not None and (not _is_int(self.kv_cache_memory) or self.kv_cache_memory < 1):
            problems.append(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if not isinstance(self.gpu_memory_fraction, int | float) or not 0 < self.gpu_memory_fraction <= 1:
            problems.append(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction!r}")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            problems.append(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        choices = {"dtype": ("auto", *_DTYPES), "kv_cache_dtype": _CACHE_DTYPES, "index_cache_dtype": _CACHE_DTYPES,
                   "kv_cache_layout": ("auto", "plain", "shuffle"), "attention_backend": ("auto", "torch", "triton"),
                   "quantization": QUANTIZATIONS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                problems.append(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("cuda_graphs", "overlap_scheduling"):
            if getattr(self, name) not in (None, True, False):
                problems.append(f"{name} must be None (auto), True or False, got {getattr(self, name)!r}")
        if not isinstance(self.scheduler, str) and not callable(self.scheduler):
            problems.append(f"scheduler must be a name or a factory, got {self.scheduler!r}")
        try:
            object.__setattr__(self, "speculative", SpecConfig.parse(self.speculative))
        except ValueError as e:
            problems.append(f"speculative: {e}")
        if problems:
            raise ValueError("EngineConfig: " + "; ".join(problems))

    def replace(self, **overrides: Any) -> EngineConfig:
        """A copy with `overrides` applied and validated (unknown names are a TypeError)."""
        return dataclasses.replace(self, **overrides)

    def model_path(self) -> Path:
        return BUNDLED_MODELS.get(self.model) or Path(self.model)

    def resolve_device(self) -> torch.device:
        """The device the engine serves on, checked against this machine before anything loads: ConfigError when
        the device is not there, the kernels have no tables for its GPU, attention_backend="triton" has no GPU
        (outside the Triton interpreter) or FP8 is asked of a device without it."""
        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(self.device)
        problems = _machine_problems(self, device)
        if problems:
            raise ConfigError("this machine cannot serve the configuration: " + "; ".join(problems))
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            # CPUs have slow, lossy bf16 matmuls; GPUs are built for it.
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    def resolve_attention_backend(self, device: torch.device) -> str:
        if self.attention_backend == "auto":
            return "triton" if device.type == "cuda" else "torch"
        return self.attention_backend

    def resolve_cuda_graphs(self, device: torch.device) -> bool:
        if self.cuda_graphs is None:
            return device.type == "cuda" and self.resolve_attention_backend(device) == "triton"
        return self.cuda_graphs and device.type == "cuda"

    def resolve_overlap(self, device: torch.device) -> bool:
        if self.speculative is not None:  # a drafter proposes from the host's tokens of the step before
            return False
        return device.type == "cuda" if self.overlap_scheduling is None else self.overlap_scheduling

    def resolve_kv_layout(self, device: torch.device) -> str:
        """"auto": plain on the CPU and on Hopper (measured faster there), SHUFFLE on AMD Instinct."""
        if self.kv_cache_layout == "auto":
            return current_arch(device).kv_layout if device.type == "cuda" else "plain"
        return self.kv_cache_layout

    def resolve_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[str, str]:
        """(kv dtype, index-key dtype) as Contract 1 names them."""
        kv = self.kv_cache_dtype if self.kv_cache_dtype != "auto" else (
            "bf16" if model_dtype == torch.bfloat16 else "fp32")
        index = kv if self.index_cache_dtype == "auto" else self.index_cache_dtype
        return kv, index


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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
