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
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Per-request helpers the core attaches: seeded sampling state and the incremental detokenizer.
    sampling: SamplingState | None = None
    text: TextStream | None = None
    logprobs: list[SampledToken] = field(default_factory=list)
    # The prompt's images, in prompt order, each over its run of image tokens (m3sdk.images)
    images: tuple[PromptImage, ...] = ()
    _seq: int = field(default_factory=lambda: next(_arrival_seq))

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

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
    """One streamed delta. The last chunk of a request has `finish_reason`, `usage` and `timings` set."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[SampledToken] | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: Exception | None = None  # the request failed (e.g. PrefillNodeError): its stream raises this

    def then(self, later: Chunk) -> Chunk:
        """This delta followed by a later one of the same request, as one."""
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        return Chunk(self.request_id, self.text + later.text, self.token_ids + later.token_ids, later.finish_reason,
                     logprobs, later.usage, later.timings, later.error)


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    logprobs: list[SampledToken] | None = None
