"""Speculation: what the engine core does differently when a drafter is configured, in one place.

One engine step with speculation:
  1. `propose`: each running request whose prompt is fully computed gets up to k drafts, appended to its
     `token_ids` as if they were known tokens, so the scheduler schedules 1 + k tokens for it (or fewer when
     the token budget cuts it: then only the scheduled drafts are verified). Drafts never exceed what the
     request may still generate (max_tokens, the context limit).
  2. `scheduled`: requests that were preempted or not scheduled get their drafts removed (a preempted request
     recomputes from its real tokens) and the drafter forgets the preempted ones.
  3. `launch`: one target forward queued on the device, with logits at every scheduled position of a speculating
     request (each draft is a query with its own position, so on MSA layers each gets its own causal block
     selection), and the aux hidden states the drafter reads; drafts still on the device are read there.
     `finish` (the core calls it at its next step, after emitting the step before's deltas): plain rows are
     sampled by the Sampler, speculating rows verified by the verifier (exact). Each speculating entry is then
     rewritten to the 1 + a positions that hold real tokens (the last token and the a accepted drafts), and the
     rejected drafts leave `token_ids`: the scheduler's `update` advances `num_computed_tokens` by 1 + a and
     offers only real tokens' pages to the prefix cache. The drafter observes the committed positions' target
     states.
  4. `finish_step` (after the scheduler's update): the accepted drafts leave `token_ids` too (the core appends
     every emitted token through its usual path: detokenizer, stop checks), and pages that hold only rejected
     slots go back to the pool (`CacheManager.truncate`). A rejected slot inside a kept page is simply
     overwritten later: attention never reads past a sequence's context length.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from m3sdk.prompt_logprobs import PendingPromptLogprobs, widen_for_prompt_logprobs
from m3sdk.request import Request, RequestStatus
from m3sdk.runner import Carry
from m3sdk.sampler import SampledToken, Sampler
from m3sdk.scheduler.base import Scheduled, StepPlan
from m3sdk.speculative.base import DraftRequest, Proposal, SpeculativeDecoder, TargetStates
from m3sdk.speculative.depth import DraftDepth
from m3sdk.speculative.verify import VerifyRow, verify, verify_greedy
from m3sdk.structured import apply_bitmask, fill_draft_masks, new_bitmask

if TYPE_CHECKING:
    from m3sdk.cache.manager import CacheManager
    from m3sdk.runner import ModelRunner
    from m3sdk.speculative.chain import Unverified


@dataclass
class Launched:
    """A step whose forward is queued on the device: what `Speculation.finish` needs to read it."""

    plan: StepPlan
    num_logits: list[int]
    spec: list[bool]  # per entry: verifies drafts
    logits: torch.Tensor | None
    hidden: torch.Tensor
    aux: torch.Tensor | None
    carry: Carry | None  # the drafts it read on the device (Proposal.pending)
    # the drafter's read of a greedy verify step launched behind it, with the step's argmax and the drafts it
    # verified on their way to the host (`ChainDrafter.read_unverified`; None: read and observed as usual)
    read: Unverified | None = None
    prompt: PendingPromptLogprobs | None = None  # the prompt logprobs it computes


class Speculation:
    def __init__(self, drafter: SpeculativeDecoder, cache: CacheManager, sampler: Sampler,
                 depth: DraftDepth | None = None):
        self.drafter = drafter
        self.cache = cache
        self.sampler = sampler
        self.k = drafter.num_speculative_tokens  # the most drafts a step verifies per request
        # the drafts per request of each step (depth.py); a fixed k_max without one
        self.depth = depth if depth is not None else DraftDepth(self.k, [1], adaptive=False)
        # the depth of the next step, chosen when its drafts are launched (at this step's launch or finish):
        # 0 runs no drafter for it
        self.next_depth = self.k
        # launch the drafter's read of a greedy verify step behind its forward, the verdict counted on the device
        # (`_read_unverified`), rather than after the host has read the step
        self.read_behind_verify = drafter.reads_unverified
        # request id -> (request, its proposal, its real length): the drafts sit at token_ids[real:]
        self._drafts: dict[str, tuple[Request, Proposal, int]] = {}
        # metrics
        self.drafted = [0] * self.k  # drafts verified at each position
        self.accepted = [0] * self.k
        self.verify_rows = 0  # request-steps that verified at least one draft
        self.verify_tokens = 0  # tokens those emitted
        self.decode_rows = 0  # every request-step that emitted tokens (one target forward for that request)
        self.decode_tokens = 0

    # -- 1, 2: drafts in, drafts of the unscheduled out --

    def propose(self, requests: Iterable[Request]) -> None:
        k = self.next_depth
        if k == 0:  # a plain decode step
            return
        asks = []
        for r in requests:
            room = r.max_total_tokens - r.num_tokens - 1  # the step emits up to drafts + 1 tokens
            if r.status is RequestStatus.RUNNING and r.num_computed_tokens == r.num_tokens - 1 and room > 0:
                asks.append((r, DraftRequest(r.request_id, r.token_ids, min(k, room))))
        if not asks:
            return
        for (r, _), proposal in zip(asks, self.drafter.propose([a for _, a in asks]), strict=True):
            if proposal.tokens:
                self._drafts[r.request_id] = (r, proposal, r.num_tokens)
                r.token_ids.extend(proposal.tokens)

    def scheduled(self, plan: StepPlan) -> None:
        on = {s.request.request_id for s in plan.scheduled}
        for rid in [rid for rid in self._drafts if rid not in on]:
            r, _, real = self._drafts.pop(rid)
            del r.token_ids[real:]
        for r in plan.preempted:
            self.drafter.release(r.request_id)

    # -- 3: one forward (launched), then sample / verify, observe --

    def launch(self, plan: StepPlan, runner: ModelRunner, layer_hook: Callable[[int], None] | None = None
               ) -> Launched:
        """Queue the step's forward on the device (logits at every scheduled position of a speculating entry; drafts
        still on the device are read there); `finish` reads its results."""
        num_logits, spec, pending = [], [], []
        decoding, depth, clean = 0, 0, True
        for request, n, samples in plan.scheduled:
            is_spec = request.request_id in self._drafts
            spec.append(is_spec)
            num_logits.append(n if is_spec else int(samples))
            if is_spec and self._drafts[request.request_id][1].pending is not None:
                pending.append(request)
            decoding += samples
            depth = max(depth, n - 1) if is_spec else depth
            clean = clean and samples and (is_spec or n == 1)
        self._launched(decoding, depth, clean)
        carry = self._carry(pending)
        prompt = None
        if any(sc.request.needs_prompt_logprobs for sc in plan.scheduled):  # (prefill entries: never speculating)
            num_logits, prompt = widen_for_prompt_logprobs(plan, num_logits)
        logits, hidden, aux = runner.forward(plan, num_logits, self.drafter.aux_layers, carry=carry,
                                             layer_hook=layer_hook)
        step = Launched(plan, num_logits, spec, logits, hidden, aux, carry,
                        prompt=prompt.launch(logits) if prompt is not None else None)
        if (self.read_behind_verify and self.next_depth > 0 and carry is not None
                and len(pending) == len(plan.scheduled) and _greedy(pending)):
            self._read_unverified(step)
        return step

    def launched_plain(self, plan: StepPlan) -> None:
        """A depth-0 step launched by the engine's plain executor: what `launch` learns and decides of a step."""
        self._launched(sum(s.samples for s in plan.scheduled), 0,
                       all(s.samples and s.num_new_tokens == 1 for s in plan.scheduled))

    def _launched(self, decoding: int, depth: int, clean: bool) -> None:
        """The next step's depth, for the rows decoding after this one (joins and finishes show at its propose),
        and this step's launch on the chooser's clock."""
        self.next_depth = self.depth.choose(decoding)
        self.depth.launched(time.perf_counter(), decoding, depth, self.next_depth, clean)

    def _read_unverified(self, step: Launched) -> None:
        """A step of greedy verify rows only, each verifying drafts still on the device: the drafter's read of it
        is launched behind it, so the device drafts the next step while the host reads this one."""
        items, row = [], 0
        for request, n, _ in step.plan.scheduled:
            items.append((request.request_id, request.num_computed_tokens, n, row, step.carry.rows[id(request)]))
            row += n
        step.read = self.drafter.read_unverified(items, step.logits, step.aux, step.carry.tokens)

    def finish(self, step: Launched) -> list[tuple[Request, list[SampledToken]]]:
        """A launched step's emitted tokens, per request that emits, in plan order. Requests finished since it was
        launched (aborted while it ran) are skipped: their pages and drafts are gone already."""
        plan, num_logits, spec, logits = step.plan, step.num_logits, step.spec, step.logits
        if step.prompt is not None:  # before the tokens: the first token's chunk carries them
            step.prompt.resolve()
        plain_rows, plain_reqs, verify_reqs, verify_at = [], [], [], []
        row = 0
        for (request, n, samples), m, is_spec in zip(plan.scheduled, num_logits, spec, strict=True):
            if is_spec and not request.is_finished:  # (one aborted while the forward ran: its rows are not read)
                verify_reqs.append((request, n))
                verify_at.extend(range(row, row + m))
            elif samples and not request.is_finished:
                plain_reqs.append(request)
                plain_rows.append(row + m - 1)  # (an entry computing prompt logprobs has all its positions')
            row += m
        emitted: dict[str, list[SampledToken]] = {}
        if plain_rows:
            # (a step of plain rows only, a depth-0 step's, samples every logits row: no gather)
            rows = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
            sampled = self.sampler.sample(rows, [r.sampling for r in plain_reqs])
            emitted.update((r.request_id, [t]) for r, t in zip(plain_reqs, sampled, strict=True))
        if verify_reqs:
            # (a step of verify rows only reads every logits row: no gather)
            rows = logits if len(verify_at) == logits.shape[0] else logits[verify_at]
            # greedy rows without penalties or logprobs need each position's argmax alone: one host read brings
            # it with the drafts that stayed on the device
            greedy = _greedy(r for r, _ in verify_reqs)
            argmax, drafts = [], []
            if step.read is not None:  # (read without waiting for the drafter's read launched behind it)
                read = step.read.verdict.get()[0].tolist()
                argmax, drafts = [read[i] for i in verify_at], read[logits.shape[0]:]
            elif greedy:
                argmax_t = rows.argmax(dim=1)
                both = torch.cat([argmax_t, step.carry.tokens]) if step.carry is not None else argmax_t
                read = both.tolist()
                argmax, drafts = read[:len(verify_at)], read[len(verify_at):]
            elif step.carry is not None:
                drafts = step.carry.tokens.tolist()
            verify_rows = []
            for request, n in verify_reqs:
                _, proposal, real = self._drafts[request.request_id]
                if proposal.pending is not None:  # its placeholders get the drafts the forward read
                    first = step.carry.rows[id(request)]
                    proposal.tokens[:] = drafts[first:first + len(proposal.tokens)]
                    proposal.pending = None
                    request.token_ids[real:real + len(proposal.tokens)] = proposal.tokens
                # the scheduled drafts (the token budget may cut some) and, if sampled, their distributions
                q = None if proposal.probs is None else proposal.probs[: n - 1]
                verify_rows.append(VerifyRow(request.sampling, proposal.tokens[: n - 1], q))
            if any(r.sampling.grammar is not None for r, _ in verify_reqs):
                rows = _grammar_masked(rows, verify_reqs, verify_rows)
            results = verify_greedy(argmax, verify_rows) if greedy else verify(rows, verify_rows)
            counts = []
            for (r, _), vr, toks in zip(verify_reqs, verify_rows, results, strict=True):
                emitted[r.request_id] = toks
                self._count(len(vr.drafts), len(toks) - 1)
                counts.append((len(vr.drafts), len(toks) - 1))
            self.depth.verified(counts)

        # rewrite speculating entries to their real tokens; observe what is now committed (or, for a step the
        # drafter read already, tell it how much; when the next step drafts nothing, neither)
        observe = step.read is None and self.next_depth > 0
        observed, settled, offset = [], {}, 0
        for i, (request, n, _) in enumerate(plan.scheduled):
            if request.is_finished:
                offset += n
                continue
            toks = emitted.get(request.request_id)
            committed = n
            if spec[i]:
                _, _, real = self._drafts[request.request_id]
                committed = len(toks)  # the last token + the accepted drafts
                del request.token_ids[real + committed - 1:]  # the rejected drafts
                plan.scheduled[i] = Scheduled(request, committed, True)
            if toks:
                self.decode_rows += 1
                self.decode_tokens += len(toks)
            if not observe:
                settled[request.request_id] = committed
                offset += n
                continue
            start = request.num_computed_tokens
            # the token after each committed position: in token_ids, and for the last one the emitted token
            # when the step emitted (else it is a prompt token still to compute)
            nxt = request.token_ids[start + 1:start + committed] + [
                toks[-1].token_id if toks else request.token_ids[start + committed]]
            observed.append((request.request_id, TargetStates(start, nxt, step.hidden, step.aux, offset)))
            offset += n
        if step.read is not None:
            self.drafter.settle(step.read, settled)
        elif observe:  # (else the drafter's contexts miss these positions: a context restarts where it resumes)
            self.drafter.observe(observed)
        return [(s.request, emitted[s.request.request_id]) for s in plan.scheduled
                if s.request.request_id in emitted]

    def _carry(self, pending: list[Request]) -> Carry | None:
        """Where the verify forward finds the drafts still on the device (Proposal.pending: the drafter's last
        step's [B, k] tokens, the same for all of them): request -> the flat index of its first draft."""
        if not pending:
            return None
        proposals = [self._drafts[r.request_id][1] for r in pending]
        drafts = proposals[0].pending.drafts
        k = drafts.shape[1]
        return Carry(drafts.reshape(-1), {id(r): p.row * k for r, p in zip(pending, proposals, strict=True)})

    def _count(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.verify_rows += 1
        self.verify_tokens += num_accepted + 1
        for i in range(num_drafts):
            self.drafted[i] += 1
            self.accepted[i] += i < num_accepted

    # -- 4: after the scheduler's update --

    def finish_step(self) -> None:
        for r, _, real in self._drafts.values():
            # the drafts left in token_ids were accepted: the core appends them with the other emitted tokens
            del r.token_ids[real:]
            self.cache.truncate(r, r.num_computed_tokens)
        self._drafts.clear()

    def release(self, request: Request) -> None:
        """A request finished or was aborted."""
        entry = self._drafts.pop(request.request_id, None)
        if entry is not None:
            del request.token_ids[entry[2]:]
        self.drafter.release(request.request_id)

    def stats(self) -> dict[str, float | int | list[float]]:
        drafted, accepted = sum(self.drafted), sum(self.accepted)
        return {
            "spec_method": self.drafter.method,
            "spec_drafted_tokens": drafted,
            "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_acceptance_rate_per_position": [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted,
                                                                                       strict=True)],
            # tokens emitted per verify forward of a request that had drafts (1 + accepted drafts)
            "spec_mean_accepted_length": self.verify_tokens / self.verify_rows if self.verify_rows else 0.0,
            # target forwards a request needs per generated token, over all decode/verify steps (1.0 without)
            "spec_target_forwards_per_token": self.decode_rows / self.decode_tokens if self.decode_tokens else 0.0,
            **self.depth.stats(),
        }


def _greedy(requests: Iterable[Request]) -> bool:
    """Whether each request's verdict is the argmax of the raw logits alone (greedy, no penalties, no logprobs,
    no structured output, no logit_bias or min_tokens mask)."""
    return all(r.params.greedy and not r.params.has_penalties and r.params.logprobs is None
               and r.sampling.grammar is None and not r.sampling.adjusts_logits for r in requests)


def _grammar_masked(logits: torch.Tensor, requests: list[tuple[Request, int]], rows: list[VerifyRow]) -> torch.Tensor:
    """A float32 copy of the verify logits with each constrained request's per-position bitmask applied: at its
    last token and after each draft (the matcher walks the drafts and rolls back), so the verifier never accepts
    a draft the grammar forbids, nor draws a token it forbids."""
    x = logits.to(torch.float32, copy=True)
    bitmask = new_bitmask(x.shape[0], x.shape[1], x.device)
    masked, start = [], 0
    for (request, _), row in zip(requests, rows, strict=True):
        n = len(row.drafts) + 1
        if request.sampling.grammar is not None:
            fill_draft_masks(bitmask, start, request.sampling.grammar, row.drafts)
            masked += range(start, start + n)
        start += n
    apply_bitmask(x, bitmask, masked)
    return x
