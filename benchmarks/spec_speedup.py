"""Speculative decoding speed-up: output tokens/s of m3-tiny with its bundled EAGLE3 head vs without, at fixed
concurrency, greedy, on held-out prompts of its domain (benchmarks/spec.py picks them).

    python benchmarks/spec_speedup.py [--device cuda] [--dtype auto] [--concurrency 1,8,16,32,64] [--k 3]
                                      [--spec-modes adaptive,fixed] [--plain-modes auto,sync] [--max-tokens 128]
                                      [--check-prompts 0] [--out spec.jsonl]

One engine per mode, loaded once (max_num_seqs = the largest concurrency) and run at every concurrency in turn:
plain with the engine's default scheduling (`auto`: each step overlapped or read first, whichever measured
faster; `overlap`: always overlapped; `sync`: overlap off), and speculative with the draft depth chosen per step
(`adaptive`, the default) or fixed at k (`fixed`). At each concurrency every engine runs two warm-up waves (the
adaptive engine measures its step costs there too), then the timed window. One markdown row per concurrency:
tokens/s of each engine, each speculative engine's ratio against the first plain mode, whether outputs were
identical, the adaptive engine's steps by depth and mean accepted length, and the share of the timed steps each
engine replayed from CUDA graphs (the engines' `graph_steps` stat); `--out` gets the same as JSON lines, with each
run's steps, step times and slow steps (> 10 ms: a compile or an eager step).

`--check-prompts N` first checks at batch 1 in float32 that speculative outputs equal plain ones (printed, with
where each first differs if not). `--profile 1,8` adds device time, kernels and host phases per token at those
concurrencies.
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


def engine_for(mode: str, device: str, dtype: str, max_num_seqs: int, k: int) -> Engine:
    """The engine of a mode: plain `auto` | `overlap` | `sync`, speculative `adaptive` | `fixed` (k drafts)."""
    spec = None
    if mode in ("adaptive", "fixed"):
        spec = {"method": "eagle3", "num_speculative_tokens": k, "adaptive": mode == "adaptive"}
    overlap = {"auto": None, "overlap": True, "sync": False}.get(mode)
    graphs = None if spec is None or SPEC_GRAPHS else False  # None: the engine's default (on for CUDA)
    return Engine(device=device, dtype=dtype, max_num_seqs=max_num_seqs, speculative=spec, cuda_graphs=graphs,
                  overlap_scheduling=overlap)


async def run(engine: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int, name: str,
              profile: bool = False, warm_up: bool = True) -> tuple[list[list[int]], float, dict]:
    """(outputs, seconds, stats) of a timed window at `concurrency` on a loaded engine; stats' `graph_share` is the
    share of its steps replayed from CUDA graphs, the `spec_*` and overlap counters are the window's."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int], tokens: int = max_tokens) -> list[int]:
        async with gate:
            done = await engine.generate(prompt, max_tokens=tokens, temperature=0, ignore_eos=True)
            return done.token_ids

    if warm_up:
        # two waves, so prefills joining running decodes compile their kernels here too (decode, verify and
        # draft-chain graphs were captured when the engine started); sent twice, because the timed window re-sends
        # these prompts as prefix-cache hits, whose 16-token tails at a short context are Triton variants no whole
        # prompt compiles. An adaptive engine measures its step costs at this batch size here as well.
        for _ in range(2):
            await asyncio.gather(*[one(p, WARM_UP_TOKENS or max_tokens) for p in prompts[:2 * concurrency]])
    before = engine.stats()
    core = engine._core
    # CPU time of the engine thread and of this (the event loop's) thread: both need the GIL, and what the loop
    # spends per step on the emitted chunks is host time the engine thread may wait for
    engine_clock = time.pthread_getcpuclockid(core._thread.ident)
    cpu0 = time.clock_gettime(engine_clock), time.thread_time()
    with (profiled(profile) as prof, host_phases(engine, profile or PHASES) as phases,
          step_times(engine) as times):
        start = time.perf_counter()
        outputs = await asyncio.gather(*[one(p) for p in prompts])
        seconds = time.perf_counter() - start
    cpu1 = time.clock_gettime(engine_clock), time.thread_time()
    after = engine.stats()
    stats = dict(after)
    steps = after["steps"] - before["steps"]
    for key in ("spec_drafted_tokens", "spec_accepted_tokens", "overlap_steps", "read_first_steps"):
        if key in after:
            stats[key] = after[key] - before[key]
    if "spec_steps_by_depth" in after:
        stats["spec_steps_by_depth"] = [a - b for a, b in zip(after["spec_steps_by_depth"],
                                                              before["spec_steps_by_depth"], strict=True)]
    stats["cpu_ms_per_step"] = {n: round(1e3 * (b - a) / max(steps, 1), 3)
                                for n, a, b in zip(("engine", "loop"), cpu0, cpu1, strict=True)}
    stats["graph_share"] = round((after["graph_steps"] - before["graph_steps"]) / max(steps, 1), 3)
    stats["window_steps"] = steps
    # where the window went: step time percentiles, by what the step launched (a prefill chunk, decode or verify
    # rows only, nothing), and the slow steps (a Triton compile, an eager prefill step)
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
        row = dict(**device_time(prof, sum(len(o) for o in outputs), seconds, name, concurrency),
                   graph_share=stats["graph_share"], steps=steps,
                   host_ms_per_step={k: round(1e3 * v / max(steps, 1), 3) for k, v in phases.items()})
        record(**row)
        print(f"profile {name}: {row['wall_ms_per_token']} ms wall / {row['device_ms_per_token']} ms device / "
              f"{row['kernels_per_token']} kernels per token, {row['tokens'] / max(steps, 1):.2f} tokens per "
              f"step, graph steps {row['graph_share']:.0%}; host ms per step {row['host_ms_per_step']}", flush=True)
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


PLAIN_MODES, SPEC_MODES = ("auto", "overlap", "sync"), ("adaptive", "fixed")


def run_modes(modes: list[str], prompts: dict[int, list[list[int]]], args: argparse.Namespace, dtype: str,
              profile: bool = False) -> dict[int, dict[str, tuple[list[list[int]], float, dict]]]:
    """Each mode's engine, loaded once, timed at every concurrency of `prompts` -> {concurrency: {mode: run}}."""
    out: dict[int, dict] = {c: {} for c in prompts}

    async def one_engine(mode: str) -> None:
        async with engine_for(mode, args.device, dtype, max(prompts), args.k) as engine:
            for c, ps in prompts.items():
                out[c][mode] = await run(engine, ps, c, args.max_tokens, mode, profile=profile)

    for mode in modes:
        t0 = time.perf_counter()
        asyncio.run(one_engine(mode))
        print(f"{mode}: {time.perf_counter() - t0:.1f} s (load, warm-up waves, timed windows)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", default="1,8,16,32,64")
    ap.add_argument("--k", type=int, default=3, help="drafts per step: the most (adaptive), all of them (fixed)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="auto", help="float32 makes greedy outputs batch-invariant enough to compare")
    ap.add_argument("--check-prompts", type=int, default=0, help="float32 batch-1 prompts that must match (0: skip)")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument("--profile", default="",
                    help="concurrencies to profile last (device time, kernels and host phases per token) into --out")
    ap.add_argument("--plain-modes", default="auto,sync",
                    help="plain engines: auto (the default: overlapped or read first per step, measured), overlap "
                         "(always overlapped), sync (overlap off); speed-ups are against the first")
    ap.add_argument("--spec-modes", default="adaptive,fixed",
                    help="speculative engines: adaptive (depth per step, 0 .. k), fixed (k every step)")
    ap.add_argument("--spec-eager", action="store_true", help="no CUDA graphs for the speculative engines")
    ap.add_argument("--min-requests", type=int, default=16, help="requests per timed window: max(2 c, this)")
    ap.add_argument("--phases", action="store_true", help="host ms per step by phase in every row (no profiler)")
    ap.add_argument("--warm-up-tokens", type=int, default=0,
                    help="tokens per warm-up request (0: --max-tokens); fewer make a large batch's run shorter")
    args = ap.parse_args()
    global OUT, SPEC_GRAPHS, WARM_UP_TOKENS, PHASES
    OUT = open(args.out, "a") if args.out else None  # noqa: SIM115 - open for the whole run
    SPEC_GRAPHS = not args.spec_eager
    WARM_UP_TOKENS = args.warm_up_tokens
    PHASES = args.phases
    record(run="spec_speedup", argv=sys.argv[1:])
    plain_modes = [m for m in args.plain_modes.split(",") if m in PLAIN_MODES]
    spec_modes = [m for m in args.spec_modes.split(",") if m in SPEC_MODES]
    if args.check_prompts:
        # IEEE fp32 Triton dots for the check only (tl.dot on fp32 defaults to TF32: bf16-like rounding, which
        # differs between batch shapes); kernels compiled under it are cached apart from the timed runs'
        previous = os.environ.get("TRITON_F32_DEFAULT")
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
        check = run_modes(["sync", spec_modes[0]], {1: held_out_prompts(args.check_prompts, args.prompt_tokens)},
                          args, "float32")[1]
        if previous is None:
            del os.environ["TRITON_F32_DEFAULT"]
        else:
            os.environ["TRITON_F32_DEFAULT"] = previous
        (plain, _, p_stats), (spec, _, stats) = check["sync"], check[spec_modes[0]]
        same = sum(a == b for a, b in zip(plain, spec, strict=True))
        # where each output first differs (None: identical): a late split is a rounding tie, an early one a bug
        first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                 for a, b in zip(plain, spec, strict=True)]
        record(check=f"float32 batch 1 {spec_modes[0]} == plain", prompts=len(plain), identical=same,
               first_diff=first, graph_share_plain=p_stats["graph_share"], graph_share_spec=stats["graph_share"],
               mean_accepted_length=stats["spec_mean_accepted_length"])
        print(f"check: float32 batch 1, {same}/{len(plain)} speculative outputs identical to plain "
              f"{'' if same == len(plain) else f'MISMATCH (first differing token {first}) '}"
              f"(graph steps plain {p_stats['graph_share']:.0%}, eagle3 {stats['graph_share']:.0%})", flush=True)

    concurrencies = [int(x) for x in args.concurrency.split(",")]
    prompts = {c: held_out_prompts(max(2 * c, args.min_requests), args.prompt_tokens) for c in concurrencies}
    results = run_modes(plain_modes + spec_modes, prompts, args, args.dtype)
    plain_cols = " | ".join(f"plain {m} tok/s" for m in plain_modes)
    spec_cols = " | ".join(f"{m} tok/s | {m} / plain {plain_modes[0]}" for m in spec_modes)
    print(f"\n| conc | requests | {plain_cols} | {spec_cols} | identical | adaptive steps by depth | accepted len | "
          f"graph steps |\n|{'---|' * (6 + len(plain_modes) + 2 * len(spec_modes))}")
    for c in concurrencies:
        report(args, c, prompts[c], plain_modes, spec_modes, results[c])
    if args.profile:  # separate runs: the profiler's own overhead stays out of the table
        profile = [int(x) for x in args.profile.split(",")]
        run_modes(plain_modes + spec_modes, {c: held_out_prompts(max(2, 2 * c), args.prompt_tokens)
                                             for c in profile}, args, args.dtype, profile=True)


def report(args: argparse.Namespace, c: int, prompts: list[list[int]], plain_modes: list[str], spec_modes: list[str],
           runs: dict[str, tuple[list[list[int]], float, dict]]) -> None:
    """One row (markdown and JSON) for the engines timed on the same prompts at concurrency c."""
    tokens = sum(len(o) for o in runs[plain_modes[0]][0]) if plain_modes else 0
    rate = {m: round(tokens / r[1], 1) for m, r in runs.items()}
    base = plain_modes[0] if plain_modes else None
    gain = {m: round(runs[base][1] / runs[m][1], 3) for m in spec_modes} if base else {}
    first = next(iter(runs.values()))[0]
    row = dict(dtype=args.dtype, spec_graphs=SPEC_GRAPHS, concurrency=c, requests=len(prompts), k=args.k,
               max_tokens=args.max_tokens, warm_up_tokens=WARM_UP_TOKENS or args.max_tokens, tok_s=rate,
               speedup_vs=base, speedup=gain, identical=all(r[0] == first for r in runs.values()),
               steps_by_depth={m: runs[m][2].get("spec_steps_by_depth") for m in spec_modes},
               overlap_steps={m: [runs[m][2].get("overlap_steps"), runs[m][2].get("read_first_steps")]
                              for m in plain_modes},
               mean_accepted_length={m: round(runs[m][2]["spec_mean_accepted_length"], 3) for m in spec_modes},
               target_forwards_per_token={m: round(runs[m][2]["spec_target_forwards_per_token"], 3)
                                          for m in spec_modes},
               graph_share={m: r[2]["graph_share"] for m, r in runs.items()},
               steps={m: r[2]["window_steps"] for m, r in runs.items()},
               step_ms={m: r[2]["step_ms"] for m, r in runs.items()},
               step_kinds={m: r[2]["step_kinds"] for m, r in runs.items()},
               slow_steps={m: [r[2]["slow_steps"], r[2]["slow_steps_s"], r[2]["step_s_total"]]
                           for m, r in runs.items()},
               host_ms_per_step={m: r[2].get("host_ms_per_step") for m, r in runs.items()},
               cpu_ms_per_step={m: r[2]["cpu_ms_per_step"] for m, r in runs.items()},
               seconds={m: round(r[1], 3) for m, r in runs.items()})
    record(**row)
    plain = " | ".join(f"{rate[m]:.0f}" for m in plain_modes)
    spec = " | ".join(f"{rate[m]:.0f} | {cell(gain.get(m), '.2f', 'x')}" for m in spec_modes)
    shares = " / ".join(f"{m} {row['graph_share'][m]:.0%}" for m in runs)
    print(f"| {c} | {len(prompts)} | {plain} | {spec} | {row['identical']} | "
          f"{row['steps_by_depth'].get('adaptive')} | "
          f"{' / '.join(str(v) for v in row['mean_accepted_length'].values())} | {shares} |", flush=True)


if __name__ == "__main__":
    main()
