"""Node kills: a prefill node (the real engine, a process of its own) killed with SIGKILL again and again in the
middle of its prefills and transfers, and restarted on the same port, under a decode Engine whose requests have
deadlines. Every request must complete within its deadline with the greedy tokens (and finish reason) of a
colocated Engine.

    .venv/bin/python benchmarks/node_kills.py [--model m3-tiny|PATH] [--kills 100] [--batch 4] [--timeout 30]
                                              [--delay 0.4] [--max-minutes M] [--out DIR]

Each round sends `--batch` fresh prompts (80-200 random tokens: nothing the decode side has cached, so all of
them go to the node), kills the node at a random point 0.05 s to `--delay` + 0.3 s later (the node holds each
prefill `--delay` seconds before computing it, so most kills land while prefills are on the node, before or
during their transfer), waits for the batch, restarts the node on the same port and waits until the decode side
takes it back; with --max-minutes, no round starts past that time (the table says how many kills ran). A kill
"hit" when some of the round's prefills fell back to the decode side (counted by the engine). At the end the
decode side must hold no request and every page must be free. Prints a table (and one JSON line); with --out
writes each round and the summary to DIR/node_kills.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "disagg"))  # the node processes of the disaggregation tests

from disagg_helpers import spawn_engine_node, stop_node, wait_healthy  # noqa: E402

from m3sdk import Engine  # noqa: E402

KV_CACHE = 16 << 20
MAX_TOKENS = 6


def prompts(rounds: int, batch: int) -> list[list[list[int]]]:
    rng = random.Random(0)
    return [[[rng.randrange(1, 250) for _ in range(rng.randrange(80, 201))] for _ in range(batch)]
            for _ in range(rounds)]


async def settle(engine: Engine, free: int, within: float = 5.0) -> int:
    """Pages still held `within` seconds after a round (0 when every page came back)."""
    deadline = time.monotonic() + within
    while (stats := engine.stats())["pages_free"] != free and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return free - stats["pages_free"]


async def timed(engine: Engine, prompt: list[int], timeout: float, t0: float) -> tuple[object, float]:
    """The greedy completion of `prompt` and the seconds from `t0` to its end."""
    done = await engine.generate(prompt, temperature=0.0, max_tokens=MAX_TOKENS, timeout=timeout)
    return done, time.monotonic() - t0


async def main_async(args: argparse.Namespace) -> dict:
    batches = prompts(args.kills, args.batch)
    settings = dict(model=args.model, device="cpu", kv_cache_memory=KV_CACHE)
    async with Engine(**settings) as local:
        reference = [[(c.token_ids, c.finish_reason) for c in await asyncio.gather(
            *(local.generate(p, temperature=0.0, max_tokens=MAX_TOKENS) for p in batch))] for batch in batches]
    rng = random.Random(1)
    out = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = (Path(args.out) / "node_kills.jsonl").open("w")
    tally = dict(kills=0, hits=0, requests=0, completed=0, deadline_misses=0, mismatches=0, leaked_pages=0)
    restarts, worst = [], 0.0
    proc, address = spawn_engine_node(args.model, delay_s=args.delay, kv_cache_memory=KV_CACHE)
    t_start = time.monotonic()
    try:
        async with Engine(**settings, prefill_nodes=[address], remote_prefill_min_tokens=32,
                          prefill_timeout=10.0) as engine:
            free = engine.stats()["pages_free"]
            for k, batch in enumerate(batches):
                if args.max_minutes and time.monotonic() - t_start > args.max_minutes * 60:
                    break
                before = engine.stats()
                t0 = time.monotonic()

                pending = asyncio.ensure_future(asyncio.gather(*(timed(engine, p, args.timeout, t0) for p in batch)))
                kill_at = rng.uniform(0.05, args.delay + 0.3)
                await asyncio.sleep(kill_at)
                proc.kill()
                results = await pending
                after = engine.stats()
                row = dict(round=k, kill_at_s=round(kill_at, 3),
                           fallbacks=after["remote_prefill_fallbacks"] - before.get("remote_prefill_fallbacks", 0),
                           remote=after["remote_prefills"] - before.get("remote_prefills", 0),
                           misses=sum(c.finish_reason == "timeout" or s > args.timeout for c, s in results),
                           mismatches=sum((c.token_ids, c.finish_reason) != ref
                                          for (c, _), ref in zip(results, reference[k], strict=True)),
                           slowest_s=round(max(s for _, s in results), 2), leaked_pages=await settle(engine, free))
                worst = max(worst, row["slowest_s"])
                tally["kills"] += 1
                tally["hits"] += row["fallbacks"] > 0
                tally["requests"] += len(batch)
                tally["completed"] += sum(c.finish_reason in ("length", "stop") and s <= args.timeout
                                          for c, s in results)
                tally["deadline_misses"] += row["misses"]
                tally["mismatches"] += row["mismatches"]
                tally["leaked_pages"] = max(tally["leaked_pages"], row["leaked_pages"])
                proc.join(10)
                t1 = time.monotonic()
                proc, _ = spawn_engine_node(args.model, delay_s=args.delay, kv_cache_memory=KV_CACHE,
                                            listen=address)
                await wait_healthy(engine)
                row["restart_s"] = round(time.monotonic() - t1, 2)
                restarts.append(row["restart_s"])
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                print(json.dumps(row), flush=True)
            stats = engine.stats()
            summary = {**tally, "remote_prefills": stats["remote_prefills"],
                       "fallbacks": stats["remote_prefill_fallbacks"], "slowest_request_s": worst,
                       "deadline_s": args.timeout, "restart_mean_s": round(sum(restarts) / len(restarts), 2),
                       "live_after": stats["running"] + stats["waiting"],
                       "pages_held_after": await settle(engine, free), "wall_s": round(time.monotonic() - t_start, 1)}
    finally:
        stop_node(proc)
    if out:
        out.write(json.dumps({"summary": summary}) + "\n")
        out.close()
    return summary


def print_table(s: dict) -> None:
    cols = [("kills", "kills"), ("hit in flight", "hits"), ("requests", "requests"), ("completed", "completed"),
            ("deadline misses", "deadline_misses"), ("token mismatches", "mismatches"),
            ("leaked pages", "pages_held_after"), ("served remotely", "remote_prefills"),
            ("slowest (s)", "slowest_request_s"), ("restart (s)", "restart_mean_s"), ("wall (s)", "wall_s")]
    print("| " + " | ".join(name for name, _ in cols) + " |")
    print("|" + "---:|" * len(cols))
    print("| " + " | ".join(str(s[key]) for _, key in cols) + " |")
    print(json.dumps(s), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="m3-tiny")
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4, help="prompts per round (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=30.0, help="each request's deadline, seconds")
    parser.add_argument("--delay", type=float, default=0.4, help="seconds the node holds each prefill")
    parser.add_argument("--max-minutes", type=float, default=None, help="start no round after this many minutes")
    parser.add_argument("--out", default=None)
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    print_table(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
