"""A stack of MoE experts in one storage format (`Experts`), and its conversions: quantizing, the serving layout,
dequantizing to the exact values the kernels multiply. Plain torch (load time).

An expert is gate_up [2I, H] (gate rows then up rows, not interleaved) and down [H, I].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arch import TILES, current_arch
from .formats import (
    MX_BLOCK,
    PLANE_FLUSH,
    PLANE_K,
    dequantize_mxfp4,
    dequantize_mxfp4_planes,
    dequantize_mxfp8,
    mxfp4_planes,
    quantize_fp8_weight,
    quantize_mxfp4,
    quantize_mxfp8,
)

FORMATS = ("bf16", "fp8", "mxfp4", "mxfp8")


FMT_CODE = {f: i for i, f in enumerate(FORMATS)}


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
        return 4 if self.planes else FMT_CODE[self.fmt]

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


def stack_shared(w_gate_up: torch.Tensor, w_down: torch.Tensor, shared_gate_up: torch.Tensor,
                 shared_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Routed experts [E, 2I, H], [E, H, I] and a shared expert of any width Is ([2Is, H], [H, Is]) -> one stack
    with the shared expert after the routed ones as n = cdiv(Is, I) experts of the routed width (zero-padded), and
    n: the router's `shared=n` picks all n with weight 1. Exact: SwiGLU-OAI is elementwise over the intermediate,
    so the pieces' outputs sum to the whole's, and a zero gate|up row gives h = 0."""
    inter, s_inter = w_down.shape[2], shared_down.shape[1]
    n = -(-s_inter // inter)
    pad = n * inter - s_inter
    gate, up = shared_gate_up.chunk(2, dim=0)
    gate, up = (torch.nn.functional.pad(x, (0, 0, 0, pad)).view(n, inter, -1) for x in (gate, up))
    down = torch.nn.functional.pad(shared_down, (0, pad)).view(-1, n, inter).transpose(0, 1)
    return (torch.cat((w_gate_up, torch.cat((gate, up), dim=1).to(w_gate_up.dtype))),
            torch.cat((w_down, down.to(w_down.dtype))), n)


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
    """MXFP4 experts -> the same values in the planes layout (`formats.mxfp4_planes`: Hopper's decode layout, made
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
