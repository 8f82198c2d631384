"""Cancellation storm: many requests, a share of them ended early in every way a caller can, then a page count.

    .venv/bin/python benchmarks/storm.py [--model m3-tiny|PATH] [--requests 10000] [--cancel 0.3]
                                         [--concurrency 256] [--max-tokens 16] [--torch-threads 1]

Each request is a short prompt generating up to `--max-tokens` tokens; `--concurrency` of them are live at once.
A `--cancel` share is ended early, in turn: the awaiting task cancelled, `abort(id)`, the stream left after its
first chunk, and `timeout=` (a deadline shorter than the generation). At the end the engine must hold no request
and every page must be free (cached pages count as free). Prints one JSON line: requests served (finished on
their own), cancelled (each way), timed out, errors, leaked pages, wall time and requests per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import torch

from m3sdk import Engine, EngineOverloadedError

WAYS = ("task", "abort", "leave", "timeout")


async def one(engine: Engine, i: int, way: str | None, prompt: str, max_tokens: int, tally: dict) -> None:
    rid = f"storm-{i}"
    params = dict(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
    try:
        if way is None:
            done = await engine.generate(prompt, request_id=rid, **params)
            tally["served" if done.finish_reason == "length" else done.finish_reason] += 1
        elif way == "task":
            task = asyncio.ensure_future(engine.generate(prompt, request_id=rid, **params))
            await asyncio.sleep(random.uniform(0, 0.05))
            task.cancel()
            try:
                await task
                tally["served"] += 1  # it finished before the cancel landed
            except asyncio.CancelledError:
                tally["cancelled_task"] += 1
        elif way == "abort":
            task = asyncio.ensure_future(engine.generate(prompt, request_id=rid, **params))
            await asyncio.sleep(random.uniform(0, 0.05))
            await engine.abort(rid)
            done = await task
            tally["cancelled_abort" if done.finish_reason == "abort" else "served"] += 1
        elif way == "leave":
            async for _ in engine.stream(prompt, request_id=rid, **params):
                break
            tally["cancelled_leave"] += 1
        else:
            done = await engine.generate(prompt, request_id=rid, timeout=random.uniform(0.001, 0.05), **params)
            tally["timed_out" if done.finish_reason == "timeout" else "served"] += 1
    except EngineOverloadedError:
        tally["overloaded"] += 1
    except Exception as e:  # noqa: BLE001 - counted: the storm reports any error it meets
        tally["errors"] += 1
        tally.setdefault("first_error", repr(e))


async def main_async(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven ravens watch".split()
    tally = dict.fromkeys(("served", "stop", "cancelled_task", "cancelled_abort", "cancelled_leave", "timed_out",
                           "overloaded", "errors"), 0)
    async with Engine(model=args.model, device="cpu") as engine:
        limit = asyncio.Semaphore(args.concurrency)

        async def bounded(i: int) -> None:
            way = WAYS[i % len(WAYS)] if rng.random() < args.cancel else None
            prompt = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 40)))
            async with limit:
                await one(engine, i, way, prompt, args.max_tokens, tally)

        t0 = time.perf_counter()
        await asyncio.gather(*(bounded(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
        deadline = time.monotonic() + 10
        while (stats := engine.stats())["running"] + stats["waiting"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stats = engine.stats()
    return {"requests": args.requests, **tally, "live_after": stats["running"] + stats["waiting"],
            "leaked_pages": stats["pages_total"] - stats["pages_free"], "preemptions": stats["preemptions"],
            "wall_s": round(wall, 1), "requests_per_s": round(args.requests / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="m3-tiny")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--cancel", type=float, default=0.3)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    print(json.dumps(asyncio.run(main_async(args))), flush=True)


if __name__ == "__main__":
    main()
