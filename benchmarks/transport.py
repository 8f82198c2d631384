"""KV transport rate on this machine vs UCX's own loopback rate, measured in the same run.

    .venv/bin/python benchmarks/transport.py [--total-mib 256] [--message-mib 64] [--repeats 3]

Three numbers over 127.0.0.1 between two processes, the same bytes each time:
  kv        UcxTransport: a prefill node's pages packed into messages, pushed, checked and scattered into the
            decode side's KVPool pages (what a remote prefill costs beyond compute)
  ucxx      raw ucxx tag send/recv of the same message sizes (the Python binding's ceiling)
  perftest  ucx_perftest tag_bw of the same message size (UCX's own C loopback rate; from the libucx wheel)
Rates are GB/s (1e9 bytes/s), best of the repeats (the machine is shared; the best is the least disturbed).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.disagg import loop, wire
from m3sdk.disagg.transport import UcxTransport

TRANSFER_ID = 4242


def pool_spec(total_bytes: int) -> KVCacheSpec:
    # MiniMax-M3-like page rows at TP 8 (1 KV head of 128, index keys of 128 on every other layer), 8 layers
    probe = KVCacheSpec(num_pages=1, num_layers=8, num_kv_heads=1, head_dim=128, sparse_layers=(1, 3, 5, 7),
                        index_head_dim=128, kv_dtype="bf16")
    return KVCacheSpec(**{**probe.__dict__, "num_pages": max(1, total_bytes // probe.bytes_per_page)})


def plan_for(pool: KVPool, message_bytes: int) -> wire.TransferPlan:
    return wire.TransferPlan.build(wire.page_rows(pool), TRANSFER_ID, pool.spec.num_pages, pool.spec.num_layers,
                                   message_bytes)


def _sender(conn, total_bytes: int, message_bytes: int) -> None:
    import ucxx

    pool = KVPool(pool_spec(total_bytes))
    for layer in wire.page_rows(pool):
        for t in layer:
            t.random_(0, 256)
    rows, plan = wire.page_rows(pool), plan_for(pool, message_bytes)
    src = torch.arange(pool.spec.num_pages)
    transport = UcxTransport()
    loop.run(transport.start(listen=False))
    while True:
        what, port = conn.recv()
        if what == "kv":
            loop.run(transport.push("127.0.0.1", port, plan, rows, src))
        elif what == "raw":
            async def raw(port=port):
                ep = await ucxx.create_endpoint("127.0.0.1", port)
                bufs = [torch.empty(m.nbytes, dtype=torch.uint8).numpy() for m in plan.messages]
                for i, b in enumerate(bufs):
                    await ep.send(b, tag=plan.tag(i), force_tag=True)
                await ep.close()
            loop.run(raw())
        else:
            return
        conn.send("sent")


def measure(total_bytes: int, message_bytes: int, repeats: int) -> dict[str, float]:
    import ucxx

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child, total_bytes, message_bytes), daemon=True)
    proc.start()
    pool = KVPool(pool_spec(total_bytes))
    rows, plan = wire.page_rows(pool), plan_for(pool, message_bytes)
    dst = torch.arange(pool.spec.num_pages)
    transport = UcxTransport()
    loop.run(transport.start(listen=True))
    best = {"kv": 0.0, "ucxx": 0.0}
    try:
        for _ in range(repeats):
            receive = loop.run(_post(transport, plan, rows, dst))
            t0 = time.perf_counter()
            parent.send(("kv", transport.port))
            loop.run(receive.wait())
            best["kv"] = max(best["kv"], plan.total_bytes / (time.perf_counter() - t0) / 1e9)
            parent.recv()

            bufs = [torch.empty(m.nbytes, dtype=torch.uint8).numpy() for m in plan.messages]

            async def recv_all(bufs=bufs):
                await asyncio.gather(*(ucxx.recv(b, plan.tag(i)) for i, b in enumerate(bufs)))
            fut = loop.submit(recv_all())
            t0 = time.perf_counter()
            parent.send(("raw", transport.port))
            fut.result()
            best["ucxx"] = max(best["ucxx"], plan.total_bytes / (time.perf_counter() - t0) / 1e9)
            parent.recv()
    finally:
        parent.send(("stop", 0))
        proc.join(10)
        loop.run(transport.close())
    best["perftest"] = perftest(message_bytes, max(4, total_bytes // message_bytes), repeats)
    best["bytes"] = plan.total_bytes
    best["messages"] = len(plan.messages)
    return best


async def _post(transport: UcxTransport, plan, rows, dst):
    return transport.receive(plan, rows, dst)


def perftest(message_bytes: int, iterations: int, repeats: int) -> float:
    import libucx

    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    if not binary.exists():
        return float("nan")
    env = {**os.environ, "LD_LIBRARY_PATH": f"{root / 'lib'}:{root.parent / 'libucx_cu12.libs'}",
           "UCX_WARN_UNUSED_ENV_VARS": "n"}
    best = 0.0
    for r in range(repeats):
        port = str(13000 + os.getpid() % 1000 + r)
        server = subprocess.Popen([binary, "-p", port], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        out = subprocess.run([binary, "127.0.0.1", "-p", port, "-t", "tag_bw", "-s", str(message_bytes),
                              "-n", str(iterations)], env=env, capture_output=True, text=True, timeout=120).stdout
        server.wait(30)
        final = re.search(r"Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)", out)
        if final:
            best = max(best, float(final.group(1)) * 2**20 / 1e9)  # perftest MB are 2^20 bytes
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--message-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    r = measure(args.total_mib << 20, args.message_mib << 20, args.repeats)
    print(f"{r['bytes'] / 2**20:.0f} MiB in {r['messages']} messages of <= {args.message_mib} MiB, "
          f"best of {args.repeats}, GB/s:")
    print(f"  kv transport (pack, push, check, scatter) {r['kv']:.2f}")
    print(f"  raw ucxx tag send/recv                    {r['ucxx']:.2f}")
    print(f"  ucx_perftest tag_bw (C)                   {r['perftest']:.2f}")
    print(f"  kv / perftest = {r['kv'] / r['perftest']:.0%}   kv / raw ucxx = {r['kv'] / r['ucxx']:.0%}")


if __name__ == "__main__":
    sys.exit(main())
