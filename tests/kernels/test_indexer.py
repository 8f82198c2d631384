"""Triton indexer (block-max scan, forced local blocks, top-k) against `indexer_topk_ref`."""

import pytest
import torch
from attn_cases import make_step

from m3sdk_kernels.indexer import indexer_topk
from m3sdk_kernels.reference import (
    gather_index_keys_ref,
    indexer_topk_ref,
)

HIDX, DI = 2, 32


def block_scores(index_q, step, block, local):
    """The reference's score of every (head, token, block), -inf past the token, +inf on its local blocks."""
    rows = []
    cu = step.cu_seqlens_q.tolist()
    for i, ctx in enumerate(step.context_lens.tolist()):
        n = cu[i + 1] - cu[i]
        keys = gather_index_keys_ref(step.index_cache, step.page_table[i, : -(-ctx // 16)], ctx)
        nb = -(-ctx // block)
        for j in range(n):
            pos = ctx - n + j
            s = index_q[cu[i] + j].float() @ keys[: pos + 1].T  # [H, pos + 1]
            s = torch.nn.functional.pad(s, (0, nb * block - pos - 1), value=float("-inf"))
            s = s.view(HIDX, nb, block).amax(-1)
            for back in range(local):
                s[:, max(pos // block - back, 0)] = float("inf")
            rows.append(s)
    return rows


def check(got, ref, index_q, step, block, local):
    """Same number of valid entries per row, valid first; the chosen blocks' scores equal the reference's
    (as multisets: robust to exact ties, which random data does not make anyway)."""
    scores = block_scores(index_q, step, block, local)
    for t, s in enumerate(scores):
        for h in range(HIDX):
            g, r = got[h, t], ref[h, t]
            valid = int((r >= 0).sum())
            assert int((g >= 0).sum()) == valid and (g[:valid] >= 0).all()
            assert sorted(s[h, g[:valid].long()].tolist()) == sorted(s[h, r[:valid].long()].tolist())


@pytest.mark.parametrize("index_dtype", ["bf16", "fp8", "fp32"])
@pytest.mark.parametrize("mode", ["decode", "decode_idle", "verify", "prefill"])
def test_matches_reference(mode, index_dtype, device):
    """Contexts of up to 200 tokens in 16-token blocks, top-3: selection drops most blocks. decode_idle: a
    sequence without a query token (token i is then not sequence i)."""
    ctx, new = {"decode": ([200, 37, 16, 129, 1], [1] * 5), "decode_idle": ([200, 37, 129], [1, 0, 1]),
                "verify": ([200, 70], [4, 4]), "prefill": ([150, 40], [70, 40])}[mode]
    block, topk, local = 16, 3, 1
    step = make_step(ctx, new, 1, 16, "bf16", "plain", index_dim=DI, index_dtype=index_dtype, device=device)
    index_q = torch.randn(sum(new), HIDX, DI).to(device, torch.bfloat16)
    out = torch.full((HIDX, sum(new), topk), 12345, dtype=torch.int32, device=device)  # poisoned
    got = indexer_topk(index_q, step.index_cache, step.page_table, step.cu_seqlens_q, step.context_lens, block,
                       topk, local, out=out)
    ref = indexer_topk_ref(index_q, step.index_cache, step.page_table, step.cu_seqlens_q, step.context_lens,
                           block, topk, local)
    assert got is out and got.shape == ref.shape
    check(got, ref, index_q, step, block, local)


def test_local_blocks_and_block_size_32(device):
    """Two forced local blocks (clamped at block 0), 32-token blocks, one more head than the dots' rows need."""
    ctx, new = [20, 100, 250], [1, 3, 1]
    block, topk, local = 32, 4, 2
    step = make_step(ctx, new, 1, 16, "bf16", "plain", index_dim=DI, index_dtype="fp8", device=device)
    index_q = torch.randn(sum(new), HIDX, DI).to(device, torch.bfloat16)
    args = (index_q, step.index_cache, step.page_table, step.cu_seqlens_q, step.context_lens, block, topk, local)
    got, ref = indexer_topk(*args), indexer_topk_ref(*args)
    check(got, ref, index_q, step, block, local)
    last = got[:, -1]  # position 249: blocks 7 (own) and 6 are forced
    assert {6, 7} <= set(last[0].tolist()) and {6, 7} <= set(last[1].tolist())


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_page_ahead_and_long_chunks(mode, monkeypatch, device):
    """The scan with page ids carried one block ahead and few chunks (several blocks per program, the carried
    ids crossing a chunk's end and the sequence's last page), the top-k at one warp."""
    from m3sdk_kernels import arch

    for family in ("indexer_scan", "indexer_scan:fp8", "indexer_prefill"):
        monkeypatch.setitem(arch.TILES[family], "sm90", arch.TILES[family]["sm90"] | {"PAGE_AHEAD": 1,
                                                                                         "SPLIT_PROGRAMS": 8})
    monkeypatch.setitem(arch.TILES["indexer_topk"], "sm90", {"num_warps": 1})
    ctx, new = {"decode": ([200, 37, 129], [1] * 3), "prefill": ([150, 40], [70, 40])}[mode]
    block, topk, local = 16, 3, 1
    step = make_step(ctx, new, 1, 16, "bf16", "plain", index_dim=DI, index_dtype="fp8", device=device)
    index_q = torch.randn(sum(new), HIDX, DI).to(device, torch.bfloat16)
    args = (index_q, step.index_cache, step.page_table, step.cu_seqlens_q, step.context_lens, block, topk, local)
    check(indexer_topk(*args), indexer_topk_ref(*args), index_q, step, block, local)


@pytest.mark.parametrize("num_blocks", [3, 293])
def test_topk_rows_narrower_and_wider_than_the_floor(num_blocks, device):
    """`block_topk` on rows padded to a multiple of 16 and read at the narrowest compiled width (3 blocks) or the
    next one up (293 blocks): torch.topk of each token's visible blocks, highest first, -1 past them; and
    `compile_topk_widths` launches every width up to a context's."""
    from m3sdk_kernels.indexer import TOPK_MIN_WIDTH, block_topk, compile_topk_widths

    block, topk = 16, 8
    assert num_blocks < TOPK_MIN_WIDTH or num_blocks > TOPK_MIN_WIDTH
    scores = torch.randn(HIDX, 2, -(-num_blocks // 16) * 16, generator=torch.Generator().manual_seed(0))
    # one sequence, its 2 query tokens at the last two positions of block num_blocks - 1: both see every block
    cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
    ctx = torch.tensor([num_blocks * block], dtype=torch.int32, device=device)
    out = torch.empty(HIDX, 2, topk, dtype=torch.int32, device=device)
    block_topk(scores.to(device), cu, ctx, block, topk, 2, out)
    k = min(topk, num_blocks)
    assert torch.equal(out[..., :k].cpu(), scores[..., :num_blocks].topk(k, dim=-1).indices.int())
    assert (out[..., k:] == -1).all()
    compile_topk_widths(2 * TOPK_MIN_WIDTH * block, block, topk, device)
