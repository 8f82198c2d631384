"""Prompt logprobs: each prompt token's logprob given its prefix (and the top-n alternatives), from the logits of
the prefill chunks that compute it. A request that asks for them gets logits at every position of its prefill
chunks (position p's give token p + 1's logprob) and reads none of its prompt from the prefix cache
(`Request.needs_prompt_logprobs`) until they are delivered with its first chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from m3sdk.request import Request
from m3sdk.sampler import PendingLogprobs, launch_prompt_logprobs
from m3sdk.scheduler.base import StepPlan


@dataclass
class PromptJobs:
    """Per entry that computes prompt logprobs: (request, its first position, the row of that position's logits,
    how many positions)."""

    jobs: list[tuple[Request, int, int, int]]

    def launch(self, logits: torch.Tensor) -> PendingPromptLogprobs | None:
        rows, targets, top_n = [], [], []
        for request, start, row, k in self.jobs:
            rows += range(row, row + k)
            targets += request.prompt_token_ids[start + 1:start + 1 + k]
            top_n += [request.params.prompt_logprobs] * k
        if not rows:
            return None
        return PendingPromptLogprobs(self.jobs, launch_prompt_logprobs(logits[rows], targets, top_n))


@dataclass
class PendingPromptLogprobs:
    jobs: list[tuple[Request, int, int, int]]
    pending: PendingLogprobs

    def resolve(self) -> None:
        """Into each request's `prompt_logprobs`, by position (a recomputed chunk writes the same values again)."""
        values = iter(self.pending.resolve())
        for request, start, _, k in self.jobs:
            chunk = [next(values) for _ in range(k)]
            if request.prompt_logprobs is not None:  # (not delivered yet)
                request.prompt_logprobs[start + 1:start + 1 + k] = chunk


def widen_for_prompt_logprobs(plan: StepPlan, num_logits: Sequence[int]) -> tuple[list[int], PromptJobs]:
    """`num_logits` (per entry: logits at its last m positions) with every entry that computes prompt logprobs
    widened to all its positions (its last row stays its sampling row), and where those logits are."""
    out, jobs, row = [], [], 0
    for (request, n, _), m in zip(plan.scheduled, num_logits, strict=True):
        start = request.num_computed_tokens
        # the prompt's last position has no prompt token after it
        k = min(start + n, request.num_prompt_tokens - 1) - start if request.needs_prompt_logprobs else 0
        if k > 0:
            m = n
            jobs.append((request, start, row, k))
        out.append(m)
        row += m
    return out, PromptJobs(jobs)
