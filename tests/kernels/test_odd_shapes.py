"""Every kernel against its reference at shapes of the MiniMax-M3 architecture off the power-of-two path: head
widths 40 / 72 / 96, index width 24, GQA groups of 3, MSA blocks of 8, 48 and 256 keys, contexts ending inside a
page and inside a key tile, 3 and 5 experts with top-3, a shared expert wider than the routed ones."""

import pytest
import torch
from attn_cases import make_step, poisoned

from m3sdk_kernels import reference
from m3sdk_kernels.experts import Experts, stack_shared
from m3sdk_kernels.indexer import indexer_topk
from m3sdk_kernels.moe import fused_moe, moe_unsupported
from m3sdk_kernels.paged_attention import attention_plan, paged_attention
from m3sdk_kernels.router import route

HKV = 2
ALPHA, LIMIT = 1.702, 7.0


def attend(step, q, **kw):
    out = poisoned(q.shape, q.dtype, q.device)
    got = paged_attention(q, *step.kv, q.shape[-1] ** -0.5, step.k_scale, step.v_scale, step.layout, out=out, **kw)
    ref = paged_attention_ref(step, q, **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    return ref


def paged_attention_ref(step, q, **kw):
    return reference.paged_attention_ref(q, *step.kv, q.shape[-1] ** -0.5, step.k_scale, step.v_scale, step.layout,
                                         **kw)


@pytest.mark.parametrize(("d", "group", "kv_dtype", "layout"), [
    (40, 3, "bf16", "plain"), (72, 16, "fp8", "plain"), (96, 5, "bf16", "shuffle")])
@pytest.mark.parametrize("case", [([1, 17, 70, 129], [1, 1, 1, 1]), ([70, 33, 5], [20, 33, 1])],
                         ids=["decode", "mixed"])
def test_dense_attention_odd_head_widths(case, d, group, kv_dtype, layout, device):
    """Contexts of 17, 33, 70, 129 tokens end inside a page and inside a 64-key tile."""
    ctx, new = case
    step = make_step(ctx, new, HKV, d, kv_dtype, layout, device=device)
    attend(step, torch.randn(sum(new), HKV * group, d).to(device, torch.bfloat16))


@pytest.mark.parametrize(("block", "topk", "ctx", "new"), [
    (8, 5, [70, 33], [1, 1]), (8, 3, [61, 20], [9, 20]), (48, 2, [150, 100], [1, 1]), (48, 2, [150, 60], [6, 3]),
    (256, 2, [700, 300], [1, 1]), (256, 1, [600], [5])],
    ids=["b8-decode", "b8-mixed", "b48-decode", "b48-mixed", "b256-decode", "b256-verify"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_msa_attention_any_block_size(block, topk, ctx, new, kv_dtype, device):
    """MSA over blocks under a page (8 keys: a 16-key tile, half masked), not a multiple of the tile (48) and of
    many pages (256), head width 40, selections from the reference indexer at index width 24."""
    d = 40
    step = make_step(ctx, new, HKV, d, kv_dtype, "plain", index_dim=24, device=device)
    index_q = torch.randn(sum(new), HKV, 24).to(device, torch.bfloat16)
    sel = reference.indexer_topk_ref(index_q, step.index_cache, step.page_table, step.cu_seqlens_q,
                                     step.context_lens, block, topk, 1)
    q = torch.randn(sum(new), HKV * 4, d).to(device, torch.bfloat16)
    ref = attend(step, q, block_sel=sel, block_size=block)
    dense = paged_attention_ref(step, q)
    assert (ref.float() - dense.float()).abs().max() > 0.05  # the selection dropped keys


def test_msa_tiles_are_padded_to_16_keys():
    """tl.dot needs K >= 16 on a GPU: a block of 8 keys runs in 16-key tiles, a 48-key block in 64-key ones."""
    for block, want in ((8, 16), (48, 64), (256, 64)):
        assert attention_plan(4, 4, 4, 16, 1, 4096, True, 16, block)["BLOCK_N"] == want


@pytest.mark.parametrize(("block", "index_dim", "index_dtype"), [(8, 24, "bf16"), (48, 24, "fp8"), (256, 40, "bf16")])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_indexer_any_block_size_and_index_width(block, index_dim, index_dtype, mode, device):
    ctx, new = {"decode": ([600, 37, 129], [1, 1, 1]), "prefill": ([300, 40], [30, 40])}[mode]
    step = make_step(ctx, new, 1, 16, "bf16", "plain", index_dim=index_dim, index_dtype=index_dtype, device=device)
    index_q = torch.randn(sum(new), 3, index_dim).to(device, torch.bfloat16)
    args = (index_q, step.index_cache, step.page_table, step.cu_seqlens_q, step.context_lens, block, 3, 1)
    got, ref = indexer_topk(*args), reference.indexer_topk_ref(*args)
    # ties are absent from random data: the same blocks per row (order among equal scores aside)
    assert torch.equal(got.sort(-1).values, ref.sort(-1).values)


@pytest.mark.parametrize(("experts", "top_k", "shared"), [(3, 3, 2), (5, 3, 1), (5, 2, 0)])
def test_router_expert_counts_and_shared_columns(experts, top_k, shared, device):
    logits = torch.randn(19, experts, device=device) * 2
    bias = torch.randn(experts, device=device) * 0.3
    w, ids = route(logits, bias, top_k, 1.5, shared)
    wr, idr = reference.route_ref(logits, bias, top_k, 1.5, shared)
    assert ids.shape == (19, top_k + shared) and torch.equal(ids, idr)
    torch.testing.assert_close(w, wr, rtol=1e-6, atol=1e-6)
    assert torch.equal(ids[:, top_k:], torch.arange(experts, experts + shared, device=device).int().expand(19, -1))


def swiglu_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return reference.swiglu_oai_ref(x @ gate_up.T, ALPHA, LIMIT) @ down.T


@pytest.mark.parametrize(("experts", "top_k", "shared_inter"), [(3, 3, 80), (5, 3, 32), (5, 3, 24)],
                         ids=["e3-top3-shared80", "e5-top3-shared32", "e5-top3-shared24"])
@pytest.mark.parametrize("t", [2, 24])  # decode (unsorted) and small-batch (sorted) paths
def test_moe_expert_counts_and_a_shared_expert_of_another_width(experts, top_k, shared_inter, t, device):
    """Routed width 32; the shared expert 80 wide (three pieces, the last zero-padded), 32 or 24 wide, stacked
    after the routed ones (`stack_shared`) and picked in full by the router's shared columns: fused MoE = its
    reference = routed experts + the unsplit shared expert, written out."""
    g = torch.Generator().manual_seed(experts * 100 + shared_inter)
    hidden, inter = 64, 32
    wgu, wdn = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1, torch.randn(experts, hidden, inter) * 0.1
    sgu, sdn = torch.randn(2 * shared_inter, hidden, generator=g) * 0.1, torch.randn(hidden, shared_inter) * 0.1
    gate_up, down, n = stack_shared(wgu, wdn, sgu, sdn)
    assert n == -(-shared_inter // inter) and gate_up.shape == (experts + n, 2 * inter, hidden)
    stack = Experts("bf16", gate_up.to(device, torch.bfloat16), down.to(device, torch.bfloat16))
    x = torch.randn(t, hidden, generator=g).to(device, torch.bfloat16)
    w, ids = route(torch.randn(t, experts, generator=g).to(device), torch.zeros(experts, device=device), top_k, 1.0,
                   n)
    got = fused_moe(x, ids, w, stack, ALPHA, LIMIT)
    ref = reference.fused_moe_ref(x, ids, w, stack, ALPHA, LIMIT)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    xf, b = x.float().cpu(), (lambda m: m.to(torch.bfloat16).float())
    plain = swiglu_expert(xf, b(sgu), b(sdn))
    for j in range(top_k):
        for row in range(t):
            e = int(ids[row, j])
            plain[row] += float(w[row, j]) * swiglu_expert(xf[row], b(wgu[e]), b(wdn[e]))
    torch.testing.assert_close(ref.float().cpu(), plain, atol=3e-2, rtol=3e-2)


def test_moe_widths_the_kernels_refuse_are_named():
    """Decided at build (`moe_unsupported`): the dimension that cannot be tiled, by name."""
    assert moe_unsupported(64, 32, "bf16") is None
    assert "hidden_size 40" in moe_unsupported(40, 32, "bf16")
    assert "moe_intermediate_size 24" in moe_unsupported(64, 24, "bf16")
    assert "moe_intermediate_size 96" in moe_unsupported(128, 96, "fp8")  # fp8 activations: groups of 64
