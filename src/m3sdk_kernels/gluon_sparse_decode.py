"""MSA FP8 decode attention over the paged KV cache in Gluon (sm90): `paged_attention(..., block_sel=...)` for one
query token per sequence, the plain layout and an FP8 cache with per-token scales.

A program owns one token, one KV head and a slice of the token's selected blocks (split-KV, merged by LSE with
paged_attention's `_merge_kernel`). The GROUP (<= 16) query heads of the KV head are the M of mma.sync m16n8k16
(a wgmma's 64 rows would be three quarters padding). Unlike the Triton kernel, the schedule is explicit:

1. Key table: the slice's block ids and their page ids are read once, up front, into shared memory as one slot id
   (page * 16 + offset) per key, -1 where the key is not visible (a -1 block, or past the context). Every K/V
   address of the program is then known before the first tile is computed: no per-tile chain of dependent
   global loads (block id -> page id -> K/V).
2. Ring of NUM_BUF shared-memory stages filled by cp.async (16-byte vectors of K and V rows, 4-byte scales),
   NUM_BUF - 1 tiles in flight while one is computed. Invisible keys are masked copies: no memory traffic,
   zeros in shared memory, -inf scores.
3. Per tile: S = Q K^T (fp16 operands: the e4m3 -> fp16 convert is exact), scaled per key by k_scale, an online
   base-2 softmax, and O += (P * v_scale * fp8_max) V; the output divides fp8_max out once (p * v_scale alone
   would leave fp16's normal range).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .layout import PAGE_SIZE
from .paged_attention import merge_splits, split_partials

# Names that newer Gluon changed: a CTA-wide barrier (`thread_barrier` in triton 3.6) and the cp.async copy
# (`async_copy_global_to_shared` in 3.6)
try:
    from triton.experimental.gluon.language import barrier as _cta_barrier
    from triton.experimental.gluon.language.nvidia.ampere.async_copy import async_load as _cp_async
except ImportError:
    from triton.experimental.gluon.language import thread_barrier as _cta_barrier
    from triton.experimental.gluon.language.nvidia.ampere.async_copy import async_copy_global_to_shared as _cp_async

MMA_M = gl.constexpr(16)  # rows of mma.sync: the query heads of one KV head, padded
_PAGE = gl.constexpr(PAGE_SIZE)


@gluon.jit
def _issue_tile(tab, k_smem, v_smem, ks_smem, vs_smem, tile: gl.constexpr, k_base, v_base, ks_base, vs_base,
                stride_cp, stride_sp, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, N_TILES: gl.constexpr,
                NUM_BUF: gl.constexpr, CP: gl.constexpr, SCALE: gl.constexpr):
    """Start the copies of key tile `tile` into ring stage tile % NUM_BUF as one cp.async group; past the slice,
    an empty group, so that the wait counts stay the same for every tile."""
    if tile < N_TILES:
        keys = tab.slice(tile * BLOCK_N, BLOCK_N)
        slot = keys.load(gl.SliceLayout(1, CP))
        ok = slot >= 0
        page = gl.maximum(slot, 0) // _PAGE
        off = gl.maximum(slot, 0) % _PAGE
        row = page.to(gl.int64) * stride_cp + off * HEAD_DIM  # plain layout: [pages, kv_heads, 16, HEAD_DIM]
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, CP))
        kv_off = row[:, None] + d[None, :]
        _cp_async(k_smem.index(tile % NUM_BUF), k_base + kv_off, mask=ok[:, None])
        _cp_async(v_smem.index(tile % NUM_BUF), v_base + kv_off, mask=ok[:, None])
        slot_s = keys.load(SCALE)
        s_off = (gl.maximum(slot_s, 0) // _PAGE).to(gl.int64) * stride_sp + gl.maximum(slot_s, 0) % _PAGE
        _cp_async(ks_smem.index(tile % NUM_BUF), ks_base + s_off, mask=slot_s >= 0)
        _cp_async(vs_smem.index(tile % NUM_BUF), vs_base + s_off, mask=slot_s >= 0)
    async_copy.commit_group()


@gluon.jit
def _sparse_decode_kernel(
        q_ptr, k_cache, v_cache, k_scale, v_scale, page_table, ctx_lens, sel_ptr, out_ptr, part_o, part_lse,
        qk_scale, num_tokens, stride_qt, stride_qh, stride_ot, stride_oh, stride_pt, stride_cp, stride_ch, stride_sp,
        stride_sh, stride_sel_h, stride_sel_t,
        NUM_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_SPLITS: gl.constexpr, TOPK: gl.constexpr, SEL_BLOCK: gl.constexpr, V_MUL: gl.constexpr,
        NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr):
    seq = gl.program_id(0)  # one query token per sequence: token i is sequence i
    h = gl.program_id(1)
    split = gl.program_id(2)
    BLOCKS_PER: gl.constexpr = TOPK // NUM_SPLITS
    TILES_PER: gl.constexpr = SEL_BLOCK // BLOCK_N
    N_TILES: gl.constexpr = BLOCKS_PER * TILES_PER

    # Register layouts. MMA: warps side by side along N (keys for S, head dims for O); rows are never split.
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    # S = Q K^T at k_width 4 (an 8-bit element's 32-bit word): K loads from shared memory by ldmatrix as FP8 and
    # upcasts in registers (q takes the same permutation of K). O += P V at k_width 2 (fp16's): P goes from the
    # accumulator layout to the operand layout in registers.
    Q_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    K_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    V_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    # copies: 16 FP8 elements (16 bytes) of a K/V row per thread
    TPW_D: gl.constexpr = HEAD_DIM // 16 if HEAD_DIM // 16 < 32 else 32
    CP: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_D, TPW_D], [NUM_WARPS, 1], [1, 0])
    SCALE: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    TAB: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])

    # Shared memory: the key table, and the ring of K/V tiles and their scales
    KV_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])  # of each row
    tab = gl.allocate_shared_memory(gl.int32, [N_TILES * BLOCK_N], FLAT)
    k_smem = gl.allocate_shared_memory(k_cache.dtype.element_ty, [NUM_BUF, BLOCK_N, HEAD_DIM], KV_SMEM)
    v_smem = gl.allocate_shared_memory(v_cache.dtype.element_ty, [NUM_BUF, BLOCK_N, HEAD_DIM], KV_SMEM)
    ks_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF, BLOCK_N], FLAT)
    vs_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF, BLOCK_N], FLAT)

    # 1. key table: slot id of every key of the slice, -1 where invisible
    ctx = gl.load(ctx_lens + seq)
    local = gl.arange(0, N_TILES * BLOCK_N, layout=TAB)  # key index inside the slice
    sel_row = sel_ptr + h * stride_sel_h + seq.to(gl.int64) * stride_sel_t + split * BLOCKS_PER
    blk = gl.load(sel_row + local // SEL_BLOCK)
    key = blk * SEL_BLOCK + local % SEL_BLOCK
    visible = (blk >= 0) & (key < ctx)
    page = gl.load(page_table + seq.to(gl.int64) * stride_pt + key // _PAGE, mask=visible, other=0)
    tab.store(gl.where(visible, page * _PAGE + key % _PAGE, -1))
    _cta_barrier()

    k_base = k_cache + h * stride_ch
    v_base = v_cache + h * stride_ch
    ks_base = k_scale + h * stride_sh
    vs_base = v_scale + h * stride_sh
    for j in gl.static_range(NUM_BUF - 1):
        _issue_tile(tab, k_smem, v_smem, ks_smem, vs_smem, j, k_base, v_base, ks_base, vs_base, stride_cp,
                    stride_sp, HEAD_DIM, BLOCK_N, N_TILES, NUM_BUF, CP, SCALE)

    # q: the GROUP heads of this KV head as rows (padding rows zero), fp16 for the dot
    r = gl.arange(0, MMA_M, layout=gl.SliceLayout(1, Q_OP))
    dq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, Q_OP))
    q = gl.load(q_ptr + seq.to(gl.int64) * stride_qt + (h * GROUP + r)[:, None] * stride_qh + dq[None, :],
                mask=(r < GROUP)[:, None], other=0.0).to(gl.float16)

    m_i = gl.full([MMA_M], float("-inf"), gl.float32, ROW)
    l_i = gl.full([MMA_M], 0.0, gl.float32, ROW)
    acc = gl.full([MMA_M, HEAD_DIM], 0.0, gl.float32, MMA)
    # unrolled: every shared-memory view is static, and the scheduler sees across tiles
    for i in gl.static_range(N_TILES):
        # tile i's group is complete once at most NUM_BUF - 2 later groups are pending; the barrier makes every
        # thread's copies visible, and tells that every warp is done with tile i - 1, whose stage the copies
        # issued next (tile i + NUM_BUF - 1) overwrite
        async_copy.wait_group(NUM_BUF - 2)
        _cta_barrier()
        _issue_tile(tab, k_smem, v_smem, ks_smem, vs_smem, i + NUM_BUF - 1, k_base, v_base, ks_base, vs_base,
                    stride_cp, stride_sp, HEAD_DIM, BLOCK_N, N_TILES, NUM_BUF, CP, SCALE)
        k_t = k_smem.index(i % NUM_BUF).permute((1, 0)).load(K_OP).to(gl.float16)  # K^T [HEAD_DIM, BLOCK_N]
        s = mma_v2(q, k_t, gl.full([MMA_M, BLOCK_N], 0.0, gl.float32, MMA))
        ks = ks_smem.index(i % NUM_BUF).load(COL)
        ok = tab.slice(i * BLOCK_N, BLOCK_N).load(COL) >= 0
        s = gl.where(ok[None, :], s * (ks * qk_scale)[None, :], float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet keep weight 0
        p = gl.exp2(s - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 1)
        vs = vs_smem.index(i % NUM_BUF).load(COL)
        p = gl.convert_layout((p * (vs * V_MUL)[None, :]).to(gl.float16), P_OP)
        # V [BLOCK_N, HEAD_DIM] is the transposed operand: 8-bit elements have no transposing ldmatrix, so it
        # loads in 16-byte rows, upcasts, and goes to the operand layout as fp16 (ldmatrix.trans)
        v = gl.convert_layout(v_smem.index(i % NUM_BUF).load(CP).to(gl.float16), V_OP)
        acc = mma_v2(p, v, acc * alpha[:, None])
        m_i = m_new
    async_copy.wait_group(0)

    o = acc / (gl.where(l_i > 0, l_i, 1.0) * V_MUL)[:, None]
    ro = gl.arange(0, MMA_M, layout=ROW)
    do = gl.arange(0, HEAD_DIM, layout=COL)
    head = h * GROUP + ro
    row_ok = (ro < GROUP)[:, None]
    if NUM_SPLITS == 1:
        gl.store(out_ptr + seq.to(gl.int64) * stride_ot + head[:, None] * stride_oh + do[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok)
    else:
        # partials in _merge_kernel's layout: [NUM_SPLITS, tokens, NUM_HEADS, HEAD_DIM], base-2 LSE
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        prow = (split * num_tokens + seq.to(gl.int64)) * NUM_HEADS + head
        gl.store(part_o + prow[:, None] * HEAD_DIM + do[None, :], o, mask=row_ok)
        gl.store(part_lse + prow, lse, mask=ro < GROUP)


def supports(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None, layout: str,
             block_sel: torch.Tensor | None, block_size: int, max_seqlen_q: int, num_seqs: int) -> bool:
    """Whether this kernel serves a paged_attention call: MSA decode, one token per sequence, plain FP8 pages with
    scales, at most 16 query heads per KV head, a power-of-two head dim of 16+ and a power-of-two top-k."""
    if block_sel is None or k_scale is None or layout != "plain" or k_cache.element_size() != 1:
        return False
    t, hq, d = q.shape
    group = hq // k_cache.shape[1]
    topk = block_sel.shape[-1]
    return (max_seqlen_q == 1 and t == num_seqs and group <= MMA_M and d >= 16 and d == triton.next_power_of_2(d)
            and topk == triton.next_power_of_2(topk) and block_size % 16 == 0
            and block_size == triton.next_power_of_2(block_size))


MAX_TILES = 32  # key tiles per program: the tile loop is unrolled (static shared-memory views)


# Tiles by batch, timed on the H200 at a 32K context (docs/kernels.md "Gluon"): up to FEW_TOKENS tokens, 4-warp
# programs over 64-key tiles in 3 stages, 512 programs (b1: 0.0072 ms against 0.0096 for the one-warp default);
# above, one warp over 16-key tiles in 4 stages, 1,024 programs (b16: 0.0177 against 0.0230 for the 4-warp tiles)
FEW_TOKENS = 4
FEW_TILES = {"block_n": 64, "num_buf": 3, "num_warps": 4, "split_programs": 512}
MANY_TILES = {"block_n": 16, "num_buf": 4, "num_warps": 1, "split_programs": 1024}


def plan(num_tokens: int, num_kv_heads: int, topk: int, block_size: int, **tiles: int) -> dict:
    """Launch shape: the batch's default tiles with `tiles` (block_n, num_buf, num_warps, split_programs) over
    them; splits of the top-k list (a power of two dividing it) until the programs fill `split_programs`, and at
    least enough that no program walks more than MAX_TILES key tiles of `block_n`."""
    cfg = (FEW_TILES if num_tokens <= FEW_TOKENS else MANY_TILES) | tiles
    block_n = min(cfg["block_n"], block_size)
    want = max(1, cfg["split_programs"] // max(1, num_tokens * num_kv_heads),
               topk * (block_size // block_n) // MAX_TILES)
    splits = min(triton.next_power_of_2(want), topk)
    return {"NUM_SPLITS": splits, "BLOCK_N": block_n, "NUM_BUF": cfg["num_buf"], "num_warps": cfg["num_warps"]}


def sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor,
                  block_sel: torch.Tensor, block_size: int = 128, out: torch.Tensor | None = None,
                  **tiles: int) -> torch.Tensor:
    """`paged_attention(q, ..., block_sel=block_sel)` for the case `supports` accepts (one query token per
    sequence: q [B, Hq, D], block_sel [Hkv, B, topk] of distinct block ids, -1 padded). `tiles` overrides `plan`'s
    defaults (block_n, num_buf, num_warps, split_programs)."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    topk = block_sel.shape[-1]
    cfg = plan(t, hkv, topk, block_size, **tiles)
    if out is None:
        out = torch.empty_like(q)
    if t == 0:
        return out
    splits = cfg["NUM_SPLITS"]
    part_o, part_lse = split_partials(splits, out)
    _sparse_decode_kernel[(t, hkv, splits)](
        q, k_cache, v_cache, k_scale, v_scale, page_table, context_lens, block_sel, out, part_o, part_lse,
        scale * 1.4426950408889634, t, q.stride(0), q.stride(1), out.stride(0), out.stride(1), page_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_scale.stride(0), k_scale.stride(1), block_sel.stride(0),
        block_sel.stride(1),
        NUM_HEADS=hq, HEAD_DIM=d, GROUP=hq // hkv, BLOCK_N=cfg["BLOCK_N"], NUM_SPLITS=splits, TOPK=topk,
        SEL_BLOCK=block_size, V_MUL=torch.finfo(v_cache.dtype).max, NUM_BUF=cfg["NUM_BUF"],
        NUM_WARPS=cfg["num_warps"], num_warps=cfg["num_warps"])
    if splits > 1:
        merge_splits(part_o, part_lse, out)
    return out


def compile_sm90(num_tokens: int = 64, num_kv_heads: int = 4, num_heads: int = 64, head_dim: int = 128,
                 topk: int = 16, block_size: int = 128, **tiles: int):
    """Ahead-of-time compile for sm90 (no GPU needed): the CompiledKernel of the launch `sparse_decode` makes at
    these shapes (M3's by default), bf16 q/out, e4m3 K/V."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = plan(num_tokens, num_kv_heads, topk, block_size, **tiles)
    fn = _sparse_decode_kernel
    types = {"q_ptr": "*bf16", "k_cache": "*fp8e4nv", "v_cache": "*fp8e4nv", "k_scale": "*fp32", "v_scale": "*fp32",
             "page_table": "*i32", "ctx_lens": "*i32", "sel_ptr": "*i32", "out_ptr": "*bf16", "part_o": "*fp32",
             "part_lse": "*fp32", "qk_scale": "fp32"}
    constexprs = {"NUM_HEADS": num_heads, "HEAD_DIM": head_dim, "GROUP": num_heads // num_kv_heads,
                  "BLOCK_N": cfg["BLOCK_N"], "NUM_SPLITS": cfg["NUM_SPLITS"], "TOPK": topk, "SEL_BLOCK": block_size,
                  "V_MUL": 448.0, "NUM_BUF": cfg["NUM_BUF"], "NUM_WARPS": cfg["num_warps"]}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    # pointers 16-byte aligned and strides multiples of 16, as the JIT specializes them at run time
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if signature[n].startswith("*") or n.startswith("stride_")}
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})
