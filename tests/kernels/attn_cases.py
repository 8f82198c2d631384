"""Random paged caches and ragged step layouts for the attention kernel tests (small heads, real structure)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3sdk_kernels.layout import PAGE_SIZE, cache_shape
from m3sdk_kernels.reference import write_index_key_ref, write_kv_ref

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn, "fp8nuz": torch.float8_e4m3fnuz}


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor whose every element is NaN (fp8 too), so an element a kernel fails to write shows."""
    return torch.full(shape, float("nan"), device=device).to(dtype)


@dataclass
class Step:
    """One forward step over a paged cache: sequences with `new` tokens each, `ctx` tokens after the step."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    index_cache: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    layout: str

    def to(self, device: torch.device | str) -> Step:
        return Step(*(x if x is None or isinstance(x, str) else x.to(device) for x in (
            self.k_cache, self.v_cache, self.k_scale, self.v_scale, self.index_cache, self.page_table,
            self.cu_seqlens_q, self.context_lens, self.layout)))

    @property
    def kv(self) -> tuple:
        return self.k_cache, self.v_cache, self.page_table, self.cu_seqlens_q, self.context_lens


def make_step(ctx: list[int], new: list[int], kv_heads: int, head_dim: int, kv_dtype: str, layout: str,
              index_dim: int = 32, index_dtype: str = "bf16", seed: int = 0,
              device: torch.device | str = "cpu") -> Step:
    """Random K/V/index keys for every cached token, pages scattered over a pool with spare (NaN) pages, made on
    the CPU (the references write them) and moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-c // PAGE_SIZE) for c in ctx]
    num_pages = sum(pages) + 3
    dtype, idx_dtype = DTYPES[kv_dtype], DTYPES[index_dtype]
    k_cache = poisoned(cache_shape("k", layout, num_pages, kv_heads, head_dim, dtype), dtype)
    v_cache = poisoned(cache_shape("v", layout, num_pages, kv_heads, head_dim, dtype), dtype)
    fp8 = dtype.itemsize == 1
    k_scale = poisoned((num_pages, kv_heads, PAGE_SIZE), torch.float32) if fp8 else None
    v_scale = poisoned((num_pages, kv_heads, PAGE_SIZE), torch.float32) if fp8 else None
    index_cache = poisoned((num_pages, PAGE_SIZE, index_dim), idx_dtype)
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(ctx), max(pages), dtype=torch.int32)  # entries past a sequence's pages: page 0
    at = 0
    for i, (c, p) in enumerate(zip(ctx, pages, strict=True)):
        table[i, :p] = perm[at:at + p].int()
        at += p
        at_page = torch.arange(p * PAGE_SIZE)
        slots = table[i].long()[at_page // PAGE_SIZE] * PAGE_SIZE + at_page % PAGE_SIZE
        # the last page's tail holds a finished sequence's (large) K/V, as a reused page does: kernels may read it
        # with weight 0 (Contract 1 keeps every slot finite); pages of no sequence stay NaN, never to be read
        stale = (torch.randn(len(slots) - c, kv_heads, head_dim, generator=g) * 100).to(torch.bfloat16)
        write_kv_ref(stale, stale, k_cache, v_cache, slots[c:], k_scale, v_scale, layout)
        slots = slots[:c]
        k = torch.randn(c, kv_heads, head_dim, generator=g).to(torch.bfloat16)
        v = torch.randn(c, kv_heads, head_dim, generator=g).to(torch.bfloat16)
        write_kv_ref(k, v, k_cache, v_cache, slots, k_scale, v_scale, layout)
        # index keys as the model makes them: RMS-normalized, so the fp8 direct cast is safe
        ik = torch.nn.functional.normalize(torch.randn(c, index_dim, generator=g), dim=-1) * index_dim**0.5
        write_index_key_ref(ik, index_cache, slots)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    return Step(k_cache, v_cache, k_scale, v_scale, index_cache, table, cu, torch.tensor(ctx, dtype=torch.int32),
                layout).to(device)
