"""Long context on one GPU: TTFT and TPOT of the M3 slice from 8K to 1M tokens, each against its floor measured in
the same run; and, on any machine, the host work of a decode step and of a prefill chunk against the context.

    PYTHONPATH=src python benchmarks/long_context.py STEP [--slice DIR] [--contexts 8192,131072] [--out DIR]

Steps (JSON lines to OUT/long_context.jsonl, a table at the end):
  host    (CPU is enough) host microseconds per decode step of one request holding each context's pages: the
          cache's allocate + commit, and the decode graphs' staging (DecodeGraphs.stage + the page-table
          update); and per 2048-token prefill chunk at that prefix (AttentionMetadata.build). A real small
          model's graphs and a real page pool; nothing runs on a device.
  gpu     the slice (benchmarks/serving.py slice) on the H200, per context: one engine request (FP8 KV, --quantization
          fp8 weights) of that many prompt tokens and 32 output tokens, greedy: TTFT and TPOT as the caller sees
          them, with the median, p99 and largest gaps between tokens, and the device memory the request needed
          beyond the engine's pools; the prompt's FLOP floor (every GEMM at 2 FLOPs per weight per token, the dense
          layer's causal attention, the sparse layer's 16 x 128 selected keys per query, the indexer's causal scan;
          `prompt_floor`) at the bf16 and fp8 matmul rates measured here; the decode step's roofline
          (serving.step_bytes over the read bandwidth measured here) and its graph replay time on a filled cache,
          both at the engine's first decode context (context + 1: its graph's context bucket). Ratios: TTFT / floor
          (goal <= 1.5), TPOT / roofline and TPOT / replay (goal <= 1.15).
  prefill where a prefill chunk's time goes at a long prefix (H200): one --chunk-token chunk whose prefix ends at
          each context, on a filled FP8 cache of the slice: the whole eager forward of the chunk, and alone the
          dense layer's attention (its TFLOP/s against the bf16 matmul rate measured here), the indexer (scan +
          top-k) and the sparse layer's attention; each chunk's FLOPs beside.
  table   the table of OUT/long_context.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(".")
JSONL = "long_context.jsonl"
CHUNK = 2048


def record(**row) -> None:
    row["step_time"] = time.strftime("%H:%M:%S")
    with open(OUT / JSONL, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


# ------------------------------------------------------------------------------------------------------- host

def step_host(args) -> None:
    from m3sdk.attention.base import PAGE_SIZE, AttentionMetadata
    from m3sdk.cache.kv_pool import KVCacheSpec
    from m3sdk.cache.manager import PagedCacheManager
    from m3sdk.graphs import DecodeGraphs
    from m3sdk.model.loader import load_model
    from m3sdk.params import SamplingParams
    from m3sdk.request import Request

    cpu = torch.device("cpu")
    model = load_model(ROOT / "src/m3sdk/assets/m3-tiny", cpu, torch.float32, "torch")
    top = max(args.contexts)
    steps = 256
    for context in args.contexts:
        spec = KVCacheSpec(num_pages=-(-(top + steps) // PAGE_SIZE) + 16, num_layers=1, num_kv_heads=1, head_dim=8,
                           sparse_layers=(), index_head_dim=8, kv_dtype="fp32", index_dtype="fp32")
        cache = PagedCacheManager(spec)
        graphs = DecodeGraphs(model, cache.kv, 1, top + steps, cpu)
        request = Request("r", [random.randrange(1000) for _ in range(context)], SamplingParams(max_tokens=steps),
                          max_total_tokens=context + steps)
        assert cache.allocate(request, context)
        request.num_computed_tokens = context
        cache.commit(request)
        book, stage = [], []
        for _ in range(steps):  # decode steps as the engine makes them
            request.token_ids.append(1)
            t0 = time.perf_counter()
            assert cache.allocate(request, 1)
            request.num_computed_tokens += 1
            cache.commit(request)
            t1 = time.perf_counter()
            pages = cache.page_table(request)
            key = graphs.key(1, 1, request.num_computed_tokens, len(pages))
            graphs.stage(key, [1], [1], [request.num_computed_tokens], [pages])
            graphs.apply_updates(graphs._num_updates)
            t2 = time.perf_counter()
            book.append(t1 - t0)
            stage.append(t2 - t1)
        pages = cache.page_table(request)
        builds = []
        for _ in range(8):
            t0 = time.perf_counter()
            AttentionMetadata.build([CHUNK], [context], [pages])
            builds.append(time.perf_counter() - t0)
        record(step="host", context=context, pages=len(pages), cache_us=statistics.median(book) * 1e6,
               stage_us=statistics.median(stage) * 1e6, stage_max_us=max(stage) * 1e6,
               prefill_chunk_build_us=statistics.median(builds) * 1e6)


# ------------------------------------------------------------------------------------------------------- gpu

def matmul_rates() -> dict[str, float]:
    """TFLOP/s of an 8192^3 bf16 matmul and of the same shape in FP8 (torch._scaled_mm), as timed here."""
    from gpu_timing import bench

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    rates = {"bf16": 2 * n**3 / bench(lambda: a @ b) / 1e9}
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        rates["fp8"] = 2 * n**3 / bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e9
    except Exception as exc:  # noqa: BLE001 - the bf16 floor still stands
        print(f"fp8 matmul rate not measured: {exc!r}", file=sys.stderr)
    return rates


def prompt_flops(model, tokens: int) -> dict[str, float]:
    """FLOPs a prompt of `tokens` must do: GEMMs (2 per weight a token uses: attention projections, dense MLP,
    shared expert, its top-k routed experts, the router; lm_head at one row), attention (QK and PV, 4 x D per
    head per visible key: the dense layer's causal half, the sparse layer's selected blocks) and the indexer scan."""
    c = model.config
    gemm = 0
    for i, layer in enumerate(model.layers):
        attn = sum(t.numel() for n, t in [*layer.self_attn.named_parameters(), *layer.self_attn.named_buffers()]
                   if t.dim() == 2 and "norm" not in n)
        mlp = layer.mlp
        if i in c.moe_layers:
            routed = c.num_experts_per_tok * (mlp.w_gate_up[0].numel() + mlp.w_down[0].numel())
            rest = sum(t.numel() for n, t in [*mlp.named_parameters(), *mlp.named_buffers()]
                       if t.dim() == 2 and not n.startswith(("w_gate_up", "w_down")))
            per_token = attn + routed + rest
        else:
            per_token = attn + sum(t.numel() for t in [*mlp.parameters(), *mlp.buffers()] if t.dim() == 2)
        gemm += 2 * per_token * tokens
    gemm += 2 * model.lm_head.weight.numel()
    dense_attn = sparse_attn = index = 0
    for i in range(c.num_layers):
        heads = c.num_heads * c.head_dim
        if c.is_sparse(i):
            keys = min(c.index_topk_blocks * c.index_block_size, tokens)
            sparse_attn += 4 * heads * keys * tokens
            index += 2 * c.index_n_heads * c.index_head_dim * tokens * tokens / 2
        else:
            dense_attn += 4 * heads * tokens * tokens / 2
    return {"gemm": gemm, "dense_attention": dense_attn, "sparse_attention": sparse_attn, "indexer": index}


def prompt_floor(flops: dict[str, float], rates: dict[str, float], quantization: str) -> float:
    """Seconds of a prompt's FLOPs at the measured matmul rates: the GEMMs at the FP8 rate where the weights are FP8,
    attention and the indexer (fp16 dots of the FP8 cache) at the bf16 rate."""
    gemm_rate = rates.get("fp8", rates["bf16"]) if quantization == "fp8" else rates["bf16"]
    return flops["gemm"] / (gemm_rate * 1e12) + (sum(flops.values()) - flops["gemm"]) / (rates["bf16"] * 1e12)


async def engine_point(engine, context: int, output_len: int, seed: int) -> dict[str, float]:
    from m3sdk import SamplingParams

    vocab = engine._core.vocab_size
    rng = random.Random(context * 1000 + seed)  # a new prompt each time: no prefix-cache hit
    prompt = [rng.randrange(3, vocab - 3) for _ in range(context)]
    params = SamplingParams(temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    times = []
    async for chunk in engine.stream(prompt, params, max_tokens=output_len):
        times += [time.perf_counter()] * len(chunk.token_ids)
    ttft = times[0] - t0
    # the gaps in output order (before token 2, 3, ...; tokens that arrived together leave none), then sorted
    in_order = [round((b - a) * 1e3, 3) for a, b in zip(times, times[1:], strict=False) if b > a]
    gaps = sorted(g / 1e3 for g in in_order)
    return {"ttft_s": ttft, "tpot_ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3,
            "itl_median_ms": statistics.median(gaps) * 1e3 if gaps else None,
            "itl_p99_ms": gaps[int(0.99 * (len(gaps) - 1))] * 1e3 if gaps else None,
            "itl_max_ms": gaps[-1] * 1e3 if gaps else None, "itl_ms": in_order}


def step_gpu(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import triton
    from gpu_timing import read_bandwidth
    from serving import decode_step, distinct_experts, fill_cache, staged_replay, step_bytes

    from m3sdk import Engine
    from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
    from m3sdk.graphs import DecodeGraphs
    from m3sdk_kernels.arch import fp8_dtype

    bw = read_bandwidth() / 1e3
    rates = matmul_rates()
    record(step="rates", read_tb_s=bw, matmul_tflops=rates, device=torch.cuda.get_device_name(0))
    top = max(args.contexts)
    config = dict(model=str(args.slice), kv_cache_dtype="fp8", max_model_len=top + args.output_len + 16,
                  max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory << 30,
                  quantization=args.quantization, max_num_batched_tokens=args.chunk)

    async def serve() -> None:
        async with Engine(**config) as engine:
            base_bytes = torch.cuda.memory_allocated()
            for context in args.contexts:
                flops = prompt_flops(engine._core.runner.model, context)
                floor = prompt_floor(flops, rates, args.quantization)
                # the first request at a context bucket captures its decode graph (once per engine): the last of
                # --repeat runs is the table's, the first is recorded as cold
                for run in range(args.repeat):
                    torch.cuda.reset_peak_memory_stats()
                    point = await engine_point(engine, context, args.output_len, run)
                    # the device memory the request's prefill and decode needed beyond the engine's fixed pools
                    peak_gib = (torch.cuda.max_memory_allocated() - base_bytes) / 2**30
                    record(step="engine", context=context, chunk=args.chunk, run=run, warm=run == args.repeat - 1,
                           **point, flops=flops, ttft_floor_s=floor, ttft_over_floor=point["ttft_s"] / floor,
                           peak_gib_over_idle=peak_gib,
                           stats={k: v for k, v in engine.stats().items() if k in ("steps", "graph_steps")})

    asyncio.run(serve())
    torch.cuda.empty_cache()
    # the decode step alone, on a filled cache of the top context, the same weights
    from m3sdk.model.loader import load_model

    dev = torch.device("cuda")
    model = load_model(args.slice, dev, torch.bfloat16, "triton", quantization=args.quantization)
    pages_per_seq = -(-top // 16) + 1
    spec = KVCacheSpec.for_model(model.config, pages_per_seq, kv_dtype="fp8", index_dtype="fp8",
                                 fp8_dtype=fp8_dtype(dev), model_dtype=torch.bfloat16, device=dev)
    kv = KVPool(spec)
    fill_cache(kv)
    graphs = DecodeGraphs(model, kv, 1, config["max_model_len"], dev)  # the engine's context buckets
    perm = torch.randperm(spec.num_pages, generator=torch.Generator().manual_seed(0))
    for context in args.contexts:
        # the engine's first decode step after the prompt attends to context + 1 keys (its graph's context bucket)
        tables, meta = decode_step(1, context + 1, pages_per_seq, perm, dev)
        ids = torch.randint(0, model.config.vocab_size, (1,), device=dev)
        experts = distinct_experts(model, ids, meta, kv)
        replay = staged_replay(graphs, ids.tolist(), context + 1, tables)
        replay()
        t_graph = triton.testing.do_bench(replay, warmup=10, rep=200, return_mode="median")
        roofline = step_bytes(model, kv, 1, context + 1, experts)["total"] / bw / 1e9
        record(step="decode", context=context, graph_ms=t_graph, roofline_ms=roofline,
               graph_over_roofline=t_graph / roofline)


def step_prefill(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_timing import bench
    from serving import fill_cache

    from m3sdk.attention.base import AttentionMetadata
    from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
    from m3sdk.model.loader import load_model
    from m3sdk_kernels.arch import fp8_dtype
    from m3sdk_kernels.indexer import indexer_topk
    from m3sdk_kernels.paged_attention import paged_attention

    dev = torch.device("cuda")
    rates = matmul_rates()
    record(step="rates", matmul_tflops=rates, device=torch.cuda.get_device_name(0))
    model = load_model(args.slice, dev, torch.bfloat16, "triton", quantization=args.quantization)
    c = model.config
    top = max(args.contexts)
    spec = KVCacheSpec.for_model(c, -(-top // 16) + 1, kv_dtype="fp8", index_dtype="fp8", fp8_dtype=fp8_dtype(dev),
                                 model_dtype=torch.bfloat16, device=dev)
    kv = KVPool(spec)
    fill_cache(kv)
    perm = torch.randperm(spec.num_pages, generator=torch.Generator().manual_seed(0))
    dense = next(i for i in range(c.num_layers) if not c.is_sparse(i))
    sparse = next((i for i in range(c.num_layers) if c.is_sparse(i)), None)
    gen = torch.Generator(device=dev).manual_seed(0)
    n = args.chunk
    for context in args.contexts:
        pages = perm[:-(-context // 16)].tolist()
        meta = AttentionMetadata.build([n], [context], [pages], device=dev)
        ids = torch.randint(0, c.vocab_size, (n,), device=dev, generator=gen)
        q = torch.randn(n, c.num_heads, c.head_dim, device=dev, dtype=torch.bfloat16, generator=gen)
        hints = dict(max_seqlen_q=n, max_context_len=context)
        scale = c.head_dim**-0.5

        def attend(layer, sel=None):
            return paged_attention(q, kv.k[layer], kv.v[layer], meta.page_table, meta.cu_seqlens_q,  # noqa: B023
                                   meta.context_lens, scale, kv.k_scale[layer], kv.v_scale[layer],  # noqa: B023
                                   layout=kv.spec.layout, block_sel=sel, block_size=c.index_block_size,
                                   **hints)  # noqa: B023

        row = {"forward_ms": bench(lambda: model(ids, meta, kv, None), rep=500),  # noqa: B023
               "dense_attention_ms": bench(lambda: attend(dense), rep=500)}  # noqa: B023
        prefix = context - n
        dense_flops = 4 * c.num_heads * c.head_dim * (n * prefix + n * n / 2)
        row["dense_attention_tflops"] = dense_flops / row["dense_attention_ms"] / 1e9
        row["dense_attention_over_bf16_rate"] = dense_flops / (rates["bf16"] * 1e9) / row["dense_attention_ms"]
        if sparse is not None:
            iq = torch.randn(n, c.index_n_heads, c.index_head_dim, device=dev, dtype=torch.bfloat16, generator=gen)

            def select():
                return indexer_topk(iq, kv.index_k[sparse], meta.page_table, meta.cu_seqlens_q,  # noqa: B023
                                    meta.context_lens, c.index_block_size, c.index_topk_blocks,  # noqa: B023
                                    c.index_local_blocks, **hints)  # noqa: B023

            sel = select()
            row["indexer_ms"] = bench(select, rep=500)
            row["sparse_attention_ms"] = bench(lambda: attend(sparse, sel), rep=500)  # noqa: B023
            row["indexer_scores_mib"] = c.index_n_heads * n * -(-context // c.index_block_size) * 4 / 2**20
        record(step="prefill", context=context, chunk=n, chunks_per_prompt=-(-context // n), **row,
               flops=prompt_flops(model, context))


def step_table(args) -> None:
    rows = [json.loads(line) for line in open(OUT / JSONL)]
    host = [r for r in rows if r["step"] == "host"]
    if host:
        print(f"{'context':>9} {'pages':>7} {'cache us':>9} {'stage us':>9} {'stage max':>10} {'chunk build us':>15}")
        for r in host:
            print(f"{r['context']:>9} {r['pages']:>7} {r['cache_us']:>9.1f} {r['stage_us']:>9.1f} "
                  f"{r['stage_max_us']:>10.1f} {r['prefill_chunk_build_us']:>15.1f}")
    prefill = [r for r in rows if r["step"] == "prefill"]
    if prefill:
        print(f"{'context':>9} {'chunk':>6} {'forward ms':>11} {'dense ms':>9} {'TFLOP/s':>8} {'x bf16':>7} "
              f"{'indexer ms':>11} {'sparse ms':>10} {'scores MiB':>11}")
        for r in prefill:
            print(f"{r['context']:>9} {r['chunk']:>6} {r['forward_ms']:>11.2f} {r['dense_attention_ms']:>9.2f} "
                  f"{r['dense_attention_tflops']:>8.0f} {r['dense_attention_over_bf16_rate']:>7.2f} "
                  f"{r.get('indexer_ms', 0):>11.2f} {r.get('sparse_attention_ms', 0):>10.2f} "
                  f"{r.get('indexer_scores_mib', 0):>11.0f}")
    engine = {r["context"]: r for r in rows if r["step"] == "engine" and r["warm"]}
    cold = {r["context"]: r for r in rows if r["step"] == "engine" and r["run"] == 0}
    decode = {r["context"]: r for r in rows if r["step"] == "decode"}
    if engine:
        print(f"{'context':>9} {'TTFT s':>8} {'floor s':>8} {'x':>6} {'TPOT ms':>8} {'ITL p50':>8} {'ITL p99':>8} "
              f"{'ITL max':>8} {'replay ms':>10} "
              f"{'roofline':>9} {'TPOT/replay':>12} {'TPOT/roof':>10} {'cold TPOT':>10}")
        for context, r in sorted(engine.items()):
            d = decode.get(context, {})
            g, f = d.get("graph_ms"), d.get("roofline_ms")
            print(f"{context:>9} {r['ttft_s']:>8.2f} {r['ttft_floor_s']:>8.2f} {r['ttft_over_floor']:>6.2f} "
                  f"{r['tpot_ms']:>8.3f} {r.get('itl_median_ms') or 0:>8.3f} {r['itl_p99_ms'] or 0:>8.2f} "
                  f"{r.get('itl_max_ms') or 0:>8.2f} {g or 0:>10.3f} {f or 0:>9.3f} "
                  f"{r['tpot_ms'] / g if g else 0:>12.2f} {r['tpot_ms'] / f if f else 0:>10.2f} "
                  f"{cold[context]['tpot_ms']:>10.3f}")


def main() -> None:
    global OUT, JSONL
    p = argparse.ArgumentParser()
    p.add_argument("step", choices=["host", "gpu", "prefill", "table"])
    p.add_argument("--slice", type=Path, default=Path("/tmp/m3-slice"))
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--jsonl", default=JSONL)
    p.add_argument("--contexts", type=lambda v: [int(x) for x in v.split(",")],
                   default=[8192, 131072, 524288, 1040000])
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--chunk", type=int, default=2048, help="gpu: max_num_batched_tokens (the prefill chunk)")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--kv-cache-memory", type=int, default=12, help="gpu: GiB")
    p.add_argument("--quantization", default="fp8")
    p.add_argument("--repeat", type=int, default=2, help="gpu: requests per context (the last one is the table's)")
    args = p.parse_args()
    OUT, JSONL = args.out, args.jsonl
    OUT.mkdir(parents=True, exist_ok=True)
    {"host": step_host, "gpu": step_gpu, "prefill": step_prefill, "table": step_table}[args.step](args)
    if args.step != "table":
        step_table(args)


if __name__ == "__main__":
    main()
