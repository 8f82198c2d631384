"""Plain decoding's scheduling modes against each other: `auto` (the engine's default on a GPU: each step overlapped
or read first, whichever measured the shorter period at its batch size, core/overlap.py), `overlap` (every step
overlapped) and `sync` (overlap off), on m3-tiny and on an M3 slice (1 dense + 1 sparse layer at the released
width, random weights drawn on the device from its config alone: no checkpoint to write).

    python benchmarks/overlap.py [--models m3-tiny,slice] [--concurrency 1,8,32,64] [--max-tokens 128]
                                 [--repeat 5] [--out overlap.jsonl]

One engine per model, loaded once; its executor is switched between the modes while it is idle (the `auto`
mode's measurements carry over from one concurrency to the next, as in a serving engine). At each concurrency each
mode runs two warm-up waves, then a timed window of max(2 c, 16) greedy requests of held-out m3-tiny prompts
(their token ids are valid inputs of both models), `--repeat` times, the modes interleaved; each mode's median
window counts (its time and its stats). One markdown row per (model, concurrency): output tokens/s of
each mode, each against sync, the median step, and how many of auto's steps overlapped; `--out` gets JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from spec import held_out_prompts
from spec_speedup import run

from m3sdk import Engine
from m3sdk.core.executor import Executor, OverlappedExecutor
from m3sdk.core.overlap import OverlapChoice
from m3sdk.graphs import batch_buckets

ROOT = Path(__file__).resolve().parent.parent
MODES = ("sync", "overlap", "auto")


def slice_dir(dense: int, sparse: int) -> Path:
    """A folder with the slice's config.json alone (the engine draws random weights for it: load_format dummy)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_m3_slice import slice_config

    out = Path(tempfile.mkdtemp(prefix="m3-slice-config-"))
    slice_config(dense, sparse, 4096, {}).save_pretrained(out)
    return out


def set_mode(engine: Engine, mode: str, choice: OverlapChoice) -> None:
    """Switch an idle engine's executor (benchmark instrumentation: an engine picks its executor at build)."""
    core = engine._core
    ex = core.executor
    if mode == "sync":
        core.executor = Executor(ex.runner, ex.scheduler, ex.sampler)
    else:
        core.executor = OverlappedExecutor(ex.runner, ex.scheduler, ex.sampler, choice if mode == "auto" else None)


async def idle(engine: Engine) -> None:
    core = engine._core
    while core.scheduler.num_running or core.scheduler.num_waiting or core.executor.busy:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)


async def one_model(name: str, args: argparse.Namespace, out) -> None:
    config = dict(device=args.device, max_num_seqs=max(args.concurrency), max_model_len=1024)
    if name == "slice":
        config.update(model=str(slice_dir(1, 1)), load_format="dummy", kv_cache_memory=4 << 30)
    t0 = time.perf_counter()
    async with Engine(**config) as engine:
        print(f"{name}: loaded and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
        choice = OverlapChoice(batch_buckets(config["max_num_seqs"]))
        for c in args.concurrency:
            prompts = held_out_prompts(max(2 * c, 16), 48)
            # every prompt once before the first mode (its warm-up sends 2 c of them): each mode's window then meets
            # the same prefix-cache hits, and the same prefill work
            await idle(engine)
            await asyncio.gather(*[engine.generate(p, max_tokens=1, temperature=0) for p in prompts])
            # --repeat rounds, the modes in a rotated order each round (a window of m3-tiny lasts well under a
            # second: one stall or the order alone moves a single window by tens of percent); each mode's median
            # window (the upper one of an even count), its time and its stats
            windows: dict[str, list] = {m: [] for m in args.modes}
            for r in range(args.repeat):
                for mode in args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]:
                    await idle(engine)
                    set_mode(engine, mode, choice)
                    # a step under the new executor, so the engine's stats (read at a window's start) are its own
                    await engine.generate(prompts[0], max_tokens=1, temperature=0)
                    windows[mode].append(await run(engine, prompts, c, args.max_tokens, f"{name}-{mode}",
                                                   warm_up=r == 0))
            runs = {m: sorted(w, key=lambda run_: run_[1])[len(w) // 2] for m, w in windows.items()}
            tokens = sum(len(o) for o in runs[args.modes[0]][0])
            rate = {m: round(tokens / r[1], 1) for m, r in runs.items()}
            vs_sync = {m: round(runs["sync"][1] / r[1], 3) for m, r in runs.items()} if "sync" in runs else {}
            auto = runs.get("auto", (None, None, {}))[2]
            row = dict(model=name, concurrency=c, requests=len(prompts), max_tokens=args.max_tokens, tok_s=rate,
                       vs_sync=vs_sync, repeat=args.repeat,
                       identical=all(r[0] == runs[args.modes[0]][0] for r in runs.values()),
                       step_ms_median={m: r[2]["step_ms_median"] for m, r in runs.items()},
                       graph_share={m: r[2]["graph_share"] for m, r in runs.items()},
                       cpu_ms_per_step={m: r[2]["cpu_ms_per_step"] for m, r in runs.items()},
                       auto_overlapped=[auto.get("overlap_steps"), auto.get("read_first_steps")])
            if out is not None:
                out.write(json.dumps(row) + "\n")
                out.flush()
            cells = " | ".join(f"{rate[m]:.0f} ({vs_sync.get(m, 0):.2f}x)" for m in args.modes)
            steps = " / ".join(f"{row['step_ms_median'][m]}" for m in args.modes)
            print(f"| {name} | {c} | {cells} | {steps} | {row['auto_overlapped']} | {row['identical']} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="m3-tiny,slice")
    ap.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8, 32, 64])
    ap.add_argument("--modes", type=lambda v: [m for m in v.split(",") if m in MODES], default=list(MODES))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5, help="timed windows per mode (median)")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    args = ap.parse_args()
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - open for the whole run
    head = " | ".join(f"{m} tok/s (vs sync)" for m in args.modes)
    print(f"| model | conc | {head} | step p50 ms ({' / '.join(args.modes)}) | auto: overlapped, read first | "
          f"identical |\n|{'---|' * (5 + len(args.modes))}", flush=True)
    for name in args.models.split(","):
        asyncio.run(one_model(name, args, out))


if __name__ == "__main__":
    main()
