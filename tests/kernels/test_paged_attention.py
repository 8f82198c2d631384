"""Triton paged attention (dense and MSA; decode, chunked prefill, mixed) against `paged_attention_ref`."""

import pytest
import torch
from attn_cases import DTYPES, make_step, poisoned
from kernel_marks import amd_only

from m3sdk_kernels import arch
from m3sdk_kernels.paged_attention import MERGE_LAST_MAX_SPLITS, arrival_counters, attention_plan, paged_attention
from m3sdk_kernels.reference import (
    indexer_topk_ref,
    paged_attention_ref,
)

HKV, GROUP, D = 2, 16, 32  # M3's 16 query heads per KV head, small head dim
# (ctx after the step, new tokens): decode across page edges, a chunk in the middle of a prompt, a whole prompt
DECODE = ([1, 15, 16, 17, 70, 129], [1, 1, 1, 1, 1, 1])
MIXED = ([70, 33, 5, 130], [20, 33, 1, 4])
MIXED_SPARSE = ([70, 20, 5, 130], [12, 20, 1, 4])  # smaller: the interpreter walks block unions slowly


def run(step, q, scale, **kw):
    """Kernel into a NaN-poisoned output (every element must be written) and the reference."""
    out = poisoned(q.shape, q.dtype, q.device)
    got = paged_attention(q, *step.kv, scale, step.k_scale, step.v_scale, step.layout, out=out, **kw)
    assert got is out
    ref = paged_attention_ref(q, *step.kv, scale, step.k_scale, step.v_scale, step.layout, **kw)
    assert not got.isnan().any()
    return got.float(), ref.float()


@pytest.mark.parametrize("layout", ["plain", "shuffle"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("case", [DECODE, MIXED], ids=["decode", "mixed"])
def test_dense_matches_reference(case, kv_dtype, layout, device):
    ctx, new = case
    step = make_step(ctx, new, HKV, D, kv_dtype, layout, device=device)
    q = torch.randn(sum(new), HKV * GROUP, D).to(device, torch.bfloat16)
    got, ref = run(step, q, D**-0.5)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("layout,ahead", [("plain", 0), ("shuffle", 0), ("plain", 1)],
                         ids=["plain", "shuffle", "plain-ahead"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("case", [DECODE, MIXED_SPARSE], ids=["decode", "mixed"])
def test_sparse_matches_reference_and_drops_blocks(monkeypatch, case, kv_dtype, layout, ahead, device):
    """MSA with 16-token blocks, top-2: contexts up to 130 tokens keep 2 of up to 9 blocks. Decode reads its block
    ids in each tile's iteration, or (`ahead`) once, with page ids carried a tile ahead (PAGE_AHEAD)."""
    for family in ("sparse_decode", "sparse_decode:fp8"):
        monkeypatch.setitem(arch.TILES[family], "sm90", {**arch.TILES[family]["sm90"], "PAGE_AHEAD": ahead})
    ctx, new = case
    block, topk = 16, 2
    step = make_step(ctx, new, HKV, D, kv_dtype, layout, index_dim=32, device=device)
    index_q = torch.randn(sum(new), HKV, 32).to(device, torch.bfloat16)
    sel = indexer_topk_ref(index_q, step.index_cache, step.page_table, step.cu_seqlens_q, step.context_lens,
                           block, topk, 1)
    q = torch.randn(sum(new), HKV * GROUP, D).to(device, torch.bfloat16)
    got, ref = run(step, q, D**-0.5, block_sel=sel, block_size=block)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    dense = paged_attention_ref(q, *step.kv, D**-0.5, step.k_scale, step.v_scale, layout).float()
    assert (ref - dense).abs().max() > 0.05  # the selection changed the result: something was dropped


@pytest.mark.parametrize("merge_last", [0, 1], ids=["merge-kernel", "merge-last"])
def test_splits_and_gqa_padding(monkeypatch, merge_last, device, ieee_fp32):
    """Split-KV + LSE merge (many splits, some empty), a group of 4 heads padded to 16 rows, fp32 KV; merged by a
    second kernel, or (MERGE_LAST) by each tile's last program to arrive, whose counters are back at 0 after the
    call (a second call gives the same result)."""
    monkeypatch.setitem(arch.TILES["attn_decode"], "sm90", {**arch.TILES["attn_decode"]["sm90"], "BLOCK_N": 16,
                                                            "SPLIT_PROGRAMS": 1 << 12, "MERGE_LAST": merge_last})
    ctx, new = [3, 100, 47], [1, 1, 1]
    plan = attention_plan(3, 3, HKV, 4, 1, max(ctx), False, 1, 128)
    assert plan["NUM_SPLITS"] >= 2 and plan["BLOCK_H"] == 16 and plan["MERGE_LAST"] == merge_last
    step = make_step(ctx, new, HKV, D, "fp32", "plain", device=device)
    q = torch.randn(3, HKV * 4, D, device=device)
    got, ref = run(step, q, 0.3)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    if merge_last:
        assert not arrival_counters(q.device, 3 * HKV)[: 3 * HKV].any()
        torch.testing.assert_close(run(step, q, 0.3)[0], got, atol=0, rtol=0)


def test_merge_last_only_for_few_splits():
    """A long context of few sequences splits wide; past MERGE_LAST_MAX_SPLITS the merge kernel merges, since the
    last program's unrolled merge took minutes to compile at 256 splits (a first 32K request would stall on it)."""
    wide = attention_plan(1, 1, 4, 16, 1, 32768, False, 1, 128, fp8=True, arch=arch.ARCHS["sm90"])
    batch = attention_plan(64, 64, 4, 16, 1, 32768, False, 1, 128, fp8=True, arch=arch.ARCHS["sm90"])
    msa = attention_plan(1, 1, 4, 16, 1, 32768, True, 16, 128, fp8=True, arch=arch.ARCHS["sm90"])
    assert wide["NUM_SPLITS"] > MERGE_LAST_MAX_SPLITS and wide["MERGE_LAST"] == 0
    assert 1 < batch["NUM_SPLITS"] <= MERGE_LAST_MAX_SPLITS and batch["MERGE_LAST"] == 1
    assert msa["NUM_SPLITS"] == MERGE_LAST_MAX_SPLITS and msa["MERGE_LAST"] == 1


def test_few_tokens_take_wider_msa_programs(device):
    """sm90 FP8 MSA decode: a batch whose programs do not fill the chip even at 16 splits (FEW_BELOW) runs 2-warp
    programs of 64-key tiles; from 16 tokens on, one-warp programs of 32-key tiles (the other tests set FEW_BELOW 0
    to keep their small batches on that shape). The wide one matches the reference over 128-token blocks (two tiles
    a block) with a selection that drops blocks."""
    sm90 = arch.ARCHS["sm90"]
    few = attention_plan(2, 2, HKV, GROUP, 1, 1000, True, 4, 128, fp8=True, arch=sm90)
    full = attention_plan(16, 16, 4, 16, 1, 32768, True, 16, 128, fp8=True, arch=sm90)
    assert (few["num_warps"], few["BLOCK_N"]) == (2, 64) and (full["num_warps"], full["BLOCK_N"]) == (1, 32)
    ctx, new = [1000, 700], [1, 1]
    step = make_step(ctx, new, HKV, D, "fp8", "plain", device=device)
    sel = torch.tensor([[[7, 2, -1, 5], [0, 5, 3, -1]], [[1, 7, 4, -1], [5, 2, 0, -1]]], dtype=torch.int32,
                       device=device)
    q = torch.randn(2, HKV * GROUP, D).to(device, torch.bfloat16)
    got, ref = run(step, q, D**-0.5, block_sel=sel, block_size=128)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page_ahead", [0, 1])
@pytest.mark.parametrize("programs", [8, 24], ids=["1-split", "2-splits"])
def test_dense_fp8_decode_many_tiles_per_split(monkeypatch, programs, page_ahead, device):
    """Dense FP8 decode with several 16-key tiles per split across page edges: page ids loaded in the tile's own
    iteration, or carried one tile ahead (PAGE_AHEAD, sm90's FP8 default) from tile to tile."""
    fp8 = arch.TILES["attn_decode:fp8"]["sm90"]
    monkeypatch.setitem(arch.TILES["attn_decode:fp8"], "sm90",
                        {**fp8, "BLOCK_N": 16, "SPLIT_PROGRAMS": programs, "PAGE_AHEAD": page_ahead})
    ctx, new = DECODE
    plan = attention_plan(len(ctx), len(ctx), HKV, GROUP, 1, max(ctx), False, 1, 128, fp8=True)
    assert plan["NUM_SPLITS"] == (1 if programs == 8 else 2) and plan["PAGE_AHEAD"] == page_ahead
    step = make_step(ctx, new, HKV, D, "fp8", "shuffle", device=device)
    q = torch.randn(sum(new), HKV * GROUP, D).to(device, torch.bfloat16)
    got, ref = run(step, q, D**-0.5)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("layout,ahead,merge_last", [("shuffle", 0, 1), ("plain", 1, 0), ("plain", 1, 1)],
                         ids=["shuffle-merge-last", "plain-ahead", "plain-ahead-merge-last"])
@pytest.mark.parametrize("programs", [1 << 12, 8], ids=["4-splits", "2-splits"])
def test_sparse_decode_splits_and_unsorted_selection(monkeypatch, programs, layout, ahead, merge_last, device):
    """Selections in any order (valid entries first, -1 padded) split over programs, two 16-key tiles per block:
    block and page ids loaded in each tile's iteration, or (PAGE_AHEAD, plain pages) the split's block ids read
    once and each tile's page ids carried from the previous iteration; splits merged by a second kernel or in the
    last program of each (token, KV head) (MERGE_LAST, sm90's FP8 default)."""
    fp8 = arch.TILES["sparse_decode:fp8"]["sm90"]  # the FP8 entry overrides the family's
    monkeypatch.setitem(arch.TILES["sparse_decode:fp8"], "sm90", {**fp8, "BLOCK_N": 16, "SPLIT_PROGRAMS": programs,
                                                                  "PAGE_AHEAD": ahead, "MERGE_LAST": merge_last,
                                                                  "FEW_BELOW": 0})
    assert attention_plan(2, 2, HKV, GROUP, 1, 100, True, 4, 32, fp8=True)["NUM_SPLITS"] == (4 if programs > 8 else 2)
    ctx, new = [100, 40], [1, 1]
    step = make_step(ctx, new, HKV, D, "fp8", layout, device=device)
    sel = torch.tensor([[[3, 0, 2, -1], [1, 0, -1, -1]], [[1, 3, -1, -1], [0, 1, -1, -1]]], dtype=torch.int32,
                       device=device)
    q = torch.randn(2, HKV * GROUP, D).to(device, torch.bfloat16)
    got, ref = run(step, q, D**-0.5, block_sel=sel, block_size=32)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


@amd_only
def test_fp8_fnuz_cache(device):
    """gfx942's e4m3fnuz pages decode the same way (scales carry the range)."""
    ctx, new = [40, 17], [3, 1]
    step = make_step(ctx, new, HKV, D, "fp8nuz", "plain", device=device)
    assert step.k_cache.dtype == DTYPES["fp8nuz"]
    q = torch.randn(4, HKV * GROUP, D).to(device, torch.bfloat16)
    got, ref = run(step, q, D**-0.5)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)



@pytest.mark.parametrize("merge_last", [0, 1], ids=["merge-kernel", "merge-last"])
def test_keys_as_mma_rows_decode(monkeypatch, merge_last, device):
    """KEYS_M (bf16 decode with the keys as the MMA's M, l summed after the loop; sm90's dense default): dense
    decode over several 16-key tiles per split with page ids carried ahead, MSA decode over 16-key tiles, splits
    merged by a second kernel or by their last program, against the reference."""
    for family, extra in (("attn_decode", {"BLOCK_N": 16, "SPLIT_PROGRAMS": 24, "PAGE_AHEAD": 1}),
                          ("sparse_decode", {"BLOCK_N": 16, "SPLIT_PROGRAMS": 1 << 12})):
        monkeypatch.setitem(arch.TILES[family], "sm90", {**arch.TILES[family]["sm90"], **extra, "KEYS_M": 1,
                                                         "MERGE_LAST": merge_last})
    ctx, new = DECODE
    assert attention_plan(len(ctx), len(ctx), HKV, GROUP, 1, max(ctx), False, 1, 128)["KEYS_M"] == 1
    dense_and_msa_decode_match(make_step(ctx, new, HKV, D, "bf16", "plain", device=device), new, device)


def dense_and_msa_decode_match(step, new: list[int], device) -> None:
    """Dense decode, then MSA decode over the reference indexer's top-2 of 16-key blocks, against the reference."""
    q = torch.randn(sum(new), HKV * GROUP, D).to(device, torch.bfloat16)
    index_q = torch.randn(sum(new), HKV, 32).to(device, torch.bfloat16)
    sel = indexer_topk_ref(index_q, step.index_cache, step.page_table, step.cu_seqlens_q, step.context_lens, 16, 2, 1)
    for kw in ({}, {"block_sel": sel, "block_size": 16}):
        got, ref = run(step, q, D**-0.5, **kw)
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_decode_one_token_each(monkeypatch, kv_dtype, device):
    """A decode batch of one query token per sequence maps program i to sequence i without searching cu_seqlens_q
    (ONE_EACH; a batch where some sequence has no token keeps the search): dense decode in 4 splits of 16-key tiles
    (short contexts leave splits empty: their partials are zeros the merge loads without waiting for their weights)
    and MSA decode, merged by the last program of each token's splits, against the reference."""
    for family, extra in (("attn_decode", {"BLOCK_N": 16, "SPLIT_PROGRAMS": 1 << 12}),
                          ("attn_decode:fp8", {"BLOCK_N": 16, "SPLIT_PROGRAMS": 1 << 12}),
                          ("sparse_decode", {}), ("sparse_decode:fp8", {"FEW_BELOW": 0})):
        monkeypatch.setitem(arch.TILES[family], "sm90", {**arch.TILES[family]["sm90"], **extra, "MERGE_LAST": 1})
    ctx, new = DECODE
    plan = attention_plan(len(ctx), len(ctx), HKV, GROUP, 1, max(ctx), False, 1, 128, fp8=kv_dtype == "fp8")
    assert plan["ONE_EACH"] == 1 and plan["NUM_SPLITS"] == 4 and plan["MERGE_LAST"] == 1
    assert attention_plan(len(ctx) - 1, len(ctx), HKV, GROUP, 1, max(ctx), False, 1, 128)["ONE_EACH"] == 0
    dense_and_msa_decode_match(make_step(ctx, new, HKV, D, kv_dtype, "plain", device=device), new, device)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_prefill_bulk_tiles_match_reference(monkeypatch, kv_dtype, device):
    """Chunks behind long prefixes, with the unmasked tiles before each program's first query (BULK) and without:
    programs whose first query sits on, before and past a tile edge, a chunk shorter than a tile, split ranges."""
    ctx, new = [300, 161, 90], [37, 97, 3]
    step = make_step(ctx, new, 1, D, kv_dtype, "plain", device=device)
    q = torch.randn(sum(new), GROUP, D).to(device, torch.bfloat16)
    outs = []
    for bulk in (0, 1):
        for family in ("attn_prefill", "attn_prefill:fp8"):
            monkeypatch.setitem(arch.TILES[family], "sm90", {**arch.TILES[family]["sm90"], "BULK": bulk, "BLOCK_N": 32})
        plan = attention_plan(sum(new), len(new), 1, GROUP, max(new), max(ctx), False, 1, 128, kv_dtype == "fp8")
        assert plan["BULK"] == bulk and plan["Q_FP8"] == 0
        got, ref = run(step, q, D**-0.5)
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
        outs.append(got)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_fp8_score_dot_stays_near_reference(monkeypatch, device):
    """The tuning switch Q_FP8 (q scaled per row into e4m3, the scores an FP8 dot with the cached keys) over a
    prefix: within its documented error of the reference (relative L2 about 2 % at these short contexts, 2.5e-3
    behind 128K keys), where FP8 pages alone stay near 1e-3."""
    if arch.current_arch().name != "sm90":
        pytest.skip("an sm90 tile-table switch")
    monkeypatch.setitem(arch.TILES["attn_prefill:fp8"], "sm90", {**arch.TILES["attn_prefill:fp8"]["sm90"],
                                                                  "Q_FP8": 1})
    ctx, new = [1000, 130], [64, 130]
    step = make_step(ctx, new, 2, 128, "fp8", "plain", device=device)
    q = torch.randn(sum(new), 2 * GROUP, 128).to(device, torch.bfloat16)
    assert attention_plan(sum(new), 2, 2, GROUP, max(new), max(ctx), False, 1, 128, True)["Q_FP8"] == 1
    got, ref = run(step, q, 128**-0.5)
    assert (got - ref).norm() / ref.norm() < 4e-2
