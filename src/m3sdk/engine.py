"""Engine: the async face, on anyio: the same Engine serves an asyncio or a trio program. The core runs in its
own thread (or, with `EngineConfig.engine_process`, in a process of its own: core/process.py; both behind
core/handle.py's CoreHandle); the caller's event loop only validates and moves requests in, and deltas out.

Requests go in through the core's thread-safe inbox. Deltas come back once per step, scheduled onto the event loop
from the engine thread without waiting for it (`_LoopHandle`), into one channel per request. Leaving a
stream early, cancelling the awaiting task, or `abort()` ends the request in the core and frees its pages. If the
engine thread (or process) dies, every waiter gets EngineDeadError at once. (Over 450 lines: generate, stream, chat
and abort share the loop-side state here, the channels and orphans, which has one owner.)
"""

from __future__ import annotations

import dataclasses
import numbers
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import anyio
import sniffio
from prometheus_client import CollectorRegistry

from m3sdk.chat import AssistantStreamParser, join_deltas, prompt_opens_reasoning
from m3sdk.chat.completion import ChatCompletion, ChatCompletionChunk, chat_finish_reason
from m3sdk.chat.constraints import chat_constraint
from m3sdk.chat.image_parts import has_image_parts, split_image_parts
from m3sdk.config import EngineConfig
from m3sdk.core import CoreHandle, CoreProcess, build_core
from m3sdk.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from m3sdk.metrics import EngineMetrics
from m3sdk.params import SamplingParams, check_text, short_repr
from m3sdk.request import Chunk, Completion, Request
from m3sdk.tokenizer import Tokenizer

# a text, token ids, chat messages, or an image prompt: {"prompt": text | "prompt_token_ids": ids, "images": [...]}
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]] | Mapping[str, Any]

_NO_IMAGES = ("this engine takes no images: its checkpoint has no vision encoder, limit_images is 0, or it runs "
              "tensor parallel")
_DEAD = object()  # queued to every live request when the engine thread dies


class _LoopHandle:
    """The running event loop as another thread reaches it: `call_soon(fn)` runs fn there soon and returns at once
    (asyncio's call_soon_threadsafe, trio's run_sync_soon; anyio's from_thread would wait for the loop). Raises
    RuntimeError once the loop has ended. `new_event()`: an event of the loop's own library."""

    def __init__(self) -> None:
        if sniffio.current_async_library() == "trio":
            import trio

            self.key: object = trio.lowlevel.current_trio_token()
            self.call_soon: Callable[[Callable[[], None]], None] = self.key.run_sync_soon
            self.new_event: Callable[[], Any] = trio.Event
        else:
            import asyncio

            self.key = asyncio.get_running_loop()
            self.call_soon = self.key.call_soon_threadsafe
            self.new_event = asyncio.Event

    def is_current(self) -> bool:
        return _LoopHandle().key is self.key


class _Channel:
    """One request's deltas (all its choices'), from the loop's dispatch to its waiter. `ids`: the engine's request
    id of each choice (the application's id for a single choice, suffixed "/index" for several).

    A deque, and the loop's own event while the waiter waits: `get` returns at once when a delta is there. (An
    anyio memory stream costs a checkpoint, that is a whole extra loop turn, and an async-backend lookup per
    delta: with 64 streams behind an HTTP server that was a third of the event loop's time.)"""

    def __init__(self, request_id: str, ids: list[str], new_event: Callable[[], Any]) -> None:
        self.request_id = request_id
        self.ids = ids
        self._items: deque[Chunk | object] = deque()
        self._new_event = new_event
        self._waiter: Any = None  # the event the waiter awaits, while it does

    def put(self, item: Chunk | object) -> None:
        self._items.append(item)
        if self._waiter is not None:
            self._waiter.set()

    async def get(self) -> Chunk | object:
        while not self._items:
            self._waiter = self._new_event()
            try:
                await self._waiter.wait()
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> Chunk | object:
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items


class Engine:
    """`async with Engine(model=..., max_num_seqs=...) as engine: await engine.generate("...")`."""

    def __init__(self, config: EngineConfig | None = None, /, **overrides: Any):
        config = config if config is not None else EngineConfig()
        self.config = config.replace(**overrides) if overrides else config
        self._core: CoreHandle | None = None
        self._metrics: EngineMetrics | None = None
        self._loop: _LoopHandle | None = None
        self._channels: dict[str, _Channel] = {}  # by the engine's request id of each live choice
        self._requests: dict[str, _Channel] = {}  # by the application's request id
        # ids whose waiter left early, with how many aborts are in flight: their chunks are dropped until the
        # core's last one, so a new request reusing the id gets only its own
        self._orphans: dict[str, int] = {}
        self._dead: BaseException | None = None
        self._closed = False
        # RemotePrefill (m3sdk/disagg/remote.py) when prefill_nodes is set and the core runs in a thread here (an
        # engine process builds and owns its own)
        self._admission: Any = None

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Load the model (off the event loop) and start the engine thread (or process)."""
        if self._core is not None or self._closed:
            raise RuntimeError("an Engine starts once")
        self._loop = _LoopHandle()
        core: CoreHandle
        if self.config.engine_process:
            self._core = core = await anyio.to_thread.run_sync(CoreProcess.launch, self.config)
        else:
            self._core = core = local = await anyio.to_thread.run_sync(build_core, self.config)
            if self.config.prefill_nodes:
                # off the loop too: the client handshakes the nodes (up to a connect timeout each)
                from m3sdk.disagg.remote import RemotePrefill  # the optional `ucx` extra

                self._admission = await anyio.to_thread.run_sync(RemotePrefill.for_core, self.config, local)
        self._metrics = EngineMetrics(core.stats)
        core.start(self._emit_threadsafe, self._dead_threadsafe, finish_listeners=[self._metrics.on_finish],
                   admission=self._admission)

    async def shutdown(self) -> None:
        """Abort what is live (its waiters get finish_reason "abort"), stop the thread, free everything."""
        core, self._closed = self._core, True
        if core is None:
            return
        core.stop()
        # a thread the watchdog gave up on may never return: it is a daemon, not waited for
        stuck = self.config.step_timeout if self._dead is not None else None
        with anyio.CancelScope(shield=True):  # a cancelled shutdown still leaves no engine thread behind
            await anyio.to_thread.run_sync(core.join, stuck)

    @property
    def max_model_len(self) -> int:
        return self._running_core().max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer and chat template (read-only use: it is shared with the engine thread)."""
        return self._running_core().tokenizer

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """This engine's Prometheus registry (serve it with prometheus_client's start_http_server)."""
        return self._running_metrics().registry

    def metrics_text(self) -> str:
        """This engine's metrics in the Prometheus exposition format."""
        return self._running_metrics().text()

    def describe(self) -> dict[str, str]:
        """Model, kernel backend and cache budget, as `m3sdk info` prints them."""
        return self._running_core().describe()

    def stats(self) -> dict[str, int | float]:
        """running, waiting, pages_total, pages_free, pages_cached, prefix_cache_queries/hits (tokens),
        preemptions, steps, prompt/generation tokens, requests finished/aborted; with prefill_nodes also
        remote_prefills, remote_prefill_fallbacks, remote_prefill_failures, remote_prefill_bytes and
        remote_prefill_seconds."""
        return self._running_core().stats()

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, /, *,
                       request_id: str | None = None, priority: int = 0, **param_overrides: Any) -> Completion:
        """The whole completion, its `n` choices in `outputs`. Cancelling the awaiting task aborts the request."""
        chunks: dict[int, list[Chunk]] = {}
        images = isinstance(prompt, Mapping) and bool(prompt.get("images"))
        requests = await _off_loop(images, self._make_requests, prompt, params, request_id, priority, param_overrides)
        async with aclosing(self._stream(requests)) as stream:
            async for chunk in stream:
                chunks.setdefault(chunk.index, []).append(chunk)
        return Completion.of_chunks([chunks[i] for i in sorted(chunks)])

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, /, *, request_id: str | None = None,
               priority: int = 0, **param_overrides: Any) -> AsyncIterator[Chunk]:
        """Deltas as they are generated, each of choice `chunk.index` (several choices' interleave when n > 1);
        the last chunk of each choice has finish_reason, usage and timings. The request is validated here
        (InvalidRequestError, TypeError) and queued when iteration starts; leaving the loop early aborts it."""
        return self._stream(self._make_requests(prompt, params, request_id, priority, param_overrides))

    async def chat(self, messages: Sequence[Mapping[str, Any]], /, *, tools: Sequence[Mapping[str, Any]] | None = None,
                   tool_choice: str | Mapping[str, Any] = "auto", response_format: Mapping[str, Any] | None = None,
                   chat_template_kwargs: Mapping[str, Any] | None = None, parallel_tool_calls: bool = True,
                   params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0,
                   **param_overrides: Any) -> ChatCompletion:
        """One assistant turn: the messages (and tools) rendered by the checkpoint's chat template, the reply
        parsed into content, reasoning and tool calls. `tool_choice` "required" or {"type": "function",
        "function": {"name": ...}} constrains the reply to a call of the allowed tool(s) with schema-valid
        arguments; `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
        ...}} constrains it to JSON. `parallel_tool_calls=False` allows one call per reply under "required".
        finish_reason is "tool_calls" when the reply ends after calling tools."""
        deltas, text = [], []
        steps = await _off_loop(has_image_parts(messages), self._chat, messages, tools, tool_choice, response_format,
                                chat_template_kwargs, parallel_tool_calls, params, request_id, priority,
                                param_overrides)
        async with aclosing(steps):
            async for chunk, step in steps:
                text.append(chunk.text)
                deltas += step
        message = join_deltas(deltas)
        return ChatCompletion(chunk.request_id, message, chat_finish_reason(chunk.finish_reason,
                                                                            bool(message.tool_calls)),
                              chunk.usage, chunk.timings, "".join(text))

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], /, *,
                    tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping[str, Any] = "auto",
                    response_format: Mapping[str, Any] | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None, parallel_tool_calls: bool = True,
                    params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0,
                    **param_overrides: Any) -> AsyncIterator[ChatCompletionChunk]:
        """`chat`, streamed: each step's AssistantDeltas (content, reasoning_content, or a tool call with its
        index, id, name and argument fragments). Validated here, queued when iteration starts."""
        steps = self._chat(messages, tools, tool_choice, response_format, chat_template_kwargs, parallel_tool_calls,
                           params, request_id, priority, param_overrides)
        return self._chat_chunks(steps)

    async def _chat_chunks(self, steps: AsyncIterator[tuple[Chunk, list]]) -> AsyncIterator[ChatCompletionChunk]:
        called = False
        async with aclosing(steps):
            async for chunk, deltas in steps:
                called = called or any(d.tool_calls for d in deltas)
                reason = None if chunk.finish_reason is None else chat_finish_reason(chunk.finish_reason, called)
                yield ChatCompletionChunk(chunk.request_id, deltas, reason, chunk.usage, chunk.timings, chunk.logprobs)

    def _chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
              tool_choice: str | Mapping[str, Any], response_format: Mapping[str, Any] | None,
              chat_template_kwargs: Mapping[str, Any] | None, parallel_tool_calls: bool, params: SamplingParams | None,
              request_id: str | None, priority: int, overrides: dict[str, Any]) -> AsyncIterator[tuple[Chunk, list]]:
        """Validate and build a chat request (before anything is queued); the generator of (chunk, its parsed
        deltas) runs it."""
        core = self._running_core()
        constraint = chat_constraint(tools, tool_choice, response_format, parallel_tool_calls)
        messages, images = split_image_parts(messages)
        if images and core.images is None:
            raise InvalidRequestError(_NO_IMAGES)
        prompt = core.tokenizer.apply_chat_template(messages, tools=None if tool_choice == "none" else tools,
                                                    chat_template_kwargs=chat_template_kwargs)
        in_reasoning = prompt_opens_reasoning(prompt)
        params = _params(params, overrides)
        if constraint is not None:
            if in_reasoning:
                raise InvalidRequestError("tool_choice 'required' / a named function and response_format constrain "
                                          "the whole reply, which this prompt opens inside reasoning: use "
                                          "thinking_mode 'disabled' or 'adaptive'")
            if params.structured_output is not None:
                raise InvalidRequestError("pass structured_output or tool_choice / response_format, not both")
            params = params.replace(structured_output=constraint)
        if params.n != 1:
            raise InvalidRequestError(f"a chat turn has one reply: n must be 1, got {params.n}")
        if images:
            check_text("the rendered chat", prompt)
            ids: Prompt = {"prompt_token_ids": core.images.text_ids(prompt, add_special_tokens=False),
                           "images": images}
        else:
            ids = core.tokenizer.encode(prompt, add_special_tokens=False)
        requests = self._make_requests(ids, params, request_id, priority, {})
        parser = AssistantStreamParser(None if tool_choice == "none" else tools, starts_in_reasoning=in_reasoning)
        return self._parsed(requests, parser)

    async def _parsed(self, requests: list[Request], parser: AssistantStreamParser
                      ) -> AsyncIterator[tuple[Chunk, list]]:
        async with aclosing(self._stream(requests)) as chunks:
            async for chunk in chunks:
                deltas = parser.feed(chunk.text)
                if chunk.finish_reason is not None:
                    deltas += parser.finish()
                yield chunk, deltas

    async def abort(self, request_id: str) -> None:
        """End a request, every choice of it (its waiter gets finish_reason "abort"). Unknown or finished ids are
        a no-op."""
        channel = self._requests.get(request_id)
        if channel is not None and self._dead is None:
            for rid in channel.ids:
                if self._channels.get(rid) is channel:
                    self._running_core().abort(rid)

    # -- requests in -----------------------------------------------------------------------------------

    def _running_metrics(self) -> EngineMetrics:
        self._running_core()
        assert self._metrics is not None
        return self._metrics

    def _running_core(self) -> CoreHandle:
        if self._dead is not None:
            raise EngineDeadError(f"the engine core died: {self._dead!r}") from self._dead
        if self._core is None or self._closed:
            raise RuntimeError("the Engine is not running: use `async with Engine(...)` or `await start()`")
        return self._core

    def _make_requests(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                       priority: int, overrides: dict[str, Any]) -> list[Request]:
        """The request's choices, validated (every check before anything is queued)."""
        core = self._running_core()
        params = _params(params, overrides)
        params.check_against(core.vocab_size, self.config.max_stop_strings, self.config.max_stop_length)
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty str, got {short_repr(request_id)}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an int, got {short_repr(priority)}")
        ids, images = self._prompt_with_images(core, prompt)
        limit = core.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens; the context holds {limit} "
                                      "(max_model_len), with room for at least one generated token")
        if len(ids) + params.max_tokens > limit:
            raise InvalidRequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                      f"max_model_len {limit}")
        most = self.config.max_num_seqs + self.config.max_waiting_requests
        if params.n > most:
            raise InvalidRequestError(f"n={params.n} choices cannot all be live in this engine (max_num_seqs + "
                                      f"max_waiting_requests = {most})")
        if params.n == 1:
            return [core.new_request(request_id, ids, params, len(ids) + params.max_tokens, priority,
                                     images=images)]
        return [core.new_request(f"{request_id}/{i}", ids, params.for_choice(i), len(ids) + params.max_tokens,
                                 priority, index=i, images=images) for i in range(params.n)]

    @classmethod
    def _prompt_with_images(cls, core: CoreHandle, prompt: Prompt) -> tuple[list[int], tuple]:
        """(token ids, images): an image prompt's placeholders expanded to their images' tokens (m3sdk.images)."""
        if not isinstance(prompt, Mapping):
            return cls._prompt_ids(core, prompt), ()
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "images"})
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise InvalidRequestError("a prompt mapping holds 'prompt' (text) or 'prompt_token_ids', and 'images'; "
                                      f"got keys {sorted(prompt)}")
        images = prompt.get("images") or ()
        if images and core.images is None:
            raise InvalidRequestError(_NO_IMAGES)
        text = prompt.get("prompt")
        if images and isinstance(text, str):
            check_text("the prompt", text)
            ids = core.images.text_ids(text)
        else:
            ids = cls._prompt_ids(core, text if "prompt" in prompt else prompt["prompt_token_ids"])
        if not images:
            return ids, ()
        return core.images.prepare(ids, images)

    @staticmethod
    def _prompt_ids(core: CoreHandle, prompt: Prompt) -> list[int]:
        tokenizer = core.tokenizer
        if isinstance(prompt, str):
            check_text("the prompt", prompt)
            ids = tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            text = tokenizer.apply_chat_template(prompt)
            check_text("the rendered chat", text)  # a template may add text of its own; the encoder needs it valid
            ids = tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            # a list of plain ints (the common case) is checked by type and min/max only: the per-item checks
            # below took 14 ms for a 32K-token prompt, all of it added to its time to first token
            if all(type(t) is int for t in prompt):
                ids = list(prompt)
            else:
                bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
                if bad:
                    raise InvalidRequestError(f"token ids must be ints, got {bad[:5]!r}")
                ids = [int(t) for t in prompt]
            if ids and not (0 <= min(ids) and max(ids) < core.vocab_size):
                outside = [t for t in ids if not 0 <= t < core.vocab_size]
                raise InvalidRequestError(f"token ids {outside[:5]} are outside the vocabulary "
                                          f"(size {core.vocab_size})")
        else:
            raise InvalidRequestError("prompt must be a str, a list of token ids, or a list of chat messages, "
                                      f"got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def _admit(self, requests: list[Request]) -> _Channel:
        core = self._running_core()
        if not self._loop.is_current():
            raise RuntimeError("an Engine serves the event loop that started it")
        rid = requests[0].request_id if len(requests) == 1 else requests[0].request_id.rpartition("/")[0]
        ids = [r.request_id for r in requests]
        if rid in self._requests or any(i in self._channels for i in ids):
            raise InvalidRequestError(f"request_id {rid!r} is already live")
        if len(self._channels) + len(ids) > self.config.max_num_seqs + self.config.max_waiting_requests:
            raise EngineOverloadedError(f"{len(self._channels)} requests are live (max_num_seqs "
                                        f"{self.config.max_num_seqs} + max_waiting_requests "
                                        f"{self.config.max_waiting_requests}); retry later")
        channel = _Channel(rid, ids, self._loop.new_event)
        self._requests[rid] = channel
        self._channels.update(dict.fromkeys(ids, channel))
        core.submit(*requests)
        return channel

    async def _stream(self, requests: list[Request]) -> AsyncIterator[Chunk]:
        channel = self._admit(requests)
        rid, several = channel.request_id, len(requests) > 1
        ended: set[int] = set()  # choices whose last chunk came
        backlog: list[Chunk | object] = []
        try:
            while len(ended) < len(requests):
                item = backlog.pop(0) if backlog else await channel.get()
                while not channel.empty():
                    backlog.append(channel.get_nowait())
                if item is not _DEAD and item.finish_reason is None and backlog:
                    # Under load several steps' deltas wait here: hand each choice's over as one chunk.
                    if _DEAD in backlog:
                        item = _DEAD
                    else:
                        rest = []
                        for nxt in backlog:
                            if nxt.index == item.index and item.finish_reason is None:
                                item = item.then(nxt)
                            else:
                                rest.append(nxt)
                        backlog = rest
                if item is _DEAD:
                    raise EngineDeadError(f"the engine core died: {self._dead!r}") from self._dead
                if item.finish_reason is not None:
                    ended.add(item.index)
                if item.error is not None:
                    raise item.error
                yield dataclasses.replace(item, request_id=rid) if several else item
        finally:
            for i in channel.ids:
                if self._channels.get(i) is channel:
                    del self._channels[i]
            if self._requests.get(rid) is channel:
                del self._requests[rid]
            if len(ended) < len(requests) and self._dead is None and not self._closed:
                ended |= _last_indices(backlog) | _last_indices(_drain(channel))
                for request in requests:
                    if request.index not in ended and not request.is_finished:
                        self._orphans[request.request_id] = self._orphans.get(request.request_id, 0) + 1
                        self._core.abort(request.request_id)

    # -- deltas out (called in the engine thread) -------------------------------------------------------

    def _emit_threadsafe(self, chunks: list[Chunk]) -> None:
        try:
            self._loop.call_soon(lambda: self._dispatch(chunks))
        except RuntimeError:  # the application's loop is closed: nobody is listening any more
            self._core.stop()

    def _dead_threadsafe(self, exc: BaseException) -> None:
        try:
            self._loop.call_soon(lambda: self._on_dead(exc))
        except RuntimeError:
            pass  # the loop is closed: no waiter is left to tell

    def _dispatch(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            rid, last = chunk.request_id, chunk.finish_reason is not None
            if rid in self._orphans:  # a left waiter's: never for a new request that reuses the id
                if last:
                    self._orphans[rid] -= 1
                    if not self._orphans[rid]:
                        del self._orphans[rid]
                continue
            channel = self._channels.get(rid)
            if channel is not None:
                channel.put(chunk)

    def _on_dead(self, exc: BaseException) -> None:
        self._dead = exc
        for channel in self._channels.values():
            channel.put(_DEAD)


def _params(params: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    if params is None:
        return SamplingParams(**overrides)
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params.replace(**overrides) if overrides else params


async def _off_loop(images: bool, build: Callable[..., Any], *args: Any) -> Any:
    """build(*args): a request validated and made ready to queue; in a worker thread when its prompt has images,
    whose decoding and resizing would otherwise stall every other request's stream on the event loop."""
    return await anyio.to_thread.run_sync(build, *args) if images else build(*args)


def _drain(channel: _Channel) -> list[Chunk | object]:
    """What waits in a channel its waiter left."""
    items = []
    while not channel.empty():
        items.append(channel.get_nowait())
    return items


def _last_indices(items: list[Chunk | object]) -> set[int]:
    """The choices whose last chunk is among these."""
    return {item.index for item in items if item is not _DEAD and item.finish_reason is not None}
