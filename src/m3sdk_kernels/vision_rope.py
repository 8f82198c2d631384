"""The vision tower's q/k/v split + RoPE in one pass: the packed projection qkv [P, 3 * H * D] (q | k | v, each
head-major) -> one buffer [3, P, H, D] with q and k rotated and v copied.

    y[d] = x[d] * cos[d] - x[d + R/2] * sin[d]     d <  R/2
    y[d] = x[d] * cos[d] + x[d - R/2] * sin[d]     R/2 <= d < R
    y[d] = x[d]                                    d >= R (and every d of v)

in fp32, rounded once to qkv's dtype (`vision_qkv_rope_ref` in reference.py). Why [3, P, H, D]: q[i] is then a
[P, H, D] block, and its [1, H, P, D] transposed view is what SDPA takes with no copy (its flash,
memory-efficient and cuDNN kernels read any token / head strides with a unit last stride); their output comes back
laid out as [P, H, D] (cuDNN allocates it in q's layout, flash and memory-efficient always do), so flattening it to
[P, H * D] for out_proj is a view too. A [3, H, P, D] buffer would make that output [H, P, D] and cost a transpose
copy before out_proj.

One program per (BLOCK_P rows, BLOCK_C columns) of the flat [P, 3 * H * D] input: a column's part (q / k / v),
head and channel come from its index, so head widths that are no power of two (M3: 80, rotated width 78) waste no
lanes; the rotation partner and cos / sin are gathers of lines the program reads anyway (L1 / L2 hits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arch import Arch, current_arch, tiles


@triton.jit
def _vision_qkv_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, P, stride_qkv, stride_cos, stride_sin,
                            H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_P: tl.constexpr,
                            BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < P
    rows64 = rows.to(tl.int64)
    part = cols // (H * D)  # 0 q, 1 k, 2 v
    within = cols % (H * D)  # head * D + channel
    d = within % D
    rotated = (part < 2) & (d < R)
    first_half = d < R // 2
    partner = tl.where(first_half, cols + R // 2, cols - R // 2)
    mask = row_ok[:, None] & (cols < 3 * H * D)[None, :]
    rmask = row_ok[:, None] & rotated[None, :]
    src = qkv_ptr + rows64[:, None] * stride_qkv
    x = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + partner[None, :], mask=rmask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + rows64[:, None] * stride_cos + d[None, :], mask=rmask, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + rows64[:, None] * stride_sin + d[None, :], mask=rmask, other=0.0).to(tl.float32)
    y = x * c + tl.where(first_half[None, :], -x2, x2) * s
    dst = out_ptr + part.to(tl.int64)[None, :] * P * (H * D) + rows64[:, None] * (H * D) + within[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=mask)


def vision_qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                    head_dim: int) -> torch.Tensor:
    """Triton version of `vision_qkv_rope_ref`: qkv [P, 3 * heads * head_dim] (unit column stride), cos / sin
    [P, R] (unit last stride, any float dtype) -> [3, P, heads, head_dim] in qkv's dtype."""
    p, width = qkv.shape
    rot = cos.shape[-1]
    if width != 3 * heads * head_dim or rot % 2 or rot > head_dim or sin.shape != cos.shape or cos.shape[0] != p:
        raise ValueError(f"vision_qkv_rope: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)} "
                         f"do not fit {heads} heads of {head_dim}")
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("vision_qkv_rope: qkv, cos and sin need a unit last stride")
    out = torch.empty((3, p, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if p:
        cfg = tiles("vision_rope", current_arch(qkv.device))
        grid = (triton.cdiv(p, cfg["BLOCK_P"]), triton.cdiv(width, cfg["BLOCK_C"]))
        _vision_qkv_rope_kernel[grid](qkv, cos, sin, out, p, qkv.stride(0), cos.stride(0), sin.stride(0),
                                      H=heads, D=head_dim, R=rot, BLOCK_P=cfg["BLOCK_P"], BLOCK_C=cfg["BLOCK_C"],
                                      num_warps=cfg["num_warps"])
    return out


def aot_variants(arch: Arch) -> list:
    from .aot import AotVariant

    t = tiles("vision_rope", arch)
    out = []
    for dtype in ("bf16", "fp32"):  # the tower's dtypes; cos / sin stay fp32
        out.append(AotVariant(
            f"vision_rope.qkv_{dtype}", _vision_qkv_rope_kernel,
            {"qkv_ptr": f"*{dtype}", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": f"*{dtype}", "P": "i32",
             "stride_qkv": "i32", "stride_cos": "i32", "stride_sin": "i32"},
            # MiniMax-M3's tower: 16 heads of 80, the first 78 channels rotated
            {"H": 16, "D": 80, "R": 78, "BLOCK_P": t["BLOCK_P"], "BLOCK_C": t["BLOCK_C"]},
            num_warps=t["num_warps"], num_stages=1, aligned=("stride_qkv",)))
    return out
