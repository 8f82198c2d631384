"""The shared verifier: the target's logits for a request's last token plus its k drafts -> the accepted drafts
and one more token (the correction at the first rejection, or the bonus token after k acceptances).

Exactness:
- temperature 0: draft i is accepted iff it equals the argmax of the biased, penalized logits at its position, the token
  the plain sampler would have emitted there, so the output is token-for-token the non-speculative one.
- temperature > 0 (Leviathan et al. / Chen et al. speculative sampling): with p the target's processed
  distribution (logit_bias and min_tokens masks, penalties, temperature, min-p/top-k/top-p:
  `sampler.processed_probs`) and q the distribution the draft was drawn from, draft x is accepted with probability
  min(1, p(x) / q(x)); at the first rejection the token is drawn from normalize(max(p - q, 0)). Every emitted
  token is then distributed exactly as p. A drafter that picks its tokens deterministically has q = a point mass
  at x: accept with probability p(x), else draw from p with x removed.
Position i's distribution is computed with drafts 1..i-1 appended to the output history (the penalties see
them), which is the true history whenever position i is reached.

Seeded requests draw their uniforms and the final token from a generator seeded by (seed, tokens generated so
far), as the sampler does, so a seeded request is reproducible given its drafts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from m3sdk.sampler import (
    SampledToken,
    SamplingState,
    apply_logit_bias,
    apply_penalties,
    apply_temperature,
    apply_truncation,
)


@dataclass
class VerifyRow:
    """One request in a verify step: its sampler state (history before this step), its drafts and, for sampled
    drafts, their distributions q [len(drafts), V] (None: point masses)."""

    state: SamplingState
    drafts: list[int]
    draft_probs: torch.Tensor | None = None


def _position_states(row: VerifyRow) -> list[SamplingState]:
    """The sampler state at each of the row's 1 + k positions. Without penalties, and past min_tokens, the history
    does not change the distribution, so the one state serves all positions (no per-position copy of the counts)."""
    s = row.state
    if not s.params.has_penalties and not s.masks_stops:
        return [s] * (len(row.drafts) + 1)
    out = list(s.output_token_ids)
    return [s] + [SamplingState(s.params, s.prompt_token_ids, out + row.drafts[:i], min_tokens_ids=s.min_tokens_ids)
                  for i in range(1, len(row.drafts) + 1)]


def _generator(state: SamplingState, device: torch.device) -> torch.Generator | None:
    seed = state.generator_seed()
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def accept_greedy(target: list[int], drafts: list[int]) -> list[int]:
    """Accepted drafts + the target's token at the first mismatch (or the bonus after all)."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return drafts[:n] + [target[n]]


def accept_sampled(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                   generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling over p [k+1, V] (processed target distributions), drafts (k tokens), q [k, V] or
    None (point masses). Returns the accepted drafts + one token drawn from the residual or the bonus row."""
    k = len(drafts)
    dev = p.device
    idx = torch.arange(k, device=dev)
    d = torch.tensor(drafts, dtype=torch.long, device=dev)
    p_d = p[idx, d]
    q_d = q[idx, d] if q is not None else torch.ones(k, device=dev)
    u = torch.rand(k, device=dev, generator=generator)
    # u < p/q  <=>  u * q < p (no division: q(x) > 0 for a drawn x, but be safe)
    accepted = (u * q_d < p_d).tolist()
    n = accepted.index(False) if False in accepted else k
    if n == k:
        final = p[k]
    else:
        residual = p[n].clone()
        if q is None:
            residual[drafts[n]] = 0.0
        else:
            residual = (residual - q[n]).clamp_min_(0.0)
        # the residual is all zero only if p == q there, in which case the draft is never rejected; guard
        # against rounding anyway by falling back to p
        final = residual if float(residual.sum()) > 0 else p[n]
    e = torch.empty_like(final).exponential_(generator=generator).clamp_min_(torch.finfo(final.dtype).tiny)
    token = int((final / e).argmax())  # exponential race: picks i with probability final_i / sum(final)
    return drafts[:n] + [token]


def verify_greedy(argmax: list[int], rows: Sequence[VerifyRow]) -> list[list[SampledToken]]:
    """`verify` for greedy rows without penalties or logprobs, from each position's argmax (read on the host with
    whatever else the step reads; the logits' argmax is the plain sampler's token there). Their logprobs are not
    reported, so not computed: NaN."""
    out, start = [], 0
    for row in rows:
        n = len(row.drafts) + 1
        out.append([SampledToken(t, math.nan, None) for t in accept_greedy(argmax[start:start + n], row.drafts)])
        start += n
    return out


@torch.inference_mode()
def verify(logits: torch.Tensor, rows: Sequence[VerifyRow]) -> list[list[SampledToken]]:
    """logits [sum(len(drafts) + 1), V], rows in the same order -> the emitted tokens of each row (between 1 and
    len(drafts) + 1), with the logprobs the sampler would report for them."""
    states = [st for row in rows for st in _position_states(row)]
    assert logits.shape[0] == len(states), f"{logits.shape[0]} logits rows for {len(states)} verify positions"
    # penalties and temperature work in place: a copy only when one applies (greedy rows without penalties
    # read the logits as they are)
    x = logits.to(torch.float32, copy=any(st.params.has_penalties or not st.params.greedy or st.adjusts_logits
                                          for st in states))
    apply_logit_bias(x, states)
    apply_penalties(x, states)
    apply_temperature(x, states)
    logz = x.logsumexp(dim=1)

    # the processed distributions of every sampled position in one batch (truncation works row-wise)
    sampled = [i for i, st in enumerate(states) if not st.params.greedy]
    probs = torch.empty(0)
    if sampled:
        idx = torch.tensor(sampled, device=x.device)
        probs = x[idx]
        apply_truncation(probs, [states[i].params for i in sampled])
        probs = probs.softmax(dim=1)
    where = {pos: j for j, pos in enumerate(sampled)}
    # each position's argmax and its logprob in one host read (float32 holds any token id below 2^24 exactly);
    # max's index is the first maximal one, as the plain sampler's argmax, so ties break the same way
    assert x.shape[1] <= 1 << 24, "token ids past 2^24 do not round-trip through float32"
    best, argmax_t = x.max(dim=1)
    argmax_f, best_lp = torch.stack([argmax_t.float(), best - logz]).tolist()
    argmax = [int(a) for a in argmax_f]

    emitted: list[list[int]] = []
    start = 0
    for row in rows:
        n = len(row.drafts) + 1
        if row.state.params.greedy:
            emitted.append(accept_greedy(argmax[start:start + n], row.drafts))
        else:
            p = probs[where[start]:where[start] + n]
            emitted.append(accept_sampled(p, row.drafts, row.draft_probs, _generator(row.state, x.device)))
        start += n

    # every emitted token's logprob: a greedy row emits the argmax at each of its positions (accepted drafts
    # equal it), whose logprob is read already; otherwise one gather and one host read for all rows
    pos, tok, starts = [], [], []
    start = 0
    for row, toks in zip(rows, emitted, strict=True):
        starts.append(len(pos))
        pos += range(start, start + len(toks))
        tok += toks
        start += len(row.drafts) + 1
    flat = None
    if sampled or any(row.state.params.logprobs for row in rows):
        flat = torch.tensor([pos, tok], dtype=torch.long).to(x.device)
    lps = (x[flat[0], flat[1]] - logz[flat[0]]).tolist() if sampled else [best_lp[p] for p in pos]
    out: list[list[SampledToken]] = []
    for row, toks, first in zip(rows, emitted, starts, strict=True):
        k = row.state.params.logprobs
        tops: list[list[tuple[int, float]] | None] = [None] * len(toks)
        if k:
            at = flat[0, first:first + len(toks)]
            vals, ids = x[at].topk(min(k, x.shape[1]), dim=1)
            vals = (vals - logz[at].unsqueeze(1)).tolist()
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals, strict=True)]
        elif k == 0:
            tops = [[] for _ in toks]
        out.append([SampledToken(t, lp, tp) for t, lp, tp in
                    zip(toks, lps[first:first + len(toks)], tops, strict=True)])
    return out
