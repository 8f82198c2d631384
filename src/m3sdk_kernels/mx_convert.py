"""MXFP4 -> e4m3 by integer ops: the fp8 tensor-core path of MXFP4 experts (Hopper), per tile inside the MoE GEMMs
(`mxfp4_e4m3_tile`) or for a whole stack once per step (`mx_to_fp8`).

Each weight row gets one reference exponent, 11 octaves below its largest E8M0 scale (`MX_FP8_OCTAVES`); groups
within those octaves convert exactly, groups further below flush to zero (`experts.mx_fp8_flush`).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .arch import TILES, Arch, current_arch, tiles
from .experts import Experts


@triton.jit
def mx_row_ref(s_base, rows, K, stride_sn, BLOCK_N: tl.constexpr):
    # MXFP4 through the fp8 tensor cores: each weight row gets one reference exponent, 11 octaves below its largest
    # E8M0 scale. A group whose scale lies within those 11 octaves (d' = scale - ref in 0..11) has every E2M1 value
    # x 2^(d' - 5) in e4m3's normal range (0.5 * 2^-5 = 2^-6 .. 6 * 2^6 = 384), so it converts to e4m3 exactly and
    # the row's 2^(ref - 122) goes to the epilogue, like an fp8 per-channel scale. Groups further below flush to 0.
    ref = tl.zeros((BLOCK_N,), tl.int32)
    for g0 in range(0, K // 32, 32):
        gs = g0 + tl.arange(0, 32)
        sc = tl.load(s_base + rows[:, None] * stride_sn + gs[None, :], mask=gs[None, :] < K // 32, other=0)
        ref = tl.maximum(ref, tl.max(sc.to(tl.int32), axis=1))
    return ref - 11


@triton.jit
def mx_row_scale(ref):
    # 2^(ref - 122) built from its bits (exact); rows whose largest scale is below 2^-121 clamp to 2^-126
    return (tl.maximum(ref + 5, 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1x4_to_e4m3x4(c, base):
    # Four E2M1 magnitude codes, one per byte of c -> four e4m3 magnitude bytes of value(code) * 2^(d' - 5), with
    # byte j of base = 8 + 8 * d' (< 128) of byte j's code. At d' = 0 a code >= 2 is 4 * code + 8 (the e2m1
    # exponent and mantissa bits sit 2 bits up, base moves the exponent bias), code 1 (0.5, e2m1's subnormal) is 8,
    # code 0 is 0: per byte, (nz ? base : 0) + 4 * (code + ge2 - nz) with nz = code >= 1, ge2 = code >= 2. No byte
    # carries into the next.
    nz = ((c + 0x7F7F7F7F) >> 7) & 0x01010101
    ge2 = (((c & 0x06060606) + 0x7E7E7E7E) >> 7) & 0x01010101
    return ((nz * 255) & base) + ((c + ge2 - nz) << 2)


@triton.jit
def _bytes(x, j: tl.constexpr):
    return (x >> (8 * j)).to(tl.uint8)


@triton.jit
def mxfp4_e4m3_tile(w_base, s_base, rows, ref, k0, stride_wn, stride_sn, BLOCK_K: tl.constexpr):
    # The MXFP4 weight tile W^T[k0:k0+BLOCK_K, rows] as e4m3 (times the row's 2^(ref - 122)), converted four
    # bytes (eight elements) per 32-bit integer op. The 4 bytes of a word lie in one 16-byte scale group.
    G: tl.constexpr = BLOCK_K // 32
    NW: tl.constexpr = BLOCK_K // 8
    BLOCK_N: tl.constexpr = rows.shape[0]
    ks = k0 // 32 + tl.arange(0, G)
    dp = tl.load(s_base + rows[None, :] * stride_sn + ks[:, None]).to(tl.int32) - ref[None, :]
    base = tl.reshape(tl.broadcast_to(((8 + 8 * dp) * 0x01010101)[:, None, :], (G, 4, BLOCK_N)), (NW, BLOCK_N))
    keep = tl.reshape(tl.broadcast_to(tl.where(dp >= 0, -1, 0)[:, None, :], (G, 4, BLOCK_N)), (NW, BLOCK_N))
    w32 = w_base.to(tl.pointer_type(tl.int32))
    wd = tl.load(w32 + rows[None, :] * (stride_wn // 4) + (k0 // 8 + tl.arange(0, NW))[:, None])
    wd = wd & keep  # a flushed group's codes become 0
    sign = -2139062144  # 0x80808080
    lo = _e2m1x4_to_e4m3x4(wd & 0x07070707, base) | ((wd << 4) & sign)  # elements 8w + 2j
    hi = _e2m1x4_to_e4m3x4((wd >> 4) & 0x07070707, base) | (wd & sign)  # elements 8w + 2j + 1
    # element 8w + 2j + h from byte j of (lo, hi)[h]: [NW, N, h, j bit 0, j bit 1] -> [NW, j1, j0, h, N]
    t = tl.join(tl.join(tl.join(_bytes(lo, 0), _bytes(hi, 0)), tl.join(_bytes(lo, 1), _bytes(hi, 1))),
                tl.join(tl.join(_bytes(lo, 2), _bytes(hi, 2)), tl.join(_bytes(lo, 3), _bytes(hi, 3))))
    t = tl.reshape(tl.permute(t, (0, 4, 3, 2, 1)), (BLOCK_K, BLOCK_N))
    return t.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _mx_to_fp8_kernel(w_ptr, s_ptr, q_ptr, qs_ptr, N, K, stride_we, stride_wn, stride_se, stride_sn, stride_qe,
                      stride_qn, stride_qse, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One expert's BLOCK_N MXFP4 rows -> e4m3 rows (the conversion the fp8 path does per tile, done once) and the
    # rows' 2^(ref - 122) as their per-channel scale
    e = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < N
    rows = tl.where(ok, offs, 0)
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    ref = mx_row_ref(s_base, rows, K, stride_sn, BLOCK_N)
    q_rows = q_ptr + e * stride_qe + rows[None, :] * stride_qn
    for k0 in range(0, K, BLOCK_K):
        t = mxfp4_e4m3_tile(w_base, s_base, rows, ref, k0, stride_wn, stride_sn, BLOCK_K)
        tl.store(q_rows + (k0 + tl.arange(0, BLOCK_K))[:, None], t, mask=ok[None, :])
    tl.store(qs_ptr + e * stride_qse + rows, mx_row_scale(ref), mask=ok)


@triton.jit
def _bytes_of(x, b: tl.constexpr):
    return ((x >> (8 * b)) & 0xFF).to(tl.uint8)


@triton.jit
def _planes_to_fp8_kernel(w_ptr, s_ptr, r_ptr, q_ptr, qs_ptr, N, K, stride_we, stride_wn, stride_se, stride_sn,
                          stride_re, stride_qe, stride_qn, stride_qse, BLOCK_N: tl.constexpr):
    # `_mx_to_fp8_kernel` for the planes layout. Byte b of a planes word holds nibbles 2b, 2b + 1 (scale groups
    # (0, 2), (4, 6), (1, 3), (5, 7) for b = 0..3), so the four low nibbles of a word convert as one 32-bit op with
    # a base per byte (`_e2m1x4_to_e4m3x4`), the four high ones as another; each byte lands in its group's columns.
    # A group's offset from the row reference (11 octaves below the row's largest scale) is rel - 18.
    e = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < N
    rows = tl.where(ok, offs, 0)
    w_base = w_ptr + e * stride_we + rows[:, None] * stride_wn
    q_rows = q_ptr + e * stride_qe + rows[:, None] * stride_qn
    sign = -2139062144  # 0x80808080
    for k0 in range(0, K, 256):
        wd = tl.load(w_base + (k0 // 8 + tl.arange(0, 32))[None, :])
        d = tl.load(s_ptr + e * stride_se + rows[:, None] * stride_sn + (k0 // 32 + tl.arange(0, 8))[None, :])
        d = d.to(tl.int32) - 18
        base = tl.where(d >= 0, 8 + 8 * d, 0)  # 0 for flushed groups: their codes are cleared too
        keep = tl.where(d >= 0, 0x8F, 0)
        b04, b26 = tl.split(tl.reshape(base, (BLOCK_N, 4, 2)))  # groups (0, 2, 4, 6), (1, 3, 5, 7)
        k04, k26 = tl.split(tl.reshape(keep, (BLOCK_N, 4, 2)))
        b0, b1, b2, b3 = _quad(b04)  # groups 0, 2, 4, 6
        c0, c1, c2, c3 = _quad(b26)  # groups 1, 3, 5, 7
        base_lo = (b0 | (b2 << 8) | (c0 << 16) | (c2 << 24))[:, None]  # low nibbles: groups 0, 4, 1, 5
        base_hi = (b1 | (b3 << 8) | (c1 << 16) | (c3 << 24))[:, None]  # high nibbles: groups 2, 6, 3, 7
        kb0, kb1, kb2, kb3 = _quad(k04)
        kc0, kc1, kc2, kc3 = _quad(k26)
        keep_lo = (kb0 | (kb2 << 8) | (kc0 << 16) | (kc2 << 24))[:, None]
        keep_hi = (kb1 | (kb3 << 8) | (kc1 << 16) | (kc3 << 24))[:, None]
        lo_n = wd & (keep_lo & 0x0F0F0F0F)
        hi_n = (wd >> 4) & (keep_hi & 0x0F0F0F0F)
        lo = _e2m1x4_to_e4m3x4(lo_n & 0x07070707, base_lo) | ((lo_n << 4) & sign)
        hi = _e2m1x4_to_e4m3x4(hi_n & 0x07070707, base_hi) | ((hi_n << 4) & sign)
        cols = q_rows + k0 + tl.arange(0, 32)[None, :]
        for b in tl.static_range(4):  # low nibbles: groups 0, 4, 1, 5; high: 2, 6, 3, 7
            tl.store(cols + 32 * (4 * (b % 2) + b // 2), _bytes_of(lo, b).to(tl.float8e4nv, bitcast=True),
                     mask=ok[:, None])
            tl.store(cols + 32 * (4 * (b % 2) + b // 2 + 2), _bytes_of(hi, b).to(tl.float8e4nv, bitcast=True),
                     mask=ok[:, None])
    # 2^(ref - 122), ref = the largest scale - 11: the planes row scale 2^(largest - 127) times 2^-6
    tl.store(qs_ptr + e * stride_qse + rows, tl.load(r_ptr + e * stride_re + rows) * 0.015625, mask=ok)


@triton.jit
def _quad(x):
    # [R, 4] -> its four columns
    a, b = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # columns (0, 2), (1, 3)
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def mx_to_fp8(experts: Experts, down_stream: torch.cuda.Stream | None = None) -> Experts:
    """MXFP4 experts (checkpoint or planes layout) -> fp8 experts with the same values as the fp8 path multiplies
    them (`dequantize_experts(.., mx_fp8=True)`: exact, the groups under `MX_FP8_OCTAVES` flushed): e4m3fn plus a
    float32 scale per row. Prefill converts once per step where the tile table says MX_CONVERT, instead of once
    per token tile inside the GEMMs. `down_stream`: the down weights convert there (after the current stream's
    work so far), for the caller to overlap with its gate_up GEMM and wait for before the down GEMM."""
    if experts.fmt != "mxfp4":
        raise ValueError("mx_to_fp8 takes MXFP4 experts")
    cfg = tiles("mx_to_fp8", current_arch(experts.gate_up.device))
    out = []
    for w, sc, r in ((experts.gate_up, experts.gate_up_scale, experts.gate_up_row),
                     (experts.down, experts.down_scale, experts.down_row)):
        out += _mx_to_fp8_stack(w, sc, r, experts.planes, cfg, down_stream if w is experts.down else None)
    return Experts("fp8", out[0], out[2], out[1], out[3])


def _mx_to_fp8_stack(w: torch.Tensor, sc: torch.Tensor, r: torch.Tensor | None, planes: bool, cfg: dict,
                     stream: torch.cuda.Stream | None) -> list[torch.Tensor]:
    # one MXFP4 stack [E, N, K (packed)] -> (e4m3fn [E, N, K], float32 row scales [E, N]). The outputs belong to
    # the current stream (their memory returns to it, so no cross-stream bookkeeping); `stream` writes them, after
    # the current stream's work so far (which may still use that memory's previous tenant)
    e, n, k = w.shape[0], w.shape[1], w.shape[2] * (8 if planes else 2)
    q = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=w.device)
    qs = torch.empty((e, n), dtype=torch.float32, device=w.device)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(w.device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        _mx_to_fp8_launch(w, sc, r, q, qs, planes, cfg)
    return [q, qs]


def _mx_to_fp8_launch(w: torch.Tensor, sc: torch.Tensor, r: torch.Tensor | None, q: torch.Tensor, qs: torch.Tensor,
                      planes: bool, cfg: dict) -> None:
    e, n, k = q.shape
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), e)
    if planes:
        _planes_to_fp8_kernel[grid](w, sc, r, q, qs, n, k, w.stride(0), w.stride(1), sc.stride(0), sc.stride(1),
                                    r.stride(0), q.stride(0), q.stride(1), qs.stride(0), BLOCK_N=cfg["BLOCK_N"],
                                    num_warps=cfg["num_warps"])
    else:
        _mx_to_fp8_kernel[grid](w, sc, q, qs, n, k, w.stride(0), w.stride(1), sc.stride(0), sc.stride(1),
                                q.stride(0), q.stride(1), qs.stride(0), BLOCK_N=cfg["BLOCK_N"],
                                BLOCK_K=min(cfg["BLOCK_K"], k & -k), num_warps=cfg["num_warps"])


def aot_variants(arch: Arch) -> list:
    """The once-per-step conversions, where a tile table has them (sm90: MXFP4 -> fp8 for prefill)."""
    from .aot import AotVariant

    if arch.name not in TILES["mx_to_fp8"]:
        return []
    cfg = tiles("mx_to_fp8", arch)
    return [
        AotVariant(
            "planes_to_fp8", _planes_to_fp8_kernel,
            {"w_ptr": "*i32", "s_ptr": "*u8", "r_ptr": "*fp32", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "N": "i32",
             "K": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32",
             "stride_re": "i32", "stride_qe": "i64", "stride_qn": "i32", "stride_qse": "i32"},
            {"BLOCK_N": cfg["BLOCK_N"]}, num_warps=cfg["num_warps"],
            aligned=("N", "K", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_re", "stride_qe",
                     "stride_qn", "stride_qse")),
        AotVariant(
            "mx_to_fp8", _mx_to_fp8_kernel,
            {"w_ptr": "*u8", "s_ptr": "*u8", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "N": "i32", "K": "i32",
             "stride_we": "i64", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_qe": "i64",
             "stride_qn": "i32", "stride_qse": "i32"},
            {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"]}, num_warps=cfg["num_warps"],
            aligned=("N", "K", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_qe", "stride_qn",
                     "stride_qse")),
    ]
