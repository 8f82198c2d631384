"""EngineConfig: the engine-level knobs, validated on creation. Unknown fields are a TypeError.

The knobs that have grown into families live in groups: `cache` (CacheConfig), `scheduling` (SchedulingConfig),
`speculative` (SpecConfig), `disagg` (DisaggConfig) and `parallel` (ParallelConfig). A group's knobs are also
EngineConfig's own flat keywords and attributes (`EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype`), so
`Engine(model=..., max_num_seqs=...)` reads as before; a whole group may be given too (`cache=CacheConfig(...)`).

"auto" values are resolved against the machine once, when the engine is built (m3sdk/core/resolved.py), so one
config serves a CPU laptop and a GPU node alike. A leaf: it imports nothing heavy (no torch, no kernels).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3sdk.speculative.registry import DRAFTERS

# minimax-m3: the real architecture's config.json alone (no weights): for load_format="dummy" and memory planning
BUNDLED_MODELS = {name: Path(__file__).parent / "assets" / name for name in ("m3-tiny", "minimax-m3")}

QUANTIZATIONS = ("none", "fp8", "fp8_experts", "mxfp4")  # m3sdk/model/quantize.py
# The vision encoder's linears: "auto" and "none" keep them in the model dtype (on an H200 bf16 is as fast as FP8
# W8A8 for one 1344 x 1344 image and 2.4x faster for a 448 x 448 one: docs/perf.md "Images"), "fp8" serves them in
# FP8 W8A8 (half the tower's memory)
VISION_QUANTIZATIONS = ("auto", "none", "fp8")
LOAD_FORMATS = ("auto", "dummy")  # dummy: m3sdk/model/dummy.py
PREFILL_TOKEN_ENV = "M3SDK_PREFILL_TOKEN"  # where the CLI reads prefill nodes' shared token (never a flag)
DTYPES = ("float32", "bfloat16")
CACHE_DTYPES = ("auto", "bf16", "fp8", "fp32")


@dataclass(frozen=True)
class SpecConfig:
    """`Engine(speculative=...)`: a dict `{"method", "num_speculative_tokens", "model", ...}`, a string
    `"ngram"`, `"eagle3"`, `"eagle3:/path/to/head"`, `"mtp"`, or None (off)."""

    method: str
    num_speculative_tokens: int = 3  # the most drafts a step verifies per request
    # the drafts per step chosen from 0 .. num_speculative_tokens by the batch, acceptance and measured step costs
    # (speculative/depth.py); False: always num_speculative_tokens
    adaptive: bool = True
    model: str | None = None  # draft checkpoint (eagle3); None: the head bundled with the target, if any
    prompt_lookup_max: int = 4  # ngram: longest suffix to match
    prompt_lookup_min: int = 1  # ngram: shortest suffix to match

    def __post_init__(self) -> None:
        if self.method not in DRAFTERS:
            raise ValueError(f"speculative method must be one of {DRAFTERS.names()}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an int in [1, 16], got {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be True or False, got {self.adaptive!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.model is not None and self.method == "ngram":
            raise ValueError("the ngram drafter takes no model")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpecConfig | None) -> SpecConfig | None:
        if value is None or isinstance(value, SpecConfig):
            return value
        if isinstance(value, str):
            method, _, path = value.partition(":")
            return cls(method=method.strip(), model=path.strip() or None)
        if isinstance(value, dict):
            unknown = set(value) - {f for f in cls.__dataclass_fields__}
            if unknown:
                raise ValueError(f"unknown speculative option(s) {sorted(unknown)}")
            if "method" not in value:
                raise ValueError("speculative needs a 'method'")
            return cls(**value)
        raise ValueError(f"speculative must be a str, a dict or None, got {type(value).__name__}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(group: object, *names: str) -> list[str]:
    return [f"{n} must be an int >= 1, got {getattr(group, n)!r}" for n in names
            if not _is_int(getattr(group, n)) or getattr(group, n) < 1]


def _check(group: object, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"{type(group).__name__}: " + "; ".join(problems))


@dataclass(frozen=True)
class CacheConfig:
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: gpu_memory_fraction (or a CPU default)
    gpu_memory_fraction: float = 0.9  # of the device memory free after loading the model
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "bf16" | "fp8" | "fp32"
    kv_cache_layout: str = "auto"  # "auto" (the platform's measured default, m3sdk_kernels.arch) | "plain" | "shuffle"
    index_cache_dtype: str = "auto"  # indexer keys of sparse layers; "auto": as kv_cache_dtype
    enable_prefix_caching: bool = True
    cache_manager: str = "paged"  # a registered name (m3sdk/cache: CACHE_MANAGERS)

    def __post_init__(self) -> None:
        problems = []
        if self.kv_cache_memory is not None and (not _is_int(self.kv_cache_memory) or self.kv_cache_memory < 1):
            problems.append(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if not isinstance(self.gpu_memory_fraction, int | float) or not 0 < self.gpu_memory_fraction <= 1:
            problems.append(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction!r}")
        for name, allowed in (("kv_cache_dtype", CACHE_DTYPES), ("index_cache_dtype", CACHE_DTYPES),
                              ("kv_cache_layout", ("auto", "plain", "shuffle"))):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        _check(self, problems)


@dataclass(frozen=True)
class SchedulingConfig:
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    max_waiting_requests: int = 1024  # admitted but not yet running; beyond it EngineOverloadedError
    # A registered name, or a factory (cache_manager, config) -> Scheduler, e.g. a Scheduler class.
    scheduler: str | Callable[..., Any] = "continuous"
    # Overlap host scheduling with the device step (docs/engine.md): while step N runs, schedule and launch step
    # N+1 from N's tokens still on the device; the host's bookkeeping of N (append, stop checks, streaming) lags
    # one step. None: on a CUDA device each decode step overlaps or reads the step before first, whichever measured
    # the shorter step at its batch size (core/overlap.py: on a model as small as m3-tiny reading first can win);
    # off on a CPU. True: every step overlaps. A speculating engine's drafting steps never overlap (its drafts need
    # the host's tokens); its depth-0 steps follow this setting (False: never overlapped).
    overlap_scheduling: bool | None = None

    def __post_init__(self) -> None:
        problems = _positive_int(self, "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests")
        if not problems and self.max_num_batched_tokens < self.max_num_seqs:
            problems.append("max_num_batched_tokens must be >= max_num_seqs (each running request decodes)")
        if not isinstance(self.scheduler, str) and not callable(self.scheduler):
            problems.append(f"scheduler must be a name or a factory, got {self.scheduler!r}")
        if self.overlap_scheduling not in (None, True, False):
            problems.append(f"overlap_scheduling must be None (auto), True or False, got {self.overlap_scheduling!r}")
        _check(self, problems)


@dataclass(frozen=True)
class DisaggConfig:
    """Remote prefill (docs/disaggregation.md): prompts with at least remote_prefill_min_tokens tokens to compute go
    to the least loaded of prefill_nodes ("host:port"); if that fails, "local" prefills here, "error" raises
    PrefillNodeError. Needs the `ucx` extra."""

    prefill_nodes: tuple[str, ...] = ()
    remote_prefill_min_tokens: int = 512
    prefill_fallback: str = "local"
    prefill_timeout: float = 60.0  # seconds per remote prefill, enforced on both sides
    prefill_token: str | None = None  # the shared token the prefill nodes require, if any
    prefill_tls_root_cert: str | None = None  # PEM file of the CA that signed the nodes' certificates: TLS

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
        _check(self, problems)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallel over tensor_parallel_size ranks (processes; one GPU each, or gloo on a CPU), docs/serving.md.
    expert_parallel: whole experts per rank (needs num_experts % ranks == 0), else every expert's width is split (the
    default: pairs routed to another rank's experts still run as weight-0 pairs on a local expert, so whole experts
    measured 1.12x slower per TP=2 batch-64 decode step on the H200, docs/perf.md)."""

    tensor_parallel_size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        _check(self, _positive_int(self, "tensor_parallel_size"))


_GROUPS: dict[str, type] = {"cache": CacheConfig, "scheduling": SchedulingConfig, "disagg": DisaggConfig,
                            "parallel": ParallelConfig}
# flat keyword -> the group that holds it
_FLAT = {f.name: group for group, cls in _GROUPS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True, init=False)
class EngineConfig:
    model: str = "m3-tiny"  # a checkpoint folder, or the name of a bundled model
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" (bfloat16 on a GPU, float32 on a CPU) | "float32" | "bfloat16"
    max_model_len: int | None = None  # prompt + generated tokens; None: the model's, shrunk to fit the cache
    # Per request: stop strings (and stop token ids) and the characters of one stop string. Every step matches each
    # stream's new text against its stop strings, so 100,000 of them (or one of 10 MB) would slow every stream.
    max_stop_strings: int = 64
    max_stop_length: int = 1024
    # The watchdog: a phase of the engine loop (a forward, sampling, emitting) that runs longer than this many
    # seconds ends the engine with EngineDeadError naming the phase, so that no waiter hangs on a stuck step.
    # None: off. A first Triton compile at a new shape runs in a step on a GPU (warm-up covers the common ones).
    step_timeout: float | None = 300.0
    attention_backend: str = "auto"  # "auto" (triton on a GPU, torch on a CPU) | "torch" | "triton"
    # Replay decode and verify steps from captured CUDA graphs; None: on for a CUDA device with the triton backend.
    cuda_graphs: bool | None = None
    # Weights quantized at load (m3sdk/model/quantize.py): "fp8" = FP8 W8A8 attention, dense MLPs and shared
    # experts; "fp8_experts" = that plus FP8 routed experts; "mxfp4" = "fp8" plus MXFP4 routed experts. Experts a
    # checkpoint stores quantized stay as stored.
    quantization: str = "none"
    # "auto": the checkpoint's weights; "dummy": random weights from `seed` for the model's config.json alone, made
    # on the device in the served format (each tensor-parallel rank makes only its shard): nothing else is read.
    load_format: str = "auto"
    seed: int = 0  # of load_format="dummy"'s weights
    # A progress bar on stderr while the weights load (the CLI turns it on; an embedded engine stays silent).
    show_progress: bool = False
    # Speculative decoding: None (off), "ngram" | "eagle3" | "eagle3:/path/to/head" | "mtp", or a dict
    # {"method", "num_speculative_tokens", "model", ...}; normalized to a SpecConfig (above).
    speculative: SpecConfig | str | dict | None = None
    # Images per request (docs/vision.md); 0: the checkpoint's vision encoder is not loaded (text serving pays
    # nothing). A checkpoint without a vision tower takes no images whatever this says.
    limit_images: int = 8
    # The vision encoder's linears, whatever `quantization` says (VISION_QUANTIZATIONS): "auto" / "none" the model
    # dtype, "fp8" FP8 W8A8.
    vision_quantization: str = "auto"
    # Remote (http/https) image URLs -> their bytes; None: such URLs are refused (no network access by default).
    image_fetcher: Callable[[str], bytes] | None = None
    # Run the engine core in a process of its own (core/process.py), so the application's threads (an HTTP
    # server's event loop) and the engine loop do not share one interpreter lock. Requests are still validated in
    # the application's process; with prefill_nodes, the remote prefill client lives in the engine process,
    # beside the cache it fills. Not with tensor_parallel_size > 1 (its workers cannot be children of the
    # daemonic engine process).
    engine_process: bool = False
    cache: CacheConfig = CacheConfig()
    scheduling: SchedulingConfig = SchedulingConfig()
    disagg: DisaggConfig = DisaggConfig()
    parallel: ParallelConfig = ParallelConfig()

    def __init__(self, **knobs: Any):
        """Keywords: this class's fields, whole groups, or any group's knobs (flat)."""
        own = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(knobs) - own - set(_FLAT))
        if unknown:
            raise TypeError(f"EngineConfig got unknown knob(s) {unknown}")
        problems = []
        for group, cls in _GROUPS.items():
            flat = {k: v for k, v in knobs.items() if _FLAT.get(k) == group}
            base = knobs.get(group, cls())
            try:
                value = dataclasses.replace(base, **flat) if flat else base
            except ValueError as e:
                problems.append(str(e))
                value = base
            object.__setattr__(self, group, value)
        for f in dataclasses.fields(self):
            if f.name not in _GROUPS:
                object.__setattr__(self, f.name, knobs.get(f.name, f.default))
        problems += self._problems()
        if problems:
            raise ValueError("EngineConfig: " + "; ".join(problems))

    def __getattr__(self, name: str) -> Any:
        # a group's knob read flat (only reached when normal lookup fails)
        group = _FLAT.get(name)
        if group is None or group not in self.__dict__:
            raise AttributeError(f"'EngineConfig' object has no attribute {name!r}")
        return getattr(self.__dict__[group], name)

    def _problems(self) -> list[str]:
        problems = _positive_int(self, "max_stop_strings", "max_stop_length")
        if not _is_int(self.seed) or self.seed < 0:
            problems.append(f"seed must be an int >= 0, got {self.seed!r}")
        if not _is_int(self.limit_images) or self.limit_images < 0:
            problems.append(f"limit_images must be an int >= 0, got {self.limit_images!r}")
        if self.image_fetcher is not None and not callable(self.image_fetcher):
            problems.append("image_fetcher must be a callable (url -> bytes) or None")
        if self.step_timeout is not None and (isinstance(self.step_timeout, bool) or not isinstance(
                self.step_timeout, int | float) or not 0 < self.step_timeout < float("inf")):
            problems.append(f"step_timeout must be a positive number of seconds or None, got {self.step_timeout!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            problems.append(f"max_model_len must be an int >= 2 or None, got {self.max_model_len!r}")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            problems.append(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        choices = {"dtype": ("auto", *DTYPES), "attention_backend": ("auto", "torch", "triton"),
                   "quantization": QUANTIZATIONS, "vision_quantization": VISION_QUANTIZATIONS,
                   "load_format": LOAD_FORMATS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                problems.append(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.cuda_graphs not in (None, True, False):
            problems.append(f"cuda_graphs must be None (auto), True or False, got {self.cuda_graphs!r}")
        if self.engine_process not in (True, False):
            problems.append(f"engine_process must be True or False, got {self.engine_process!r}")
        elif self.engine_process and self.parallel.tensor_parallel_size > 1:
            problems.append("engine_process does not run with tensor_parallel_size > 1")
        try:
            object.__setattr__(self, "speculative", SpecConfig.parse(self.speculative))
        except ValueError as e:
            problems.append(f"speculative: {e}")
        return problems

    def replace(self, **overrides: Any) -> EngineConfig:
        """A copy with `overrides` (flat knobs, fields or groups) applied and validated (unknown names are a
        TypeError)."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return EngineConfig(**{**current, **overrides})

    def model_path(self) -> Path:
        return BUNDLED_MODELS.get(self.model) or Path(self.model)

    def vision_encoder_quantization(self) -> str:
        """How the vision encoder's linears are served: "fp8" when vision_quantization asks for it, else "none"."""
        return "fp8" if self.vision_quantization == "fp8" else "none"
