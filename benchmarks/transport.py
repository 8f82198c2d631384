"""KV transport rate on this machine vs UCX's own loopback rate, measured in the same run.

    .venv/bin/python benchmarks/transport.py [--total-mib 256] [--message-mib 64 16 4 1] [--repeats 5]

Two processes on 127.0.0.1 move the same bytes each way:
  kv            UcxTransport: a prefill node's pages packed into messages (Outbox), pushed, checked and scattered
                into the decode side's KVPool pages (what a remote prefill costs beyond compute); page tables of
                consecutive pages on both sides (a fresh engine's), and "scattered": random page ids
  ucxx raw      ucxx tag send/recv of the same message sizes on endpoints like the transport's (no UCX peer error
                handling: shared memory between the two processes); receive buffers posted and touched beforehand
  ucxx raw, EH  the same on ucxx's public create_endpoint/create_listener endpoints (peer error handling: TCP)
  perftest      ucx_perftest tag_bw, the same message size (UCX's own C loopback rate; from the libucx wheel);
                "-e" asks it for peer error handling, like ucxx's public endpoints
Rates are GB/s (1e9 bytes/s), from the sender's first pack or send to the receiver's last scatter or receive;
each cell gives min / median / max over the repeats (the machine is shared), after one warm-up round.
The transports each side actually uses are printed by UCX_LOG_LEVEL=info (e.g. "tag(sysv/memory cma/memory)").
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.disagg import loop, wire
from m3sdk.disagg.transport import UcxTransport, _api, _send, _worker

TRANSFER_ID = 4242


def pool_spec(total_bytes: int) -> KVCacheSpec:
    # MiniMax-M3-like page rows at TP 8 (1 KV head of 128, index keys of 128 on every other layer), 8 layers
    probe = KVCacheSpec(num_pages=1, num_layers=8, num_kv_heads=1, head_dim=128, sparse_layers=(1, 3, 5, 7),
                        index_head_dim=128, kv_dtype="bf16")
    return KVCacheSpec(**{**probe.__dict__, "num_pages": max(1, total_bytes // probe.bytes_per_page)})


def plan_for(pool: KVPool, message_bytes: int, transfer_id: int) -> wire.TransferPlan:
    return wire.TransferPlan.build(wire.page_rows(pool), transfer_id, pool.spec.num_pages, pool.spec.num_layers,
                                   message_bytes)


def _sender(conn, total_bytes: int, sizes: list[int], window: int) -> None:
    import ucxx

    torch.set_num_threads(1)
    pool = KVPool(pool_spec(total_bytes))
    for layer in wire.page_rows(pool):
        for t in layer:
            t.random_(0, 256)
    rows = wire.page_rows(pool)
    # a fresh engine's page table is one run of consecutive pages; a long-running one's is scattered
    srcs = {"kv": torch.arange(pool.spec.num_pages), "kv-scattered": torch.randperm(pool.spec.num_pages)}
    transport = UcxTransport(window=window)
    loop.run(transport.start(listen=False))
    conn.send("ready")
    raw_eps: dict[tuple[bool, int], object] = {}
    raw_bufs: dict[int, list] = {}  # touched once, so page faults stay out of the timing
    for size in sizes:
        plan = plan_for(pool, size, TRANSFER_ID)
        raw_bufs[plan.messages[0].nbytes] = [torch.ones(m.nbytes, dtype=torch.uint8).numpy() for m in plan.messages]
    while True:
        what, port, message_bytes, transfer_id = conn.recv()
        if what == "stop":
            return
        plan = plan_for(pool, message_bytes, transfer_id)
        if what in srcs:
            async def kv(port=port, plan=plan, src=srcs[what]):
                start = time.perf_counter()
                outbox = transport.outbox(plan, torch.device("cpu"))
                push = asyncio.ensure_future(transport.push("127.0.0.1", port, outbox))
                for msg in plan.messages:
                    # packed just ahead of the sends (as a node packs while it computes), so the staging
                    # buffers stay within the pool and stay warm
                    while msg.index > outbox.sent + transport.window:
                        await asyncio.sleep(2e-4)
                    outbox.pack([msg], rows, src)
                    await asyncio.sleep(0)
                await push
                return start
            start = loop.run(kv())
        elif what in ("raw", "raw-eh"):
            async def raw(port=port, plan=plan, eh=what == "raw-eh"):
                key = (eh, port)
                if key not in raw_eps:
                    raw_eps[key] = (await ucxx.create_endpoint("127.0.0.1", port) if eh
                                    else _api().UCXEndpoint.create(_worker(), "127.0.0.1", port, False))
                ep = raw_eps[key]
                start = time.perf_counter()
                bufs = raw_bufs[plan.messages[0].nbytes]
                sends = [ep.send(b, tag=plan.tag(i), force_tag=True) if eh else _send(ep, b, plan.tag(i))
                         for i, b in enumerate(bufs)]
                await asyncio.gather(*sends)
                return start
            start = loop.run(raw())
        conn.send(start)


async def _recv_all(plan: wire.TransferPlan, bufs: list) -> None:
    import ucxx

    await asyncio.gather(*(ucxx.recv(b, plan.tag(i)) for i, b in enumerate(bufs)))


def measure(total_bytes: int, sizes: list[int], repeats: int, window: int) -> dict[tuple[str, int], list[float]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child, total_bytes, sizes, window), daemon=True)
    proc.start()
    pool = KVPool(pool_spec(total_bytes))
    rows = wire.page_rows(pool)
    dsts = {"kv": torch.arange(pool.spec.num_pages), "kv-scattered": torch.randperm(pool.spec.num_pages)}
    transport = UcxTransport(window=window)
    loop.run(transport.start(listen=True))
    eh_listener = loop.run(_eh_listener())
    rates: dict[tuple[str, int], list[float]] = {}
    transfer_id = TRANSFER_ID
    parent.recv()  # the sender is set up
    try:
        # the first round warms up (connections, staging buffers' first touch) and is not counted
        for repeat in range(repeats + 1):
            for size in sizes:
                for what, port in (("kv", transport.port), ("kv-scattered", transport.port),
                                   ("raw", transport.port), ("raw-eh", eh_listener.port)):
                    transfer_id += 1
                    plan = plan_for(pool, size, transfer_id)
                    if what in dsts:
                        receive = loop.run(_post(transport, plan, rows, dsts[what]))
                        done = loop.submit(receive.wait())
                    else:
                        bufs = [torch.zeros(m.nbytes, dtype=torch.uint8).numpy() for m in plan.messages]
                        done = loop.submit(_recv_all(plan, bufs))
                    parent.send((what, port, size, transfer_id))
                    done.result()
                    end = time.perf_counter()
                    # from the sender's first pack or send (perf_counter is one clock for all processes of the
                    # host): the command's trip through the pipe is not the transport's
                    rate = plan.total_bytes / (end - parent.recv()) / 1e9
                    if repeat:
                        rates.setdefault((what, size), []).append(rate)
                if repeat:  # interleaved with the others, so each row sees the same load
                    for flags in ((), ("-e",)):
                        rate = perftest(size, max(8, total_bytes // size), flags)
                        rates.setdefault(("perftest" + "".join(flags), size), []).append(rate)
    finally:
        parent.send(("stop", 0, 0, 0))
        proc.join(10)
        loop.run(transport.close())
    return rates


async def _eh_listener():
    import ucxx

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
    env = {**os.environ, "LD_LIBRARY_PATH": f"{root / 'lib'}:{root.parent / 'libucx_cu12.libs'}",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--message-mib", type=int, nargs="+", default=[64, 16, 4, 1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=int, default=UcxTransport().window, help="UcxTransport window")
    args = parser.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    torch.set_num_threads(1)
    sizes = [m << 20 for m in args.message_mib]
    rates = measure(args.total_mib << 20, sizes, args.repeats, args.window)

    def cell(key: tuple[str, int]) -> str:
        r = rates.get(key) or [float("nan")]
        return f"{min(r):.2f} / {statistics.median(r):.2f} / {max(r):.2f}"

    print(f"{args.total_mib} MiB per transfer, window {args.window}, {args.repeats} repeats, GB/s min / median / max, "
          f"load average "
          f"{os.getloadavg()[0]:.1f}; UCX settings: "
          + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("UCX_")))
    columns = ("kv", "kv-scattered", "raw", "raw-eh", "perftest", "perftest-e")
    print("| message | kv transport | kv, scattered pages | ucxx raw | ucxx raw, EH | perftest | perftest -e "
          "| kv / perftest |")
    print("| --- " * (len(columns) + 2) + "|")
    for size in sizes:
        # each repeat's kv and perftest ran back to back: their ratio sees one load
        ratios = [kv / pt for kv, pt in zip(rates[("kv", size)], rates[("perftest", size)], strict=True)]
        print(f"| {size >> 20} MiB | " + " | ".join(cell((name, size)) for name in columns)
              + f" | {min(ratios):.0%} / {statistics.median(ratios):.0%} / {max(ratios):.0%} |")


if __name__ == "__main__":
    sys.exit(main())
