"""Speculative decoding speed-up: output tokens/s of m3-tiny with its bundled EAGLE3 head (k = 3) vs without, at
fixed concurrency, greedy, on held-out prompts of its domain (benchmarks/spec.py picks them); every output must
equal the plain one.

    python benchmarks/spec_speedup.py [--device cuda] [--dtype auto] [--concurrency 1,8,32] [--max-tokens 128]

Prints one markdown row per concurrency: tokens/s without, with, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from spec import held_out_prompts

from m3sdk import Engine


async def run(prompts: list[list[int]], concurrency: int, max_tokens: int, device: str, dtype: str,
              speculative: str | None) -> tuple[list[list[int]], float]:
    async with Engine(device=device, dtype=dtype, max_num_seqs=concurrency, speculative=speculative) as engine:
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: list[int]) -> list[int]:
            async with gate:
                done = await engine.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                return done.token_ids

        await asyncio.gather(*[one(p) for p in prompts[:concurrency]])  # warm-up: kernels compiled, graphs built
        start = time.perf_counter()
        outputs = await asyncio.gather(*[one(p) for p in prompts])
        return outputs, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="auto", help="float32 makes greedy outputs batch-invariant enough to compare")
    args = ap.parse_args()
    print("| concurrency | requests | plain tok/s | eagle3 tok/s | speed-up | identical |\n|---|---|---|---|---|---|")
    for c in (int(x) for x in args.concurrency.split(",")):
        prompts = held_out_prompts(max(2 * c, 8), args.prompt_tokens)
        plain, t_plain = asyncio.run(run(prompts, c, args.max_tokens, args.device, args.dtype, None))
        spec, t_spec = asyncio.run(run(prompts, c, args.max_tokens, args.device, args.dtype, "eagle3"))
        tokens = sum(len(o) for o in plain)
        print(f"| {c} | {len(prompts)} | {tokens / t_plain:.0f} | {tokens / t_spec:.0f} | "
              f"{t_plain / t_spec:.2f}x | {plain == spec} |", flush=True)


if __name__ == "__main__":
    main()
