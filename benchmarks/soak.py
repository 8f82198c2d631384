"""Soak: the embedded engine under a steady mixed load for a long time, its memory and free pages sampled.

    .venv/bin/python benchmarks/soak.py [--model m3-tiny|PATH] [--minutes 60] [--streams 4] [--think 0.2]
                                        [--sample-every 10] [--out DIR] [--torch-threads 1]

`--streams` callers loop until the time is up, each sending one request after another with a random think time
of up to `--think` seconds between them. Each request is, at random: `generate`, `stream`, `chat`, a chat
constrained by a JSON schema, a request cancelled early (the awaiting task cancelled, `abort(id)` or the stream
left after its first chunk), or one with a `timeout` shorter than its generation; prompts of 3-60 words and
1-64 new tokens. Every `--sample-every` seconds the process's RSS (VmRSS) and the engine's free pages are
sampled. At the end: a table per minute (requests done, RSS, free pages), the RSS slope (least squares, MB/hour)
over the second half of the run (the first half holds the warm-up: allocator pools, compiled paths, the prefix
cache filling), and the pages still held once the engine is idle. With --out, the samples and the summary go to
DIR/soak.jsonl, one JSON object a line, written as they are taken.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import torch

from m3sdk import Engine

KINDS = ("generate", "stream", "chat", "structured", "cancel", "timeout")
WEIGHTS = (0.3, 0.2, 0.15, 0.1, 0.15, 0.1)
WORDS = "the quick brown fox jumps over a lazy dog while seven ravens watch from an old oak tree".split()
SCHEMA = {"type": "object", "properties": {"mood": {"type": "string", "enum": ["calm", "tense"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["mood", "score"], "additionalProperties": False}


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def slope_mb_per_hour(samples: list[dict]) -> float | None:
    """Least-squares slope of RSS over time, in MB/hour."""
    if len(samples) < 2:
        return None
    ts = [s["t_s"] / 3600 for s in samples]
    ys = [s["rss_mb"] for s in samples]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var else None


async def one(engine: Engine, rng: random.Random, i: int, tally: Counter) -> None:
    kind = rng.choices(KINDS, WEIGHTS)[0]
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 61)))
    rid = f"soak-{i}"
    params = dict(max_tokens=rng.randrange(1, 65), temperature=rng.choice((0.0, 0.8)), seed=i)
    messages = [{"role": "user", "content": prompt}]
    try:
        if kind == "generate":
            await engine.generate(prompt, request_id=rid, **params)
        elif kind == "stream":
            async for _ in engine.stream(prompt, request_id=rid, **params):
                pass
        elif kind == "chat":
            await engine.chat(messages, request_id=rid, **params)
        elif kind == "structured":
            await engine.chat(messages, request_id=rid, seed=i, max_tokens=40,
                              response_format={"type": "json_schema", "json_schema": {"name": "m", "schema": SCHEMA}})
        elif kind == "cancel":
            way = i % 3
            if way == 2:
                async for _ in engine.stream(prompt, request_id=rid, **params, ignore_eos=True):
                    break
            else:
                task = asyncio.ensure_future(engine.generate(prompt, request_id=rid, **params, ignore_eos=True))
                await asyncio.sleep(rng.uniform(0, 0.05))
                if way == 0:
                    task.cancel()
                else:
                    await engine.abort(rid)
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        else:
            await engine.generate(prompt, request_id=rid, timeout=rng.uniform(0.005, 0.1),
                                  **{**params, "max_tokens": 64}, ignore_eos=True)
        tally[kind] += 1
    except Exception as e:  # noqa: BLE001 - counted: the soak reports any error it meets
        tally["errors"] += 1
        tally.setdefault("first_error", repr(e))  # type: ignore[arg-type]


async def main_async(args: argparse.Namespace) -> dict:
    out = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = (Path(args.out) / "soak.jsonl").open("w")
    tally: Counter = Counter()
    samples: list[dict] = []
    async with Engine(model=args.model, device="cpu") as engine:
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        counter = iter(range(10**12))

        async def caller(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < end:
                await one(engine, rng, next(counter), tally)
                await asyncio.sleep(rng.uniform(0, args.think))

        def sample() -> dict:
            stats = engine.stats()
            row = {"t_s": round(time.monotonic() - t0, 1), "done": sum(v for k, v in tally.items()
                                                                         if k in KINDS),
                   "errors": tally["errors"], "rss_mb": round(rss_mb(), 1), "pages_free": stats["pages_free"],
                   "pages_total": stats["pages_total"], "running": stats["running"], "waiting": stats["waiting"]}
            samples.append(row)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
            return row

        async def sampler() -> None:
            while time.monotonic() < end:
                sample()
                await asyncio.sleep(min(args.sample_every, max(0.0, end - time.monotonic())))

        await asyncio.gather(sampler(), *(caller(s) for s in range(args.streams)))
        wall = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while (stats := engine.stats())["running"] + stats["waiting"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        last = sample()
    second_half = [s for s in samples if s["t_s"] >= args.minutes * 30]
    summary = {"minutes": args.minutes, "streams": args.streams, "requests": last["done"],
               **{k: tally[k] for k in KINDS}, "errors": tally["errors"], "first_error": tally.get("first_error"),
               "rss_first_mb": samples[0]["rss_mb"], "rss_last_mb": last["rss_mb"],
               "rss_max_mb": max(s["rss_mb"] for s in samples),
               "rss_slope_mb_per_h_second_half": (None if (k := slope_mb_per_hour(second_half)) is None
                                                  else round(k, 2)),
               "live_after": last["running"] + last["waiting"],
               "leaked_pages": last["pages_total"] - last["pages_free"],
               "wall_s": round(wall, 1)}
    if out:
        out.write(json.dumps({"summary": summary}) + "\n")
        out.close()
    return {"samples": samples, "summary": summary}


def print_table(samples: list[dict], summary: dict) -> None:
    by_minute: dict[int, dict] = {}
    for s in samples:
        by_minute[int(s["t_s"] // 60)] = s  # the last sample of each minute
    print(f"{'minute':>6} {'requests done':>13} {'RSS MB':>8} {'free pages':>10}")
    for minute, s in sorted(by_minute.items()):
        print(f"{minute:>6} {s['done']:>13} {s['rss_mb']:>8.1f} {s['pages_free']:>6}/{s['pages_total']}")
    print(json.dumps(summary), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="m3-tiny")
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--think", type=float, default=0.2, help="most seconds a caller waits between requests")
    parser.add_argument("--sample-every", type=float, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    result = asyncio.run(main_async(args))
    print_table(result["samples"], result["summary"])


if __name__ == "__main__":
    main()
