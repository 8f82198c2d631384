"""OutputProcessor: what becomes of the tokens a step emitted: appended to their requests, detokenized, checked
against the stop conditions, and turned into the step's chunks; finishing a request is here too.

`finish_reason` is the one stop predicate. Tokens that cannot end their request (none stops it, no stop string
to match) are recorded at once (the next step is scheduled from them) and their text worked out in `flush`,
which the core calls once the next step is launched: the host's detokenizing overlaps the device's step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

from m3sdk.request import Chunk, FinishReason, Request, StopReason
from m3sdk.runner import PLACEHOLDER
from m3sdk.sampler import SampledToken

# tokens of one request emitted by one step, and where the first one goes: None appends; an index puts them at
# their PLACEHOLDERs (an overlapped step's)
Emitted = tuple[Request, list[SampledToken], int | None]
Release = Callable[[Request, FinishReason], None]


class OutputProcessor:
    def __init__(self, eos_token_ids: Iterable[int], release: Release):
        self.eos_token_ids = frozenset(eos_token_ids)
        # frees what a finished request holds (its scheduler's or admission's state, pages, drafts)
        self._release = release
        # tokens recorded whose text waits for `flush`, with the position of the first
        self._text_later: list[tuple[Request, list[SampledToken], int]] = []
        self.counters = dict(generation_tokens=0, requests_finished=0, requests_aborted=0)

    def finish_reason(self, request: Request, token_id: int, end: int) -> tuple[FinishReason, StopReason] | None:
        """Whether this token, ending at position `end` of the request's tokens, ends the request by itself, and
        why: ("stop", None) for eos (unless ignored) and ("stop", the id) for a stop token (neither is text), once
        min_tokens are generated; ("length", None) at max_tokens or the context limit. A structured output allows
        eos only where its match is complete: eos ends it, ignore_eos and min_tokens or not. A stop string is the
        detokenizer's to find (`matches_stops`)."""
        params = request.params
        structured = params.structured_output is not None
        stops = self.matches_stops(request, end)
        if token_id in self.eos_token_ids and (structured or (stops and not params.ignore_eos)):
            return "stop", None
        if stops and token_id in params.stop_token_ids:
            return "stop", token_id
        if end >= request.max_total_tokens:
            return "length", None
        return None

    @staticmethod
    def matches_stops(request: Request, end: int) -> bool:
        """Whether a stop (eos, a stop token, a stop string) may end the request at the token ending at `end`:
        min_tokens are generated with it."""
        return end - request.num_prompt_tokens >= request.params.min_tokens

    def process(self, emitted: Sequence[Emitted]) -> list[Chunk]:
        """Record every token; the chunks of the requests that may finish now (the others' come from `flush`).
        Requests finished since their step launched (aborted) drop theirs."""
        chunks = []
        for request, tokens, at in emitted:
            if request.is_finished:
                continue
            first = request.num_tokens if at is None else at
            if request.params.stop or any(self.finish_reason(request, t.token_id, first + i + 1) is not None
                                          for i, t in enumerate(tokens)):
                chunks.append(self._accept(request, tokens, at))
            else:
                for i, token in enumerate(tokens):
                    self._record(request, token, None if at is None else at + i)
                self._text_later.append((request, tokens, first))
        return chunks

    def flush(self) -> list[Chunk]:
        """The text of the tokens `process` recorded without their chunk."""
        later, self._text_later = self._text_later, []
        chunks = []
        for request, tokens, first in later:
            text = "".join(request.text.push(t.token_id, self.matches_stops(request, first + i + 1))[0]
                           for i, t in enumerate(tokens))
            logprobs = list(tokens) if request.params.logprobs is not None else None
            chunks.append(Chunk(request.request_id, text, [t.token_id for t in tokens], None, logprobs,
                                index=request.index, prompt_logprobs=_take_prompt_logprobs(request)))
        return chunks

    def _accept(self, request: Request, tokens: list[SampledToken], at: int | None) -> Chunk:
        """The tokens in order until the request finishes, as one chunk (one per token cost the event loop a queue
        operation and a merge each)."""
        want_logprobs = request.params.logprobs is not None
        first = request.num_tokens if at is None else at
        text, ids, logprobs = [], [], []
        ends: tuple[FinishReason, StopReason] | None = None
        for i, token in enumerate(tokens):
            tid = token.token_id
            self._record(request, token, None if at is None else at + i)
            ids.append(tid)
            logprobs.append(token)
            ends = self.finish_reason(request, tid, first + i + 1)
            if ends is None or ends[0] != "stop":  # stop tokens are not text
                piece, stopped = request.text.push(tid, self.matches_stops(request, first + i + 1))
                text.append(piece)
                if stopped is not None:
                    ends = "stop", stopped
            if ends is not None:
                break
        prompt_logprobs = _take_prompt_logprobs(request)
        if ends is None:
            return Chunk(request.request_id, "".join(text), ids, None, logprobs if want_logprobs else None,
                         index=request.index, prompt_logprobs=prompt_logprobs)
        text.append(request.text.finish())
        request.stop_reason = ends[1]
        chunk = self.finish(request, ends[0], "".join(text), ids, logprobs if want_logprobs else None)
        return dataclasses.replace(chunk, prompt_logprobs=prompt_logprobs) if prompt_logprobs is not None else chunk

    def _record(self, request: Request, token: SampledToken, at: int | None) -> None:
        """Append a token (or put it at `at`, its PLACEHOLDER) and count it."""
        request.append_token(token.token_id, at)
        self.counters["generation_tokens"] += 1
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()

    def finish(self, request: Request, reason: FinishReason, text: str = "", token_ids: Sequence[int] = (),
               logprobs: list[SampledToken] | None = None, error: Exception | None = None) -> Chunk:
        """End a request: listeners first (its pages are still held), then release it; its last chunk."""
        while request.token_ids and request.token_ids[-1] == PLACEHOLDER:  # a step in flight's token: dropped
            request.token_ids.pop()
        self._release(request, reason)
        self.counters["requests_aborted" if reason == "abort" else "requests_finished"] += 1
        return Chunk(request.request_id, text, list(token_ids), reason, logprobs, request.usage(), request.timings(),
                     error, request.index, request.stop_reason)


def _take_prompt_logprobs(request: Request) -> list[SampledToken | None] | None:
    """The request's prompt logprobs, once, with its first chunk (they are complete when it has a token)."""
    prompt, request.prompt_logprobs = request.prompt_logprobs, None
    return prompt
