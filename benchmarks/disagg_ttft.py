"""Time to first token of long prompts: disaggregated (a prefill node on one GPU, the decode Engine on another)
vs colocated (the same decode Engine prefilling on its own GPU), with a greedy correctness check first.

    python benchmarks/disagg_ttft.py --model CKPT [--lengths 8192 32768] [--repeats 3] [--gpus 0,1] [--out DIR]

The prefill node is a process of its own (EngineBackend + PrefillNode, as `m3sdk prefill-node` runs) on the first
GPU of --gpus, the decode Engine runs in this process on the second; each process sees its own GPU as cuda:0 and
the other as cuda:1 (CUDA_VISIBLE_DEVICES), as ucxx expects (its progress thread makes device 0 current). Both
engines have the same settings (FP8 KV cache and index keys, no CUDA graphs: they only shorten decode steps).
"Colocated" is the same Engine with remote prefill switched off (its threshold raised past every prompt), so
both modes share one model load and one GPU for decode. Prefix caching is off, so every run computes (or
receives) its whole prompt.

1. Correctness: one greedy prompt longer than the index's top-k blocks (so the index keys matter) generated
   remotely and locally must give the same tokens (and the remote one must really have gone remote).
2. TTFT: random prompts (distinct, so no prefix cache hits) of each length, warm-up of each mode and length,
   then `repeats` pairs, the modes alternating. TTFT is from the call to the first streamed token.
Prints a table; with --out appends each row to OUT/disagg.jsonl as it is measured.
--phases adds, per timed run, a timeline of the request's phases in both processes (Phases, below) to the rows.
Every wait has a deadline: the node's start (--start-timeout), each generation (--step-timeout), each remote
prefill (--prefill-timeout, the engine's own deadline, with prefill_fallback="error" so a failed remote prefill
ends the run rather than being timed as a local one); a prefill node that dies ends the run at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc.aio
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from m3sdk import Engine, SamplingParams  # noqa: E402
from m3sdk.config import EngineConfig  # noqa: E402

OFF = 1 << 40  # remote_prefill_min_tokens that no prompt reaches: colocated


def engine_settings(args) -> dict:
    cuda = args.device == "cuda"
    return dict(model=str(args.model), device="cuda:0" if cuda else "cpu", kv_cache_dtype="fp8" if cuda else "auto",
                # one prompt at a time is what is timed; the engine warms up batches up to max_num_seqs only, so one
                # sequence means fewer shapes to compile before it serves (its start took 40 s of a window's 220)
                cuda_graphs=False, max_model_len=max(*args.lengths, args.check_len) + 64, max_num_seqs=1,
                max_num_batched_tokens=args.chunk, gpu_memory_fraction=0.8,
                enable_prefix_caching=False)  # every run computes (or receives) its whole prompt


def _dump_stacks(every: float) -> None:
    """Every `every` s, every thread's stack to stderr (0: never): where a run that outlives its window spends it."""
    if every > 0:
        faulthandler.dump_traceback_later(every, repeat=True, file=sys.stderr)


class Phases:
    """--phases: host timestamps (perf_counter: one clock for the processes of a host) of one request's way through
    both processes, taken by wrapping the code each phase ends in, as (name, seconds). Decode process: the call
    (submit), the remote prefill started by the engine thread (d.start), its job on the disagg loop (d.job), the
    transfer found in place or staged (d.pieces / d.staged), the Prefill call made (d.call), the receive made right
    after (d.receive) and each of its messages posted (d.post), the receive complete (d.received), the reply checked
    (d.reply: the call and the receive both ended), the outcome taken by the engine thread (d.poll), each engine
    step's end (d.step), the first token at the caller (first). Node process: the Prefill handler entered (n.rpc),
    the call checked (n.checked), the work started (n.serve), the request handed to its engine (n.submit), each step
    planned (n.plan), each group of layers packed (n.pack) and each message's first send posted (n.send0), the
    sampled request finishing (n.finish0) and its in-place sends released (n.finish1), its chunk emitted (n.emit),
    the push done (n.pushed), the reply returned (n.reply)."""

    events: list[tuple[str, float]] = []

    @classmethod
    def note(cls, name: str) -> None:
        cls.events.append((name, time.perf_counter()))

    @classmethod
    def take(cls) -> list[tuple[str, float]]:
        events, cls.events = cls.events, []
        return events

    @classmethod
    def _wrap(cls, owner, attr: str, before: str | None = None, after: str | None = None) -> None:
        inner = getattr(owner, attr)
        if asyncio.iscoroutinefunction(inner):
            async def wrapped(*args, **kwargs):
                if before:
                    cls.note(before)
                try:
                    return await inner(*args, **kwargs)
                finally:
                    if after:
                        cls.note(after)
        else:
            def wrapped(*args, **kwargs):
                if before:
                    cls.note(before)
                try:
                    return inner(*args, **kwargs)
                finally:
                    if after:
                        cls.note(after)
        setattr(owner, attr, wrapped)

    @classmethod
    def install_decode(cls) -> None:
        from m3sdk.core import EngineCore
        from m3sdk.disagg import client, remote, ucx_receive, ucx_transport

        cls._wrap(remote.RemotePrefill, "admit", after="d.start")
        cls._wrap(client.PrefillClient, "_job", before="d.job")
        call = grpc.aio._channel.UnaryUnaryMultiCallable.__call__

        def traced_call(self, *args, **kwargs):
            if self._method.endswith(b"/Prefill"):
                cls.note("d.call")
            return call(self, *args, **kwargs)

        grpc.aio._channel.UnaryUnaryMultiCallable.__call__ = traced_call
        cls._wrap(ucx_receive.UcxReceive, "_post", after="d.post")
        long_runs = client.long_runs

        def traced_long_runs(pages):  # whether the transfer is a plan of pieces (in place) or staged
            runs = long_runs(pages)
            cls.note("d.pieces" if runs is not None else "d.staged")
            return runs

        client.long_runs = traced_long_runs
        cls._wrap(ucx_transport.UcxTransport, "receive", after="d.receive")
        cls._wrap(ucx_receive.UcxReceive, "wait", after="d.received")
        cls._wrap(client, "check_reply", before="d.reply")
        handovers = remote.RemotePrefill.handovers

        def traced_handovers(self):
            out = handovers(self)
            if out:
                cls.note("d.poll")
            return out

        remote.RemotePrefill.handovers = traced_handovers
        cls._wrap(EngineCore, "step", after="d.step")

    @classmethod
    def install_node(cls) -> None:
        from m3sdk.disagg import backend, server, ucp, ucx_api, ucx_transport

        cls._wrap(server.PrefillServicer, "Prefill", before="n.rpc", after="n.reply")
        cls._wrap(server, "check_prefill", after="n.checked")
        cls._wrap(server.PrefillServicer, "_serve", before="n.serve")
        cls._wrap(backend.EngineBackend, "prefill", before="n.submit")
        cls._wrap(backend.EngineBackend, "_on_plan", before="n.plan")
        cls._wrap(backend.EngineBackend, "_pack", after="n.pack")
        cls._wrap(backend.EngineBackend, "_on_finish", before="n.finish0", after="n.finish1")
        emit = backend.EngineBackend._emit

        def traced_emit(self, chunks):
            if any(c.finish_reason is not None for c in chunks):
                cls.note("n.emit")
            emit(self, chunks)

        backend.EngineBackend._emit = traced_emit
        cls._wrap(ucx_transport.UcxTransport, "push", after="n.pushed")
        cls._wrap(ucp, "send", before="n.send0")  # a plan of pieces' message
        cls._wrap(ucx_api, "start_send", before="n.send0")  # a staged message

    @staticmethod
    def serve(conn) -> None:
        """In the node process: answer each request on `conn` with the events noted since the last one."""
        def run() -> None:
            with contextlib.suppress(EOFError, OSError):
                while conn.recv() is not None:
                    conn.send(Phases.take())
        threading.Thread(target=run, name="phases", daemon=True).start()

    @staticmethod
    def timeline(events: list[tuple[str, float]], start: float) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for name, t in sorted(events, key=lambda e: e[1]):
            out.setdefault(name, []).append(round((t - start) * 1e3, 2))
        return out


def _node(conn, settings: dict, listen: str, dump_every: float = 0.0, phases: bool = False) -> None:
    from m3sdk.disagg.backend import EngineBackend
    from m3sdk.node import PrefillNode

    _dump_stacks(dump_every)
    if phases:  # before the backend binds its hooks
        Phases.install_node()
    backend = EngineBackend(EngineConfig(**settings))
    node = PrefillNode(backend, listen).start()
    conn.send(node.address)
    if phases:
        Phases.serve(conn)
    try:
        node.serve_until_signal(grace=2.0)
    finally:
        backend.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def first_token_s(engine: Engine, ids: list[int], max_tokens: int = 2) -> tuple[float, list[int]]:
    start = time.perf_counter()
    Phases.events.append(("submit", start))
    ttft, tokens = None, []
    async for chunk in engine.stream(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - start
            Phases.note("first")
        tokens += chunk.token_ids
    return ttft, tokens


async def bounded(engine: Engine, ids: list[int], node: mp.Process, timeout: float,
                  max_tokens: int = 2) -> tuple[float, list[int]]:
    """first_token_s within `timeout` s; a dead prefill node ends the wait at once."""
    task = asyncio.ensure_future(first_token_s(engine, ids, max_tokens))
    deadline = time.monotonic() + timeout
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and (not node.is_alive() or time.monotonic() > deadline):
            task.cancel()
            why = (f"the prefill node died (exit code {node.exitcode}; -11 is SIGSEGV)" if not node.is_alive()
                   else f"no answer in {timeout:.0f} s")
            raise SystemExit(f"a {len(ids)}-token prompt: {why}")
    return task.result()


async def run(args, address: str, node: mp.Process, conn) -> list[dict]:
    rows = []
    if args.phases:
        Phases.install_decode()
        conn.recv()  # the node's address, sent when it serves

    def node_phases() -> list[tuple[str, float]]:
        conn.send(True)
        if not conn.poll(10):
            raise SystemExit("the prefill node sent no phases in 10 s")
        return conn.recv()

    def record(**row) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out is not None:  # as they come: a run cut short keeps what it measured
            with open(args.out / "disagg.jsonl", "a") as f:
                f.write(json.dumps({"bench": "disagg_ttft", "model": str(args.model), **row}) + "\n")

    gen = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    async with Engine(**engine_settings(args), prefill_nodes=(address,), remote_prefill_min_tokens=1024,
                      prefill_timeout=args.prefill_timeout, prefill_fallback="error") as engine:
        core = engine._core
        remote = engine._admission
        while not remote.client.has_healthy_node:  # the node may still be loading: the heartbeat retries it
            if not node.is_alive():
                raise SystemExit(f"the prefill node died while starting (exit code {node.exitcode})")
            if time.perf_counter() - t > args.start_timeout:
                raise SystemExit(f"the prefill node was not healthy within {args.start_timeout:.0f} s: "
                                 f"{remote.client.node_states()}")
            await asyncio.sleep(0.5)
        record(step="start", seconds=round(time.perf_counter() - t, 1))
        vocab = core.vocab_size

        def prompt(n: int) -> list[int]:
            return torch.randint(0, vocab, (n,), generator=gen).tolist()

        def mode(name: str) -> None:
            remote.min_tokens = 1 if name == "disaggregated" else OFF

        # 1. correctness: remote prefill (KV, FP8 scales, index keys over UCX) == local prefill, greedy
        ids = prompt(args.check_len)
        t = time.perf_counter()
        before = remote.num_remote
        mode("disaggregated")
        first, disagg = await bounded(engine, ids, node, args.step_timeout, args.check_tokens)
        record(step="check-run", mode="disaggregated", prompt_tokens=len(ids), first_token_s=round(first, 2),
               seconds=round(time.perf_counter() - t, 1))
        went_remote = remote.num_remote == before + 1
        mode("colocated")
        t1 = time.perf_counter()
        first, local = await bounded(engine, ids, node, args.step_timeout, args.check_tokens)
        record(step="check-run", mode="colocated", prompt_tokens=len(ids), first_token_s=round(first, 2),
               seconds=round(time.perf_counter() - t1, 1))
        record(step="check", seconds=round(time.perf_counter() - t, 1), prompt_tokens=len(ids),
               went_remote=went_remote, identical=disagg == local,
               same_prefix=next((i for i, (a, b) in enumerate(zip(disagg, local, strict=False)) if a != b),
                                len(local)),
               disagg=disagg, colocated=local)

        # 2. TTFT
        for n in args.lengths:
            for name in ("disaggregated", "colocated"):  # warm-up: JIT compiles for this length
                mode(name)
                t = time.perf_counter()
                await bounded(engine, prompt(n), node, args.step_timeout)
                record(step="warm-up", mode=name, prompt_tokens=n, seconds=round(time.perf_counter() - t, 1))
            times: dict[str, list[float]] = {"disaggregated": [], "colocated": []}
            for _ in range(args.repeats):
                for name in times:
                    mode(name)
                    before = remote.num_remote
                    if args.phases:
                        Phases.take()
                        node_phases()
                    ttft, _ = await bounded(engine, prompt(n), node, args.step_timeout)
                    if (remote.num_remote > before) != (name == "disaggregated"):
                        raise SystemExit(f"{name} run of {n} tokens went the wrong way (remote fallback?)")
                    times[name].append(ttft)
                    if args.phases:
                        await asyncio.sleep(0.05)  # the second token's step (max_tokens=2) and the node's end
                        events = Phases.take() + node_phases()
                        start = next(t for e, t in events if e == "submit")
                        record(step="phases", mode=name, prompt_tokens=n, ttft_s=round(ttft, 4),
                               ms=Phases.timeline(events, start))
            for name, ts in times.items():
                record(step="ttft", mode=name, prompt_tokens=n, ttft_s=ts, median_s=statistics.median(ts))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens of both engines")
    parser.add_argument("--check-len", type=int, default=4096)
    parser.add_argument("--check-tokens", type=int, default=16)
    parser.add_argument("--gpus", default="0,1", help="prefill node GPU, decode GPU (physical ids)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke test of the script")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--start-timeout", type=float, default=120.0, help="s for the node to load and answer")
    parser.add_argument("--step-timeout", type=float, default=90.0, help="s for one generation (JIT included)")
    parser.add_argument("--prefill-timeout", type=float, default=60.0, help="the engine's deadline per remote prefill")
    parser.add_argument("--phases", action="store_true", help="a timeline of each timed run's phases in both "
                        "processes (ms from the call), as rows")
    parser.add_argument("--dump-every", type=float, default=0.0,
                        help="dump every thread's stack of both processes to stderr every this many seconds")
    args = parser.parse_args()
    _dump_stacks(args.dump_every)
    first, second = args.gpus.split(",")
    listen = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    os.environ["CUDA_VISIBLE_DEVICES"] = f"{first},{second}"
    node = ctx.Process(target=_node, args=(child, engine_settings(args), listen, args.dump_every, args.phases),
                       daemon=True)
    node.start()
    os.environ["CUDA_VISIBLE_DEVICES"] = f"{second},{first}"  # before this process touches CUDA
    try:
        rows = asyncio.run(run(args, listen, node, parent))
    finally:
        if node.is_alive():
            os.kill(node.pid, signal.SIGTERM)
            node.join(20)
        if node.is_alive():
            node.kill()
    print("| prompt tokens | TTFT disaggregated s (min / median / max) | colocated | disaggregated / colocated |")
    print("| --- | --- | --- | --- |")
    for n in args.lengths:
        d, c = ([r for r in rows if r.get("step") == "ttft" and r["prompt_tokens"] == n and r["mode"] == m][0]
                ["ttft_s"] for m in ("disaggregated", "colocated"))
        print(f"| {n} | {min(d):.3f} / {statistics.median(d):.3f} / {max(d):.3f} | {min(c):.3f} / "
              f"{statistics.median(c):.3f} / {max(c):.3f} | {statistics.median(d) / statistics.median(c):.2f} |")


if __name__ == "__main__":
    main()
