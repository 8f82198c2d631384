"""The "triton" attention backend equals the "torch" one through Contract 2: a prefill chunk then a decode step
of a ragged batch over a KVPool, dense and MSA layers, bf16 and FP8 caches, both layouts."""

import pytest
import torch

from m3sdk.attention.base import AttentionMetadata, get_backend
from m3sdk.cache.kv_pool import KVCacheSpec, KVPool

HQ, HKV, D, DI, BLOCK, TOPK = 32, 2, 32, 32, 16, 2


@pytest.mark.parametrize(("kv_dtype", "layout"), [("bf16", "plain"), ("fp8", "shuffle")])
def test_triton_backend_equals_torch_backend(kv_dtype, layout, device):
    spec = KVCacheSpec(num_pages=16, num_layers=2, num_kv_heads=HKV, head_dim=D, sparse_layers=(1,),
                       index_head_dim=DI, kv_dtype=kv_dtype, layout=layout, index_dtype=kv_dtype, device=device)
    pools = {name: KVPool(spec) for name in ("torch", "triton")}
    backends = {name: get_backend(name) for name in pools}
    pages = [[3, 7, 1, 12], [0, 9, 4], [15, 2]]
    g = torch.Generator().manual_seed(0)
    # step 1: prompts (the second one's first 12 tokens); step 2: one token each (+ a 3-token draft). Contexts
    # past TOPK * BLOCK = 32 tokens: the selection drops blocks.
    for new, ctx in (([36, 12, 18], [36, 12, 18]), ([1, 3, 1], [37, 15, 19])):
        meta = AttentionMetadata.build(new, ctx, pages, device)
        t = sum(new)
        k, v = (torch.randn(t, HKV, D, generator=g).to(device, torch.bfloat16) for _ in range(2))
        ik = torch.nn.functional.normalize(torch.randn(t, DI, generator=g), dim=-1).to(device, torch.bfloat16) * DI**0.5
        q = torch.randn(t, HQ, D, generator=g).to(device, torch.bfloat16)
        iq = torch.randn(t, HKV, DI, generator=g).to(device, torch.bfloat16)
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


def test_unserved_shapes_take_the_references_from_build(monkeypatch, device):
    """Shapes the kernels refuse (`attention_unsupported`, here by lowering its width limit) are decided when the
    backend is bound at build: those ops then give the torch backend's bits exactly; served ones stay kernels."""
    from m3sdk.attention.base import AttentionShapes
    from m3sdk_kernels import shapes

    assert shapes.attention_unsupported(D, 16, DI, BLOCK) == {}
    assert set(shapes.attention_unsupported(512, 16)) == {"norm_rope_write", "write_kv", "attend"}
    assert "head_dim 512" in shapes.attention_unsupported(512, 16)["attend"]
    assert set(shapes.attention_unsupported(D, 15)) == {"norm_rope_write"}  # odd rotary width
    assert set(shapes.attention_unsupported(D, 16, 300, BLOCK)) == {"norm_rope_write", "select_blocks"}
    monkeypatch.setattr(shapes, "MAX_DIM", 16)
    spec = KVCacheSpec(num_pages=8, num_layers=1, num_kv_heads=HKV, head_dim=D, sparse_layers=(),
                       index_head_dim=DI, kv_dtype="bf16", layout="plain", index_dtype="bf16", device=device)
    pools = {name: KVPool(spec) for name in ("torch", "triton")}
    backends = {name: get_backend(name) for name in pools}
    for backend in backends.values():
        backend.bind(AttentionShapes(D, 16, None, None))
    meta = AttentionMetadata.build([20], [20], [[5, 2]], device)
    k, v, q = (torch.randn(20, h, D).to(device, torch.bfloat16) for h in (HKV, HKV, HQ))
    outs = {}
    for name, backend in backends.items():
        backend.write_kv(0, k, v, None, meta, pools[name])
        outs[name] = backend.attend(0, q, meta, pools[name], None, D**-0.5, BLOCK)
    assert torch.equal(pools["torch"].k[0], pools["triton"].k[0])
    assert torch.equal(outs["torch"], outs["triton"])  # the reference itself, not a kernel within tolerance
