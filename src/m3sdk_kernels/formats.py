"""Number formats of weights and caches (plain torch, load time): per-row FP8 and the OCP microscaling formats.

FP8 W8A8: a weight [N, K] is stored as fp8 with one float32 scale per output channel (row), an activation
[M, K] is quantized per token on the fly (`scale = amax / fp8_max`, the same rule as the FP8 KV cache).

MX (OCP Microscaling v1.0): 32 consecutive elements along K share one E8M0 scale byte (2^(byte - 127)).
MXFP4 stores E2M1 values two per byte, the even element in the low nibble (the layout of the published
checkpoints: Quark, gpt-oss, compressed-tensors); MXFP8 stores one e4m3fn per byte. Quantizing picks the
smallest power of two that keeps the block's amax representable (no saturation).
"""

from __future__ import annotations

import torch


def quantize_fp8_rows(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) symmetric FP8: returns (x / scale as fp8, scale as float32 without the last dim)."""
    fp8_max = torch.finfo(fp8_dtype).max
    amax = x.float().abs().amax(dim=-1)
    # A floor keeps an all-zero row finite; its stored values are 0 whatever the scale.
    scale = amax.clamp(min=1e-12) / fp8_max
    q = (x.float() / scale[..., None]).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return q, scale


MX_BLOCK = 32


E8M0_BIAS = 127


# E2M1 magnitudes by 3-bit code; bit 3 of a nibble is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# Midpoints between neighbouring magnitudes; at a tie round-to-nearest-even keeps the even code, so the tie
# goes down at 0.25, 1.25, 2.5, 5 (below is even) and up at 0.75, 1.75, 3.5 (above is even).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


_E2M1_TIE_UP = (False, True, False, True, False, True, False)


# MX formats (load-time, plain torch)


def _mx_exponent(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """Smallest e with amax / 2^e <= elem_max, clamped to E8M0's range (all-zero blocks get the smallest)."""
    e = torch.ceil(torch.log2(amax / elem_max)).clamp(-E8M0_BIAS, E8M0_BIAS)
    e = torch.where(amax > 0, e, torch.full_like(e, -E8M0_BIAS))
    # log2 may round a value just above a power of two down onto it: bump those blocks by one
    return torch.where(amax / torch.exp2(e) > elem_max, e + 1, e)


def _mx_blocks(w: torch.Tensor) -> torch.Tensor:
    if w.shape[-1] % MX_BLOCK:
        raise ValueError(f"MX needs the last dim divisible by {MX_BLOCK}, got {tuple(w.shape)}")
    return w.float().reshape(*w.shape[:-1], w.shape[-1] // MX_BLOCK, MX_BLOCK)


def _e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    return torch.exp2(scales.to(torch.float32) - E8M0_BIAS)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] -> (packed uint8 [..., K // 2], scales uint8 [..., K // 32])."""
    blocks = _mx_blocks(w)
    e = _mx_exponent(blocks.abs().amax(-1), E2M1_VALUES[-1])
    v = blocks / torch.exp2(e)[..., None]
    mag = v.abs()
    code = torch.zeros(mag.shape, dtype=torch.uint8, device=w.device)
    for mid, up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_UP, strict=True):
        code += (mag >= mid if up else mag > mid).to(torch.uint8)
    code |= ((v < 0) & (code > 0)).to(torch.uint8) << 3  # no negative zero: zeros stay canonical
    code = code.reshape(*w.shape)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), (e + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_mxfp4`: -> [..., K] in `dtype` (exact in float32)."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    vals = lut[codes.long()].reshape(*scales.shape, MX_BLOCK) * _e8m0_to_float(scales)[..., None]
    return vals.reshape(*packed.shape[:-1], -1).to(dtype)


# MXFP4 "planes" layout (Hopper decode): the same bits, rearranged once at load so that one 32-bit word turns
# into four fp16x2 registers with two shifts and two masks each. Per 256-element K tile, word w (0..31) of a row
# holds in nibble q + 4h (q 0..3, h 0..1) the element 64 q + 32 h + w, i.e. w of scale group 2q + h: the nibbles
# q and q + 4 sit 16 bits apart, so one shift moves both into place and the halves of the result are an fp16x2
# of groups 2q and 2q + 1 (a GEMM step is four K = 64 dots, one per q). E2M1 code bits s e1 e0 m placed at fp16
# bits 15 and 11..9 give exactly value * 2^-14 (the subnormal 0.5 too); a group's scale becomes an fp16
# multiplier 2^(s - ref + 14), ref the row's largest scale (2^(ref - 127) goes to the GEMM epilogue), so every
# product stays within fp16 and groups more than 28 octaves below the row's largest flush to zero.
PLANE_K = 256


PLANE_FLUSH = 28


_PLANE_SHIFT = tuple(4 * ((g >> 1) + 4 * (g & 1)) for g in range(8))  # bit offset of scale group g's nibble


def mxfp4_planes(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 (packed [..., N, K // 2], E8M0 scales [..., N, K // 32]; K a multiple of 256) -> the planes layout:
    (words int32 [..., N, K // 8], rel uint8 [..., N, K // 32] = the fp16 exponent field of each group's
    multiplier (0: flushed), row scale float32 [..., N] = 2^(ref - 127))."""
    k = packed.shape[-1] * 2
    if k % PLANE_K:
        raise ValueError(f"the planes layout needs K divisible by {PLANE_K}, got {k}")
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], k // PLANE_K, 8, 32)
    words = torch.zeros(codes[..., 0, :].shape, dtype=torch.int32, device=packed.device)  # [..., K // 256, 32]
    for g, shift in enumerate(_PLANE_SHIFT):  # int32 shifts wrap into the sign bit: the word's bits exactly
        words |= codes[..., g, :].to(torch.int32) << shift
    s = scales.to(torch.int32)
    ref = s.amax(-1, keepdim=True)
    rel = (s - ref + PLANE_FLUSH + 1).clamp(min=0).to(torch.uint8)
    return words.reshape(*packed.shape[:-1], k // 8), rel, torch.exp2(ref[..., 0].double() - E8M0_BIAS).float()


def dequantize_mxfp4_planes(words: torch.Tensor, rel: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """-> float32 [..., N, K]: the values a planes GEMM multiplies (fp16 products of code x multiplier, rounded as
    the kernel rounds them, times the row scale)."""
    k = words.shape[-1] * 8
    w = words.reshape(*words.shape[:-1], k // PLANE_K, 32).to(torch.int64) & 0xFFFFFFFF
    codes = (w[..., None, :] >> torch.tensor(_PLANE_SHIFT, device=words.device)[:, None]) & 0xF  # [.., tiles, 8, 32]
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=words.device)
    raw = (lut[codes] * 2.0**-14).half().reshape(*words.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    mult = torch.where(rel > 0, torch.exp2(rel.float() - 15), 0.0).half()
    vals = (raw * mult[..., None]).float() * row_scale[..., None, None]
    return vals.reshape(*words.shape[:-1], k)


def quantize_mxfp8(w: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] -> (fp8 [..., K], scales uint8 [..., K // 32])."""
    blocks = _mx_blocks(w)
    fp8_max = torch.finfo(fp8_dtype).max
    e = _mx_exponent(blocks.abs().amax(-1), fp8_max)
    q = (blocks / torch.exp2(e)[..., None]).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return q.reshape(w.shape), (e + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_mxfp8` (and the published MXFP8 checkpoint's `weight` + `weight_scale_inv`)."""
    vals = q.float().reshape(*scales.shape, MX_BLOCK) * _e8m0_to_float(scales)[..., None]
    return vals.reshape(q.shape).to(dtype)


# FP8 per-channel weights, per-token activations: references


def quantize_fp8_weight(w: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (fp8 [..., N, K], float32 scale [..., N]): one scale per output channel."""
    return quantize_fp8_rows(w, fp8_dtype)
