"""Fused MoE: out[t] = sum_j weight[t, j] * expert_{id[t, j]}(x[t]) over a stack of SwiGLU-OAI experts.

An expert is gate_up [2I, H] (gate rows then up rows, not interleaved) and down [H, I]:
    g = min(x @ gate.T, limit);  u = clamp(x @ up.T, -limit, limit)
    expert(x) = ((u + 1) * g * sigmoid(alpha * g)) @ down.T
The shared expert rides along as one more expert of the stack that every token picks with weight 1, and the
routed scaling is folded into the routed weights (`router.route(..., routed_scale, shared=True)`), so one
launch pair serves routed and shared experts.

Two Triton GEMMs:
- gate_up: gate and up tiles of the same weight rows in one program (two accumulators), SwiGLU-OAI in the
  epilogue; the intermediate [pairs, I] is written once (bf16, or fp8 with a scale per 64 columns).
- down: applies the router weight in the epilogue.
Rows are (token, expert) pairs. Decode (few tokens) runs one pair per program with no sort, and the down GEMM
sums a token's pairs in registers. Larger batches sort pairs by expert, padded to BLOCK_M (`moe_align`, one
launch), so every weight tile is read once per BLOCK_M pairs; the down GEMM then writes per-pair rows that are
summed per token.

Weight formats (`Experts.fmt`):
- "bf16"
- "fp8": e4m3 (e4m3fnuz on gfx942) with one float32 scale per output channel; activations are quantized per token
  (gate_up input) and per 64-column group (the intermediate, in the gate_up epilogue): fp8 x fp8 tensor cores.
- "mxfp4": E2M1 two per byte + E8M0 scale per 32 along K; "mxfp8": e4m3fn + E8M0 per 32. Weight-only: the
  activation stays bf16 and the GEMMs are tl.dot_scaled, which the compiler lowers to an in-register upcast on
  Hopper and gfx942 (no FP4 tensor cores) and on gfx950 too while the activation is bf16 (its MX matrix cores
  want MX activations: see docs/kernels.md).
  Where the tile table sets MX_FP8 (sm90), MXFP4 runs through the fp8 tensor cores instead: activations fp8 as
  for "fp8" experts, and each E2M1 nibble becomes an e4m3 byte by integer ops, with its group's scale folded in
  as an exponent offset from a per-row reference (11 octaves below the row's largest scale; the row's power of
  two goes to the epilogue). Exact for groups within those 11 octaves; groups further below flush to zero
  (`mx_fp8_flush`: under 2^-12 of the row's largest block range). No bf16 upcast, no per-element scale multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arch import Arch, current_arch, tiles
from .experts import FMT_CODE, FP8_ACT_GROUP, Experts
from .formats import PLANE_K
from .moe_align import moe_align
from .moe_planes import dot_acc, planes_order, planes_out, planes_step
from .mx_convert import mx_row_ref, mx_row_scale, mx_to_fp8, mxfp4_e4m3_tile, side_stream
from .quant import INTERPRET, bf16_grid, fp8_grid, quantize_fp8_per_token


@triton.jit
def _mxfp4_fp8_dot(acc, a, w_base, s_base, rows, ref, k0, stride_wn, stride_sn, BLOCK_K: tl.constexpr,
                   DOT_F32: tl.constexpr):
    # acc += A[:, k0:k0+BLOCK_K] @ W^T with A fp8 and the MXFP4 weight converted to e4m3 in registers by integer ops
    # (no float upcast, no per-element scale multiply)
    return dot_acc(a, mxfp4_e4m3_tile(w_base, s_base, rows, ref, k0, stride_wn, stride_sn, BLOCK_K), acc, DOT_F32)


@triton.jit
def _dot_step(acc, a, w_base, s_base, rows, ref, k0, stride_wn, stride_sn, W_FMT: tl.constexpr,
              BLOCK_K: tl.constexpr, MX_FP8: tl.constexpr, DOT_F32: tl.constexpr):
    # acc += A[:, k0:k0+BLOCK_K] @ W^T[k0:k0+BLOCK_K, rows] for the weight format W_FMT (0 bf16, 1 fp8,
    # 2 mxfp4, 3 mxfp8). MX goes through tl.dot_scaled: MX matrix cores where the target has them, an in-register
    # upcast to bf16 by the compiler elsewhere (measured 3x faster on Hopper than our own upcast, docs/perf.md);
    # MXFP4 with MX_FP8 (fp8 activations) converts to e4m3 instead (`_mxfp4_fp8_dot`).
    if W_FMT == 2 and MX_FP8:
        acc = _mxfp4_fp8_dot(acc, a, w_base, s_base, rows, ref, k0, stride_wn, stride_sn, BLOCK_K, DOT_F32)
    elif W_FMT >= 2:
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        sc = tl.load(s_base + rows[:, None] * stride_sn + ks[None, :])
        if W_FMT == 2:
            kp = tl.arange(0, BLOCK_K // 2)
            w = tl.load(w_base + rows[None, :] * stride_wn + (k0 // 2 + kp)[:, None])
            acc = tl.dot_scaled(a, None, "bf16", w, sc, "e2m1", acc)
        else:
            w = tl.load(w_base + rows[None, :] * stride_wn + (k0 + tl.arange(0, BLOCK_K))[:, None])
            acc = tl.dot_scaled(a, None, "bf16", w, sc, "e4m3", acc)
    else:
        w = tl.load(w_base + rows[None, :] * stride_wn + (k0 + tl.arange(0, BLOCK_K))[:, None])
        acc = dot_acc(a, w, acc, DOT_F32)
    return acc


@triton.jit
def _acc_init(W_FMT: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if W_FMT == 4 and SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    return acc


@triton.jit
def _row_refs(s_base, rows, K, stride_sn, MX_FP8: tl.constexpr, BLOCK_N: tl.constexpr):
    if MX_FP8:
        ref = mx_row_ref(s_base, rows, K, stride_sn, BLOCK_N)
    else:
        ref = rows
    return ref


@triton.jit
def _channel_scale(s_base, rows, ref, MX_FP8: tl.constexpr):
    # the per-output-channel factor of an fp8-activation GEMM: fp8 weights' scale, or MXFP4's row reference
    if MX_FP8:
        scale = mx_row_scale(ref)
    else:
        scale = tl.load(s_base + rows)
    return scale


@triton.jit
def _pair_rows(pid_m, pairs_ptr, block_expert_ptr, ids_ptr, num_pairs, SORTED: tl.constexpr, BLOCK_M: tl.constexpr):
    # The BLOCK_M pair rows of program pid_m and their expert. Unsorted: row 0 is pair pid_m, the rest padding.
    offs = tl.arange(0, BLOCK_M)
    if SORTED:
        pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + offs)
        valid = pairs < num_pairs
        expert = tl.load(block_expert_ptr + pid_m)
    else:
        valid = offs == 0
        pairs = tl.zeros((BLOCK_M,), tl.int32) + pid_m
        expert = tl.load(ids_ptr + pid_m)
    return tl.where(valid, pairs, 0).to(tl.int64), valid, expert.to(tl.int64)


@triton.jit
def _moe_gate_up_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, r_ptr, h_ptr, h_scale_ptr, pairs_ptr,
                        block_expert_ptr, num_padded_ptr, ids_ptr, num_pairs, I, K, stride_xt, stride_we, stride_wn,
                        stride_se, stride_sn, stride_re, stride_hp, stride_hsp, alpha, limit, TOP_K: tl.constexpr,
                        SORTED: tl.constexpr, W_FMT: tl.constexpr, MX_FP8: tl.constexpr, ACT_FP8: tl.constexpr,
                        SWAP: tl.constexpr, XPERM: tl.constexpr, FUSED_GU: tl.constexpr, H_ROW: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
                        DOT_F32: tl.constexpr, INTERPRET: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if SORTED:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
    pairs, valid, expert = _pair_rows(pid_m, pairs_ptr, block_expert_ptr, ids_ptr, num_pairs, SORTED, BLOCK_M)
    tokens = pairs // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    # offsets inside one expert's matrix fit in int32 (the expert base is the int64 part): 32-bit pointer math
    rows_g = tl.where(n_ok, offs_n, 0)
    rows_u = rows_g + I
    w_base = w_ptr + expert * stride_we
    s_base = w_scale_ptr + expert * stride_se
    x_rows = x_ptr + tokens[:, None] * stride_xt
    if FUSED_GU:
        acc_g, acc_u = _gate_up_fused(x_rows, x_scale_ptr + tokens, valid, w_base, s_base, rows_g, I, K, stride_wn,
                                      stride_sn, W_FMT, MX_FP8, ACT_FP8, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
    else:
        acc_g, acc_u = _gate_up_pair(x_rows, x_scale_ptr + tokens, valid, w_base, s_base, r_ptr + expert * stride_re,
                                     rows_g, rows_u, K, stride_wn, stride_sn, W_FMT, MX_FP8, ACT_FP8, SWAP, XPERM,
                                     BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
    g = tl.minimum(acc_g, limit)
    u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = (u + 1.0) * (g * tl.sigmoid(alpha * g))
    mask = valid[:, None] & n_ok[None, :]
    if W_FMT == 4 and XPERM:  # the down GEMM's planes order (`planes_order`)
        out = h_ptr + pairs[:, None] * stride_hp + (offs_n // 64 * 64 + offs_n % 32 * 2 + offs_n % 64 // 32)[None, :]
    else:
        out = h_ptr + pairs[:, None] * stride_hp + offs_n[None, :]
    if ACT_FP8 and not H_ROW:
        hg = tl.reshape(h, (BLOCK_M, BLOCK_N // 64, 64))
        scale = tl.maximum(tl.max(tl.abs(hg), axis=2), 1e-12) / FP8_MAX
        q = fp8_grid(tl.clamp(hg / scale[:, :, None], -FP8_MAX, FP8_MAX), INTERPRET)
        tl.store(out, tl.reshape(q, (BLOCK_M, BLOCK_N)).to(h_ptr.dtype.element_ty), mask=mask)
        gcol = pid_n * (BLOCK_N // 64) + tl.arange(0, BLOCK_N // 64)
        tl.store(h_scale_ptr + pairs[:, None] * stride_hsp + gcol[None, :], scale,
                 mask=valid[:, None] & (gcol[None, :] * 64 < I))
    else:  # H_ROW: bf16 here, quantized per row by the next launch (the row's amax spans every column block)
        if h_ptr.dtype.element_ty == tl.bfloat16:
            h = bf16_grid(h, INTERPRET)
        tl.store(out, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_up_fused(x_rows, xs_ptrs, valid, w_base, s_base, rows_g, I, K, stride_wn, stride_sn, W_FMT: tl.constexpr,
                   MX_FP8: tl.constexpr, ACT_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    # gate and up rows interleaved (g0 u0 g1 u1 ..) as one 2 x BLOCK_N-wide weight tile: one MMA per step, and the
    # accumulator's neighbouring columns (one thread's registers) split back into gate and up
    rows = tl.reshape(tl.join(rows_g, rows_g + I), (2 * BLOCK_N,))
    ref = _row_refs(s_base, rows, K, stride_sn, MX_FP8, 2 * BLOCK_N)
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=valid[:, None], other=0.0)
        acc = _dot_step(acc, a, w_base, s_base, rows, ref, k0, stride_wn, stride_sn, W_FMT, BLOCK_K, MX_FP8, DOT_F32)
    if ACT_FP8:
        acc = acc * tl.load(xs_ptrs)[:, None] * _channel_scale(s_base, rows, ref, MX_FP8)[None, :]
    return tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))


@triton.jit
def _gate_up_pair(x_rows, xs_ptrs, valid, w_base, s_base, r_base, rows_g, rows_u, K, stride_wn, stride_sn,
                  W_FMT: tl.constexpr, MX_FP8: tl.constexpr, ACT_FP8: tl.constexpr, SWAP: tl.constexpr,
                  XPERM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_F32: tl.constexpr):
    # gate and up tiles of the same columns, two accumulators
    offs_k = tl.arange(0, BLOCK_K)
    ref_g = _row_refs(s_base, rows_g, K, stride_sn, MX_FP8, BLOCK_N)
    ref_u = _row_refs(s_base, rows_u, K, stride_sn, MX_FP8, BLOCK_N)
    acc_g = _acc_init(W_FMT, SWAP, BLOCK_M, BLOCK_N)
    acc_u = _acc_init(W_FMT, SWAP, BLOCK_M, BLOCK_N)
    for k0 in range(0, K, BLOCK_K):
        if W_FMT == 4:
            acc_g = planes_step(acc_g, x_rows, valid, w_base, s_base, rows_g, k0, stride_wn, stride_sn, SWAP,
                                 XPERM, DOT_F32)
            acc_u = planes_step(acc_u, x_rows, valid, w_base, s_base, rows_u, k0, stride_wn, stride_sn, SWAP,
                                 XPERM, DOT_F32)
        else:
            a = tl.load(x_rows + (k0 + offs_k)[None, :], mask=valid[:, None], other=0.0)
            acc_g = _dot_step(acc_g, a, w_base, s_base, rows_g, ref_g, k0, stride_wn, stride_sn, W_FMT, BLOCK_K,
                              MX_FP8, DOT_F32)
            acc_u = _dot_step(acc_u, a, w_base, s_base, rows_u, ref_u, k0, stride_wn, stride_sn, W_FMT, BLOCK_K,
                              MX_FP8, DOT_F32)
    if W_FMT == 4:
        acc_g = planes_out(acc_g, r_base, rows_g, SWAP)
        acc_u = planes_out(acc_u, r_base, rows_u, SWAP)
    if ACT_FP8:
        xs = tl.load(xs_ptrs)
        acc_g = acc_g * xs[:, None] * _channel_scale(s_base, rows_g, ref_g, MX_FP8)[None, :]
        acc_u = acc_u * xs[:, None] * _channel_scale(s_base, rows_u, ref_u, MX_FP8)[None, :]
    return acc_g, acc_u


@triton.jit
def _down_acc(h_ptr, h_scale_ptr, w_base, s_base, r_base, pairs, valid, rows, K, stride_hp, stride_hsp, stride_wn,
              stride_sn, W_FMT: tl.constexpr, MX_FP8: tl.constexpr, ACT_FP8: tl.constexpr, SWAP: tl.constexpr,
              XPERM: tl.constexpr, H_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    ref = _row_refs(s_base, rows, K, stride_sn, MX_FP8, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = _acc_init(W_FMT, SWAP, BLOCK_M, BLOCK_N)
    for k0 in range(0, K, BLOCK_K):
        if W_FMT == 4:
            acc = planes_step(acc, h_ptr + pairs[:, None] * stride_hp, valid, w_base, s_base, rows, k0, stride_wn,
                               stride_sn, SWAP, XPERM, DOT_F32)
        elif ACT_FP8 and not H_ROW:
            a = tl.load(h_ptr + pairs[:, None] * stride_hp + (k0 + offs_k)[None, :], mask=valid[:, None], other=0.0)
            # BLOCK_K <= 64 divides the activation group: one scale per row for this step
            part = _dot_step(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), a, w_base, s_base, rows, ref, k0, stride_wn,
                             stride_sn, W_FMT, BLOCK_K, MX_FP8, DOT_F32)
            hs = tl.load(h_scale_ptr + pairs * stride_hsp + k0 // 64, mask=valid, other=0.0)
            acc += part * hs[:, None]
        else:
            a = tl.load(h_ptr + pairs[:, None] * stride_hp + (k0 + offs_k)[None, :], mask=valid[:, None], other=0.0)
            acc = _dot_step(acc, a, w_base, s_base, rows, ref, k0, stride_wn, stride_sn, W_FMT, BLOCK_K, MX_FP8,
                            DOT_F32)
    if W_FMT == 4:
        acc = planes_out(acc, r_base, rows, SWAP)
    if ACT_FP8:
        if H_ROW:  # one scale per pair row: the MMAs chain across K steps, applied once here
            acc = acc * tl.load(h_scale_ptr + pairs * stride_hsp, mask=valid, other=0.0)[:, None]
        acc = acc * _channel_scale(s_base, rows, ref, MX_FP8)[None, :]
    return acc


@triton.jit
def _moe_down_kernel(h_ptr, h_scale_ptr, w_ptr, w_scale_ptr, r_ptr, out_ptr, topk_w_ptr, pairs_ptr, block_expert_ptr,
                     num_padded_ptr, ids_ptr, num_pairs, N, K, stride_hp, stride_hsp, stride_we, stride_wn, stride_se,
                     stride_sn, stride_re, stride_om, TOP_K: tl.constexpr, SORTED: tl.constexpr, W_FMT: tl.constexpr,
                     MX_FP8: tl.constexpr, ACT_FP8: tl.constexpr, SWAP: tl.constexpr, XPERM: tl.constexpr,
                     FUSED_GU: tl.constexpr, H_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0)
    if SORTED:
        # per-pair rows out[pair, :] = weight * expert(x)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        pairs, valid, expert = _pair_rows(pid_m, pairs_ptr, block_expert_ptr, ids_ptr, num_pairs, True, BLOCK_M)
        acc = _down_acc(h_ptr, h_scale_ptr, w_ptr + expert * stride_we, w_scale_ptr + expert * stride_se,
                        r_ptr + expert * stride_re, pairs, valid, rows, K, stride_hp, stride_hsp, stride_wn,
                        stride_sn, W_FMT, MX_FP8, ACT_FP8, SWAP, XPERM, H_ROW, BLOCK_M, BLOCK_N, BLOCK_K,
                            DOT_F32)
        acc = acc * tl.load(topk_w_ptr + pairs, mask=valid, other=0.0)[:, None]
        tl.store(out_ptr + pairs[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & n_ok[None, :])
    else:
        # program = (token, column block): the token's pairs summed in registers, out[token, :] written once
        total = tl.zeros((BLOCK_N,), tl.float32)
        for j in range(TOP_K):
            pair = pid_m * TOP_K + j
            pairs, valid, expert = _pair_rows(pair, pairs_ptr, block_expert_ptr, ids_ptr, num_pairs, False,
                                              BLOCK_M)
            acc = _down_acc(h_ptr, h_scale_ptr, w_ptr + expert * stride_we, w_scale_ptr + expert * stride_se,
                            r_ptr + expert * stride_re, pairs, valid, rows, K, stride_hp, stride_hsp, stride_wn,
                            stride_sn, W_FMT, MX_FP8, ACT_FP8, SWAP, XPERM, H_ROW, BLOCK_M, BLOCK_N, BLOCK_K,
                            DOT_F32)
            total += tl.sum(tl.where(valid[:, None], acc, 0.0), axis=0) * tl.load(topk_w_ptr + pair)
        tl.store(out_ptr + pid_m * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def moe_tiles(num_tokens: int, arch: Arch, variant: str | None = None) -> tuple[dict, bool]:
    """(tile dict, sorted?) for a batch of `num_tokens` tokens on `arch` (`variant` "planes": MXFP4 in the planes
    layout, the tables' "family:planes" entries)."""
    decode = tiles("moe_decode", arch, variant)
    if num_tokens <= decode["MAX_TOKENS"]:
        return decode, False
    small = tiles("moe_small", arch, variant)
    return (small if num_tokens <= small["MAX_TOKENS"] else tiles("moe_prefill", arch, variant)), True


def _weight_args(w: torch.Tensor, s: torch.Tensor | None, r: torch.Tensor | None) -> tuple:
    # (weight, scale, row scale, stride_we, stride_wn, stride_se, stride_sn, stride_re); bf16 has no scales and
    # only planes have row scales: the weight / scale stands in
    if s is None:
        return w, w, w, w.stride(0), w.stride(1), 0, 0, 0
    r = s if r is None else r
    return w, s, r, w.stride(0), w.stride(1), s.stride(0), s.stride(1) if s.dim() == 3 else 0, r.stride(0)


def mx_fp8(fmt: str, num_tokens: int, arch: Arch, planes: bool = False) -> bool:
    """Whether `fused_moe` runs `fmt` experts (`planes`: in the planes layout) for `num_tokens` tokens through the
    fp8 tensor cores (MXFP4 converted to e4m3 in registers or, MX_CONVERT, once per step; activations fp8): the
    tile table's MX_FP8 (not on gfx950, whose matrix cores take MX, nor on gfx942, whose fp8 is e4m3fnuz). Planes
    take the fp8 path only converted once; else their own fp16 GEMMs."""
    if fmt != "mxfp4" or not moe_tiles(num_tokens, arch)[0].get("MX_FP8", 0):
        return False
    return not planes or bool(moe_tiles(num_tokens, arch, "fp8")[0].get("MX_CONVERT", 0))


def h_row(fmt: str, num_tokens: int, arch: Arch, planes: bool = False) -> bool:
    """Whether `fused_moe` quantizes the fp8 intermediate per row (the tile table's H_ROW; `fused_moe_ref`'s h_row)
    for `fmt` experts (`planes`: in the planes layout) and `num_tokens` tokens."""
    cfg = moe_tiles(num_tokens, arch, "fp8")[0]
    return (fmt == "fp8" or mx_fp8(fmt, num_tokens, arch, planes)) and bool(cfg.get("H_ROW", 0))


def moe_plan(num_tokens: int, fmt: str, planes: bool, hidden: int, inter: int, arch: Arch) -> dict:
    """How `fused_moe` runs `num_tokens` tokens of `fmt` experts (`planes`: MXFP4 in the planes layout) of widths
    hidden / inter on `arch`: tiles, sorted or not, the fp8 paths, K tiles, and `unsupported` (why these widths
    cannot be tiled, or None). A function of shapes only, so `moe_unsupported` can ask it at build time."""
    cfg, sort = moe_tiles(num_tokens, arch, "planes" if planes else "bf16" if fmt == "bf16" else None)
    use_mx_fp8 = mx_fp8(fmt, num_tokens, arch, planes)
    if fmt == "fp8" or use_mx_fp8:  # fp8 activations: the tables' "family:fp8" entries
        cfg, sort = moe_tiles(num_tokens, arch, "fp8")
    convert = bool(use_mx_fp8 and cfg.get("MX_CONVERT", 0))
    if convert:  # the stack converted to fp8 experts first
        fmt, use_mx_fp8, planes = "fp8", False, False
    act_fp8 = fmt == "fp8" or use_mx_fp8
    row_q = act_fp8 and bool(cfg.get("H_ROW", 0))
    # K tiles: the table's, or the largest power of two dividing K when K is smaller (small models); planes step
    # through their 256-element tiles
    gu_bk = PLANE_K if planes else min(cfg["GU_BLOCK_K"], hidden & -hidden)
    dn_bk = PLANE_K if planes else min(cfg["DN_BLOCK_K"], inter & -inter,
                                       FP8_ACT_GROUP if act_fp8 and not row_q else inter)
    # MXFP4 as fp8: K tiles of 64 and up, the sizes compiled and measured on sm90 (the conversion is one dot)
    min_bk = 64 if use_mx_fp8 else 32 if fmt != "bf16" else 16
    unsupported = None
    if act_fp8 and inter % FP8_ACT_GROUP:
        unsupported = f"moe_intermediate_size {inter} is not a multiple of {FP8_ACT_GROUP} (fp8 activation groups)"
    elif gu_bk < min_bk:
        unsupported = f"hidden_size {hidden} is not a multiple of {min_bk} (the {fmt} expert GEMMs' K tile)"
    elif dn_bk < min_bk:
        unsupported = f"moe_intermediate_size {inter} is not a multiple of {min_bk} (the {fmt} expert GEMMs' K tile)"
    return {"cfg": cfg, "sort": sort, "mx_fp8": use_mx_fp8, "convert": convert, "act_fp8": act_fp8, "row_q": row_q,
            "gu_bk": gu_bk, "dn_bk": dn_bk, "unsupported": unsupported}


def moe_unsupported(hidden: int, inter: int, fmt: str = "bf16", planes: bool = False,
                    arch: Arch | None = None) -> str | None:
    """Why `fused_moe` cannot serve experts of these widths in `fmt` at some batch size on `arch` (default: the
    current device's), or None: asked once when a model is built, which then takes the torch path for its MoE."""
    arch = arch or current_arch()
    decode, small = tiles("moe_decode", arch), tiles("moe_small", arch)
    for t in (1, decode["MAX_TOKENS"] + 1, small["MAX_TOKENS"] + 1):  # decode, small-batch and prefill tiles
        why = moe_plan(t, fmt, planes, hidden, inter, arch)["unsupported"]
        if why:
            return why
    return None


def fused_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Experts,
              alpha: float, limit: float) -> torch.Tensor:
    """Triton version of `fused_moe_ref` (hidden [T, H] bf16, contiguous experts), of its `mx_fp8` mode where
    `mx_fp8(fmt, T, arch)` says so."""
    t, k = topk_ids.shape
    n_pairs = t * k
    hdim, inter, fmt = experts.hidden, experts.inter, experts.fmt
    dev = hidden.device
    out = torch.empty((t, hdim), dtype=hidden.dtype, device=dev)
    if t == 0:
        return out
    arch = current_arch(dev)
    planes = experts.planes
    plan = moe_plan(t, fmt, planes, hdim, inter, arch)
    if plan["unsupported"]:
        raise ValueError(plan["unsupported"])
    cfg, sort, use_mx_fp8, act_fp8, row_q = (plan[key] for key in ("cfg", "sort", "mx_fp8", "act_fp8", "row_q"))
    gu_bk, dn_bk = plan["gu_bk"], plan["dn_bk"]
    side = None  # MX_CONVERT 2: the down weights convert on a side stream while the gate_up GEMM runs
    if plan["convert"]:  # the whole stack to fp8 once, then the fp8 experts' path
        side = side_stream(dev) if cfg["MX_CONVERT"] == 2 and dev.type == "cuda" else None
        experts, fmt, planes = mx_to_fp8(experts, side), "fp8", False
    ids = topk_ids.reshape(-1).to(torch.int32)
    weights = topk_weights.reshape(-1).to(torch.float32)
    if act_fp8:
        fp8 = experts.gate_up.dtype if fmt == "fp8" else arch.fp8_dtype
        x, x_scale = quantize_fp8_per_token(hidden, fp8)
        # H_ROW: the gate_up writes bf16, quantized per row below; else fp8 with a scale per 64 columns
        h = torch.empty((n_pairs, inter), dtype=hidden.dtype if row_q else fp8, device=dev)
        h_scale = torch.empty((n_pairs, inter // FP8_ACT_GROUP), dtype=torch.float32, device=dev)
    else:
        x, x_scale = hidden, hidden
        if planes and cfg.get("PLANES_XPERM", 0):
            x = planes_order(hidden)
            x_scale = x
        # planes: fp16 activations for fp16 dots (the SwiGLU-OAI output is within +-8 x limit)
        h = torch.empty((n_pairs, inter), dtype=torch.float16 if planes else hidden.dtype, device=dev)
        h_scale = h
    block_m = cfg["BLOCK_M"]
    if sort:
        pairs, block_expert, num_padded = moe_align(ids, experts.num_experts, block_m)
        m_blocks = block_expert.numel()
    else:
        pairs = block_expert = num_padded = ids
        m_blocks = n_pairs
    common = dict(TOP_K=k, SORTED=sort, W_FMT=experts.w_fmt, MX_FP8=use_mx_fp8, ACT_FP8=act_fp8,
                  SWAP=bool(cfg.get("PLANES_SWAP", 0)), XPERM=planes and bool(cfg.get("PLANES_XPERM", 0)),
                  FUSED_GU=bool(cfg.get("FUSED_GU", 0)) and not planes,
                  H_ROW=row_q, BLOCK_M=block_m, DOT_F32=INTERPRET, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    fp8_max = torch.finfo(fp8).max if act_fp8 else 0.0

    w, s, r, swe, swn, sse, ssn, sre = _weight_args(experts.gate_up, experts.gate_up_scale, experts.gate_up_row)
    _moe_gate_up_kernel[(m_blocks, triton.cdiv(inter, cfg["GU_BLOCK_N"]))](
        x, x_scale, w, s, r, h, h_scale, pairs, block_expert, num_padded, ids, n_pairs, inter, hdim, x.stride(0),
        swe, swn, sse, ssn, sre, h.stride(0), h_scale.stride(0), alpha, limit, BLOCK_N=cfg["GU_BLOCK_N"],
        BLOCK_K=gu_bk, FP8_MAX=fp8_max, INTERPRET=INTERPRET, **common)
    if row_q:
        h, h_scale = quantize_fp8_per_token(h, fp8)
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)

    w, s, r, swe, swn, sse, ssn, sre = _weight_args(experts.down, experts.down_scale, experts.down_row)
    y = torch.empty((n_pairs, hdim), dtype=hidden.dtype, device=dev) if sort else out
    _moe_down_kernel[(m_blocks if sort else t, triton.cdiv(hdim, cfg["DN_BLOCK_N"]))](
        h, h_scale, w, s, r, y, weights, pairs, block_expert, num_padded, ids, n_pairs, hdim, inter, h.stride(0),
        h_scale.stride(0), swe, swn, sse, ssn, sre, y.stride(0), BLOCK_N=cfg["DN_BLOCK_N"], BLOCK_K=dn_bk,
        **common)
    if sort:
        torch.sum(y.view(t, k, hdim), dim=1, out=out)
    return out


# ---------------------------------------------------------------------------------------------------------
# Ahead-of-time variants: the released model's shapes (H 6144, I 3072, top-4 + shared), every weight format


def aot_variants(arch: Arch) -> list:
    from .aot import AotVariant

    fp8 = f"*{arch.fp8_triton}"
    out = []
    w_types = {"bf16": ("*bf16", "*bf16"), "fp8": (fp8, "*fp32"), "mxfp4": ("*u8", "*u8"), "mxfp8": ("*fp8e4nv", "*u8")}
    if arch.name == "sm90":  # MXFP4 in the planes layout (Hopper's decode layout)
        w_types["mxfp4_planes"] = ("*i32", "*u8")
    codes = {**FMT_CODE, "mxfp4_planes": 4}
    for family, sort in (("moe_decode", False), ("moe_small", True), ("moe_prefill", True)):
        for fmt, (wt, st) in w_types.items():
            planes = fmt == "mxfp4_planes"
            mxf = fmt == "mxfp4" and bool(tiles(family, arch).get("MX_FP8", 0))
            cfg = tiles(family, arch, "planes" if planes else "fp8" if fmt == "fp8" or mxf else
                        "bf16" if fmt == "bf16" else None)
            act = fp8 if fmt == "fp8" or mxf else "*fp16" if planes else "*bf16"
            row_q = act == fp8 and bool(cfg.get("H_ROW", 0))
            common = {"TOP_K": 5, "SORTED": sort, "W_FMT": codes[fmt], "MX_FP8": mxf, "ACT_FP8": act == fp8,
                      "SWAP": bool(cfg.get("PLANES_SWAP", 0)), "XPERM": planes and bool(cfg.get("PLANES_XPERM", 0)),
                      "FUSED_GU": bool(cfg.get("FUSED_GU", 0)) and not planes,
                      "H_ROW": row_q, "BLOCK_M": cfg["BLOCK_M"], "DOT_F32": False}
            ptrs = {"pairs_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "ids_ptr": "*i32"}
            strides = {"stride_we": "i64", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32"}
            out.append(AotVariant(
                f"{family}_gate_up_{fmt}", _moe_gate_up_kernel,
                {"x_ptr": ("*fp16" if common["XPERM"] else "*bf16") if planes else act, "x_scale_ptr": "*fp32",
                 "w_ptr": wt, "w_scale_ptr": st,
                 "r_ptr": "*fp32", "h_ptr": "*bf16" if row_q else act, "h_scale_ptr": "*fp32", **ptrs,
                 "num_pairs": "i32", "I": "i32", "K": "i32", "stride_xt": "i32", **strides, "stride_re": "i32",
                 "stride_hp": "i32", "stride_hsp": "i32", "alpha": "fp32", "limit": "fp32"},
                {**common, "BLOCK_N": cfg["GU_BLOCK_N"], "BLOCK_K": PLANE_K if planes else cfg["GU_BLOCK_K"],
                 "FP8_MAX": arch.fp8_max, "INTERPRET": False},
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                aligned=("I", "K", "stride_xt", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_re",
                         "stride_hp", "stride_hsp")))
            dn_bk = PLANE_K if planes else cfg["DN_BLOCK_K"] if act != fp8 or row_q else min(cfg["DN_BLOCK_K"], 64)
            out.append(AotVariant(
                f"{family}_down_{fmt}", _moe_down_kernel,
                {"h_ptr": act, "h_scale_ptr": "*fp32", "w_ptr": wt, "w_scale_ptr": st, "r_ptr": "*fp32",
                 "out_ptr": "*bf16", "topk_w_ptr": "*fp32", **ptrs, "num_pairs": "i32", "N": "i32", "K": "i32",
                 "stride_hp": "i32", "stride_hsp": "i32", **strides, "stride_re": "i32", "stride_om": "i32"},
                {**common, "BLOCK_N": cfg["DN_BLOCK_N"], "BLOCK_K": dn_bk},
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                aligned=("N", "K", "stride_hp", "stride_hsp", "stride_we", "stride_wn", "stride_se", "stride_sn",
                         "stride_re", "stride_om")))
    return out
