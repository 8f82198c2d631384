"""The prefill node's backend: an engine core of its own computes each prompt as a one-token request.

When such a request finishes (its first token sampled), the core's finish hook runs in the engine thread while
the request still holds its pages: the pages to send are copied out then, so the core may free and reuse them
at once and the push runs from the copy.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from m3sdk.core import EngineCore
from m3sdk.disagg import wire
from m3sdk.disagg.compat import CompatInfo, model_fingerprint
from m3sdk.disagg.messages import PrefillOrder
from m3sdk.disagg.server import Prefilled
from m3sdk.request import Chunk, FinishReason, Request
from m3sdk.sampler import SamplingState
from m3sdk.tokenizer import TextStream
from m3sdk_kernels.layout import PAGE_SIZE


class EngineBackend:
    def __init__(self, core: EngineCore, model_path: str | Path):
        self.core = core
        self.compat = CompatInfo.from_spec(core.cache.kv.spec, model_fingerprint(model_path))
        self.vocab_size = core.vocab_size
        self._rows = wire.page_rows(core.cache.kv)
        self._waiters: dict[str, tuple[asyncio.Future, int]] = {}  # request id -> (result, cached pages)
        self._snapshots: dict[str, list[list[torch.Tensor]]] = {}
        core.finish_hooks.append(self._on_finish)
        core.start(self._emit, self._on_dead)

    async def prefill(self, order: PrefillOrder) -> Prefilled:
        ids = order.token_ids
        request = Request(order.request_id, ids, order.params, len(ids) + 1)
        request.sampling = SamplingState(order.params, ids)
        request.text = TextStream(self.core.tokenizer, order.params, ids)
        done = asyncio.get_running_loop().create_future()
        self._waiters[order.request_id] = (done, order.num_cached_pages)
        self.core.submit(request)
        try:
            return await done
        except asyncio.CancelledError:
            self.core.abort(order.request_id)
            raise
        finally:
            self._waiters.pop(order.request_id, None)
            self._snapshots.pop(order.request_id, None)

    def stop(self) -> None:
        self.core.stop()
        self.core.join()

    # -- the engine thread -------------------------------------------------------------------------------

    def _on_finish(self, request: Request, reason: FinishReason) -> None:
        waiter = self._waiters.get(request.request_id)
        if waiter is None or reason == "abort":
            return
        table = self.core.cache.page_table(request)
        num_pages = -(-request.num_prompt_tokens // PAGE_SIZE)
        idx = torch.tensor(table[waiter[1]:num_pages], dtype=torch.int64, device=self._rows[0][0].device)
        self._snapshots[request.request_id] = [[t.index_select(0, idx) for t in layer] for layer in self._rows]

    def _emit(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            waiter = self._waiters.get(chunk.request_id)
            if waiter is not None and chunk.finish_reason is not None:
                waiter[0].get_loop().call_soon_threadsafe(self._resolve, chunk)

    def _resolve(self, chunk: Chunk) -> None:
        waiter = self._waiters.get(chunk.request_id)
        if waiter is None or waiter[0].done():
            return
        rows = self._snapshots.pop(chunk.request_id, None)
        if chunk.finish_reason == "abort" or rows is None:
            waiter[0].set_exception(RuntimeError(f"prefill of {chunk.request_id!r} was aborted in the engine"))
        else:
            token = chunk.logprobs[0]
            waiter[0].set_result(Prefilled(token.token_id, token.logprob, rows))

    def _on_dead(self, exc: BaseException) -> None:
        for done, _ in list(self._waiters.values()):
            done.get_loop().call_soon_threadsafe(
                lambda d=done: d.done() or d.set_exception(RuntimeError(f"engine died: {exc!r}")))
