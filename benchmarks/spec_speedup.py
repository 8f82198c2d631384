"""Speculative decoding speed-up: output tokens/s of m3-tiny with its bundled EAGLE3 head (k = 3) vs without, at
fixed concurrency, greedy, on held-out prompts of its domain (benchmarks/spec.py picks them).

    python benchmarks/spec_speedup.py [--device cuda] [--dtype auto] [--concurrency 1,8,32] [--max-tokens 128]
                                      [--check-prompts 4] [--out spec.jsonl]

First a correctness check: at batch 1 in float32, speculative outputs must equal plain ones (printed, with where
each first differs if not). Then one markdown row per concurrency: tokens/s without (with the engine's default
overlapped scheduling, and with it off: speculation never overlaps, so the second is the like-for-like baseline),
with, both ratios, whether outputs were identical, the speculative run's mean accepted length, and the share of
the timed steps each run replayed from CUDA graphs (the engines' `graph_steps` stat, not the flag asked for);
`--out` gets the same as JSON lines, with each run's steps, median step time and slow steps (> 10 ms: a compile
or an eager step). `--profile 1,8` adds device time, kernels and host phases per token at those concurrencies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time

import torch
from spec import held_out_prompts

import m3sdk.speculative.decoding as spec_decoding
from m3sdk import Engine


async def run(prompts: list[list[int]], concurrency: int, max_tokens: int, device: str, dtype: str,
              speculative: str | None, profile: bool = False, overlap: bool | None = None, late: bool = False
              ) -> tuple[list[list[int]], float, dict]:
    """(outputs, seconds, stats) of the timed window; stats' `graph_share` is the share of its steps replayed from
    CUDA graphs. `overlap` None: the engine's default (on for CUDA without speculation). `late`: the drafter reads
    each verify step after the host has read it (A/B against the read launched behind the verify forward)."""
    graphs = None if speculative is None or SPEC_GRAPHS else False  # None: the engine's default (on for CUDA)
    async with Engine(device=device, dtype=dtype, max_num_seqs=concurrency, speculative=speculative,
                      cuda_graphs=graphs, overlap_scheduling=overlap) as engine:
        if late and hasattr(engine._core.executor, "spec"):
            engine._core.executor.spec.read_behind_verify = False
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: list[int], tokens: int = max_tokens) -> list[int]:
            async with gate:
                done = await engine.generate(prompt, max_tokens=tokens, temperature=0, ignore_eos=True)
                return done.token_ids

        # warm-up: two waves, so prefills joining running decodes compile their kernels here too (decode, verify
        # and draft-chain graphs were captured when the engine started); sent twice, because the timed window
        # re-sends these prompts as prefix-cache hits, whose 16-token tails at a short context are Triton variants
        # no whole prompt compiles: without the second pass the first engine of a process compiled them in its
        # timed window and later engines reused them (the overlap column, run first, read 1.8-2.4x slow)
        for _ in range(2):
            await asyncio.gather(*[one(p, WARM_UP_TOKENS or max_tokens) for p in prompts[:2 * concurrency]])
        before = engine.stats()
        # CPU time of the engine thread and of this (the event loop's) thread: both need the GIL, and what the loop
        # spends per step on the emitted chunks is host time the engine thread may wait for
        engine_clock = time.pthread_getcpuclockid(engine._core._thread.ident)
        cpu0 = time.clock_gettime(engine_clock), time.thread_time()
        with (profiled(profile) as prof, host_phases(engine, profile or PHASES) as phases,
              step_times(engine) as times):
            start = time.perf_counter()
            outputs = await asyncio.gather(*[one(p) for p in prompts])
            seconds = time.perf_counter() - start
        cpu1 = time.clock_gettime(engine_clock), time.thread_time()
        stats = engine.stats()
        steps = stats["steps"] - before["steps"]
        stats["cpu_ms_per_step"] = {name: round(1e3 * (b - a) / max(steps, 1), 3)
                                    for name, a, b in zip(("engine", "loop"), cpu0, cpu1, strict=True)}
        stats["graph_share"] = round((stats["graph_steps"] - before["graph_steps"]) / max(steps, 1), 3)
        stats["window_steps"] = steps
        # where the window went: step time percentiles, by what the step launched (a prefill chunk, decode or
        # verify rows only, nothing), and the slow steps (a Triton compile, an eager prefill step)
        durations = sorted(t for t, _ in times)
        slow = [t for t in durations if t > SLOW_STEP_S]
        stats["step_ms_median"] = percentile_ms(durations, 0.5)
        stats["step_ms"] = {f"p{q}": percentile_ms(durations, q / 100) for q in (10, 50, 90, 99)}
        stats["step_kinds"] = {kind: [len(ts), round(sum(ts), 4), percentile_ms(ts, 0.5), percentile_ms(ts, 0.9)]
                               for kind in ("decode", "prefill", "idle")
                               if (ts := sorted(t for t, k in times if k == kind))}
        stats["slow_steps"], stats["slow_steps_s"] = len(slow), round(sum(slow), 3)
        stats["step_s_total"] = round(sum(durations), 3)
        if PHASES:
            stats["host_ms_per_step"] = {k: round(1e3 * v / max(steps, 1), 3) for k, v in phases.items()}
        if prof is not None:
            name = speculative or ("plain" if overlap is None else "plain-no-overlap")
            row = dict(**device_time(prof, sum(len(o) for o in outputs), seconds, name, concurrency),
                       graph_share=stats["graph_share"], steps=steps,
                       host_ms_per_step={k: round(1e3 * v / max(steps, 1), 3) for k, v in phases.items()})
            record(**row)
            print(f"profile {name}: {row['wall_ms_per_token']} ms wall / {row['device_ms_per_token']} ms device / "
                  f"{row['kernels_per_token']} kernels per token, {row['tokens'] / max(steps, 1):.2f} tokens per "
                  f"step, graph steps {row['graph_share']:.0%}; host ms per step {row['host_ms_per_step']}",
                  flush=True)
        return outputs, seconds, stats


@contextlib.contextmanager
def profiled(on: bool):
    """torch.profiler over the timed window (CUPTI sees every kernel, whichever thread launched it, graph replays'
    kernels included)."""
    if not on:
        yield None
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        yield prof


SLOW_STEP_S = 0.010  # a step this long is a compile or an eager step, not a replayed one (m3-tiny: ~1-2 ms)


def percentile_ms(sorted_s: list[float], q: float) -> float:
    return round(1e3 * sorted_s[min(int(q * len(sorted_s)), len(sorted_s) - 1)], 3) if sorted_s else 0.0


@contextlib.contextmanager
def step_times(engine: Engine):
    """(wall seconds, kind) of each engine step (`EngineCore.step`) in the window; kind is what the step scheduled:
    "prefill" (a chunk longer than a verify step), "decode" (decode or verify rows only) or "idle". Benchmark
    instrumentation on the engine's core, restored after."""
    core, times = engine._core, []
    saved = [(obj, attr, obj.__dict__.get(attr)) for obj, attr in ((core, "step"), (core.scheduler, "schedule"))]
    step, schedule, longest = core.step, core.scheduler.schedule, [0]  # (host_phases may have wrapped them)
    spec = getattr(core.executor, "spec", None)
    verify = 1 + (spec.k if spec is not None else 0)

    def scheduled():
        plan = schedule()
        longest[0] = max((s.num_new_tokens for s in plan.scheduled), default=0)
        return plan

    def timed():
        longest[0] = 0
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            kind = "prefill" if longest[0] > verify else "decode" if longest[0] else "idle"
            times.append((time.perf_counter() - t0, kind))

    core.step, core.scheduler.schedule = timed, scheduled
    try:
        yield times
    finally:
        restore(saved)


@contextlib.contextmanager
def host_phases(engine: Engine, on: bool):
    """Seconds the engine thread spent in each phase of its steps (wall time of the calls, nested ones counted in
    both; a call that reads the device's results includes waiting for them): where a step's host time goes.
    Reaches into the engine's core (benchmark instrumentation, restored after)."""
    totals: dict[str, float] = {}
    if not on:
        yield totals
        return
    core = engine._core
    targets = [(core, "step"), (core.scheduler, "schedule"), (core.scheduler, "update"), (core.runner, "forward"),
               (core.executor.sampler, "sample"), (core.executor.sampler, "launch"), (core.output, "process"),
               (core.output, "flush")]
    if core.runner.graphs is not None:  # the graph step's host upload, and its replay (the launch alone)
        targets += [(core.runner.graphs, "stage"), (core.runner.graphs, "replay")]
    spec = getattr(core.executor, "spec", None)
    if spec is not None:
        targets += [(spec.drafter, "propose"), (spec.drafter, "observe"), (spec_decoding, "verify"),
                    (spec, "launch"), (spec, "finish")]
        if hasattr(spec.drafter, "read_ahead"):
            targets += [(spec.drafter, "read_ahead"), (spec.drafter, "read_unverified")]

    def timed(name: str, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0
        return call

    saved = [(obj, attr, obj.__dict__.get(attr)) for obj, attr in targets]
    for obj, attr in targets:
        name = f"spec_{attr}" if obj is spec else attr.lstrip("_")
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    try:
        yield totals
    finally:
        restore(saved)


def restore(saved: list[tuple[object, str, object]]) -> None:
    """Put back what benchmark wrappers replaced: an instance attribute, or none (the class's method)."""
    for obj, attr, old in saved:
        if old is None:
            delattr(obj, attr)
        else:
            setattr(obj, attr, old)


def device_time(prof, tokens: int, seconds: float, name: str, concurrency: int) -> dict:
    """Where a generated token's time goes: wall vs device busy time (kernels), kernels launched, top kernels."""
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
    busy = sum(sum(v) for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:8]
    return dict(profile=name, concurrency=concurrency, tokens=tokens,
                wall_ms_per_token=round(1e3 * seconds / tokens, 3), device_ms_per_token=round(busy / 1e3 / tokens, 3),
                kernels_per_token=round(sum(len(v) for v in kernels.values()) / tokens, 1),
                top_kernels_us_per_token=[(k, round(sum(v) / tokens, 1)) for k, v in top])


OUT = None  # the --out file
SPEC_GRAPHS = True  # --spec-eager turns CUDA graphs off for the speculative engines only
WARM_UP_TOKENS = 0  # --warm-up-tokens (0: --max-tokens)
PHASES = False  # --phases: host time per phase in every row (cheap wrappers, no profiler)


def cell(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else format(value, fmt) + unit


def record(**kw) -> None:
    if OUT is not None:
        OUT.write(json.dumps(kw) + "\n")
        OUT.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="auto", help="float32 makes greedy outputs batch-invariant enough to compare")
    ap.add_argument("--check-prompts", type=int, default=4, help="float32 batch-1 prompts that must match (0: skip)")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument("--profile", default="",
                    help="concurrencies to profile last (device time, kernels and host phases per token) into --out: "
                         "2 requests at 1, 2c at c (e.g. 1,8)")
    ap.add_argument("--plain-modes", default="overlap,sync",
                    help="plain engines to time: overlap (the engine's default on a GPU), sync (overlap off)")
    ap.add_argument("--spec-eager", action="store_true", help="no CUDA graphs for the speculative engines")
    ap.add_argument("--min-requests", type=int, default=8, help="requests per timed window: max(2 c, this)")
    ap.add_argument("--phases", action="store_true", help="host ms per step by phase in every row (no profiler)")
    ap.add_argument("--spec-modes", default="early",
                    help="speculative engines to time: early (the drafter's read launched behind each greedy verify "
                         "forward, the default), late (read after the host has read the step: the older order)")
    ap.add_argument("--repeat", type=int, default=1, help="time every engine this many times (rows each)")
    ap.add_argument("--warm-up-tokens", type=int, default=0,
                    help="tokens per warm-up request (0: --max-tokens); fewer make a large batch's run shorter")
    args = ap.parse_args()
    global OUT, SPEC_GRAPHS, WARM_UP_TOKENS, PHASES
    OUT = open(args.out, "a") if args.out else None  # noqa: SIM115 - open for the whole run
    SPEC_GRAPHS = not args.spec_eager
    WARM_UP_TOKENS = args.warm_up_tokens
    PHASES = args.phases
    record(run="spec_speedup", argv=sys.argv[1:])
    if args.check_prompts:
        prompts = held_out_prompts(args.check_prompts, args.prompt_tokens)
        # IEEE fp32 Triton dots for the check only (tl.dot on fp32 defaults to TF32: bf16-like rounding, which
        # differs between batch shapes); kernels compiled under it are cached apart from the timed runs'
        previous = os.environ.get("TRITON_F32_DEFAULT")
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
        plain, _, p_stats = asyncio.run(run(prompts, 1, args.max_tokens, args.device, "float32", None))
        spec, _, stats = asyncio.run(run(prompts, 1, args.max_tokens, args.device, "float32", "eagle3"))
        if previous is None:
            del os.environ["TRITON_F32_DEFAULT"]
        else:
            os.environ["TRITON_F32_DEFAULT"] = previous
        same = sum(a == b for a, b in zip(plain, spec, strict=True))
        # where each output first differs (None: identical): a late split is a rounding tie, an early one a bug
        first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                 for a, b in zip(plain, spec, strict=True)]
        record(check="float32 batch 1 eagle3 == plain", prompts=len(prompts), identical=same, first_diff=first,
               graph_share_plain=p_stats["graph_share"], graph_share_spec=stats["graph_share"],
               mean_accepted_length=stats["spec_mean_accepted_length"])
        print(f"check: float32 batch 1, {same}/{len(prompts)} speculative outputs identical to plain "
              f"{'' if same == len(prompts) else f'MISMATCH (first differing token {first}) '}"
              f"(mean accepted length {stats['spec_mean_accepted_length']:.2f}; graph steps plain "
              f"{p_stats['graph_share']:.0%}, eagle3 {stats['graph_share']:.0%})", flush=True)

    print("| dtype | conc | requests | plain tok/s (overlap) | plain tok/s (no overlap) | eagle3 tok/s | speed-up "
          "vs overlap | vs no overlap | identical | accepted len | graph steps plain / no-ov / eagle3 | read |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    overlaps = {"overlap": None, "sync": False}  # plain engine modes: the engine's default (on), and off
    modes = [m for m in overlaps if m in args.plain_modes.split(",")]
    orders = {"early": False, "late": True}  # speculative engine modes: the `late` flag of `run`
    spec_modes = [m for m in orders if m in args.spec_modes.split(",")]
    for c in (int(x) for x in args.concurrency.split(",")):
        prompts = held_out_prompts(max(2 * c, args.min_requests), args.prompt_tokens)
        for repeat in range(args.repeat):
            plains = {m: asyncio.run(run(prompts, c, args.max_tokens, args.device, args.dtype, None,
                                         overlap=overlaps[m])) for m in modes}
            specs = {m: asyncio.run(run(prompts, c, args.max_tokens, args.device, args.dtype, "eagle3",
                                        late=orders[m])) for m in spec_modes}
            for order, result in specs.items():
                report(args, c, prompts, repeat, order, {**plains, "spec": result})
    if args.profile:  # separate runs: the profiler's own overhead stays out of the table
        for c in (int(x) for x in args.profile.split(",")):
            prompts = held_out_prompts(max(2, 2 * c if c > 1 else 2), args.prompt_tokens)
            for m in modes + ["spec"]:
                method = "eagle3" if m == "spec" else None
                asyncio.run(run(prompts, c, args.max_tokens, args.device, args.dtype, method, True,
                                overlaps.get(m), late=orders[spec_modes[0]]))


def report(args: argparse.Namespace, c: int, prompts: list[list[int]], repeat: int, order: str,
           runs: dict[str, tuple[list[list[int]], float, dict]]) -> None:
    """One row (markdown and JSON) for plain engines and one speculative engine timed on the same prompts."""
    spec, t_spec, stats = runs["spec"]
    plain = next(iter(runs.values()))[0]
    tokens = sum(len(o) for o in plain)
    rate = {m: round(tokens / r[1], 1) for m, r in runs.items()}
    gain = {m: round(r[1] / t_spec, 3) for m, r in runs.items()}
    row = dict(dtype=args.dtype, spec_graphs=SPEC_GRAPHS, read=order, repeat=repeat, concurrency=c,
               requests=len(prompts), max_tokens=args.max_tokens, warm_up_tokens=WARM_UP_TOKENS or args.max_tokens,
               plain_tok_s=rate.get("overlap"), plain_no_overlap_tok_s=rate.get("sync"), spec_tok_s=rate["spec"],
               speedup=gain.get("overlap"), speedup_vs_no_overlap=gain.get("sync"),
               identical=all(r[0] == spec for r in runs.values()),
               mean_accepted_length=round(stats["spec_mean_accepted_length"], 3),
               target_forwards_per_token=round(stats["spec_target_forwards_per_token"], 3),
               graph_share={m: r[2]["graph_share"] for m, r in runs.items()},
               steps={m: r[2]["window_steps"] for m, r in runs.items()},
               step_ms_median={m: r[2]["step_ms_median"] for m, r in runs.items()},
               slow_steps={m: [r[2]["slow_steps"], r[2]["slow_steps_s"], r[2]["step_s_total"]]
                           for m, r in runs.items()},
               step_ms={m: r[2]["step_ms"] for m, r in runs.items()},
               step_kinds={m: r[2]["step_kinds"] for m, r in runs.items()},
               host_ms_per_step={m: r[2].get("host_ms_per_step") for m, r in runs.items()},
               cpu_ms_per_step={m: r[2]["cpu_ms_per_step"] for m, r in runs.items()},
               seconds={m: round(r[1], 3) for m, r in runs.items()})
    record(**row)
    shares = " / ".join(cell(row["graph_share"].get(m), ".0%") for m in ("overlap", "sync", "spec"))
    print(f"| {args.dtype} | {c} | {len(prompts)} | {cell(row['plain_tok_s'], '.0f')} | "
          f"{cell(row['plain_no_overlap_tok_s'], '.0f')} | {row['spec_tok_s']:.0f} | "
          f"{cell(row['speedup'], '.2f', 'x')} | {cell(row['speedup_vs_no_overlap'], '.2f', 'x')} | "
          f"{row['identical']} | {row['mean_accepted_length']:.2f} | {shares} | {order} |", flush=True)


if __name__ == "__main__":
    main()
