"""The shared verifier: exact greedy acceptance and the distribution of speculative sampling (chi-square)."""

import torch

from m3sdk.params import SamplingParams
from m3sdk.sampler import SamplingState, processed_probs
from m3sdk.speculative.verify import VerifyRow, accept_greedy, accept_sampled, verify

# chi-square critical values at p = 1e-4 (df = V - 1): a correct sampler fails this once in 10^4 runs
CHI2_CRIT = {5: 25.74, 3: 21.11}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, f"sampled tokens of probability 0: {counts}"
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum())


P = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10],
                  [0.10, 0.40, 0.05, 0.15, 0.10, 0.20],
                  [0.50, 0.10, 0.10, 0.10, 0.10, 0.10]])
Q = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10],
                  [0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])


def _run(q_sampled: bool, trials: int = 20000):
    g = torch.Generator().manual_seed(0)
    first = torch.zeros(6)
    second = torch.zeros(6)  # given the first draft accepted
    accepted_first = 0
    for _ in range(trials):
        if q_sampled:
            drafts = [int(torch.multinomial(Q[i], 1, generator=g)) for i in range(2)]
            out = accept_sampled(P, drafts, Q, g)
        else:
            drafts = [1, 3]  # fixed point-mass drafts: q is None
            out = accept_sampled(P, drafts, None, g)
        assert 1 <= len(out) <= 3 and out[:-1] == drafts[:len(out) - 1]
        first[out[0]] += 1
        if len(out) >= 2:
            accepted_first += 1
            second[out[1]] += 1
    return first, second, accepted_first


def test_rejection_sampling_reproduces_target_with_sampled_drafts():
    first, second, n = _run(q_sampled=True)
    assert chi_square(first, P[0]) < CHI2_CRIT[5]
    assert chi_square(second, P[1]) < CHI2_CRIT[5]
    # acceptance rate of the first draft is sum(min(p, q)) (= 0.45 here)
    assert abs(n / first.sum() - float(torch.minimum(P[0], Q[0]).sum())) < 0.02


def test_rejection_sampling_reproduces_target_with_point_mass_drafts():
    first, second, n = _run(q_sampled=False)
    assert chi_square(first, P[0]) < CHI2_CRIT[5]
    assert chi_square(second, P[1]) < CHI2_CRIT[5]
    assert abs(n / first.sum() - float(P[0, 1])) < 0.02


def test_a_biased_sampler_fails_the_same_bound():
    """The bound has teeth: a verifier that always accepts emits the draft distribution, which it rejects."""
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(20000):
        counts[int(torch.multinomial(Q[0], 1, generator=g))] += 1
    assert chi_square(counts, P[0]) > CHI2_CRIT[5]


def test_verify_samples_the_processed_distribution():
    """Through `verify`: temperature, top-k and a repetition penalty; the first emitted token follows the
    sampler's processed distribution (point-mass draft of a token that top-k removes is always rejected)."""
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, 3.0, 1.2]]).repeat(2, 1)
    params = SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.5)
    state = SamplingState(params, [6], [])  # token 6 (the best) is penalized
    p = processed_probs(logits[:1], [state])[0]
    n = 6000  # one verify call over n identical rows (independent draws from the global generator)
    counts = torch.zeros(8)
    for out in verify(logits.repeat(n, 1), [VerifyRow(state, [2])] * n):
        counts[out[0].token_id] += 1
    assert p[5] == 0 and counts[5] == 0
    assert chi_square(counts, p) < 30.0  # df 4 (5 survivors), p ~ 1e-5


def test_greedy_accepts_the_matching_prefix_and_corrects():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_greedy([4], []) == [4]


def test_greedy_verify_sees_drafts_in_the_penalty_history():
    """Position 2's argmax depends on whether draft 1 is in the history: with a repetition penalty, token 3
    (accepted at position 1) is penalized at position 2, so the target's token there is 4, not 3."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 0.0],   # -> 3
                           [0.0, 0.0, 0.0, 3.0, 2.5],   # 3 is penalized (3 / 2 = 1.5 < 2.5) -> 4
                           [9.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=2)
    state = SamplingState(params, [0, 1], [])
    out = verify(logits, [VerifyRow(state, [3, 3])])[0]
    assert [t.token_id for t in out] == [3, 4]
    # logprobs are the sampler's: of the penalized logits at each position
    lp = torch.log_softmax(torch.tensor([0.0, 0.0, 0.0, 1.5, 2.5]), 0)[4]
    assert abs(out[1].logprob - float(lp)) < 1e-5
    assert out[1].top_logprobs[0][0] == 4 and len(out[1].top_logprobs) == 2


def test_seeded_verify_is_reproducible_and_mixed_batches_line_up():
    logits = torch.randn(3 + 1 + 3, 16, generator=torch.Generator().manual_seed(3))
    rows = lambda: [VerifyRow(SamplingState(SamplingParams(temperature=1.0, seed=7), [1], []), [4, 5]),  # noqa: E731
                    VerifyRow(SamplingState(SamplingParams(temperature=0), [1], []), []),
                    VerifyRow(SamplingState(SamplingParams(temperature=0), [1], []), [int(logits[4].argmax()), 0])]
    a, b = verify(logits, rows()), verify(logits, rows())
    assert [[t.token_id for t in r] for r in a] == [[t.token_id for t in r] for r in b]
    assert [t.token_id for t in a[1]] == [int(logits[3].argmax())]
    assert a[2][0].token_id == int(logits[4].argmax())
