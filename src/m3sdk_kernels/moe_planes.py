"""MXFP4 in the planes layout (`formats.mxfp4_planes`, Hopper decode): one GEMM step of 256 K elements as four
fp16 K = 64 dots, the weights converted by shifts and masks and scaled by fp16x2 multipliers per scale group."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import PLANE_K


@triton.jit
def dot_acc(a, w, acc, DOT_F32: tl.constexpr):
    if DOT_F32:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(a, w, acc)


@triton.jit
def _halves_f16(x):
    # int32 [R, C] -> fp16 [R, 2C]: column 2c + h is half h of x[:, c] (no data movement: a register's halves)
    lo = x.to(tl.uint16)
    hi = (x >> 16).to(tl.uint16)
    return tl.reshape(tl.join(lo, hi), (x.shape[0], 2 * x.shape[1])).to(tl.float16, bitcast=True)


@triton.jit
def _plane_bits(wd, Q: tl.constexpr):
    # nibbles Q and Q + 4 of each planes word -> fp16x2 of value * 2^-14: signs (bits 4Q + 3, + 16) to bits 15 and
    # 31, exponent and mantissa (bits 4Q .. 4Q + 2, + 16) to bits 9 .. 11 (+ 16): two shifts, two masks, one or
    sgn = (wd << (12 - 4 * Q)) & -2147450880  # 0x80008000
    if Q == 3:
        mag = (wd >> 3) & 0x0E000E00
    else:
        mag = (wd << (9 - 4 * Q)) & 0x0E000E00
    return sgn | mag


@triton.jit
def _mults_f16x2(s_base, rows, stride_sn, k0):
    # the tile's 8 rel bytes of each row in one load -> four int32 [rows]: the fp16x2 multipliers 2^(rel - 15) of
    # scale groups 2q (low half) and 2q + 1 (high half), q = 0..3
    rel = tl.load(s_base + rows[:, None] * stride_sn + (k0 // 32 + tl.arange(0, 8))[None, :]).to(tl.int32)
    even, odd = tl.split(tl.reshape(rel, (rows.shape[0], 4, 2)))
    m = tl.reshape((even << 10) | (odd << 26), (rows.shape[0], 2, 2))  # [rows, q // 2, q % 2]
    m02, m13 = tl.split(m)  # split takes the last dim: q % 2 = 0 (q 0, 2) and q % 2 = 1 (q 1, 3)
    m0, m2 = tl.split(m02)
    m1, m3 = tl.split(m13)
    return m0, m1, m2, m3


@triton.jit
def _mul_f16x2(x, m, INTERPRET: tl.constexpr):
    # fp16x2 products of two int32 tensors' halves, as int32 (one HMUL2 per register on the GPU)
    if INTERPRET:
        p = _halves_f16(x) * _halves_f16(m)
        p = tl.reshape(p.to(tl.uint16, bitcast=True).to(tl.int32), (x.shape[0], x.shape[1], 2))
        lo, hi = tl.split(p)
        out = lo | (hi << 16)
    else:
        out = tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [x, m], dtype=tl.int32,
                                        is_pure=True, pack=1)
    return out


@triton.jit
def planes_step(acc, a_rows, valid, w_base, s_base, rows, k0, stride_wn, stride_sn, SWAP: tl.constexpr,
                 XPERM: tl.constexpr, DOT_F32: tl.constexpr):
    # acc += A[:, k0:k0+256] @ W^T for MXFP4 in the planes layout (formats.mxfp4_planes): the tile's 32 words of
    # each row in one load, then per q the fp16 weights of scale groups 2q, 2q + 1 (column 2w + h is element
    # 64q + 32h + w) times their per-row multipliers, and a K = 64 dot with the activation in that column order:
    # gathered and converted here, or (XPERM) stored so by the previous step (fp16, `planes_order`), a plain
    # load. SWAP: weight rows as the MMA's M (acc is [rows, tokens]).
    wd = tl.load(w_base + rows[:, None] * stride_wn + (k0 // 8 + tl.arange(0, 32))[None, :])
    mults = _mults_f16x2(s_base, rows, stride_sn, k0)
    cols = tl.arange(0, 64)
    for q in tl.static_range(4):
        m = tl.broadcast_to(mults[q][:, None], wd.shape)
        w = _halves_f16(_mul_f16x2(_plane_bits(wd, q), m, DOT_F32))
        if XPERM:
            ks = k0 + 64 * q + cols
        else:
            ks = k0 + 64 * q + 32 * (cols % 2) + cols // 2
        a = tl.load(a_rows + ks[None, :], mask=valid[:, None], other=0.0).to(tl.float16)
        if SWAP:
            acc = dot_acc(w, tl.trans(a), acc, DOT_F32)
        else:
            acc = dot_acc(a, tl.trans(w), acc, DOT_F32)
    return acc


@triton.jit
def planes_out(acc, r_base, rows, SWAP: tl.constexpr):
    # a planes accumulator as [tokens, rows], times the rows' 2^(ref - 127)
    if SWAP:
        acc = tl.trans(acc)
    return acc * tl.load(r_base + rows)[None, :]


def planes_order(x: torch.Tensor) -> torch.Tensor:
    """[T, K] -> fp16 [T, K] with the columns of every 256 in the order a planes GEMM step multiplies them (column
    64q + 2w + h holds element 64q + 32h + w)."""
    t, k = x.shape
    return x.view(t, k // PLANE_K, 4, 2, 32).transpose(-1, -2).reshape(t, k).to(torch.float16)
