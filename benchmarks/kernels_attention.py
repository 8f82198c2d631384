"""Attention kernels on one GPU: ours vs the floor vs a peer, one run (method: ../shared/design/kernels.md).

    PYTHONPATH=src python benchmarks/kernels_attention.py --steps check,bandwidth,STEP...,report [--out DIR]

Each step appends its numbers to DIR/attention.jsonl (so steps can run in separate processes: a fault in one
does not take the others down); `report` prints the table of everything recorded. A decode step may carry its own
filters, `STEP:KV[:LAYOUT]` (e.g. `dense_decode_128k:fp8:shuffle`; `check:fp8` checks only those modes).
`sweep` times decode under the tile variants of `--variants` (JSON, see `sweep`) set in-process, `tiles_indexer`
indexer decode under a few; `graphs` captures the decode kernels in CUDA graphs and replays them.

Floors: the bytes a kernel must read (each selected K/V element and its scale once; the index keys once) over
the read bandwidth measured here by a large reduction. Peers: SDPA (flash / cuDNN, contiguous bf16 KV; for MSA
on the pre-gathered selected KV), FlexAttention with a BlockMask of the same selection (`flex_decode_*`,
`sparse_prefill_32k*`), and plain torch (bmm + block amax + topk on bf16 keys) for the indexer.
A correctness check of every timed mode against the references runs first (GPU dots are bf16/fp16 there,
unlike the interpreter's fp32).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gpu_timing import read_rates
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from m3sdk_kernels import arch
from m3sdk_kernels.arch import current_arch
from m3sdk_kernels.indexer import block_topk, indexer_block_scores, indexer_topk
from m3sdk_kernels.layout import PAGE_SIZE, cache_shape, shuffle_width
from m3sdk_kernels.paged_attention import paged_attention
from m3sdk_kernels.reference import indexer_topk_ref, paged_attention_ref

HQ, HKV, D, DI, HIDX, BS, TOPK = 64, 4, 128, 128, 4, 128, 16
DEV = "cuda"
ONLY: dict[str, str] = {}  # --kv / --layout (or a step's own) filters of the decode steps (for tuning runs)
TAG: dict[str, str] = {}  # the in-process tile variant being timed (tiles_indexer)
FLEX = torch.compile(flex_attention, dynamic=False)  # compiled at its first call, once per shape


def wanted(kv: str, layout: str) -> bool:
    return ONLY.get("kv", kv) == kv and ONLY.get("layout", layout) == layout


def tiles_tag() -> str:
    """The tile overrides of this run (M3SDK_KERNEL_TILES or an in-process variant), recorded with every row."""
    return TAG.get("tiles", os.environ.get("M3SDK_KERNEL_TILES", ""))


def bench(fn, rep: int = 300) -> float:
    """Median ms over CUDA events (launch overhead included: a few us per launch)."""
    t = triton.testing.do_bench(fn, warmup=min(50, rep), rep=rep, return_mode="median")
    torch.cuda.synchronize()  # a fault surfaces here, in the step that caused it
    return t


def copy_bandwidth() -> float:
    """TB/s of a 4 GiB device copy, counting read + write (the design's reference figure)."""
    x = torch.randn(2 << 30, dtype=torch.bfloat16, device=DEV)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / bench(lambda: y.copy_(x)) / 1e9


def make_kv(batch: int, ctx: int, kv: str, layout: str, inline_scales: bool = False):
    """Random paged K/V for `batch` sequences of `ctx` tokens, pages shuffled across the pool. `inline_scales` (FP8
    plain): each (page, KV head)'s 16 scales stored right after its 16 K (V) rows in one allocation, so a page's
    scales share its rows' DRAM page; K/V and the scales are strided views of it (the kernels take strides)."""
    pages_per = ctx // PAGE_SIZE
    num_pages = batch * pages_per
    fp8 = kv == "fp8"
    dtype = current_arch().fp8_dtype if fp8 else torch.bfloat16
    k = torch.randn(cache_shape("k", layout, num_pages, HKV, D, dtype), device=DEV).to(dtype)
    v = torch.randn(cache_shape("v", layout, num_pages, HKV, D, dtype), device=DEV).to(dtype)
    ks = vs = None
    if fp8:
        ks = torch.rand(num_pages, HKV, PAGE_SIZE, device=DEV) * 0.01 + 1e-3
        vs = torch.rand(num_pages, HKV, PAGE_SIZE, device=DEV) * 0.01 + 1e-3
    if fp8 and inline_scales:
        assert layout == "plain"
        row = PAGE_SIZE * D  # bytes of one (page, head)'s rows
        views = []
        for rows, scales in ((k, ks), (v, vs)):
            raw = torch.empty(num_pages, HKV, row + PAGE_SIZE * 4, dtype=torch.uint8, device=DEV)
            x = raw[..., :row].view(dtype).view(num_pages, HKV, PAGE_SIZE, D)
            x.copy_(rows)
            sc = raw[..., row:].view(torch.float32)
            sc.copy_(scales)
            views += [x, sc]
        k, ks, v, vs = views
    table = torch.randperm(num_pages, device=DEV, dtype=torch.int32).view(batch, pages_per)
    return k, v, ks, vs, table


def decode_meta(batch: int, ctx: int):
    cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    return cu, lens


def random_selection(batch: int, ctx: int) -> torch.Tensor:
    """[Hkv, B, 16]: the local (last) block plus 15 distinct random earlier blocks, in random order."""
    nb = ctx // BS
    others = torch.rand(HKV, batch, nb - 1, device=DEV).topk(TOPK - 1, dim=-1).indices
    local = torch.full((HKV, batch, 1), nb - 1, device=DEV)
    sel = torch.cat([others, local], -1)
    return sel.gather(-1, torch.rand(sel.shape, device=DEV).argsort(-1)).to(torch.int32)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def smooth_index(ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index queries [ctx, Hidx, Di] and keys [ctx, Di] with locality, as a real indexer sees them: both are a
    rank-16 signal whose coefficients drift slowly along the sequence (keys over ~256 tokens, queries over ~4096)
    plus noise, so neighbouring queries pick mostly the same blocks (random keys make them pick unrelated ones)."""
    rank = 16
    basis = torch.randn(rank, DI, device=DEV) / rank**0.5

    def drift(heads: int, corr: int) -> torch.Tensor:  # [ctx, heads, rank], linear between random knots
        knots = torch.randn(1, heads * rank, ctx // corr + 2, device=DEV)
        c = F.interpolate(knots, size=ctx, mode="linear", align_corners=True)[0]
        return c.view(heads, rank, ctx).permute(2, 0, 1)

    keys = 2 * drift(1, 256)[:, 0] @ basis + 0.5 * torch.randn(ctx, DI, device=DEV)
    iq = 2 * drift(HIDX, 4096) @ basis + 0.5 * torch.randn(ctx, HIDX, DI, device=DEV)
    return iq.to(torch.bfloat16), keys


def contiguous_kv(k, v, ks, vs, table) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-layout paged K/V (dequantized when FP8) as contiguous bf16 [B, Hkv, ctx, D]: FlexAttention's input,
    the same values our kernel reads (Flex cannot walk a page table)."""
    def one(cache, scale):
        x = cache[table.long()].to(torch.bfloat16)  # [B, pages, Hkv, 16, D]
        if scale is not None:
            x.mul_(scale[table.long()][..., None])
        b, p, h, _, d = x.shape
        return x.permute(0, 2, 1, 3, 4).reshape(b, h, p * PAGE_SIZE, d)
    return one(k, ks), one(v, vs)


def flex_decode_mask(sel: torch.Tensor, ctx: int) -> BlockMask:
    """BlockMask for one query per sequence from sel [Hkv, B, topk] (all valid): per (sequence, query head) the
    selected 128-token KV blocks of its KV group, as full blocks (a decode query sees every key before it, so Flex
    skips mask_mod there); mask_mod looks the block up in the selection for any partial use."""
    hkv, batch, topk = sel.shape
    nb, group = ctx // BS, HQ // hkv
    per_seq = sel.permute(1, 0, 2).long()  # [B, Hkv, topk]
    chosen = torch.zeros(batch, hkv, nb, dtype=torch.bool, device=sel.device).scatter_(-1, per_seq, True)
    idx = F.pad(per_seq.sort(-1).values.repeat_interleave(group, 1)[:, :, None], (0, nb - topk)).to(torch.int32)
    num = torch.full((batch, HQ, 1), topk, dtype=torch.int32, device=sel.device)

    def mask_mod(b, h, q, kv):
        return chosen[b, h // group, kv // BS]
    return BlockMask.from_kv_blocks(torch.zeros_like(num), torch.zeros_like(idx), num, idx, BLOCK_SIZE=(BS, BS),
                                    mask_mod=mask_mod, seq_lengths=(1, ctx))


def flex_prefill_mask(sel: torch.Tensor, ctx: int) -> tuple[BlockMask, dict]:
    """BlockMask for one sequence of `ctx` new tokens from sel [Hkv, ctx, topk] (-1 padded): a 128-query block
    visits the union of its queries' selected KV blocks; mask_mod keeps, per query, its own blocks and causality.
    Also returns the selection's locality: distinct KV blocks per 128-query block and per 8-query tile (ours)."""
    hkv, t, topk = sel.shape
    nb, group = ctx // BS, HQ // hkv
    tok = torch.zeros(hkv, t, nb + 1, dtype=torch.bool, device=sel.device)
    tok.scatter_(-1, torch.where(sel >= 0, sel, nb).long(), True)
    tok = tok[..., :nb].contiguous()  # [Hkv, T, blocks]: query t chose block b
    union = tok.view(hkv, t // BS, BS, nb).any(2)
    num = union.sum(-1).to(torch.int32).repeat_interleave(group, 0)[None]
    idx = union.to(torch.int32).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
    idx = idx.repeat_interleave(group, 0)[None]

    def mask_mod(b, h, q, kv):
        return tok[h // group, q, kv // BS] & (kv <= q)
    locality = {"blocks_per_128q": float(union.sum(-1).float().mean()),
                "blocks_per_8q_tile": float(tok.view(hkv, t // 8, 8, nb).any(2).sum(-1).float().mean())}
    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(BS, BS), mask_mod=mask_mod, seq_lengths=(ctx, ctx)), locality


def check_correctness(prefills: tuple[bool, ...] = (False, True), kvs: tuple[str, ...] = ("bf16", "fp8"),
                      layouts: tuple[str, ...] = ("plain", "shuffle")) -> dict:
    """Every timed mode on a small ragged case against the references (errors are relative L2)."""
    torch.manual_seed(0)
    errs = {}
    ctxs = [300, 1000, 17, 640]
    for prefill in prefills:
        news = [40, 300, 17, 5] if prefill else [1, 1, 1, 1]
        for kv in kvs:
            for layout in layouts:
                pages = [-(-c // PAGE_SIZE) for c in ctxs]
                k, v, ks, vs, _ = make_kv(1, sum(pages) * PAGE_SIZE, kv, layout)
                perm = torch.randperm(sum(pages), device=DEV, dtype=torch.int32)
                table = torch.zeros(len(ctxs), max(pages), dtype=torch.int32, device=DEV)
                at = 0
                for i, p in enumerate(pages):
                    table[i, :p] = perm[at:at + p]
                    at += p
                cu = torch.tensor([0] + list(torch.tensor(news).cumsum(0)), dtype=torch.int32, device=DEV)
                lens = torch.tensor(ctxs, dtype=torch.int32, device=DEV)
                q = torch.randn(sum(news), HQ, D, device=DEV, dtype=torch.bfloat16)
                bs = 64
                iq = torch.randn(sum(news), HIDX, DI, device=DEV, dtype=torch.bfloat16)
                icache = torch.randn(sum(pages), PAGE_SIZE, DI, device=DEV).to(k.dtype)
                sel = indexer_topk(iq, icache, table, cu, lens, bs, 4, 1)
                sel_ref = indexer_topk_ref(iq, icache, table, cu, lens, bs, 4, 1)
                tag = f"{'prefill' if prefill else 'decode'}_{kv}_{layout}"
                errs[f"indexer_{tag}_mismatch"] = float((sel.sort(-1).values != sel_ref.sort(-1).values).float().mean())
                for name, s in (("dense", None), ("sparse", sel_ref)):
                    out = paged_attention(q, k, v, table, cu, lens, D**-0.5, ks, vs, layout, s, bs)
                    ref = paged_attention_ref(q, k, v, table, cu, lens, D**-0.5, ks, vs, layout, s, bs)
                    errs[f"{name}_{tag}"] = rel_err(out, ref)
    return errs


def dense_decode(rows: list, read_bw: float, ctx: int, batch: int = 64) -> None:
    cu, lens = decode_meta(batch, ctx)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
    kc = torch.randn(batch, HKV, ctx, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True))
    for kv, layout in (("bf16", "plain"), ("bf16", "shuffle"), ("fp8", "plain"), ("fp8", "shuffle")):
        if not wanted(kv, layout):
            continue
        k, v, ks, vs, table = make_kv(batch, ctx, kv, layout)
        t = bench(lambda: paged_attention(q, k, v, table, cu, lens, D**-0.5, ks, vs, layout,  # noqa: B023
                                          max_seqlen_q=1, max_context_len=ctx))
        nbytes = batch * ctx * HKV * 2 * (D * k.element_size() + (4 if kv == "fp8" else 0))
        rows.append({"kernel": "dense decode", "shape": f"b{batch} ctx {ctx // 1024}K", "kv": kv, "layout": layout,
                     "ms": t, "floor_ms": nbytes / read_bw / 1e9, "TB/s": nbytes / t / 1e9,
                     "peer": "SDPA contiguous bf16", "peer_ms": t_sdpa, "tiles": tiles_tag()})


def sparse_decode(rows: list, read_bw: float, ctx: int, batch: int = 64) -> None:
    cu, lens = decode_meta(batch, ctx)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
    sel = random_selection(batch, ctx)
    kg = torch.randn(batch, HKV, TOPK * BS, D, device=DEV, dtype=torch.bfloat16)
    vg = torch.randn_like(kg)
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(q[:, :, None], kg, vg, enable_gqa=True))
    for kv, layout in (("fp8", "plain"), ("fp8", "shuffle"), ("bf16", "plain"), ("bf16", "shuffle")):
        if not wanted(kv, layout):
            continue
        k, v, ks, vs, table = make_kv(batch, ctx, kv, layout)
        t = bench(lambda: paged_attention(q, k, v, table, cu, lens, D**-0.5, ks, vs, layout, sel, BS,  # noqa: B023
                                          max_seqlen_q=1, max_context_len=ctx))
        nbytes = batch * HKV * TOPK * BS * 2 * (D * k.element_size() + (4 if kv == "fp8" else 0))
        rows.append({"kernel": "MSA sparse decode", "shape": f"b{batch} ctx {ctx // 1024}K top16", "kv": kv,
                     "layout": layout, "ms": t, "floor_ms": nbytes / read_bw / 1e9, "TB/s": nbytes / t / 1e9,
                     "peer": "SDPA on pre-gathered selected bf16 KV", "peer_ms": t_sdpa,
                     "tiles": tiles_tag()})


def indexer_decode(rows: list, read_bw: float, ctx: int, batch: int = 64, peer: bool = True) -> None:
    """Indexer decode at b`batch`: the selection of the timed inputs is checked against the reference first
    (row note), then the whole op, the scan alone and the top-k alone are timed."""
    cu, lens = decode_meta(batch, ctx)
    iq = torch.randn(batch, HIDX, DI, device=DEV, dtype=torch.bfloat16)
    t_peer = float("nan")
    if peer:
        keys = torch.randn(batch, ctx, DI, device=DEV, dtype=torch.bfloat16)

        def torch_indexer():
            s = torch.bmm(iq, keys.transpose(1, 2))
            return s.view(batch, HIDX, ctx // BS, BS).amax(-1).topk(TOPK, dim=-1).indices

        t_peer = bench(torch_indexer)
        del keys
    num_pages = batch * ctx // PAGE_SIZE
    table = torch.randperm(num_pages, device=DEV, dtype=torch.int32).view(batch, -1)
    for key in ("fp8", "bf16"):
        if ONLY.get("kv", key) != key:
            continue
        dtype = current_arch().fp8_dtype if key == "fp8" else torch.bfloat16
        cache = torch.randn(num_pages, PAGE_SIZE, DI, device=DEV).to(dtype)
        args = (iq, cache, table, cu, lens, BS)
        got = indexer_topk(*args, TOPK, 1, max_seqlen_q=1, max_context_len=ctx)
        ref = indexer_topk_ref(*args, TOPK, 1)
        mismatch = float((got.sort(-1).values != ref.sort(-1).values).float().mean())
        graph_equal, graph_ms = indexer_graph(args, ctx, got)
        t = bench(lambda: indexer_topk(*args, TOPK, 1, max_seqlen_q=1, max_context_len=ctx))  # noqa: B023
        scores = indexer_block_scores(*args, 1, 1, ctx)
        t_scan = bench(lambda: indexer_block_scores(*args, 1, 1, ctx), rep=100)  # noqa: B023
        t_topk = bench(lambda: block_topk(scores, cu, lens, BS, TOPK, 1, got), rep=100)  # noqa: B023
        nbytes = batch * ctx * DI * cache.element_size()
        rows.append({"kernel": "indexer decode", "shape": f"b{batch} ctx {ctx // 1024}K", "kv": key, "layout": "-",
                     "ms": t, "floor_ms": nbytes / read_bw / 1e9, "TB/s": nbytes / t / 1e9, "scan_ms": t_scan,
                     "topk_ms": t_topk, "graph_ms": graph_ms, "mismatch": mismatch, "graph_replay_equal": graph_equal,
                     "peer": "torch bmm+amax+topk bf16", "peer_ms": t_peer, "tiles": tiles_tag(),
                     "note": f"selection mismatch vs reference {mismatch:.4f}; CUDA graph replay equal {graph_equal}; "
                             f"scan {t_scan:.4f} topk {t_topk:.4f}; graph replay {graph_ms:.4f} ms"})


def indexer_graph(args: tuple, ctx: int, eager: torch.Tensor) -> tuple[str, float]:
    """indexer_topk captured in a CUDA graph (static output) and replayed twice over a poisoned output: "True" when
    equal to eager; then ms per replay over 200 back-to-back replays (CUDA events): the device time of the two
    launches and the gap between them without the host's launch cost, which the event-timed eager call includes
    (about 10 us per launch here, more than the top-k kernel itself), as the engine's decode graphs run it."""
    try:
        static = torch.full_like(eager, -7)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture
            indexer_topk(*args, TOPK, 1, max_seqlen_q=1, max_context_len=ctx, out=static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            indexer_topk(*args, TOPK, 1, max_seqlen_q=1, max_context_len=ctx, out=static)
        equal = True
        for _ in range(2):
            static.fill_(-7)
            graph.replay()
            torch.cuda.synchronize()
            equal &= bool(torch.equal(static, eager))
        for _ in range(20):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return str(equal), start.elapsed_time(end) / 200
    except Exception as e:  # noqa: BLE001 (recorded in the row; the timing goes on)
        return f"failed {type(e).__name__}: {str(e)[:120]}", float("nan")


def indexer_ragged_check(keys: tuple[str, ...] = ("fp8", "bf16")) -> float:
    """Worst selection mismatch of indexer_topk against the reference over ragged decode / verify / prefill
    batches (contexts crossing page and block boundaries, selections dropping blocks)."""
    worst = 0.0
    for ctxs, news in (([200, 37, 16, 129, 1000, 4100], [1] * 6), ([3000, 700], [4, 4]), ([2500, 300], [700, 300])):
        pages = [-(-c // PAGE_SIZE) for c in ctxs]
        perm = torch.randperm(sum(pages), device=DEV, dtype=torch.int32)
        table = torch.zeros(len(ctxs), max(pages), dtype=torch.int32, device=DEV)
        for i, p in enumerate(pages):
            table[i, :p] = perm[sum(pages[:i]):sum(pages[:i]) + p]
        cu = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
        lens = torch.tensor(ctxs, dtype=torch.int32, device=DEV)
        iq = torch.randn(sum(news), HIDX, DI, device=DEV, dtype=torch.bfloat16)
        for dtype in (current_arch().fp8_dtype if key == "fp8" else torch.bfloat16 for key in keys):
            cache = torch.randn(sum(pages), PAGE_SIZE, DI, device=DEV).to(dtype)
            got = indexer_topk(iq, cache, table, cu, lens, BS, TOPK, 1)
            ref = indexer_topk_ref(iq, cache, table, cu, lens, BS, TOPK, 1)
            worst = max(worst, float((got.sort(-1).values != ref.sort(-1).values).float().mean()))
    return worst


def tiles_indexer(rows: list, read_bw: float) -> None:
    """Indexer decode (FP8 keys, b64, 128K and 32K) under tile variants of the current arch's table set
    in-process (the first: the table as it is). Each variant's timed inputs' selection is checked against the
    reference before it is timed; the table and the variants marked so also pass `indexer_ragged_check` first
    (FP8 keys; bf16 too for the table). One line per row as it comes."""
    name = current_arch().name
    fp8 = "indexer_scan:fp8"  # the FP8-key scan's own entry (over indexer_scan's)
    variants = (({}, True), ({fp8: {"SPLIT_PROGRAMS": 792}}, False), ({fp8: {"SPLIT_PROGRAMS": 528}}, False),
                ({fp8: {"num_stages": 4}}, False), ({fp8: {"PAGE_AHEAD": 0, "SPLIT_PROGRAMS": 1056}}, False))
    ONLY.update(kv="fp8")
    for i, (change, ragged_check) in enumerate(variants):
        saved = {family: arch.TILES[family][name] for family in change}
        try:
            for family, entry in change.items():
                arch.TILES[family][name] = saved[family] | entry
            TAG["tiles"] = json.dumps(change)
            ragged = indexer_ragged_check(("fp8", "bf16") if i == 0 else ("fp8",)) if ragged_check else float("nan")
            for ctx in (131072, 32768):
                indexer_decode(rows, read_bw, ctx, peer=i == 0)
                r = rows[-1]
                r["note"] += f"; ragged check mismatch {ragged:.4f}"
                print(f"indexer {r['shape'].split()[-1]} {r['ms']:.4f} ms {r['floor_ms'] / r['ms']:.0%} graph "
                      f"{r['graph_ms']:.4f} {r['floor_ms'] / r['graph_ms']:.0%} scan {r['scan_ms']:.4f} topk "
                      f"{r['topk_ms']:.4f} mism {r['mismatch']:.4f} ragged {ragged:.4f} "
                      f"replay {r['graph_replay_equal'][:30]} {TAG['tiles']}", flush=True)
        except Exception as e:  # noqa: BLE001 (one variant failing must not lose the others' rows)
            print(f"indexer variant {TAG['tiles']} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            for family, entry in saved.items():
                arch.TILES[family][name] = entry
            TAG.clear()


def flex_decode(rows: list, read_bw: float, ctx: int, batch: int = 64) -> None:
    """MSA FP8 decode (plain) vs FlexAttention with a BlockMask of the same top-16 selection, over the same K/V
    dequantized to contiguous bf16; Flex's output is checked against ours before timing."""
    cu, lens = decode_meta(batch, ctx)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
    sel = random_selection(batch, ctx)
    k, v, ks, vs, table = make_kv(batch, ctx, "fp8", "plain")

    def ours():
        return paged_attention(q, k, v, table, cu, lens, D**-0.5, ks, vs, "plain", sel, BS, max_seqlen_q=1,
                               max_context_len=ctx)
    t = bench(ours)
    nbytes = batch * HKV * TOPK * BS * 2 * (D * k.element_size() + 4)
    row = {"kernel": "MSA sparse decode", "shape": f"b{batch} ctx {ctx // 1024}K top16", "kv": "fp8",
           "layout": "plain", "ms": t, "floor_ms": nbytes / read_bw / 1e9, "TB/s": nbytes / t / 1e9,
           "peer": "FlexAttention, same block mask, bf16 KV", "peer_ms": float("nan")}
    try:
        kc, vc = contiguous_kv(k, v, ks, vs, table)
        mask, qf = flex_decode_mask(sel, ctx), q[:, :, None]
        err = rel_err(FLEX(qf, kc, vc, block_mask=mask, enable_gqa=True)[:, :, 0], ours())
        row["peer_ms"] = bench(lambda: FLEX(qf, kc, vc, block_mask=mask, enable_gqa=True))
        flex_tbps = batch * HKV * TOPK * BS * 2 * D * 2 / row["peer_ms"] / 1e9  # its bf16 selected blocks
        row["note"] = f"flex rel err vs ours {err:.1e}; flex {flex_tbps:.2f} TB/s = {flex_tbps / read_bw:.0%} of read"
    except Exception as e:  # noqa: BLE001 (the peer failing must not lose our row)
        row["note"] = f"flex failed: {type(e).__name__}: {str(e)[:200]}"
    rows.append(row)


def prefill_inputs(ctx: int, selection: str) -> tuple:
    """One sequence of `ctx` FP8 plain pages and its indexer selection: `selection` "random" (random index keys:
    neighbouring queries share almost no blocks) or "smooth" (`smooth_index`: locality).
    Returns (cu, lens, k, v, k_scale, v_scale, table, index_q, index_cache, selection)."""
    cu = torch.tensor([0, ctx], device=DEV, dtype=torch.int32)
    lens = torch.tensor([ctx], device=DEV, dtype=torch.int32)
    k, v, ks, vs, table = make_kv(1, ctx, "fp8", "plain")
    if selection == "smooth":
        iq, keys = smooth_index(ctx)
    else:
        iq = torch.randn(ctx, HIDX, DI, device=DEV, dtype=torch.bfloat16)
        keys = torch.randn(ctx, DI, device=DEV)
    icache = torch.empty(ctx // PAGE_SIZE, PAGE_SIZE, DI, device=DEV, dtype=k.dtype)
    icache[table[0].long()] = keys.view(-1, PAGE_SIZE, DI).to(k.dtype)  # logical page p lives at table[0, p]
    sel = indexer_topk(iq, icache, table, cu, lens, BS, TOPK, 1, max_seqlen_q=ctx, max_context_len=ctx)
    return cu, lens, k, v, ks, vs, table, iq, icache, sel


def sparse_prefill(rows: list, ctx: int, selection: str, flex: bool) -> None:
    """One sequence of `ctx` new tokens: the indexer selects (timed too), then MSA prefill. `selection`: "random"
    (random index keys: neighbouring queries share almost no blocks) or "smooth" (`smooth_index`: locality).
    Peers: dense causal SDPA, and with `flex` FlexAttention with the selection's BlockMask (output checked)."""
    cu, lens, k, v, ks, vs, table, iq, icache, sel = prefill_inputs(ctx, selection)
    t_idx = bench(lambda: indexer_topk(iq, icache, table, cu, lens, BS, TOPK, 1, max_seqlen_q=ctx,
                                       max_context_len=ctx))
    q = torch.randn(ctx, HQ, D, device=DEV, dtype=torch.bfloat16)

    def ours():
        return paged_attention(q, k, v, table, cu, lens, D**-0.5, ks, vs, "plain", sel, BS, max_seqlen_q=ctx,
                               max_context_len=ctx)
    t = bench(ours)
    qs = q.transpose(0, 1)[None].contiguous()
    kc = torch.randn(1, HKV, ctx, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(qs, kc, vc, is_causal=True, enable_gqa=True))
    flops = 4 * ctx * HQ * TOPK * BS * D  # the selected keys only (upper bound: early tokens see fewer)
    shape = f"{ctx // 1024}K tokens, {selection} sel"
    base = {"kernel": "MSA sparse prefill", "shape": shape, "kv": "fp8", "layout": "plain", "ms": t,
            "floor_ms": flops / 790e12 * 1e3, "TB/s": float("nan")}
    mask, locality = flex_prefill_mask(sel, ctx)
    note = (f"distinct blocks per 128-query block {locality['blocks_per_128q']:.1f}, "
            f"per 8-query tile {locality['blocks_per_8q_tile']:.1f} (16 = perfect sharing)")
    rows.append(base | {"peer": "SDPA dense causal bf16", "peer_ms": t_sdpa, "note": note})
    if flex:
        row = base | {"peer": "FlexAttention, same block mask, bf16 KV", "peer_ms": float("nan")}
        try:
            del kc, vc
            kc, vc = contiguous_kv(k, v, ks, vs, table)
            err = rel_err(FLEX(qs, kc, vc, block_mask=mask, enable_gqa=True)[0].transpose(0, 1), ours())
            row["peer_ms"] = bench(lambda: FLEX(qs, kc, vc, block_mask=mask, enable_gqa=True))
            row["note"] = f"flex rel err vs ours {err:.1e}"
        except Exception as e:  # noqa: BLE001 (the peer failing must not lose our rows)
            row["note"] = f"flex failed: {type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    rows.append({"kernel": "indexer prefill", "shape": shape, "kv": "fp8", "layout": "-",
                 "ms": t_idx, "floor_ms": 2 * ctx * ctx * HIDX * DI / 790e12 * 1e3, "TB/s": float("nan"),
                 "peer": "-", "peer_ms": float("nan")})


def timings(fn) -> dict:
    """Three views of one call: `ms`, event-timed eager calls after an L2 flush (do_bench: what the tables
    always reported, launches included); `graph_ms`, a CUDA graph of 20 back-to-back calls replayed, per call (the
    device time alone, as the engine's decode graphs run it); `host_us`, the host's time to issue one call. When
    host_us exceeds the device time, eager timings measure the host."""
    ms = bench(fn, rep=100)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # allocations and compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    calls = 20
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    del graph
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    host_us = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    return {"ms": ms, "graph_ms": sorted(per_call)[len(per_call) // 2], "host_us": host_us}


# Gluon MSA FP8 decode tile variants timed by `gluon_sparse_decode` (gluon_sparse_decode.plan's keywords over the
# batch's defaults; {}: what paged_attention runs)
GLUON_VARIANTS = [{}, {"num_warps": 1, "block_n": 16, "num_buf": 4, "split_programs": 1024},
                  {"num_warps": 4, "block_n": 64, "num_buf": 3, "split_programs": 512},
                  {"num_warps": 1, "block_n": 32, "num_buf": 3, "split_programs": 1024},
                  {"num_warps": 2, "block_n": 32, "num_buf": 4, "split_programs": 512}]


def gluon_sparse_decode(rows: list, read_bw: float, ctx: int) -> None:
    """MSA FP8 plain decode: the Triton kernel vs the Gluon kernel's variants vs SDPA on pre-gathered bf16 KV at
    b1 to b64, each checked against the reference first, timed as CUDA-graph replays (`graph_ms`)."""
    from m3sdk_kernels import gluon_sparse_decode as gsd

    for batch in (1, 4, 16, 32, 64):
        cu, lens = decode_meta(batch, ctx)
        q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
        sel = random_selection(batch, ctx)
        k, v, ks, vs, table = make_kv(batch, ctx, "fp8", "plain")
        ref = paged_attention_ref(q, k, v, table, cu, lens, D**-0.5, ks, vs, "plain", sel, BS)
        nbytes = batch * HKV * TOPK * BS * 2 * (D * k.element_size() + 4)
        kg = torch.randn(batch, HKV, TOPK * BS, D, device=DEV, dtype=torch.bfloat16)
        vg = torch.randn_like(kg)
        sdpa = timings(lambda: F.scaled_dot_product_attention(q[:, :, None], kg, vg, enable_gqa=True))  # noqa: B023
        out = torch.empty_like(q)
        runs = [("triton", "", lambda: paged_attention(q, k, v, table, cu, lens, D**-0.5, ks, vs, "plain", sel, BS,  # noqa: B023
                                                       max_seqlen_q=1, max_context_len=ctx, out=out,  # noqa: B023
                                                       gluon=False))]
        runs += [("gluon", json.dumps(var), lambda var=var: gsd.sparse_decode(q, k, v, table, lens, D**-0.5, ks, vs,  # noqa: B023
                                                                              sel, BS, out=out, **var))  # noqa: B023
                 for var in GLUON_VARIANTS]
        for name, var, fn in runs:
            row = {"kernel": f"MSA decode {name}", "shape": f"b{batch} ctx {ctx // 1024}K top16", "kv": "fp8",
                   "layout": "plain", "floor_ms": nbytes / read_bw / 1e9, "peer": "SDPA pre-gathered bf16 (graph)",
                   "peer_ms": sdpa["graph_ms"], "tiles": var}
            try:
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                row["note"] = f"rel err {err:.2e}"
                if not err < 2e-2:  # NaN too
                    raise AssertionError(f"rel err {err} against the reference")
                t = timings(fn)
            except Exception as e:  # a variant that fails to build or is wrong is a row, not the end of the step
                row |= {"ms": float("nan"), "TB/s": float("nan"), "note": f"{type(e).__name__}: {str(e)[:200]}"}
                rows.append(row)
                print(row, flush=True)
                continue
            row |= {"ms": t["graph_ms"], "eager_ms": t["ms"], "TB/s": nbytes / t["graph_ms"] / 1e9}
            rows.append(row)
            print(f"b{batch} {name:7} {var:60} graph {t['graph_ms']:.4f} ms  eager {t['ms']:.4f}  "
                  f"{nbytes / t['graph_ms'] / 1e9 / read_bw:.0%} of floor  {row['note']}", flush=True)


@triton.jit
def _gather_kernel(k_ptr, v_ptr, ks_ptr, vs_ptr, table, sel, out, stride_pt, stride_cp, stride_ch, stride_sp,
                   stride_sh, stride_sel_h, stride_sel_t, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                   TOPK: tl.constexpr, SEL_BLOCK: tl.constexpr, SPLITS: tl.constexpr, SCALES: tl.constexpr):
    """The memory traffic of MSA FP8 decode alone: program (sequence, KV head, split) reads the K and V rows (and
    with SCALES their scales) of its selected blocks through the page table, as `paged_attention` does (a block
    per step, page ids carried one step ahead so the copies pipeline), and folds them by XOR of 32-bit words."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    PER: tl.constexpr = TOPK // SPLITS
    n = tl.arange(0, SEL_BLOCK)
    w = tl.arange(0, HEAD_DIM // 4)
    jb = tl.arange(0, PER)
    blks = tl.load(sel + h * stride_sel_h + b * stride_sel_t + sp * PER + jb)
    pages_ptr = table + b * stride_pt
    page = tl.load(pages_ptr + (tl.sum(tl.where(jb == 0, blks, 0)) * SEL_BLOCK + n) // 16)
    k_words = (k_ptr + h * stride_ch).to(tl.pointer_type(tl.int32), bitcast=True)
    v_words = (v_ptr + h * stride_ch).to(tl.pointer_type(tl.int32), bitcast=True)
    acc = tl.zeros([SEL_BLOCK, HEAD_DIM // 4], tl.int32)
    sacc = tl.zeros([SEL_BLOCK], tl.float32)
    for i in range(PER):
        nxt = tl.load(pages_ptr + (tl.sum(tl.where(jb == i + 1, blks, 0)) * SEL_BLOCK + n) // 16)
        row = (page.to(tl.int64) * stride_cp + (n % 16) * HEAD_DIM) // 4
        acc ^= tl.load(k_words + row[:, None] + w[None, :]) ^ tl.load(v_words + row[:, None] + w[None, :])
        if SCALES:
            srow = page.to(tl.int64) * stride_sp + h * stride_sh + n % 16
            sacc += tl.load(ks_ptr + srow) + tl.load(vs_ptr + srow)
        page = nxt
    tl.store(out + (b * NUM_KV + h) * SPLITS + sp, tl.xor_sum(tl.xor_sum(acc, 1), 0) + tl.sum(sacc).to(tl.int32))


def gather_read(k, v, ks, vs, table, sel, splits: int, scales: bool, num_warps: int, num_stages: int):
    """A launcher of `_gather_kernel` over MSA decode inputs (plain FP8 pages, sel [Hkv, B, TOPK])."""
    hkv, batch, topk = sel.shape
    out = torch.empty(batch * hkv * splits, dtype=torch.int32, device=k.device)

    def run():
        _gather_kernel[(batch, hkv, splits)](
            k, v, ks, vs, table, sel, out, table.stride(0), k.stride(0), k.stride(1), ks.stride(0), ks.stride(1),
            sel.stride(0), sel.stride(1), NUM_KV=hkv, HEAD_DIM=k.shape[-1], TOPK=topk, SEL_BLOCK=BS, SPLITS=splits,
            SCALES=scales, num_warps=num_warps, num_stages=num_stages)
        return out
    return run


def with_tiles(change: dict, fn):
    """fn() with the current arch's tile table entries updated by `change` ({family: overrides}) meanwhile."""
    name = current_arch().name
    saved = {family: dict(arch.TILES[family][name]) for family in change}
    try:
        for family, entry in change.items():
            arch.TILES[family][name] = saved[family] | entry
        return fn()
    finally:
        for family, entry in saved.items():
            arch.TILES[family][name] = entry


def record_row(row: dict, results: str) -> None:
    with open(results, "a") as f:
        f.write(json.dumps({"step": "sweep", "rows": [row]}) + "\n")


def sweep(rows: list, read_bw: float, variants: list[dict], results: str) -> None:
    """Tile variants set in-process, FP8 unless "kv" says bf16. A decode variant {"mode": "dense"|"sparse", "kv",
    "ctx", "tiles": {family: overrides}, "layout" (plain), "inline", "l2_pages", "sorted", "topk" (see `make_kv`,
    `decode_inputs`)}
    (batch 64) is compiled, its output compared with the reference at the timed shape (rel L2 in the row), then
    timed (`timings`) against SDPA timed the same way (contiguous bf16 KV for dense, the pre-gathered selected KV
    for MSA), then compared again. "tiles": "best" takes the fastest (graph_ms) of the variants timed before for the
    same mode, kv and layout. A prefill variant {"mode": "prefill",
    "ctx", "selection": "random"|"smooth", "tiles", "flex": bool} runs MSA prefill of one `ctx`-token sequence
    over the indexer's selection; its output is compared with the first prefill variant's of the same inputs
    (the reference itself would need ctx^2 scores), timed eagerly, and with "flex" FlexAttention with the same
    block mask is timed once for those inputs (its output checked against ours). {"mode": "check", "kv", "layout",
    "tiles"} runs the ragged correctness check (`check_correctness`) under those tiles. A gather variant (see
    `sweep_gather`) times MSA FP8 decode's reads alone. Each row is appended to `results` as it is made (a run
    cut short by its time limit keeps what it measured)."""
    inputs: dict = {}
    best: dict = {}
    for var in variants:
        if var["mode"] == "check":
            kvs, layouts = (var.get("kv", "fp8"),), (var.get("layout", "plain"),)
            try:
                errs = with_tiles(var["tiles"], lambda: check_correctness(kvs=kvs, layouts=layouts))  # noqa: B023
            except Exception as e:  # noqa: BLE001 (a candidate failing to build must not lose the other rows)
                print(f"check FAILED {type(e).__name__}: {str(e)[:150]} {json.dumps(var['tiles'])}", flush=True)
                continue
            worst = max(v for k, v in errs.items() if "mismatch" not in k)
            with open(results, "a") as f:
                f.write(json.dumps({"step": "sweep check", "tiles": var["tiles"], "errors": errs}) + "\n")
            print(f"check {var.get('kv', 'fp8')} {var.get('layout', 'plain')} worst rel L2 {worst:.1e}"
                  f"{' FAILED' if worst > 2e-2 else ''} {json.dumps(var['tiles'])}", flush=True)
            continue
        if var["mode"] == "prefill":
            sweep_prefill(rows, var, inputs, results)
            continue
        if var["mode"] == "gather":
            sweep_gather(rows, read_bw, var, inputs, results)
            continue
        mode, kv, ctx, batch = var["mode"], var["kv"], var["ctx"], var.get("batch", 64)
        layout = var.get("layout", "plain")
        change = best[(mode, kv, layout)][1] if var["tiles"] == "best" else var["tiles"]
        key = (mode, kv, ctx, batch, var.get("inline", False), var.get("l2_pages", 0), layout, var.get("sorted", False),
               var.get("topk", TOPK))
        decode_inputs(inputs, key)
        cu, lens, q, sel, k, v, ks, vs, table, ref, peer = inputs[key]

        def ours():
            return paged_attention(q, k, v, table, cu, lens, D**-0.5, ks, vs, layout, sel, BS,  # noqa: B023
                                   max_seqlen_q=1, max_context_len=ctx)  # noqa: B023

        def measure():
            err = rel_err(ours(), ref)  # noqa: B023
            if err >= 2e-2:
                return err, float("nan"), {"ms": float("nan"), "graph_ms": float("nan"), "host_us": 0.0}
            t = timings(ours)
            # again after the graph replays and eager loops: a kernel whose state (MERGE_LAST's arrival counters)
            # outlived a call would time fast and be wrong from its second call on
            return err, rel_err(ours(), ref), t  # noqa: B023
        try:
            err, err_after, t = with_tiles(change, measure)
        except Exception as e:  # noqa: BLE001 (one variant failing to build or launch must not lose the others)
            print(f"{mode:6} {kv:4} {ctx // 1024:4}K FAILED {type(e).__name__}: {str(e)[:150]} {json.dumps(change)}",
                  flush=True)
            continue
        if mode == "sparse":
            nbytes = batch * HKV * key[8] * BS * 2 * (D * k.element_size() + (4 if kv == "fp8" else 0))
        else:
            nbytes = batch * ctx * HKV * 2 * (D * k.element_size() + (4 if kv == "fp8" else 0))
        floor = nbytes / read_bw / 1e9
        r = {"kernel": "MSA sparse decode" if mode == "sparse" else "dense decode",
             "shape": f"b{batch} ctx {ctx // 1024}K" + (f" top{key[8]}" if mode == "sparse" else ""), "kv": kv,
             "layout": layout, "ms": t["ms"], "floor_ms": floor, "TB/s": nbytes / t["graph_ms"] / 1e9,
             "graph_ms": t["graph_ms"], "host_us": t["host_us"], "graph_of_floor": floor / t["graph_ms"],
             "peer": "SDPA " + ("pre-gathered selected bf16 KV" if mode == "sparse" else "contiguous bf16"),
             "peer_ms": peer["ms"], "peer_graph_ms": peer["graph_ms"], "peer_host_us": peer["host_us"],
             "tiles": json.dumps(change), "inline_scales": key[4], "l2_pages": key[5], "sorted_pages": key[7],
             "rel_err": err, "rel_err_after": err_after}
        rows.append(r)
        record_row(r, results)
        print(f"{mode:6} {kv:4} {layout[:5]:5} {ctx // 1024:4}K err {err:.1e}/{err_after:.1e} eager {t['ms']:.4f} "
              f"graph {t['graph_ms']:.4f} "
              f"({r['graph_of_floor']:.0%} floor, {peer['graph_ms'] / t['graph_ms']:.2f}x SDPA graph "
              f"{peer['graph_ms']:.4f}; eager {peer['ms'] / t['ms']:.2f}x) host {t['host_us']:.0f}us "
              f"{json.dumps(change)}{' inline scales' if key[4] else ''}{f' L2 {key[5]} pages' if key[5] else ''}"
              f"{' sorted pages' if key[7] else ''}",
              flush=True)
        if not math.isnan(t["graph_ms"]) and ((mode, kv, layout) not in best
                                              or t["graph_ms"] < best[(mode, kv, layout)][0]):
            best[(mode, kv, layout)] = (t["graph_ms"], change)


def decode_inputs(inputs: dict, key: tuple) -> None:
    """inputs[key] for a decode sweep variant, key = (mode, kv, ctx, batch, inline scales, L2 pages, layout, sorted,
    topk: MSA's blocks per token, the first of the 16 random ones):
    the metadata, q, the selection (MSA), the pages, the reference output and SDPA's timings; the previous shape's are
    dropped (128K FP8 pages are 8.6 GB). L2 pages > 0 maps every page id onto the first that many pages, which then
    stay in L2 between the back-to-back calls of the CUDA-graph timing: the kernel without DRAM's cost (a
    diagnostic). Sorted: each sequence's pages are consecutive in the pool, in order (long runs, as SDPA reads)."""
    if key in inputs:
        return
    mode, kv, ctx, batch, inline, l2_pages, layout, in_order, topk = key
    inputs.clear()
    torch.cuda.empty_cache()
    cu, lens = decode_meta(batch, ctx)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
    sel = random_selection(batch, ctx)[..., :topk].contiguous() if mode == "sparse" else None
    k, v, ks, vs, table = make_kv(batch, ctx, kv, layout, inline)
    if l2_pages:
        table = table % l2_pages
    if in_order:
        table = torch.arange(table.numel(), device=DEV, dtype=torch.int32).view_as(table)
    ref = paged_attention_ref(q, k, v, table, cu, lens, D**-0.5, ks, vs, layout, sel, BS)
    n = topk * BS if mode == "sparse" else ctx
    kc = torch.randn(batch, HKV, n, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    peer = timings(lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True))
    inputs[key] = (cu, lens, q, sel, k, v, ks, vs, table, ref, peer)


def sweep_gather(rows: list, read_bw: float, var: dict, inputs: dict, results: str) -> None:
    """The read floor of FP8 decode's access pattern (`_gather_kernel`) on the inputs of the decode variants at the
    same context (made here when none were): {"mode": "gather", "ctx", "splits", "scales", "num_warps",
    "num_stages", "dense"}: MSA's selected blocks, or with "dense" every block of every sequence."""
    ctx, dense = var["ctx"], var.get("dense", False)
    key = ("dense" if dense else "sparse", "fp8", ctx, 64, var.get("inline", False), var.get("l2_pages", 0), "plain",
           False, TOPK)
    decode_inputs(inputs, key)
    _, _, _, sel, k, v, ks, vs, table, _, _ = inputs[key]
    if dense:
        sel = torch.arange(ctx // BS, device=DEV, dtype=torch.int32).expand(HKV, 64, ctx // BS).contiguous()
    t = timings(gather_read(k, v, ks, vs, table, sel, var.get("splits", 1), var.get("scales", True),
                            var.get("num_warps", 4), var.get("num_stages", 3)))
    nbytes = 64 * HKV * sel.shape[-1] * BS * 2 * (D + (4 if var.get("scales", True) else 0))
    r = {"kernel": f"{'dense' if dense else 'MSA'} FP8 decode reads alone", "shape": f"b64 ctx {ctx // 1024}K",
         "kv": "fp8", "layout": "plain", "ms": t["ms"], "floor_ms": nbytes / read_bw / 1e9,
         "TB/s": nbytes / t["graph_ms"] / 1e9, "graph_ms": t["graph_ms"], "host_us": t["host_us"],
         "graph_of_floor": nbytes / read_bw / 1e9 / t["graph_ms"], "peer": "-", "peer_ms": float("nan"),
         "tiles": json.dumps({k: v for k, v in var.items() if k != "mode"})}
    rows.append(r)
    record_row(r, results)
    print(f"gather fp8 {ctx // 1024:4}K graph {t['graph_ms']:.4f} ({r['graph_of_floor']:.0%} floor, "
          f"{r['TB/s']:.2f} TB/s) eager {t['ms']:.4f} {r['tiles']}", flush=True)


def to_shuffle(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain FP8 pages [pages, Hkv, 16, D] re-laid out as SHUFFLE (`layout.cache_shape`), the same values."""
    pages, h, _, d = k.shape
    x = shuffle_width(k.dtype)
    k_s = k.view(pages, h, PAGE_SIZE, d // x, x).permute(0, 1, 3, 2, 4).contiguous()
    v_s = v.view(pages, h, PAGE_SIZE // x, x, d).permute(0, 1, 2, 4, 3).contiguous()
    return k_s, v_s


def sweep_prefill(rows: list, var: dict, inputs: dict, results: str) -> None:
    """One prefill variant of `sweep` (FP8 pages; "layout": "shuffle" re-lays the plain inputs out, so its output is
    compared with the first plain variant's and FlexAttention's time is the plain inputs')."""
    ctx, selection, change = var["ctx"], var.get("selection", "random"), var["tiles"]
    layout = var.get("layout", "plain")
    key = ("prefill", ctx, selection)
    if key not in inputs:
        inputs.clear()
        torch.cuda.empty_cache()
        cu, lens, k, v, ks, vs, table, _, _, sel = prefill_inputs(ctx, selection)
        q = torch.randn(ctx, HQ, D, device=DEV, dtype=torch.bfloat16)
        inputs[key] = {"args": (q, k, v, table, cu, lens, D**-0.5, ks, vs, "plain", sel, BS), "ref": None,
                       "flex_ms": float("nan"), "note": ""}
    state = inputs[key]
    args = state["args"]
    if layout == "shuffle":
        if "shuffle_args" not in state:
            q, k, v, table, cu, lens, scale, ks, vs, _, sel, bs = args
            state["shuffle_args"] = (q, *to_shuffle(k, v), table, cu, lens, scale, ks, vs, "shuffle", sel, bs)
        args = state["shuffle_args"]

    def ours():
        return paged_attention(*args, max_seqlen_q=ctx, max_context_len=ctx)  # noqa: B023

    def measure():
        out = ours()
        if state["ref"] is None:
            state["ref"] = out
        err = rel_err(out, state["ref"])
        return err, bench(ours) if err < 2e-2 else float("nan")
    err, t = with_tiles(change, measure)
    if var.get("flex") and math.isnan(state["flex_ms"]):
        plain = state["args"]  # Flex reads contiguous K/V made from the plain pages
        q, k, v, table, ks, vs, sel = plain[0], plain[1], plain[2], plain[3], plain[7], plain[8], plain[10]
        try:
            mask, locality = flex_prefill_mask(sel, ctx)
            qs = q.transpose(0, 1)[None].contiguous()
            kc, vc = contiguous_kv(k, v, ks, vs, table)
            flex_err = rel_err(FLEX(qs, kc, vc, block_mask=mask, enable_gqa=True)[0].transpose(0, 1), state["ref"])
            state["flex_ms"] = bench(lambda: FLEX(qs, kc, vc, block_mask=mask, enable_gqa=True))
            state["note"] = (f"flex rel err vs ours {flex_err:.1e}; distinct blocks per 128 q "
                             f"{locality['blocks_per_128q']:.1f}, per 8 q {locality['blocks_per_8q_tile']:.1f}")
            del kc, vc
        except Exception as e:  # noqa: BLE001 (the peer failing must not lose our rows)
            state["note"] = f"flex failed: {type(e).__name__}: {str(e)[:200]}"
    flops = 4 * ctx * HQ * TOPK * BS * D
    r = {"kernel": "MSA sparse prefill", "shape": f"{ctx // 1024}K tokens, {selection} sel", "kv": "fp8",
         "layout": layout, "ms": t, "floor_ms": flops / 790e12 * 1e3, "TB/s": float("nan"),
         "peer": "FlexAttention, same block mask, bf16 KV", "peer_ms": state["flex_ms"], "tiles": json.dumps(change),
         "rel_err_vs_first": err, "note": state["note"]}
    rows.append(r)
    record_row(r, results)
    print(f"prefill {layout[:5]} {ctx // 1024}K {selection} err {err:.1e} ms {t:.2f} flex {state['flex_ms']:.2f} "
          f"({state['flex_ms'] / t:.2f}x) {json.dumps(change)} {state['note'][:60]}", flush=True)


def graphs_check() -> dict:
    """Each decode mode captured in a torch.cuda.CUDAGraph (static output), replayed, synchronized: the replays
    must equal eager. Then do_bench_cudagraph of MSA FP8 decode at b64 32K after a full synchronize (inputs made
    on the default stream must be ready before Triton's side stream reads them)."""
    result = {}
    batch, ctx = 8, 4096
    cu, lens = decode_meta(batch, ctx)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
    sel = random_selection(batch, ctx)
    for kv, layout in (("fp8", "shuffle"), ("fp8", "plain"), ("bf16", "plain"), ("bf16", "shuffle")):
        k, v, ks, vs, table = make_kv(batch, ctx, kv, layout)
        for mode, s in (("sparse", sel), ("dense", None)):
            def run(out=None):
                return paged_attention(q, k, v, table, cu, lens, D**-0.5, ks, vs, layout, s, BS,  # noqa: B023
                                       max_seqlen_q=1, max_context_len=ctx, out=out)
            eager = run()
            static = torch.empty_like(eager)
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run(static)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run(static)
            for _ in range(3):
                static.fill_(float("nan"))
                graph.replay()
            torch.cuda.synchronize()
            result[f"{mode}_{kv}_{layout}_replay_equals_eager"] = bool(torch.equal(static, eager))
    batch, ctx = 64, 32768
    cu, lens = decode_meta(batch, ctx)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
    sel = random_selection(batch, ctx)
    k, v, ks, vs, table = make_kv(batch, ctx, "fp8", "shuffle")
    torch.cuda.synchronize()
    result["sparse_fp8_shuffle_b64_32k_graph_ms"] = triton.testing.do_bench_cudagraph(
        lambda: paged_attention(q, k, v, table, cu, lens, D**-0.5, ks, vs, "shuffle", sel, BS, max_seqlen_q=1,
                                max_context_len=ctx), rep=100, return_mode="median")
    torch.cuda.synchronize()
    return result


STEPS = {
    "sparse_decode_32k": lambda rows, bw: sparse_decode(rows, bw, 32768),
    "sparse_decode_128k": lambda rows, bw: sparse_decode(rows, bw, 131072),
    "indexer_decode_128k": lambda rows, bw: indexer_decode(rows, bw, 131072),
    "indexer_decode_32k": lambda rows, bw: indexer_decode(rows, bw, 32768),
    "dense_decode_32k": lambda rows, bw: dense_decode(rows, bw, 32768),
    "dense_decode_128k": lambda rows, bw: dense_decode(rows, bw, 131072),
    "sparse_prefill_32k": lambda rows, bw: sparse_prefill(rows, 32768, "random", flex=True),
    "sparse_prefill_32k_smooth": lambda rows, bw: sparse_prefill(rows, 32768, "smooth", flex=True),
    "sparse_prefill_128k": lambda rows, bw: sparse_prefill(rows, 131072, "random", flex=False),
    "sparse_prefill_128k_smooth": lambda rows, bw: sparse_prefill(rows, 131072, "smooth", flex=False),
    "flex_decode_32k": lambda rows, bw: flex_decode(rows, bw, 32768),
    "flex_decode_128k": lambda rows, bw: flex_decode(rows, bw, 131072),
    "tiles_indexer": tiles_indexer,
    "gluon_sparse_decode_32k": lambda rows, bw: gluon_sparse_decode(rows, bw, 32768),
}


def print_table(rows: list[dict]) -> None:
    print(f"\n{'kernel':20} {'shape':22} {'kv':5} {'layout':8} {'ours ms':>9} {'floor ms':>9} {'of floor':>8} "
          f"{'TB/s':>6} {'peer ms':>9} {'vs peer':>8}  peer")
    for r in rows:
        vs_floor = r["floor_ms"] / r["ms"]
        vs_peer = r["peer_ms"] / r["ms"] if not math.isnan(r["peer_ms"]) else float("nan")
        print(f"{r['kernel']:20} {r['shape']:22} {r['kv']:5} {r['layout']:8} {r['ms']:9.4f} {r['floor_ms']:9.4f} "
              f"{vs_floor:8.0%} {r['TB/s']:6.2f} {r['peer_ms']:9.4f} {vs_peer:7.2f}x  {r['peer']} "
              f"{r.get('tiles', '')} {r.get('note', '')}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON results")
    parser.add_argument("--steps", default="check," + ",".join(STEPS),
                        help="comma list of: check, bandwidth, " + ", ".join(STEPS) + ", sweep, graphs, report")
    parser.add_argument("--kv", choices=("bf16", "fp8"), help="decode steps: only this KV dtype")
    parser.add_argument("--layout", choices=("plain", "shuffle"), help="decode steps: only this layout")
    parser.add_argument("--variants", default="[]", help="sweep: JSON list of decode variants (see `sweep`)")
    parser.add_argument("--gluon-variants", help="gluon_sparse_decode_*: JSON list of tile variants to time "
                        "(gluon_sparse_decode.plan's keywords) in place of GLUON_VARIANTS")
    args = parser.parse_args()
    steps = args.steps.split(",")
    if args.gluon_variants:
        GLUON_VARIANTS[:] = json.loads(args.gluon_variants)
    results = os.path.join(args.out, "attention.jsonl")  # one JSON object per line, appended by each step
    if any(s != "report" for s in steps):
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
              flush=True)
    status = 0
    for token in steps:
        step, *filters = token.split(":")
        ONLY.clear()
        ONLY.update({k: v for k, v in (("kv", args.kv), ("layout", args.layout)) if v})
        ONLY.update(zip(("kv", "layout"), filters, strict=False))
        if step == "check":
            errs = check_correctness(kvs=(ONLY["kv"],) if "kv" in ONLY else ("bf16", "fp8"),
                                     layouts=(ONLY["layout"],) if "layout" in ONLY else ("plain", "shuffle"))
            worst = {k: v for k, v in errs.items() if v > (5e-3 if "mismatch" in k else 2e-2)}
            print("correctness (rel L2 / mismatch fraction):", json.dumps(errs), flush=True)
            record = {"errors": errs}
            if worst:
                print("CORRECTNESS FAILURES:", worst)
                status = 1
        elif step == "graphs":
            record = {"graphs": graphs_check()}
            print("CUDA graphs:", json.dumps(record["graphs"]), flush=True)
        elif step == "sweep":
            read_bw = next(r["read_TBps"] for r in map(json.loads, open(results)) if "read_TBps" in r)
            sweep([], read_bw, json.loads(args.variants), results)
            continue
        elif step == "bandwidth":
            rates, copy_bw = read_rates(), copy_bandwidth()
            read_bw = rates["read"]
            print(f"read {read_bw:.2f} TB/s (4 GiB sums: Triton streaming {rates['triton_sum']:.2f}, torch "
                  f"{rates['torch_sum']:.2f}), copy {copy_bw:.2f} TB/s (read + write)", flush=True)
            record = {"read_TBps": read_bw, "read_torch_sum_TBps": rates["torch_sum"],
                      "read_triton_sum_TBps": rates["triton_sum"], "copy_TBps": copy_bw}
        elif step == "report":
            lines = [json.loads(line) for line in open(results)]
            print_table([r for line in lines for r in line.get("rows", [])])
            continue
        else:
            read_bw = next(r["read_TBps"] for r in map(json.loads, open(results)) if "read_TBps" in r)
            rows: list[dict] = []
            STEPS[step](rows, read_bw)
            print_table(rows)
            record = {"step": step, "rows": rows}
        with open(results, "a") as f:
            f.write(json.dumps(record) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
