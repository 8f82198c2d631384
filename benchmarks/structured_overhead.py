"""Step-time cost of structured outputs: decode at batch 1, 16 and 64 with half the requests (rounded up) constrained
by a JSON schema, against the same batch unconstrained, on one loaded engine (arms alternate in order,
--repeats times, each on fresh prompts after a warm-up at its batch).

    PYTHONPATH=src python benchmarks/structured_overhead.py [--model DIR] [--max-tokens 64] [--prompt-tokens 64]

On the H200 with the M3 slice (benchmarks/serving.py's `slice` step writes it; the slice's tokenizer has the full
vocabulary, so the masks are full-size):

    PYTHONPATH=src python benchmarks/serving.py slice --slice /tmp/m3-slice
    PYTHONPATH=src python benchmarks/structured_overhead.py --model /tmp/m3-slice --max-tokens 256 \\
        --prompt-tokens 512 --repeats 3

Sampling is unseeded at temperature 1.0 with ignore_eos, so every request is lag-safe and overlapped scheduling
stays on (where the engine enables it). The schema holds one string too long to close within max_tokens
(minLength 16 x max_tokens characters; no token of these tokenizers spells more than 16): most tokens stay allowed
at every step (the costly mask) and every request runs its max_tokens, as in the plain arm (the table checks).
TPOT is the mean over requests of their time per output token after the first; step is wall time over engine
steps. Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

from m3sdk import Engine, SamplingParams


def schema(max_tokens: int) -> dict:
    return {"type": "object", "properties": {"text": {"type": "string", "minLength": 16 * max_tokens}},
            "required": ["text"], "additionalProperties": False}


async def run(engine: Engine, prompts: list[list[int]], constrained: int, max_tokens: int) -> dict[str, float]:
    plain = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    json_params = plain.replace(structured_output={"json": schema(max_tokens)})
    steps0 = engine.stats()["steps"]
    t0 = time.perf_counter()
    done = await asyncio.gather(*[engine.generate(p, json_params if i < constrained else plain)
                                  for i, p in enumerate(prompts)])
    wall = time.perf_counter() - t0
    steps = engine.stats()["steps"] - steps0
    tpots = [c.timings.mean_tpot_s for c in done if c.timings.mean_tpot_s is not None]
    return {"tpot_ms": statistics.mean(tpots) * 1e3, "step_ms": wall / steps * 1e3,
            "early": sum(c.finish_reason != "length" for c in done)}


def prompts(rng: random.Random, vocab: int, length: int, batch: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the bundled m3-tiny)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    overrides = {"model": str(args.model)} if args.model else {}
    rng = random.Random(0)
    async with Engine(max_num_seqs=max(args.batches), max_model_len=args.prompt_tokens + args.max_tokens + 16,
                      **overrides) as engine:
        vocab = engine._core.vocab_size
        desc = engine.describe()
        print(f"{desc['model']}; {desc['kv cache']}; overlap {engine._core.config.overlap}")
        await run(engine, [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(2)], 1, 8)  # warm-up
        print("| batch | constrained | TPOT ms plain | TPOT ms mixed | TPOT cost | step ms plain | step ms mixed "
              "| ended early |\n|---|---|---|---|---|---|---|---|")
        for batch in args.batches:
            constrained = (batch + 1) // 2
            def fresh() -> list[list[int]]:
                return prompts(rng, vocab, args.prompt_tokens, batch)  # noqa: B023 (called in this iteration only)

            await run(engine, fresh(), 0, 8)  # a warm-up of both arms at this batch
            await run(engine, fresh(), constrained, 8)
            plain, mixed = [], []
            for repeat in range(args.repeats):  # fresh prompts for every arm (no prefix hits); the order alternates
                arms = [(plain, 0), (mixed, constrained)]
                for results, n in arms if repeat % 2 == 0 else arms[::-1]:
                    results.append(await run(engine, fresh(), n, args.max_tokens))
            p = {k: statistics.median(r[k] for r in plain) for k in ("tpot_ms", "step_ms")}
            m = {k: statistics.median(r[k] for r in mixed) for k in ("tpot_ms", "step_ms")}
            early = sum(r["early"] for r in mixed)
            print(f"| {batch} | {constrained} | {p['tpot_ms']:.3f} | {m['tpot_ms']:.3f} | "
                  f"{(m['tpot_ms'] / p['tpot_ms'] - 1) * 100:+.1f} % | {p['step_ms']:.3f} | {m['step_ms']:.3f} | "
                  f"{early}/{constrained * args.repeats} |")


if __name__ == "__main__":
    asyncio.run(main())
