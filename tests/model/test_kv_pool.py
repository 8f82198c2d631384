"""KVPool allocates exactly Contract 1's tensors, and bytes_per_page is what they cost."""

import pytest
import torch

from m3sdk.cache.kv_pool import KVCacheSpec, KVPool


@pytest.mark.parametrize("kv_dtype,layout,x", [("bf16", "plain", 0), ("bf16", "shuffle", 8), ("fp8", "shuffle", 16),
                                               ("fp8", "plain", 0), ("fp32", "shuffle", 4)])
def test_shapes_and_bytes(kv_dtype, layout, x):
    spec = KVCacheSpec(num_pages=5, num_layers=3, num_kv_heads=2, head_dim=32, sparse_layers=(1, 2),
                       index_head_dim=16, kv_dtype=kv_dtype, layout=layout, index_dtype="fp8")
    kv = KVPool(spec)
    k_shape = (5, 2, 16, 32) if layout == "plain" else (5, 2, 32 // x, 16, x)
    v_shape = (5, 2, 16, 32) if layout == "plain" else (5, 2, 16 // x, 32, x)
    assert all(t.shape == k_shape for t in kv.k) and all(t.shape == v_shape for t in kv.v)
    assert kv.k[0].dtype == {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}[kv_dtype]
    if kv_dtype == "fp8":
        assert all(s.shape == (5, 2, 16) and s.dtype == torch.float32 for s in kv.k_scale + kv.v_scale)
    else:
        assert kv.k_scale == kv.v_scale == [None] * 3
    assert kv.index_k[0] is None and all(t.shape == (5, 16, 16) and t.dtype == torch.float8_e4m3fn
                                         for t in kv.index_k[1:])
    tensors = [t for t in kv.k + kv.v + kv.k_scale + kv.v_scale + kv.index_k if t is not None]
    assert spec.bytes_per_page * 5 == sum(t.numel() * t.element_size() for t in tensors)


def test_bad_spec():
    with pytest.raises(ValueError, match="kv_dtype"):
        KVCacheSpec(4, 1, 1, 16, (), 16, kv_dtype="int8")
    with pytest.raises(ValueError, match="divisible by 16"):
        KVCacheSpec(4, 1, 1, 24, (), 16, kv_dtype="fp8", layout="shuffle")
