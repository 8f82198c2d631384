"""Fused residual add + Gemma RMSNorm, optionally quantizing its output to FP8 per token for the next GEMM.

    h = x + residual            (rounded to x's dtype: it is the new residual stream)
    y = h / rms(h) * (1 + w)    (fp32; Gemma's weight is an offset from 1)
    y -> x's dtype, or -> fp8 with one float32 scale per row (amax / fp8_max) when `fp8_dtype` is given

One pass over the row: the FP8 projections that follow the norm (q/k/v/index, the dense and shared-expert
gate_up) then read one byte per activation and need no separate quantization launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arch import Arch, current_arch, pdl_launch, tiles
from .quant import INTERPRET, fp8_grid


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, h_ptr, H, stride_x, stride_r, stride_y, stride_h, eps,
                         HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr, FP8_MAX: tl.constexpr,
                         BLOCK_H: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr):
    if PDL:  # launched as a programmatic dependent (CUDA): the FP8 GEMM after it may launch at once (and prefetch
        # its weights); nothing is read before the previous kernel is done
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = hf * inv * (1.0 + w)
    if FP8_OUT:
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / FP8_MAX
        q = fp8_grid(tl.clamp(y / scale, -FP8_MAX, FP8_MAX), INTERPRET)
        tl.store(y_ptr + row * stride_y + cols, q.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)
    else:
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 fp8_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Triton version of `add_rms_norm_ref` (rows with unit last stride)."""
    t, hdim = x.shape
    y = torch.empty((t, hdim), dtype=fp8_dtype or x.dtype, device=x.device)
    scale = torch.empty((t,), dtype=torch.float32, device=x.device) if fp8_dtype is not None else None
    h = torch.empty_like(x) if residual is not None else x
    if t:
        r = residual if residual is not None else x
        cfg = tiles("rms_norm", current_arch(x.device))
        # PDL (the table's, sm90) where the output is fp8: it feeds an FP8 GEMM, which launches so too
        launch = pdl_launch(cfg.get("PDL", 0) and fp8_dtype is not None, x)
        _add_rms_norm_kernel[(t,)](
            x, r, weight, y, scale if scale is not None else y, h, hdim, x.stride(0), r.stride(0), y.stride(0),
            h.stride(0), eps, HAS_RESIDUAL=residual is not None, FP8_OUT=fp8_dtype is not None,
            FP8_MAX=torch.finfo(fp8_dtype).max if fp8_dtype is not None else 0.0,
            BLOCK_H=triton.next_power_of_2(hdim), PDL=bool(launch), INTERPRET=INTERPRET,
            num_warps=cfg["num_warps"], **launch)
    return y, scale, h


def aot_variants(arch: Arch) -> list:
    from .aot import AotVariant

    t = tiles("rms_norm", arch)
    types = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*fp32", "h_ptr": "*bf16", "H": "i32",
             "stride_x": "i32", "stride_r": "i32", "stride_y": "i32", "stride_h": "i32", "eps": "fp32"}
    out = []
    for fp8 in (False, True):
        out.append(AotVariant(
            f"add_rms_norm{'_fp8' if fp8 else ''}", _add_rms_norm_kernel,
            {**types, "y_ptr": f"*{arch.fp8_triton}" if fp8 else "*bf16"},
            {"HAS_RESIDUAL": True, "FP8_OUT": fp8, "FP8_MAX": arch.fp8_max if fp8 else 0.0, "BLOCK_H": 8192,
             "PDL": fp8 and bool(t.get("PDL", 0)), "INTERPRET": False},
            num_warps=t["num_warps"], num_stages=1, aligned=("H", "stride_x", "stride_r", "stride_y", "stride_h")))
    return out
