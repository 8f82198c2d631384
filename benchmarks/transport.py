"""KV transport rate on this machine vs UCX's own loopback rate, measured in the same run.

    .venv/bin/python benchmarks/transport.py [--total-mib 256] [--message-mib 64 16 4 1] [--repeats 5]
    python benchmarks/transport.py --device cuda [--gpus 0,1] [--out DIR]    # two GPUs of one host

On GPUs the sender (prefill side) holds its pool on the first GPU of --gpus and the receiver (decode side) on the
second, each process with its own GPU listed first in CUDA_VISIBLE_DEVICES (ucxx's progress thread makes device
0 current); the pool is FP8 (K, V, their scales, index keys: what a remote prefill moves), and the baseline is
  p2p           a torch peer-to-peer copy_ of the same number of bytes, sender GPU -> receiver GPU, in one tensor
(no perftest, no "EH" rows). The first round checks every received page byte for byte before anything is timed.

Two processes on 127.0.0.1 move the same bytes each way (--kinds picks; a "-wN" suffix on a kv kind runs it
with transport window N, e.g. kv-w8):
  kv            UcxTransport: a prefill node's pages queued as messages (Outbox, from another thread, as a node's
                engine thread queues them while it computes: all at once), pushed, checked, in the decode side's
                KVPool pages (what a remote prefill costs beyond compute), page tables of consecutive pages on
                both sides (a fresh engine's): pages in runs move straight from pool to pool, each message as one
                UCX message per piece (plans of pieces, disagg/ucp.py)
  kv-staged     the same pages, every message staged on both sides as one UCX message (UcxTransport(in_place=
                False), whole messages): gathered into a buffer, received into one and scattered, `window` (4)
                messages ahead of the sends ("-ahead": all at once)
  kv-scattered  random page ids on both sides (index kernels on both sides)
  ucxx raw      ucxx tag send/recv of the same message sizes on endpoints like the transport's (no UCX peer error
                handling: shared memory between the two processes); receive buffers posted and touched beforehand
  raw-w4        the same, at most 4 messages in flight each way (the transport's window)
  raw-runs      ucxx straight from the sender's pool into the receiver's, one message per (layer, tensor) (what
                sending and receiving in place would cost at best: no copies, no framing), every byte checked
  raw-put       one-sided writes (ucp_put_nbx) of each message's pieces from the sender's pool into the receiver's
                (registered once, its keys sent ahead), a flush, then a 16-byte tag message per message; every
                byte checked. List it after raw, whose endpoint it uses (connected by then)
  ucxx raw, EH  the same on ucxx's public create_endpoint/create_listener endpoints (peer error handling: TCP)
  perftest      ucx_perftest tag_bw, the same message size (UCX's own C loopback rate; from the libucx wheel);
                "-e" asks it for peer error handling, like ucxx's public endpoints
Rates are GB/s (1e9 bytes/s), from the sender's first pack or send to the receiver's last scatter or receive, as
its event loop sees it (the transfer's Outbox is made and its push started before: a node does both when the
Prefill call arrives, before it computes; the receiver posts its buffers before); each cell gives
min / median / max over the repeats (the machine is shared), after one warm-up round.
The transports each side actually uses are printed by UCX_LOG_LEVEL=info (e.g. "tag(sysv/memory cma/memory)").
Every wait has a deadline (--step-timeout): a transfer that does not finish, or a sender process that dies (a
CUDA buffer UCX took for host memory kills it with SIGSEGV), ends the run with a message instead of a hang.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import glob
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch

from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.disagg import loop, ucp, ucx_api, wire
from m3sdk.disagg.ucx_api import api, send, start_send, worker
from m3sdk.disagg.ucx_transport import UcxTransport

TRANSFER_ID = 4242


def pool_spec(total_bytes: int, device: str) -> KVCacheSpec:
    # MiniMax-M3-like page rows, 8 layers, index keys of 128 on every other layer: on a CPU as at TP 8 (1 KV head
    # of 128, bf16), on GPUs as at TP 1 (4 KV heads of 128, FP8 with scales, FP8 index keys: the GPU default)
    cuda = device == "cuda"
    probe = KVCacheSpec(num_pages=1, num_layers=8, num_kv_heads=4 if cuda else 1, head_dim=128,
                        sparse_layers=(1, 3, 5, 7), index_head_dim=128, kv_dtype="fp8" if cuda else "bf16",
                        index_dtype="fp8" if cuda else "bf16", device="cuda:0" if cuda else "cpu")
    return KVCacheSpec(**{**probe.__dict__, "num_pages": max(1, total_bytes // probe.bytes_per_page)})


def pattern(t: torch.Tensor, layer: int, j: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A pattern both processes can compute for pool rows `t` [pages, width]: each byte a function of (layer,
    tensor, page, offset). Built a few pages at a time (an int64 index of the whole pool would be 8x its size)."""
    out = torch.empty_like(t) if out is None else out
    cols = torch.arange(t.shape[1], device=t.device, dtype=torch.int64) * 131 + layer * 17 + j * 7
    step = max(1, (1 << 24) // t.shape[1])
    for start in range(0, t.shape[0], step):
        pages = torch.arange(start, min(start + step, t.shape[0]), device=t.device, dtype=torch.int64)
        out[start:start + len(pages)] = ((pages[:, None] * 13 + cols[None, :]) % 251).to(torch.uint8)
    return out


def fill(rows: list[list[torch.Tensor]]) -> None:
    for layer, tensors in enumerate(rows):
        for j, t in enumerate(tensors):
            pattern(t, layer, j, out=t)


def page_tables(num_pages: int, device: torch.device, kinds: list[str]) -> dict[str, torch.Tensor]:
    """The decode side's page ids of each kind that moves pool pages. A fresh engine's page table is one run of
    consecutive pages; a long-running one's is scattered ("kv-scattered": the same permutation in both processes,
    so the receiver can check where each page landed)."""
    gen = torch.Generator().manual_seed(7)
    runs = torch.arange(num_pages, device=device)
    scattered = torch.randperm(num_pages, generator=gen).to(device)
    return {k: scattered if k == "kv-scattered" else runs for k in kinds
            if k.startswith("kv") or k in ("raw-runs", "raw-put")}


def window_of(what: str, default: int) -> int:
    """The transport window a kind runs with ("-w8": 8)."""
    found = re.search(r"-w(\d+)$", what)
    return int(found.group(1)) if found else default


def pool_runs(rows: list[list[torch.Tensor]]) -> list:
    """Every pool tensor as one flat run (the pages of a fresh engine: one run per (layer, tensor))."""
    return [_host_or_device(t.view(-1)) for layer in rows for t in layer]


class Trace:
    """Per-message host timestamps (perf_counter: one clock for the processes of a host) of one transfer, taken
    by wrapping the transport's steps: node side queued by the producer (pack0), gathered (pack), its device work
    done (deliver), taken by the push (ready: for a plan of pieces after its sends were posted), send start / all
    parts posted / done (send0, posted, send1); decode side receive posted / completed, scatter start / end
    (checked and queued). Only with --trace, for the last repeat of each kv kind."""

    events: list[tuple[str, int, float]] | None = None

    @classmethod
    def install(cls) -> None:

        from m3sdk.disagg import outbox as ob

        mask = (1 << wire.MESSAGE_INDEX_BITS) - 1

        def note(event: str, index: int) -> None:
            if cls.events is not None:
                cls.events.append((event, index, time.perf_counter()))

        pack, check, place, send, recv = wire.pack, wire.check, wire.place, ucx_api.start_send, ucx_api.start_recv
        get, ucp_send, ucp_recv, outbox_pack, deliver = (ob.Outbox.get, ucp.send, ucp.recv, ob.Outbox.pack,
                                                         ob.Outbox._deliver)

        def on_done(fut, event: str, index: int) -> None:  # from any thread: the callback is added on its loop
            fut.get_loop().call_soon_threadsafe(fut.add_done_callback, lambda _: note(event, index))

        def traced_pack(plan, msg, *args):
            note("pack", msg.index)
            pack(plan, msg, *args)

        def traced_check(plan, msgs, *args):
            for msg in msgs:  # from the check (one copy to the host) to the copies queued
                note("scatter0", msg.index)
            check(plan, msgs, *args)
            for msg in msgs:
                note("checked", msg.index)

        def traced_place(msgs, *args):
            for msg in msgs:
                note("place0", msg.index)
            place(msgs, *args)
            for msg in msgs:
                note("scatter1", msg.index)

        def traced_send(ep, buf, tag):
            note("send0", tag & mask)
            done = send(ep, buf, tag)
            done.add_done_callback(lambda _: note("send1", tag & mask))
            return done

        def traced_recv(buf, tag):
            note("recv0", tag & mask)
            done = recv(buf, tag)
            done.add_done_callback(lambda _: note("recv1", tag & mask))
            return done

        async def traced_get(self):
            got = await get(self)
            note("ready", got[0])
            return got

        def traced_outbox_pack(self, messages, *args):
            for msg in messages:
                note("pack0", msg.index)
            outbox_pack(self, messages, *args)

        def traced_deliver(self, batch):  # the device work done (GPU: the transport's device-wait thread)
            for index, _ in batch:
                note("deliver", index)
            deliver(self, batch)

        def traced_ucp_send(ep, worker, parts, tag, **kw):  # a plan of pieces: from the producer's side or the push
            note("send0", tag & mask)
            done = ucp_send(ep, worker, parts, tag, **kw)
            note("posted", tag & mask)
            on_done(done, "send1", tag & mask)
            return done

        def traced_ucp_recv(worker, parts, tag, **kw):  # in place: into the pages
            note("recv0", tag & mask)
            done = ucp_recv(worker, parts, tag, **kw)
            done.add_done_callback(lambda _: note("recv1", tag & mask))
            return done

        wire.pack, wire.check, wire.place, ucx_api.start_send, ucx_api.start_recv, ob.Outbox.get, ob.Outbox.pack = (
            traced_pack, traced_check, traced_place, traced_send, traced_recv, traced_get, traced_outbox_pack)
        ucp.send, ucp.recv, ob.Outbox._deliver = traced_ucp_send, traced_ucp_recv, traced_deliver


def plan_pieces(what: str) -> bool:
    """Whether kind `what` moves plans of pieces, as a decode side that receives in place asks (kv-staged: whole
    messages, the GPU path before; kv-scattered has no runs, so whole messages too)."""
    return what.startswith("kv") and what != "kv-staged"


def configure(transport: UcxTransport, what: str, window: int) -> None:
    """The transport settings kind `what` runs with, the same on both sides."""
    transport.window = window_of(what, window)
    transport.in_place = what != "kv-staged"


def plan_for(pool: KVPool, message_bytes: int, transfer_id: int, dst: torch.Tensor | None = None,
             pieces: bool = False) -> wire.TransferPlan:
    """The transfer's plan; with the destination pages `dst` as a remote prefill builds it (their runs scattered
    as runs), without them as plain messages (the raw rows); `pieces` as a GPU decode side asks for it."""
    return wire.TransferPlan.build(wire.page_rows(pool), transfer_id, pool.spec.num_pages, pool.spec.num_layers,
                                   message_bytes, None if dst is None else dst.tolist(), pieces)


def _sender(conn, total_bytes: int, sizes: list[int], window: int, device: str, step_timeout: float,
            trace: bool, kinds: list[str]) -> None:
    ucxx = ucx_api.load_ucxx()

    torch.set_num_threads(1)
    if trace:
        Trace.install()
    pool = KVPool(pool_spec(total_bytes, device))
    rows = wire.page_rows(pool)
    fill(rows)
    dev = rows[0][0].device
    dsts = page_tables(pool.spec.num_pages, dev, kinds)  # the receiver's
    # sources and destinations differ; source ids on the host, as a node holds them (pack finds their runs there)
    srcs = {k: (v.roll(1) if k == "kv-scattered" else v).cpu() for k, v in dsts.items()}
    transport = UcxTransport(window=window)
    loop.run(transport.start(listen=False), step_timeout)
    conn.send("ready")
    raw_eps: dict[tuple[bool, int], object] = {}
    raw_bufs: dict[int, list] = {}  # touched once, so page faults stay out of the timing
    for size in sizes:
        plan = plan_for(pool, size, TRANSFER_ID)
        raw_bufs[plan.messages[0].nbytes] = [_host_or_device(torch.ones(m.nbytes, dtype=torch.uint8, device=dev))
                                             for m in plan.messages]
    remote: list[tuple[int, int, bytes]] = []  # the receiver's registered pool tensors (raw-put)
    rkeys: dict[int, list[int]] = {}  # their remote keys, unpacked on the endpoint to that port
    while True:
        what, port, message_bytes, transfer_id, traced = conn.recv()
        if what == "stop":
            return
        if what == "keys":
            remote = port
            continue
        plan = plan_for(pool, message_bytes, transfer_id, dsts.get(what), plan_pieces(what))
        configure(transport, what, window)
        Trace.events = [] if traced else None
        if what in srcs and what not in ("raw-runs", "raw-put"):
            # in place nothing is staged, so nothing holds the producer back: all at once, as a node whose forward
            # runs ahead of the link queues its groups
            ahead = "ahead" in what.split("-") or what == "kv"

            async def kv(port=port, plan=plan, src=srcs[what], ahead=ahead, in_place=what != "kv-staged"):
                # packed in one producer thread, running before the clock as a node's engine thread runs when its
                # forward reaches a group's last layer (the messages' pieces worked out before, as a node does when
                # it plans the step): `window` messages ahead of the completed sends, so the staging stays within
                # the transport's pool (on a CPU a fresh buffer pays a page fault per 4 KiB); "-ahead": all at once
                made = time.perf_counter()
                # a node makes it when the Prefill call arrives; the pool stays as it is: sent in place on a CPU
                outbox = transport.outbox(plan, dev, in_place=in_place)
                credits, count, go = threading.Semaphore(transport.window + 1), outbox.count_sent, threading.Event()

                def counted(send: asyncio.Future) -> None:
                    count(send)
                    credits.release()

                def produce() -> None:
                    if not go.wait(step_timeout):
                        return
                    if ahead:
                        outbox.pack(list(plan.messages), rows, src)
                        return
                    for msg in plan.messages:
                        if not credits.acquire(timeout=step_timeout):
                            return  # the push failed: it says why
                        outbox.pack([msg], rows, src)

                outbox.count_sent = counted
                outbox.prepare(rows, src)  # a node does it when it plans the step, before the forward
                prepared = time.perf_counter()
                producer = asyncio.ensure_future(asyncio.to_thread(produce))
                # the push waits for the first message, as a node's push, started with the Prefill call, does
                push = asyncio.ensure_future(transport.push("127.0.0.1", port, outbox))
                await asyncio.sleep(0.002)  # the thread is up and waiting
                start = time.perf_counter()
                if Trace.events is not None:  # making the outbox and its pieces, before the clock
                    Trace.events += [("outbox", 0, made), ("prepared", 0, prepared)]
                go.set()
                await asyncio.gather(producer, push)
                return start
            start = loop.run(kv(), step_timeout)
        elif what.startswith("raw"):
            async def raw(port=port, plan=plan, what=what, remote=remote):
                eh = what == "raw-eh"
                key = (eh, port)
                if key not in raw_eps:
                    raw_eps[key] = (await ucxx.create_endpoint("127.0.0.1", port) if eh
                                    else api().UCXEndpoint.create(worker(), "127.0.0.1", port, False))
                ep = raw_eps[key]
                if what == "raw-put":
                    if port not in rkeys:  # on an endpoint that raw connected before (its lanes known)
                        rkeys[port] = [ucp.remote_key(ep.handle, blob) for _, _, blob in remote]
                    parts = put_parts(plan, rows, srcs[what], remote, rkeys[port])
                    frame = torch.ones(16, dtype=torch.uint8).numpy()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                start = time.perf_counter()
                if what == "raw-put":  # each message's pieces written, flushed, then a 16-byte tag message
                    sends = []
                    for i, msg_parts in enumerate(parts):
                        written = ucp.put(ep.handle, ep.worker_handle, msg_parts)
                        written.add_done_callback(lambda _, i=i: sends.append(start_send(ep, frame, plan.tag(i))))
                        sends.append(written)
                    while sends:
                        await sends.pop(0)
                    return start
                bufs = pool_runs(rows) if what == "raw-runs" else raw_bufs[plan.messages[0].nbytes]
                if what == "raw-w4":  # at most 4 sends in flight, as the transport's window
                    await _windowed([lambda i=i, b=b: send(ep, b, plan.tag(i)) for i, b in enumerate(bufs)], 4)
                else:
                    await asyncio.gather(*(ep.send(b, tag=plan.tag(i), force_tag=True) if eh
                                           else send(ep, b, plan.tag(i)) for i, b in enumerate(bufs)))
                return start
            start = loop.run(raw(), step_timeout)
        conn.send((start, Trace.events))
        Trace.events = None


def put_parts(plan: wire.TransferPlan, rows: list[list[torch.Tensor]], src: torch.Tensor,
              remote: list[tuple[int, int, bytes]], rkeys: list[int]) -> list[list[tuple[int, int, int, int]]]:
    """Per message, its pieces as one-sided writes (local address, bytes, remote address, remote key) into the
    receiver's pool tensors `remote` ((address, bytes, packed key), in pool order), at the same offsets (raw-put's
    page tables are the same runs on both sides)."""
    layout = wire.Layout(plan, rows, src)
    bases = [t.data_ptr() for layer in rows for t in layer]
    order = sorted(range(len(bases)), key=bases.__getitem__)
    sorted_bases = [bases[i] for i in order]
    out = []
    for msg in plan.messages:
        parts = []
        for piece in layout.pool(msg)[0]:
            at = piece.data_ptr()
            k = order[bisect.bisect_right(sorted_bases, at) - 1]
            parts.append((at, piece.numel() * piece.element_size(), remote[k][0] + at - bases[k], rkeys[k]))
        out.append(parts)
    return out


async def _windowed(ops: list, window: int) -> None:
    """Run the coroutine factories `ops` in order, at most `window` at once."""
    pending: deque = deque()
    for op in ops:
        if len(pending) >= window:
            await pending.popleft()
        pending.append(asyncio.ensure_future(op()))
    await asyncio.gather(*pending)


def _host_or_device(t: torch.Tensor):
    return t if t.is_cuda else t.numpy()


async def _ended(wait) -> float:
    """When `wait` returned, on the loop that receives (where a decode side's job sees its receive complete; the
    main thread's wake-up from the loop's future is no part of the transfer)."""
    await wait
    return time.perf_counter()


async def _recv_all(plan: wire.TransferPlan, bufs: list, window: int | None = None) -> None:
    ucxx = ucx_api.load_ucxx()

    await _windowed([lambda i=i, b=b: ucxx.recv(b, plan.tag(i)) for i, b in enumerate(bufs)], window or len(bufs))


def _visible(first: str, second: str) -> None:
    # one GPU for both processes (--gpus 0,0: a check of the path on a one-GPU machine): listed once
    os.environ["CUDA_VISIBLE_DEVICES"] = first if first == second else f"{first},{second}"


def _alive(proc: mp.Process, what: str) -> None:
    if not proc.is_alive():
        raise SystemExit(f"{what}: the sender process died (exit code {proc.exitcode}; -11 is SIGSEGV, as when UCX "
                         "copies a CUDA buffer it took for host memory)")


def _reply(conn, proc: mp.Process, what: str, timeout: float):
    """The sender's next message, within `timeout` s, or a clear exit."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.5):
        _alive(proc, what)
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: no word from the sender in {timeout:.0f} s")
    return conn.recv()


def _result(done, proc: mp.Process, what: str, timeout: float):
    """The receiving side's outcome, within `timeout` s; a dead sender ends the wait at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return done.result(0.5)
        except TimeoutError:
            _alive(proc, what)
            if time.monotonic() > deadline:
                done.cancel()
                raise SystemExit(f"{what}: not received in {timeout:.0f} s (sender alive)") from None


def measure(total_bytes: int, sizes: list[int], repeats: int, window: int, device: str, gpus: tuple[str, str],
            kinds: list[str], step_timeout: float = 60.0,
            trace: bool = False) -> tuple[dict[tuple[str, int], list[float]], list[dict]]:
    ucxx = ucx_api.load_ucxx()

    cuda = device == "cuda"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child, total_bytes, sizes, window, device, step_timeout, trace, kinds),
                       daemon=True)
    if cuda:  # each process sees its own GPU as cuda:0 and the other one as cuda:1
        _visible(*gpus)
    proc.start()
    if cuda:
        _visible(gpus[1], gpus[0])
    if trace:
        Trace.install()
    pool = KVPool(pool_spec(total_bytes, device))
    rows = wire.page_rows(pool)
    dev = rows[0][0].device
    dsts = page_tables(pool.spec.num_pages, dev, kinds)
    transport = UcxTransport(window=window)
    loop.run(transport.start(listen=True), step_timeout)
    print("UCX transports:", " ".join(sorted(ucxx.get_active_transports())), flush=True)
    eh_listener = None if cuda or "raw-eh" not in kinds else loop.run(_eh_listener(), step_timeout)
    rates: dict[tuple[str, int], list[float]] = {}
    traces: list[dict] = []
    transfer_id = TRANSFER_ID
    _reply(parent, proc, "sender start", 2 * step_timeout)  # the sender is set up (CUDA, UCX)
    registered = []
    if "raw-put" in kinds:  # the pool tensors the sender writes into, once
        context = ucxx.core._get_ctx().context.handle
        tensors = [t for layer in rows for t in layer]
        registered = [ucp.register(context, t.data_ptr(), t.numel() * t.element_size(), dev.type) for t in tensors]
        parent.send(("keys", [(t.data_ptr(), t.numel() * t.element_size(), blob)
                              for t, (_, blob) in zip(tensors, registered, strict=True)], 0, 0, False))
    try:
        # the first round warms up (connections, staging buffers' first touch) and is not counted
        def baseline(size: int) -> None:
            if cuda:
                rates.setdefault(("p2p", size), []).append(p2p(plan_for(pool, size, TRANSFER_ID).total_bytes, dev))
                return
            for flags in ((), ("-e",)):
                rate = perftest(size, max(8, total_bytes // size), flags)
                rates.setdefault(("perftest" + "".join(flags), size), []).append(rate)

        for repeat in range(repeats + 1):
            for size in sizes:
                # each repeat's baseline beside its transfers, before them in even repeats and after in odd ones, so
                # that a load that rises or falls through a repeat weighs on both alike (pairs, then medians)
                if repeat and not repeat % 2:
                    baseline(size)
                for what in kinds:
                    port = eh_listener.port if what == "raw-eh" else transport.port
                    transfer_id += 1
                    plan = plan_for(pool, size, transfer_id, dsts.get(what), plan_pieces(what))
                    nbytes = plan.total_bytes
                    traced = trace and repeat == repeats and what.startswith("kv")
                    Trace.events = [] if traced else None
                    if what in dsts and not repeat:  # the check below sees this transfer's bytes
                        for layer in rows:
                            for t in layer:
                                t.zero_()
                    if what == "raw-put":  # the sender writes the pages: a 16-byte tag message says each is there
                        nbytes = sum(m.payload_bytes for m in plan.messages)
                        done = loop.submit(_ended(_recv_all(plan, [torch.zeros(16, dtype=torch.uint8).numpy()
                                                                   for _ in plan.messages])))
                    elif what == "raw-runs":  # straight into the pool's tensors, one message per (layer, tensor)
                        bufs = pool_runs(rows)
                        nbytes = sum(b.nbytes for b in bufs)
                        done = loop.submit(_ended(_recv_all(plan, bufs)))
                    elif what in dsts:
                        configure(transport, what, window)
                        receive = loop.run(_post(transport, plan, rows, dsts[what]), step_timeout)
                        done = loop.submit(_ended(receive.wait()))
                    else:
                        bufs = [_host_or_device(torch.zeros(m.nbytes, dtype=torch.uint8, device=dev))
                                for m in plan.messages]
                        if cuda:
                            torch.cuda.synchronize(dev)
                        done = loop.submit(_ended(_recv_all(plan, bufs, 4 if what == "raw-w4" else None)))
                    parent.send((what, port, size, transfer_id, traced))
                    step = f"{what} {size >> 20} MiB round {repeat}"
                    end = _result(done, proc, step, step_timeout)
                    if what in dsts and not repeat:
                        check(rows, dsts[what], what)
                    # from the sender's first pack or send (perf_counter is one clock for all processes of the
                    # host): the command's trip through the pipe is not the transport's
                    start, sent_events = _reply(parent, proc, step, step_timeout)
                    rate = nbytes / (end - start) / 1e9
                    if repeat:
                        rates.setdefault((what, size), []).append(rate)
                    if traced:
                        traces.append(timeline(what, size, start, end, sent_events, Trace.events))
                    Trace.events = None
                if repeat % 2:
                    baseline(size)
    finally:
        with contextlib.suppress(OSError):
            parent.send(("stop", 0, 0, 0, False))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        for memh, _ in registered:
            ucp.unregister(ucxx.core._get_ctx().context.handle, memh)
        loop.run(transport.close(), step_timeout)
    return rates, traces


def timeline(what: str, size: int, start: float, end: float, sent: list, received: list) -> dict:
    """One traced transfer: per event kind, each message's time in ms from the sender's start."""
    events: dict[str, dict[int, float]] = {}
    for event, index, t in [*sent, *received]:
        events.setdefault(event, {})[index] = round((t - start) * 1e3, 3)
    return {"bench": "transport-trace", "what": what, "message_mib": size >> 20, "total_ms": round(
        (end - start) * 1e3, 3), "events": {k: [v[i] for i in sorted(v)] for k, v in events.items()}}


def trace_line(t: dict) -> str:
    """A one-line digest: medians of the per-message spans (ms)."""
    ev = t["events"]

    def span(a: str, b: str) -> str:
        d = [y - x for x, y in zip(ev.get(a, []), ev.get(b, []), strict=False)]
        return f"{statistics.median(d):.3f}" if d else "-"

    def gap(a: str) -> str:
        d = [y - x for x, y in zip(ev.get(a, [])[:-1], ev.get(a, [])[1:], strict=False)]
        return f"{statistics.median(d):.3f}" if d else "-"

    first = {k: v[0] for k, v in ev.items() if v}
    return (f"trace {t['what']} {t['message_mib']} MiB: total {t['total_ms']:.2f} ms, n={len(ev.get('send0', []))}; "
            f"medians: pack0->deliver {span('pack0', 'deliver')} ->send0 {span('deliver', 'send0')} post "
            f"{span('send0', 'posted')} pack->ready "
            f"{span('pack', 'ready')} ready->send {span('ready', 'send0')} send "
            f"{span('send0', 'send1')} recv-gap {gap('recv1')} scatter {span('scatter0', 'scatter1')} (check "
            f"{span('scatter0', 'checked')} post {span('checked', 'place0')} place {span('place0', 'scatter1')}) "
            f"recv1->scatter0 {span('recv1', 'scatter0')}; first send0 {first.get('send0', '-')} recv1 "
            f"{first.get('recv1', '-')}; last scatter1 {ev.get('scatter1', ['-'])[-1]}")


def check(rows: list[list[torch.Tensor]], dst: torch.Tensor, what: str) -> None:
    """Every received page byte for byte: the sender's pattern of page src[i] sits in page dst[i]."""
    src = page_tables(len(dst), dst.device, [what])[what]
    if what == "kv-scattered":
        src = src.roll(1)
    for layer, tensors in enumerate(rows):
        for j, t in enumerate(tensors):
            if not torch.equal(t[dst], pattern(t, layer, j)[src]):
                raise SystemExit(f"{what}: layer {layer} tensor {j}: received pages differ from the sent ones")
    print(f"{what}: every byte of {len(dst)} pages arrived intact", flush=True)


def p2p(nbytes: int, dev: torch.device) -> float:
    """GB/s of one torch copy_ of `nbytes` from the other GPU (the sender's, cuda:1 here) to this one."""
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:1")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst.copy_(src)  # peer access set up outside the timing
    torch.cuda.synchronize(dev)
    torch.cuda.synchronize(src.device)
    start = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize(dev)
    return nbytes / (time.perf_counter() - start) / 1e9


async def _eh_listener():
    ucxx = ucx_api.load_ucxx()

    eps = []
    listener = ucxx.create_listener(eps.append)
    listener.endpoints = eps  # keep the accepted endpoints alive
    return listener


async def _post(transport: UcxTransport, plan, rows, dst):
    return transport.receive(plan, rows, dst)


def perftest(message_bytes: int, iterations: int, flags: tuple[str, ...]) -> float:
    """One ucx_perftest tag_bw run between two processes, GB/s. It inherits this process's UCX_* settings,
    among them those `import ucxx` sets (UCX_RNDV_THRESH=8192, UCX_MAX_RNDV_RAILS=1, ...)."""
    import libucx

    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    libs = ":".join(glob.glob(str(root.parent / "libucx_cu1*.libs")))  # what auditwheel vendored (libcudart)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{root / 'lib'}:{libs}",
           "UCX_WARN_UNUSED_ENV_VARS": "n"}
    with socket.socket() as s:  # a free port for perftest's setup connection
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    server = subprocess.Popen([binary, "-p", port, *flags], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run([binary, "127.0.0.1", "-p", port, "-t", "tag_bw", "-s", str(message_bytes),
                              "-n", str(iterations), "-w", "2", *flags], env=env, capture_output=True, text=True,
                             timeout=120).stdout
        server.wait(30)
    finally:
        server.kill()
        server.wait()
    final = re.search(r"Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)", out)
    return float(final.group(1)) * 2**20 / 1e9 if final else float("nan")  # perftest MB are 2^20 bytes


def probe(message_bytes: int) -> list[dict]:
    """Host and device time of a message's copies on one GPU, before and after UCX starts (its progress thread
    and ucxx's notifier thread run from then on): a small copy_ and an event record (host us per call), then the
    36 pieces of an FP8 pool message of `message_bytes` by one _foreach_copy_ and by a copy_ each (host ms to
    queue them, device ms from events, GB/s of the device time)."""
    spec = pool_spec(8 * message_bytes, "cuda")
    rows = wire.page_rows(KVPool(spec))
    plan = wire.TransferPlan.build(rows, 1, spec.num_pages, spec.num_layers, message_bytes)
    msg = plan.messages[0]
    buf = torch.empty(msg.nbytes, dtype=torch.uint8, device="cuda")
    payload = buf[wire.HEADER_BYTES:msg.nbytes - wire.TRAILER_BYTES].view(torch.int64)
    pool = [t.view(torch.int64)[:msg.page_count].reshape(-1) for layer in msg.layers for t in rows[layer]]
    pieces = list(payload.split([p.numel() for p in pool]))
    small, small_out = torch.ones(1 << 20, dtype=torch.uint8, device="cuda"), torch.empty(1 << 20, dtype=torch.uint8,
                                                                                          device="cuda")
    rows_out: list[dict] = []

    def measure_phase(phase: str) -> None:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            small_out.copy_(small, non_blocking=True)
        copy_us = (time.perf_counter() - t) / 200 * 1e6
        t = time.perf_counter()
        for _ in range(200):
            torch.cuda.Event().record()
        event_us = (time.perf_counter() - t) / 200 * 1e6
        torch.cuda.synchronize()
        row = {"bench": "transport-probe", "phase": phase, "message_mib": message_bytes >> 20, "pieces": len(pool),
               "small_copy_us": round(copy_us, 1), "event_record_us": round(event_us, 1)}
        for name, run in (("foreach", lambda: torch._foreach_copy_(pieces, pool)),
                          ("copy_each", lambda: [d.copy_(s, non_blocking=True) for d, s in zip(pieces, pool,
                                                                                                strict=True)])):
            host, device = [], []
            for _ in range(5):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t = time.perf_counter()
                a.record()
                run()
                b.record()
                host.append((time.perf_counter() - t) * 1e3)
                b.synchronize()
                device.append(a.elapsed_time(b))
            row[name] = {"host_ms": round(statistics.median(host), 3), "device_ms": round(statistics.median(device), 3),
                         "gbps": round(msg.payload_bytes / statistics.median(device) / 1e6, 1)}
        rows_out.append(row)
        print(json.dumps(row), flush=True)

    measure_phase("before UCX")
    transport = UcxTransport()
    loop.run(transport.start(listen=True), 30)
    time.sleep(0.5)
    measure_phase("UCX started")
    stop = threading.Event()

    async def churn() -> int:  # 256 MiB CUDA messages to itself, back to back, while the phase measures
        ucxx = ucx_api.load_ucxx()

        ep = api().UCXEndpoint.create(worker(), "127.0.0.1", transport.port, False)
        a = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        torch.cuda.synchronize()
        moved = 0
        while not stop.is_set():
            received = asyncio.ensure_future(ucxx.recv(b, 99))
            await send(ep, a, 99)
            await received
            moved += 1
        return moved

    moving = loop.submit(churn())
    time.sleep(0.2)
    measure_phase("UCX moving data")
    stop.set()
    rows_out[-1]["churn_messages"] = moving.result(10)
    loop.run(transport.close(), 30)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--message-mib", type=int, nargs="+", default=[64, 16, 4, 1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=int, default=UcxTransport().window, help="UcxTransport window")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gpus", default="0,1", help="sender GPU, receiver GPU (physical ids)")
    parser.add_argument("--kinds", nargs="+", help="what to measure (default: kv kv-staged kv-scattered raw, and "
                        "raw-eh on a CPU); also kv-ahead, raw-w4, raw-runs, and kv kinds with a window (kv-w8)")
    parser.add_argument("--trace", action="store_true", help="per-message timeline of the last repeat of kv kinds")
    parser.add_argument("--probe", action="store_true", help="only the copy probe (one GPU, first --message-mib)")
    parser.add_argument("--out", type=Path, help="append the rows to OUT/disagg.jsonl")
    parser.add_argument("--step-timeout", type=float, default=60.0, help="seconds any one wait may take")
    args = parser.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    torch.set_num_threads(1)
    sizes = [m << 20 for m in args.message_mib]
    gpus = tuple(args.gpus.split(","))
    if args.probe:
        rows = probe(sizes[0])
        if args.out is not None:
            with open(args.out / "disagg.jsonl", "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        return
    kinds = args.kinds or ["kv", "kv-staged", "kv-scattered", "raw"] + ([] if args.device == "cuda" else ["raw-eh"])
    rates, traces = measure(args.total_mib << 20, sizes, args.repeats, args.window, args.device, gpus, kinds,
                            args.step_timeout, args.trace)
    if not rates:  # --repeats 0: the warm-up round alone, which checks every byte
        return
    base = "p2p" if args.device == "cuda" else "perftest"
    if args.out is not None:
        with open(args.out / "disagg.jsonl", "a") as f:
            for (name, size), r in sorted(rates.items()):
                f.write(json.dumps({"bench": "transport", "device": args.device, "what": name, "total_mib":
                                    args.total_mib, "message_mib": size >> 20, "window": window_of(name, args.window),
                                    "gbps": r}) + "\n")
            for t in traces:
                f.write(json.dumps(t) + "\n")
    for t in traces:
        print(trace_line(t))

    def cell(key: tuple[str, int]) -> str:
        r = rates.get(key) or [float("nan")]
        return f"{min(r):.2f} / {statistics.median(r):.2f} / {max(r):.2f}"

    print(f"{args.total_mib} MiB per transfer, window {args.window}, {args.repeats} repeats, GB/s min / median / max, "
          f"load average "
          f"{os.getloadavg()[0]:.1f}; UCX settings: "
          + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("UCX_")))
    columns = [*kinds, *(["p2p"] if args.device == "cuda" else ["perftest", "perftest-e"])]
    print("| message | " + " | ".join(columns) + f" | kv / {base} |")
    print("| --- " * (len(columns) + 2) + "|")
    for size in sizes:
        # each repeat's kv and baseline ran back to back: their ratio sees one load
        ratios = [kv / pt for kv, pt in zip(rates[(kinds[0], size)], rates[(base, size)], strict=True)]
        print(f"| {size >> 20} MiB | " + " | ".join(cell((name, size)) for name in columns)
              + f" | {min(ratios):.0%} / {statistics.median(ratios):.0%} / {max(ratios):.0%} |")
    for size in sizes:  # every kind's median over the baseline's
        print(f"{size >> 20} MiB, median / {base} median: " + ", ".join(
            f"{name} {statistics.median(rates[(name, size)]) / statistics.median(rates[(base, size)]):.0%}"
            for name in kinds))


if __name__ == "__main__":
    sys.exit(main())
