"""The first request at a new context: what it waits for beyond the warm request's time.

One engine on a model directory (the M3 slice: `python benchmarks/serving.py slice --slice S`), started with its
warm-up, then per context two fresh prompts (no prefix-cache hit), each decoding a few tokens: the first is
"cold", the second "warm". Every Triton compile during a request is logged with its kernel, the time it took and
the request it fell in; decode graphs captured during a request are counted. A row per request, then a table.

    python benchmarks/cold_start.py --model /dev/shm/m3s --contexts 8192,12345,131072 --companion --out $OUT/cold.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path


class CompileLog:
    """Triton's jit hooks, timed: `jit_cache_hook` runs before a compile, `jit_post_compile_hook` after it."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.events: list[tuple[str, float]] = []
        self._start = 0.0

    def install(self) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *args, **kwargs) -> None:
        self._start = time.perf_counter()

    def _after(self, *args, **kwargs) -> None:
        self.events.append((kwargs["fn"].name, time.perf_counter() - self._start))
        if self.verbose:
            print("compiled", kwargs["repr"], kwargs["compile"].get("constants"), flush=True)

    def take(self) -> list[tuple[str, float]]:
        events, self.events = self.events, []
        return events


def captured(engine) -> int:
    """Decode graphs the engine holds (none without CUDA graphs)."""
    graphs = engine._core.runner.graphs
    return len(graphs.graphs) if graphs is not None else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--contexts", default="8192,12345,131072")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=1048576)
    p.add_argument("--kv-cache-memory", type=int, default=12, help="GiB")
    p.add_argument("--quantization", default="fp8")
    p.add_argument("--companion", action="store_true",
                   help="beside each request, a short one that decodes while the long one prefills (mixed steps)")
    p.add_argument("--verbose", action="store_true", help="print each compile's signature and constants")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from long_context import engine_point

    from m3sdk import Engine

    log = CompileLog(args.verbose)
    log.install()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []

    def record(**row) -> None:
        rows.append(row)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")

    async def serve() -> None:
        t0 = time.perf_counter()
        async with Engine(model=args.model, kv_cache_dtype="fp8", max_model_len=args.max_model_len,
                          kv_cache_memory=args.kv_cache_memory << 30, quantization=args.quantization) as engine:
            startup = time.perf_counter() - t0
            compiles = log.take()
            record(step="startup", seconds=startup, warm_up_s=engine._core.warm_up_seconds,
                   compiles=len(compiles), compile_s=sum(s for _, s in compiles),
                   graphs=captured(engine),
                   device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
            for context in map(int, args.contexts.split(",")):
                for run, kind in enumerate(("cold", "warm")):
                    graphs = captured(engine)
                    point, *_ = await asyncio.gather(
                        engine_point(engine, context, args.output_len, run),
                        *([engine_point(engine, 37, 64, run)] if args.companion else []))
                    compiles = log.take()
                    by_kernel = Counter()
                    for name, s in compiles:
                        by_kernel[name] += s
                    record(step="request", context=context, kind=kind, **point, compiles=len(compiles),
                           compile_s=sum(by_kernel.values()),
                           kernels={k: round(v, 3) for k, v in by_kernel.most_common()},
                           graphs_captured=captured(engine) - graphs)

    asyncio.run(serve())
    start = rows[0]
    print(f"startup {start['seconds']:.1f} s (warm-up {start['warm_up_s']:.1f} s, {start['compiles']} compiles "
          f"{start['compile_s']:.1f} s, {start['graphs']} graphs)")
    print(f"{'context':>8} {'kind':>5} {'TTFT s':>8} {'max gap ms':>10} {'compiles':>8} {'compile s':>9} {'graphs':>6}")
    for r in rows[1:]:
        print(f"{r['context']:>8} {r['kind']:>5} {r['ttft_s']:>8.3f} {r['itl_max_ms'] or 0:>10.1f} {r['compiles']:>8} "
              f"{r['compile_s']:>9.2f} {r['graphs_captured']:>6}  {r['kernels']}")


if __name__ == "__main__":
    main()
