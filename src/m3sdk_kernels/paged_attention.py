"""Causal attention of ragged query chunks over the paged KV cache: dense, or MSA-sparse with `block_sel`."""

import functools
import os
from types import ModuleType

import torch
import triton
import triton.language as tl

from .arch import Arch, pdl_launch, tiles
from .layout import PAGE, dim_tile, shuffle_width, slot_offsets

# ---------------------------------------------------------------------------------------------- Triton kernels
#
# One kernel serves dense and MSA attention, decode and (chunked) prefill. A program owns BLOCK_Q consecutive
# query tokens of one sequence and the GROUP query heads of one KV head: its BLOCK_Q x BLOCK_H rows are the M of
# every tl.dot, so the 16 heads of an M3 GQA group share each K/V tile load. Split-KV (flash-decoding) runs
# NUM_SPLITS programs over disjoint key ranges, and a merge kernel combines their partial outputs by LSE, or
# (MERGE_LAST) the last of a tile's programs to finish does, counted by an atomic (no second launch).
# Dense programs walk their keys in BLOCK_N tiles; MSA programs walk the sorted union of their tokens' selected
# blocks, so a block chosen by several tokens of the tile is loaded once for all of them (block-major inside a
# query tile), and each row only sees the blocks its own token chose. Softmax is base 2 (scale * log2 e folded).
# FP8 K/V: tiles convert to fp16 (exact for e4m3) for the dots; per-token scales multiply score columns (K) and
# probability columns (V, times fp8_max so p stays in fp16's normal range; the output divides it out).

_BIG = tl.constexpr(1 << 30)  # "no block" in the MSA union walk


@triton.jit
def seq_of_block(cu_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The sequence owning q-block `pid`, where sequence i's q-blocks start at cu[i] // BLOCK_Q + i (an upper
    bound on the blocks it needs, so the grid size follows from shapes alone; surplus blocks find no tokens)."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(cu_ptr + mid)
        if BLOCK_Q > 1:
            start = start // BLOCK_Q + mid
        if start <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def q_tile(cu_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Program `pid`'s query tile: (sequence, its first token in the batch, its token count, the tile's first
    query inside the sequence). A tile with first >= count is surplus and does nothing."""
    seq = seq_of_block(cu_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(cu_ptr + seq)
    n_q = tl.load(cu_ptr + seq + 1) - q_start
    if BLOCK_Q == 1:
        first = pid - q_start
    else:
        first = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    return seq, q_start, n_q, first


@triton.jit
def tile_pages(pages_ptr, start, kv_end, BLOCK_N: tl.constexpr):
    """Page ids of keys start .. start + BLOCK_N - 1: the sequence's pages (the last one's tail included), its last
    page again past them (its first with kv_end 0): a page of the sequence's own, whatever reads it unmasked."""
    n = start + tl.arange(0, BLOCK_N)
    return tl.load(pages_ptr + tl.minimum(n // PAGE, tl.maximum(tl.cdiv(kv_end, PAGE) - 1, 0)))


@triton.jit
def _block_end(blk, kv_end, SEL_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key end of selected block `blk` (-1: none, end 0): the sequence's end, or the block's own where its tiles
    overrun it (a block that is not a multiple of BLOCK_N, e.g. 8 or 48 keys: the tile's tail is masked)."""
    if SEL_BLOCK % BLOCK_N == 0:
        end = tl.where(blk >= 0, kv_end, 0)
    else:
        end = tl.where(blk >= 0, tl.minimum(kv_end, (blk + 1) * SEL_BLOCK), 0)
    return end


@triton.jit
def _sel_tile(blks, jb, i, pages_ptr, kv_end, TILES_PER: tl.constexpr, SEL_BLOCK: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """(first key, key end, page ids) of tile i of an MSA decode slice whose block ids + 1 (0: none) are `blks`,
    indexed by `jb`: a block past the slice or a -1 entry gives an empty tile (end 0)."""
    blk = tl.sum(tl.where(jb == i // TILES_PER, blks, 0)) - 1
    start = tl.maximum(blk, 0) * SEL_BLOCK + (i % TILES_PER) * BLOCK_N
    end = _block_end(blk, kv_end, SEL_BLOCK, BLOCK_N)
    return start, end, tile_pages(pages_ptr, start, end, BLOCK_N)


@triton.jit
def dims_ok(d, DIM: tl.constexpr, PAD: tl.constexpr):
    """The lanes of a padded head vector (arange(0, PAD)) that hold one of its DIM dimensions: a constant true
    where DIM is a power of two (no predicate in the loads), `d < DIM` otherwise."""
    if PAD == DIM:
        ok = tl.full(d.shape, 1, tl.int1)
    else:
        ok = d < DIM
    return ok


@triton.jit
def _v_tile(v_base, page, off, d, d_ok, key_ok, in_pages, stride_cp, HEAD_DIM: tl.constexpr, X: tl.constexpr,
            SHUFFLE: tl.constexpr):
    """V rows of a tile's keys as [BLOCK_N, HEAD_DIM] (page ids `page`, int64, slots `off`)."""
    if SHUFFLE and X == PAGE:
        # 8-bit SHUFFLE V is key-major inside a page ([1, HEAD_DIM, 16]): load V^T, whose 16-key runs are 16-byte
        # vectors, and give the dot its transpose, an operand contiguous along its reduction (the keys). Loaded
        # as [BLOCK_N, HEAD_DIM], it went through byte loads and register transposes (H200, b64 32K: 2.08 -> 1.08
        # ms). The compiler cannot see that the gathered page ids repeat over a page, so the runs are stated, and
        # the mask is per page (a per-key mask would split the vectors): the unwritten tail of a sequence's last
        # page is read with p = 0 there, which is why Contract 1 keeps every slot finite. bf16 SHUFFLE (runs of 8)
        # ran slower this way on the H200 (1.79 -> 2.63 ms), so it keeps the row load.
        vo = page[None, :] * stride_cp + slot_offsets(off[None, :], d[:, None], HEAD_DIM, X, SHUFFLE, True)
        v = tl.load(v_base + tl.max_contiguous(tl.multiple_of(vo, [1, X]), [1, X]),
                    mask=in_pages[None, :] & d_ok[:, None], other=0.0)
        v = tl.trans(v)
    else:
        v = tl.load(v_base + page[:, None] * stride_cp + slot_offsets(off[:, None], d[None, :], HEAD_DIM, X,
                                                                       SHUFFLE, True),
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    return v


@triton.jit
def _attend_tile(acc, m_i, l_i, q, start, kv_end, pos, row_sel, k_base, v_base, ks_base, vs_base, page,
                 qk_scale, stride_cp, stride_sp, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 X: tl.constexpr,
                 SHUFFLE: tl.constexpr, FP8: tl.constexpr, V_MUL: tl.constexpr, DOT: tl.constexpr,
                 KEYS_M: tl.constexpr, ALL_SLOTS: tl.constexpr, MASKED: tl.constexpr = True,
                 Q_FP8: tl.constexpr = False):
    """Online-softmax update of (acc, m_i, l_i) with keys start .. start + BLOCK_N - 1 (< kv_end).

    MASKED=False: every key of the tile is below kv_end and visible to every row (a tile before the program's first
    query): no masks, and every row's maximum is finite. Q_FP8: q is FP8 (rows scaled into its range) and the scores
    come from an FP8 dot with the cached keys as they are; `qk_scale` is then a per-row vector (q's scale times the
    softmax scale).

    KEYS_M (bf16 decode; sm90's dense default): the keys are the MMA's M (a decode tile's 16 rows are too few for
    an sm90 wgmma's 64): q is q^T [HEAD_DIM, BLOCK_M], acc is O^T [HEAD_DIM, BLOCK_M], and l is kept per key
    ([BLOCK_N, BLOCK_M]), summed over the keys after the loop (no cross-warp sum per tile)."""
    n = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_PAD)
    d_ok = dims_ok(d, HEAD_DIM, D_PAD)
    key_ok = n < kv_end
    in_pages = n // PAGE < tl.cdiv(kv_end, PAGE)  # the keys of the sequence's pages, tails of the last included
    page = page.to(tl.int64)
    off = n % PAGE
    # ALL_SLOTS: K/V loaded unmasked (no per-row predicates): keys past kv_end read the tail of the sequence's last
    # page or (past its pages) that page again, finite values (Contract 1) that the masked scores weigh by p = 0.
    # The scale loads keep their masks (unmasked too, the sm90 dense kernel spilled), except in MASKED=False tiles.
    if ALL_SLOTS or not MASKED:
        ld_ok = tl.full([BLOCK_N], 1, tl.int1)
    else:
        ld_ok = key_ok
    if MASKED:
        scale_ok = key_ok
    else:
        scale_ok = ld_ok
    k = tl.load(k_base + page[:, None] * stride_cp + slot_offsets(off[:, None], d[None, :], HEAD_DIM, X, SHUFFLE,
                                                                   False),
                mask=ld_ok[:, None] & d_ok[None, :], other=0.0)
    if KEYS_M:
        s = tl.dot(k.to(DOT), q) * qk_scale  # S^T [BLOCK_N, BLOCK_M]
        s = tl.where(key_ok[:, None] & (n[:, None] <= pos[None, :]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[None, :])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha[None, :] + p
        v = _v_tile(v_base, page, off, d, d_ok, ld_ok, in_pages, stride_cp, HEAD_DIM, X, SHUFFLE)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v).to(DOT), p.to(DOT))  # O^T
    else:
        if Q_FP8:
            s = tl.dot(q, tl.trans(k)) * qk_scale[:, None]
        else:
            s = tl.dot(q, tl.trans(k.to(DOT)))
        if FP8:
            ks = tl.load(ks_base + page * stride_sp + off, mask=scale_ok, other=0.0)
            if Q_FP8:
                s *= ks[None, :]
            else:
                s *= (ks * qk_scale)[None, :]
        else:
            s *= qk_scale
        if MASKED:
            visible = key_ok[None, :] & (n[None, :] <= pos[:, None]) & row_sel[:, None]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at weight 0
        else:
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _v_tile(v_base, page, off, d, d_ok, ld_ok, in_pages, stride_cp, HEAD_DIM, X, SHUFFLE)
        if FP8:
            # p * v_scale * fp8_max = p * amax of the token's V row: in fp16 range for any sane activation, and
            # no per-tile reduction (the caller divides the output by V_MUL = fp8_max once)
            vs = tl.load(vs_base + page * stride_sp + off, mask=scale_ok, other=0.0)
            pv = tl.dot((p * (vs * V_MUL)[None, :]).to(DOT), v.to(DOT))
        else:
            pv = tl.dot(p.to(DOT), v.to(DOT))
        acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


# token and sequence counts change with every step: not specialized (a first step at a new count would compile a
# variant; they index and mask, and alignment comes from the constexpr widths)
@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _attn_kernel(
        q_ptr, k_cache, v_cache, k_scale, v_scale, page_table, cu_q, ctx_lens, sel_ptr, out_ptr, part_o, part_lse,
        arrivals, qk_scale, num_seqs, num_tokens, stride_qt, stride_qh, stride_ot, stride_oh, stride_pt, stride_cp,
        stride_ch, stride_sp, stride_sh, stride_sel_h, stride_sel_t,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, X: tl.constexpr,
        SHUFFLE: tl.constexpr, FP8: tl.constexpr, SPARSE: tl.constexpr, TOPK: tl.constexpr,
        TOPK_PAD: tl.constexpr, SEL_BLOCK: tl.constexpr, V_MUL: tl.constexpr, DOT: tl.constexpr,
        PAGE_AHEAD: tl.constexpr, MERGE_LAST: tl.constexpr, KEYS_M: tl.constexpr, ALL_SLOTS: tl.constexpr,
        ONE_EACH: tl.constexpr, PDL: tl.constexpr, BULK: tl.constexpr = False, Q_FP8: tl.constexpr = False):
    if PDL:  # launched as a programmatic dependent (CUDA): the next kernel may launch at once; this one reads
        # nothing before the previous kernel is done
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    if ONE_EACH:
        # decode, one query token per sequence (cu_q = 0, 1, ..): program i is sequence i. The search of cu_q is 6
        # dependent loads ahead of the first page ids at b64 (H200, b64 32K: MSA FP8 0.0490-0.0496
        # -> 0.0480-0.0481 ms, dense unchanged)
        seq = pid
        q_start = pid
        n_q = 1
        first = 0
    else:
        seq, q_start, n_q, first = q_tile(cu_q, num_seqs, pid, BLOCK_Q)
    if first < n_q:
        BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
        ctx = tl.load(ctx_lens + seq)
        r = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        d_ok = dims_ok(d, HEAD_DIM, D_PAD)
        qi = first + r // BLOCK_H  # query index inside the sequence
        head = h * GROUP + r % BLOCK_H
        row_ok = (qi < n_q) & (r % BLOCK_H < GROUP)
        tok = (q_start + qi).to(tl.int64)  # x the token stride: past 2**31 in a step of ~218K tokens
        pos = ctx - n_q + qi
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        qk = qk_scale
        if KEYS_M:
            q = tl.trans(q.to(DOT))
            acc = tl.zeros([D_PAD, BLOCK_M], dtype=tl.float32)
        elif Q_FP8:
            # each row scaled to the FP8 range by its own amax (V_MUL is the FP8 maximum); the row's scale joins the
            # softmax scale, applied to the dot's fp32 scores
            qf = q.to(tl.float32)
            q_row = tl.maximum(tl.max(tl.abs(qf), 1), 1e-30) / V_MUL
            q = (qf / q_row[:, None]).to(k_cache.dtype.element_ty)
            qk = q_row * qk_scale
            acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        else:
            q = q.to(DOT)
            acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        kv_end = ctx - n_q + tl.minimum(first + BLOCK_Q, n_q)  # keys past the tile's last query are unseen
        k_base = k_cache + h * stride_ch
        v_base = v_cache + h * stride_ch
        ks_base = k_scale + h * stride_sh
        vs_base = v_scale + h * stride_sh
        pages_ptr = page_table + seq.to(tl.int64) * stride_pt
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if KEYS_M:
            l_i = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if SPARSE and BLOCK_Q == 1:
            # decode: the token's own selection in list order (the online softmax does not care), a fixed slice
            # of it per split; -1 entries are fully masked tiles. Without PAGE_AHEAD each tile loads its block
            # and page ids in its own iteration; with it, the slice's block ids are read once before the loop and
            # each tile's page ids one tile ahead (see the dense loop), so K/V copies of later tiles can fly
            TILES_PER: tl.constexpr = (SEL_BLOCK + BLOCK_N - 1) // BLOCK_N
            BLOCKS_PER: tl.constexpr = (TOPK + NUM_SPLITS - 1) // NUM_SPLITS
            sel_row = sel_ptr + h * stride_sel_h + (q_start + first).to(tl.int64) * stride_sel_t
            row_sel = r >= 0
            lo = split * BLOCKS_PER
            n_tiles = (tl.minimum(lo + BLOCKS_PER, TOPK) - lo) * TILES_PER
            if PAGE_AHEAD:
                jb = tl.arange(0, TOPK_PAD // NUM_SPLITS)  # >= BLOCKS_PER: splits are powers of 2, <= TOPK_PAD
                blks = tl.load(sel_row + lo + jb, mask=(jb < BLOCKS_PER) & (lo + jb < TOPK), other=-1) + 1
                start, end, page = _sel_tile(blks, jb, 0, pages_ptr, kv_end, TILES_PER, SEL_BLOCK, BLOCK_N)
            for i in range(0, n_tiles):
                if PAGE_AHEAD:
                    nxt_start, nxt_end, nxt = _sel_tile(blks, jb, i + 1, pages_ptr, kv_end, TILES_PER, SEL_BLOCK,
                                                        BLOCK_N)
                else:
                    blk = tl.load(sel_row + lo + i // TILES_PER)
                    start = tl.maximum(blk, 0) * SEL_BLOCK + (i % TILES_PER) * BLOCK_N
                    end = _block_end(blk, kv_end, SEL_BLOCK, BLOCK_N)
                    page = tile_pages(pages_ptr, start, end, BLOCK_N)
                acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start, end, pos, row_sel, k_base, v_base, ks_base,
                                             vs_base, page, qk, stride_cp, stride_sp, HEAD_DIM, D_PAD,
                                             BLOCK_N, X, SHUFFLE, FP8, V_MUL, DOT, KEYS_M, ALL_SLOTS)
                if PAGE_AHEAD:
                    start, end, page = nxt_start, nxt_end, nxt
        elif SPARSE:
            # prefill / verification: walk the sorted union of the tile's tokens' blocks, each loaded once
            qq = first + tl.arange(0, BLOCK_Q)
            kk = tl.arange(0, TOPK_PAD)
            sel = tl.load(sel_ptr + h * stride_sel_h + (q_start + qq)[:, None] * stride_sel_t + kk[None, :],
                          mask=(qq < n_q)[:, None] & (kk < TOPK)[None, :], other=-1)
            sel = tl.where(sel >= 0, sel, _BIG)
            PER: tl.constexpr = (BLOCK_Q * TOPK + NUM_SPLITS - 1) // NUM_SPLITS
            lo_rank = split * PER
            cur = tl.min(tl.min(sel, 1), 0)
            rank = 0
            while (cur < _BIG) & (rank < lo_rank + PER):
                if rank >= lo_rank:
                    hit = tl.sum((sel == cur).to(tl.int32), 1) > 0
                    row_sel = tl.reshape(tl.broadcast_to(hit[:, None], (BLOCK_Q, BLOCK_H)), (BLOCK_M,))
                    for sub in range(0, SEL_BLOCK, BLOCK_N):
                        start = cur * SEL_BLOCK + sub
                        if start < kv_end:
                            page = tile_pages(pages_ptr, start, kv_end, BLOCK_N)
                            end = _block_end(cur, kv_end, SEL_BLOCK, BLOCK_N)
                            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start, end, pos, row_sel, k_base,
                                                         v_base, ks_base, vs_base, page, qk, stride_cp,
                                                         stride_sp, HEAD_DIM, D_PAD, BLOCK_N, X, SHUFFLE, FP8, V_MUL,
                                                         DOT, KEYS_M, ALL_SLOTS)
                cur = tl.min(tl.min(tl.where(sel > cur, sel, _BIG), 1), 0)
                rank += 1
        else:
            tiles = tl.cdiv(kv_end, BLOCK_N)
            per = tl.cdiv(tiles, NUM_SPLITS)
            row_sel = r >= 0
            # PAGE_AHEAD: page ids one tile ahead, carried by the loop. K/V loads whose addresses come from a load of
            # their own iteration get one shared-memory buffer at any num_stages (sm90 TTGIR): each tile's copies
            # are issued after the previous tile's dots and waited for at once. Carried, num_stages - 1 tiles are in
            # flight, which FP8 pages need (half the bytes per tile); bf16 measured faster without (docs/perf.md).
            # (Ids carried two tiles ahead made the sm90 pipeliner give up: no cp.async at all.)
            lo = split * per
            hi = tl.minimum(lo + per, tiles)
            page = tile_pages(pages_ptr, lo * BLOCK_N, kv_end, BLOCK_N)
            if BULK:
                # the tiles before the program's first query are seen whole by every row: no masks there. After
                # this loop `page` holds (with PAGE_AHEAD) the page ids of the first masked tile.
                bulk = tl.maximum(tl.minimum((ctx - n_q + first + 1) // BLOCK_N, hi), lo)
                for t in range(lo, bulk):
                    if PAGE_AHEAD:
                        nxt = tile_pages(pages_ptr, (t + 1) * BLOCK_N, kv_end, BLOCK_N)
                    else:
                        page = tile_pages(pages_ptr, t * BLOCK_N, kv_end, BLOCK_N)
                    acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, t * BLOCK_N, kv_end, pos, row_sel, k_base,
                                                 v_base, ks_base, vs_base, page, qk, stride_cp, stride_sp,
                                                 HEAD_DIM, D_PAD, BLOCK_N, X, SHUFFLE, FP8, V_MUL, DOT, KEYS_M,
                                                 ALL_SLOTS, False, Q_FP8)
                    if PAGE_AHEAD:
                        page = nxt
                lo = bulk
            for t in range(lo, hi):
                if PAGE_AHEAD:
                    nxt = tile_pages(pages_ptr, (t + 1) * BLOCK_N, kv_end, BLOCK_N)
                else:
                    page = tile_pages(pages_ptr, t * BLOCK_N, kv_end, BLOCK_N)
                acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, t * BLOCK_N, kv_end, pos, row_sel, k_base, v_base,
                                             ks_base, vs_base, page, qk, stride_cp, stride_sp,
                                             HEAD_DIM, D_PAD, BLOCK_N, X, SHUFFLE, FP8, V_MUL, DOT, KEYS_M,
                                             ALL_SLOTS, True, Q_FP8)
                if PAGE_AHEAD:
                    page = nxt
        if KEYS_M:
            acc = tl.trans(acc)
            l_i = tl.sum(l_i, 0)
        o = acc / (tl.where(l_i > 0, l_i, 1.0) * V_MUL)[:, None]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            row = (split * num_tokens + tok.to(tl.int64)) * NUM_HEADS + head
            tl.store(part_o + row[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(part_lse + row, lse, mask=row_ok)
            if MERGE_LAST:
                # the last of the tile's NUM_SPLITS programs to arrive merges them all, in place of a second launch:
                # every program's partial stores precede (barrier, then a release add) its arrival, and the last one
                # reads them after its acquiring add saw all arrivals. It puts the counter back to 0 for the next call
                # (so a CUDA graph replays with the same buffer), which no other program of this launch touches again.
                count = arrivals + pid * tl.num_programs(1) + h
                tl.debug_barrier()
                if tl.atomic_add(count, 1, sem="acq_rel") == NUM_SPLITS - 1:
                    tl.debug_barrier()
                    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                             _merge_rows(part_o, part_lse, tok.to(tl.int64) * NUM_HEADS + head, num_tokens,
                                         row_ok, NUM_HEADS, HEAD_DIM, D_PAD, NUM_SPLITS,
                                         BLOCK_M).to(out_ptr.dtype.element_ty),
                             mask=row_ok[:, None] & d_ok[None, :])
                    tl.store(count, 0)


@triton.jit
def _merge_rows(part_o, part_lse, row0, num_tokens, row_ok, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                D_PAD: tl.constexpr,
                NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr):
    """LSE-weighted mean of the NUM_SPLITS normalized partial outputs of rows `row0` (token * heads + head) of a
    MERGE_LAST program's tile; L2 loads (.cg): the partials were written by other programs of this launch."""
    d = tl.arange(0, D_PAD)
    tile_ok = row_ok[:, None] & dims_ok(d, HEAD_DIM, D_PAD)[None, :]
    m = tl.load(part_lse + row0, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
    for s in tl.static_range(1, NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_lse + s * num_tokens * NUM_HEADS + row0, mask=row_ok, other=float("-inf"),
                                  cache_modifier=".cg"))
    m = tl.where(m == float("-inf"), 0.0, m)
    o = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    w_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        row = s * num_tokens * NUM_HEADS + row0
        w = tl.exp2(tl.load(part_lse + row, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - m)
        # every split wrote its partial (finite: 0 where it saw no key), so the loads need not wait for w (H200
        # MSA FP8 b64 32K: with PDL 0.0473-0.0475 -> 0.0459-0.0461 ms)
        o += w[:, None] * tl.load(part_o + row[:, None] * HEAD_DIM + d[None, :], mask=tile_ok, other=0.0,
                                  cache_modifier=".cg")
        w_sum += w
    return o / tl.maximum(w_sum, 1e-30)[:, None]


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_kernel(part_o, part_lse, out_ptr, num_tokens, stride_ot, stride_oh, NUM_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """out[t, h] = LSE-weighted mean of the splits' normalized partial outputs (empty splits weigh 0)."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    row = (s.to(tl.int64) * num_tokens + t) * NUM_HEADS + head
    lse = tl.load(part_lse + row, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    o = tl.load(part_o + row[:, None] * HEAD_DIM + d[None, :], mask=(w > 0)[:, None] & (d < HEAD_DIM)[None, :],
                other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(out_ptr + t * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def gluon_decode() -> ModuleType | None:
    """The Gluon MSA decode module, or None where the installed Triton has no Gluon API it builds on."""
    try:
        from . import gluon_sparse_decode
    except ImportError:
        return None
    return gluon_sparse_decode


def interpreting() -> bool:
    """Under TRITON_INTERPRET=1 the kernels do their dots in fp32 (a bf16 tl.dot is wrong in the interpreter)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_dtype(kv_dtype: torch.dtype) -> tl.dtype:
    """Operand type of the attention dots for a KV cache of `kv_dtype`: fp16 for FP8 (the e4m3 -> fp16 convert is
    exact and cheap; -> bf16 is not on Hopper), the cache type otherwise."""
    if interpreting() or kv_dtype == torch.float32:
        return tl.float32
    if kv_dtype.itemsize == 1:
        return tl.float16
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[kv_dtype]


# MERGE_LAST's merge is unrolled over the splits (_merge_rows), and its compile time grows much faster than the
# split count: sm90 on the CPU machine (triton 3.9), dense FP8 decode of one sequence: 1.8 s at 4 splits, 6.3 s at
# 32, 18.9 s at 64, 861 s at 256 (a 32K context); on the H200 (triton 3.6) a first 4K-token request stalled 38 s and
# an 8K one > 140 s in these compiles (docs/perf.md). Past this many splits (few sequences, long
# contexts) the merge kernel, vectorized over the splits, does it: one launch more, compiled in about a second.
MERGE_LAST_MAX_SPLITS = 16


def attention_plan(num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, max_seqlen_q: int,
                   max_context_len: int, sparse: bool, topk: int, block_size: int, fp8: bool = False,
                   arch: Arch | None = None) -> dict:
    """Tile shape and split count of one paged_attention call: a function of shapes and host ints only."""
    family = ("sparse" if sparse else "attn") + ("_decode" if max_seqlen_q <= 1 else "_prefill")
    cfg = tiles(family, arch, "fp8" if fp8 else None)
    block_q = 1 if max_seqlen_q <= 1 else min(cfg["BLOCK_Q"], triton.next_power_of_2(max_seqlen_q))
    block_h = max(triton.next_power_of_2(group), triton.next_power_of_2(triton.cdiv(16, block_q)))
    q_blocks = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    keys_m = int(block_q == 1 and not fp8 and cfg.get("KEYS_M", 0))  # decode only: no row_sel there
    want = max(1, cfg["SPLIT_PROGRAMS"] // max(1, q_blocks * num_kv_heads))

    def shape(tile_n: int) -> tuple[int, int]:
        """(BLOCK_N, split count) at key tiles of tile_n: enough programs to fill the chip, never splits so thin
        that the merge costs more than it spreads."""
        # MSA: tiles no wider than a block rounded up to a power of two; a block that is not a multiple of the tile
        # has its tiles' tails masked (_block_end). At least 16 keys: tl.dot's smallest K on a GPU (the P @ V dot)
        block_n = max(16, min(tile_n, triton.next_power_of_2(block_size)) if sparse else tile_n)
        max_splits = block_q * topk if sparse else max(1, triton.cdiv(max_context_len, 4 * block_n))
        return block_n, min(1 << (want.bit_length() - 1), triton.next_power_of_2(max_splits))

    block_n, splits = shape(cfg["BLOCK_N"])
    num_warps = cfg["num_warps"]
    # FEW_BELOW: programs that do not fill the chip even at the most splits (few tokens) each take the whole call's
    # time, so they run wider (FEW_WARPS warps, FEW_BLOCK_N-key tiles) and walk their tiles faster
    if q_blocks * num_kv_heads * splits < cfg.get("FEW_BELOW", 0):
        block_n, splits = shape(cfg["FEW_BLOCK_N"])
        num_warps = cfg["FEW_WARPS"]
    return {"BLOCK_Q": block_q, "BLOCK_H": block_h, "BLOCK_N": block_n, "NUM_SPLITS": splits,
            "q_blocks": q_blocks, "num_warps": num_warps, "num_stages": cfg["num_stages"],
            "PAGE_AHEAD": cfg.get("PAGE_AHEAD", 0),
            "MERGE_LAST": cfg.get("MERGE_LAST", 0) if 1 < splits <= MERGE_LAST_MAX_SPLITS else 0,
            "KEYS_M": keys_m, "ALL_SLOTS": cfg.get("ALL_SLOTS", 0),
            # every sequence has exactly one query token (max_seqlen_q is never below the true maximum: Contract 2)
            "ONE_EACH": int(max_seqlen_q == 1 and num_tokens == num_seqs),
            "PDL": cfg.get("PDL", 0),
            # dense prefill: unmasked tiles before each program's first query (BULK); FP8 scores of an FP8 cache
            # (Q_FP8: on GPUs only, the interpreter has no FP8 dot; at launch only for heads of 32+ dimensions, an
            # FP8 dot's smallest K)
            "BULK": int(block_q > 1 and not sparse and cfg.get("BULK", 0)),
            "Q_FP8": int(block_q > 1 and not sparse and fp8 and cfg.get("Q_FP8", 0) and not interpreting()),
            "maxnreg": cfg.get("maxnreg"),
            # MSA FP8 decode of few sequences: the Gluon kernel, where the arch has one (`gluon_sparse_decode.supports`
            # checks the rest of what it serves)
            "GLUON": int(sparse and fp8 and max_seqlen_q == 1 and num_tokens == num_seqs
                         and num_seqs <= cfg.get("GLUON_MAX_SEQS", 0))}


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 zeros that MERGE_LAST programs count their arrivals in, one per (query tile, KV head); each call leaves
    them at zero again, so one buffer per device serves every call (calls on a device run in stream order: two
    launches must not run concurrently on different streams). Made eagerly, never inside a CUDA graph capture: a
    buffer first zeroed by a captured memset would hold garbage for eager calls, so a capture that needs a larger
    one gets its own, zeroed by the graph at each replay."""
    have = _ARRIVALS.get(device)
    if have is not None and have.numel() >= n:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    _ARRIVALS[device] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return _ARRIVALS[device]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    layout: str = "plain", block_sel: torch.Tensor | None = None, block_size: int = 128, *,
                    max_seqlen_q: int | None = None, max_context_len: int | None = None,
                    out: torch.Tensor | None = None, gluon: bool = True) -> torch.Tensor:
    """Triton `paged_attention_ref`. Pass the host ints `max_seqlen_q` / `max_context_len` (the step's metadata
    has them) to avoid a device sync; they pick tile shapes and split counts and must not be below the true maxima
    (with `max_seqlen_q` 1 and as many tokens as sequences, programs map to sequences directly).
    `out` ([T, Hq, D], q's dtype) receives the result when given (a CUDA graph's static buffer). MSA FP8 decode of
    few sequences runs the Gluon kernel where the arch's table says so (`gluon=False`: the Triton kernel always)."""
    t_total, hq, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    hkv = k_cache.shape[1]
    if out is None:
        out = torch.empty(t_total, hq, head_dim, dtype=q.dtype, device=q.device)
    if t_total == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    sparse = block_sel is not None
    topk = block_sel.shape[-1] if sparse else 1
    plan = attention_plan(t_total, num_seqs, hkv, hq // hkv, max_seqlen_q, max_context_len, sparse, topk,
                          block_size, k_scale is not None)
    if gluon and plan["GLUON"] and q.is_cuda and not interpreting():
        gsd = gluon_decode()
        if gsd is not None and gsd.supports(q, k_cache, k_scale, layout, block_sel, block_size, max_seqlen_q,
                                            num_seqs):
            return gsd.sparse_decode(q, k_cache, v_cache, page_table, context_lens, scale, k_scale, v_scale,
                                     block_sel, block_size, out=out)
    splits = plan["NUM_SPLITS"]
    part_o, part_lse = split_partials(splits, out)
    fp8 = k_scale is not None
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)
    sel = block_sel if sparse else page_table
    arrivals = arrival_counters(q.device, plan["q_blocks"] * hkv) if plan["MERGE_LAST"] else out  # unread without
    limits = {"maxnreg": plan["maxnreg"]} if plan["maxnreg"] else {}
    limits |= pdl_launch(plan["PDL"], q)
    _attn_kernel[(plan["q_blocks"], hkv, splits)](
        q, k_cache, v_cache, ks, vs, page_table, cu_seqlens_q, context_lens, sel, out, part_o, part_lse, arrivals,
        scale * 1.4426950408889634, num_seqs, t_total, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        page_table.stride(0), k_cache.stride(0), k_cache.stride(1), ks.stride(0), ks.stride(1),
        sel.stride(0) if sparse else 0, sel.stride(1) if sparse else 0,
        NUM_HEADS=hq, HEAD_DIM=head_dim, D_PAD=dim_tile(head_dim), GROUP=hq // hkv, BLOCK_H=plan["BLOCK_H"],
        BLOCK_Q=plan["BLOCK_Q"],
        BLOCK_N=plan["BLOCK_N"], NUM_SPLITS=splits, X=shuffle_width(k_cache.dtype), SHUFFLE=layout == "shuffle",
        FP8=fp8, SPARSE=sparse, TOPK=topk, TOPK_PAD=triton.next_power_of_2(topk), SEL_BLOCK=block_size,
        V_MUL=torch.finfo(v_cache.dtype).max if fp8 else 1.0, DOT=dot_dtype(k_cache.dtype),
        PAGE_AHEAD=plan["PAGE_AHEAD"], MERGE_LAST=plan["MERGE_LAST"], KEYS_M=plan["KEYS_M"],
        ALL_SLOTS=plan["ALL_SLOTS"], ONE_EACH=plan["ONE_EACH"], PDL="launch_pdl" in limits, BULK=plan["BULK"],
        Q_FP8=plan["Q_FP8"] and dim_tile(head_dim) >= 32, num_warps=plan["num_warps"], num_stages=plan["num_stages"],
        **limits)
    if splits > 1 and not plan["MERGE_LAST"]:
        merge_splits(part_o, part_lse, out)
    return out


def split_partials(splits: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial outputs [splits, T, Hq, D] and base-2 LSEs [splits, T, Hq] (fp32) of split-KV programs writing
    `out` [T, Hq, D]; with one split, `out` twice (unread: the programs write `out` itself)."""
    if splits == 1:
        return out, out
    t, hq, d = out.shape
    return (torch.empty(splits, t, hq, d, dtype=torch.float32, device=out.device),
            torch.empty(splits, t, hq, dtype=torch.float32, device=out.device))


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """out = the LSE-weighted mean of the splits' partials (`split_partials`), one launch."""
    splits, t, hq, d = part_o.shape
    _merge_kernel[(t, hq)](part_o, part_lse, out, t, out.stride(0), out.stride(1), NUM_HEADS=hq, HEAD_DIM=d,
                           D_PAD=dim_tile(d), NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
                           num_warps=tiles("attn_merge")["num_warps"])


def aot_variants(arch: Arch) -> list:
    """The attention kernels as launched on `arch` at M3's shapes: every mode in the platform's default layout,
    the decode modes in the other layout too (see m3sdk_kernels.aot)."""
    from .aot import M3_SHAPES, AotVariant

    m = M3_SHAPES
    hq, hkv, d = m["num_heads"], m["num_kv_heads"], m["head_dim"]
    other = "plain" if arch.kv_layout == "shuffle" else "shuffle"
    modes = [(sparse, decode, kv, arch.kv_layout) for sparse in (False, True) for decode in (True, False)
             for kv in ("bf16", "fp8")]
    modes += [(sparse, True, "fp8", other) for sparse in (False, True)]
    # batch 64 decode at 32K, or an 8K-token prefill chunk of one sequence; and batch 1 decode where its tiles differ
    # (FEW_BELOW)
    shapes = []
    for sparse, decode, kv, layout in modes:
        name = f"attention.{'sparse' if sparse else 'dense'}_{'decode' if decode else 'prefill'}_{kv}_{layout}"
        tokens = 64 if decode else 8192
        plan = attention_plan(tokens, 64 if decode else 1, hkv, hq // hkv, 1 if decode else tokens, 32768, sparse,
                              m["topk"], m["block_size"], kv == "fp8", arch)
        shapes.append((name, sparse, kv, layout, plan))
        if decode:
            few = attention_plan(1, 1, hkv, hq // hkv, 1, 32768, sparse, m["topk"], m["block_size"], kv == "fp8", arch)
            if (few["num_warps"], few["BLOCK_N"]) != (plan["num_warps"], plan["BLOCK_N"]):
                shapes.append((name + "_b1", sparse, kv, layout, few))
    variants = []
    for name, sparse, kv, layout, plan in shapes:
        kv_type = arch.fp8_triton if kv == "fp8" else "bf16"
        types = {"q_ptr": "*bf16", "k_cache": f"*{kv_type}", "v_cache": f"*{kv_type}", "k_scale": "*fp32",
                 "v_scale": "*fp32", "page_table": "*i32", "cu_q": "*i32", "ctx_lens": "*i32", "sel_ptr": "*i32",
                 "out_ptr": "*bf16", "part_o": "*fp32", "part_lse": "*fp32", "arrivals": "*i32", "qk_scale": "fp32"}
        types |= {arg: "i32" for arg in _attn_kernel.arg_names if arg not in types}
        variants.append(AotVariant(
            name=name, kernel=_attn_kernel, types=types,
            constexprs={"NUM_HEADS": hq, "HEAD_DIM": d, "D_PAD": dim_tile(d), "GROUP": hq // hkv,
                        "BLOCK_H": plan["BLOCK_H"],
                        "BLOCK_Q": plan["BLOCK_Q"], "BLOCK_N": plan["BLOCK_N"], "NUM_SPLITS": plan["NUM_SPLITS"],
                        "X": 16 if kv == "fp8" else 8, "SHUFFLE": layout == "shuffle", "FP8": kv == "fp8",
                        "SPARSE": sparse, "TOPK": m["topk"], "TOPK_PAD": m["topk"], "SEL_BLOCK": m["block_size"],
                        "V_MUL": arch.fp8_max if kv == "fp8" else 1.0,
                        "DOT": tl.float16 if kv == "fp8" else tl.bfloat16, "PAGE_AHEAD": plan["PAGE_AHEAD"],
                        "MERGE_LAST": plan["MERGE_LAST"], "KEYS_M": plan["KEYS_M"],
                        "ALL_SLOTS": plan["ALL_SLOTS"], "ONE_EACH": plan["ONE_EACH"], "PDL": plan["PDL"],
                        "BULK": plan["BULK"], "Q_FP8": plan["Q_FP8"]},
            num_warps=plan["num_warps"], num_stages=plan["num_stages"], maxnreg=plan["maxnreg"],
            aligned=("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cp", "stride_ch", "stride_sp",
                     "stride_sh", "stride_sel_h", "stride_sel_t")))
    variants.append(AotVariant(
        name="attention.merge", kernel=_merge_kernel,
        types={"part_o": "*fp32", "part_lse": "*fp32", "out_ptr": "*bf16", "num_tokens": "i32", "stride_ot": "i32",
               "stride_oh": "i32"},
        constexprs={"NUM_HEADS": hq, "HEAD_DIM": d, "D_PAD": dim_tile(d), "NUM_SPLITS": 2, "SPLITS_PAD": 2},
        num_warps=tiles("attn_merge", arch)["num_warps"], aligned=("stride_ot", "stride_oh")))
    return variants
