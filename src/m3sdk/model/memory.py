"""What a model needs per GPU before anything loads: weights per rank in the served format, KV bytes per token and
per page, the pages the rest of the memory holds, and how many sequences of a given context fit at once.

Computed from the config alone (no weights, no device), with the widths each tensor-parallel rank holds
(parallel/sharding.py's split: heads, MLP widths and the vocabulary 1/N; the routed experts 1/N of them with
expert parallel, else 1/N of each expert's width; the embeddings, norms and the router whole) and the storage of
the served formats (model/quantize.py): bf16 (the model dtype), FP8 linears (1 byte + a float32 scale per output
row), expert stacks (the shared expert stacked after the routed ones, both padded to one intermediate width):
MXFP4 (half a byte + one E8M0 byte per 32) or FP8 (1 byte + a float32 scale per row); MX experts a checkpoint
stores stay as stored.
The KV cache budget is the engine's: `gpu_memory_fraction` of the memory left after the weights (the rest covers
the CUDA context, activations and graphs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from m3sdk.attention.base import PAGE_SIZE
from m3sdk.cache.kv_pool import KVCacheSpec
from m3sdk.model.config import ModelConfig
from m3sdk.model.quantize import EXPERT_FORMATS, STACK_ALIGN

_MX_BLOCK = 32
_MX_BYTES = {"mxfp4": 0.5 + 1 / _MX_BLOCK, "mxfp8": 1 + 1 / _MX_BLOCK}  # per weight, E8M0 scales included


@dataclass(frozen=True)
class MemoryPlan:
    total_params: int  # of the whole model (all ranks together, without MTP modules)
    active_params: int  # read per token, without the embeddings and the head: attention, MLPs, top-k + shared experts
    weight_bytes_per_rank: int
    weight_bytes_by_part: dict[str, int]  # per rank: embeddings, head, attention, dense_mlp, router, experts, shared
    kv_bytes_per_token: int  # per rank: K and V of every layer (+ FP8 scales) and the index keys of sparse layers
    kv_bytes_per_page: int  # PAGE_SIZE tokens
    device_memory: int | None  # bytes per GPU the plan is for (None: no fit computed)
    kv_budget_bytes: int | None
    pages: int | None
    context: int  # the context the next field is for
    max_sequences: int | None  # sequences of `context` tokens whose pages fit at once

    @property
    def fits(self) -> bool | None:
        return None if self.pages is None else self.pages >= _pages_per_sequence(self.context)

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) lines for `m3sdk info`."""
        parts = ", ".join(f"{k} {_bytes(v)}" for k, v in self.weight_bytes_by_part.items() if v)
        rows = [("parameters", f"{_count(self.total_params)} total, {_count(self.active_params)} active per token "
                               "(without embeddings and head)"),
                ("weights/rank", f"{_bytes(self.weight_bytes_per_rank)} ({parts})"),
                ("kv/rank", f"{self.kv_bytes_per_token} B per token, {_bytes(self.kv_bytes_per_page)} per "
                            f"{PAGE_SIZE}-token page")]
        if self.device_memory is None:
            return rows
        if self.pages is None or self.pages < 1:
            rows.append(("fits", f"no: the weights need {_bytes(self.weight_bytes_per_rank)} of the "
                                 f"{_bytes(self.device_memory)} per GPU"))
            return rows
        rows.append(("fits", f"{self.pages} pages ({_bytes(self.kv_budget_bytes)} of {_bytes(self.device_memory)} "
                             f"per GPU) = {self.pages * PAGE_SIZE} tokens; {self.max_sequences} concurrent "
                             f"sequences of {self.context} tokens"))
        return rows


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def plan_memory(config: ModelConfig, *, tensor_parallel_size: int = 1, expert_parallel: bool = False,
                quantization: str = "none", dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = "bf16",
                index_cache_dtype: str | None = None, device_memory: int | None = None,
                gpu_memory_fraction: float = 0.9, context: int = 32768) -> MemoryPlan:
    """The plan of `config` served over `tensor_parallel_size` GPUs of `device_memory` bytes each (None: weights
    and KV sizes only). `kv_cache_dtype` / `index_cache_dtype` ("bf16" | "fp8" | "fp32"; the index keys default to
    the KV's) as EngineConfig's."""
    n = tensor_parallel_size
    check_split(config, n, expert_parallel)
    parts = _weight_bytes(config, n, expert_parallel, quantization, dtype.itemsize)
    weights = sum(parts.values())
    index_heads = local_heads(config.index_n_heads, n) if config.sparse_layers else config.index_n_heads
    local = dataclasses.replace(config, num_heads=config.num_heads // n,
                                num_kv_heads=local_heads(config.num_kv_heads, n), index_n_heads=index_heads)
    spec = KVCacheSpec.for_model(local, 1, kv_dtype=kv_cache_dtype, index_dtype=index_cache_dtype or kv_cache_dtype,
                                 model_dtype=dtype)
    page = spec.bytes_per_page
    budget = pages = seqs = None
    if device_memory is not None:
        budget = max(0, int((device_memory - weights) * gpu_memory_fraction))
        pages = budget // page
        seqs = pages // _pages_per_sequence(context)
    return MemoryPlan(total_params=_param_count(config, config.num_experts),
                      active_params=_param_count(config, config.num_experts_per_tok, head=False),
                      weight_bytes_per_rank=weights, weight_bytes_by_part=parts, kv_bytes_per_token=page // PAGE_SIZE,
                      kv_bytes_per_page=page, device_memory=device_memory, kv_budget_bytes=budget, pages=pages,
                      context=context, max_sequences=seqs)


def _pages_per_sequence(context: int) -> int:
    return -(-context // PAGE_SIZE) + 1  # the engine keeps one spare page per sequence (core/builder.py)


def local_heads(total: int, n: int) -> int:
    """KV (or index) heads a rank of `n` holds: 1/N of them, or, where there are fewer heads than ranks, the one
    its query heads attend with (replicated over N / total ranks: `check_split` wants N a multiple of them)."""
    return total // n if total >= n else 1


def check_split(c: ModelConfig, n: int, expert_parallel: bool) -> None:
    """Every count tensor parallel splits must divide by the `n` ranks (the KV and index heads may instead be
    replicated: `n` a multiple of them); a ValueError names all that do not."""
    counts = {"num_attention_heads": c.num_heads,
              "dense_intermediate_size": c.dense_intermediate_size if c.dense_layers else 0,
              "shared_intermediate_size": c.shared_intermediate_size if c.moe_layers else 0,
              "num_local_experts" if expert_parallel else "intermediate_size (per expert)":
                  (c.num_experts if expert_parallel else c.moe_intermediate_size) if c.moe_layers else 0}
    bad = [f"{k}={v}" for k, v in counts.items() if v % n]
    replicable = {"num_key_value_heads": c.num_kv_heads, "index_n_heads": c.index_n_heads if c.sparse_layers else n}
    bad += [f"{k}={v} (or be a multiple of it)" for k, v in replicable.items() if v % n and n % v]
    if n < 1 or bad:
        raise ValueError(f"tensor_parallel_size {n} must divide {', '.join(bad)}")


def _attention_widths(c: ModelConfig, layer: int) -> tuple[int, int]:
    """(packed q|k|v|index_q|index_k output width, o_proj input width) of one layer, whole."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    index = c.index_n_heads * c.index_head_dim + c.index_head_dim if c.is_sparse(layer) else 0
    return q + 2 * kv + index, q


def _local_qkv_rows(c: ModelConfig, layer: int, n: int) -> int:
    """Rows of the packed q|k|v|index_q|index_k projection a rank of `n` holds (the index key whole)."""
    rows = (c.num_heads // n + 2 * local_heads(c.num_kv_heads, n)) * c.head_dim
    if c.is_sparse(layer):
        rows += (local_heads(c.index_n_heads, n) + 1) * c.index_head_dim
    return rows


def _param_count(c: ModelConfig, experts: int, head: bool = True) -> int:
    """Parameters with `experts` routed experts per MoE layer (all of them: the model; top-k: per token)."""
    h = c.hidden_size
    total = 2 * c.vocab_size * h + h if head else 0
    for i in range(c.num_layers):
        qkv, o = _attention_widths(c, i)
        total += h * (qkv + o) + 2 * h + 2 * c.head_dim + (2 * c.index_head_dim if c.is_sparse(i) else 0)
        if c.is_moe(i):
            total += (experts * c.moe_intermediate_size + c.shared_intermediate_size) * 3 * h + c.num_experts * (h + 1)
        else:
            total += 3 * h * c.dense_intermediate_size
    return total


def _weight_bytes(c: ModelConfig, n: int, expert_parallel: bool, quantization: str, size: int) -> dict[str, int]:
    """Bytes one rank holds, by part, in the served formats."""
    h = c.hidden_size
    fp8 = quantization != "none"

    def linear(rows: int, cols: int) -> int:  # FP8: 1 byte a weight + a float32 scale per output row
        return rows * cols + 4 * rows if fp8 else rows * cols * size

    parts = dict.fromkeys(("embeddings", "head", "attention", "dense_mlp", "router", "experts", "shared"), 0)
    parts["embeddings"] = c.vocab_size * h * size + h * size  # and the final norm
    parts["head"] = 0 if c.tie_word_embeddings and n == 1 else -(-c.vocab_size // n) * h * size
    routed = c.num_experts // n if expert_parallel else c.num_experts
    inter = c.moe_intermediate_size if expert_parallel else c.moe_intermediate_size // n
    shared = c.shared_intermediate_size // n
    expert_format = c.quant_format if c.quant_format != "none" else EXPERT_FORMATS.get(quantization)
    for i in range(c.num_layers):
        qkv, o = _attention_widths(c, i)
        index_k = c.index_head_dim if c.is_sparse(i) else 0
        norms = (2 * h + 2 * c.head_dim + 2 * index_k) * size
        parts["attention"] += linear(_local_qkv_rows(c, i, n), h) + linear(h, o // n) + norms
        if not c.is_moe(i):
            dense = c.dense_intermediate_size // n
            parts["dense_mlp"] += linear(2 * dense, h) + linear(h, dense)
            continue
        parts["router"] += c.num_experts * (h + 1) * 4
        if expert_format is None:
            parts["experts"] += routed * 3 * h * inter * size
            parts["shared"] += linear(2 * shared, h) + linear(h, shared)
            continue
        # one stack: the routed experts, then the shared expert, padded to one width (and MX: the hidden size to 32)
        inter_block, hidden_block = STACK_ALIGN[expert_format]
        width = -(-max(inter, shared) // inter_block) * inter_block
        padded_h = -(-h // hidden_block) * hidden_block
        if expert_format == "fp8":  # a float32 scale per row of gate_up [2W, H] and of down [H, W]
            per_expert = 3 * padded_h * width + 4 * (2 * width + padded_h)
        else:
            per_expert = int(3 * padded_h * width * _MX_BYTES[expert_format])
        parts["experts"] += routed * per_expert
        parts["shared"] += per_expert
    return parts
