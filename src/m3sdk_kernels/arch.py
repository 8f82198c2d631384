"""Platforms the kernels are built for, and their tile tables.

One `Arch` per target (sm90 for the H200 we measure on; gfx942 / gfx950 for AMD Instinct MI300X / MI355X). Each
kernel family looks its launch parameters up here (`tiles(family)`), so a new platform is one table entry,
not a code change. Kernel modules never read `torch.cuda` themselves: they ask `current_arch()`.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Arch:
    name: str  # "sm90" | "gfx942" | "gfx950"
    backend: str  # triton backend: "cuda" | "hip"
    target_arch: int | str  # GPUTarget's arch: 90 | "gfx942" | "gfx950"
    warp_size: int
    fp8_dtype: torch.dtype  # the KV / index cache fp8 type (e4m3fnuz on gfx942: its hardware fp8)
    fp8_triton: str  # Triton's name of the same type, for AOT signatures
    num_sms: int  # compute units of the reference part: split counts target a multiple of this
    kv_layout: str  # default KV cache layout on this platform ("plain" | "shuffle")

    @property
    def fp8_max(self) -> float:
        return torch.finfo(self.fp8_dtype).max

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.target_arch, self.warp_size)


ARCHS: dict[str, Arch] = {
    # H200: 132 SMs. SHUFFLE buys little on Hopper (the compiler swizzles shared memory); see docs/perf.md.
    "sm90": Arch("sm90", "cuda", 90, 32, torch.float8_e4m3fn, "fp8e4nv", 132, "plain"),
    # MI300X: 304 CUs, fp8 is e4m3fnuz (bias 8, max 240).
    "gfx942": Arch("gfx942", "hip", "gfx942", 64, torch.float8_e4m3fnuz, "fp8e4b8", 304, "shuffle"),
    # MI355X: 256 CUs, OCP e4m3fn.
    "gfx950": Arch("gfx950", "hip", "gfx950", 64, torch.float8_e4m3fn, "fp8e4nv", 256, "shuffle"),
}


@functools.cache
def _detect(index: int) -> Arch:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        gcn = props.gcnArchName.split(":")[0]
        if gcn not in ARCHS:
            raise RuntimeError(f"m3sdk_kernels has no tile table for {gcn}")
        return ARCHS[gcn]
    if props.major >= 9:  # Hopper tables are the closest we have for newer parts
        return ARCHS["sm90"]
    raise RuntimeError(f"m3sdk_kernels needs sm_90 or newer, found sm_{props.major}{props.minor}")


def current_arch(device: torch.device | str | None = None) -> Arch:
    """The Arch of `device` (default: the current GPU). Without a GPU (CPU, TRITON_INTERPRET=1) it is sm90:
    the interpreter runs the Hopper tile shapes, and fp8 is the OCP e4m3fn type."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return ARCHS["sm90"]
    if not torch.cuda.is_available():
        return ARCHS["sm90"]
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _detect(index)


def pdl_launch(wanted: object, x: torch.Tensor) -> dict:
    """Launch options of a kernel that a tile table lets start as a programmatic dependent (PDL: griddepcontrol,
    CUDA only): `{"launch_pdl": True}` when `wanted` and `x` lives on a CUDA device with compiled kernels (not
    under TRITON_INTERPRET=1), else {}. The kernel's PDL constexpr is `bool()` of the result."""
    return {"launch_pdl": True} if wanted and x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" else {}


def fp8_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The fp8 storage type for KV and index caches on `device`'s platform."""
    return current_arch(device).fp8_dtype


# Tile tables: family -> arch name -> launch parameters. BLOCK_* are tile extents, num_warps / num_stages go to
# the launch, SPLIT_PROGRAMS is the program count split-KV aims at (a shape-only rule, so CUDA graphs replay),
# MERGE_LAST merges the splits in their last program instead of a second kernel (plans of up to
# paged_attention.MERGE_LAST_MAX_SPLITS splits), maxnreg caps registers per thread
# (NVIDIA: more programs resident per SM).
# Families of the MoE/quant kernels are added by their own modules' authors below the attention ones.
TILES: dict[str, dict[str, dict[str, int]]] = {
    "cache_write": {
        "sm90": {"num_warps": 4, "num_stages": 1},
        "gfx942": {"num_warps": 4, "num_stages": 1},
        "gfx950": {"num_warps": 4, "num_stages": 1},
    },
    # dense decode: one query token x one GQA group (16 heads padded to BLOCK_H rows) per program, split-KV.
    # MERGE_LAST: the last split program of a token merges the partials (no merge launch; H200,
    # b64 32K: bf16 0.974 -> 0.959 ms with 1056 programs, FP8 0.749 -> 0.721, MSA bf16 0.078 -> 0.072).
    # sm90 bf16: the keys as the wgmma's M (KEYS_M) with page ids carried ahead, 3 stages: 0.1-0.4 % faster at b64
    # 32K, 0.9-1.5 % at 128K in each of three runs (3.909 -> 3.867 ms)
    "attn_decode": {
        "sm90": {"BLOCK_N": 64, "BLOCK_Q": 1, "num_warps": 4, "num_stages": 3, "SPLIT_PROGRAMS": 1056,
                 "MERGE_LAST": 1, "KEYS_M": 1, "PAGE_AHEAD": 1},
        "gfx942": {"BLOCK_N": 64, "BLOCK_Q": 1, "num_warps": 4, "num_stages": 2, "SPLIT_PROGRAMS": 1216},
        "gfx950": {"BLOCK_N": 64, "BLOCK_Q": 1, "num_warps": 4, "num_stages": 2, "SPLIT_PROGRAMS": 1024},
    },
    # FP8 KV on the H200 (docs/perf.md): page ids carried one tile ahead (PAGE_AHEAD); one-warp programs
    # of 32-key tiles, 2 stages (no cross-warp reduction in the loop, as MSA decode; 189 registers, 10 per SM):
    # b64 32K: 0.746-0.751 -> 0.714 ms against 4-warp programs of 128-key tiles at 3 stages.
    # ALL_SLOTS (K/V loads without per-key predicates; the loop is issue-bound) and then 3 stages (198 registers, no
    # spill): b64 32K: 0.735 (masked, 2 stages) -> 0.656-0.675 (ALL_SLOTS) -> 0.608 ms;
    # 0.741 -> 0.617 ms in another run (128K: 2.95 -> 2.65); 4 stages: 0.717 (7 programs per SM fit: two waves)
    "attn_decode:fp8": {"sm90": {"BLOCK_N": 32, "num_warps": 1, "num_stages": 3, "SPLIT_PROGRAMS": 1056,
                                 "PAGE_AHEAD": 1, "ALL_SLOTS": 1}},
    # prefill / verification: BLOCK_Q query tokens x the group's heads as the MMA's M rows. On AMD a 128 x 64
    # FP8 tile spills (the fp8 -> fp16 converts and the pipeliner's register prefetch): 128 x 32, one stage.
    "attn_prefill": {
        "sm90": {"BLOCK_N": 64, "BLOCK_Q": 8, "num_warps": 8, "num_stages": 2, "SPLIT_PROGRAMS": 264},
        "gfx942": {"BLOCK_N": 32, "BLOCK_Q": 8, "num_warps": 8, "num_stages": 1, "SPLIT_PROGRAMS": 608},
        "gfx950": {"BLOCK_N": 32, "BLOCK_Q": 8, "num_warps": 8, "num_stages": 1, "SPLIT_PROGRAMS": 512},
    },
    # FP8 KV on the H200, a 2048-token chunk behind a 128K prefix (docs/perf.md, "Long context"): 4 tokens x 16 heads
    # against 128-key tiles in one warpgroup, 2 stages: 57.3 -> 31.4 ms; tiles before each program's first query
    # unmasked (BULK): 28.7 (152 -> 305 TFLOP/s). 3 stages, 8 warps or 2-token tiles were slower; page ids carried
    # ahead made no difference. The scores as an FP8 dot of q, scaled per row, with the cached keys (Q_FP8) ran 22.1
    # ms (394 TFLOP/s), but e4m3 q moves logits by ~4 % of their size (relative L2 of the output against the
    # reference 0.9e-3 -> 2.5e-3, elements off by 0.08 on unit-scale inputs): off by default, a tuning switch.
    "attn_prefill:fp8": {"sm90": {"BLOCK_N": 128, "BLOCK_Q": 4, "num_warps": 4, "num_stages": 2, "BULK": 1}},
    # MSA: same kernel walking the selected blocks; decode splits the top-k over programs
    "sparse_decode": {
        "sm90": {"BLOCK_N": 64, "BLOCK_Q": 1, "num_warps": 4, "num_stages": 3, "SPLIT_PROGRAMS": 528, "MERGE_LAST": 1},
        "gfx942": {"BLOCK_N": 64, "BLOCK_Q": 1, "num_warps": 4, "num_stages": 2, "SPLIT_PROGRAMS": 1216},
        "gfx950": {"BLOCK_N": 64, "BLOCK_Q": 1, "num_warps": 4, "num_stages": 2, "SPLIT_PROGRAMS": 1024},
    },
    # FP8 on the H200 (docs/perf.md): block ids read once and page ids carried a tile ahead (PAGE_AHEAD);
    # four one-warp programs per (token, KV head), each walking 4 blocks in 32-key tiles, merged by the last to
    # finish (MERGE_LAST): no cross-warp max, sum or P exchange in the loop, all 1024 in one wave (187 registers x
    # 32 threads, 21 KB: 10 per SM). At b64 32K / 128K: 0.0530 / 0.0522 -> 0.0491 / 0.0491 ms
    # device time (62 -> 67 % of the read floor, 1.25x -> 1.34x SDPA pre-gathered) against two 2-warp
    # programs of 64-key tiles; 2048 programs (two waves), 16-key tiles, 4 stages, register caps: slower.
    # ALL_SLOTS as dense FP8: the same from DRAM (0.0489-0.0495 vs 0.0487-0.0497 ms), with
    # every page in L2 0.0430 -> 0.0418; 2 / 4 stages, 2048 programs under a 128 / 168-register cap: slower.
    # PDL: launched as a programmatic dependent, waiting for the previous kernel before reading anything (b64,
    # with the merge's partial loads no longer waiting for their weights, 32K 0.0473-0.0475 -> 0.0459-
    # 0.0461 ms, 128K 0.0472 -> 0.0460; PDL off / on: 0.0477 / 0.0470-0.0471, 128K 0.0479 / 0.0470)
    # FEW_BELOW: with fewer than 1024 programs at 16 splits (batch < 16), 2-warp programs of 64-key tiles
    # (32K, device ms against SDPA pre-gathered: b1 0.0180 -> 0.0095 (0.40 -> 0.75x; 4 warps 0.0088),
    # b8 0.0250 -> 0.0134 (0.46 -> 0.85x; 4 warps 0.0176); b16 / b32 keep the one-warp shape: 0.0222 / 0.0341, 1.09 /
    # 1.04x, against 0.0301 / 0.0476 with 4 warps)
    # GLUON_MAX_SEQS: plain-layout calls of at most this many sequences run the Gluon kernel
    # (gluon_sparse_decode.py; 32K graph replays, Triton -> Gluon: b1 0.0103 -> 0.0072 ms, b16 0.0227 -> 0.0177;
    # at b64 Gluon is slower, 0.0460 -> 0.0666 at best)
    "sparse_decode:fp8": {"sm90": {"BLOCK_N": 32, "num_warps": 1, "num_stages": 3, "SPLIT_PROGRAMS": 1024,
                                   "PAGE_AHEAD": 1, "MERGE_LAST": 1, "ALL_SLOTS": 1, "PDL": 1,
                                   "FEW_BELOW": 1024, "FEW_BLOCK_N": 64, "FEW_WARPS": 2, "GLUON_MAX_SEQS": 16}},
    # sm90: 4 query tokens x 16 heads (one warpgroup's 64 MMA rows): a tile's block union is smaller, so less work
    # on blocks other rows chose (H200, 32K tokens: 46.8 -> 29.9 ms random selections, 12.7 -> 12.1 smooth)
    "sparse_prefill": {
        "sm90": {"BLOCK_N": 64, "BLOCK_Q": 4, "num_warps": 4, "num_stages": 2, "SPLIT_PROGRAMS": 264},
        "gfx942": {"BLOCK_N": 32, "BLOCK_Q": 8, "num_warps": 8, "num_stages": 1, "SPLIT_PROGRAMS": 608},
        "gfx950": {"BLOCK_N": 32, "BLOCK_Q": 8, "num_warps": 8, "num_stages": 1, "SPLIT_PROGRAMS": 512},
    },
    "attn_merge": {
        "sm90": {"num_warps": 4},
        "gfx942": {"num_warps": 4},
        "gfx950": {"num_warps": 4},
    },
    # indexer scan: BLOCK_Q query tokens x index heads as rows, one selection block of keys per step,
    # SPLIT_PROGRAMS programs over (token tiles x block chunks)
    "indexer_scan": {
        "sm90": {"BLOCK_Q": 4, "num_warps": 4, "num_stages": 3, "SPLIT_PROGRAMS": 1056},
        "gfx942": {"BLOCK_Q": 4, "num_warps": 4, "num_stages": 2, "SPLIT_PROGRAMS": 2432},
        "gfx950": {"BLOCK_Q": 4, "num_warps": 4, "num_stages": 2, "SPLIT_PROGRAMS": 2048},
    },
    # FP8 keys on the H200 (docs/perf.md): page ids carried one block ahead (two 16 KB key tiles in
    # flight per program) and every program resident at once (5 per SM: 640 at b64; 1024 made 1.5 waves, 768
    # 1.2): the scan went from 0.316 to 0.278 ms at b64 128K
    "indexer_scan:fp8": {"sm90": {"SPLIT_PROGRAMS": 660, "PAGE_AHEAD": 1}},
    "indexer_prefill": {
        "sm90": {"BLOCK_Q": 16, "num_warps": 4, "num_stages": 3, "SPLIT_PROGRAMS": 1056},
        "gfx942": {"BLOCK_Q": 16, "num_warps": 4, "num_stages": 2, "SPLIT_PROGRAMS": 2432},
        "gfx950": {"BLOCK_Q": 16, "num_warps": 4, "num_stages": 2, "SPLIT_PROGRAMS": 2048},
    },
    "indexer_topk": {
        "sm90": {"num_warps": 4},
        "gfx942": {"num_warps": 4},
        "gfx950": {"num_warps": 4},
    },
}

# MoE / quantization / norm families (router.py, moe.py, quant.py, norm.py).
# fp8_gemm_*: M <= 16 (decode: stream the weight once, many N blocks), M <= 256, larger (tensor-core bound).
# moe_*: one dict drives both GEMMs: BLOCK_M rows of (token, expert) pairs; GU_* the gate+up GEMM (BLOCK_N
# intermediate columns, i.e. 2 x BLOCK_N weight rows), DN_* the down GEMM. moe_decode runs without the sort (one
# pair per program) up to MAX_TOKENS tokens; moe_small / moe_prefill sort pairs by expert, padded to BLOCK_M.
# MX_FP8: MXFP4 experts through the fp8 tensor cores (e4m3 from the nibbles by integer ops, fp8 activations) instead
# of tl.dot_scaled, which upcasts to bf16 on Hopper: sm90 only (gfx950 has MX matrix cores; gfx942's fp8 is fnuz),
# prefill only until measured at decode: there the sm90 SASS of the gate_up GEMM is 3032 instructions (mma.sync)
# against dot_scaled's 2088 (wgmma), and decode is bound by the per-weight conversion, not the MMA.
TILES.update({
    # BLOCK_K: the widest row tile (a row up to this wide is read in one step)
    "fp8_quant": {a: {"BLOCK_K": 16384, "num_warps": 16} for a in ("sm90", "gfx942", "gfx950")},
    # PDL (sm90): the fp8-output norm launches as a programmatic dependent, as the FP8 GEMM after it (norm.py)
    "rms_norm": {"sm90": {"num_warps": 8, "PDL": 1}, "gfx942": {"num_warps": 8}, "gfx950": {"num_warps": 8}},
    # the vision tower's q/k/v split + RoPE (vision_rope.py): BLOCK_P rows x BLOCK_C columns of the packed
    # projection per program, elementwise (bound by the read and write of qkv)
    "vision_rope": {a: {"BLOCK_P": 16, "BLOCK_C": 256, "num_warps": 4} for a in ("sm90", "gfx942", "gfx950")},
    "router": {a: {"BLOCK_T": 16, "num_warps": 4} for a in ("sm90", "gfx942", "gfx950")},
    "moe_align": {a: {"CHUNK": 256, "num_warps": 4} for a in ("sm90", "gfx942", "gfx950")},
    # MXFP4 -> fp8 experts once per prefill step (mx_convert.mx_to_fp8, where a moe_* table sets MX_CONVERT)
    # H200: 3.2 / 3.1 ms for M3's 129-expert stack (checkpoint / planes layout), 3.5 / 3.6 TB/s
    "mx_to_fp8": {"sm90": {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8}},
    # decode: split K until SPLIT_PROGRAMS programs stream the weight (about the resident CTAs: split_k in quant.py),
    # STAGGER the K order per column block (spreads the shared activation reads over L2); SWAP_AB (sm90): weight
    # rows as the MMA's M, so 64 x 16 fp8 wgmma straight from shared memory (no f16 upcast, no mma.sync).
    # PDL (sm90): launched as a programmatic dependent, PREFETCH weight tiles into L2 before griddepcontrol.wait
    # (quant.py); the activation quantization of fp8_linear launches so too. H200 (quantization
    # included, M = 1 / 16): o_proj 18.4 / 19.9 -> 16.8 / 17.8 us, dense down 24.4 / 26.0 -> 23.4 / 24.2, qkv+index
    # 20.8 / 22.0 -> 19.4 / 19.9 with PDL, 2 tiles prefetched and 264 programs (2 per SM; 396 with PDL: 16.6 / 19.1);
    # prefetching 1, 2 or 4 tiles within 1 %, 330 programs and unsplit 16-column tiles slower.
    # TMA (sm90, swap-AB): the weight tile by one tensor copy per stage; that frees the registers and threads a
    # deeper cp.async pipeline cost, so 4 stages pay (quantization included, M = 1 / 4 / 16:
    # o_proj 16.3 / 16.7 / 17.1 -> 15.5 / 16.0 / 17.1 us, dense down 22.7 / 23.0 / 23.5 -> 21.6 / 22.0 / 23.2, qkv+index
    # 19.1 / 19.3 / 19.3 -> 17.2 / 17.2 / 18.0; 5 stages, the activation by TMA too, 128-row tiles, 8 warps, the
    # quantization inside the GEMM and stream-K lost)
    "fp8_gemm_decode": {
        "sm90": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4, "num_stages": 4,
                 "SPLIT_PROGRAMS": 264, "STAGGER": 1, "SWAP_AB": 1, "PDL": 1, "PREFETCH": 1, "TMA": 1},
        "gfx942": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4, "num_stages": 2,
                   "SPLIT_PROGRAMS": 1216, "STAGGER": 1},
        "gfx950": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4, "num_stages": 2,
                   "SPLIT_PROGRAMS": 1024, "STAGGER": 1},
    },
    # decode GEMMs with N <= quant.NARROW_N (o_proj, the dense down: 96 column tiles of 64) take these over the above:
    # no split (SPLIT_PROGRAMS 0: 96 programs, one per column block, 1 per SM at 6 stages = 120 KB), so no partial
    # exchange at the end. H200, quantization included, M = 1 / 4 / 16: o_proj 16.1 / 16.2 / 17.1
    # (split in 2, 4 stages) -> 15.1 / 15.1 / 15.9 us, the GEMM alone 16.3 / 16.2 / 16.8 -> 14.1 / 14.2 / 14.4; dense
    # down 21.6 / 22.1 / 23.2 -> 21.4 / 21.6 / 22.1 (5 stages: 15.5 / 15.7 / 16.0 and 21.9 / 22.2 / 22.6)
    "fp8_gemm_decode:narrow": {"sm90": {"SPLIT_PROGRAMS": 0, "num_stages": 6}},
    # decode GEMMs with N >= quant.WIDE_N (the dense gate_up: 384 column tiles) run more programs than fit 2 per SM
    # at 4 stages (80 KB each): 3 stages keep 3 per SM in one wave (4 stages 43.0 vs 38.0 us)
    "fp8_gemm_decode:wide": {"sm90": {"num_stages": 3}},
    "fp8_gemm_mid": {
        "sm90": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
        "gfx942": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 2},
        "gfx950": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 2},
    },
    "fp8_gemm_prefill": {
        "sm90": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        "gfx942": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 2},
        "gfx950": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 2},
    },
    # H200 sweep (docs/perf.md): the sorted path already wins at 4 tokens; K tiles of 256 with 3 stages
    "moe_decode": {
        a: {"MAX_TOKENS": 2, "BLOCK_M": 16, "GU_BLOCK_N": 64, "GU_BLOCK_K": 256 if a == "sm90" else 128,
            "DN_BLOCK_N": 64, "DN_BLOCK_K": 256 if a == "sm90" else 128, "num_warps": 4,
            "num_stages": 3 if a == "sm90" else 2, "MX_FP8": 0}
        for a in ("sm90", "gfx942", "gfx950")
    },
    "moe_small": {
        a: {"MAX_TOKENS": 256, "BLOCK_M": 16, "GU_BLOCK_N": 64, "GU_BLOCK_K": 128, "DN_BLOCK_N": 64,
            "DN_BLOCK_K": 64, "num_warps": 4, "num_stages": 4 if a == "sm90" else 2, "MX_FP8": 0}
        for a in ("sm90", "gfx942", "gfx950")
    },
    # MXFP4 in the planes layout (sm90 decode, moe.py): PLANES_SWAP puts the weight rows in the MMA's M (fp16 wgmma
    # with the converted weights as the register operand), PLANES_XPERM hands the activations over in the planes
    # column order (H200: 3.02-3.72x torch._grouped_mm bf16 at T = 1..64, vs 1.40-1.70x for
    # tl.dot_scaled; without XPERM 166-1832 us, with 98-1188 us)
    "moe_decode:planes": {"sm90": {"PLANES_SWAP": 1, "PLANES_XPERM": 1}},
    "moe_small:planes": {"sm90": {"PLANES_SWAP": 1, "PLANES_XPERM": 1}},
    "moe_prefill:planes": {"sm90": {"BLOCK_M": 64, "GU_BLOCK_N": 64, "DN_BLOCK_N": 64, "num_warps": 4,
                                    "num_stages": 2, "PLANES_SWAP": 1}},
    # bf16 and the tl.dot_scaled formats: two 128 x 64 accumulators (gate, up), K tiles of 64
    "moe_prefill": {
        a: {"BLOCK_M": 128, "GU_BLOCK_N": 64, "GU_BLOCK_K": 64, "DN_BLOCK_N": 128, "DN_BLOCK_K": 64,
            "num_warps": 8, "num_stages": 3 if a == "sm90" else 2, "MX_FP8": int(a == "sm90")}
        for a in ("sm90", "gfx942", "gfx950")
    },
    # bf16 experts (their own entry: the MX formats share moe_prefill's tiles), H200 (8K tokens,
    # docs/perf.md): gate|up as one 256-wide interleaved MMA (FUSED_GU, GU_BLOCK_N 128: 144 KB of shared memory at K
    # tiles of 64, 3 stages) and 256-wide down tiles: 13.04 -> 10.74 ms (128-wide fused gate|up alone 12.57)
    "moe_prefill:bf16": {"sm90": {"FUSED_GU": 1, "GU_BLOCK_N": 128, "DN_BLOCK_N": 256}},
    # fp8 activations (fp8 experts, MXFP4 through the fp8 tensor cores), H200 (8K tokens, docs/perf.md):
    # the per-row fp8 intermediate (H_ROW) with K tiles of 128, gate|up as one 256-wide interleaved MMA (FUSED_GU,
    # GU_BLOCK_N 128: 2 x 128 weight rows), MXFP4 converted to fp8 once per step (MX_CONVERT): fp8 experts 10.25 ->
    # 7.08 ms, MXFP4 16.8 -> 10.0 ms (converting per token tile: 12.9; MX_CONVERT 2, the down weights on a side
    # stream, did not help: 11.56 vs 11.43 at GU_BLOCK_N 64)
    "moe_prefill:fp8": {"sm90": {"GU_BLOCK_N": 128, "GU_BLOCK_K": 128, "DN_BLOCK_K": 128, "FUSED_GU": 1, "H_ROW": 1,
                                 "MX_CONVERT": 1}},
})


# Table entries a Triton release cannot compile for a target, or compiles with register spills (found by
# `python -m m3sdk_kernels.aot` run under each release): "family" (the family's own entry, asked without a variant:
# here the MX expert formats) or "family:variant" -> arch -> (the oldest release known to build the entry, why not
# before, the parameters used instead below it). `tiles` applies them, so such a variant never runs there.
TRITON_LIMITS: dict[str, dict[str, tuple[tuple[int, int], str, dict[str, int]]]] = {
    # triton 3.6, gfx942: tl.dot_scaled (MXFP4 and MXFP8 down GEMMs) with K tiles of 64 fails to lower
    # ("failed to translate module to LLVM IR": an unrealized_conversion_cast of the scale operand); 128 builds
    "moe_small": {"gfx942": ((3, 9), "tl.dot_scaled with K tiles of 64 does not lower to LLVM IR on gfx942",
                             {"DN_BLOCK_K": 128})},
    # triton 3.6, gfx942: the MX gate_up GEMM of 128-row tiles spills 104 (MXFP4) / 156 (MXFP8) bytes at 2 stages
    # (1 stage: MXFP8 still 16); 64-row tiles at 1 stage spill neither (triton 3.9 spills at neither table entry)
    "moe_prefill": {"gfx942": ((3, 9), "the MX gate_up GEMM of 128-row tiles spills registers on gfx942",
                               {"BLOCK_M": 64, "num_stages": 1})},
}


def triton_version() -> tuple[int, int]:
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def triton_limit(family: str, arch: Arch) -> tuple[str, dict[str, int]] | None:
    """(why, the parameters used instead) where the installed Triton cannot build `family`'s table entry on
    `arch`, else None."""
    limit = TRITON_LIMITS.get(family, {}).get(arch.name)
    if limit is None or triton_version() >= limit[0]:
        return None
    return limit[1], limit[2]


@functools.cache
def _overrides() -> dict[str, dict[str, int]]:
    """M3SDK_KERNEL_TILES='{"family": {"num_stages": 1}}' overrides table entries on every arch: for tuning runs
    on a device without editing this file."""
    return json.loads(os.environ.get("M3SDK_KERNEL_TILES") or "{}")


def tiles(family: str, arch: Arch | None = None, variant: str | None = None) -> dict[str, int]:
    """Launch parameters of a kernel family on `arch` (default: the current device's); a `variant` (e.g. the KV
    dtype) applies the table's "family:variant" entry over the family's, where the arch has one; then what the
    installed Triton needs instead (`TRITON_LIMITS`)."""
    arch = arch or current_arch()
    cfg = TILES[family][arch.name]
    if variant is not None:
        cfg = cfg | TILES.get(f"{family}:{variant}", {}).get(arch.name, {})
    limit = triton_limit(family if variant is None else f"{family}:{variant}", arch)
    if limit is not None:
        cfg = cfg | limit[1]
    return cfg | _overrides().get(family, {})
