"""FP8 W8A8 GEMMs (per-token activations x per-channel weights) and the per-row FP8 quantization kernels.

A weight [N, K] is stored as fp8 with one float32 scale per output channel (row) (`formats.quantize_fp8_weight`),
an activation [M, K] is quantized per token on the fly (`scale = amax / fp8_max`, the same rule as the FP8 KV
cache), and the GEMM multiplies both scales in its epilogue: y = (x_q @ w_q.T) * x_scale[:, None] * w_scale[None, :].
The number formats themselves (FP8 rows, MXFP4, MXFP8) are defined in formats.py; the MX GEMMs live in moe.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .arch import Arch, current_arch, pdl_launch, tiles

# The interpreter's bf16 tl.dot is wrong (see docs/kernels.md): kernels upcast dot operands to fp32 there.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------------------------------
# Triton


@triton.jit
def fp8_grid(x, INTERPRET: tl.constexpr):
    """x (fp32, already within the fp8 range) as the kernel casts it to e4m3. The interpreter's fp32 -> e4m3
    cast loses the carry of a round-up into the exponent (31.5 -> 16): there, round to the e4m3fn grid in fp32
    first (3 mantissa bits, nearest-even; subnormals below 2^-6 in steps of 2^-9) so its cast is exact."""
    if INTERPRET:
        b = x.to(tl.uint32, bitcast=True)
        normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        sub = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0  # 1.5 * 2^23: fp32 addition rounds to integers
        x = tl.where(tl.abs(x) < 0.015625, sub, normal)
    return x


@triton.jit
def bf16_grid(x, INTERPRET: tl.constexpr):
    """x (fp32) as the GPU's fp32 -> bf16 cast rounds it (nearest-even). The interpreter's cast truncates: there,
    round in fp32 first so its cast is exact."""
    if INTERPRET:
        b = x.to(tl.uint32, bitcast=True)
        x = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _bf16(x, INTERPRET: tl.constexpr):
    # x rounded to bf16 as torch rounds each op's result on bf16 tensors, kept in fp32
    return bf16_grid(x, INTERPRET).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _row_values(x_ptr, row, stride_x, cols, K, SWIGLU: tl.constexpr, GELU: tl.constexpr, alpha, limit,
                INTERPRET: tl.constexpr):
    # fp32 values of row `row` at `cols` (zero past K): x itself, or (SWIGLU) the SwiGLU-OAI of x = [gate | up]
    # (width 2K) rounded after every op as `reference.swiglu_oai_ref` is on bf16 tensors, or (GELU) the exact (erf)
    # GELU of x computed in fp32 and rounded to bf16 once, as torch's gelu is on a bf16 tensor
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:
        up = tl.load(x_ptr + row * stride_x + K + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.minimum(x, limit)
        glu = _bf16(g * _bf16(tl.sigmoid(_bf16(alpha * g, INTERPRET)), INTERPRET), INTERPRET)
        x = _bf16(_bf16(tl.minimum(tl.maximum(up, -limit), limit) + 1.0, INTERPRET) * glu, INTERPRET)
    if GELU:
        x = _bf16(0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476)), INTERPRET)
    return x


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, alpha, limit, FP8_MAX: tl.constexpr,
                       BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr, SWIGLU: tl.constexpr, GELU: tl.constexpr,
                       PDL: tl.constexpr, INTERPRET: tl.constexpr):
    # one row per program: amax over the row, then the quantized row. PDL (CUDA, launched as a programmatic
    # dependent): the next kernel (the FP8 GEMM) may launch at once and prefetch its weights; x, which the previous
    # kernel writes, is read only after griddepcontrol.wait
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    if ONE_TILE:  # the row in one tile: its values are read (and, SWIGLU / GELU, computed) once, kept in registers
        x = _row_values(x_ptr, row, stride_x, cols, K, SWIGLU, GELU, alpha, limit, INTERPRET)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / FP8_MAX
        q = fp8_grid(tl.clamp(x / scale, -FP8_MAX, FP8_MAX), INTERPRET)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    else:
        amax = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            amax = tl.maximum(amax, tl.abs(_row_values(x_ptr, row, stride_x, k0 + cols, K, SWIGLU, GELU, alpha, limit,
                                                       INTERPRET)))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
        for k0 in range(0, K, BLOCK_K):  # the second read hits L1/L2
            x = _row_values(x_ptr, row, stride_x, k0 + cols, K, SWIGLU, GELU, alpha, limit, INTERPRET)
            q = fp8_grid(tl.clamp(x / scale, -FP8_MAX, FP8_MAX), INTERPRET)
            tl.store(q_ptr + row * stride_q + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)
    tl.store(s_ptr + row, scale)


def _quant_rows(x: torch.Tensor, k: int, fp8_dtype: torch.dtype | None, pdl: bool,
                swiglu: tuple[float, float] | None, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    fp8_dtype = fp8_dtype or current_arch(x.device).fp8_dtype
    m = x.shape[0]
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        t = tiles("fp8_quant", current_arch(x.device))
        # the whole row in one tile where it fits: one read (a row of M3's 6144 in 1024-wide steps was 12
        # dependent loads, most of the 4-8 us the launch cost at decode)
        block = min(triton.next_power_of_2(k), t["BLOCK_K"])
        launch = pdl_launch(pdl, x)
        alpha, limit = swiglu or (0.0, 0.0)
        _quant_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), alpha, limit,
                                 FP8_MAX=torch.finfo(fp8_dtype).max, BLOCK_K=block, ONE_TILE=k <= block,
                                 SWIGLU=swiglu is not None, GELU=gelu, PDL=bool(launch), INTERPRET=INTERPRET,
                                 num_warps=t["num_warps"], **launch)
    return q, s


def quantize_fp8_per_token(x: torch.Tensor, fp8_dtype: torch.dtype | None = None,
                           pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `quantize_fp8_per_token_ref` (x [M, K] with unit last stride). `pdl`: launched as a
    programmatic dependent (CUDA), for an FP8 GEMM launched so behind it (`fp8_linear`)."""
    return _quant_rows(x, x.shape[1], fp8_dtype, pdl, None)


def swiglu_quantize_fp8(gate_up: torch.Tensor, alpha: float, limit: float, fp8_dtype: torch.dtype | None = None,
                        pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `swiglu_quantize_fp8_ref` (one launch: the FP8 down projection's input from its gate_up
    output; bf16 rows with unit last stride, each op rounded to bf16 as the reference rounds it)."""
    return _quant_rows(gate_up, gate_up.shape[1] // 2, fp8_dtype, pdl, (alpha, limit))


def gelu_quantize_fp8(x: torch.Tensor, fp8_dtype: torch.dtype | None = None,
                      pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `gelu_quantize_fp8_ref` (one launch: the input of the FP8 linear after a GELU, e.g. the
    vision encoder's fc2, from the linear before it; bf16 rows with unit last stride)."""
    return _quant_rows(x, x.shape[1], fp8_dtype, pdl, None, gelu=True)


@triton.jit
def _prefetch_l2(w_ptr, cols, k0, stride_wn, BLOCK_K: tl.constexpr):
    # the weight tile at K offset k0 into L2, one 128-byte line per address (CUDA: prefetch.global.L2)
    lines = k0 + tl.arange(0, BLOCK_K // 128) * 128
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [w_ptr + cols[:, None] * stride_wn + lines[None, :]],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M"])  # one binary for every decode M (M == 1 is not special)
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_desc, w_scale_ptr, bias_ptr, c_ptr, ws_ptr, count_ptr, M, N, K,
                     stride_am, stride_wn, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, STAGGER: tl.constexpr,
                     SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    # program -> (output tile, K split): the SPLIT_K programs of one tile are neighbours
    pid = tl.program_id(0)
    pid_k = pid % SPLIT_K
    tile = pid // SPLIT_K
    # grouped tile order: GROUP_M row blocks walk the same weight columns while those are in L2
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % size_m
    pid_n = (tile % group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    # Rows past M are masked (zero-filled, no memory traffic): at M = 1 a decode tile's 15 padding rows used to
    # re-read row 0, so every program hit the same two activation lines at every K step (M = 1 ran 1.6x slower
    # than M = 16 on the H200). The row mask is constant along K, so the loads stay full-width vectors.
    # Weight columns past N re-read column 0 instead (unmasked; never stored; TMA reads zeros there).
    rows = tl.where(row_ok, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    # this split's K tiles (never empty: split_k picks equal runs)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = pid_k * per_split
    count = tl.minimum(per_split, k_tiles - first)
    # the scales up front, off the chain at the end of the weight stream (split-K arrival, partial reads, store)
    w_scale = tl.load(w_scale_ptr + cols)
    if PDL:
        # launched as a programmatic dependent (CUDA): this grid may start while the previous kernel finishes.
        # Only the weights (which no kernel writes) are read before griddepcontrol.wait: the first PREFETCH tiles
        # of this split go to L2 while the previous kernel's tail runs; the activation, the output and the shared
        # counters are touched after it
        for p in tl.static_range(PREFETCH):
            _prefetch_l2(w_ptr, cols, (first + (p + pid_n * STAGGER) % count) * BLOCK_K, stride_wn, BLOCK_K)
        tl.extra.cuda.gdc_wait()
    a_scale = tl.load(a_scale_ptr + rows)
    if SWAP_AB:  # weight rows as the MMA's M (Hopper: wgmma, fp8 operands straight from shared memory)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:  # tokens as the MMA's M (a 16-row tile: mma.sync on Hopper, the fp8 upcast to f16 first)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in range(0, count):
        # STAGGER (decode) walks the split's K tiles from a per-column-block offset, wrapping, so the programs that
        # run together read different activation lines rather than all the same one
        j = i
        if STAGGER:
            j = (i + pid_n) % count
        ks = (first + j) * BLOCK_K + offs_k
        if SWAP_AB:
            a_ptrs = a_ptr + rows[None, :] * stride_am + ks[:, None]
            w_ptrs = w_ptr + cols[:, None] * stride_wn + ks[None, :]
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[None, :] & (ks[:, None] < K), other=0.0)
            if w_desc is not None:  # TMA: the weight tile by one tensor copy, not 8 cp.async per thread
                w = w_desc.load([pid_n * BLOCK_N, (first + j) * BLOCK_K])
            elif EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=ks[None, :] < K, other=0.0)
            acc = tl.dot(w, a, acc)
        else:
            a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :]
            w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None]
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
                w = tl.load(w_ptrs, mask=ks[:, None] < K, other=0.0)
            acc = tl.dot(a, w, acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    if PDL:
        # every program past its weight stream: the next kernel may launch and prefetch while this one reduces
        tl.extra.cuda.gdc_launch_dependents()

    out_mask = row_ok[:, None] & (offs_n[None, :] < N)
    done = True
    if SPLIT_K > 1:
        # split-K in one launch: every split leaves its fp32 partial in the workspace; the last of the tile's
        # splits to arrive (a counter per tile, reset by that program for the next launch) sums them
        part = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        ws_tile = ws_ptr + tile.to(tl.int64) * SPLIT_K * BLOCK_M * BLOCK_N
        tl.store(ws_tile + pid_k * BLOCK_M * BLOCK_N + part, acc, mask=row_ok[:, None])
        tl.debug_barrier()  # every thread's partial is written before the (single-thread) release below
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
        if done:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            # unrolled: every split's partial requested at once (one round trip, not SPLIT_K); .cg: the other SMs'
            # partials from L2, never a stale L1 line
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(ws_tile + s * BLOCK_M * BLOCK_N + part, mask=row_ok[:, None], other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)
    if done:
        acc = acc * a_scale[:, None] * w_scale[None, :]
        if bias_ptr is not None:  # added in fp32 before the one rounding to the output dtype
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=out_mask)


# Split-K arrival counters, one int32 per output tile, zero between launches (the last split of a tile resets
# its own). One buffer per device, so launches that use it must run one at a time (one stream: the engine's).
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MAX_TILES = 1 << 16


def _counters(device: torch.device) -> torch.Tensor:
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a buffer made during capture would be zeroed only when that graph replays
            raise RuntimeError("fp8_gemm: run it once on this device before capturing a CUDA graph")
        _COUNTERS[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[device]


NARROW_N = 6144  # decode GEMMs this narrow have few column tiles: their "fp8_gemm_decode:narrow" tiles
WIDE_N = 16384  # decode GEMMs this wide have more column tiles than 2 programs per SM: "fp8_gemm_decode:wide"


def decode_variant(n: int) -> str | None:
    """The `fp8_gemm_decode` table variant for a GEMM with N output columns."""
    return "narrow" if n <= NARROW_N else "wide" if n >= WIDE_N else None


def _gemm_tiles(m: int, n: int, arch: Arch) -> dict[str, int]:
    # decode (the job is streaming the weight once), mid, prefill (the job is tensor-core rate)
    if m <= 16:
        return tiles("fp8_gemm_decode", arch, decode_variant(n))
    return tiles("fp8_gemm_mid" if m <= 256 else "fp8_gemm_prefill", arch)


def split_k(tiles_mn: int, k: int, t: dict[str, int]) -> int:
    """K splits per output tile: enough programs for SPLIT_PROGRAMS (several per SM, so the weight stream has
    enough loads in flight and no SM ends a wave alone), in equal runs of K tiles (no empty split)."""
    k_tiles = triton.cdiv(k, t["BLOCK_K"])
    split = max(1, min(k_tiles, t.get("SPLIT_PROGRAMS", 0) // tiles_mn))
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))


def fp8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of `fp8_gemm_ref` (a `bias` [N], contiguous, is added in the epilogue). Where the tiles say PDL
    (sm90 decode) it launches as a programmatic dependent of the kernel before it; where they say TMA (sm90 decode,
    swap-AB), the weight tiles come by TMA."""
    m, k = x_q.shape
    n = w_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    t = _gemm_tiles(m, n, current_arch(x_q.device))
    tiles_mn = triton.cdiv(m, t["BLOCK_M"]) * triton.cdiv(n, t["BLOCK_N"])
    split = split_k(tiles_mn, k, t)
    counters = _counters(x_q.device)
    if split > 1 and tiles_mn > counters.numel():
        raise ValueError(f"fp8_gemm: {tiles_mn} output tiles, the split-K counters hold {counters.numel()}")
    # fp32 partials of every split (unused without a split: any fp32 pointer will do)
    ws = torch.empty(tiles_mn * split * t["BLOCK_M"] * t["BLOCK_N"] if split > 1 else 1, dtype=torch.float32,
                     device=x_q.device)
    launch = pdl_launch(t.get("PDL", 0), x_q)
    pdl = bool(launch)
    w_desc = None
    # TMA needs 16-byte aligned row strides (K % 16 for fp8 rows); other widths take the cp.async loads
    if t.get("TMA", 0) and t.get("SWAP_AB", 0) and x_q.is_cuda and not INTERPRET and w_q.stride(0) % 16 == 0:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w_desc = TensorDescriptor.from_tensor(w_q, [t["BLOCK_N"], t["BLOCK_K"]])
    _fp8_gemm_kernel[(tiles_mn * split,)](
        x_q, x_scale, w_q, w_desc, w_scale, bias, out, ws, counters, m, n, k, x_q.stride(0), w_q.stride(0),
        out.stride(0),
        BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"], GROUP_M=t["GROUP_M"], SPLIT_K=split,
        STAGGER=t.get("STAGGER", 0), SWAP_AB=t.get("SWAP_AB", 0), EVEN_K=k % t["BLOCK_K"] == 0, PDL=pdl,
        PREFETCH=t.get("PREFETCH", 0) if pdl else 0, num_warps=t["num_warps"], num_stages=t["num_stages"],
        **launch)
    return out


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of `fp8_linear_ref`: quantize x per token unless it comes quantized (from the norm); where
    the GEMM launches as a programmatic dependent (PDL), the quantization launches so too, so the GEMM's weight
    prefetch overlaps it."""
    if x_scale is None:
        pdl = bool(_gemm_tiles(x.shape[0], w_q.shape[0], current_arch(x.device)).get("PDL", 0))
        x, x_scale = quantize_fp8_per_token(x, w_q.dtype, pdl=pdl)
    return fp8_gemm(x, x_scale, w_q, w_scale, out_dtype, bias)


# ---------------------------------------------------------------------------------------------------------
# Ahead-of-time variants (python -m m3sdk_kernels.aot)


def aot_variants(arch: Arch) -> list:
    from .aot import AotVariant

    fp8 = f"*{arch.fp8_triton}"
    pdl = arch.backend == "cuda"  # griddepcontrol: CUDA only (the decode GEMM's table decides at run time)
    # rows of M3's widths, one tile each: the hidden size, the dense MLP's intermediate 12288 (SwiGLU) and the vision
    # MLP's intermediate 5120 (GELU)
    out = []
    t = tiles("fp8_quant", arch)
    for name, swiglu, gelu, k in (("", False, False, 6144), ("_swiglu", True, False, 12288),
                                  ("_gelu", False, True, 5120)):
        block = min(triton.next_power_of_2(k), t["BLOCK_K"])
        out.append(AotVariant(
            f"quant_fp8_rows{name}", _quant_rows_kernel,
            {"x_ptr": "*bf16", "q_ptr": fp8, "s_ptr": "*fp32", "K": "i32", "stride_x": "i32", "stride_q": "i32",
             "alpha": "fp32", "limit": "fp32"},
            {"FP8_MAX": arch.fp8_max, "BLOCK_K": block, "ONE_TILE": k <= block, "SWIGLU": swiglu, "GELU": gelu,
             "PDL": pdl, "INTERPRET": False},
            num_warps=t["num_warps"], aligned=("K", "stride_x", "stride_q")))
    # (family, variant, N, K, bias): decode at the packed qkv+index projection, narrow at o_proj, wide at the dense
    # gate_up; mid / prefill at o_proj (8192 -> 6144, the smallest N of the model's FP8 GEMMs); prefill with a bias at
    # the vision encoder's fc1 (1280 -> 5120); each with the split the dispatch picks there
    for family, variant, n, k, bias in (("fp8_gemm_decode", None, 9856, 6144, False),
                                        ("fp8_gemm_decode", "narrow", 6144, 8192, False),
                                        ("fp8_gemm_decode", "wide", 24576, 6144, False),
                                        ("fp8_gemm_mid", None, 6144, 8192, False),
                                        ("fp8_gemm_prefill", None, 6144, 8192, False),
                                        ("fp8_gemm_prefill", None, 5120, 1280, True)):
        t = tiles(family, arch, variant)
        split = split_k(triton.cdiv(n, t["BLOCK_N"]), k, t)
        pdl = bool(t.get("PDL", 0))
        tma = bool(t.get("TMA", 0) and t.get("SWAP_AB", 0))
        types = {"a_ptr": fp8, "a_scale_ptr": "*fp32", "w_ptr": fp8, "w_scale_ptr": "*fp32", "c_ptr": "*bf16",
                 "ws_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
                 "stride_wn": "i32", "stride_cm": "i32"}
        if tma:  # a host TensorDescriptor argument
            types["w_desc"] = f"tensordesc<{arch.fp8_triton}[{t['BLOCK_N']}, {t['BLOCK_K']}]>"
        if bias:
            types["bias_ptr"] = "*bf16"
        name = f"{family}{':' + variant if variant else ''} split {split}" + " tma" * tma + " bias" * bias
        out.append(AotVariant(
            name, _fp8_gemm_kernel, types,
            {**({} if tma else {"w_desc": None}), **({} if bias else {"bias_ptr": None}), "BLOCK_M": t["BLOCK_M"],
             "BLOCK_N": t["BLOCK_N"], "BLOCK_K": t["BLOCK_K"], "GROUP_M": t["GROUP_M"], "SPLIT_K": split,
             "STAGGER": t.get("STAGGER", 0), "SWAP_AB": t.get("SWAP_AB", 0), "EVEN_K": True, "PDL": pdl,
             "PREFETCH": t.get("PREFETCH", 0) if pdl else 0},
            num_warps=t["num_warps"], num_stages=t["num_stages"], aligned=("K", "stride_am", "stride_wn", "stride_cm")))
    return out
