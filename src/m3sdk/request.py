"""A request's state inside the engine, and the results an application sees (Completion, Chunk, Usage, Timings).

One owner: the scheduler moves a Request between its queues and advances `num_computed_tokens`; the cache
manager keeps its pages (by request id); the core appends sampled tokens and decides when it finishes.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from m3sdk.images import PromptImage
    from m3sdk.params import SamplingParams
    from m3sdk.sampler import SampledToken, SamplingState
    from m3sdk.tokenizer import TextStream

# "timeout": SamplingParams.timeout passed before the request ended
FinishReason = Literal["stop", "length", "abort", "timeout"]
# What ended a "stop": the stop string matched or the stop token id sampled (None for eos, a length or an abort).
StopReason = int | str | None

# Tie-breaker for requests that arrive within the clock's resolution: admission order.
_arrival_seq = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds pages and is scheduled every step
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Tokens, progress and timings of one generation.

    `token_ids` is the prompt followed by the generated tokens. `num_computed_tokens` of them have their K/V
    (and index keys) in the cache; the scheduler feeds the rest, so prefill, chunked prefill, decode and the
    recompute after a preemption are one mechanism.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # The most tokens this request may ever hold (prompt + generated): max_model_len, or less by max_tokens.
    max_total_tokens: int
    # Lower runs first; equal priorities are first come, first served.
    priority: int = 0
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Per-request helpers the core attaches: seeded sampling state and the incremental detokenizer.
    sampling: SamplingState | None = None
    text: TextStream | None = None
    logprobs: list[SampledToken] = field(default_factory=list)
    # choice `index` of an n-choice request (the engine's request id is the application's one, suffixed)
    index: int = 0
    # with params.prompt_logprobs: position j's entry is prompt token j's logprob given tokens < j (None at 0),
    # filled as prefill chunks run; None once they went out with the request's first chunk
    prompt_logprobs: list[SampledToken | None] | None = None
    # The prompt's images, in prompt order, each over its run of image tokens (m3sdk.images)
    images: tuple[PromptImage, ...] = ()
    _seq: int = field(default_factory=lambda: next(_arrival_seq))

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are still to compute: prefill reads none of its prompt from the prefix cache."""
        return self.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, at: int | None = None) -> None:
        """Add a sampled token at the end, or at `at`: the slot an overlapped step's PLACEHOLDER held for it."""
        if at is None:
            self.token_ids.append(token_id)
        else:
            self.token_ids[at] = token_id
        if self.sampling is not None:
            self.sampling.append(token_id)

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: priority, then arrival. The largest key is the first to be preempted."""
        return (self.priority, self.arrival_time, self._seq)

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    def timings(self) -> Timings:
        end = self.finish_time or time.monotonic()
        started = self.first_scheduled_time or end
        first = self.first_token_time
        decode_tokens = self.num_output_tokens - 1
        return Timings(
            queue_s=started - self.arrival_time,
            ttft_s=None if first is None else first - self.arrival_time,
            mean_tpot_s=(end - first) / decode_tokens if first is not None and decode_tokens > 0 else None,
            e2e_s=end - self.arrival_time,
        )


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Seconds: waiting before the first schedule, to the first token, per token after it, end to end."""

    queue_s: float
    ttft_s: float | None
    mean_tpot_s: float | None
    e2e_s: float


@dataclass(frozen=True)
class Chunk:
    """One streamed delta of choice `index`. The last chunk of a choice has `finish_reason` (and `stop_reason`),
    `usage` and `timings` set (usage and timings of that choice); the first chunk of choice 0 carries the
    `prompt_logprobs` when asked."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[SampledToken] | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: Exception | None = None  # the request failed (e.g. PrefillNodeError): its stream raises this
    index: int = 0
    stop_reason: StopReason = None
    prompt_logprobs: list[SampledToken | None] | None = None

    def then(self, later: Chunk) -> Chunk:
        """This delta followed by a later one of the same choice, as one."""
        assert later.index == self.index, "chunks of two choices do not merge"
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        return Chunk(self.request_id, self.text + later.text, self.token_ids + later.token_ids, later.finish_reason,
                     logprobs, later.usage, later.timings, later.error, self.index, later.stop_reason, prompt)


@dataclass(frozen=True)
class Choice:
    """One of the `n` completions of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stop_reason: StopReason = None
    logprobs: list[SampledToken] | None = None


@dataclass(frozen=True)
class Completion:
    """A finished request. `outputs` holds its `n` choices in index order; the flat fields (text, token_ids,
    finish_reason, stop_reason, logprobs) are choice 0's. `usage` counts the prompt once and every choice's
    tokens; `timings` run from arrival to the last choice's end."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    logprobs: list[SampledToken] | None = None
    stop_reason: StopReason = None
    prompt_logprobs: list[SampledToken | None] | None = None
    outputs: tuple[Choice, ...] = ()

    @classmethod
    def of_chunks(cls, choices: list[list[Chunk]]) -> Completion:
        """The Completion of a request's streamed chunks, grouped by choice (index order)."""
        outputs, usages, timings = [], [], []
        for chunks in choices:
            last = chunks[-1]
            logprobs = [t for c in chunks for t in c.logprobs or ()] if last.logprobs is not None else None
            outputs.append(Choice(last.index, "".join(c.text for c in chunks),
                                  [t for c in chunks for t in c.token_ids], last.finish_reason, last.stop_reason,
                                  logprobs))
            usages.append(last.usage)
            timings.append(last.timings)
        prompt_logprobs = next((c.prompt_logprobs for c in choices[0] if c.prompt_logprobs is not None), None)
        first = outputs[0]
        usage = Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                      usages[0].cached_prompt_tokens)
        ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
        tpots = [t.mean_tpot_s for t in timings if t.mean_tpot_s is not None]
        timing = timings[0] if len(timings) == 1 else Timings(
            min(t.queue_s for t in timings), min(ttfts) if ttfts else None,
            sum(tpots) / len(tpots) if tpots else None, max(t.e2e_s for t in timings))
        return cls(choices[0][-1].request_id, first.text, first.token_ids, first.finish_reason, usage, timing,
                   first.logprobs, first.stop_reason, prompt_logprobs, tuple(outputs))
