"""Paged KV-cache layouts: where a token's K/V/index key lives, and the plain gather the references share.

Pages hold 16 token slots; slot = page * 16 + offset. Two K/V layouts:
  plain:   K, V  [pages, kv_heads, 16, head_dim]
  shuffle: K     [pages, kv_heads, head_dim // x, 16, x]
           V     [pages, kv_heads, 16 // x, head_dim, x]      x = 16 bytes / element size
The SHUFFLE layout (AMD's AITER kernels) makes each 16-byte load land in the matrix unit's operand layout.
FP8 caches carry per-token, per-head float32 scales [pages, kv_heads, 16]. Index keys: [pages, 16, index_dim].
"""

import torch
import triton
import triton.language as tl

PAGE_SIZE = 16
PAGE: tl.constexpr = tl.constexpr(PAGE_SIZE)  # the same, for use inside kernels
LAYOUTS = ("plain", "shuffle")


def dim_tile(dim: int) -> int:
    """The register extent of a head / index vector of `dim` elements: the next power of two (tl.arange's rule),
    at least 16 (tl.dot's smallest K). Kernels mask the lanes past `dim`."""
    return max(16, triton.next_power_of_2(dim))


def shuffle_width(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector: the `x` of the SHUFFLE layout."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def cache_shape(kind: str, layout: str, num_pages: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[int, ...]:
    """Shape of one layer's K (`kind="k"`) or V (`kind="v"`) page pool."""
    if layout == "plain":
        return (num_pages, num_kv_heads, PAGE_SIZE, head_dim)
    if layout != "shuffle":
        raise ValueError(f"unknown KV layout {layout!r}; expected one of {LAYOUTS}")
    x = shuffle_width(dtype)
    if head_dim % x:
        raise ValueError(f"the shuffle KV layout stores head_dim in {x}-element vectors; head_dim {head_dim} is not a "
                         f"multiple of {x} (use the plain layout)")
    if kind == "k":
        return (num_pages, num_kv_heads, head_dim // x, PAGE_SIZE, x)
    return (num_pages, num_kv_heads, PAGE_SIZE // x, head_dim, x)


@triton.jit
def slot_offsets(off, d, HEAD_DIM: tl.constexpr, X: tl.constexpr, SHUFFLE: tl.constexpr, IS_V: tl.constexpr):
    """Element offset of (token `off` in its page, dim `d`) inside one (page, kv head) chunk of 16 * HEAD_DIM
    elements; `off` and `d` broadcast against each other, so one call addresses a whole tile."""
    if SHUFFLE:
        if IS_V:  # [16 // X, HEAD_DIM, X]
            return (off // X) * (HEAD_DIM * X) + d * X + off % X
        return (d // X) * (PAGE * X) + off * X + d % X  # K: [HEAD_DIM // X, 16, X]
    return off * HEAD_DIM + d


@triton.jit
def _gather_kernel(cache_ptr, scale_ptr, pages_ptr, out_ptr, length, stride_cp, stride_ch, stride_sp, stride_sh,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, X: tl.constexpr, SHUFFLE: tl.constexpr,
                   IS_V: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    h = tl.program_id(0)
    tok = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D_PAD)
    ok = tok < length
    tile_ok = ok[:, None] & (d < HEAD_DIM)[None, :]
    page = tl.load(pages_ptr + tok // PAGE, mask=ok, other=0).to(tl.int64)
    off = tok % PAGE
    ptr = cache_ptr + page[:, None] * stride_cp + h * stride_ch
    x = tl.load(ptr + slot_offsets(off[:, None], d[None, :], HEAD_DIM, X, SHUFFLE, IS_V), mask=tile_ok)
    x = x.to(tl.float32)
    if HAS_SCALE:
        x *= tl.load(scale_ptr + page * stride_sp + h * stride_sh + off, mask=ok)[:, None]
    tl.store(out_ptr + (h * length + tok[:, None]) * HEAD_DIM + d[None, :], x, mask=tile_ok)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, length: int,
              layout: str = "plain", k_scale: torch.Tensor | None = None,
              v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `gather_kv_ref`: a sequence's K and V as float32 [kv_heads, length, head_dim]."""
    heads = k_cache.shape[1]
    head_dim = k_cache.shape[2] * k_cache.shape[4] if layout == "shuffle" else k_cache.shape[3]
    out = []
    for cache, scale, is_v in ((k_cache, k_scale, False), (v_cache, v_scale, True)):
        o = torch.empty(heads, length, head_dim, dtype=torch.float32, device=cache.device)
        block = 64
        s = scale if scale is not None else o  # never read without HAS_SCALE
        _gather_kernel[(heads, triton.cdiv(length, block))](
            cache, s, pages, o, length, cache.stride(0), cache.stride(1), s.stride(0), s.stride(1),
            HEAD_DIM=head_dim, D_PAD=dim_tile(head_dim), X=shuffle_width(cache.dtype), SHUFFLE=layout == "shuffle",
            IS_V=is_v,
            HAS_SCALE=scale is not None, BLOCK=block)
        out.append(o)
    return out[0], out[1]
