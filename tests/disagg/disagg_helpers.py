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
from m3sdk.disagg.server import FirstToken
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
    """Packs the pattern of the requested pages after `delay_s` (a stand-in for compute time). Its pages are made
    for each request and never changed (so they may be sent in place)."""

    holds_pages = True
    max_prompt_tokens = 1 << 20
    takes_images = False

    def __init__(self, kv_dtype: str, layout: str, delay_s: float = 0.0):
        self.spec = spec(kv_dtype, layout)
        self.compat = CompatInfo.from_spec(self.spec, "pattern-model")
        self.vocab_size = VOCAB
        self.rows = wire.page_rows(KVPool(self.spec))
        self.delay_s = delay_s

    async def prefill(self, order: PrefillOrder, outbox) -> FirstToken:
        await asyncio.sleep(self.delay_s)
        rows = expected_rows(self.spec, order.token_ids, order.num_cached_pages)
        outbox.pack(list(outbox.plan.messages), rows, torch.arange(outbox.plan.num_pages))
        top = [(first_token(order.token_ids), -0.25)] * order.params.logprobs
        return FirstToken(first_token(order.token_ids), -0.25, top)

    def pages(self) -> tuple[int, int]:
        return 0, 0

    def failure(self) -> BaseException | None:
        return None


def _serve(conn, kv_dtype: str, layout: str, delay_s: float, token: str | None, listen: str,
           limits: dict) -> None:
    from m3sdk.node import PrefillNode

    node = PrefillNode(PatternBackend(kv_dtype, layout, delay_s), listen, token=token,
                       limits=Limits(**{"max_prompt_tokens": 4096, **limits})).start()
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
               token: str | None = TOKEN, listen: str = "127.0.0.1:0", **limits) -> tuple[mp.Process, str]:
    """A node in a process of its own; returns (process, "HOST:PORT"). `limits`: messages.Limits fields."""
    return _spawn(_serve, kv_dtype, layout, delay_s, token, listen, limits)


def stop_node(proc: mp.Process) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _serve_engine(conn, checkpoint: str, delay_s: float, corrupt_index_keys: bool, hold_last_layer: bool,
                  fail_at_tokens: int, kv_cache_memory: int, listen: str, options: dict) -> None:
    torch.set_num_threads(1)
    from m3sdk.config import EngineConfig
    from m3sdk.disagg.backend import EngineBackend
    from m3sdk.node import PrefillNode

    class Backend(EngineBackend):
        async def prefill(self, order, outbox):
            await asyncio.sleep(delay_s)  # a slow node, for the kill and abort tests
            return await super().prefill(order, outbox)

        def _pack(self, job, messages):
            if corrupt_index_keys:
                # garble the group's index keys after its layers ran (the first token is computed from the
                # real ones) and before they are packed: what travels is wrong, the node's compute is not
                sparse = set(self.core.cache.kv.spec.sparse_layers)
                for layer in {layer for m in messages for layer in m.layers} & sparse:
                    index_rows = self.rows[layer][-1]
                    index_rows[job.src] = torch.randint(0, 256, (len(job.src), index_rows.shape[1]),
                                                        dtype=torch.uint8)
            super()._pack(job, messages)

    config = EngineConfig(model=checkpoint, device="cpu", kv_cache_memory=kv_cache_memory, **options)
    backend = Backend(config)
    if hold_last_layer:
        hold_until_first_group_sent(backend)
    if fail_at_tokens:
        def fail(module, args):  # a fault in the node's engine thread, on one prompt length only
            if any(len(job.order.token_ids) == fail_at_tokens for job in backend._step):
                raise RuntimeError(f"injected fault at a {fail_at_tokens}-token prompt")

        backend.core.runner.model.layers[0].register_forward_pre_hook(fail)
    node = PrefillNode(backend, listen).start()
    conn.send(node.address)
    try:
        node.serve_until_signal(grace=2.0)
    finally:
        backend.stop()


def hold_until_first_group_sent(backend) -> None:
    """Make the last layer of a forward that completes a prompt wait until that transfer's first message was
    sent (its first group of layers): a node that pushed only after the whole forward would wait forever, so past
    20 s the hook raises, the node's engine dies and the decode side sees the prefill fail."""
    import time

    def before_last_layer(module, args):
        for job in backend._step:
            deadline = time.monotonic() + 20
            while not job.outbox.sent:
                if time.monotonic() > deadline:
                    raise RuntimeError("the first group of layers was not sent before the last layer ran")
                time.sleep(0.005)

    backend.core.runner.model.layers[-1].register_forward_pre_hook(before_last_layer)


def spawn_engine_node(checkpoint, delay_s: float = 0.0, corrupt_index_keys: bool = False,
                      hold_last_layer: bool = False, fail_at_tokens: int = 0,
                      kv_cache_memory: int = 8 << 20, listen: str = "127.0.0.1:0", **options) -> tuple[mp.Process, str]:
    """A prefill node running the real engine on `checkpoint`; index keys garbled in transit if asked; with
    `hold_last_layer`, a forward cannot finish before its transfers' first group of layers was sent; with
    `fail_at_tokens`, its engine thread dies on a prompt of that many tokens. `options`: EngineConfig fields."""
    return _spawn(_serve_engine, str(checkpoint), delay_s, corrupt_index_keys, hold_last_layer, fail_at_tokens,
                  kv_cache_memory, listen, options)
