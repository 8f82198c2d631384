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

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .arch import TILES, Arch, current_arch, tiles
from .quant import (
    INTERPRET,
    MX_BLOCK,
    PLANE_FLUSH,
    PLANE_K,
    bf16_grid,
    dequantize_mxfp4,
    dequantize_mxfp4_planes,
    dequantize_mxfp8,
    fp8_grid,
    mxfp4_planes,
    quantize_fp8_per_token,
    quantize_fp8_per_token_ref,
    quantize_fp8_weight,
    quantize_mxfp4,
    quantize_mxfp8,
)

FORMATS = ("bf16", "fp8", "mxfp4", "mxfp8")
_FMT_CODE = {f: i for i, f in enumerate(FORMATS)}
FP8_ACT_GROUP = 64  # intermediate activation columns sharing one fp8 scale


@dataclass
class Experts:
    """A stack of E experts in one storage format.

    gate_up [E, 2I, H] and down [E, H, I] (bf16 | fp8); mxfp4 packs K in half: [E, 2I, H // 2], [E, H, I // 2].
    Scales: fp8 float32 [E, 2I], [E, H]; mx uint8 E8M0 [E, 2I, H // 32], [E, H, I // 32]; bf16 none."""

    fmt: str
    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    # MXFP4 in the planes layout (`to_planes`): weights int32 words, scales the groups' rel exponents, and these
    # float32 row scales [E, 2I], [E, H]
    gate_up_row: torch.Tensor | None = None
    down_row: torch.Tensor | None = None

    @property
    def planes(self) -> bool:
        return self.gate_up_row is not None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden(self) -> int:
        return self.down.shape[1]

    @property
    def w_fmt(self) -> int:
        """The kernels' weight-format code: FORMATS' index, 4 for MXFP4 in the planes layout."""
        return 4 if self.planes else _FMT_CODE[self.fmt]

    @property
    def inter(self) -> int:
        return self.gate_up.shape[1] // 2


def quantize_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, fmt: str,
                     fp8_dtype: torch.dtype | None = None) -> Experts:
    """bf16/fp32 expert weights [E, 2I, H], [E, H, I] -> `Experts` in `fmt` (fp8: `fp8_dtype`, default the
    platform's). Expert by expert: quantizing a whole stack at once would need its size several times in fp32."""
    if fmt != "bf16" and w_gate_up.shape[0] > 1:
        parts = [quantize_experts(w_gate_up[e : e + 1], w_down[e : e + 1], fmt, fp8_dtype)
                 for e in range(w_gate_up.shape[0])]
        return Experts(fmt, *(torch.cat([getattr(p, f) for p in parts])
                              for f in ("gate_up", "down", "gate_up_scale", "down_scale")))
    if fmt == "bf16":
        return Experts(fmt, w_gate_up.to(torch.bfloat16).contiguous(), w_down.to(torch.bfloat16).contiguous())
    if fmt == "fp8":
        fp8_dtype = fp8_dtype or current_arch(w_gate_up.device).fp8_dtype
        gu, gus = quantize_fp8_weight(w_gate_up, fp8_dtype)
        dn, dns = quantize_fp8_weight(w_down, fp8_dtype)
        return Experts(fmt, gu, dn, gus, dns)
    if fmt in ("mxfp4", "mxfp8"):
        quantize = quantize_mxfp4 if fmt == "mxfp4" else quantize_mxfp8
        gu, gus = quantize(w_gate_up)
        dn, dns = quantize(w_down)
        return Experts(fmt, gu, dn, gus, dns)
    raise ValueError(f"expert format {fmt!r} is not one of {FORMATS}")


def empty_experts(fmt: str, num_experts: int, hidden: int, inter: int) -> Experts:
    """Uninitialized MX storage for `num_experts` experts (the `Experts` shapes) on the default device, for a
    loader to read a checkpoint's bytes into."""
    if fmt not in ("mxfp4", "mxfp8"):
        raise ValueError(f"empty_experts holds MX formats, not {fmt!r}")
    pack, wdtype = (2, torch.uint8) if fmt == "mxfp4" else (1, torch.float8_e4m3fn)

    def empty(rows: int, k: int, dtype: torch.dtype, div: int) -> torch.Tensor:
        return torch.empty((num_experts, rows, k // div), dtype=dtype)

    return Experts(fmt, empty(2 * inter, hidden, wdtype, pack), empty(hidden, inter, wdtype, pack),
                   empty(2 * inter, hidden, torch.uint8, MX_BLOCK), empty(hidden, inter, torch.uint8, MX_BLOCK))


def to_planes(experts: Experts) -> Experts:
    """MXFP4 experts -> the same values in the planes layout (`quant.mxfp4_planes`: Hopper's decode layout, made
    once at load; values more than 28 octaves below their row's largest scale flush to zero)."""
    if experts.fmt != "mxfp4" or experts.planes:
        raise ValueError("to_planes takes MXFP4 experts in the checkpoint layout")
    ex = experts
    parts = [(*mxfp4_planes(ex.gate_up[e], ex.gate_up_scale[e]), *mxfp4_planes(ex.down[e], ex.down_scale[e]))
             for e in range(ex.num_experts)]  # expert by expert: the conversion's temporaries stay small
    gu, gus, gur, dn, dns, dnr = (torch.stack(f) for f in zip(*parts, strict=True))
    return Experts("mxfp4", gu, dn, gus, dns, gur, dnr)


def serving_layout(experts: Experts) -> Experts:
    """The stack in the layout `fused_moe` serves fastest on its device, made once after loading: MXFP4 on a GPU
    whose tile tables have planes entries (sm90) in the planes layout (`to_planes`); anything else as it is."""
    dev = experts.gate_up.device
    if experts.fmt != "mxfp4" or experts.planes or dev.type != "cuda" or (experts.hidden | experts.inter) % PLANE_K:
        return experts
    return to_planes(experts) if current_arch(dev).name in TILES["moe_decode:planes"] else experts


MX_FP8_OCTAVES = 11  # MXFP4 as e4m3: scale groups this far below their row's largest scale convert exactly


def mx_fp8_flush(scales: torch.Tensor) -> torch.Tensor:
    """bool [..., N, K / 32]: the MXFP4 scale groups the fp8 path flushes to zero, those more than
    `MX_FP8_OCTAVES` octaves below their row's largest scale. A flushed element is at most 6 * 2^(s - 127) with
    s <= row max - 12: under 2^-12 of the largest magnitude the row's largest block can hold."""
    s = scales.to(torch.int32)
    return s < s.amax(-1, keepdim=True) - MX_FP8_OCTAVES


def dequantize_experts(experts: Experts, mx_fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> float32 (gate_up [E, 2I, H], down [E, H, I]): exactly the values the kernels multiply (MXFP4 through
    the fp8 path with `mx_fp8`: the flushed groups zero, every other value exact)."""
    ex = experts
    if ex.fmt == "bf16":
        return ex.gate_up.float(), ex.down.float()
    if ex.fmt == "fp8":
        return ex.gate_up.float() * ex.gate_up_scale[..., None], ex.down.float() * ex.down_scale[..., None]
    if ex.planes:
        out = []
        for w, rel, r in ((ex.gate_up, ex.gate_up_scale, ex.gate_up_row), (ex.down, ex.down_scale, ex.down_row)):
            v = dequantize_mxfp4_planes(w, rel, r)
            if mx_fp8:  # rel = scale - row max + 29: the fp8 path flushes rel < 29 - 11
                v = v.masked_fill((rel < PLANE_FLUSH + 1 - MX_FP8_OCTAVES).repeat_interleave(MX_BLOCK, -1), 0.0)
            out.append(v)
        return out[0], out[1]
    dequantize = dequantize_mxfp4 if ex.fmt == "mxfp4" else dequantize_mxfp8
    out = []
    for w, s in ((ex.gate_up, ex.gate_up_scale), (ex.down, ex.down_scale)):
        v = dequantize(w, s)
        if mx_fp8 and ex.fmt == "mxfp4":
            v = v.masked_fill(mx_fp8_flush(s).repeat_interleave(MX_BLOCK, -1), 0.0)
        out.append(v)
    return out[0], out[1]


def swiglu_oai_ref(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[.., 2I] (gate | up, not interleaved) -> [.., I]: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, L)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1.0) * (gate * torch.sigmoid(alpha * gate))


def _quantize_groups_ref(h: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Quantize-dequantize [P, I] per (row, 64-column group), as the fp8 gate_up epilogue stores it."""
    groups = h.reshape(h.shape[0], -1, FP8_ACT_GROUP)
    q, s = quantize_fp8_per_token_ref(groups, fp8_dtype)
    return (q.float() * s[..., None]).reshape(h.shape)


def fused_moe_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Experts,
                  alpha: float, limit: float, mx_fp8: bool = False, h_row: bool = False) -> torch.Tensor:
    """hidden [T, H], topk_ids / topk_weights [T, k] -> [T, H] in hidden's dtype (fp32 math, the kernels'
    quantization of activations mirrored; `mx_fp8`: MXFP4 experts as `fused_moe` runs them through the fp8 tensor
    cores, activations fp8 like the fp8 experts'; planes: activations and the intermediate fp16; `h_row`: an fp8
    intermediate rounded to hidden's dtype, then quantized per row instead of per 64 columns)."""
    t, k = topk_ids.shape
    act_fp8 = experts.fmt == "fp8" or (mx_fp8 and experts.fmt == "mxfp4")
    fp8 = experts.gate_up.dtype if experts.fmt == "fp8" else torch.float8_e4m3fn
    w_gate_up, w_down = dequantize_experts(experts, mx_fp8)
    act_dtype = torch.float16 if experts.planes else hidden.dtype
    if act_fp8:
        xq, xs = quantize_fp8_per_token_ref(hidden, fp8)
        x = xq.float() * xs[:, None]
    else:
        x = hidden.to(act_dtype).float()
    flat = topk_ids.reshape(-1).long()
    out = torch.zeros((t, experts.hidden), dtype=torch.float32, device=hidden.device)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tokens = pairs // k
        h = swiglu_oai_ref(x[tokens] @ w_gate_up[e].T, alpha, limit)
        if act_fp8 and h_row:
            hq, hs = quantize_fp8_per_token_ref(h.to(hidden.dtype).float(), fp8)
            h = hq.float() * hs[:, None]
        else:
            h = _quantize_groups_ref(h, fp8) if act_fp8 else h.to(act_dtype).float()
        y = (h @ w_down[e].T) * topk_weights.reshape(-1)[pairs, None].float()
        out.index_add_(0, tokens, y)
    return out.to(hidden.dtype)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pairs (flattened index t * k + j) sorted by expert, each expert's run padded to a multiple of block_m with
    the sentinel P = number of pairs -> (sorted pairs int32 [padded], expert of each block int32, padded)."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    order = torch.argsort(flat, stable=True)
    pairs, owners, start = [], [], 0
    for e, c in enumerate(counts.tolist()):
        run = order[start : start + c]
        start += c
        pad = -c % block_m
        pairs.append(torch.cat((run, torch.full((pad,), n, dtype=run.dtype, device=run.device))))
        owners += [e] * ((c + pad) // block_m)
    sorted_pairs = torch.cat(pairs).to(torch.int32)
    return sorted_pairs, torch.tensor(owners, dtype=torch.int32, device=flat.device), sorted_pairs.numel()


# ---------------------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _moe_align_kernel(ids_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, cursor_ptr, num_pairs, max_padded,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, LOG2_E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    # One program: histogram, padded prefix sums, the expert of every block, then each pair scattered to its
    # expert's next free row (atomic cursor: order inside an expert's run is free, rows are independent).
    # cursor_ptr is scratch [2 * E_PAD]: next free row per expert, then each expert's end row.
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((E_PAD,), tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + lanes
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0)
        counts += tl.histogram(ids, E_PAD)
    # lanes past the end were counted as expert 0
    counts -= tl.where(experts == 0, tl.cdiv(num_pairs, CHUNK) * CHUNK - num_pairs, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(cursor_ptr + experts, ends - padded)
    tl.store(cursor_ptr + E_PAD + experts, ends)
    for r0 in range(0, max_padded, CHUNK):
        rows = r0 + lanes
        tl.store(pairs_ptr + rows, tl.zeros((CHUNK,), tl.int32) + num_pairs, mask=rows < max_padded)
    tl.debug_barrier()
    num_blocks = max_padded // BLOCK_M
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + lanes
        first = blocks * BLOCK_M
        # owner = number of experts whose run ends at or before the block's first row (binary search on ends)
        owner = tl.zeros((CHUNK,), tl.int32)
        for i in tl.static_range(LOG2_E_PAD):
            cand = owner + (E_PAD >> (i + 1))
            owner = tl.where(tl.load(cursor_ptr + E_PAD + cand - 1) <= first, cand, owner)
        tl.store(block_expert_ptr + blocks, tl.where(first < total, owner, 0), mask=blocks < num_blocks)
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + lanes
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=0)
        slot = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
        tl.store(pairs_ptr + slot, offs, mask=ok)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """Triton version of `moe_align_ref`, shaped for a fixed-size grid (CUDA graphs): the outputs have the
    worst-case length and `num_padded` (int32 [1], on the device) says how much is used."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    n = ids.numel()
    max_padded = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    dev = ids.device
    pairs = torch.empty((max_padded,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((max_padded // block_m,), dtype=torch.int32, device=dev)
    num_padded = torch.empty((1,), dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(num_experts)
    cursor = torch.empty((2 * e_pad,), dtype=torch.int32, device=dev)
    cfg = tiles("moe_align", current_arch(dev))
    _moe_align_kernel[(1,)](ids, pairs, block_expert, num_padded, cursor, n, max_padded, BLOCK_M=block_m,
                            E_PAD=e_pad, LOG2_E_PAD=e_pad.bit_length() - 1, CHUNK=cfg["CHUNK"],
                            num_warps=cfg["num_warps"])
    return pairs, block_expert, num_padded


@triton.jit
def _dot(a, w, acc, DOT_F32: tl.constexpr):
    if DOT_F32:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(a, w, acc)


@triton.jit
def _mx_row_ref(s_base, rows, K, stride_sn, BLOCK_N: tl.constexpr):
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
def _mx_row_scale(ref):
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
def _mxfp4_e4m3_tile(w_base, s_base, rows, ref, k0, stride_wn, stride_sn, BLOCK_K: tl.constexpr):
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
    ref = _mx_row_ref(s_base, rows, K, stride_sn, BLOCK_N)
    q_rows = q_ptr + e * stride_qe + rows[None, :] * stride_qn
    for k0 in range(0, K, BLOCK_K):
        t = _mxfp4_e4m3_tile(w_base, s_base, rows, ref, k0, stride_wn, stride_sn, BLOCK_K)
        tl.store(q_rows + (k0 + tl.arange(0, BLOCK_K))[:, None], t, mask=ok[None, :])
    tl.store(qs_ptr + e * stride_qse + rows, _mx_row_scale(ref), mask=ok)


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


def _side_stream(device: torch.device) -> torch.cuda.Stream:
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


@triton.jit
def _mxfp4_fp8_dot(acc, a, w_base, s_base, rows, ref, k0, stride_wn, stride_sn, BLOCK_K: tl.constexpr,
                   DOT_F32: tl.constexpr):
    # acc += A[:, k0:k0+BLOCK_K] @ W^T with A fp8 and the MXFP4 weight converted to e4m3 in registers by integer ops
    # (no float upcast, no per-element scale multiply)
    return _dot(a, _mxfp4_e4m3_tile(w_base, s_base, rows, ref, k0, stride_wn, stride_sn, BLOCK_K), acc, DOT_F32)


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
        acc = _dot(a, w, acc, DOT_F32)
    return acc


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
def _planes_step(acc, a_rows, valid, w_base, s_base, rows, k0, stride_wn, stride_sn, SWAP: tl.constexpr,
                 XPERM: tl.constexpr, DOT_F32: tl.constexpr):
    # acc += A[:, k0:k0+256] @ W^T for MXFP4 in the planes layout (quant.mxfp4_planes): the tile's 32 words of
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
            acc = _dot(w, tl.trans(a), acc, DOT_F32)
        else:
            acc = _dot(a, tl.trans(w), acc, DOT_F32)
    return acc


@triton.jit
def _planes_out(acc, r_base, rows, SWAP: tl.constexpr):
    # a planes accumulator as [tokens, rows], times the rows' 2^(ref - 127)
    if SWAP:
        acc = tl.trans(acc)
    return acc * tl.load(r_base + rows)[None, :]


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
        ref = _mx_row_ref(s_base, rows, K, stride_sn, BLOCK_N)
    else:
        ref = rows
    return ref


@triton.jit
def _channel_scale(s_base, rows, ref, MX_FP8: tl.constexpr):
    # the per-output-channel factor of an fp8-activation GEMM: fp8 weights' scale, or MXFP4's row reference
    if MX_FP8:
        scale = _mx_row_scale(ref)
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
            acc_g = _planes_step(acc_g, x_rows, valid, w_base, s_base, rows_g, k0, stride_wn, stride_sn, SWAP,
                                 XPERM, DOT_F32)
            acc_u = _planes_step(acc_u, x_rows, valid, w_base, s_base, rows_u, k0, stride_wn, stride_sn, SWAP,
                                 XPERM, DOT_F32)
        else:
            a = tl.load(x_rows + (k0 + offs_k)[None, :], mask=valid[:, None], other=0.0)
            acc_g = _dot_step(acc_g, a, w_base, s_base, rows_g, ref_g, k0, stride_wn, stride_sn, W_FMT, BLOCK_K,
                              MX_FP8, DOT_F32)
            acc_u = _dot_step(acc_u, a, w_base, s_base, rows_u, ref_u, k0, stride_wn, stride_sn, W_FMT, BLOCK_K,
                              MX_FP8, DOT_F32)
    if W_FMT == 4:
        acc_g = _planes_out(acc_g, r_base, rows_g, SWAP)
        acc_u = _planes_out(acc_u, r_base, rows_u, SWAP)
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
            acc = _planes_step(acc, h_ptr + pairs[:, None] * stride_hp, valid, w_base, s_base, rows, k0, stride_wn,
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
        acc = _planes_out(acc, r_base, rows, SWAP)
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


def planes_order(x: torch.Tensor) -> torch.Tensor:
    """[T, K] -> fp16 [T, K] with the columns of every 256 in the order a planes GEMM step multiplies them (column
    64q + 2w + h holds element 64q + 32h + w)."""
    t, k = x.shape
    return x.view(t, k // PLANE_K, 4, 2, 32).transpose(-1, -2).reshape(t, k).to(torch.float16)


def h_row(fmt: str, num_tokens: int, arch: Arch, planes: bool = False) -> bool:
    """Whether `fused_moe` quantizes the fp8 intermediate per row (the tile table's H_ROW; `fused_moe_ref`'s h_row)
    for `fmt` experts (`planes`: in the planes layout) and `num_tokens` tokens."""
    cfg = moe_tiles(num_tokens, arch, "fp8")[0]
    return (fmt == "fp8" or mx_fp8(fmt, num_tokens, arch, planes)) and bool(cfg.get("H_ROW", 0))


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
    cfg, sort = moe_tiles(t, arch, "planes" if planes else "bf16" if fmt == "bf16" else None)
    use_mx_fp8 = mx_fp8(fmt, t, arch, planes)
    if fmt == "fp8" or use_mx_fp8:  # fp8 activations: the tables' "family:fp8" entries
        cfg, sort = moe_tiles(t, arch, "fp8")
    side = None  # MX_CONVERT 2: the down weights convert on a side stream while the gate_up GEMM runs
    if use_mx_fp8 and cfg.get("MX_CONVERT", 0):  # the whole stack to fp8 once, then the fp8 experts' path
        side = _side_stream(dev) if cfg["MX_CONVERT"] == 2 and dev.type == "cuda" else None
        experts, fmt, use_mx_fp8, planes = mx_to_fp8(experts, side), "fp8", False, False
    act_fp8 = fmt == "fp8" or use_mx_fp8
    row_q = act_fp8 and bool(cfg.get("H_ROW", 0))
    # K tiles: the table's, or the largest power of two dividing K when K is smaller (small models); planes step
    # through their 256-element tiles
    gu_bk = PLANE_K if planes else min(cfg["GU_BLOCK_K"], hdim & -hdim)
    dn_bk = PLANE_K if planes else min(cfg["DN_BLOCK_K"], inter & -inter,
                                       FP8_ACT_GROUP if act_fp8 and not row_q else inter)
    # MXFP4 as fp8: K tiles of 64 and up, the sizes compiled and measured on sm90 (the conversion is one dot)
    min_bk = 64 if use_mx_fp8 else 32 if fmt != "bf16" else 16
    if min(gu_bk, dn_bk) < min_bk or (act_fp8 and inter % FP8_ACT_GROUP):
        raise ValueError(f"hidden {hdim} / intermediate {inter} too small or odd for {fmt} experts")
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
    out = [AotVariant("moe_align", _moe_align_kernel,
                      {"ids_ptr": "*i32", "pairs_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
                       "cursor_ptr": "*i32", "num_pairs": "i32", "max_padded": "i32"},
                      {"BLOCK_M": 64, "E_PAD": 256, "LOG2_E_PAD": 8, "CHUNK": tiles("moe_align", arch)["CHUNK"]},
                      num_warps=tiles("moe_align", arch)["num_warps"], num_stages=1)]
    w_types = {"bf16": ("*bf16", "*bf16"), "fp8": (fp8, "*fp32"), "mxfp4": ("*u8", "*u8"), "mxfp8": ("*fp8e4nv", "*u8")}
    if arch.name == "sm90":  # MXFP4 in the planes layout (Hopper's decode layout), MXFP4 -> fp8 once per step
        w_types["mxfp4_planes"] = ("*i32", "*u8")
        cfg = tiles("mx_to_fp8", arch)
        out.append(AotVariant(
            "planes_to_fp8", _planes_to_fp8_kernel,
            {"w_ptr": "*i32", "s_ptr": "*u8", "r_ptr": "*fp32", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "N": "i32",
             "K": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32",
             "stride_re": "i32", "stride_qe": "i64", "stride_qn": "i32", "stride_qse": "i32"},
            {"BLOCK_N": cfg["BLOCK_N"]}, num_warps=cfg["num_warps"],
            aligned=("N", "K", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_re", "stride_qe",
                     "stride_qn", "stride_qse")))
        out.append(AotVariant(
            "mx_to_fp8", _mx_to_fp8_kernel,
            {"w_ptr": "*u8", "s_ptr": "*u8", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "N": "i32", "K": "i32",
             "stride_we": "i64", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_qe": "i64",
             "stride_qn": "i32", "stride_qse": "i32"},
            {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"]}, num_warps=cfg["num_warps"],
            aligned=("N", "K", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_qe", "stride_qn",
                     "stride_qse")))
    codes = {**_FMT_CODE, "mxfp4_planes": 4}
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
