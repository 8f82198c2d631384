"""EngineCore: the synchronous engine loop, in a thread of its own: schedule -> run -> sample -> update -> emit.

Other threads talk to it only through `submit`, `abort` and `stop` (a thread-safe inbox) and read `stats()`
(a snapshot replaced after every step). Each step's deltas go out in one `emit(chunks)` call, so the
application's event loop pays one wake-up per step, not one per token. If anything in the loop raises, the
core calls `on_dead(exc)` and ends: the async face turns that into EngineDeadError for every waiter.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from m3sdk.cache import CACHE_MANAGERS
from m3sdk.cache.kv_pool import KVCacheSpec
from m3sdk.cache.manager import CacheManager, cache_budget_bytes, num_pages_for_budget
from m3sdk.cache.page_pool import PAGE_SIZE, pages_for
from m3sdk.config import EngineConfig
from m3sdk.errors import InvalidRequestError, PrefillNodeError
from m3sdk.graphs import DecodeGraphs
from m3sdk.model.loader import load_model
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM
from m3sdk.observability import get_logger
from m3sdk.params import SamplingParams
from m3sdk.request import Chunk, FinishReason, Request
from m3sdk.runner import PLACEHOLDER, Carry, ModelRunner
from m3sdk.sampler import PendingSample, SampledToken, Sampler, SamplingState
from m3sdk.scheduler import SCHEDULERS, Scheduler, StepPlan
from m3sdk.speculative.base import SpeculativeDecoder, TargetInfo, build_drafter
from m3sdk.speculative.decoding import Launched, Speculation
from m3sdk.structured import GrammarCompiler
from m3sdk.tokenizer import TextStream, Tokenizer
from m3sdk_kernels.arch import fp8_dtype

if TYPE_CHECKING:
    from m3sdk.parallel import TensorParallel

log = get_logger("m3sdk.core")

Emit = Callable[[list[Chunk]], None]
OnDead = Callable[[BaseException], None]

_ADD, _ABORT, _STOP, _WAKE = "add", "abort", "stop", "wake"

# Concurrent prompts per warm-up wave: Triton specializes integer arguments (batch, token count) on divisibility by
# 16, and the attention split counts follow the batch (one prompt's 16-token tail at a 512 context splits its keys
# 2 ways on a dense layer and 16 on a sparse one on sm90; sixteen prompts' do not split), so 1, 3 and 16 differ.
WARM_UP_BATCHES = (1, 3, 16)


@dataclasses.dataclass
class _InFlight:
    """An overlapped step launched on the device whose sampled tokens the host has not read yet: `rows` sample,
    `slots[i]` is where row i's token stands as a PLACEHOLDER in its `token_ids`."""

    plan: StepPlan
    rows: list[Request]
    slots: list[int]
    sample: PendingSample | None

    def carry(self) -> Carry | None:
        if self.sample is None:
            return None
        return Carry(self.sample.tokens, {id(r): i for i, r in enumerate(self.rows)})


def _lag_safe(request: Request) -> bool:
    """Its next draw does not read its own last token on the host (penalties count it, a seed counts tokens)."""
    return request.params.seed is None and not request.params.has_penalties


class EngineCore:
    def __init__(self, config: EngineConfig, runner: ModelRunner, scheduler: Scheduler, cache: CacheManager,
                 tokenizer: Tokenizer, max_model_len: int, drafter: SpeculativeDecoder | None = None):
        self.config = config
        self.runner = runner
        self.scheduler = scheduler
        self.cache = cache
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = runner.model.config.vocab_size
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(runner.model.config.eos_token_ids)
        self.sampler = Sampler()
        self._grammars: GrammarCompiler | None = None  # structured outputs' compiler: `grammars()`
        self._grammars_lock = threading.Lock()
        self.spec = Speculation(drafter, cache, self.sampler) if drafter is not None else None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending: list[Chunk] = []  # abort notices, sent with the next step's deltas
        # The last step could run nothing until a remote prefill ends: the loop sleeps until its inbox wake.
        self._stalled = False
        # Overlapped steps (EngineConfig.overlap_scheduling): the step on the device whose tokens are not yet read.
        self.overlap = config.resolve_overlap(runner.device)
        self._inflight: _InFlight | None = None
        # With speculation: the verify step launched on the device whose results the host has not read yet.
        self._verifying: Launched | None = None
        # Called in the engine thread when a request finishes, before its pages are freed.
        self.finish_hooks: list[Callable[[Request, FinishReason], None]] = []
        # Called in the engine thread when its loop ends, however it ends (e.g. stopping tensor-parallel workers).
        self.stop_hooks: list[Callable[[], None]] = []
        self.remote = None  # RemotePrefill (m3sdk/disagg/remote.py) when config.prefill_nodes is set
        self._counters = dict(steps=0, prompt_tokens=0, generation_tokens=0, requests_finished=0,
                              requests_aborted=0)
        self._stats: dict[str, int] = {}
        self._publish_stats()
        self.warm_up_seconds = 0.0  # what warm_up() took (build runs it on a GPU)

    @classmethod
    def build(cls, config: EngineConfig) -> EngineCore:
        """Load the model and tokenizer, size the KV cache from the memory left, wire the components."""
        device = config.resolve_device()
        dtype = config.resolve_dtype(device)
        path = config.model_path()
        tp = None
        if config.tensor_parallel_size > 1:  # ranks 1.. run in worker processes that mirror every forward
            from m3sdk.parallel import TensorParallel

            if config.speculative is not None and config.speculative.method != "ngram":
                raise ValueError("tensor_parallel_size > 1 supports speculative='ngram' only (drafters read the "
                                 "target's weights, which are sharded)")
            if config.quantization != "none":
                raise ValueError("tensor_parallel_size > 1 does not support quantization yet (ranks load bf16 "
                                 "shards)")
            tp = TensorParallel.launch(path, config.tensor_parallel_size, device, dtype,
                                       config.resolve_attention_backend(device), config.expert_parallel)
            model = tp.model
        else:
            model = load_model(path, device, dtype, config.resolve_attention_backend(device),
                               quantization=config.quantization, progress=config.show_progress)
        try:
            return cls._assemble(config, device, dtype, path, model, tp)
        except BaseException:
            if tp is not None:  # else the workers outlive the error and the process group blocks the next engine
                tp.shutdown()
            raise

    @classmethod
    def _assemble(cls, config: EngineConfig, device: torch.device, dtype: torch.dtype, path: Path,
                  model: MiniMaxM3ForCausalLM, tp: TensorParallel | None) -> EngineCore:
        """`build` once the model is loaded: cache, scheduler, drafter, graphs, the core and its warm-up."""
        tokenizer = Tokenizer.from_pretrained(path)
        mc = model.config
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {mc.max_position_embeddings}")
        max_model_len = config.max_model_len or mc.max_position_embeddings
        kv_dtype, index_dtype = config.resolve_cache_dtypes(dtype)
        spec = KVCacheSpec.for_model(mc, 1, kv_dtype=kv_dtype, layout=config.resolve_kv_layout(device),
                                     index_dtype=index_dtype, fp8_dtype=fp8_dtype(device), model_dtype=dtype,
                                     device=device)
        budget = cache_budget_bytes(config.kv_cache_memory, config.gpu_memory_fraction, device)
        # one spare page per sequence: a sequence's pages round up
        useful = config.max_num_seqs * (pages_for(max_model_len) + 1)
        num_pages = num_pages_for_budget(spec.bytes_per_page, budget, useful)
        if num_pages < pages_for(max_model_len):
            if config.max_model_len is not None or num_pages < 1:
                raise ValueError(f"the KV cache budget ({budget} bytes, {num_pages} pages of "
                                 f"{spec.bytes_per_page} bytes) cannot hold one sequence of max_model_len "
                                 f"{max_model_len}: raise kv_cache_memory or lower max_model_len")
            max_model_len = num_pages * PAGE_SIZE
            log.warning("max_model_len lowered to fit the KV cache", max_model_len=max_model_len)
        cache = CACHE_MANAGERS.get(config.cache_manager)(
            dataclasses.replace(spec, num_pages=num_pages), config.enable_prefix_caching)
        factory = config.scheduler
        if isinstance(factory, str):
            factory = SCHEDULERS.get(factory)
        scheduler = factory(cache, config)
        log.info("engine built", model=str(path), device=str(device), dtype=str(dtype), pages=num_pages,
                 max_model_len=max_model_len)
        drafter = None
        if config.speculative is not None:
            drafter = build_drafter(config.speculative, TargetInfo(
                config=mc, embed_tokens=model.embed_tokens, lm_head=model.lm_head, checkpoint=str(path),
                device=device, dtype=dtype, model=model, kv_spec=cache.kv.spec, num_cache_pages=num_pages,
                max_num_seqs=config.max_num_seqs, max_model_len=max_model_len))
        runner = ModelRunner(model, cache, device, mirror=tp)
        if config.resolve_cuda_graphs(device) and DecodeGraphs.supported(model):
            # With a drafter: decode (1 token) and verify (1 + k tokens) steps, returning the aux states the drafter
            # reads; the drafter's own steps too. Under tensor parallel the workers capture and replay the same
            # graphs in lockstep (parallel/graphs.py).
            k = drafter.num_speculative_tokens if drafter is not None else 0
            if tp is None:
                graphs = DecodeGraphs
            else:
                from m3sdk.parallel import MirroredGraphs

                graphs = functools.partial(MirroredGraphs, tp)
            runner.graphs = graphs(model, cache.kv, config.max_num_seqs, max_model_len, device,
                                   query_lens=(1, 1 + k), aux_layers=drafter.aux_layers if drafter else ())
            if hasattr(drafter, "capture_graphs"):
                drafter.capture_graphs(config.max_num_seqs)
        core = cls(config, runner, scheduler, cache, tokenizer, max_model_len, drafter)
        if tp is not None:
            core.stop_hooks.append(tp.shutdown)
        if device.type == "cuda":
            core.warm_up()
        return core

    def grammars(self) -> GrammarCompiler:
        """The compiler of structured outputs for this engine's tokenizer (built on first use, in the caller's
        thread; thread-safe)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammars

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_total_tokens: int,
                    priority: int = 0) -> Request:
        """A request with its seeded sampling state, its structured output's matcher (compiled here, in the
        caller's thread: InvalidRequestError if it does not compile) and incremental detokenizer attached."""
        grammar = None
        if params.structured_output is not None:
            if self.config.prefill_nodes:
                raise InvalidRequestError("structured_output is not supported with prefill_nodes (a prefill node "
                                          "samples the first token unconstrained)")
            grammar = self.grammars().grammar(params.structured_output)
        request = Request(request_id, prompt_ids, params, max_total_tokens, priority)
        request.sampling = SamplingState(params, prompt_ids, grammar=grammar)
        request.text = TextStream(self.tokenizer, params, prompt_ids)
        return request

    def warm_up(self, prompt_len: int = 512, batches: Sequence[int] = WARM_UP_BATCHES) -> None:
        """Serve a few synthetic requests through the real step loop before the engine thread starts, so that the
        first users do not pay one-time costs. On a GPU, Triton compiles a kernel variant the first time a shape
        class is launched (attention and indexer split counts and integer specializations follow the batch, the
        query length and the context: a prompt whose prefix is cached prefills a 16-token tail at a 512 context, a
        different variant from its first, whole prefill; the first H200 run stalled 1.7-2.6 s on exactly that),
        cuBLAS picks algorithms per shape and the pinned host pool fills. Waves of 1, 3 and 16 concurrent prompts
        (as max_num_seqs and the cache allow), each twice: whole prompts, then the same prompts as prefix-cache
        hits, each decoding a few tokens in this engine's mode (overlapped or not). Triton keeps what it compiled
        in its disk cache, so a later start on the same machine pays milliseconds here. The step, graph and
        speculation counters start from zero afterwards; the cache keeps the warm-up's pages as idle cached pages
        (free to take)."""
        t0 = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        length = min(prompt_len, self.max_model_len - params.max_tokens) // PAGE_SIZE * PAGE_SIZE
        vocab = min(self.vocab_size, self.tokenizer.vocab_size)
        rng = random.Random(0)
        for b in sorted({min(b, self.config.max_num_seqs) for b in batches}):
            if length < PAGE_SIZE or b * (pages_for(length + params.max_tokens) + 1) > self.cache.num_free_pages():
                continue
            prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(b)]
            for again in range(2):
                requests = []
                for i, prompt in enumerate(prompts):
                    request = self.new_request(f"m3sdk-warm-up-{b}-{again}-{i}", prompt, params,
                                               length + params.max_tokens)
                    self.scheduler.add(request)
                    requests.append(request)
                while self._inflight or self._verifying or not all(r.is_finished for r in requests):
                    self.step()
        self._counters = dict.fromkeys(self._counters, 0)
        if self.runner.graphs is not None:
            self.runner.graphs.replays = 0  # stats()["graph_steps"] counts from zero with "steps"
        if self.spec is not None:  # its acceptance counters too (random prompts draft badly); no draft is held now
            self.spec = Speculation(self.spec.drafter, self.cache, self.sampler)
        self._publish_stats()
        self.warm_up_seconds = time.perf_counter() - t0
        log.info("engine warmed up", seconds=round(self.warm_up_seconds, 2), prompt_len=length)

    # -- any thread --------------------------------------------------------------------------------------

    def start(self, emit: Emit, on_dead: OnDead) -> None:
        if self.config.prefill_nodes and self.remote is None:
            from m3sdk.disagg.remote import RemotePrefill  # the optional `ucx` extra

            self.remote = RemotePrefill.from_config(self.config, self.cache, self.vocab_size, self._wake)
            self.scheduler.remote = self.remote
            self.finish_hooks.append(self.remote.on_finish)
        self._thread = threading.Thread(target=self._run, args=(emit, on_dead), name="m3sdk-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> None:
        self._inbox.put((_ADD, request))

    def abort(self, request_id: str) -> None:
        self._inbox.put((_ABORT, request_id))

    def _wake(self) -> None:
        self._inbox.put((_WAKE, None))

    def stop(self) -> None:
        """Abort whatever is live and end the loop (join the thread to wait for it)."""
        self._inbox.put((_STOP, None))

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def describe(self) -> dict[str, str]:
        """A human summary for `m3sdk info`: model, kernel backend, cache budget."""
        mc, spec = self.runner.model.config, self.cache.kv.spec
        model = self.runner.model
        # quantized weights are buffers (Fp8Linear, QuantizedMoE): count their bytes too
        weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        return {
            "model": str(self.config.model_path()),
            "layers": f"{mc.num_layers} ({len(mc.sparse_layers)} MSA sparse, {len(mc.moe_layers)} MoE)",
            "weights": f"{weight_bytes / 2**20:.1f} MiB on {spec.device} as {spec.model_dtype}",
            "attention": f"{mc.num_heads} q / {mc.num_kv_heads} kv heads x {mc.head_dim}; MSA top-"
                         f"{mc.index_topk_blocks} of {mc.index_block_size}-token blocks",
            "experts": f"{mc.num_experts} routed (top-{mc.num_experts_per_tok}) + shared",
            "backend": self.config.resolve_attention_backend(self.runner.device),
            "quantization": self.config.quantization,
            "kv cache": f"{spec.num_pages} pages x {spec.bytes_per_page} B = "
                        f"{spec.num_pages * spec.bytes_per_page / 2**20:.1f} MiB ({spec.kv_dtype} {spec.layout}, "
                        f"index keys {spec.index_dtype}); max_model_len {self.max_model_len}",
        }

    # -- the engine thread -------------------------------------------------------------------------------

    def _run(self, emit: Emit, on_dead: OnDead) -> None:
        try:
            while self._handle_inbox():
                if remote := self._remote_outcomes():
                    # a prefill node's first tokens go out before this engine's next step, which would hold them
                    # for a whole decode step (its launch, eager: 7 ms on a CPU; docs/perf.md, session 16)
                    self._publish_stats()
                    emit(remote)
                chunks = self.step()
                if self._pending:
                    chunks, self._pending = self._pending + chunks, []
                # stats first: a waiter woken by its last chunk then reads its pages as freed
                self._publish_stats()
                if chunks:
                    emit(chunks)
            self._publish_stats()
            if self._pending:
                emit(self._pending)
            if self.remote is not None:
                self.remote.close()
        except BaseException as e:  # noqa: BLE001 - any failure must reach the waiters, never hang them
            on_dead(e)
            log.exception("engine thread died")
        finally:
            for hook in self.stop_hooks:
                hook()

    def _handle_inbox(self) -> bool:
        """Apply queued adds and aborts; blocks while there is nothing to run. False once told to stop."""
        block = self._stalled or not (self.scheduler.num_running or self.scheduler.num_waiting or self._inflight
                                      or self._verifying)
        while True:
            try:
                kind, item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = self._stalled = False
            if kind == _ADD:
                self.scheduler.add(item)
                self._counters["prompt_tokens"] += item.num_prompt_tokens
            elif kind == _ABORT:
                request = self.scheduler.get(item)
                if request is not None:  # unknown or finished: a no-op
                    self._pending.append(self._finish(request, "abort", "", []))
            elif kind == _WAKE:  # a remote prefill ended: the loop collects it
                pass
            else:
                for request in self.scheduler.live_requests():
                    self._pending.append(self._finish(request, "abort", "", []))
                return False

    def step(self) -> list[Chunk]:
        """One forward over the scheduled tokens; returns the deltas of the requests that sampled (with overlapped
        steps, those of the step before, whose tokens the host reads now)."""
        if self.overlap:
            return self._step_overlapped()
        if self._inflight is not None:  # overlap was switched off while a step was in flight: read it first
            step, self._inflight = self._inflight, None
            return self._resolve(step)
        if self.spec is not None:
            return self._step_speculative()
        plan = self.scheduler.schedule()
        if not plan:
            return self._nothing_scheduled(plan)
        self._counters["steps"] += 1
        rows = [s.request for s in plan.scheduled if s.samples]
        logits = self.runner.run(plan)
        sampled = self.sampler.sample(logits, [r.sampling for r in rows]) if rows else []
        self.scheduler.update(plan)
        return [self._accept(request, token) for request, token in zip(rows, sampled, strict=True)]

    def _step_speculative(self) -> list[Chunk]:
        """Finish the verify step the call before launched (verify waits for its forward; its tokens are accepted,
        which decides who finished), then propose, schedule and launch the next one and return the finished
        step's deltas: the engine loop emits them and reads its inbox while the device runs the new step (and
        the event loop's work on them overlaps it). Tokens that cannot end their request are detokenized after the
        launch too. A request aborted meanwhile is skipped when its step is read."""
        chunks, later = [], []
        if self._verifying is not None:
            step, self._verifying = self._verifying, None
            emitted = self.spec.finish(step)
            self.scheduler.update(step.plan)
            self.spec.finish_step()
            for request, tokens in emitted:
                if self._text_only(request, tokens):  # recorded now (the next step is scheduled from them)
                    for token in tokens:
                        self._record(request, token)
                    later.append((request, tokens))
                else:
                    chunks.append(self._accept_all(request, tokens))
        self.spec.propose(self.scheduler.live_requests())
        plan = self.scheduler.schedule()
        self.spec.scheduled(plan)
        if plan:
            self._counters["steps"] += 1
            self._verifying = self.spec.launch(plan, self.runner)
        elif not (chunks or later):
            return self._nothing_scheduled(plan)
        # their text while the device runs the step just launched
        return chunks + [self._text_chunk(request, tokens) for request, tokens in later]

    def _text_only(self, request: Request, tokens: list[SampledToken]) -> bool:
        """Whether these tokens leave nothing but their text to work out: none can end the request (no stop string
        to match, no eos or stop token, short of max_tokens), so their chunk can be built after the next launch."""
        return (not request.params.stop and request.sampling.grammar is None
                and request.num_tokens + len(tokens) < request.max_total_tokens
                and not any(self._is_stop_token(request, t.token_id) for t in tokens))

    def _is_stop_token(self, request: Request, token_id: int) -> bool:
        """Whether this token ends the request by itself (eos unless ignored, or one of its stop tokens)."""
        params = request.params
        return (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids

    def _text_chunk(self, request: Request, tokens: list[SampledToken]) -> Chunk:
        """The chunk of recorded tokens that `_text_only` said cannot end the request."""
        text = "".join(request.text.push(t.token_id)[0] for t in tokens)
        logprobs = list(tokens) if request.params.logprobs is not None else None
        return Chunk(request.request_id, text, [t.token_id for t in tokens], None, logprobs)

    def _nothing_scheduled(self, plan: StepPlan) -> list[Chunk]:
        if plan.preempted or not (self.scheduler.num_running or self.scheduler.num_waiting):
            return []
        if self.remote is not None and self.scheduler.remote_pending:
            # the waiting requests need pages or max_num_seqs slots held by requests on prefill nodes
            self._stalled = True
            return []
        raise RuntimeError("the scheduler scheduled nothing although requests are waiting")

    def _step_overlapped(self) -> list[Chunk]:
        """Schedule and launch step N+1 while step N may still run on the device, then read N's tokens.

        N's sampled tokens stand as PLACEHOLDERs in `token_ids` (so the scheduler gives each such request its
        decode token) and reach N+1's input ids on the device (the runner's Carry). The host then waits for N's
        tokens only (not for N+1), accepts them (detokenize, stop checks, finish), and only then runs
        `Scheduler.update` for N+1, so the pages it commits to the prefix cache hash real tokens. A request that
        finished at N was scheduled in N+1 too: that token is dropped (its pages are freed at once; N+1's late
        writes into them come before any later step's on the same stream). When N+1 samples a row with a
        structured output, its bitmask needs N's token on the host: N is read after N+1's forward is queued and
        before N+1's sampling (the mask is filled while that forward runs)."""
        prev, self._inflight = self._inflight, None
        chunks: list[Chunk] = []
        if prev is not None and not all(_lag_safe(r) for r in prev.rows):
            chunks, prev = self._resolve(prev), None  # their next draw reads the host's tokens: settle them first
        plan = self.scheduler.schedule()
        if plan:
            self._counters["steps"] += 1
            rows = [s.request for s in plan.scheduled if s.samples]
            logits = self.runner.run(plan, prev.carry() if prev is not None else None)
            slots = []
            for request in rows:
                request.token_ids.append(PLACEHOLDER)
                slots.append(request.num_tokens - 1)
            if prev is not None and any(r.sampling.grammar is not None for r in rows):
                chunks, prev = chunks + self._resolve(prev), None
            sample = self.sampler.launch(logits, [r.sampling for r in rows]) if rows else None
            self._inflight = _InFlight(plan, rows, slots, sample)
        elif prev is None:
            return chunks + self._nothing_scheduled(plan)
        if prev is not None:
            chunks += self._resolve(prev)
        if self._inflight is not None:
            self.scheduler.update(self._inflight.plan)
        return chunks

    def _resolve(self, step: _InFlight) -> list[Chunk]:
        """Read an overlapped step's tokens and accept them; requests finished since it launched drop theirs."""
        if step.sample is None:
            return []
        tokens = step.sample.resolve()
        return [self._accept(request, token, at) for request, at, token in zip(step.rows, step.slots, tokens,
                                                                                strict=True)
                if not request.is_finished]

    def _accept_all(self, request: Request, tokens: list[SampledToken]) -> Chunk:
        """The tokens a verify step emitted, in order, until the request finishes, as one chunk (the stream would
        merge them anyway; one chunk each cost the event loop a queue operation and a merge per token)."""
        chunk = self._accept(request, tokens[0])
        for token in tokens[1:]:
            if request.is_finished:
                break
            chunk = chunk.then(self._accept(request, token))
        return chunk

    def _accept(self, request: Request, token: SampledToken, at: int | None = None) -> Chunk:
        """Append a sampled token (or put it at `at`, its PLACEHOLDER); detokenize; decide whether the request is
        done."""
        tid = token.token_id
        self._record(request, token, at)
        params = request.params
        logprobs = [token] if params.logprobs is not None else None
        reason: FinishReason | None = None
        text = ""
        if self._is_stop_token(request, tid):
            reason = "stop"  # stop tokens are not text
        else:
            text, stopped = request.text.push(tid)
            if stopped is not None:
                reason = "stop"
        if reason is None and request.sampling.grammar is not None and request.sampling.grammar.terminated:
            reason = "stop"  # the structured output is complete (it accepted a stop token that eos rules ignore)
        if reason is None and (request.num_tokens if at is None else at + 1) >= request.max_total_tokens:
            reason = "length"
        if reason is None:
            return Chunk(request.request_id, text, [tid], None, logprobs)
        return self._finish(request, reason, text + request.text.finish(), [tid], logprobs)

    def _record(self, request: Request, token: SampledToken, at: int | None = None) -> None:
        """Append a sampled token (or put it at `at`, its PLACEHOLDER) and count it."""
        request.append_token(token.token_id, at)
        self._counters["generation_tokens"] += 1
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()

    def _finish(self, request: Request, reason: FinishReason, text: str, token_ids: list[int],
                logprobs: list[SampledToken] | None = None, error: Exception | None = None) -> Chunk:
        while request.token_ids[-1] == PLACEHOLDER:  # the token of a step still in flight: dropped
            request.token_ids.pop()
        for hook in self.finish_hooks:
            hook(request, reason)
        self.scheduler.finish(request, reason)
        if self.spec is not None:
            self.spec.release(request)
        self._counters["requests_aborted" if reason == "abort" else "requests_finished"] += 1
        return Chunk(request.request_id, text, token_ids, reason, logprobs, request.usage(), request.timings(),
                     error)

    def _remote_outcomes(self) -> list[Chunk]:
        """Requests whose remote prefill ended: they sample on from the node's first token, or are prefilled
        here (fallback "local"), or fail with PrefillNodeError (fallback "error")."""
        if self.remote is None:
            return []
        chunks = []
        for request, outcome in self.remote.poll():
            if request.is_finished:
                continue
            if isinstance(outcome, BaseException):
                if self.remote.fallback == "local":
                    self.scheduler.resume_remote(request, computed=False)
                else:
                    error = PrefillNodeError(f"remote prefill failed and prefill_fallback is 'error': {outcome}")
                    chunks.append(self._finish(request, "abort", "", [], error=error))
            else:
                self.scheduler.resume_remote(request, computed=True)
                token = SampledToken(outcome.first_token, outcome.first_logprob, outcome.top_logprobs)
                chunks.append(self._accept(request, token))
        return chunks

    def _publish_stats(self) -> None:
        self._stats = {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "preemptions": self.scheduler.num_preemptions,
            **self.cache.stats(),
            **self._counters,
            # steps replayed from CUDA graphs (0: every step ran eagerly, e.g. no GPU or graphs off)
            "graph_steps": self.runner.graphs.replays if self.runner.graphs is not None else 0,
            **(self.spec.stats() if self.spec is not None else {}),
        }

