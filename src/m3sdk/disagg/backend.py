"""The prefill node's backend: an engine core of its own computes each prompt as a one-token request, and its pages
leave a group of layers at a time while the following layers still compute.

The backend is a step observer of its core (m3sdk/core/hooks.py). When a step's plan holds the step that
completes one of our prompts (the step samples it), the observer asks for the layer hook, which runs after the
attention of each layer (attention writes the layer's K, V, scales and index keys first): after the last layer of
each group of layers it packs that group's pages of the prompt into the transfer's outbox, and the push sends them
while that layer's MLP and the next layers run (the last group's while the last MLP, the head and the sampling
run). Pages that line up with the decode side's runs (a plan of pieces) are sent straight from the pool (an
in-place outbox: no copy), so its finish listener holds the request's pages until its sends let go of them (the
engine thread does not wait: the hold completes from another thread); otherwise packing copies, and the core may
free and reuse the pages at once. The first token comes with the step's chunk, after every message was packed.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from m3sdk.config import EngineConfig
from m3sdk.core import build_core
from m3sdk.core.hooks import LayerHook
from m3sdk.disagg import wire
from m3sdk.disagg.compat import CompatInfo, model_fingerprint
from m3sdk.disagg.messages import PrefillOrder
from m3sdk.disagg.outbox import Outbox
from m3sdk.disagg.server import FirstToken
from m3sdk.errors import InvalidRequestError
from m3sdk.observability import get_logger
from m3sdk.request import Chunk, FinishReason, Request
from m3sdk.scheduler.base import StepPlan

log = get_logger("m3sdk.disagg.backend")


@dataclass
class _Job:
    order: PrefillOrder
    outbox: Outbox
    done: asyncio.Future[FirstToken]
    groups: dict[int, list[wire.MessageSpec]]  # last layer of a group of layers -> the group's messages
    src: torch.Tensor | None = None  # the source pages, known in the step that completes the prompt
    packed: int = field(default=0)


class EngineBackend:
    holds_pages = True  # _on_finish: a finishing prompt's pages stay until its in-place sends let go of them
    # seconds a finished prompt's pages wait for them (the last group's messages, a few ms on a CPU); then the push's
    # endpoint is dropped so that UCX lets go, and the pages are freed
    release_timeout = 5.0

    def __init__(self, config: EngineConfig):
        if config.scheduler != "continuous":
            raise ValueError(f"a prefill node runs the continuous scheduler, got {config.scheduler!r}")
        if config.tensor_parallel_size != 1:
            raise ValueError("a prefill node runs with tensor_parallel_size=1 (pages of other ranks are not sent)")
        # before the core: its warm-up (build_core on a GPU) already shows it steps, of no job
        self._jobs: dict[str, _Job] = {}
        self._step: list[_Job] = []  # engine thread: jobs whose prompt completes in the running step
        # where a finished prompt's pages wait for its in-place sends (never the engine thread)
        self._waits = ThreadPoolExecutor(4, thread_name_prefix="m3sdk-node-release")
        # no overlapped steps: the step after a prompt's last chunk would run (and pack) it a second time
        self.core = build_core(config.replace(overlap_scheduling=False), observers=[self])
        self.compat = CompatInfo.from_spec(self.core.cache.kv.spec, model_fingerprint(config.model_path()))
        self.vocab_size = self.core.vocab_size
        # the prompt and its first token within max_model_len, which the core keeps within its KV cache
        self.max_prompt_tokens = self.core.max_model_len - 1
        self.takes_images = self.core.images is not None
        self._dead: BaseException | None = None
        self.rows = wire.page_rows(self.core.cache.kv)
        self.core.start(self._emit, self._on_dead, finish_listeners=[self._on_finish])

    async def prefill(self, order: PrefillOrder, outbox: Outbox) -> FirstToken:
        ids = order.token_ids
        images = ()
        if order.images:
            if self.core.images is None:  # (the servicer refuses images first: its max_image_bytes is 0)
                raise InvalidRequestError("this node takes no images")
            # decoding and resizing off the loop; each image must come out as the decode side's did
            images = await asyncio.to_thread(self.core.images.place, ids, [
                (i.offset, i.num_tokens, i.digest, i.data) for i in order.images])
        request = self.core.new_request(order.request_id, ids, order.params, len(ids) + 1, images=images)
        groups: dict[int, list[wire.MessageSpec]] = {}
        for msg in outbox.plan.messages:
            groups.setdefault(msg.layers[-1], []).append(msg)
        job = _Job(order, outbox, asyncio.get_running_loop().create_future(), groups)
        self._jobs[order.request_id] = job
        self.core.submit(request)
        try:
            return await job.done
        except asyncio.CancelledError:
            self.core.abort(order.request_id)
            raise
        finally:
            self._jobs.pop(order.request_id, None)

    def pages(self) -> tuple[int, int]:
        stats = self.core.stats()
        return stats["pages_free"], stats["pages_total"]

    def failure(self) -> BaseException | None:
        return self._dead

    def stop(self) -> None:
        self.core.stop()
        self.core.join()
        self._waits.shutdown()

    # -- the engine thread -------------------------------------------------------------------------------

    def on_step(self, plan: StepPlan) -> LayerHook | None:
        """The step observer: the jobs whose prompt this step completes pack their pages during its forward."""
        self._step = []
        for request, _, samples in plan.scheduled:
            job = self._jobs.get(request.request_id)
            if job is not None and samples:
                table = self.core.cache.page_table(request)
                pages = table[job.order.num_cached_pages:job.order.num_pages]
                # on the host: pack finds their runs there without a device sync (wire.Layout)
                job.src = torch.tensor(pages, dtype=torch.int64)
                # every message's pieces now, before the forward: its hooks then pack with a few calls each
                job.outbox.prepare(self.rows, job.src)
                self._step.append(job)
        return self._after_attention if self._step else None

    def _after_attention(self, layer: int) -> None:
        # after the attention, not the whole layer: its cache writes are queued by then, and the MLP (the MoE of a
        # sparse layer) runs while the group's pages travel
        for job in self._step:
            messages = job.groups.get(layer)
            if messages:
                self._pack(job, messages)

    def _pack(self, job: _Job, messages: list[wire.MessageSpec]) -> None:
        job.outbox.pack(messages, self.rows, job.src)
        job.packed += len(messages)

    def _on_finish(self, request: Request, reason: FinishReason) -> Future[None] | None:
        """The finish listener, before the core frees the request's pages (an abort too: sends of what was packed
        may be in flight): a hold on them while in-place sends read them."""
        job = self._jobs.get(request.request_id)
        if job is None or not job.outbox.reads_pages or job.outbox.released.is_set():
            return None
        return self._waits.submit(self._wait_released, job.outbox, request.request_id)

    def _wait_released(self, outbox: Outbox, request_id: str) -> None:
        if not outbox.wait_released(self.release_timeout):
            log.warning("in-place sends still held pages at the prefill's end: endpoint dropped",
                        request_id=request_id, waited_s=self.release_timeout)

    def _emit(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            job = self._jobs.get(chunk.request_id)
            if job is not None and chunk.finish_reason is not None:
                job.done.get_loop().call_soon_threadsafe(self._resolve, job, chunk)

    def _resolve(self, job: _Job, chunk: Chunk) -> None:
        if job.done.done():
            return
        if chunk.finish_reason == "abort":
            job.done.set_exception(RuntimeError(f"prefill of {chunk.request_id!r} was aborted in the engine"))
        elif job.packed != len(job.outbox.plan.messages):
            job.done.set_exception(RuntimeError(f"prefill of {chunk.request_id!r} finished with {job.packed} of "
                                                f"{len(job.outbox.plan.messages)} messages packed"))
        else:
            token = chunk.logprobs[0]
            job.done.set_result(FirstToken(token.token_id, token.logprob, token.top_logprobs))

    def _on_dead(self, exc: BaseException) -> None:
        self._dead = exc
        for job in list(self._jobs.values()):
            job.done.get_loop().call_soon_threadsafe(
                lambda d=job.done: d.done() or d.set_exception(RuntimeError(f"engine died: {exc!r}")))
