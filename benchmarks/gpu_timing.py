"""Timing helpers and the read floor shared by the kernel and serving benchmarks (run on a GPU)."""

import torch
import triton
import triton.language as tl


def bench(fn, rep: int = 100) -> float:
    """Median ms of `fn`, replayed from a CUDA graph when it can be captured (no launch gaps), else by events.
    `rep`: ms of replays per sample (do_bench_cudagraph takes 10 samples: a smaller rep fits more rows in a window)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception:
        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


@triton.jit
def _read_sum_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Program i sums ITERS consecutive BLOCK-element tiles of x: a plain streaming read."""
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        acc += tl.load(x_ptr + base + i * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def read_rates(device: str = "cuda") -> dict[str, float]:
    """TB/s of two reductions of a 4 GiB bf16 tensor: torch's sum, and a plain Triton streaming sum (8 warps,
    8192-element tiles, 8 per program). On the H200 torch's reads 4.22-4.28 TB/s and the Triton one 4.55-4.61;
    read-bound floors use the faster ("read")."""
    x = torch.randn(2 << 30, dtype=torch.bfloat16, device=device)
    block, iters = 8192, 8
    partial = torch.empty(x.numel() // (block * iters), dtype=torch.float32, device=device)

    def triton_sum():
        _read_sum_kernel[(partial.numel(),)](x, partial, BLOCK=block, ITERS=iters, num_warps=8, num_stages=1)

    triton_sum()
    want = x.sum(dtype=torch.float32)
    if not torch.allclose(partial.sum(), want, rtol=1e-3, atol=1.0):  # a floor from a wrong kernel is no floor
        raise RuntimeError(f"streaming sum {partial.sum().item()} != torch's {want.item()}")
    nbytes = x.numel() * x.element_size()
    rates = {"torch_sum": nbytes / bench(lambda: x.sum(dtype=torch.float32)) / 1e9,
             "triton_sum": nbytes / bench(triton_sum) / 1e9}
    return rates | {"read": max(rates.values())}


def read_bandwidth(device: str = "cuda") -> float:
    """The device's read bandwidth in GB/s (`read_rates`' "read"): the floor of read-bound kernels."""
    return read_rates(device)["read"] * 1e3
