"""EngineCore: the synchronous engine loop, in a thread of its own. A step is schedule -> execute -> process.

Other threads talk to it only through `submit`, `abort`, `wake` and `stop` (a thread-safe inbox) and read
`stats()` (a snapshot replaced after every step). Each step's deltas go out in one `emit(chunks)` call, so the
application's event loop pays one wake-up per step, not one per token. If anything in the loop raises, the core
calls `on_dead(exc)` and ends: the async face turns that into EngineDeadError for every waiter. The loop never
waits for another thread: what others finish (an admission's outcome, pages a listener held) reaches it through
the inbox. Built by `m3sdk.core.builder.build_core`.

Time bounds: a request with `SamplingParams.timeout` ends with finish_reason "timeout" once it passed (checked
between steps; the inbox wait wakes for the nearest one), its pages freed as an abort's. A watchdog thread
(`EngineConfig.step_timeout`) reports EngineDeadError naming the phase of the loop that ran past the bound (a
stuck forward hangs no waiter); the stuck thread, should it ever return, emits nothing more.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from m3sdk.cache.manager import CacheManager
from m3sdk.core.admission_checks import AdmissionChecks, prefilled_remotely
from m3sdk.core.executor import Executor
from m3sdk.core.hooks import Admission, Emit, FinishListener, OnDead, StepObserver
from m3sdk.core.output import OutputProcessor
from m3sdk.errors import EngineDeadError, PrefillNodeError
from m3sdk.observability import get_logger
from m3sdk.params import SamplingParams
from m3sdk.request import Chunk, FinishReason, Request
from m3sdk.runner import ModelRunner
from m3sdk.sampler import SamplingState
from m3sdk.scheduler import Scheduler, StepPlan
from m3sdk.structured import GrammarCompiler
from m3sdk.tokenizer import TextStream, Tokenizer

if TYPE_CHECKING:
    from m3sdk.core.resolved import ResolvedConfig
    from m3sdk.images import PromptImage
    from m3sdk.parallel import TensorParallel

log = get_logger("m3sdk.core")

_ADD, _ABORT, _STOP, _WAKE, _UNHOLD = "add", "abort", "stop", "wake", "unhold"


class EngineCore:
    def __init__(self, config: ResolvedConfig, runner: ModelRunner, scheduler: Scheduler, cache: CacheManager,
                 tokenizer: Tokenizer, executor: Executor, observers: Sequence[StepObserver] = (),
                 on_stop: Sequence[Callable[[], None]] = (), tensor_parallel: TensorParallel | None = None):
        self.config = config
        self.runner = runner
        self.scheduler = scheduler
        self.cache = cache
        self.tokenizer = tokenizer
        self.executor = executor
        self.tensor_parallel = tensor_parallel  # the worker ranks, when tensor parallel
        self.max_model_len = config.max_model_len
        self.vocab_size = runner.model.config.vocab_size
        self.images = runner.images  # image prompts (m3sdk.images), or None: this engine takes text only
        self.output = OutputProcessor(frozenset(tokenizer.eos_token_ids) | frozenset(runner.model.config.eos_token_ids),
                                      self._release)
        self._observers = list(observers)
        self._finish_listeners: list[FinishListener] = []
        self._admission: Admission | None = None
        self._on_idle: Callable[[], None] | None = None
        self._grammars: GrammarCompiler | None = None  # structured outputs' compiler: `grammars()`
        self._grammars_lock = threading.Lock()
        self._on_stop = list(on_stop)  # run in the engine thread when its loop ends, however it ends
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending: list[Chunk] = []  # abort notices, sent with the next step's deltas
        # The last step could run nothing until an admission hands requests over or a page hold ends: the loop
        # sleeps until its inbox hears of it.
        self._stalled = False
        self._num_holds = 0  # finished requests' pages retained for a listener's I/O
        # the other choices of an n-choice prompt, until its first choice's prompt is computed
        self._held_choices: list[tuple[Request, list[Request]]] = []
        # prefill_tokens: prompt tokens run through the model (prefix-cache hits are not, recomputes are again)
        self._counters = dict(steps=0, prompt_tokens=0, prefill_tokens=0, requests_timed_out=0)
        # requests with a timeout: (deadline on time.monotonic(), tie-breaker, request), nearest first
        self._deadlines: list[tuple[float, int, Request]] = []
        self._tie = itertools.count()
        # the watchdog's view of the loop: the phase it runs and since when (None while it waits for work)
        self._phase: tuple[str, float] | None = None
        self._dead_once = threading.Lock()
        self._given_up = False  # the watchdog reported this loop dead: it must emit nothing more
        self._stats: dict[str, Any] = {}
        self._publish_stats()
        self.warm_up_seconds = 0.0  # what the warm-up took (the builder runs it on a GPU)

    def grammars(self) -> GrammarCompiler:
        """The compiler of structured outputs for this engine's tokenizer (built on first use, in the caller's
        thread; thread-safe)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.output.eos_token_ids)
            return self._grammars

    def admission_checks(self) -> AdmissionChecks:
        """What new_request refuses because of the admission (prefill nodes: it is passed to `start`)."""
        return AdmissionChecks.of(self._admission is not None, self.images)

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_total_tokens: int,
                    priority: int = 0, index: int = 0, images: tuple[PromptImage, ...] = ()) -> Request:
        """A request (choice `index` of its prompt) with its seeded sampling state, its structured output's matcher
        (compiled here, in the caller's thread: InvalidRequestError if it does not compile) and incremental
        detokenizer attached."""
        checks = self.admission_checks()
        checks.check_params(params)
        grammar = None if params.structured_output is None else self.grammars().grammar(params.structured_output)
        request = Request(request_id, prompt_ids, params, max_total_tokens, priority, index=index, images=images)
        request.sampling = SamplingState.of(params, prompt_ids, self.output.eos_token_ids, grammar)
        request.text = TextStream(self.tokenizer, params, prompt_ids)
        checks.check_request(request)
        return request

    # -- any thread --------------------------------------------------------------------------------------

    def start(self, emit: Emit, on_dead: OnDead, *, finish_listeners: Sequence[FinishListener] = (),
              admission: Admission | None = None, on_idle: Callable[[], None] | None = None) -> None:
        """Start the loop. `finish_listeners` hear of every request's end; `admission` may take arriving requests
        (it is closed when the loop ends); `on_idle` is called in the engine thread whenever the loop is about to
        wait for work, its stats published (an engine process sends them: pages freed without a step that emits)."""
        if self._thread is not None:
            raise RuntimeError("an EngineCore starts once")
        self._finish_listeners += finish_listeners
        self._admission = admission
        self._on_idle = on_idle
        once = self._once(on_dead)
        self._thread = threading.Thread(target=self._run, args=(emit, once), name="m3sdk-engine", daemon=True)
        self._thread.start()
        if self.config.engine.step_timeout is not None:
            threading.Thread(target=self._watch, args=(once, self.config.engine.step_timeout),
                             name="m3sdk-watchdog", daemon=True).start()

    def submit(self, request: Request, *choices: Request) -> None:
        """Queue a request; the other `choices` of its prompt (if any) follow it once its prompt is computed, so
        that they find the prompt's pages in the prefix cache and compute only its last partial page."""
        self._inbox.put((_ADD, (request, choices)))

    def abort(self, request_id: str) -> None:
        self._inbox.put((_ABORT, request_id))

    def wake(self) -> None:
        """Make the loop look at its admission's outcomes."""
        self._inbox.put((_WAKE, None))

    def stop(self) -> None:
        """Abort whatever is live and end the loop (join the thread to wait for it)."""
        self._inbox.put((_STOP, None))

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def describe(self) -> dict[str, str]:
        """A human summary for `m3sdk info`: model, kernel backend, cache budget."""
        mc, spec = self.runner.model.config, self.cache.kv.spec
        model = self.runner.model
        # quantized weights are buffers (Fp8Linear, QuantizedMoE): count their bytes too
        weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        vision = {}
        if self.images is not None and self.images.encoder is not None:
            encoder = self.images.encoder
            encoder_bytes = sum(t.numel() * t.element_size() for t in (*encoder.parameters(), *encoder.buffers()))
            fp8 = self.config.engine.vision_encoder_quantization() != "none"
            linears = "fp8" if fp8 else str(encoder.dtype).removeprefix("torch.")
            vision = {"vision": f"{encoder.config.num_hidden_layers} layers, {encoder_bytes / 2**20:.1f} MiB, linears "
                                f"{linears}; up to {self.images.limit} images per prompt"}
        return {
            "model": str(self.config.model_path),
            "layers": f"{mc.num_layers} ({len(mc.sparse_layers)} MSA sparse, {len(mc.moe_layers)} MoE)",
            "weights": f"{weight_bytes / 2**20:.1f} MiB on {spec.device} as {spec.model_dtype}",
            "attention": f"{mc.num_heads} q / {mc.num_kv_heads} kv heads x {mc.head_dim}; MSA top-"
                         f"{mc.index_topk_blocks} of {mc.index_block_size}-token blocks",
            "experts": f"{mc.num_experts} routed (top-{mc.num_experts_per_tok}) + shared",
            "backend": self.config.attention_backend,
            "quantization": self.config.engine.quantization,
            "kv cache": f"{spec.num_pages} pages x {spec.bytes_per_page} B = "
                        f"{spec.num_pages * spec.bytes_per_page / 2**20:.1f} MiB ({spec.kv_dtype} {spec.layout}, "
                        f"index keys {spec.index_dtype}); max_model_len {self.max_model_len}",
            **vision,
        }

    # -- the engine thread -------------------------------------------------------------------------------

    def step(self) -> list[Chunk]:
        """Schedule -> execute -> process: one forward over the scheduled tokens; returns the deltas of the
        requests whose tokens the host read in it (with overlapped or speculative steps, those of the step
        before)."""
        ex = self.executor
        self._enter("settle the step in flight")
        chunks = self.output.process(ex.settle())
        self._add_held_choices()
        self._enter("schedule")
        plan = ex.schedule()
        if plan.preempted and self.images is not None and not self.images.encodes:
            self._fail_recomputes(plan.preempted)
        if plan:
            self._counters["steps"] += 1
            self._counters["prefill_tokens"] += sum(max(0, min(n, r.num_prompt_tokens - r.num_computed_tokens))
                                                    for r, n, _ in plan.scheduled)
            self._enter("launch the forward")
            ex.launch(plan, self._layer_hook(plan))
        elif not ex.busy and not chunks:
            return self._nothing_scheduled(plan)
        self._enter("collect the sampled tokens")
        # the text of the tokens read before (while the device runs the step just launched) goes out first: a token
        # read now may end its request, whose last chunk must follow them
        chunks += self.output.flush()
        chunks += self.output.process(ex.collect())
        self._enter("commit and detokenize")
        ex.commit()
        # the text of tokens that cannot end their request, while the device runs the step just launched
        return chunks + self.output.flush()

    def _enter(self, phase: str) -> None:
        self._phase = (phase, time.monotonic())

    def _once(self, on_dead: OnDead) -> OnDead:
        """`on_dead` for the loop and the watchdog: whichever reports first is the one the waiters get."""
        def report(exc: BaseException) -> None:
            if self._dead_once.acquire(blocking=False):
                on_dead(exc)
        return report

    def _watch(self, on_dead: OnDead, bound: float) -> None:
        """The watchdog thread: report the loop dead when one phase of it ran past `bound` seconds."""
        while self._thread is not None and self._thread.is_alive():
            time.sleep(min(bound / 4, 1.0))
            phase = self._phase
            if phase is not None and time.monotonic() - phase[1] > bound:
                self._given_up = True
                log.warning("engine step stuck: the engine is reported dead", phase=phase[0], bound_s=bound)
                on_dead(EngineDeadError(f"the engine loop spent over {bound:g} s in one phase ({phase[0]}; "
                                        "EngineConfig.step_timeout)"))
                return

    def _expire(self) -> None:
        """End the requests whose timeout passed (their chunks go out with the next emit)."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request = heapq.heappop(self._deadlines)
            if not request.is_finished and (self._live(request.request_id)
                                            or self._take_held(request.request_id)) is request:
                self._counters["requests_timed_out"] += 1
                self._pending.append(self.output.finish(request, "timeout"))

    def reset_stats(self) -> None:
        """Step, token, request, graph and speculation counters from zero (after the warm-up)."""
        self._counters = dict.fromkeys(self._counters, 0)
        self.output.counters = dict.fromkeys(self.output.counters, 0)
        if self.runner.graphs is not None:
            self.runner.graphs.replays = 0  # stats()["graph_steps"] counts from zero with "steps"
        self.executor.reset()
        self._publish_stats()

    def _layer_hook(self, plan: StepPlan) -> Callable[[int], None] | None:
        hooks = [h for h in (o.on_step(plan) for o in self._observers) if h is not None]
        if len(hooks) <= 1:
            return hooks[0] if hooks else None

        def every(layer: int) -> None:
            for hook in hooks:
                hook(layer)

        return every

    def _nothing_scheduled(self, plan: StepPlan) -> list[Chunk]:
        if plan.preempted or not (self.scheduler.num_running or self.scheduler.num_waiting):
            return []
        if self._num_holds or (self._admission is not None and self._admission.live_requests()):
            # the waiting requests need pages held by requests an admission took, or by a listener's I/O: wait
            # for its handovers or for the hold to end
            self._stalled = True
            return []
        raise RuntimeError("the scheduler scheduled nothing although requests are waiting")

    def _run(self, emit: Emit, on_dead: OnDead) -> None:
        try:
            while self._handle_inbox():
                self._enter("hand over admitted requests")
                if self._deadlines:
                    self._expire()
                if handed := self._handovers():
                    # their first tokens go out before this engine's next step, which would hold them a whole step
                    self._publish_stats()
                    emit(handed)
                chunks = self.step()
                if self._pending:
                    chunks, self._pending = self._pending + chunks, []
                if self._given_up:  # the watchdog told every waiter already
                    return
                # stats first: a waiter woken by its last chunk then reads its pages as freed
                self._publish_stats()
                if chunks:
                    self._enter("emit")
                    emit(chunks)
                self._phase = None
            self._publish_stats()
            if self._pending:
                emit(self._pending)
        except BaseException as e:  # noqa: BLE001 - any failure must reach the waiters, never hang them
            on_dead(e)
            log.exception("engine thread died")
        finally:
            if self._admission is not None:
                self._admission.close()
            for fn in self._on_stop:
                fn()

    def _handle_inbox(self) -> bool:
        """Apply queued adds and aborts; blocks while there is nothing to run. False once told to stop."""
        block = self._stalled or not (self.scheduler.num_running or self.scheduler.num_waiting or self.executor.busy
                                      or self._held_choices)
        if block and self._on_idle is not None:
            self._on_idle()
        while True:
            # waiting for work: wake for the nearest deadline (a stalled request may pass its timeout meanwhile)
            wait = max(0.0, self._deadlines[0][0] - time.monotonic()) if block and self._deadlines else None
            try:
                kind, item = self._inbox.get(block=block, timeout=wait)
            except queue.Empty:
                return True
            block = self._stalled = False
            if kind == _ADD:
                request, choices = item
                for r in (request, *choices):
                    if r.params.timeout is not None:
                        heapq.heappush(self._deadlines, (r.arrival_time + r.params.timeout, next(self._tie), r))
                self._add(request)
                if choices and self.config.engine.enable_prefix_caching:
                    self._held_choices.append((request, list(choices)))
                else:
                    for choice in choices:
                        self._add(choice)
            elif kind == _ABORT:
                request = self._live(item) or self._take_held(item)
                if request is not None:  # unknown or finished: a no-op
                    self._pending.append(self.output.finish(request, "abort"))
            elif kind == _UNHOLD:  # a finish listener's I/O let go of a finished request's pages
                self._num_holds -= 1
                self.cache.release_pages(item)
            elif kind == _WAKE:  # an admission has outcomes: the loop collects them
                pass
            else:
                live = self.scheduler.live_requests()
                if self._admission is not None:
                    live += self._admission.live_requests()
                live += [c for _, choices in self._held_choices for c in choices]
                self._held_choices.clear()
                for request in live:
                    self._pending.append(self.output.finish(request, "abort"))
                return False

    def _add(self, request: Request) -> None:
        self._counters["prompt_tokens"] += request.num_prompt_tokens
        if self._admission is None or not prefilled_remotely(request) or not self._admission.admit(request):
            self.scheduler.add(request)

    def _fail_recomputes(self, preempted: list[Request]) -> None:
        """Preempted image requests of an engine without a vision encoder end with an error: recomputing their
        prompt here would compute image tokens (their chunks go out with this step's)."""
        for request in preempted:
            if request.images:
                self._pending.append(self.output.finish(request, "abort", error=PrefillNodeError(
                    "the request was preempted for KV pages, and recomputing its image tokens needs a vision encoder, "
                    "which this engine leaves to its prefill nodes (prefill_fallback 'error')")))

    def _add_held_choices(self) -> None:
        """The choices whose first choice's prompt is computed (its pages committed to the prefix cache), or which
        ended, go to the scheduler."""
        if not self._held_choices:
            return
        held = []
        for first, choices in self._held_choices:
            if first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens:
                for choice in choices:
                    self._add(choice)
            else:
                held.append((first, choices))
        self._held_choices = held

    def _take_held(self, request_id: str) -> Request | None:
        for _, choices in self._held_choices:
            for choice in choices:
                if choice.request_id == request_id:
                    choices.remove(choice)
                    return choice
        return None

    def _live(self, request_id: str) -> Request | None:
        request = self.scheduler.get(request_id)
        if request is None and self._admission is not None:
            request = self._admission.get(request_id)
        return request

    def _release(self, request: Request, reason: FinishReason) -> None:
        """What a finished request holds goes: listeners first (a hold keeps its pages out of use until it
        completes), then its owner's state and pages, then the executor's state of it."""
        for listener in self._finish_listeners:
            hold = listener(request, reason)
            if hold is not None:
                pages = self.cache.retain(request)
                self._num_holds += 1
                hold.add_done_callback(lambda _, pages=pages: self._inbox.put((_UNHOLD, pages)))
        if self.scheduler.get(request.request_id) is request:
            self.scheduler.finish(request, reason)
        elif self._admission is not None and self._admission.get(request.request_id) is request:
            self._admission.drop(request, reason)
        self.executor.release(request)

    def _handovers(self) -> list[Chunk]:
        """Requests an admission hands over: they sample on from their first token, are prefilled here, or fail
        with their error."""
        if self._admission is None:
            return []
        emitted, chunks = [], []
        for h in self._admission.handovers():
            self.scheduler.add(h.request)  # it holds its pages: the scheduler runs it from num_computed_tokens
            if h.error is not None:
                chunks.append(self.output.finish(h.request, "abort", error=h.error))
            elif h.first_token is not None:
                emitted.append((h.request, [h.first_token], None))
        return chunks + self.output.process(emitted) + self.output.flush()

    def _publish_stats(self) -> None:
        self._stats = {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "preemptions": self.scheduler.num_preemptions,
            **self.cache.stats(),
            **self._counters,
            **self.output.counters,
            # steps replayed from CUDA graphs (0: every step ran eagerly, e.g. no GPU or graphs off)
            "graph_steps": self.runner.graphs.replays if self.runner.graphs is not None else 0,
            **self.executor.stats(),
            **(self._admission.stats() if self._admission is not None else {}),
        }

