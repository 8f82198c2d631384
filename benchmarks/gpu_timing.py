"""Timing helpers shared by the GEMM and MoE kernel benchmarks (run on a GPU)."""

import torch
import triton


def bench(fn, rep: int = 100) -> float:
    """Median ms of `fn`, replayed from a CUDA graph when it can be captured (no launch gaps), else by events.
    `rep`: ms of replays per sample (do_bench_cudagraph takes 10 samples: a smaller rep fits more rows in a window)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception:
        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def read_bandwidth(device: str = "cuda") -> float:
    """The device's read bandwidth in GB/s, by a 4 GiB reduction: the floor of read-bound kernels."""
    x = torch.randn(2 << 30, dtype=torch.bfloat16, device=device)
    return x.numel() * 2 / bench(lambda: x.sum(dtype=torch.float32)) / 1e6  # bytes / ms -> GB/s
