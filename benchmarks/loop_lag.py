"""Event-loop lag of the application while the engine generates: does the engine stall its host's loop?

    .venv/bin/python benchmarks/loop_lag.py [--model m3-tiny|PATH] [--streams 64] [--max-tokens 128]
                                            [--interval-ms 1] [--torch-threads 1]

A ticker task sleeps `--interval-ms` in a loop and records how late each wake-up is; meanwhile `--streams`
concurrent `engine.stream(...)` consumers generate on the CPU. Reports the ticker's lag p50/p99/max, and the
generation throughput, as one JSON line. The target is p99 <= 5 ms.

On Linux it also reads the loop thread's run-queue wait (/proc/self/task/<tid>/schedstat) around each tick:
the part of the lag when the thread was ready but the OS ran something else (other processes on a shared
machine). `own_lag_ms_*` is the lag without that part: what this process (the GIL, the loop's own work) costs.
`loop_cpu_ms_per_step` is the CPU time of the loop's thread during generation (the ticker's included) per engine
step: the loop's own work, which other processes on the machine do not change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time
from pathlib import Path

import torch

from m3sdk import Engine


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def runqueue_wait_s() -> float:
    """Seconds this thread has spent ready to run but not running (0 where schedstat is unavailable)."""
    try:
        return int(Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()[1]) / 1e9
    except OSError:
        return 0.0


async def ticker(interval: float, lags: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """Appends (lag, run-queue wait during it) per tick."""
    while not stop.is_set():
        waited = runqueue_wait_s()
        start = time.perf_counter()
        await asyncio.sleep(interval)
        lag = time.perf_counter() - start - interval
        lags.append((lag, runqueue_wait_s() - waited))


async def consume(engine: Engine, prompt: str, max_tokens: int, seed: int) -> int:
    n = 0
    async for chunk in engine.stream(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=seed):
        n += len(chunk.token_ids)
    return n


async def main(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    async with Engine(model=args.model, device="cpu", max_num_seqs=args.streams,
                      max_num_batched_tokens=max(512, args.streams)) as engine:
        words = ["the", "engine", "loop", "token", "stream", "cache", "page", "model", "batch", "lag"]
        prompts = [" ".join(rng.choices(words, k=rng.randrange(4, 24))) for _ in range(args.streams)]
        idle: list[tuple[float, float]] = []
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(args.interval_ms / 1e3, idle, stop))
        await asyncio.sleep(1.0)  # the loop's lag with the engine idle: the floor of this machine
        stop.set()
        await tick
        lags: list[tuple[float, float]] = []
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(args.interval_ms / 1e3, lags, stop))
        start, cpu = time.perf_counter(), time.thread_time()
        tokens = await asyncio.gather(*(consume(engine, p, args.max_tokens, i) for i, p in enumerate(prompts)))
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
        stop.set()
        await tick
        steps = engine.stats()["steps"]
    ms = [lag * 1e3 for lag, _ in lags]
    own = [max(0.0, lag - wait) * 1e3 for lag, wait in lags]
    idle_ms = [lag * 1e3 for lag, _ in idle]
    return {
        "streams": args.streams, "max_tokens": args.max_tokens, "model": args.model,
        "torch_threads": torch.get_num_threads(),
        "lag_ms_p50": round(statistics.median(ms), 3), "lag_ms_p99": round(percentile(ms, 0.99), 3),
        "lag_ms_max": round(max(ms), 3), "ticks": len(ms),
        "own_lag_ms_p50": round(statistics.median(own), 3), "own_lag_ms_p99": round(percentile(own, 0.99), 3),
        "idle_lag_ms_p50": round(statistics.median(idle_ms), 3),
        "idle_lag_ms_p99": round(percentile(idle_ms, 0.99), 3),
        "tokens": sum(tokens), "seconds": round(elapsed, 2), "tokens_per_s": round(sum(tokens) / elapsed, 1),
        "steps": steps, "loop_cpu_ms_per_step": round(cpu * 1e3 / max(1, steps), 3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="m3-tiny")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--interval-ms", type=float, default=1.0)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads of the engine's CPU forward (0: torch's default)")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    print(json.dumps(asyncio.run(main(args))))
