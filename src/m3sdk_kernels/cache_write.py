"""Cache writes: store each new token's K, V (optionally FP8 with per-token, per-head scales) and index key."""

import torch

from .layout import PAGE_SIZE, store_tokens_ref


def quantize_fp8_ref(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) symmetric FP8: returns (x / scale as fp8, scale as float32 without the last dim)."""
    fp8_max = torch.finfo(fp8_dtype).max
    amax = x.float().abs().amax(dim=-1)
    # A floor keeps an all-zero row finite; its stored values are 0 whatever the scale.
    scale = amax.clamp(min=1e-12) / fp8_max
    q = (x.float() / scale[..., None]).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return q, scale


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, layout: str = "plain") -> None:
    """Store k, v [T, kv_heads, head_dim] at `slot_mapping` [T]. FP8 caches need both scale tensors."""
    slots = slot_mapping.long()
    for x, cache, scale, kind in ((k, k_cache, k_scale, "k"), (v, v_cache, v_scale, "v")):
        if scale is not None:
            x, s = quantize_fp8_ref(x, cache.dtype)
            scale[slots // PAGE_SIZE, :, slots % PAGE_SIZE] = s
        store_tokens_ref(cache, x.to(cache.dtype), slots, kind, layout)


def write_index_key_ref(index_k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store index keys [T, index_dim]; FP8 is a direct cast (unit scale: the key is RMS-normalized)."""
    slots = slot_mapping.long()
    index_cache[slots // PAGE_SIZE, slots % PAGE_SIZE] = index_k.to(index_cache.dtype)
