"""Serving performance of an M3 slice on one GPU, each ratio from one run (method: ../shared/design/kernels.md).

    PYTHONPATH=src python benchmarks/serving.py STEP [--slice DIR] [--out DIR] [...]

Steps (each in its own process, so a fault in one does not take the others down; each appends JSON lines to
OUT/serving.jsonl and prints them):
  slice      write the slice (scripts/make_m3_slice.py: real width, --dense + --sparse layers, random weights)
  decode     decode step time of the engine's forward (captured CUDA graph, static-buffer copies included;
             eager beside it) at (batch, context) points, against the roofline: bytes that one step must read
             (every active weight once: attention, dense MLP, router, shared expert, each distinct routed
             expert the batch picked, lm_head; the FP8 KV it attends to: all of a dense layer's, the selected
             16 x 128 keys per KV group of a sparse layer, plus all index keys) over the read bandwidth measured
             in the same process. Also checks a graph replay against the eager forward (same step, same cache).
             --quantization fp8: FP8 W8A8 attention projections, dense MLP and shared expert (m3sdk/model/quantize.py);
             routed experts, router and lm_head stay bf16, and the roofline counts each at the bytes it is stored in
             (the record's `weights_by_dtype` says which).
  engine     the real engine under load (m3sdk.bench's run_load, metrics under vLLM's names) on one loaded engine per
             --tp value: fixed concurrency --concurrency, overlap_scheduling on vs off alternately (and, on TP=1, with
             the CUDA graphs detached: eager, as TP without graphs runs), after a greedy check that overlap on and
             off give the same tokens and a warm-up pass that compiles the mixed prefill + decode shapes.
  hf         HF transformers generate of the same slice: decode step time at batch 1 and 16 after a 2048-token
             prompt ((t(9 new tokens) - t(1)) / 8).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from gpu_timing import read_bandwidth

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(".")
JSONL = "serving.jsonl"


def record(**row) -> None:
    row["step_time"] = time.strftime("%H:%M:%S")
    with open(OUT / JSONL, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def step_slice(args) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_m3_slice import make_slice

    t = time.perf_counter()
    make_slice(args.slice, args.dense, args.sparse, device="cuda" if torch.cuda.is_available() else "cpu",
               max_position_embeddings=args.max_position_embeddings,
               overrides=dict(json.loads(s) for s in args.set))
    size = sum(f.stat().st_size for f in args.slice.glob("*.safetensors"))
    record(step="slice", path=str(args.slice), dense=args.dense, sparse=args.sparse, gbytes=size / 1e9,
           seconds=time.perf_counter() - t)


def fill_cache(kv, seed: int = 0) -> None:
    """Random K/V (FP8 with positive per-token scales) and index keys: never time on zeros."""
    g = torch.Generator(device=kv.spec.device).manual_seed(seed)
    for tensors in (kv.k, kv.v, kv.index_k):
        for t in tensors:
            if t is None:
                continue
            for chunk in t.split(4096):
                chunk.copy_(torch.randn(chunk.shape, generator=g, device=t.device, dtype=torch.bfloat16))
    for tensors in (kv.k_scale, kv.v_scale):
        for t in tensors:
            if t is not None:
                t.uniform_(0.005, 0.05, generator=g)


def decode_step(batch: int, context: int, pages_per_seq: int, perm: torch.Tensor, device):
    """A decode step of `batch` sequences at `context` on random pages (`perm`): (its page tables as host lists,
    its device metadata for the eager forward)."""
    from m3sdk.attention.base import PAGE_SIZE, AttentionMetadata

    tables = perm[: batch * pages_per_seq].view(batch, pages_per_seq)[:, : -(-context // PAGE_SIZE)].tolist()
    return tables, AttentionMetadata.build([1] * batch, [context] * batch, tables, device=device)


def staged_replay(graphs, ids: list[int], context: int, tables: list[list[int]], q: int = 1):
    """Stage a step of q new tokens per sequence (1: decode; 1 + k: a speculative verify step) that ends at
    `context` into `graphs` the way the engine does (one upload from host lists) -> a call that replays it (the
    timed part: the graph alone, on inputs that stay staged), or None when it fits no graph."""
    batch = len(ids) // q
    key = graphs.key(batch, q, context, len(tables[0]))
    if key is None:
        return None
    graphs.stage(key, ids, [q] * batch, [context] * batch, tables)
    return lambda: graphs.replay(key)


def distinct_experts(model, input_ids, meta, kv) -> dict[int, int]:
    """Layer -> how many distinct routed experts this step's tokens picked that this model (rank) holds (one eager
    forward, hooks only; under expert parallel a rank holds experts [first_expert, first_expert + E_local))."""
    from m3sdk.model.layers import SparseMoE, route

    seen: dict[int, int] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, SparseMoE):
            def hook(module, args, i=i):
                _, ids = route(args[0], module.router_weight, module.e_score_correction_bias, module.top_k)
                local = ids.unique() - getattr(module, "first_expert", 0)
                seen[i] = int(((local >= 0) & (local < module.w_gate_up.shape[0])).sum())
            hooks.append(layer.mlp.register_forward_pre_hook(hook))
    model(input_ids, meta, kv, torch.arange(input_ids.shape[0], device=input_ids.device))
    for h in hooks:
        h.remove()
    return seen


def step_bytes(model, kv, batch: int, context: int, experts: dict[int, int]) -> dict[str, float]:
    """Bytes one decode step must read, by kind."""
    c = model.config

    def nbytes(module, skip=()) -> int:  # parameters and buffers (FP8 linears keep their weights as buffers)
        tensors = [*module.named_parameters(), *module.named_buffers()]
        return sum(t.numel() * t.element_size() for n, t in tensors if n not in skip)

    weights = 0
    for i, layer in enumerate(model.layers):
        weights += nbytes(layer.self_attn)
        mlp = layer.mlp
        if i in experts:
            per_expert = (mlp.w_gate_up[0].numel() + mlp.w_down[0].numel()) * mlp.w_gate_up.element_size()
            weights += experts[i] * per_expert + nbytes(mlp, skip=("w_gate_up", "w_down"))
        else:
            weights += nbytes(mlp)
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    kv_elt = kv.k[0].element_size()
    per_token = 2 * c.num_kv_heads * c.head_dim * kv_elt + (2 * c.num_kv_heads * 4 if kv.k_scale[0] is not None
                                                             else 0)
    selected = min(c.index_topk_blocks * c.index_block_size, context)
    kv_bytes = 0
    index_bytes = 0
    for i in range(c.num_layers):
        if c.is_sparse(i):
            kv_bytes += batch * selected * per_token
            index_bytes += batch * context * c.index_head_dim * kv.index_k[i].element_size()
        else:
            kv_bytes += batch * context * per_token
    return {"weights": weights, "lm_head": head, "kv": kv_bytes, "index_keys": index_bytes,
            "total": weights + head + kv_bytes + index_bytes}


def weights_by_dtype(model) -> dict[str, float]:
    """GB of the model's weights (parameters and buffers) by dtype: what quantization actually changed."""
    out: dict[str, float] = {}
    for t in (*model.parameters(), *model.buffers()):
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0.0) + t.numel() * t.element_size() / 1e9
    return out


# kernel name -> kind, first match wins (m3sdk_kernels' Triton names, cuBLAS's, NCCL's, torch's elementwise)
KERNEL_KINDS = (("nccl", ("nccl",)), ("moe", ("_moe_",)), ("router", ("_route_",)),
                ("attention", ("_attn_kernel", "_merge_kernel")), ("indexer", ("_scan_kernel", "_topk_kernel")),
                ("fp8_gemm", ("_fp8_gemm", "_quant_rows")), ("cublas", ("gemm", "gemv", "nvjet", "xmma", "cutlass")),
                ("norm_rope_write", ("norm", "_write_kv", "_write_index")), ("memcpy", ("memcpy", "memset")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def kernel_profile(fn, calls: int = 20) -> dict:
    """Device time per call of `fn`'s kernels (torch.profiler: a graph replay's kernels show one by one), by kind
    and the top kernels by name, plus the busy time (union of kernel intervals) against the wall time per call:
    wall - busy is the device idling between kernels (launch gaps, waits for the host)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / calls
    # "nccl:all_reduce" and the like are the profiler's device-side annotations of a collective, not kernels: the
    # ncclDevKernel_* under them are counted
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and not e.name.startswith("nccl:"))
    by_name: dict[str, list[float]] = {}
    busy, end = 0.0, float("-inf")
    for a, b, name in spans:
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += b - a
        entry[1] += 1
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    kinds: dict[str, float] = {}
    for name, (us, _) in by_name.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us / calls
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:14]
    return {"wall_us": wall * 1e6, "busy_us": busy / calls, "kernel_us": sum(kinds.values()),
            "kernels_per_call": len(spans) / calls, "by_kind_us": {k: round(v, 1) for k, v in
                                                                   sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [[name[:70], round(us / calls, 1), n / calls] for name, (us, n) in top]}


def step_decode(args) -> None:
    import triton

    from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
    from m3sdk.graphs import DecodeGraphs
    from m3sdk.model.loader import load_model
    from m3sdk_kernels.arch import fp8_dtype

    dev = torch.device("cuda")
    tp_size = args.tp[0]
    bw = read_bandwidth() / 1e3  # TB/s
    record(step="bandwidth", read_tb_s=bw, device=torch.cuda.get_device_name(0), torch=torch.__version__,
           triton=triton.__version__)
    t = time.perf_counter()
    tp = None
    if tp_size > 1:  # rank 0 here, ranks 1.. in worker processes that mirror every forward and graph replay
        from m3sdk.parallel import MirroredGraphs, TensorParallel

        tp = TensorParallel.launch(args.slice, tp_size, dev, torch.bfloat16, "triton", args.expert_parallel,
                                   args.load_format, quantization=args.quantization)
        model, dev = tp.model, torch.device("cuda", 0)
    elif args.load_format == "dummy":
        from m3sdk.model.config import ModelConfig
        from m3sdk.model.dummy import dummy_model

        model = dummy_model(ModelConfig.from_pretrained(args.slice), dev, torch.bfloat16, "triton",
                            quantization=args.quantization)
    else:
        model = load_model(args.slice, dev, torch.bfloat16, "triton", quantization=args.quantization)
    try:
        torch.cuda.synchronize()
        record(step="load", tp=tp_size, expert_parallel=args.expert_parallel, seconds=time.perf_counter() - t,
               quantization=args.quantization, weights_by_dtype=weights_by_dtype(model),
               lm_head_dtype=str(model.lm_head.weight.dtype),
               qkv_dtype=str(model.layers[0].self_attn.qkv_proj.weight.dtype))
        points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
        max_b, max_ctx = max(b for b, _ in points), max(c for _, c in points)
        pages_per_seq = -(-max_ctx // 16) + 1
        spec = KVCacheSpec.for_model(model.config, max_b * pages_per_seq, kv_dtype="fp8", index_dtype="fp8",
                                     fp8_dtype=fp8_dtype(dev), model_dtype=torch.bfloat16, device=dev)
        kv = KVPool(spec)
        fill_cache(kv)  # rank 0's; the workers' pools stay zeros (same kernels, same bytes read)
        perm = torch.randperm(spec.num_pages, generator=torch.Generator().manual_seed(0))
        t = time.perf_counter()
        # a verify step of q tokens ending at a point's context needs graphs up to q - 1 positions past it
        graphs = (MirroredGraphs(tp, model, kv, max_b, max_ctx, dev) if tp is not None
                  else DecodeGraphs(model, kv, max_b, max_ctx + max(args.verify, default=1) - 1, dev,
                                    query_lens=(1, *args.verify)))
        torch.cuda.synchronize()
        record(step="capture", tp=tp_size, buckets=graphs.buckets, seconds=time.perf_counter() - t)
        gen = torch.Generator(device=dev).manual_seed(1)
        for batch, context in points:
            tables, meta = decode_step(batch, context, pages_per_seq, perm, dev)
            ids = torch.randint(0, model.config.vocab_size, (batch,), device=dev, generator=gen)
            rows = torch.arange(batch, device=dev)
            experts = distinct_experts(model, ids, meta, kv)
            _, eager_logits = model(ids, meta, kv, rows)
            replay = staged_replay(graphs, ids.tolist(), context, tables)
            graph_logits = replay()[1][:batch]
            err = ((graph_logits - eager_logits).norm() / eager_logits.norm()).item()
            agree = (graph_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item()
            t_graph = triton.testing.do_bench(replay, warmup=10, rep=200, return_mode="median")
            t_eager = triton.testing.do_bench(lambda: model(ids, meta, kv, rows), warmup=5, rep=100,  # noqa: B023
                                              return_mode="median")
            need = step_bytes(model, kv, batch, context, experts)  # this rank's bytes under tensor parallel
            floor_ms = need["total"] / bw / 1e9
            record(step="decode", tp=tp_size, expert_parallel=args.expert_parallel, quantization=args.quantization,
                   batch=batch, context=context, graph_ms=t_graph, eager_ms=t_eager,
                   roofline_ms=floor_ms, graph_over_roofline=t_graph / floor_ms,
                   bandwidth_fraction=floor_ms / t_graph, bytes=need, distinct_experts=experts,
                   graph_vs_eager_rel_err=err, graph_vs_eager_argmax_agree=agree, tok_s=batch / t_graph * 1e3)
            if args.profile:
                for mode, fn in (("graph", replay),
                                 ("eager", lambda: model(ids, meta, kv, rows))):  # noqa: B023
                    try:
                        prof = kernel_profile(fn)
                    except Exception as exc:  # noqa: BLE001 - a profiler failure must not lose the timings
                        prof = {"error": repr(exc)[:300]}
                    record(step="decode_profile", tp=tp_size, quantization=args.quantization, batch=batch,
                           context=context, mode=mode, **prof)
            # a verify step of q tokens per sequence against this decode step (last: its inputs replace the decode
            # step's in the graphs' static buffers)
            for q in args.verify:
                verify = staged_replay(graphs, torch.randint(0, model.config.vocab_size, (batch * q,),
                                                             generator=torch.Generator().manual_seed(q)).tolist(),
                                       context, tables, q)
                if verify is None:
                    raise SystemExit(f"--verify {q}: no graph holds that step (tensor parallel captures q = 1 only)")
                t_verify = triton.testing.do_bench(verify, warmup=10, rep=200, return_mode="median")
                record(step="verify", tp=tp_size, quantization=args.quantization, batch=batch, context=context,
                       q=q, verify_ms=t_verify, decode_ms=t_graph, verify_over_decode=t_verify / t_graph)
    finally:
        if tp is not None:
            tp.shutdown()


def _set_overlap(core, overlap: bool) -> None:
    """Switch an idle engine's executor between overlapped and plain steps (benchmark instrumentation: an engine
    picks its executor once, at build)."""
    from m3sdk.core.executor import Executor, OverlappedExecutor

    kind = OverlappedExecutor if overlap else Executor
    ex = core.executor
    core.executor = kind(ex.runner, ex.scheduler, ex.sampler)


async def _idle(engine) -> None:
    """Wait until the engine thread has no request and no step in flight (knobs are switched only then)."""
    core = engine._core
    while core.scheduler.num_running or core.scheduler.num_waiting or core.executor.busy:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: identical)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


def top2_gap(completion, at: int) -> float | None:
    """Logprob of the top token minus the runner-up's at position `at` (a near-tie is a gap of a few 1e-3)."""
    top = completion.logprobs[at].top_logprobs if completion.logprobs and at < len(completion.logprobs) else None
    return top[0][1] - top[1][1] if top and len(top) > 1 else None


class StepPhases:
    """Host timings of one engine's loop, step by step (`--phases`): its methods are wrapped on the instance, so
    every step records when it began, what its plan held, and the host seconds spent in each phase:
    schedule, launch (runner.run: inputs, metadata, the forward's launches or a graph replay; under tensor
    parallel also the step message to the workers and the input broadcast's launch), sample (the sampler's
    launch; with overlap off, sampling and its token read), wait (overlapped: the host waiting for the previous
    step's tokens, i.e. the device time the host work did not cover), accept (detokenize, stop checks, finish)
    and update. A step's period is the time to the next step's start: in steady decode, the time per token."""

    def __init__(self, core):
        self.steps: list[dict] = []
        self._cur: dict = {}
        self._originals = []
        self._wrap(core, "step", self._step)
        self._wrap(core.scheduler, "schedule", self._schedule)
        self._wrap(core.runner, "run", self._phase("launch"))
        self._wrap(core.executor.sampler, "sample", self._phase("sample"))
        self._wrap(core.executor.sampler, "launch", self._launch)
        self._wrap(core.output, "process", self._phase("accept"))
        self._wrap(core.scheduler, "update", self._phase("update"))

    def _wrap(self, obj, name: str, make) -> None:
        fn = getattr(obj, name)
        self._originals.append((obj, name))
        setattr(obj, name, make(fn))

    def restore(self) -> None:
        for obj, name in self._originals:
            delattr(obj, name)  # the class's method shows again

    def _add(self, key: str, seconds: float) -> None:
        self._cur[key] = self._cur.get(key, 0.0) + seconds

    def _phase(self, key: str):
        def make(fn):
            def timed(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self._add(key, time.perf_counter() - t)
            return timed
        return make

    def _step(self, fn):
        def timed(*a, **k):
            self._cur = {"t0": time.perf_counter()}
            try:
                return fn(*a, **k)
            finally:
                self._cur["t1"] = time.perf_counter()
                self.steps.append(self._cur)
        return timed

    def _schedule(self, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            plan = fn(*a, **k)
            self._add("schedule", time.perf_counter() - t)
            if plan:
                counts = [n for _, n, _ in plan.scheduled]
                self._cur.update(entries=len(counts), tokens=sum(counts), decode=max(counts) == 1)
            return plan
        return timed

    def _launch(self, fn):
        time_it = self._phase("sample")(fn)

        def timed(*a, **k):
            pending = time_it(*a, **k)
            resolve = pending.resolve

            def waited():
                t = time.perf_counter()
                pending._host.get()  # the wait for the tokens' copy (resolve repeats it at no cost)
                self._add("wait", time.perf_counter() - t)
                return resolve()
            pending.resolve = waited
            return pending
        return timed

    def summary(self, batch: int) -> dict:
        """Decode steps of the full batch (every one of `batch` entries adds one token) against the rest."""
        import statistics

        rows = [r for r in self.steps if "entries" in r]
        for r, nxt in zip(rows, rows[1:], strict=False):
            r["period"] = nxt["t0"] - r["t0"]
        rows = [r for r in rows if "period" in r]
        full = [r for r in rows if r["decode"] and r["entries"] == batch]
        other = [r for r in rows if not (r["decode"] and r["entries"] == batch)]
        keys = ("schedule", "launch", "sample", "wait", "accept", "update")
        for r in rows:
            r["accept"] = r.get("accept", 0.0) - r.get("wait", 0.0)  # the wait happens inside _resolve
            r["rest"] = r["period"] - sum(r.get(k, 0.0) for k in keys)  # emit, inbox, what no phase covers
        med = {k: statistics.median([r.get(k, 0.0) for r in full]) * 1e3 for k in (*keys, "rest")} if full else {}
        period = statistics.median([r["period"] for r in full]) if full else float("nan")
        return {"steps": len(rows), "full_decode_steps": len(full),
                "full_decode_period_ms": period * 1e3, "full_decode_tok_s": batch / period if full else None,
                "full_decode_p90_period_ms": (sorted(r["period"] for r in full)[int(0.9 * (len(full) - 1))] * 1e3
                                              if full else None),
                "full_decode_host_ms": {k: round(v, 3) for k, v in med.items()},
                "other_steps": len(other), "other_seconds": sum(r["period"] for r in other),
                "other_tokens": sum(r["tokens"] for r in other),
                "full_decode_seconds": sum(r["period"] for r in full)}


async def _engine_runs(args, tp: int) -> None:
    from m3sdk import Engine, SamplingParams
    from m3sdk.bench import EngineTarget, compute_metrics, random_requests, run_load

    config = dict(model=str(args.slice), kv_cache_dtype="fp8", max_model_len=args.input_len + args.output_len + 16,
                  max_num_seqs=max(args.concurrency), kv_cache_memory=4 << 30, tensor_parallel_size=tp,
                  expert_parallel=args.expert_parallel, overlap_scheduling=True, load_format=args.load_format)
    t = time.perf_counter()
    async with Engine(**config) as e:
        core = e._core
        graphs = core.runner.graphs
        record(step="engine_load", slice=args.slice.name, tp=tp, expert_parallel=args.expert_parallel,
               seconds=time.perf_counter() - t,
               warm_up_seconds=core.warm_up_seconds,
               graphs=graphs is not None, lm_head_rows=core.runner.model.lm_head.weight.shape[0])
        greedy = SamplingParams(temperature=0, ignore_eos=True)
        # a user's first request right after start, then the same prompt again (a prefix-cache hit: its last 16
        # tokens are prefilled at a 512 context); before the engine warmed up at start these paid Triton compiles
        first = random_requests(1, args.input_len, 1, 0.0, core.vocab_size, 98)[0].prompt
        first_ms = []
        for _ in range(2):
            t0 = time.perf_counter()
            await e.generate(first, greedy, max_tokens=1)
            first_ms.append((time.perf_counter() - t0) * 1e3)
        record(step="engine_first", tp=tp, overlap=core.config.overlap, first_request_ms=first_ms[0],
               repeat_prefix_hit_ms=first_ms[1])
        # correctness first: 4 equal requests finish in the same step. A priming run fills the prefix cache, so
        # every compared run prefills the same 16-token tails from the same cached pages (compared against a first,
        # whole prefill, GEMMs of other sizes round differently and a near-tie of the random weights flips); the
        # off-vs-off pair says how deterministic the engine is at all. Where outputs split, the reference's top-2
        # logprob gap there tells a rounding tie (~1e-3) from a bug (a clear winner replaced).
        check = [r.prompt for r in random_requests(4, args.input_len, 1, 0.0, core.vocab_size, 99)]
        traced = SamplingParams(temperature=0, ignore_eos=True, logprobs=2)
        runs = []
        for overlap in (False, False, False, True):  # priming (whole prefills), reference, off again, overlap
            await _idle(e)
            _set_overlap(core, overlap)
            done = await asyncio.gather(*[e.generate(p, traced, max_tokens=min(args.output_len, 128))
                                          for p in check])
            runs.append([c.token_ids for c in done])
            if len(runs) == 2:
                reference = done
        prime, ref, again, ovl = runs
        diffs = [first_diff(a, b) for a, b in zip(ovl, ref, strict=True)]
        record(step="engine_check", tp=tp, overlap_identical=ovl == ref, first_diff=diffs,
               top2_gap_at_diff=[None if d is None else top2_gap(c, d) for c, d in zip(reference, diffs, strict=True)],
               off_off_identical=again == ref, prefix_hit_vs_whole_prefill_identical=prime == ref,
               prefix_hit_vs_whole_prefill_first_diff=[first_diff(a, b) for a, b in zip(prime, ref, strict=True)],
               tokens=ovl[0][:8], reference_tokens=ref)  # all of them: TP=2's compared with TP=1's
        modes = [(g, ov) for g in ([graphs, None] if graphs is not None and tp == 1 else [graphs])
                 for ov in (True, False)]
        if args.modes:  # e.g. "graphs+overlap,graphs": only those, in that order
            named = {("graphs" if g is not None else "eager") + ("+overlap" if ov else ""): (g, ov) for g, ov in modes}
            modes = [named[m] for m in args.modes.split(",") if m in named]
        seed = 0
        for concurrency in args.concurrency:
            for g, overlap in modes:
                if g is None and graphs is not None and concurrency != max(args.concurrency):
                    continue  # eager only at the TP comparison point
                await _idle(e)
                _set_overlap(core, overlap)
                core.runner.graphs = g
                # each mode warms up on its own, and every run draws fresh prompts: no run measures a prefix-cache
                # hit of an earlier one (which prefills 16 tokens instead of the prompt, a shape a warm-up of whole
                # prompts never compiled: the first H200 run measured those compiles as overlap's TTFT)
                n = args.num_prompts or 2 * concurrency
                warm, requests = (random_requests(n, args.input_len, args.output_len, 0.0, core.vocab_size, seed + k)
                                  for k in (0, 1))
                seed += 2
                await run_load(EngineTarget(e), warm, greedy, max_concurrency=concurrency)
                await _idle(e)
                before = core.stats()
                phases = StepPhases(core) if args.phases else None
                try:
                    results, duration = await run_load(EngineTarget(e), requests, greedy, max_concurrency=concurrency)
                finally:
                    if phases is not None:
                        phases.restore()
                m = compute_metrics(results, duration)
                after = core.stats()
                # stalls: inter-token gaps over 100 ms, by the output position they end at (a compile shows once per
                # run, something per-wave or per-finish at the same position in many requests)
                slow = Counter(i + 1 for r in results for i, g in enumerate(r.itl) if g > 0.1)
                record(step="engine", slice=args.slice.name, tp=tp, expert_parallel=args.expert_parallel,
                       concurrency=concurrency,
                       overlap=overlap, graphs=g is not None,
                       input_len=args.input_len, output_len=args.output_len, requests=len(requests),
                       steps=after["steps"] - before["steps"], graph_steps=after["graph_steps"] - before["graph_steps"],
                       prefix_cache_hits=after["prefix_cache_hits"] - before["prefix_cache_hits"],
                       max_itl_ms=max((g for r in results for g in r.itl), default=0.0) * 1e3,
                       stalls=sum(slow.values()), stall_positions=slow.most_common(6),
                       **{k: v for k, v in m.items() if not k.startswith("std")},
                       **({"phases": phases.summary(concurrency)} if phases is not None else {}))
        core.runner.graphs = graphs
        if args.profile:
            await _idle(e)
            engine_step_profile(core, tp, max(args.concurrency), args.input_len + args.output_len, args.slice.name)


def engine_step_profile(core, tp: int, batch: int, context: int, slice_name: str) -> None:
    """The loaded engine's own decode step at (batch, context), outside its loop (which is idle): the graph replay
    (mirrored to the workers under tensor parallel) and the eager forward, timed and kernel-profiled like `decode`,
    on random pages of its KV pool (it writes one slot per sequence there: run after the engine's last load)."""
    import triton

    runner, kv = core.runner, core.cache.kv
    dev = kv.k[0].device
    pages_per_seq = min(-(-context // 16) + 1, kv.spec.num_pages // batch)
    context = min(context, (pages_per_seq - 1) * 16)
    perm = torch.randperm(kv.spec.num_pages, generator=torch.Generator().manual_seed(0))
    tables, meta = decode_step(batch, context, pages_per_seq, perm, dev)
    ids = torch.randint(0, core.vocab_size, (batch,), device=dev)
    rows = torch.arange(batch, device=dev)
    fns = {"eager": lambda: runner.model(ids, meta, kv, rows)}
    replay = None if runner.graphs is None else staged_replay(runner.graphs, ids.tolist(), context, tables)
    if replay is not None:
        fns = {"graph": replay, **fns}
    for mode, fn in fns.items():
        ms = triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median")
        try:
            prof = kernel_profile(fn)
        except Exception as exc:  # noqa: BLE001 - a profiler failure must not lose the timing
            prof = {"error": repr(exc)[:300]}
        record(step="engine_step", slice=slice_name, tp=tp, expert_parallel=core.config.expert_parallel, batch=batch,
               context=context, mode=mode, ms=ms, tok_s=batch / ms * 1e3, **prof)


def step_engine(args) -> None:
    for tp in args.tp:
        asyncio.run(_engine_runs(args, tp))


async def _tiny_tokens(tp: int, overlap: bool, prompts: list[list[int]], max_tokens: list[int], device: str
                       ) -> tuple[list[list[int]], bool]:
    from m3sdk import Engine, SamplingParams

    greedy = SamplingParams(temperature=0, ignore_eos=True)
    async with Engine(model="m3-tiny", device=device, dtype="float32", max_model_len=512, max_num_seqs=16,
                      kv_cache_memory=1 << 30, tensor_parallel_size=tp, overlap_scheduling=overlap) as e:
        done = await asyncio.gather(*[e.generate(p, greedy, max_tokens=m)
                                      for p, m in zip(prompts, max_tokens, strict=True)])
        return [c.token_ids for c in done], e._core.runner.graphs is not None


def step_check(args) -> None:
    """Greedy tokens with overlap on vs off on the GPU, where near-ties are rare: m3-tiny in float32, 12 prompts of
    8-400 tokens with 4-96 output tokens each (so requests finish at different steps and the overlapped engine's
    batches differ from the synchronous one's: a finished request rides one step more). A race in the overlapped
    path (a host buffer reused, a device buffer overwritten before the step that reads it ran) shows as outputs
    that split early; a rounding tie as a late split in one request."""
    import os
    import random

    # Triton's fp32 tl.dot defaults to TF32 (10-bit mantissa): the attention of a row would round differently with
    # another split count (which follows the batch), about as loosely as bf16. IEEE fp32 dots keep near-ties rare.
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 2048) for _ in range(rng.randrange(8, 400))] for _ in range(12)]
    max_tokens = [rng.randrange(4, 96) for _ in prompts]
    for tp in args.tp:
        try:
            off, graphs = asyncio.run(_tiny_tokens(tp, False, prompts, max_tokens, args.device))
            on, _ = asyncio.run(_tiny_tokens(tp, True, prompts, max_tokens, args.device))
        except Exception as exc:  # noqa: BLE001 - one failed TP size must not hide the other's record
            record(step="check", model="m3-tiny", tp=tp, error=repr(exc)[:400])
            continue
        record(step="check", model="m3-tiny", dtype="float32", tp=tp, graphs=graphs, prompts=len(prompts),
               identical=sum(a == b for a, b in zip(on, off, strict=True)), tokens=sum(map(len, off)),
               first_diff=[first_diff(a, b) for a, b in zip(on, off, strict=True)])


def step_table(args) -> None:
    """The records of OUT/serving.jsonl as short tables (decode vs roofline; engine runs) and one line per profile."""
    rows = [json.loads(line) for line in open(OUT / JSONL)]
    print("| tp | quant | b x ctx | graph ms | roofline ms | ratio | BW frac | GB read | eager ms | argmax agree |")
    for r in rows:
        if r["step"] == "decode":
            print(f"| {r.get('tp', 1)} | {r['quantization']} | {r['batch']}x{r['context']} | {r['graph_ms']:.3f} "
                  f"| {r['roofline_ms']:.3f} | {r['graph_over_roofline']:.2f} | {r['bandwidth_fraction']:.2f} "
                  f"| {r['bytes']['total'] / 1e9:.2f} | {r['eager_ms']:.3f} | {r['graph_vs_eager_argmax_agree']:.2f} |")
    print("| tp | conc | overlap | graphs | out tok/s | TPOT med/p99 ms | ITL med/p99 ms | TTFT med/p99 ms | steps |")
    for r in rows:
        if r["step"] == "engine":
            tp = f"{r.get('slice', '')} {r['tp']}{' EP' if r.get('expert_parallel') and r['tp'] > 1 else ''}"
            print(f"| {tp} | {r['concurrency']} | {r['overlap']} | {r['graphs']} | {r['output_throughput']:.0f} "
                  f"| {r['median_tpot_ms']:.2f}/{r['p99_tpot_ms']:.2f} "
                  f"| {r['median_itl_ms']:.2f}/{r['p99_itl_ms']:.2f} "
                  f"| {r['median_ttft_ms']:.1f}/{r['p99_ttft_ms']:.1f} | {r['steps']} |")
            if "phases" in r:
                f = r["phases"]
                print(f"  phases: full-batch decode {f['full_decode_steps']} steps {f['full_decode_period_ms']:.3f} ms "
                      f"({f['full_decode_seconds']:.2f} s), other {f['other_steps']} steps {f['other_seconds']:.2f} s; "
                      f"host ms {f['full_decode_host_ms']}")
        elif r["step"] in ("check", "engine_check", "engine_first", "engine_load"):
            print(json.dumps({k: v for k, v in r.items() if k != "step_time"})[:300])
    for r in rows:
        if r["step"] in ("decode_profile", "engine_step"):
            ep = " EP" if r.get("expert_parallel") and r["tp"] > 1 else ""
            what = (f"{r['step']} {r.get('slice', '')} tp{r['tp']}{ep} {r.get('quantization', '')} "
                    f"{r['batch']}x{r['context']} {r['mode']}"
                    + (f" {r['ms']:.3f} ms" if "ms" in r else ""))
            if "error" in r:
                print(what, r["error"][:200])
            else:
                print(f"{what}: wall {r['wall_us']:.0f} busy {r['busy_us']:.0f} kernels {r['kernel_us']:.0f} us, "
                      f"{r['kernels_per_call']:.0f}/call; {r['by_kind_us']}")


def step_hf(args) -> None:
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    t = time.perf_counter()
    hf = MiniMaxM3VLForCausalLM.from_pretrained(args.slice, dtype=torch.bfloat16, device_map="cuda").eval()
    record(step="hf_load", seconds=time.perf_counter() - t, attn=hf.config._attn_implementation)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for batch in (int(b) for b in args.hf_batches.split(",")):
        ids = torch.randint(0, hf.config.vocab_size - 100, (batch, args.prompt_len), device="cuda", generator=gen)

        def generate(n: int) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,  # noqa: B023
                        do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        generate(2)  # warm-up (allocator, kernels)
        t1, tn = generate(1), generate(9)
        step_s = (tn - t1) / 8
        record(step="hf", batch=batch, prompt_len=args.prompt_len, prefill_s=t1, decode_step_ms=step_s * 1e3,
               tok_s=batch / step_s)


def main() -> None:
    global OUT, JSONL
    p = argparse.ArgumentParser()
    p.add_argument("step", choices=["slice", "decode", "check", "engine", "hf", "table"])
    p.add_argument("--slice", type=Path, default=Path("/tmp/m3-slice"))
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--jsonl", default=JSONL, help="records file under --out")
    p.add_argument("--device", default="cuda", help="check: where m3-tiny runs (cpu: a smoke run of the step)")
    p.add_argument("--dense", type=int, default=1)
    p.add_argument("--sparse", type=int, default=1)
    p.add_argument("--max-position-embeddings", type=int, default=524288)
    p.add_argument("--set", action="append", default=[], help='a config override as a JSON pair: ["k", v]')
    p.add_argument("--points", default="1x2048,16x2048,1x32768,64x32768", help="BATCHxCONTEXT decode points")
    p.add_argument("--quantization", default="none", help="load_model's: none | fp8 (decode step)")
    p.add_argument("--verify", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="decode: also time a speculative verify step of these query lengths at each point (e.g. 4: "
                        "the last token + 3 drafts per sequence), graph replays against the decode step's")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="decode, engine: dummy = random weights for --slice's config.json alone (no weights read)")
    p.add_argument("--profile", action="store_true", help="decode: kernel profile of each point (graph and "
                   "eager); engine: the loaded engine's decode step at the largest concurrency, timed and profiled")
    p.add_argument("--expert-parallel", action="store_true",
                   help="tensor parallel: whole experts per rank instead of every expert's width split")
    p.add_argument("--hf-batches", default="1,16")
    p.add_argument("--tp", type=lambda v: [int(x) for x in v.split(",")], default=[1], help="engine: e.g. 1,2")
    p.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 64])
    p.add_argument("--modes", default="", help="engine: e.g. graphs+overlap,graphs,eager+overlap,eager (default all)")
    p.add_argument("--num-prompts", type=int, default=0, help="engine: requests per point (default 2 x concurrency)")
    p.add_argument("--phases", action="store_true", help="engine: host time per step by phase, full-batch decode "
                   "steps apart (StepPhases)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=2048)
    args = p.parse_args()
    OUT, JSONL = args.out, args.jsonl
    OUT.mkdir(parents=True, exist_ok=True)
    if args.step == "slice" and args.slice.exists():
        shutil.rmtree(args.slice)
    steps = {"slice": step_slice, "decode": step_decode, "check": step_check, "engine": step_engine, "hf": step_hf,
             "table": step_table}
    steps[args.step](args)


if __name__ == "__main__":
    main()
