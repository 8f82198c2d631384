"""CoreProcess: the engine core in a process of its own (`EngineConfig.engine_process`), behind the same
CoreHandle as the in-thread EngineCore, so that the application's threads (an HTTP server's event loop) and the
engine loop no longer share one interpreter lock.

The child (spawned: CUDA-safe) builds the real core with build_core and runs it. Two pipes: commands in (add, abort,
stop), one message per step out (the step's chunks, the finishes of requests that ended in it, the stats
snapshot), each one pickle, made and written by a thread of the child's beside its engine loop. The parent keeps
what validation needs (tokenizer, grammar compiler, image decoding, sizes): requests are checked in the caller's
thread before anything is queued, then travel as plain specs and are rebuilt in the child by its core's
`new_request` (which compiles a structured output again: the child's own cache). A reader thread in the parent
hands each step's chunks to `emit`; the child dying (its pipe closes) or its loop dying is `on_dead` with
EngineDeadError for every waiter.

With prefill_nodes the child builds the remote prefill admission beside its core (the parent never touches UCX)
and reports the checks it makes the core apply (AdmissionChecks), which the parent's `new_request` applies too.

Finish listeners run in the parent's reader thread, before the step's chunks are emitted, with the parent's
Request brought to the state the child's had when it finished (status, reasons, times, tokens); a listener here
holds no pages (there are none in this process), so it returns None. (Over 450 lines: both ends of one message
protocol, the parent's handle and the child's entry point, stay in one file.)
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util
import os
import pickle
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from m3sdk.config import EngineConfig
from m3sdk.core.admission_checks import AdmissionChecks
from m3sdk.core.hooks import Admission, Emit, FinishListener, OnDead
from m3sdk.errors import EngineDeadError, InvalidRequestError
from m3sdk.observability import get_logger
from m3sdk.params import SamplingParams
from m3sdk.request import Chunk, FinishReason, Request, RequestStatus, StopReason
from m3sdk.sampler import SamplingState
from m3sdk.structured import GrammarCompiler
from m3sdk.tokenizer import Tokenizer

if TYPE_CHECKING:
    from m3sdk.core.engine_core import EngineCore
    from m3sdk.images import ImagePrompts, PromptImage

log = get_logger("m3sdk.core")

_ADD, _ABORT, _STOP = "add", "abort", "stop"  # parent -> child
_EXIT_TIMEOUT_S = 30.0  # what an application that exits without shutting its engine down waits for the child
_READY, _FAILED, _STEP, _REFUSED, _DEAD, _STOPPED = "ready", "failed", "step", "refused", "dead", "stopped"
_STATS = "stats"  # child -> parent: the stats as the loop goes idle, when no step emitted them
# The interpreter lock's switch interval in the engine process (and in `m3sdk serve`'s): a thread that wakes with a
# message (a new request in the child, a step's chunks in the server) waits for a busy engine or event-loop
# thread to hand the lock over; Python's default of 5 ms lets each of those hops cost up to that much latency.
SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class RequestSpec:
    """What rebuilds a validated request in the child."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int
    priority: int
    index: int
    images: tuple[PromptImage, ...]
    arrival_time: float  # time.monotonic() in the parent: one clock for every process of the machine

    @classmethod
    def of(cls, request: Request) -> RequestSpec:
        return cls(request.request_id, request.prompt_token_ids, request.params, request.max_total_tokens,
                   request.priority, request.index, request.images, request.arrival_time)

    def build(self, core: EngineCore) -> Request:
        request = core.new_request(self.request_id, self.prompt_token_ids, self.params, self.max_total_tokens,
                                   self.priority, self.index, self.images)
        request.arrival_time = self.arrival_time  # timings and timeouts count from the application's call
        return request


@dataclass(frozen=True)
class Finished:
    """A request's state as it finished in the child, for the parent's finish listeners."""

    request_id: str
    reason: FinishReason
    stop_reason: StopReason
    output_token_ids: list[int]
    num_cached_tokens: int
    num_preemptions: int
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float

    @classmethod
    def of(cls, request: Request, reason: FinishReason) -> Finished:
        return cls(request.request_id, reason, request.stop_reason, request.output_token_ids,
                   request.num_cached_tokens, request.num_preemptions, request.first_scheduled_time,
                   request.first_token_time, request.finish_time or time.monotonic())

    def apply(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.stop_reason = self.reason, self.stop_reason
        request.token_ids = request.prompt_token_ids + self.output_token_ids
        request.num_cached_tokens, request.num_preemptions = self.num_cached_tokens, self.num_preemptions
        request.first_scheduled_time, request.first_token_time = self.first_scheduled_time, self.first_token_time
        request.finish_time = self.finish_time


@dataclass(frozen=True)
class _Ready:
    tokenizer_path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    image_token_id: int | None  # None: the child's core takes no images
    limit_images: int
    checks: AdmissionChecks  # what the child's core refuses because of its admission (prefill nodes)
    description: dict[str, str]
    stats: dict[str, Any]


class CoreProcess:
    """The parent's side: a CoreHandle over the child's core. `launch` returns once the child's core is built
    (its build errors are raised here, as build_core raises them)."""

    def __init__(self, config: EngineConfig, process: multiprocessing.process.BaseProcess, commands: Connection,
                 out: Connection, ready: _Ready):
        self.config = config
        self._process = process
        self._commands = commands
        self._out = out
        self._send_lock = threading.Lock()  # the loop's submits and aborts, a reader's stop
        self.tokenizer = Tokenizer.from_pretrained(ready.tokenizer_path)
        self.vocab_size = ready.vocab_size
        self.max_model_len = ready.max_model_len
        self._eos_token_ids = ready.eos_token_ids
        self._description = ready.description
        self._stats = ready.stats
        self._checks = ready.checks
        self.images = _parent_images(config, self.tokenizer, ready)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        # submitted requests by id until they finish (the reader thread brings them to their final state)
        self._live: dict[str, Request] = {}
        self._reader: threading.Thread | None = None
        _RUNNING.add(self)

    @classmethod
    def launch(cls, config: EngineConfig) -> CoreProcess:
        """Spawn the child, wait for its core to be built (this blocks: call it off the event loop)."""
        ctx = multiprocessing.get_context("spawn")
        commands_in, commands = ctx.Pipe(duplex=False)
        out, out_child = ctx.Pipe(duplex=False)
        # image URLs are fetched where images are preprocessed: in this process
        child_config = config.replace(image_fetcher=None, engine_process=False)
        process = ctx.Process(target=_child_main, args=(child_config, commands_in, out_child),
                              name="m3sdk-engine-core", daemon=True)
        try:
            process.start()  # pickles the config before the child is launched
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            for end in (commands_in, commands, out, out_child):
                end.close()
            raise ValueError(f"engine_process sends the EngineConfig to the engine process, and it does not pickle "
                             f"({e}): a scheduler factory must be a module-level function or class") from e
        commands_in.close()  # the child holds the other ends: its death closes `out` here
        out_child.close()
        try:
            kind, payload = pickle.loads(out.recv_bytes())
        except (EOFError, OSError):
            process.join(5)
            commands.close()
            out.close()
            raise EngineDeadError(f"the engine process exited while building the engine ({_exit_text(process)})"
                                  ) from None
        if kind == _FAILED:
            process.join(30)
            commands.close()
            out.close()
            raise payload
        try:
            return cls(config, process, commands, out, payload)
        except BaseException:  # the parent's side did not come up (its tokenizer, say): no child left behind
            process.kill()
            process.join()
            commands.close()
            out.close()
            raise

    def grammars(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self._eos_token_ids)
            return self._grammars

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_total_tokens: int,
                    priority: int = 0, index: int = 0, images: tuple[PromptImage, ...] = ()) -> Request:
        """A request checked as the child's core will check it (a structured output is compiled here: one that
        does not compile is an InvalidRequestError before anything is queued), its admission's checks included."""
        self._checks.check_params(params)
        if params.structured_output is not None:
            self.grammars().compile(params.structured_output)
        request = Request(request_id, prompt_ids, params, max_total_tokens, priority, index=index, images=images)
        request.sampling = SamplingState.of(params, prompt_ids, self._eos_token_ids)  # for the checks alone
        self._checks.check_request(request)
        return request

    def start(self, emit: Emit, on_dead: OnDead, *, finish_listeners: Sequence[FinishListener] = (),
              admission: Admission | None = None) -> None:
        if self._reader is not None:
            raise RuntimeError("a CoreProcess starts once")
        if admission is not None:
            raise ValueError("an engine core in its own process builds its admission there (from prefill_nodes)")
        self._reader = threading.Thread(target=self._read, args=(emit, on_dead, list(finish_listeners)),
                                        name="m3sdk-engine-reader", daemon=True)
        self._reader.start()

    def submit(self, request: Request, *choices: Request) -> None:
        requests = (request, *choices)
        for r in requests:
            self._live[r.request_id] = r
        try:
            self._send((_ADD, [RequestSpec.of(r) for r in requests]))
        except OSError as e:
            for r in requests:
                self._live.pop(r.request_id, None)
            raise EngineDeadError(f"the engine process is gone ({_exit_text(self._process)})") from e

    def abort(self, request_id: str) -> None:
        try:
            self._send((_ABORT, request_id))
        except OSError:
            pass  # the child is gone: its death reaches every waiter

    def stop(self) -> None:
        try:
            self._send((_STOP, None))
        except OSError:
            pass

    def join(self, timeout: float | None = None) -> None:
        """Wait for the child to stop (its live requests' aborts delivered first); past `timeout` it is killed."""
        if self._reader is not None:
            self._reader.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop in time: killed", timeout_s=timeout)
            self._process.kill()
            self._process.join()
        self._commands.close()
        _RUNNING.discard(self)

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def describe(self) -> dict[str, str]:
        return dict(self._description)

    def _send(self, message: tuple[str, Any]) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._commands.send_bytes(data)

    def _read(self, emit: Emit, on_dead: OnDead, listeners: list[FinishListener]) -> None:
        """The reader thread: each step's message -> listeners, then emit; the child's end -> on_dead."""
        reported = False
        try:
            while True:
                try:
                    message = pickle.loads(self._out.recv_bytes())
                except (EOFError, OSError):
                    break
                kind = message[0]
                if kind == _STEP:
                    _, chunks, finished, self._stats = message
                    for f in finished:
                        request = self._live.pop(f.request_id, None)
                        if request is not None:
                            f.apply(request)
                            for listener in listeners:
                                listener(request, f.reason)
                    emit(chunks)
                elif kind == _STATS:
                    self._stats = message[1]
                elif kind == _REFUSED:  # the child could not rebuild a request the parent accepted
                    _, ids, error = message
                    emit([Chunk(rid, "", [], "abort", error=error, index=self._live.pop(rid).index) for rid in ids])
                elif kind == _DEAD:
                    reported = True
                    on_dead(message[1])
                else:  # stopped: every live request's last chunk went out before
                    return
            self._process.join(5)
            if not reported:
                on_dead(EngineDeadError(f"the engine process exited ({_exit_text(self._process)})"))
        except BaseException as e:  # noqa: BLE001 - a failure here must still reach the waiters
            if not reported:
                on_dead(e)
            log.exception("engine reader thread died")
        finally:
            self._out.close()


# Engines whose child runs. The child ignores SIGTERM, which multiprocessing's own exit hook sends its daemonic
# children before joining them: this hook, registered after that one and so run before it, stops them first.
_RUNNING: weakref.WeakSet[CoreProcess] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for core in list(_RUNNING):
        core.stop()
    for core in list(_RUNNING):
        core.join(_EXIT_TIMEOUT_S)


def _parent_images(config: EngineConfig, tokenizer: Tokenizer, ready: _Ready) -> ImagePrompts | None:
    """Image prompts' expansion and preprocessing in this process (the caller's thread): the child's core encodes
    them."""
    if ready.image_token_id is None:
        return None
    import torch

    from m3sdk.images import ImagePrompts
    from m3sdk.model.image_processor import ImageProcessor

    return ImagePrompts(ImageProcessor.from_pretrained(config.model_path()), None, tokenizer, ready.limit_images,
                        torch.device("cpu"), ready.image_token_id, config.image_fetcher,
                        keep_files=bool(config.prefill_nodes))


def _exit_text(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip, else an EngineDeadError that names it."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any exception type may refuse to pickle
        return EngineDeadError(repr(exc))


class _Outbox:
    """The child's side of the out pipe. `send` only queues: a thread of its own pickles and writes, so the engine
    loop never waits for the pickle (about 0.1 ms for 64 streams' chunks) nor for a parent slow to read (a full
    pipe). Messages leave in `send` order, from any thread; `close` sends what is queued and ends."""

    def __init__(self, out: Connection):
        self._out = out
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="m3sdk-engine-outbox", daemon=True)
        self._thread.start()

    def send(self, message: tuple) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _write(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._out.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
            except OSError:  # the parent is gone: nobody reads; its pipe's end stops the main thread too
                return


def _child_main(config: EngineConfig, commands: Connection, out: Connection) -> None:
    """The engine process: build the core, run it, apply commands until stop (or the parent is gone)."""
    # Ctrl-C in a terminal and a service manager's SIGTERM reach the whole process group: the parent handles
    # them and stops this process once its live requests are aborted (or its end of the pipe closes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    from m3sdk.core.builder import build_core, tokenizer_path

    outbox = _Outbox(out)
    try:
        core = build_core(config)
        admission = None
        if config.prefill_nodes:  # built here, beside the cache it fills; the core's loop closes it as it ends
            from m3sdk.disagg.remote import RemotePrefill  # the optional `ucx` extra

            admission = RemotePrefill.for_core(config, core)
    except BaseException as e:  # noqa: BLE001 - the parent raises it from Engine.start
        outbox.send((_FAILED, _portable(e)))
        outbox.close()
        return
    images = core.images
    outbox.send((_READY, _Ready(str(tokenizer_path(core.config)), core.vocab_size, core.max_model_len,
                                frozenset(core.output.eos_token_ids),
                                None if images is None else images.image_token_id,
                                0 if images is None else images.limit,
                                AdmissionChecks.of(admission is not None, images), core.describe(), core.stats())))
    finished: list[Finished] = []  # the engine thread's alone: its listener fills it, its emit sends it
    dead = threading.Event()

    def on_finish(request: Request, reason: FinishReason) -> None:
        finished.append(Finished.of(request, reason))

    sent: list[dict[str, Any]] = [{}]  # the stats the parent holds (the engine thread's alone)

    def emit(chunks: list[Chunk]) -> None:
        done = finished[:]
        finished.clear()
        sent[0] = core.stats()
        outbox.send((_STEP, chunks, done, sent[0]))

    def on_idle() -> None:
        stats = core.stats()
        if stats != sent[0]:
            sent[0] = stats
            outbox.send((_STATS, stats))

    def on_dead(exc: BaseException) -> None:
        dead.set()
        outbox.send((_DEAD, _portable(exc)))

    core.start(emit, on_dead, finish_listeners=[on_finish], admission=admission, on_idle=on_idle)
    try:
        while True:
            try:
                kind, item = pickle.loads(commands.recv_bytes())
            except (EOFError, OSError):  # the parent is gone
                break
            if kind == _ADD:
                try:
                    requests = [spec.build(core) for spec in item]
                except InvalidRequestError as e:
                    outbox.send((_REFUSED, [spec.request_id for spec in item], e))
                    continue
                core.submit(*requests)
            elif kind == _ABORT:
                core.abort(item)
            else:
                break
    finally:
        core.stop()
        # a loop the watchdog gave up on may never return: leave it
        core.join(0 if dead.is_set() else None)
    outbox.send((_STOPPED, None))
    outbox.close()
    if dead.is_set():  # the engine thread may be stuck in a forward: interpreter shutdown would wait on it
        os._exit(1)
