"""KV transport rate on this machine vs UCX's own loopback rate, measured in the same run.

    .venv/bin/python benchmarks/transport.py [--total-mib 256] [--message-mib 64 16 4 1] [--repeats 5]
    python benchmarks/transport.py --device cuda [--gpus 0,1] [--out DIR]    # two GPUs of one host

On GPUs the sender (prefill side) holds its pool on the first GPU of --gpus and the receiver (decode side) on the
second, each process with its own GPU listed first in CUDA_VISIBLE_DEVICES (ucxx's progress thread makes device
0 current); the pool is FP8 (K, V, their scales, index keys: what a remote prefill moves), and the baseline is
  p2p           a torch peer-to-peer copy_ of the same number of bytes, sender GPU -> receiver GPU, in one tensor
(no perftest, no "EH" rows). The first round checks every received page byte for byte before anything is timed.

Two processes on 127.0.0.1 move the same bytes each way:
  kv            UcxTransport: a prefill node's pages packed into messages (Outbox), pushed, checked and put into
                the decode side's KVPool pages (what a remote prefill costs beyond compute), page tables of
                consecutive pages on both sides (a fresh engine's): each message's runs of pages move as one
                _foreach_copy_ on each side (wire.py)
  kv staged     the same pages, the plan built without the destination pages (the decode side scatters with
                one index kernel per tensor)
  kv scattered  random page ids on both sides (index kernels on both sides)
  ucxx raw      ucxx tag send/recv of the same message sizes on endpoints like the transport's (no UCX peer error
                handling: shared memory between the two processes); receive buffers posted and touched beforehand
  ucxx raw, EH  the same on ucxx's public create_endpoint/create_listener endpoints (peer error handling: TCP)
  perftest      ucx_perftest tag_bw, the same message size (UCX's own C loopback rate; from the libucx wheel);
                "-e" asks it for peer error handling, like ucxx's public endpoints
Rates are GB/s (1e9 bytes/s), from the sender's first pack or send to the receiver's last scatter or receive;
each cell gives min / median / max over the repeats (the machine is shared), after one warm-up round.
The transports each side actually uses are printed by UCX_LOG_LEVEL=info (e.g. "tag(sysv/memory cma/memory)").
Every wait has a deadline (--step-timeout): a transfer that does not finish, or a sender process that dies (a
CUDA buffer UCX took for host memory kills it with SIGSEGV), ends the run with a message instead of a hang.
"""

from __future__ import annotations

import argparse
import asyncio
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
import time
from pathlib import Path

import torch

from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.disagg import loop, wire
from m3sdk.disagg.transport import UcxTransport, _api, _send, _worker

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


def page_tables(num_pages: int, device: torch.device) -> dict[str, torch.Tensor]:
    # a fresh engine's page table is one run of consecutive pages; a long-running one's is scattered (the same
    # permutations in both processes, so the receiver can check where each page landed)
    gen = torch.Generator().manual_seed(7)
    return {"kv": torch.arange(num_pages, device=device), "kv-staged": torch.arange(num_pages, device=device),
            "kv-scattered": torch.randperm(num_pages, generator=gen).to(device)}


def plan_pages(what: str, dsts: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The destination pages the plan is built with: "kv-staged" leaves them out (scattered by index)."""
    return None if what == "kv-staged" else dsts.get(what)


def plan_for(pool: KVPool, message_bytes: int, transfer_id: int,
             dst: torch.Tensor | None = None) -> wire.TransferPlan:
    """The transfer's plan; with the destination pages `dst` as a remote prefill builds it (their runs scattered
    as runs), without them as plain messages (the raw rows, and "kv-staged")."""
    return wire.TransferPlan.build(wire.page_rows(pool), transfer_id, pool.spec.num_pages, pool.spec.num_layers,
                                   message_bytes, None if dst is None else dst.tolist())


def _sender(conn, total_bytes: int, sizes: list[int], window: int, device: str, step_timeout: float) -> None:
    import ucxx

    torch.set_num_threads(1)
    pool = KVPool(pool_spec(total_bytes, device))
    rows = wire.page_rows(pool)
    fill(rows)
    dev = rows[0][0].device
    dsts = page_tables(pool.spec.num_pages, dev)  # the receiver's
    # sources and destinations differ; source ids on the host, as a node holds them (pack finds their runs there)
    srcs = {k: v.cpu() for k, v in dict(dsts, **{"kv-scattered": dsts["kv-scattered"].roll(1)}).items()}
    transport = UcxTransport(window=window)
    loop.run(transport.start(listen=False), step_timeout)
    conn.send("ready")
    raw_eps: dict[tuple[bool, int], object] = {}
    raw_bufs: dict[int, list] = {}  # touched once, so page faults stay out of the timing
    for size in sizes:
        plan = plan_for(pool, size, TRANSFER_ID)
        raw_bufs[plan.messages[0].nbytes] = [_host_or_device(torch.ones(m.nbytes, dtype=torch.uint8, device=dev))
                                             for m in plan.messages]
    while True:
        what, port, message_bytes, transfer_id = conn.recv()
        if what == "stop":
            return
        plan = plan_for(pool, message_bytes, transfer_id, plan_pages(what, dsts))
        if what in srcs:
            async def kv(port=port, plan=plan, src=srcs[what]):
                start = time.perf_counter()
                outbox = transport.outbox(plan, dev)
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
            start = loop.run(kv(), step_timeout)
        elif what in ("raw", "raw-eh"):
            async def raw(port=port, plan=plan, eh=what == "raw-eh"):
                key = (eh, port)
                if key not in raw_eps:
                    raw_eps[key] = (await ucxx.create_endpoint("127.0.0.1", port) if eh
                                    else _api().UCXEndpoint.create(_worker(), "127.0.0.1", port, False))
                ep = raw_eps[key]
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                start = time.perf_counter()
                bufs = raw_bufs[plan.messages[0].nbytes]
                sends = [ep.send(b, tag=plan.tag(i), force_tag=True) if eh else _send(ep, b, plan.tag(i))
                         for i, b in enumerate(bufs)]
                await asyncio.gather(*sends)
                return start
            start = loop.run(raw(), step_timeout)
        conn.send(start)


def _host_or_device(t: torch.Tensor):
    return t if t.is_cuda else t.numpy()


async def _recv_all(plan: wire.TransferPlan, bufs: list) -> None:
    import ucxx

    await asyncio.gather(*(ucxx.recv(b, plan.tag(i)) for i, b in enumerate(bufs)))


def _visible(first: str, second: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = f"{first},{second}"


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


def measure(total_bytes: int, sizes: list[int], repeats: int, window: int, device: str,
            gpus: tuple[str, str], step_timeout: float = 60.0) -> dict[tuple[str, int], list[float]]:
    import ucxx

    cuda = device == "cuda"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child, total_bytes, sizes, window, device, step_timeout), daemon=True)
    if cuda:  # each process sees its own GPU as cuda:0 and the other one as cuda:1
        _visible(*gpus)
    proc.start()
    if cuda:
        _visible(gpus[1], gpus[0])
    pool = KVPool(pool_spec(total_bytes, device))
    rows = wire.page_rows(pool)
    dev = rows[0][0].device
    dsts = page_tables(pool.spec.num_pages, dev)
    transport = UcxTransport(window=window)
    loop.run(transport.start(listen=True), step_timeout)
    print("UCX transports:", " ".join(sorted(ucxx.get_active_transports())), flush=True)
    eh_listener = None if cuda else loop.run(_eh_listener(), step_timeout)
    kinds = ("kv", "kv-staged", "kv-scattered", "raw") + (() if cuda else ("raw-eh",))
    rates: dict[tuple[str, int], list[float]] = {}
    transfer_id = TRANSFER_ID
    _reply(parent, proc, "sender start", 2 * step_timeout)  # the sender is set up (CUDA, UCX)
    try:
        # the first round warms up (connections, staging buffers' first touch) and is not counted
        for repeat in range(repeats + 1):
            for size in sizes:
                for what in kinds:
                    port = eh_listener.port if what == "raw-eh" else transport.port
                    transfer_id += 1
                    plan = plan_for(pool, size, transfer_id, plan_pages(what, dsts))
                    if what in dsts:
                        for layer in rows if not repeat else ():  # the check below sees this transfer's bytes
                            for t in layer:
                                t.zero_()
                        receive = loop.run(_post(transport, plan, rows, dsts[what]), step_timeout)
                        done = loop.submit(receive.wait())
                    else:
                        bufs = [_host_or_device(torch.zeros(m.nbytes, dtype=torch.uint8, device=dev))
                                for m in plan.messages]
                        if cuda:
                            torch.cuda.synchronize(dev)
                        done = loop.submit(_recv_all(plan, bufs))
                    parent.send((what, port, size, transfer_id))
                    step = f"{what} {size >> 20} MiB round {repeat}"
                    _result(done, proc, step, step_timeout)
                    end = time.perf_counter()
                    if what in dsts and not repeat:
                        check(rows, dsts[what], what)
                    # from the sender's first pack or send (perf_counter is one clock for all processes of the
                    # host): the command's trip through the pipe is not the transport's
                    rate = plan.total_bytes / (end - _reply(parent, proc, step, step_timeout)) / 1e9
                    if repeat:
                        rates.setdefault((what, size), []).append(rate)
                if repeat and cuda:
                    rates.setdefault(("p2p", size), []).append(p2p(plan.total_bytes, dev))
                elif repeat:  # interleaved with the others, so each row sees the same load
                    for flags in ((), ("-e",)):
                        rate = perftest(size, max(8, total_bytes // size), flags)
                        rates.setdefault(("perftest" + "".join(flags), size), []).append(rate)
    finally:
        with contextlib.suppress(OSError):
            parent.send(("stop", 0, 0, 0))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        loop.run(transport.close(), step_timeout)
    return rates


def check(rows: list[list[torch.Tensor]], dst: torch.Tensor, what: str) -> None:
    """Every received page byte for byte: the sender's pattern of page src[i] sits in page dst[i]."""
    src = page_tables(len(dst), dst.device)[what]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--message-mib", type=int, nargs="+", default=[64, 16, 4, 1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=int, default=UcxTransport().window, help="UcxTransport window")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gpus", default="0,1", help="sender GPU, receiver GPU (physical ids)")
    parser.add_argument("--out", type=Path, help="append the rows to OUT/disagg.jsonl")
    parser.add_argument("--step-timeout", type=float, default=60.0, help="seconds any one wait may take")
    args = parser.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    torch.set_num_threads(1)
    sizes = [m << 20 for m in args.message_mib]
    gpus = tuple(args.gpus.split(","))
    rates = measure(args.total_mib << 20, sizes, args.repeats, args.window, args.device, gpus, args.step_timeout)
    base = "p2p" if args.device == "cuda" else "perftest"
    if args.out is not None:
        with open(args.out / "disagg.jsonl", "a") as f:
            for (name, size), r in sorted(rates.items()):
                f.write(json.dumps({"bench": "transport", "device": args.device, "what": name, "total_mib":
                                    args.total_mib, "message_mib": size >> 20, "window": args.window,
                                    "gbps": r}) + "\n")

    def cell(key: tuple[str, int]) -> str:
        r = rates.get(key) or [float("nan")]
        return f"{min(r):.2f} / {statistics.median(r):.2f} / {max(r):.2f}"

    print(f"{args.total_mib} MiB per transfer, window {args.window}, {args.repeats} repeats, GB/s min / median / max, "
          f"load average "
          f"{os.getloadavg()[0]:.1f}; UCX settings: "
          + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("UCX_")))
    columns = ("kv", "kv-staged", "kv-scattered", "raw") + (
        ("p2p",) if args.device == "cuda" else ("raw-eh", "perftest", "perftest-e"))
    print("| message | " + " | ".join(columns) + f" | kv / {base} |")
    print("| --- " * (len(columns) + 2) + "|")
    for size in sizes:
        # each repeat's kv and baseline ran back to back: their ratio sees one load
        ratios = [kv / pt for kv, pt in zip(rates[("kv", size)], rates[(base, size)], strict=True)]
        print(f"| {size >> 20} MiB | " + " | ".join(cell((name, size)) for name in columns)
              + f" | {min(ratios):.0%} / {statistics.median(ratios):.0%} / {max(ratios):.0%} |")


if __name__ == "__main__":
    sys.exit(main())
