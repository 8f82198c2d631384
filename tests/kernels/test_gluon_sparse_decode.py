"""The Gluon MSA FP8 decode kernel (sm90): ahead-of-time compile on any machine, and exactness against
`paged_attention_ref` on a GPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

gsd = pytest.importorskip("m3sdk_kernels.gluon_sparse_decode",
                          reason="the installed triton has no Gluon API with mma_v2 / cp.async")

from m3sdk_kernels.arch import ARCHS  # noqa: E402
from m3sdk_kernels.layout import PAGE_SIZE  # noqa: E402
from m3sdk_kernels.paged_attention import attention_plan, paged_attention  # noqa: E402
from m3sdk_kernels.reference import paged_attention_ref  # noqa: E402

HQ, HKV, D, BS, TOPK = 64, 4, 128, 128, 16


COMPILE = """
import json
from m3sdk_kernels.gluon_sparse_decode import compile_sm90
kernel = compile_sm90(num_tokens=64)
ptx = kernel.asm["ptx"]
print(json.dumps({"mma": ptx.count("mma.sync.aligned.m16n8k16"), "cp_async": ptx.count("cp.async.cg.shared.global")
                  + ptx.count("cp.async.ca.shared.global"), "shared": kernel.metadata.shared}))
"""


def test_compiles_for_sm90_without_a_gpu():
    """M3's shapes at batch 64: every tile's two dots became mma.sync, the K/V copies cp.async (compiled for real
    in a process of its own: the test session interprets Triton)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = gsd.plan(64, HKV, TOPK, BS)
    tiles = TOPK // cfg["NUM_SPLITS"] * BS // cfg["BLOCK_N"]
    # m16n8k16 steps of QK^T and of PV, the warps side by side along N
    assert got["mma"] == tiles * 2 * cfg["BLOCK_N"] * D // (8 * 16) // cfg["num_warps"]
    assert got["cp_async"] > 0
    assert got["shared"] >= cfg["NUM_BUF"] * 2 * cfg["BLOCK_N"] * D  # the ring of FP8 K and V tiles


def make_case(lens: list[int], seed: int = 0):
    """FP8 plain pages of `lens` contexts, shuffled across the pool; per-token scales; selections of distinct
    blocks (the last, partial one always), -1 padded where a context has fewer than TOPK blocks, in random order."""
    g = torch.Generator().manual_seed(seed)
    dev, fp8 = "cuda", torch.float8_e4m3fn
    pages = [-(-n // PAGE_SIZE) for n in lens]
    num_pages = sum(pages) + 3
    k = (torch.randn(num_pages, HKV, PAGE_SIZE, D, generator=g) * 2).to(fp8).to(dev)
    v = (torch.randn(num_pages, HKV, PAGE_SIZE, D, generator=g) * 2).to(fp8).to(dev)
    ks = (torch.rand(num_pages, HKV, PAGE_SIZE, generator=g) * 0.1 + 0.01).to(dev)
    vs = (torch.rand(num_pages, HKV, PAGE_SIZE, generator=g) * 0.1 + 0.01).to(dev)
    perm = torch.randperm(num_pages, generator=g).int()
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    sel = torch.full((HKV, len(lens), TOPK), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(lens):
        table[i, : pages[i]] = perm[at: at + pages[i]]
        at += pages[i]
        blocks = -(-n // BS)
        for h in range(HKV):
            pick = torch.randperm(blocks - 1, generator=g)[: min(TOPK - 1, blocks - 1)].tolist() + [blocks - 1]
            if h == 1 and len(pick) > 2:
                pick = pick[:-2] + [blocks - 1]  # fewer than the context has: -1 entries amid a long context
            order = torch.randperm(TOPK, generator=g)[: len(pick)]
            sel[h, i, order] = torch.tensor(pick, dtype=torch.int32)
    q = torch.randn(len(lens), HQ, D, generator=g).to(dev, torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=dev)
    return q, k, v, ks, vs, table.to(dev), cu, lens_t, sel.to(dev)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[5000], [32768 - 37] + [300 + 131 * i for i in range(63)]], ids=["b1", "b64"])
@pytest.mark.parametrize("tiles", [{}, {"num_warps": 2, "block_n": 32, "split_programs": 512}],
                         ids=["default", "2warps"])
def test_matches_reference(lens, tiles):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is built for sm90")
    q, k, v, ks, vs, table, cu, lens_t, sel = make_case(lens)
    scale = D**-0.5
    out = torch.full_like(q, float("nan"))
    got = gsd.sparse_decode(q, k, v, table, lens_t, scale, ks, vs, sel, BS, out=out, **tiles)
    ref = paged_attention_ref(q, k, v, table, cu, lens_t, scale, ks, vs, "plain", sel, BS)
    tri = paged_attention(q, k, v, table, cu, lens_t, scale, ks, vs, "plain", sel, BS, max_seqlen_q=1,
                          max_context_len=max(lens), gluon=False)
    assert got is out and not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # no further from the reference than the Triton kernel is (both round p to fp16 the same way)
    err = (got.float() - ref.float()).norm() / ref.float().norm()
    err_tri = (tri.float() - ref.float()).norm() / ref.float().norm()
    assert err <= 1.5 * err_tri + 1e-3, (float(err), float(err_tri))


@pytest.mark.parametrize("arch, seqs, gluon", [("sm90", 1, 1), ("sm90", 16, 1), ("sm90", 17, 0), ("gfx950", 1, 0)])
def test_the_table_sends_few_sequences_to_gluon_on_sm90_only(arch, seqs, gluon):
    plan = attention_plan(seqs, seqs, HKV, HQ // HKV, 1, 32768, True, TOPK, BS, fp8=True, arch=ARCHS[arch])
    assert plan["GLUON"] == gluon
    # never a prefill, a mixed step or BF16 pages
    assert not attention_plan(seqs + 3, seqs, HKV, HQ // HKV, 4, 32768, True, TOPK, BS, True, ARCHS[arch])["GLUON"]
    assert not attention_plan(seqs, seqs, HKV, HQ // HKV, 1, 32768, True, TOPK, BS, False, ARCHS[arch])["GLUON"]


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[5000, 77], [300 + 131 * i for i in range(17)]], ids=["b2", "b17"])
def test_paged_attention_runs_gluon_for_few_sequences(lens):
    """paged_attention gives the Gluon kernel's output bit for bit up to the table's GLUON_MAX_SEQS, the Triton
    kernel's above it; both against the reference."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is built for sm90")
    q, k, v, ks, vs, table, cu, lens_t, sel = make_case(lens, seed=3)
    scale = D**-0.5
    args = (q, k, v, table, cu, lens_t, scale, ks, vs, "plain", sel, BS)
    got = paged_attention(*args, max_seqlen_q=1, max_context_len=max(lens))
    glu = gsd.sparse_decode(q, k, v, table, lens_t, scale, ks, vs, sel, BS)
    tri = paged_attention(*args, max_seqlen_q=1, max_context_len=max(lens), gluon=False)
    torch.testing.assert_close(got, glu if len(lens) <= 16 else tri, atol=0, rtol=0)
    torch.testing.assert_close(got.float(), paged_attention_ref(*args).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gluon_decode_replays_in_a_cuda_graph():
    """The engine captures decode steps as CUDA graphs: paged_attention's Gluon path (its split partials and merge
    included) replays to the eager output bit for bit."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is built for sm90")
    lens = [5000, 77, 300]
    q, k, v, ks, vs, table, cu, lens_t, sel = make_case(lens, seed=5)
    out = torch.empty_like(q)

    def step():
        return paged_attention(q, k, v, table, cu, lens_t, D**-0.5, ks, vs, "plain", sel, BS, max_seqlen_q=1,
                               max_context_len=max(lens), out=out)

    eager = step().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
