"""Host memory peak and time of loading a ~2 GB MiniMax-M3-architecture checkpoint onto the CPU.

    .venv/bin/python benchmarks/load_memory.py [--gb 2] [--layout minimax|hf] [--dir /tmp/m3sdk_load_bench] [--keep]

Writes a random bf16 checkpoint of a scaled-down M3 shape (sharded, with an index file) into --dir, then loads
it with `m3sdk.model.load_model` in a fresh process and reports that process's peak resident set (VmHWM) above
its pre-load baseline, relative to the checkpoint's bytes. The checkpoint is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from m3sdk.model.config import ModelConfig
from m3sdk.model.loader import expected_tensors
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM


def bench_config(gb: float) -> dict:
    """A 2-dense + N-sparse/MoE layer text config whose bf16 weights come to about `gb` GB."""
    moe_layer_bytes = 2 * 32 * 3 * 1536 * 1024
    moe_layers = max(2, round((gb * 1e9 - 400e6) / moe_layer_bytes))
    layers = 2 + moe_layers
    flags = [0, 0] + [1] * moe_layers
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
        "text_config": {
            "vocab_size": 32000, "hidden_size": 1536, "num_hidden_layers": layers, "num_attention_heads": 12,
            "num_key_value_heads": 2, "head_dim": 128, "rotary_dim": 64, "rope_theta": 5e6,
            "intermediate_size": 1024, "shared_intermediate_size": 1024, "dense_intermediate_size": 4096,
            "num_local_experts": 32, "num_experts_per_tok": 4, "routed_scaling_factor": 2.0,
            "moe_layer_freq": flags, "torch_dtype": "bfloat16",
            "sparse_attention_config": {"use_sparse_attention": True, "sparse_attention_freq": flags,
                                        "sparse_num_index_heads": 2, "sparse_index_dim": 128,
                                        "sparse_block_size": 128, "sparse_topk_blocks": 16, "sparse_local_block": 1},
        },
    }


def write_checkpoint(directory: Path, gb: float, layout: str) -> int:
    """Random bf16 tensors under the names of `layout`, in shards of ~500 MB; returns the total tensor bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = bench_config(gb)
    (directory / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_dict(raw)
    prefix, lm_head = {"minimax": ("language_model.model.", "language_model.lm_head.weight"),
                       "hf": ("model.", "lm_head.weight")}[layout]
    expected = expected_tensors(config, layout, prefix, lm_head)
    with torch.device("meta"):
        params = dict(MiniMaxM3ForCausalLM(config).named_parameters())
    shard, shard_bytes, total, weight_map, files = {}, 0, 0, {}, []

    def flush():
        nonlocal shard, shard_bytes
        file = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, directory / file)
        weight_map.update(dict.fromkeys(shard, file))
        files.append(file)
        shard, shard_bytes = {}, 0

    g = torch.Generator().manual_seed(0)
    for name, target in expected.items():
        shape = params[target.param][target.index].shape
        t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        shard[name] = t
        shard_bytes += t.numel() * 2
        total += t.numel() * 2
        if shard_bytes > 500e6:
            flush()
    if shard:
        flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


def vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(path: str) -> None:
    """Runs in a fresh process: baseline RSS, load, peak RSS."""
    from m3sdk.model import load_model

    baseline = vm_hwm_bytes()
    start = time.perf_counter()
    model = load_model(path, device="cpu", dtype=torch.bfloat16)
    seconds = time.perf_counter() - start
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"baseline": baseline, "peak": vm_hwm_bytes(), "seconds": seconds, "param_bytes": param_bytes}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--layout", choices=["minimax", "hf"], default="minimax")
    ap.add_argument("--dir", default="/tmp/m3sdk_load_bench")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    directory = Path(args.dir)
    try:
        t0 = time.perf_counter()
        size = write_checkpoint(directory, args.gb, args.layout)
        print(f"wrote {size / 1e9:.2f} GB ({args.layout} layout) in {time.perf_counter() - t0:.0f}s to {directory}")
        # the written shards are in the page cache: a warm load, the common case after a download
        out = subprocess.run([sys.executable, __file__, "--child", str(directory)], check=True, capture_output=True,
                             text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        extra = r["peak"] - r["baseline"]
        print(f"checkpoint {size / 1e9:.3f} GB, model params {r['param_bytes'] / 1e9:.3f} GB")
        print(f"load time {r['seconds']:.2f}s ({size / 1e9 / r['seconds']:.2f} GB/s)")
        print(f"peak RSS {r['peak'] / 1e9:.3f} GB = baseline {r['baseline'] / 1e9:.3f} GB (python+torch) "
              f"+ {extra / 1e9:.3f} GB for loading = {extra / size:.3f}x the checkpoint")
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
