"""Contract 2: what one forward step knows about its tokens (AttentionMetadata) and the attention seam.

Tokens of many sequences are flattened, sequence-major: sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1],
and after this step's writes its cache holds context_lens[i] tokens, the new ones last. Prefill, chunked
prefill and decode are the same thing seen this way (n_i = prompt piece or 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from m3sdk.registry import Registry
from m3sdk.staging import to_device

if TYPE_CHECKING:
    from m3sdk.cache.kv_pool import KVPool

PAGE_SIZE = 16


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    context_lens: torch.Tensor  # int32 [B], after this step's writes
    page_table: torch.Tensor  # int32 [B, max_pages]
    max_seqlen_q: int
    max_context_len: int

    @classmethod
    def build(cls, num_new_tokens: Sequence[int], context_lens: Sequence[int], page_tables: Sequence[Sequence[int]],
              device: torch.device | str = "cpu") -> AttentionMetadata:
        """From host lists: per sequence, its new-token count, its context length after the step and its pages."""
        positions, slots = [], []
        for n, ctx, pages in zip(num_new_tokens, context_lens, page_tables, strict=True):
            if not 0 <= n <= ctx or len(pages) * PAGE_SIZE < ctx:
                raise ValueError(f"sequence with {n} new tokens, context {ctx}, {len(pages)} pages is inconsistent")
            for p in range(ctx - n, ctx):
                positions.append(p)
                slots.append(pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE)
        cu = [0]
        for n in num_new_tokens:
            cu.append(cu[-1] + n)
        # a multiple of 16 wide: the kernels take the row stride as an integer, and Triton compiles a variant per
        # divisibility class of it (a first step at another width would wait on a compile)
        width = -(-max((len(p) for p in page_tables), default=0) // 16) * 16
        # entries past a sequence's pages are unspecified by the contract: 0 (a real page)
        table = np.zeros((len(page_tables), width), dtype=np.int32)
        for i, pages in enumerate(page_tables):
            table[i, :len(pages)] = np.asarray(pages, dtype=np.int32)
        return cls(
            positions=to_device(positions, torch.int64, device),
            slot_mapping=to_device(slots, torch.int64, device),
            cu_seqlens_q=to_device(cu, torch.int32, device),
            context_lens=to_device(list(context_lens), torch.int32, device),
            page_table=to_device(torch.from_numpy(table), torch.int32, device),
            max_seqlen_q=max(num_new_tokens, default=0),
            max_context_len=max(context_lens, default=0),
        )


@dataclass(frozen=True)
class AttentionShapes:
    """A model's attention widths, for a backend to decide at build how it serves each op. `index_dim` and
    `block_size`: the MSA indexer's (None without sparse layers)."""

    head_dim: int
    rotary_dim: int
    index_dim: int | None = None
    block_size: int | None = None


class AttentionBackend(Protocol):
    """Cache writes, indexer selection and paged attention of one layer (dense, or MSA with `block_sel`)."""

    def bind(self, shapes: AttentionShapes) -> None:
        """Called once when the model is built: the backend decides here, never at a request, how it serves each
        op for these shapes."""

    def compile_ahead(self, max_context_len: int, topk: int, device: torch.device) -> None:
        """Called once before serving: compile now what a first prompt at any context up to `max_context_len`
        would otherwise wait on (a backend without compiled kernels does nothing)."""

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor | None,
                 meta: AttentionMetadata, kv: KVPool) -> None:
        """Store k, v [T, Hkv, D] (k normed and roped) and, on sparse layers, index_k [T, Di] at meta.slot_mapping."""

    def norm_rope_write(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        eps: float, meta: AttentionMetadata, kv: KVPool, index_q: torch.Tensor | None = None,
                        index_k: torch.Tensor | None = None, index_q_norm_w: torch.Tensor | None = None,
                        index_k_norm_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention block's pre-attention step: per-head Gemma norm + partial RoPE (cos/sin [T, R/2]) of q
        [T, Hq, D] and k [T, Hkv, D] (and, on sparse layers, of index_q [T, Hidx, Di] and index_k [T, Di]), then
        `write_kv` of k, v, index_k. Inputs may be strided token rows of one packed projection (heads contiguous).
        Returns (q, index_q) normed and roped, index_q None on dense layers."""

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
               block_sel: torch.Tensor | None, scale: float, block_size: int) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over the paged cache -> [T, Hq, D]; block_sel [Hkv, T, topk] restricts
        each query of KV group g to its selected blocks of `block_size` positions."""

    def select_blocks(self, layer: int, index_q: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
                      block_size: int, topk: int, local_blocks: int) -> torch.Tensor:
        """index_q [T, Hidx, Di] -> int32 [Hidx, T, topk] block ids (valid first, -1 padded)."""


# built-in backends live in `<name>_backend.py` and register themselves on import
BACKENDS: Registry[type[AttentionBackend]] = Registry(
    "attention backend", builtin={"torch": "m3sdk.attention.torch_backend", "triton": "m3sdk.attention.triton_backend"})
register_backend = BACKENDS.register


def get_backend(name: str) -> AttentionBackend:
    """A new backend instance by registered name ("torch", "triton")."""
    return BACKENDS.get(name)()
