"""The "triton" attention backend equals the "torch" one through Contract 2: a prefill chunk then a decode step
of a ragged batch over a KVPool, dense and MSA layers, bf16 and FP8 caches, both layouts."""

import pytest
import torch

from m3sdk.attention.base import AttentionMetadata, get_backend
from m3sdk.cache.kv_pool import KVCacheSpec, KVPool

HQ, HKV, D, DI, BLOCK, TOPK = 32, 2, 32, 32, 16, 2


@pytest.mark.parametrize(("kv_dtype", "layout"), [("bf16", "plain"), ("fp8", "shuffle")])
def test_triton_backend_equals_torch_backend(kv_dtype, layout):
    spec = KVCacheSpec(num_pages=16, num_layers=2, num_kv_heads=HKV, head_dim=D, sparse_layers=(1,),
                       index_head_dim=DI, kv_dtype=kv_dtype, layout=layout, index_dtype=kv_dtype)
    pools = {name: KVPool(spec) for name in ("torch", "triton")}
    backends = {name: get_backend(name) for name in pools}
    pages = [[3, 7, 1, 12], [0, 9, 4], [15, 2]]
    g = torch.Generator().manual_seed(0)
    # step 1: prompts (the second one's first 12 tokens); step 2: one token each (+ a 3-token draft). Contexts
    # past TOPK * BLOCK = 32 tokens: the selection drops blocks.
    for new, ctx in (([36, 12, 18], [36, 12, 18]), ([1, 3, 1], [37, 15, 19])):
        meta = AttentionMetadata.build(new, ctx, pages)
        t = sum(new)
        k, v = (torch.randn(t, HKV, D, generator=g).to(torch.bfloat16) for _ in range(2))
        ik = torch.nn.functional.normalize(torch.randn(t, DI, generator=g), dim=-1).to(torch.bfloat16) * DI**0.5
        q = torch.randn(t, HQ, D, generator=g).to(torch.bfloat16)
        iq = torch.randn(t, HKV, DI, generator=g).to(torch.bfloat16)
        outs = {}
        for name, backend in backends.items():
            kv = pools[name]
            for layer in (0, 1):
                backend.write_kv(layer, k, v, ik if layer == 1 else None, meta, kv)
            sel = backend.select_blocks(1, iq, meta, kv, BLOCK, TOPK, 1)
            outs[name] = (backend.attend(0, q, meta, kv, None, D**-0.5, BLOCK),
                          backend.attend(1, q, meta, kv, sel, D**-0.5, BLOCK), sel)
        for a, b in zip(pools["torch"].k + pools["torch"].v + pools["torch"].index_k[1:],
                        pools["triton"].k + pools["triton"].v + pools["triton"].index_k[1:], strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        (dense_t, sparse_t, sel_t), (dense_k, sparse_k, sel_k) = outs["torch"], outs["triton"]
        assert torch.equal(sel_t.sort(-1).values, sel_k.sort(-1).values)
        torch.testing.assert_close(dense_k.float(), dense_t.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(sparse_k.float(), sparse_t.float(), atol=2e-2, rtol=2e-2)
