import math

import pytest
import torch

from m3sdk.params import SamplingParams
from m3sdk.sampler import (
    Sampler,
    SamplingState,
    apply_penalties,
    apply_truncation,
    processed_probs,
    step_seed,
)

V = 50


def _state(prompt=(), output=(), **kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), list(prompt), list(output))


def _logits(n: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# ---- plain references (loops over python lists) ---------------------------------------------------------

def ref_penalties(row: list[float], prompt, output, rep, pres, freq) -> list[float]:
    out = list(row)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def ref_keep(row: list[float], temperature, top_k, top_p, min_p) -> list[bool]:
    """Which tokens survive, computed in probability space, one rule at a time."""
    z = [v / temperature for v in row]
    m = max(z)
    e = [math.exp(v - m) for v in z]
    probs = [v / sum(e) for v in e]
    keep = [True] * len(row)
    if min_p > 0:
        keep = [k and p >= min_p * max(probs) for k, p in zip(keep, probs, strict=True)]
    if top_k > 0:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = [k and v >= kth for k, v in zip(keep, z, strict=True)]
    if top_p < 1:
        kept_mass = sum(p for p, k in zip(probs, keep, strict=True) if k)
        order = sorted((i for i in range(len(row)) if keep[i]), key=lambda i: -probs[i])
        before = 0.0
        for i in order:
            if before >= top_p:
                keep[i] = False
            before += probs[i] / kept_mass
    return keep


# ---- greedy, penalties, truncation ----------------------------------------------------------------------

def test_greedy_is_argmax_and_logprob_is_log_softmax():
    x = _logits(6)
    out = Sampler().sample(x, [_state(temperature=0) for _ in range(6)])
    assert [t.token_id for t in out] == x.argmax(1).tolist()
    ref = x.log_softmax(1).max(1).values
    assert torch.allclose(torch.tensor([t.logprob for t in out]), ref, atol=1e-5)
    assert all(t.top_logprobs is None for t in out)


def test_penalties_match_reference_and_follow_appended_tokens():
    x = _logits(4)
    rng = torch.Generator().manual_seed(1)
    states = []
    for rep, pres, freq in [(1.3, 0.0, 0.0), (0.7, 0.5, 0.0), (1.0, -0.4, 1.5), (2.0, 2.0, -2.0)]:
        prompt = torch.randint(0, V, (12,), generator=rng).tolist()
        output = torch.randint(0, V, (9,), generator=rng).tolist()
        states.append(_state(prompt, output, repetition_penalty=rep, presence_penalty=pres,
                             frequency_penalty=freq))
    plain = _state([1, 2, 3], [4, 4])  # no penalties: row untouched
    for step in range(3):
        if step:
            for s in states:
                s.output_token_ids += [step, step + 7]  # the cached counts must pick these up
        if step == 2:
            del states[1].output_token_ids[-5:]  # a rollback: counts are rebuilt
        got = torch.cat([x, x[:1]])
        apply_penalties(got, states + [plain])
        for i, s in enumerate(states):
            p = s.params
            ref = ref_penalties(x[i].tolist(), s.prompt_token_ids, s.output_token_ids, p.repetition_penalty,
                                p.presence_penalty, p.frequency_penalty)
            assert torch.allclose(got[i], torch.tensor(ref), atol=1e-5), (step, i)
        assert torch.equal(got[-1], x[0])


@pytest.mark.parametrize("kw", [
    dict(top_k=5), dict(top_k=1), dict(top_p=0.5), dict(top_p=0.9, temperature=0.5), dict(min_p=0.1),
    dict(min_p=0.02, temperature=2.0), dict(top_k=10, top_p=0.6), dict(top_k=20, top_p=0.8, min_p=0.05),
    dict(top_k=V), dict(),
])
def test_truncation_masks_are_exact(kw):
    x = _logits(8, seed=3)
    params = [SamplingParams(**kw) for _ in range(8)]
    t = params[0].temperature
    got = x / t
    apply_truncation(got, params)
    for i in range(8):
        keep = ref_keep(x[i].tolist(), t, params[i].top_k, params[i].top_p, params[i].min_p)
        assert torch.isfinite(got[i]).tolist() == keep
        assert torch.equal(got[i][torch.tensor(keep)], (x[i] / t)[torch.tensor(keep)])


def test_truncation_rows_are_independent_and_greedy_rows_untouched():
    x = _logits(4, seed=5)
    params = [SamplingParams(top_k=3), SamplingParams(), SamplingParams(temperature=0, top_k=2),
              SamplingParams(top_p=0.3)]
    got = x.clone()
    apply_truncation(got, params)
    assert int(torch.isfinite(got[0]).sum()) == 3
    assert torch.equal(got[1], x[1]) and torch.equal(got[2], x[2])
    assert torch.isfinite(got[3]).tolist() == ref_keep(x[3].tolist(), 1.0, -1, 0.3, 0.0)


def test_processed_probs():
    x = _logits(3, seed=7)
    states = [_state(temperature=0.8, top_k=6, top_p=0.9), _state(temperature=0),
              _state([1, 2], [3, 3], repetition_penalty=1.5, frequency_penalty=0.3, temperature=1.2)]
    probs = processed_probs(x, states)
    assert torch.allclose(probs.sum(1), torch.ones(3))
    keep = torch.tensor(ref_keep(x[0].tolist(), 0.8, 6, 0.9, 0.0))
    ref0 = torch.where(keep, (x[0] / 0.8).softmax(0), 0.0)
    assert torch.allclose(probs[0], ref0 / ref0.sum(), atol=1e-6)
    assert probs[1].tolist() == torch.nn.functional.one_hot(x[1].argmax(), V).float().tolist()
    pen = torch.tensor(ref_penalties(x[2].tolist(), [1, 2], [3, 3], 1.5, 0.0, 0.3))
    assert torch.allclose(probs[2], (pen / 1.2).softmax(0), atol=1e-6)


# ---- the draws ------------------------------------------------------------------------------------------

def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token outside the support was drawn"
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (z = 3.09), Wilson-Hilferty approximation (within 1% here)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.5, top_k=5), dict(top_p=0.8),
                                dict(min_p=0.1, temperature=1.3)])
def test_temperature_sampling_matches_processed_distribution(kw):
    torch.manual_seed(1234)
    row = torch.linspace(-2.0, 2.0, 12)[torch.randperm(12)]
    n = 20000
    states = [_state(**kw) for _ in range(n)]
    toks = torch.tensor([t.token_id for t in Sampler().sample(row.expand(n, 12), states)])
    probs = processed_probs(row[None], states[:1])[0]
    df = int((probs > 0).sum()) - 1
    assert _chi_square(torch.bincount(toks, minlength=12).float(), probs) < _chi2_critical(df)
    if "temperature" in kw and len(kw) == 1:  # plain temperature: the support is everything
        assert torch.allclose(probs, (row / kw["temperature"]).softmax(0))


def test_seeded_draws_follow_the_distribution():
    # seeds 0..n-1 at one step: the per-(seed, step) streams must be as good as the global generator
    row = torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0, 1.5, 0.2, 3.0])
    n = 8000
    states = [_state(seed=s) for s in range(n)]
    toks = torch.tensor([t.token_id for t in Sampler().sample(row.expand(n, 8), states)])
    assert _chi_square(torch.bincount(toks, minlength=8).float(), row.softmax(0)) < _chi2_critical(7)


def _generate(state: SamplingState, others_fn, steps: int) -> list[int]:
    """Run `steps` steps with `state` placed among varying other rows; its logits depend only on the step."""
    sampler = Sampler()
    for step in range(steps):
        others = others_fn(step)
        pos = step % (len(others) + 1)
        x = _logits(len(others) + 1, vocab=1000, seed=step, scale=4.0)
        x[pos] = _logits(1, vocab=1000, seed=100 + step, scale=1.0)[0]
        state.output_token_ids.append(sampler.sample(x, others[:pos] + [state] + others[pos:])[pos].token_id)
    return state.output_token_ids


def test_same_seed_same_tokens_whatever_the_batch():
    kw = dict(seed=42, temperature=1.0, top_p=0.95, repetition_penalty=1.1)
    alone = _generate(_state([5, 6], **kw), lambda step: [], 12)
    torch.manual_seed(999)  # the global generator must not matter for a seeded row
    mixed = _generate(
        _state([5, 6], **kw),
        lambda step: [_state(seed=step), _state(), _state(temperature=0), _state(seed=42, top_k=3)][: step % 5],
        12)
    assert alone == mixed
    assert len(set(alone)) > 6  # the step enters the seed: not the same token every step
    other_seed = _generate(_state([5, 6], **{**kw, "seed": 43}), lambda step: [], 12)
    assert other_seed != alone


def test_step_seed_mixes():
    seeds = {step_seed(s, t) for s in range(50) for t in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**64 for s in seeds)
    assert step_seed(-1, 0) == step_seed(2**64 - 1, 0)


def test_filters_hold_in_draws():
    torch.manual_seed(0)
    x = _logits(64, seed=9)
    out = Sampler().sample(x, [_state(top_k=1)] * 32 + [_state(min_p=1.0, temperature=5.0)] * 32)
    assert [t.token_id for t in out] == x.argmax(1).tolist()


def test_logprobs():
    x = _logits(4, seed=11)
    states = [_state(temperature=0.5, logprobs=5, top_k=3), _state(temperature=0, logprobs=0),
              _state(logprobs=None), _state([2], [2, 7], temperature=2.0, logprobs=20, repetition_penalty=1.4)]
    torch.manual_seed(3)
    out = Sampler().sample(x, states)
    # logprobs are of the penalized, temperature-scaled distribution, before top-k/top-p/min-p
    ref = [(x[0] / 0.5).log_softmax(0), x[1].log_softmax(0), x[2].log_softmax(0),
           (torch.tensor(ref_penalties(x[3].tolist(), [2], [2, 7], 1.4, 0, 0)) / 2.0).log_softmax(0)]
    for t, r in zip(out, ref, strict=True):
        assert math.isclose(t.logprob, float(r[t.token_id]), abs_tol=1e-5)
    assert out[0].token_id in x[0].topk(3).indices.tolist()
    assert [i for i, _ in out[0].top_logprobs] == ref[0].topk(5).indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in out[0].top_logprobs]), ref[0].topk(5).values, atol=1e-5)
    assert out[1].top_logprobs == [] and out[2].top_logprobs is None
    assert [i for i, _ in out[3].top_logprobs] == ref[3].topk(20).indices.tolist()


def test_bf16_logits_and_empty_prompt():
    x = _logits(2).bfloat16()
    out = Sampler().sample(x, [_state(temperature=0, repetition_penalty=1.2), _state(seed=1)])
    assert out[0].token_id == int(x[0].float().argmax())
    assert 0 <= out[1].token_id < V


@pytest.mark.gpu
def test_seeded_on_gpu_matches_across_batches():
    kw = dict(seed=7, top_k=50)
    x = _logits(3, vocab=200064, seed=2).cuda()
    s = Sampler()
    a = s.sample(x[1:2], [_state(**kw)])[0].token_id
    b = s.sample(x, [_state(), _state(**kw), _state(temperature=0)])[1].token_id
    assert a == b
