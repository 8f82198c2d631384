"""OutputProcessor: what becomes of the tokens a step emitted: appended to their requests, detokenized, checked
against the stop conditions, and turned into the step's chunks; finishing a request is here too.

`finish_reason` is the one stop predicate. Tokens that cannot end their request (none stops it, no stop string
to match) are recorded at once (the next step is scheduled from them) and their text worked out in `flush`,
which the core calls once the next step is launched: the host's detokenizing overlaps the device's step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from m3sdk.request import Chunk, FinishReason, Request
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
        self._text_later: list[tuple[Request, list[SampledToken]]] = []
        self.counters = dict(generation_tokens=0, requests_finished=0, requests_aborted=0)

    def finish_reason(self, request: Request, token_id: int, end: int) -> FinishReason | None:
        """Whether this token, ending at position `end` of the request's tokens, ends the request by itself: "stop"
        for eos (unless ignored; a structured output never ignores it) or a stop token (neither is text),
        "length" at max_tokens or the context limit. A stop string is the detokenizer's to find."""
        params = request.params
        # a structured output allows eos only where its match is complete: eos ends it, ignore_eos or not
        ends = token_id in self.eos_token_ids and (not params.ignore_eos or params.structured_output is not None)
        if ends or token_id in params.stop_token_ids:
            return "stop"
        if end >= request.max_total_tokens:
            return "length"
        return None

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
                self._text_later.append((request, tokens))
        return chunks

    def flush(self) -> list[Chunk]:
        """The text of the tokens `process` recorded without their chunk."""
        later, self._text_later = self._text_later, []
        chunks = []
        for request, tokens in later:
            text = "".join(request.text.push(t.token_id)[0] for t in tokens)
            logprobs = list(tokens) if request.params.logprobs is not None else None
            chunks.append(Chunk(request.request_id, text, [t.token_id for t in tokens], None, logprobs))
        return chunks

    def _accept(self, request: Request, tokens: list[SampledToken], at: int | None) -> Chunk:
        """The tokens in order until the request finishes, as one chunk (one per token cost the event loop a queue
        operation and a merge each)."""
        want_logprobs = request.params.logprobs is not None
        first = request.num_tokens if at is None else at
        text, ids, logprobs = [], [], []
        reason: FinishReason | None = None
        for i, token in enumerate(tokens):
            tid = token.token_id
            self._record(request, token, None if at is None else at + i)
            ids.append(tid)
            logprobs.append(token)
            reason = self.finish_reason(request, tid, first + i + 1)
            if reason != "stop":  # stop tokens are not text
                piece, stopped = request.text.push(tid)
                text.append(piece)
                if stopped is not None:
                    reason = "stop"
            if reason is not None:
                break
        if reason is None:
            return Chunk(request.request_id, "".join(text), ids, None, logprobs if want_logprobs else None)
        text.append(request.text.finish())
        return self.finish(request, reason, "".join(text), ids, logprobs if want_logprobs else None)

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
                     error)
