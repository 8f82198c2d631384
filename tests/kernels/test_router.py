"""Sigmoid router (bias steers the choice, weights unbiased and renormalized) against its reference."""

import pytest
import torch

from m3sdk_kernels import reference, router


def hf_route(logits, bias, top_k):
    """transformers' MiniMaxM3VLTopKRouter after the logits, written out."""
    p = torch.sigmoid(logits.float())
    _, ids = torch.topk(p + bias, top_k, dim=-1, sorted=False)
    w = p.gather(1, ids)
    return w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("shared", [False, True])
def test_route_matches_reference_and_transformers(shared, device):
    torch.manual_seed(0)
    t, e, k, scale = 53, 128, 4, 2.0  # more tokens than one program's block
    logits = torch.randn(t, e, device=device) * 3
    bias = torch.randn(e, device=device) * 0.5  # large enough to change the choice against plain top-k of the sigmoid
    w, ids = router.route(logits, bias, k, scale, shared)
    wr, idr = reference.route_ref(logits, bias, k, scale, shared)
    assert w.shape == ids.shape == (t, k + shared) and ids.dtype == torch.int32
    assert torch.equal(ids, idr)
    torch.testing.assert_close(w, wr, rtol=1e-6, atol=1e-6)
    hw, hids = hf_route(logits, bias, k)
    order = hids.sort(-1)
    assert torch.equal(ids[:, :k].sort(-1).values.long(), order.values)
    torch.testing.assert_close(w[:, :k].gather(1, ids[:, :k].sort(-1).indices), scale * hw.gather(1, order.indices))
    plain = torch.topk(logits, k).indices.sort(-1).values
    assert (plain != order.values).any()  # the bias changed some choices: the test can tell it apart
    if shared:
        assert (ids[:, k] == e).all() and (w[:, k] == 1).all()


@pytest.mark.parametrize("case", ["ties", "dominant_bias", "narrow"])
def test_never_the_same_expert_twice(case, device):
    torch.manual_seed(1)
    t, e, k = 20, 16, 4
    logits = torch.randn(t, e, device=device)
    bias = torch.zeros(e, device=device)
    if case == "ties":
        logits = torch.zeros(t, e, device=device)  # every score equal
    elif case == "dominant_bias":
        bias[3] = 100.0  # one expert wins every round of argmax until it is masked
    else:
        e, logits, bias = 4, logits[:, :4], bias[:4]  # top-k of exactly k experts
    w, ids = router.route(logits, bias, k)
    for row in ids.tolist():
        assert len(set(row)) == k and all(0 <= i < e for i in row)
    torch.testing.assert_close(w.sum(-1), torch.ones(t, device=device))
    if case == "dominant_bias":
        assert (ids == 3).any(-1).all()
