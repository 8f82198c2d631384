"""Contract 1: the paged KV cache tensors (K, V, FP8 scales, and the index keys of the sparse layers).

A page is 16 token slots in every layer at once: slot = page * 16 + offset addresses the token's K/V in each
layer and its index key in each sparse layer. Who owns which page is the cache manager's business, not this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from m3sdk_kernels.layout import LAYOUTS, PAGE_SIZE, cache_shape

if TYPE_CHECKING:
    from m3sdk.model.config import ModelConfig

_PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class KVCacheSpec:
    num_pages: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sparse_layers: tuple[int, ...]
    index_head_dim: int
    kv_dtype: str = "bf16"  # "bf16" | "fp8" | "fp32"
    layout: str = "plain"  # "plain" | "shuffle"
    index_dtype: str = "bf16"  # "bf16" | "fp8" | "fp32"
    fp8_dtype: torch.dtype = torch.float8_e4m3fn  # float8_e4m3fnuz on gfx942
    model_dtype: torch.dtype = torch.bfloat16
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        for name in ("kv_dtype", "index_dtype"):
            if getattr(self, name) not in ("bf16", "fp8", "fp32"):
                raise ValueError(f"{name} must be 'bf16', 'fp8' or 'fp32', not {getattr(self, name)!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {self.layout!r}")
        if self.layout == "shuffle":
            x = 16 // self._size(self.kv_dtype)
            if self.head_dim % x:
                raise ValueError(f"shuffle layout needs head_dim divisible by {x}, got {self.head_dim}")
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")

    @classmethod
    def for_model(cls, config: ModelConfig, num_pages: int, **kwargs) -> KVCacheSpec:
        """The spec of `config`'s caches; kwargs set dtypes, layout and device."""
        return cls(num_pages=num_pages, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, sparse_layers=tuple(config.sparse_layers),
                   index_head_dim=config.index_head_dim, **kwargs)

    def torch_dtype(self, which: str) -> torch.dtype:
        """Storage dtype for a kv_dtype/index_dtype name."""
        return self.fp8_dtype if which == "fp8" else _PLAIN_DTYPES[which]

    def _size(self, which: str) -> int:
        return torch.empty((), dtype=self.torch_dtype(which)).element_size()

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page costs over all layers: K and V, FP8 scales, and the index keys of sparse layers."""
        kv = 2 * self.num_kv_heads * PAGE_SIZE * self.head_dim * self._size(self.kv_dtype)
        scales = 2 * self.num_kv_heads * PAGE_SIZE * 4 if self.kv_dtype == "fp8" else 0
        index = PAGE_SIZE * self.index_head_dim * self._size(self.index_dtype)
        return self.num_layers * (kv + scales) + len(self.sparse_layers) * index


class KVPool:
    """Per-layer page pools. `k_scale`/`v_scale` entries are None unless FP8; `index_k` is None on dense layers."""

    def __init__(self, spec: KVCacheSpec):
        self.spec = spec
        kv_dtype = spec.torch_dtype(spec.kv_dtype)
        fp8 = spec.kv_dtype == "fp8"
        sparse = set(spec.sparse_layers)
        # zero-filled: a never-written slot must not hold NaN bit patterns that a masked read could multiply
        self.k = [self._zeros(cache_shape("k", spec.layout, spec.num_pages, spec.num_kv_heads, spec.head_dim,
                                          kv_dtype), kv_dtype) for _ in range(spec.num_layers)]
        self.v = [self._zeros(cache_shape("v", spec.layout, spec.num_pages, spec.num_kv_heads, spec.head_dim,
                                          kv_dtype), kv_dtype) for _ in range(spec.num_layers)]
        scale_shape = (spec.num_pages, spec.num_kv_heads, PAGE_SIZE)
        self.k_scale = [self._zeros(scale_shape, torch.float32) if fp8 else None for _ in range(spec.num_layers)]
        self.v_scale = [self._zeros(scale_shape, torch.float32) if fp8 else None for _ in range(spec.num_layers)]
        index_dtype = spec.torch_dtype(spec.index_dtype)
        self.index_k = [self._zeros((spec.num_pages, PAGE_SIZE, spec.index_head_dim), index_dtype)
                        if layer in sparse else None for layer in range(spec.num_layers)]

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.spec.device)

    @property
    def num_pages(self) -> int:
        return self.spec.num_pages
