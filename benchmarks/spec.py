"""Speculative decoding on m3-tiny: acceptance and target forwards per token, greedy, on held-out prompts of its
domain (the paragraphs scripts/train_m3_tiny.py and scripts/train_eagle3_tiny.py keep out: every 100th of each
novel), with the bundled EAGLE3 head and the n-gram drafter; checks every output equals the plain one.

    .venv/bin/python benchmarks/spec.py [--prompts 32] [--prompt-tokens 48] [--max-tokens 64] [--k 3]

Prints one markdown table row per method: mean accepted length (tokens per verify forward, the bonus token
included, out of k + 1), acceptance rate per draft position, target forwards per generated token, and CPU wall
time (informational: on a CPU the tiny target is cheap, so wall time mostly measures Python overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import lzma
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from m3sdk import Engine
from m3sdk.config import BUNDLED_MODELS

CORPUS = Path(__file__).resolve().parent.parent / "data" / "austen.txt.xz"
VAL_EVERY = 100


def held_out_prompts(count: int, length: int) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(BUNDLED_MODELS["m3-tiny"] / "tokenizer.json"))
    text = lzma.decompress(CORPUS.read_bytes()).decode("utf-8")
    held = [p for book in text.strip().split("\n\n")
            for i, p in enumerate(book.split("\n")) if i % VAL_EVERY == VAL_EVERY - 1]
    prompts = [ids for ids in (e.ids for e in tokenizer.encode_batch(held)) if len(ids) >= length]
    step = max(1, len(prompts) // count)
    return [p[:length] for p in prompts[::step][:count]]


async def run(prompts: list[list[int]], max_tokens: int, speculative) -> tuple[list[list[int]], dict, float]:
    async with Engine(device="cpu", max_num_seqs=16, speculative=speculative) as engine:
        t0 = time.perf_counter()
        done = await asyncio.gather(*[engine.generate(p, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                                      for p in prompts])
        wall = time.perf_counter() - t0
        return [c.token_ids for c in done], engine.stats(), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)  # many small ops on a CPU: one thread avoids OpenMP barrier waits
    prompts = held_out_prompts(args.prompts, args.prompt_tokens)
    plain, _, plain_wall = asyncio.run(run(prompts, args.max_tokens, None))
    print(f"m3-tiny, {len(prompts)} held-out prompts of {args.prompt_tokens} tokens, {args.max_tokens} greedy tokens "
          f"each, k = {args.k}, CPU ({torch.get_num_threads()} thread)\n")
    print("| method | mean accepted length | acceptance per position | target forwards / token | identical "
          "| wall s |")
    print("|---|---|---|---|---|---|")
    print(f"| none | 1.00 | - | 1.000 | - | {plain_wall:.1f} |")
    for method in ("eagle3", "ngram"):
        out, stats, wall = asyncio.run(run(prompts, args.max_tokens,
                                           {"method": method, "num_speculative_tokens": args.k}))
        per_pos = " / ".join(f"{a:.2f}" for a in stats["spec_acceptance_rate_per_position"])
        print(f"| {method} | {stats['spec_mean_accepted_length']:.2f} | {per_pos} | "
              f"{stats['spec_target_forwards_per_token']:.3f} | {out == plain} | {wall:.1f} |")


if __name__ == "__main__":
    main()
