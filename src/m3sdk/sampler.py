"""Sampler: logits [N, V] and one SamplingState per row -> one SampledToken per row.

Each row goes through, in order (vLLM's order and semantics):
  0. the grammar's bitmask, for rows with a structured output: tokens it forbids become -inf; then logit_bias
     added, and before min_tokens are generated eos and the stop token ids set to -inf;
  1. penalties: repetition over prompt + output (divide positive logits, multiply negative ones), presence and
     frequency over the output only (subtract once per seen token / once per occurrence);
  2. temperature (greedy rows, temperature 0, take the argmax here, after penalties);
  3. logprobs are read at this point: log_softmax of the penalized, temperature-scaled logits (greedy rows at
     temperature 1), before truncation, so the sampled token always has a finite logprob;
  4. truncation: min-p, top-k, top-p (top-p over the top-k survivors, renormalized; min-p commutes with both);
  5. the draw: an exponential race, argmax(p / E) with E ~ Exp(1) i.i.d. per token, which picks token i with
     probability p_i. Seeded rows draw E from a generator seeded by (seed, tokens generated so far), so the token
     is a function of the seed, the step and the row's logits alone, whatever else is in the batch.

Every stage works on the batch at once, restricted to the rows that ask for it; Python only loops over rows for
the per-request pieces (penalty bookkeeping, seeded draws), never over the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from m3sdk.params import SamplingParams
from m3sdk.staging import HostCopy, to_device
from m3sdk.structured import Grammar, apply_bitmask, new_bitmask

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request at one step: a 64-bit mix, so nearby (seed, step) pairs do not
    share streams (a plain seed + step would make seed 1 at step 0 replay seed 0 at step 1)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


@dataclass
class _PenaltyCounts:
    seen: torch.Tensor  # bool[V]: in the prompt or the output (repetition penalty)
    counts: torch.Tensor  # float32[V]: occurrences in the output (presence / frequency penalties)
    num_counted: int  # output tokens folded in so far


@dataclass(eq=False)
class SamplingState:
    """Per-request sampler state. The engine appends each accepted token through `append` (append-only; if
    `output_token_ids` ever shrinks, the penalty counts are rebuilt from scratch)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int] = field(default_factory=list)
    # the ids masked until min_tokens are generated: eos (unless ignored) and the stop token ids (the core sets it)
    min_tokens_ids: tuple[int, ...] = ()
    # the structured output's matcher, at the state after output_token_ids
    grammar: Grammar | None = None
    _penalty: _PenaltyCounts | None = field(default=None, init=False, repr=False)

    @classmethod
    def of(cls, params: SamplingParams, prompt_token_ids: Sequence[int], eos_token_ids: Iterable[int],
           grammar: Grammar | None = None) -> SamplingState:
        """A new request's state; `grammar`: its structured output's matcher (None where only its checks need the
        state)."""
        # eos is never masked for a structured output: its grammar decides where it may end
        stops = () if params.ignore_eos or params.structured_output is not None else sorted(eos_token_ids)
        return cls(params, prompt_token_ids, grammar=grammar,
                   min_tokens_ids=tuple(dict.fromkeys([*stops, *params.stop_token_ids])))

    def append(self, token_id: int) -> None:
        """An accepted token: into the history, and through the grammar."""
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    @property
    def masks_stops(self) -> bool:
        """Its next token must not be one that ends it (fewer than min_tokens generated)."""
        return bool(self.min_tokens_ids) and len(self.output_token_ids) < self.params.min_tokens

    @property
    def adjusts_logits(self) -> bool:
        """Stage 0 changes its logits (a logit_bias, or stops masked)."""
        return self.params.logit_bias is not None or self.masks_stops

    def generator_seed(self) -> int | None:
        """Seed of this step's draw (None: unseeded, use the global generator)."""
        if self.params.seed is None:
            return None
        return step_seed(self.params.seed, len(self.output_token_ids))

    def penalty_counts(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen bool[V], output counts float32[V]) on `device`, updated with only the new output tokens, so a
        long prompt is copied to the device once, not every step."""
        pc = self._penalty
        out = self.output_token_ids
        if pc is None or pc.seen.device != device or pc.seen.numel() != vocab_size or len(out) < pc.num_counted:
            seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if len(self.prompt_token_ids):
                seen[torch.as_tensor(list(self.prompt_token_ids), dtype=torch.long, device=device)] = True
            pc = self._penalty = _PenaltyCounts(seen, torch.zeros(vocab_size, device=device), 0)
        if len(out) > pc.num_counted:
            new = torch.as_tensor(out[pc.num_counted:], dtype=torch.long, device=device)
            pc.counts.index_add_(0, new, torch.ones(new.numel(), device=device))
            pc.seen[new] = True
            pc.num_counted = len(out)
        return pc.seen, pc.counts


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float  # of the distribution described in step 3 of the module docstring
    top_logprobs: list[tuple[int, float]] | None  # the top-n (token, logprob), best first; None if not asked


_Rows = slice | torch.Tensor


def _rows(selected: list[int], n: int, device: torch.device) -> _Rows | None:
    """An index for the selected rows: None if none, a view-giving slice if all, else an index tensor."""
    if not selected:
        return None
    if len(selected) == n:
        return slice(None)
    return to_device(selected, torch.long, device)


def _update(x: torch.Tensor, rows: _Rows, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    x[rows] = fn(x[rows])


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device).unsqueeze(1)


def apply_logit_bias(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Each row's logit_bias added and, before its min_tokens, its stop ids set to -inf, in place: one scatter for
    the batch."""
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, s in enumerate(states):
        if s.params.logit_bias is not None:
            rows += [i] * len(s.params.logit_bias)
            ids += s.params.logit_bias.keys()
            values += s.params.logit_bias.values()
        if s.masks_stops:
            rows += [i] * len(s.min_tokens_ids)
            ids += s.min_tokens_ids
            values += [-math.inf] * len(s.min_tokens_ids)
    if rows:
        index = to_device(rows + ids, torch.long, x.device)
        x.index_put_((index[:len(rows)], index[len(rows):]), to_device(values, torch.float32, x.device),
                     accumulate=True)


def apply_penalties(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Repetition / presence / frequency penalties, in place on the rows that have any."""
    sel = [i for i, s in enumerate(states) if s.params.has_penalties]
    rows = _rows(sel, len(states), x.device)
    if rows is None:
        return
    vocab = x.shape[1]
    seen, counts = zip(*(states[i].penalty_counts(vocab, x.device) for i in sel), strict=True)
    seen, counts = torch.stack(seen), torch.stack(counts)
    ps = [states[i].params for i in sel]
    rep = _column([p.repetition_penalty for p in ps], x.device)
    freq = _column([p.frequency_penalty for p in ps], x.device)
    pres = _column([p.presence_penalty for p in ps], x.device)

    def penalize(v: torch.Tensor) -> torch.Tensor:
        v = torch.where(seen, torch.where(v > 0, v / rep, v * rep), v)
        return v - freq * counts - pres * (counts > 0)

    _update(x, rows, penalize)


def apply_grammars(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Each constrained row's bitmask, in place: the tokens its grammar forbids next become -inf."""
    rows = [i for i, s in enumerate(states) if s.grammar is not None]
    if rows:
        bitmask = new_bitmask(len(states), x.shape[1], x.device)
        for i in rows:
            states[i].grammar.fill(bitmask, i)
        apply_bitmask(x, bitmask, rows)


def apply_temperature(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Divide each row by its temperature, in place (greedy rows by 1: their logprobs are at temperature 1)."""
    temps = [s.params.temperature if s.params.temperature > 0 else 1.0 for s in states]
    if any(t != 1.0 for t in temps):
        x.div_(_column(temps, x.device))


def apply_truncation(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """min-p, top-k, top-p, in place on the sampled (non-greedy) rows: removed tokens become -inf. The argmax
    always survives."""
    n, vocab = x.shape
    dev = x.device
    sel = [i for i, p in enumerate(params) if p.min_p > 0 and not p.greedy]
    if (rows := _rows(sel, n, dev)) is not None:
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p): no softmax needed
        log_min_p = _column([math.log(params[i].min_p) for i in sel], dev)
        _update(x, rows, lambda v: v.masked_fill(v < v.amax(1, keepdim=True) + log_min_p, -math.inf))
    sel = [i for i, p in enumerate(params) if 0 < p.top_k < vocab and not p.greedy]
    if (rows := _rows(sel, n, dev)) is not None:
        ks = [params[i].top_k for i in sel]
        k = to_device(ks, torch.long, dev).unsqueeze(1)

        def top_k(v: torch.Tensor) -> torch.Tensor:
            kth = v.topk(max(ks), dim=1).values.gather(1, k - 1)
            return v.masked_fill(v < kth, -math.inf)  # ties with the k-th value stay in

        _update(x, rows, top_k)
    sel = [i for i, p in enumerate(params) if p.top_p < 1 and not p.greedy]
    if (rows := _rows(sel, n, dev)) is not None:
        top_p = _column([params[i].top_p for i in sel], dev)
        # when every row here has a top-k, only the first max(k) tokens can be finite: sort just those
        row_k = [params[i].top_k for i in sel]
        width = max(row_k) if all(0 < rk < vocab for rk in row_k) else vocab

        def nucleus(v: torch.Tensor) -> torch.Tensor:
            # keep the smallest prefix (by descending probability) whose mass reaches top_p: a token stays when
            # the mass strictly before it is still below top_p (so the most likely token always stays)
            sorted_v, order = v.topk(width, dim=1) if width < vocab else v.sort(dim=1, descending=True)
            probs = sorted_v.softmax(dim=1)
            drop = probs.cumsum(dim=1) - probs >= top_p
            return torch.full_like(v, -math.inf).scatter(1, order, sorted_v.masked_fill(drop, -math.inf))

        _update(x, rows, nucleus)


def processed_probs(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """The distribution each row is sampled from, float32[N, V]: after penalties, temperature, min-p, top-k and
    top-p. Greedy rows are one-hot at their argmax. (For exact rejection sampling in speculative decoding.)"""
    x = logits.to(torch.float32, copy=True)
    apply_logit_bias(x, states)
    apply_penalties(x, states)
    apply_temperature(x, states)
    apply_truncation(x, [s.params for s in states])
    probs = x.softmax(dim=1)
    greedy = _rows([i for i, s in enumerate(states) if s.params.greedy], len(states), x.device)
    if greedy is not None:
        _update(probs, greedy, lambda p: torch.zeros_like(p).scatter_(1, p.argmax(1, keepdim=True), 1.0))
    return probs


class Sampler:
    """Stateless apart from a reusable generator per device for the seeded draws."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        return gen.manual_seed(seed)

    def _draw(self, probs: torch.Tensor, seeds: list[int | None]) -> torch.Tensor:
        """Exponential race over each row of probs -> token ids int64[R]."""
        q = torch.empty_like(probs)
        if any(s is None for s in seeds):
            q.exponential_()  # the global generator (torch.manual_seed governs it)
        for j, seed in enumerate(seeds):
            if seed is not None:
                q[j].exponential_(generator=self._generator(probs.device, seed))
        # Exp(1) can round to 0: keep the ratio finite (a removed token has p = 0 and must stay at 0)
        return probs.div_(q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=1)

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> list[SampledToken]:
        return self.launch(logits, states).resolve()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> PendingSample:
        """Queue the sampling of every row on the logits' device without waiting for it: the tokens stay on the
        device (the overlapped engine step feeds them to the next forward) and `resolve()` reads them back."""
        n = logits.shape[0]
        assert n == len(states), f"{n} logits rows for {len(states)} states"
        dev = logits.device
        # a copy only for the steps that change it in place (penalties, temperature, truncation of sampled rows):
        # an all-greedy batch-64 step would copy 51 MB of M3 logits for nothing
        plain = all(s.params.greedy and not s.params.has_penalties and not s.adjusts_logits and s.grammar is None
                    for s in states)
        x = logits.to(torch.float32, copy=not plain)
        apply_grammars(x, states)
        apply_logit_bias(x, states)
        apply_penalties(x, states)
        apply_temperature(x, states)
        logz = x.logsumexp(dim=1)

        # top-n logprobs before truncation (the sampled token's own logprob is read after: truncation never
        # changes the logit of a token that survives it, and the sampled token did)
        want = [i for i, s in enumerate(states) if s.params.logprobs]
        top_vals = top_ids = None
        if (rows := _rows(want, n, dev)) is not None:
            nmax = min(max(states[i].params.logprobs for i in want), x.shape[1])
            top_vals, top_ids = x[rows].topk(nmax, dim=1)
            top_vals = top_vals - logz[rows].unsqueeze(1)

        tokens = x.argmax(dim=1) if plain else torch.empty(n, dtype=torch.long, device=dev)
        greedy = [] if plain else [i for i, s in enumerate(states) if s.params.greedy]
        if (rows := _rows(greedy, n, dev)) is not None:
            tokens[rows] = x[rows].argmax(dim=1)
        rand = [i for i, s in enumerate(states) if not s.params.greedy]
        if (rows := _rows(rand, n, dev)) is not None:
            xr = x[rows]
            apply_truncation(xr, [states[i].params for i in rand])
            tokens[rows] = self._draw(xr.softmax(dim=1), [states[i].generator_seed() for i in rand])

        logprobs = x.gather(1, tokens.unsqueeze(1)).squeeze(1) - logz
        logprob_counts = [s.params.logprobs for s in states]
        return PendingSample(tokens, HostCopy(tokens, logprobs, top_vals, top_ids), want, logprob_counts)


@dataclass
class PendingSample:
    """A launched sampling: `tokens` int64[N] on the device now, the SampledTokens once `resolve()` is called."""

    tokens: torch.Tensor
    _host: HostCopy
    _want: list[int]
    _logprob_counts: list[int | None]

    def resolve(self) -> list[SampledToken]:
        tokens, logprobs, top_vals, top_ids = self._host.get()
        top: dict[int, list[tuple[int, float]]] = {}
        if top_vals is not None:
            vals, ids = top_vals.tolist(), top_ids.tolist()
            for j, i in enumerate(self._want):
                k = self._logprob_counts[i]
                top[i] = list(zip(ids[j][:k], vals[j][:k], strict=True))
        return [
            SampledToken(tok, lp, top.get(i, [] if self._logprob_counts[i] == 0 else None))
            for i, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True))
        ]


@torch.inference_mode()
def launch_prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], top_n: Sequence[int]) -> PendingLogprobs:
    """Row i's logprob of token `targets[i]` and its top `top_n[i]` alternatives, under the plain log-softmax of the
    logits (a prompt token given its prefix: no sampling parameter applies), queued on the device."""
    x = logits.to(torch.float32)
    logz = x.logsumexp(dim=1)
    target = to_device(list(targets), torch.long, x.device)
    chosen = x.gather(1, target.unsqueeze(1)).squeeze(1) - logz
    width = min(max(top_n), x.shape[1])
    top_vals = top_ids = None
    if width:
        top_vals, top_ids = x.topk(width, dim=1)
        top_vals = top_vals - logz.unsqueeze(1)
    return PendingLogprobs(HostCopy(chosen, top_vals, top_ids), list(targets), list(top_n))


@dataclass
class PendingLogprobs:
    """Logprobs of given tokens queued on the device; `resolve()` reads them as SampledTokens."""

    _host: HostCopy
    _targets: list[int]
    _top_n: list[int]

    def resolve(self) -> list[SampledToken]:
        chosen, top_vals, top_ids = self._host.get()
        vals = top_vals.tolist() if top_vals is not None else None
        ids = top_ids.tolist() if top_ids is not None else None
        return [SampledToken(t, lp, list(zip(ids[i][:k], vals[i][:k], strict=True)) if k else [])
                for i, (t, lp, k) in enumerate(zip(self._targets, chosen.tolist(), self._top_n, strict=True))]
