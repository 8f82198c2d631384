"""Helpers of the disaggregation tests: a page-filling prefill backend and node processes on 127.0.0.1.

`PatternBackend` stands in for the engine where the test is about the protocol and the transport: it writes
a pattern that is a function of (the tokens of the page, layer, tensor, byte), so the decode side can check
every byte it received landed in the right page. The end-to-end tests run the real engine instead.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal

import torch

from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.disagg import wire
from m3sdk.disagg.compat import CompatInfo
from m3sdk.disagg.messages import Limits, PrefillOrder
from m3sdk.disagg.server import Prefilled
from m3sdk_kernels.layout import PAGE_SIZE

VOCAB = 1000
TOKEN = "s3cret"


def spec(kv_dtype: str = "bf16", layout: str = "plain", num_pages: int = 64) -> KVCacheSpec:
    return KVCacheSpec(num_pages=num_pages, num_layers=4, num_kv_heads=2, head_dim=16, sparse_layers=(1, 3),
                       index_head_dim=8, kv_dtype=kv_dtype, layout=layout)


def compat(kv_dtype: str = "bf16", layout: str = "plain") -> CompatInfo:
    return CompatInfo.from_spec(spec(kv_dtype, layout), "pattern-model")


def pattern(token_ids: list[int], page: int, layer: int, tensor: int, width: int) -> torch.Tensor:
    """The bytes of one page of one tensor of one layer: depends on the page's tokens, never on its id."""
    seed = sum((i + 1) * t for i, t in enumerate(token_ids[page * PAGE_SIZE:(page + 1) * PAGE_SIZE]))
    return ((torch.arange(width) * 7 + seed * 31 + layer * 11 + tensor * 5) % 251).to(torch.uint8)


def expected_rows(s: KVCacheSpec, token_ids: list[int], first_page: int) -> list[list[torch.Tensor]]:
    """Per layer and tensor, the pattern of pages [first_page, pages of the prompt) stacked."""
    rows = wire.page_rows(KVPool(s))  # only for the widths
    num_pages = -(-len(token_ids) // PAGE_SIZE)
    return [[torch.stack([pattern(token_ids, p, layer, j, t.shape[1]) for p in range(first_page, num_pages)])
             for j, t in enumerate(layer_rows)] for layer, layer_rows in enumerate(rows)]


def first_token(token_ids: list[int]) -> int:
    return sum(token_ids) % VOCAB


class PatternBackend:
    """Fills the requested pages with `pattern` after `delay_s` (a stand-in for compute time)."""

    def __init__(self, kv_dtype: str, layout: str, delay_s: float = 0.0):
        self.spec = spec(kv_dtype, layout)
        self.compat = CompatInfo.from_spec(self.spec, "pattern-model")
        self.vocab_size = VOCAB
        self.delay_s = delay_s

    async def prefill(self, order: PrefillOrder) -> Prefilled:
        await asyncio.sleep(self.delay_s)
        rows = expected_rows(self.spec, order.token_ids, order.num_cached_pages)
        return Prefilled(first_token(order.token_ids), -0.25, rows)


def _serve(conn, kv_dtype: str, layout: str, delay_s: float, token: str | None) -> None:
    from m3sdk.node import PrefillNode

    node = PrefillNode(PatternBackend(kv_dtype, layout, delay_s), "127.0.0.1:0", token=token,
                       limits=Limits(max_prompt_tokens=4096)).start()
    conn.send(node.address)
    node.serve_until_signal(grace=2.0)


def _spawn(target, *args) -> tuple[mp.Process, str]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise RuntimeError("prefill node did not start")
    return proc, parent.recv()


def spawn_node(kv_dtype: str = "bf16", layout: str = "plain", delay_s: float = 0.0,
               token: str | None = TOKEN) -> tuple[mp.Process, str]:
    """A node in a process of its own; returns (process, "127.0.0.1:PORT")."""
    return _spawn(_serve, kv_dtype, layout, delay_s, token)


def stop_node(proc: mp.Process) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _serve_engine(conn, checkpoint: str, delay_s: float, corrupt_index_keys: bool) -> None:
    torch.set_num_threads(1)
    from m3sdk.config import EngineConfig
    from m3sdk.core import EngineCore
    from m3sdk.disagg.backend import EngineBackend
    from m3sdk.node import PrefillNode

    class Backend(EngineBackend):
        async def prefill(self, order):
            await asyncio.sleep(delay_s)  # a slow node, for the kill and abort tests
            return await super().prefill(order)

        def _on_finish(self, request, reason):
            super()._on_finish(request, reason)
            rows = self._snapshots.get(request.request_id)
            if corrupt_index_keys and rows is not None:
                for layer in self.core.cache.kv.spec.sparse_layers:
                    rows[layer][-1].copy_(torch.randint(0, 256, rows[layer][-1].shape, dtype=torch.uint8))

    config = EngineConfig(model=checkpoint, device="cpu", kv_cache_memory=8 << 20)
    backend = Backend(EngineCore.build(config), config.model_path())
    node = PrefillNode(backend, "127.0.0.1:0").start()
    conn.send(node.address)
    try:
        node.serve_until_signal(grace=2.0)
    finally:
        backend.stop()


def spawn_engine_node(checkpoint, delay_s: float = 0.0, corrupt_index_keys: bool = False
                      ) -> tuple[mp.Process, str]:
    """A prefill node running the real engine on `checkpoint`; index keys garbled in transit if asked."""
    return _spawn(_serve_engine, str(checkpoint), delay_s, corrupt_index_keys)
