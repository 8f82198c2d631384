"""Routing sort of the fused MoE: (token, expert) pairs grouped by expert, each run padded to the GEMM's BLOCK_M."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arch import Arch, current_arch, tiles


@triton.jit
def _moe_align_kernel(ids_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, cursor_ptr, num_pairs, max_padded,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, LOG2_E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    # One program: histogram, padded prefix sums, the expert of every block, then each pair scattered to its
    # expert's next free row (atomic cursor: order inside an expert's run is free, rows are independent).
    # cursor_ptr is scratch [2 * E_PAD]: next free row per expert, then each expert's end row.
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((E_PAD,), tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + lanes
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0)
        counts += tl.histogram(ids, E_PAD)
    # lanes past the end were counted as expert 0
    counts -= tl.where(experts == 0, tl.cdiv(num_pairs, CHUNK) * CHUNK - num_pairs, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(cursor_ptr + experts, ends - padded)
    tl.store(cursor_ptr + E_PAD + experts, ends)
    for r0 in range(0, max_padded, CHUNK):
        rows = r0 + lanes
        tl.store(pairs_ptr + rows, tl.zeros((CHUNK,), tl.int32) + num_pairs, mask=rows < max_padded)
    tl.debug_barrier()
    num_blocks = max_padded // BLOCK_M
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + lanes
        first = blocks * BLOCK_M
        # owner = number of experts whose run ends at or before the block's first row (binary search on ends)
        owner = tl.zeros((CHUNK,), tl.int32)
        for i in tl.static_range(LOG2_E_PAD):
            cand = owner + (E_PAD >> (i + 1))
            owner = tl.where(tl.load(cursor_ptr + E_PAD + cand - 1) <= first, cand, owner)
        tl.store(block_expert_ptr + blocks, tl.where(first < total, owner, 0), mask=blocks < num_blocks)
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + lanes
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=0)
        slot = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
        tl.store(pairs_ptr + slot, offs, mask=ok)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """Triton version of `moe_align_ref`, shaped for a fixed-size grid (CUDA graphs): the outputs have the
    worst-case length and `num_padded` (int32 [1], on the device) says how much is used."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    n = ids.numel()
    max_padded = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    dev = ids.device
    pairs = torch.empty((max_padded,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((max_padded // block_m,), dtype=torch.int32, device=dev)
    num_padded = torch.empty((1,), dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(num_experts)
    cursor = torch.empty((2 * e_pad,), dtype=torch.int32, device=dev)
    cfg = tiles("moe_align", current_arch(dev))
    _moe_align_kernel[(1,)](ids, pairs, block_expert, num_padded, cursor, n, max_padded, BLOCK_M=block_m,
                            E_PAD=e_pad, LOG2_E_PAD=e_pad.bit_length() - 1, CHUNK=cfg["CHUNK"],
                            num_warps=cfg["num_warps"])
    return pairs, block_expert, num_padded


def aot_variants(arch: Arch) -> list:
    """The routing sort as launched on `arch` (up to 256 experts, the prefill GEMM's BLOCK_M)."""
    from .aot import AotVariant

    cfg = tiles("moe_align", arch)
    return [AotVariant("moe_align", _moe_align_kernel,
                       {"ids_ptr": "*i32", "pairs_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
                        "cursor_ptr": "*i32", "num_pairs": "i32", "max_padded": "i32"},
                       {"BLOCK_M": 64, "E_PAD": 256, "LOG2_E_PAD": 8, "CHUNK": cfg["CHUNK"]},
                       num_warps=cfg["num_warps"], num_stages=1)]
