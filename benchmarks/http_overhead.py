"""What the HTTP face costs: TTFT, ITL and throughput of one workload through `m3sdk serve` (streamed
/v1/completions, the official-client path) against the embedded Engine, at several fixed concurrencies.

    PYTHONPATH=src python benchmarks/http_overhead.py [--model DIR] [--concurrency 1,16,64] [--input-len 256]
        [--output-len 64] [--num-prompts N] [--engine-arg NAME=JSON ...] [--modes embedded,http,http-process]
        [--serve-arg ARG ...] [--out FILE]

Modes: `embedded` (the Engine in this process), `http` (`m3sdk serve --no-engine-process`, its engine core in a
thread beside the HTTP loop), `http-process` (`m3sdk serve`, the core in a process of its own: the server's
default). --serve-arg passes more arguments to every server.

Both modes get the same engine settings (--engine-arg, as `m3sdk bench` / `m3sdk serve` take them) and the same
prompts (random token ids, EOS ignored); each mode loads its own engine (the embedded one in this process, then
the server as a subprocess, never both at once) and warms up at every concurrency before it is measured. Metrics
are m3sdk.bench's (vLLM's names), timed where the client sees each delta: the embedded engine's chunk on its
event loop, the server's SSE event in an httpx client in this process. On Linux the HTTP rows also give the
CPU time of the server's event-loop thread per streamed token (/proc: its main thread; the engine has its own).
`client busy`: the share of the run the measuring loop in this process spent on the CPU (in the embedded mode
that loop also runs the engine's side of the streams); near 100 % the client, not the target, sets the latencies.
--client-procs N spreads the HTTP streams over N client processes (then `client busy` is the busiest one's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx

from m3sdk import Engine, SamplingParams
from m3sdk.bench import BenchRequest, EngineTarget, RequestResult, Target, compute_metrics, random_requests, run_load
from m3sdk.bench_http import HTTPTarget
from m3sdk.config import EngineConfig
from m3sdk.model.config import ModelConfig

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "output_throughput")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="m3-tiny")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, help="per point (default: 4 x concurrency, at least 16)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="NAME=JSON")
    p.add_argument("--modes", default="embedded,http",
                   help="which to run, of embedded, http, http-process (embedded first for the comparison)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for `m3sdk serve` (repeatable; e.g. --serve-arg=--log-level=debug)")
    p.add_argument("--out", type=Path, help="append one JSON line per (mode, concurrency)")
    p.add_argument("--client-procs", type=int, default=1,
                   help="HTTP clients in this many processes, each with its share of the streams (one httpx loop "
                        "saturates near 64 streams)")
    return p.parse_args()


def engine_overrides(args: argparse.Namespace) -> dict:
    out = {"model": args.model, "max_num_seqs": max(int(c) for c in args.concurrency.split(","))}
    for item in args.engine_arg:
        name, _, value = item.partition("=")
        out[name] = json.loads(value)
    return out


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process's main thread: the server's event loop, not its engine thread."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(target: Target, args: argparse.Namespace, vocab: int, server_pid: int | None = None
                  ) -> dict[int, dict]:
    out = {}
    for k, conc in enumerate(int(c) for c in args.concurrency.split(",")):
        n = args.num_prompts or max(16, 4 * conc)
        warm = random_requests(min(n, 2 * conc), args.input_len, args.output_len, 0.0, vocab, 1000 + k)
        await run_load(target, warm, GREEDY, max_concurrency=conc)
        requests = random_requests(n, args.input_len, args.output_len, 0.0, vocab, k)
        cpu = main_thread_cpu_s(server_pid) if server_pid else 0.0
        client = time.thread_time()
        results, duration = await run_load(target, requests, GREEDY, max_concurrency=conc)
        out[conc] = compute_metrics(results, duration, percentiles=(99,))
        # how busy the measuring loop was: near 100 %, the client, not the target, sets the latencies
        out[conc]["client_loop_busy"] = (time.thread_time() - client) / duration
        if server_pid:  # the server loop's CPU time per streamed token (wall-clock free: a loaded machine aside)
            cpu = main_thread_cpu_s(server_pid) - cpu
            out[conc]["loop_cpu_us_per_token"] = 1e6 * cpu / max(1, out[conc]["total_output_tokens"])
    return out


def client_share(base: str, requests: list[BenchRequest], conc: int, start_at: float
                 ) -> tuple[list[RequestResult], float, float, float]:
    """One client process's share of a run, started at wall time `start_at` with its siblings:
    -> (results, start, end, busy share of its loop)."""
    async def run() -> tuple[list[RequestResult], float, float, float]:
        async with HTTPTarget(base) as target:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            t0, cpu = time.time(), time.thread_time()
            results, _ = await run_load(target, requests, GREEDY, max_concurrency=conc)
            t1 = time.time()
            return results, t0, t1, (time.thread_time() - cpu) / (t1 - t0)
    return asyncio.run(run())


def measure_procs(base: str, args: argparse.Namespace, vocab: int, server_pid: int | None) -> dict[int, dict]:
    """`measure` with the streams spread over --client-procs processes (requests dealt round-robin; a concurrency
    below the process count uses that many processes, one stream each: the streams add up to the concurrency)."""
    procs = args.client_procs
    out = {}
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        def run(requests: list[BenchRequest], conc: int) -> tuple[list[RequestResult], float, float]:
            start_at = time.time() + 2.0  # every process has its client open by then
            used = min(procs, conc)
            shares = [pool.submit(client_share, base, requests[i::used], conc // used + (i < conc % used), start_at)
                      for i in range(used)]
            parts = [f.result() for f in shares]
            results = [r for part in parts for r in part[0]]
            return results, max(p[2] for p in parts) - min(p[1] for p in parts), max(p[3] for p in parts)

        for k, conc in enumerate(int(c) for c in args.concurrency.split(",")):
            n = args.num_prompts or max(16, 4 * conc)
            run(random_requests(min(n, 2 * conc), args.input_len, args.output_len, 0.0, vocab, 1000 + k), conc)
            requests = random_requests(n, args.input_len, args.output_len, 0.0, vocab, k)
            cpu = main_thread_cpu_s(server_pid) if server_pid else 0.0
            results, duration, busy = run(requests, conc)
            out[conc] = compute_metrics(results, duration, percentiles=(99,))
            out[conc]["client_loop_busy"] = busy  # the busiest client process
            if server_pid:
                cpu = main_thread_cpu_s(server_pid) - cpu
                out[conc]["loop_cpu_us_per_token"] = 1e6 * cpu / max(1, out[conc]["total_output_tokens"])
    return out


async def embedded(args: argparse.Namespace, overrides: dict, vocab: int) -> dict[int, dict]:
    async with Engine(EngineConfig(**overrides)) as engine:
        return await measure(EngineTarget(engine), args, vocab)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def through_http(args: argparse.Namespace, overrides: dict, vocab: int, serve_args: tuple[str, ...] = ()
                       ) -> dict[int, dict]:
    port = free_port()
    argv = [sys.executable, "-m", "m3sdk.cli", "serve", "--port", str(port), "--log-level", "warning",
            *args.serve_arg, *serve_args]
    for name, value in overrides.items():
        argv += ["--engine-arg", f"{name}={json.dumps(value)}"]
    server = subprocess.Popen(argv, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1800
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"m3sdk serve did not come up (exit {server.poll()})")
            await asyncio.sleep(0.5)
        pid = server.pid if sys.platform == "linux" else None
        if args.client_procs > 1:
            return await asyncio.to_thread(measure_procs, base + "/v1", args, vocab, pid)
        async with HTTPTarget(base + "/v1") as target:
            return await measure(target, args, vocab, pid)
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    args = parse_args()
    overrides = engine_overrides(args)
    vocab = ModelConfig.from_pretrained(EngineConfig(model=args.model).model_path()).vocab_size
    modes = {"embedded": embedded, "http": lambda *a: through_http(*a, serve_args=("--no-engine-process",)),
             "http-process": lambda *a: through_http(*a, serve_args=("--engine-process",))}
    runs = {mode: asyncio.run(modes[mode](args, overrides, vocab)) for mode in args.modes.split(",")}
    header = f"{'conc':>5} {'mode':<13}" + "".join(f"{k:>20}" for k in KEYS) + f"{'loop us/tok':>12}{'client busy':>14}"
    print(header)
    for conc in next(iter(runs.values())):
        for mode in runs:
            m = runs[mode][conc]
            loop = f"{m['loop_cpu_us_per_token']:>12.1f}" if "loop_cpu_us_per_token" in m else f"{'':>12}"
            print(f"{conc:>5} {mode:<13}" + "".join(f"{m[k]:>20.2f}" for k in KEYS) + loop
                  + f"{100 * m['client_loop_busy']:>13.0f}%")
            if args.out is not None:
                with open(args.out, "a") as f:
                    f.write(json.dumps({"mode": mode, "concurrency": conc, "engine": overrides, "input_len":
                                        args.input_len, "output_len": args.output_len, **m}) + "\n")
        if "embedded" not in runs:
            continue
        e = runs["embedded"][conc]
        for mode in [m for m in runs if m != "embedded"]:
            h = runs[mode][conc]
            loop = f"; server loop CPU {h['loop_cpu_us_per_token']:.0f} us/token" if "loop_cpu_us_per_token" in h \
                else ""
            print(f"{conc:>5} {mode + ' adds':<13} TTFT {h['median_ttft_ms'] - e['median_ttft_ms']:+.2f} ms (median), "
                  f"ITL {100 * (h['median_itl_ms'] / e['median_itl_ms'] - 1):+.1f} % (median), "
                  f"throughput {100 * (h['output_throughput'] / e['output_throughput'] - 1):+.1f} %{loop}")


if __name__ == "__main__":
    main()
