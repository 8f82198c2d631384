"""CoreHandle: the engine core as the async face (m3sdk.engine) drives it. Two implement it: `EngineCore` (the loop
in a thread of the application's process) and `CoreProcess` (the same loop in a process of its own, reached over
pipes: core/process.py). The face validates and builds requests through it in the caller's thread, queues them,
and hears of each step's chunks through `emit` (called in another thread) until `on_dead` or `stop`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from m3sdk.core.hooks import Admission, Emit, FinishListener, OnDead
from m3sdk.params import SamplingParams
from m3sdk.request import Request
from m3sdk.structured import GrammarCompiler
from m3sdk.tokenizer import Tokenizer

if TYPE_CHECKING:
    from m3sdk.images import ImagePrompts, PromptImage


class CoreHandle(Protocol):
    tokenizer: Tokenizer  # read-only use from the caller's thread
    max_model_len: int
    vocab_size: int
    images: ImagePrompts | None  # image prompts' expansion and preprocessing; None: the engine takes text only

    def grammars(self) -> GrammarCompiler:
        """The structured outputs' compiler (thread-safe)."""

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_total_tokens: int,
                    priority: int = 0, index: int = 0, images: tuple[PromptImage, ...] = ()) -> Request:
        """A request ready to submit, or InvalidRequestError (its structured output does not compile, ...)."""

    def start(self, emit: Emit, on_dead: OnDead, *, finish_listeners: Sequence[FinishListener] = (),
              admission: Admission | None = None) -> None:
        """Run the loop: `emit(chunks)` once per step, `on_dead(exc)` once if it dies; `finish_listeners` hear of
        every request's end before its last chunk is emitted."""

    def submit(self, request: Request, *choices: Request) -> None:
        """Queue a request (and the other choices of its prompt)."""

    def abort(self, request_id: str) -> None:
        """End a live request (a no-op for an unknown or finished id); its last chunk says "abort"."""

    def stop(self) -> None:
        """Abort what is live and end the loop."""

    def join(self, timeout: float | None = None) -> None:
        """Wait for the loop to end (at most `timeout` seconds)."""

    def stats(self) -> dict[str, Any]:
        """The counters as of the last step."""

    def describe(self) -> dict[str, str]:
        """Model, kernel backend and cache budget, as `m3sdk info` prints them."""
