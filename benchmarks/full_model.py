"""The whole MiniMax-M3 at its real size on one host's GPUs, with dummy weights: load time, decode time per output
token against its roofline, the prefill of an 8K prompt, tokens/s per GPU.

    PYTHONPATH=src python benchmarks/full_model.py --tp 2 [--expert-parallel] [--quantization mxfp4]
        [--num-layers N] [--concurrency 1,4,16,64] [--contexts 2048,32768] [--prompt 8192] [--out DIR]

- Model: the bundled full config (src/m3sdk/assets/minimax-m3), or --model DIR's config.json; `--num-layers N`
  keeps the real widths and takes N layers in the model's proportion of dense to MoE layers (at least one
  dense: layer 0 of M3 is one), so a slice runs on one GPU as a check of the script and the kernels.
- Weights: load_format="dummy" (model/dummy.py), made on each GPU already sharded and in the served format of
  --quantization ("mxfp4": MXFP4 experts + FP8 attention / dense MLP; "fp8_experts": FP8 experts too; "fp8":
  FP8 linears, bf16 experts; "none").
  The load time is the whole: worker start, process group, every rank's generation and quantization.
- Read rate: `gpu_timing.read_rates` on each of the --tp GPUs, before the load, in this run.
- Decode (TPOT): the engine's captured decode step (CUDA graph, mirrored to the workers as the engine mirrors
  it; FP8 KV and index keys) for `concurrency` sequences at `context` tokens, timed as the median replay. The
  cache holds random K/V on rank 0 (zeros on the workers: the same bytes read). Where the pool cannot hold every
  sequence's pages, their page tables share pages (`aliased_pages` in the row: the bytes read are the same, from
  HBM: the pool is far larger than L2); whether that many sequences fit in serving is the memory plan's answer
  (`m3sdk info --plan-only`), printed first.
- Roofline: the bytes one decode step must read, each once (every active weight in its served format: attention,
  dense MLPs, router, shared expert, each distinct routed expert the step's tokens picked, lm_head; the KV it
  attends to: all of a dense layer's, the selected index_topk_blocks x index_block_size keys of a sparse layer;
  all index keys of every sparse layer), over the ranks' summed read rate. Replicated reads under tensor parallel
  (the router, the index keys on every rank) and the weight-0 routes of expert parallel count once: they are the
  sharding's cost, and show in the ratio.
- TTFT: the prefill of a --prompt-token prompt in the engine's chunks (max_num_batched_tokens), eager and
  mirrored as the engine runs prefills, to the first token's logits; no queueing.
- Reference (other hardware, other software; not comparable one to one): AMD publishes about 7.5 ms TPOT at
  concurrency 4 for the full model on 4 MI355X.

Prints a table, and JSON rows to OUT/full_model.jsonl.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from gpu_timing import read_rates
from serving import fill_cache, staged_replay

from m3sdk.attention.base import PAGE_SIZE, AttentionMetadata
from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.config import BUNDLED_MODELS, QUANTIZATIONS, EngineConfig
from m3sdk.graphs import DecodeGraphs
from m3sdk.model.config import ModelConfig
from m3sdk.model.layers import route
from m3sdk.model.memory import plan_memory
from m3sdk_kernels.arch import fp8_dtype

AMD_TPOT_MS = 7.5  # full MiniMax-M3, concurrency 4, 4 x MI355X (AMD's published figure)
OUT = Path(".")


def record(**row) -> dict:
    with open(OUT / "full_model.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def model_config(source: Path, num_layers: int | None, into: Path) -> Path:
    """A folder with `source`'s config.json, cut to `num_layers` layers (real widths) when given."""
    raw = json.loads((source / "config.json").read_text())
    text = raw.get("text_config", raw)
    total = text["num_hidden_layers"]
    if num_layers is not None and num_layers < total:
        kinds = text["mlp_layer_types"]
        dense = [i for i, k in enumerate(kinds) if k == "dense"]
        moe = [i for i, k in enumerate(kinds) if k != "dense"]
        n_dense = min(len(dense), max(1, round(num_layers * len(dense) / total)))
        keep = sorted(dense[:n_dense] + moe[:num_layers - n_dense])
        for key in ("layer_types", "mlp_layer_types"):
            text[key] = [text[key][i] for i in keep]
        text["num_hidden_layers"] = num_layers
    into.mkdir(parents=True, exist_ok=True)
    (into / "config.json").write_text(json.dumps(raw))
    return into


def load(path: Path, args) -> tuple:
    """(rank 0's model, the TensorParallel handle or None, seconds)."""
    dev = torch.device("cuda", 0)
    t = time.perf_counter()
    tp = None
    if args.tp > 1:
        from m3sdk.parallel import TensorParallel

        tp = TensorParallel.launch(path, args.tp, dev, torch.bfloat16, "triton", args.expert_parallel, "dummy",
                                   args.seed, args.quantization)
        model = tp.model
    else:
        from m3sdk.model.dummy import dummy_model

        model = dummy_model(ModelConfig.from_pretrained(path), dev, torch.bfloat16, "triton",
                            quantization=args.quantization, seed=args.seed)
    torch.cuda.synchronize()
    return model, tp, time.perf_counter() - t


def held_bytes(model) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


def distinct_experts(model, tp, ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> dict[int, int]:
    """MoE layer -> distinct routed experts the step's tokens picked, over all experts (the router is whole on
    every rank). One eager forward, mirrored to the workers; hooks on rank 0 only (benchmark instrumentation)."""
    seen: dict[int, int] = {}
    hooks = []
    for i in model.config.moe_layers:
        def hook(module, inputs, i=i):
            _, picked = route(inputs[0], module.router_weight, module.e_score_correction_bias, module.top_k)
            seen[i] = int(picked.unique().numel())
        hooks.append(model.layers[i].mlp.register_forward_pre_hook(hook))
    rows = torch.arange(ids.shape[0], device=ids.device)
    if tp is not None:
        tp.mirror(ids, meta, kv, rows, ())
    model(ids, meta, kv, rows)
    for h in hooks:
        h.remove()
    return seen


def step_bytes(config: ModelConfig, quantization: str, kv_dtype: str, batch: int, context: int,
               experts: dict[int, int]) -> dict[str, float]:
    """Bytes one decode step of the whole model must read, each once, by kind (weights in the served format, from
    the one-rank memory plan: the same storage formulas a load is checked against)."""
    parts = plan_memory(config, quantization=quantization).weight_bytes_by_part
    per_expert = parts["experts"] / (len(config.moe_layers) * config.num_experts) if config.moe_layers else 0
    weights = (parts["attention"] + parts["dense_mlp"] + parts["router"] + parts["shared"]
               + per_expert * sum(experts.values()))
    head = config.vocab_size * config.hidden_size * 2
    elt = 1 if kv_dtype == "fp8" else 2
    per_token = 2 * config.num_kv_heads * config.head_dim * elt + (2 * config.num_kv_heads * 4 if elt == 1 else 0)
    selected = min(config.index_topk_blocks * config.index_block_size, context)
    kv_bytes = index_bytes = 0
    for i in range(config.num_layers):
        if config.is_sparse(i):
            kv_bytes += batch * selected * per_token
            index_bytes += batch * context * config.index_head_dim * elt
        else:
            kv_bytes += batch * context * per_token
    return {"weights": weights, "lm_head": head, "kv": kv_bytes, "index_keys": index_bytes,
            "total": weights + head + kv_bytes + index_bytes}


def page_tables(batch: int, context: int, num_pages: int, generator: torch.Generator) -> tuple[list, bool]:
    """Random distinct pages per sequence where the pool holds them all, else drawn with reuse (aliased)."""
    need = -(-context // PAGE_SIZE)
    perm = torch.randperm(num_pages, generator=generator)
    aliased = batch * need > num_pages
    if aliased:
        perm = perm.repeat(-(-batch * need // num_pages))
    return perm[: batch * need].view(batch, need).tolist(), aliased


def prefill_ms(model, tp, kv: KVPool, prompt: int, chunk: int, pages: list[int], repeats: int = 3) -> float:
    """Median ms of a `prompt`-token prefill in chunks of `chunk` tokens, to the last token's logits."""
    dev = torch.device("cuda", 0)
    ids = torch.randint(0, model.config.vocab_size, (prompt,), device=dev)
    steps = []
    for start in range(0, prompt, chunk):
        n = min(chunk, prompt - start)
        meta = AttentionMetadata.build([n], [start + n], [pages], device=dev)
        steps.append((ids[start:start + n], meta, torch.tensor([n - 1], device=dev)))

    def run():
        for x, meta, last in steps:
            if tp is not None:
                tp.mirror(x, meta, kv, last, ())
            model(x, meta, kv, last)

    run()  # compiles the prefill shapes
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    global OUT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=BUNDLED_MODELS["minimax-m3"], help="a folder with config.json")
    p.add_argument("--tp", type=int, default=2, help="GPUs (tensor_parallel_size)")
    p.add_argument("--expert-parallel", action="store_true", help="whole experts per GPU")
    p.add_argument("--quantization", default="mxfp4", choices=QUANTIZATIONS)
    p.add_argument("--kv-cache-dtype", default="fp8", choices=("fp8", "bf16"), help="KV and index keys")
    p.add_argument("--num-layers", type=int, help="the first layers only (real widths): a one-GPU check")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--contexts", default="2048,32768")
    p.add_argument("--prompt", type=int, default=8192, help="TTFT prompt tokens")
    p.add_argument("--memory-fraction", type=float, default=0.85, help="of the free memory, for the KV pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args()
    OUT = args.out
    OUT.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.concurrency.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} GPUs; {torch.cuda.device_count()} visible")
    setup = dict(tp=args.tp, expert_parallel=args.expert_parallel, quantization=args.quantization,
                 kv_cache_dtype=args.kv_cache_dtype)

    path = model_config(args.model, args.num_layers, Path(tempfile.mkdtemp(prefix="m3_full_")))
    config = ModelConfig.from_pretrained(path)
    plan = plan_memory(config, tensor_parallel_size=args.tp, expert_parallel=args.expert_parallel,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                       device_memory=torch.cuda.get_device_properties(0).total_memory, context=max(contexts))
    record(step="plan", **setup, layers=config.num_layers, **dict(plan.rows()))

    rates = []
    for r in range(args.tp):  # before the load: each GPU's whole memory is free
        with torch.cuda.device(r):  # Triton launches on the current device
            rates.append(read_rates(f"cuda:{r}")["read"])
            torch.cuda.empty_cache()
    record(step="read_rate", tb_s=rates, device=torch.cuda.get_device_name(0), torch=torch.__version__)
    read_rate = sum(rates) * 1e12  # bytes/s, all ranks

    model, tp, load_s = load(path, args)
    try:
        record(step="load", **setup, layers=config.num_layers, seconds=load_s, rank0_bytes=held_bytes(model),
               planned_bytes=plan.weight_bytes_per_rank)
        dev = torch.device("cuda", 0)
        local = model.config  # rank 0's heads
        spec = KVCacheSpec.for_model(local, 1, kv_dtype=args.kv_cache_dtype, index_dtype=args.kv_cache_dtype,
                                     fp8_dtype=fp8_dtype(dev), model_dtype=torch.bfloat16, device=dev)
        want = max(max(batches) * (-(-max(contexts) // PAGE_SIZE) + 1), -(-args.prompt // PAGE_SIZE) + 1)
        free, _ = torch.cuda.mem_get_info(dev)
        reserve = 6 << 30  # graphs, activations of the prefill chunks, the workers' own context on their GPUs
        num_pages = min(want, int((free - reserve) * args.memory_fraction) // spec.bytes_per_page)
        kv = KVPool(KVCacheSpec.for_model(local, num_pages, kv_dtype=args.kv_cache_dtype,
                                          index_dtype=args.kv_cache_dtype, fp8_dtype=fp8_dtype(dev),
                                          model_dtype=torch.bfloat16, device=dev))
        fill_cache(kv)
        max_len = max(max(contexts), args.prompt) + PAGE_SIZE
        t = time.perf_counter()
        if tp is not None:
            from m3sdk.parallel import MirroredGraphs

            graphs = MirroredGraphs(tp, model, kv, max(batches), max_len, dev)
        else:
            graphs = DecodeGraphs(model, kv, max(batches), max_len, dev)
        torch.cuda.synchronize()
        record(step="capture", **setup, seconds=time.perf_counter() - t, kv_pages=num_pages,
               kv_gb=num_pages * spec.bytes_per_page / 1e9)

        import triton

        gen = torch.Generator().manual_seed(args.seed)
        rows = []
        for context in contexts:
            for batch in batches:
                tables, aliased = page_tables(batch, context, num_pages, gen)
                ids = torch.randint(0, config.vocab_size, (batch,), generator=gen).to(dev)
                meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, device=dev)
                experts = distinct_experts(model, tp, ids, meta, kv)
                replay = staged_replay(graphs, ids.tolist(), context, tables)
                if replay is None:
                    record(step="decode", **setup, batch=batch, context=context, skipped="fits no graph")
                    continue
                tpot = triton.testing.do_bench(replay, warmup=5, rep=100, return_mode="median")
                need = step_bytes(config, args.quantization, args.kv_cache_dtype, batch, context, experts)
                floor = need["total"] / read_rate * 1e3
                rows.append(record(step="decode", **setup, layers=config.num_layers, batch=batch, context=context,
                                   tpot_ms=tpot, roofline_ms=floor, over_roofline=tpot / floor,
                                   tok_s=batch / tpot * 1e3, tok_s_per_gpu=batch / tpot * 1e3 / args.tp,
                                   aliased_pages=aliased, bytes=need,
                                   distinct_experts=sum(experts.values()) / max(1, len(experts))))
        pages = list(range(-(-args.prompt // PAGE_SIZE)))
        ttft = prefill_ms(model, tp, kv, args.prompt, EngineConfig().max_num_batched_tokens, pages)
        record(step="ttft", **setup, layers=config.num_layers, prompt=args.prompt,
               chunk=EngineConfig().max_num_batched_tokens, ms=ttft)
    finally:
        if tp is not None:
            tp.shutdown()

    print(f"\nMiniMax-M3 {config.num_layers} layers, dummy weights, {args.quantization}, TP={args.tp}"
          f"{' EP' if args.expert_parallel else ''}, KV {args.kv_cache_dtype}; load {load_s:.1f} s; "
          f"read {sum(rates):.2f} TB/s over {args.tp} GPU(s); TTFT {args.prompt} tokens {ttft:.1f} ms")
    print(f"{'context':>8} {'conc':>5} {'TPOT ms':>9} {'roofline':>9} {'ratio':>6} {'tok/s':>9} {'tok/s/GPU':>10}")
    for r in rows:
        print(f"{r['context']:>8} {r['batch']:>5} {r['tpot_ms']:>9.3f} {r['roofline_ms']:>9.3f} "
              f"{r['over_roofline']:>6.2f} {r['tok_s']:>9.0f} {r['tok_s_per_gpu']:>10.0f}"
              f"{'  (pages aliased)' if r['aliased_pages'] else ''}")
    print(f"reference: AMD publishes ~{AMD_TPOT_MS} ms TPOT at concurrency 4 for the full model on 4 MI355X "
          "(other hardware)")


if __name__ == "__main__":
    main()
