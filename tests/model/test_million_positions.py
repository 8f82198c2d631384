"""The index arithmetic of a 1M-token context on a small model (the GPU when there is one, else the CPU): a decode
step at position 1,048,575 (the context MiniMax-M3 allows, 2**20 tokens), its 65,536 pages shuffled over the top of
a larger pool (page ids past 65,536, slots past 2**20), run the way the engine runs it (the decode graphs' staging
and device page table, the Triton kernels, interpreted on a CPU: cache writes, the indexer's scan and top-k over
8,192 blocks of 128, dense split-KV and MSA attention), against the plain-torch references on the same cache. RoPE
at those positions against float64."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from m3sdk.attention.base import PAGE_SIZE, AttentionMetadata
from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.graphs import DecodeGraphs
from m3sdk.model.layers import RotaryEmbedding
from m3sdk.model.loader import load_model

CONTEXT = 1 << 20
# narrow widths, M3's selection geometry (16 blocks of 128 keys, one local block)
TINY = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16, rotary_dim=8,
            intermediate_size=32, shared_intermediate_size=32, dense_intermediate_size=64, num_local_experts=4,
            num_experts_per_tok=2, index_n_heads=1, index_head_dim=16, index_block_size=128, index_topk_blocks=16,
            index_local_blocks=1, vocab_size=1024, bos_token_id=1000, eos_token_id=1001)


def test_rope_at_a_million_positions_uses_exact_positions():
    """cos/sin at positions up to 2**20 - 1: each angle within an fp32 rounding of position x frequency (positions
    never pass through a narrower type), as transformers computes them."""
    rope = RotaryEmbedding(64, 5e6)
    positions = torch.tensor([0, 1, 4095, 65535, 524287, CONTEXT - 17, CONTEXT - 2, CONTEXT - 1])
    cos, sin = rope(positions)
    inv_freq = rope._inv_freq.double().numpy()  # the frequencies as the model holds them (fp32)
    angle = positions.numpy().astype(np.float64)[:, None] * inv_freq[None, :]
    slack = np.spacing(angle.astype(np.float32)).astype(np.float64) + 1e-6  # the angle's fp32 rounding, cos' own
    assert np.all(np.abs(cos.double().numpy() - np.cos(angle)) <= slack)
    assert np.all(np.abs(sin.double().numpy() - np.sin(angle)) <= slack)
    assert np.abs(np.cos(angle[-1]) - np.cos(angle[-2])).max() > 1e-2  # neighbouring positions stay apart


def _fill(kv: KVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in (*kv.k, *kv.v, *(i for i in kv.index_k if i is not None)):
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))


@pytest.mark.slow
def test_decode_step_at_the_last_position_of_a_million_token_context(tmp_path, device, ieee_fp32):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from make_m3_slice import make_slice

    path = make_slice(tmp_path / "slice", dense=1, sparse=1, max_position_embeddings=CONTEXT, overrides=TINY)
    kernels = load_model(path, device, torch.float32, "triton")
    reference = load_model(path, device, torch.float32, "torch")
    pages_needed = CONTEXT // PAGE_SIZE
    spare = 3000  # pool pages below the sequence's: its page ids run past 2**16, its slots past 2**20
    spec = KVCacheSpec.for_model(kernels.config, spare + pages_needed, kv_dtype="fp32", index_dtype="fp32",
                                 model_dtype=torch.float32, device=device)
    kv = KVPool(spec)
    _fill(kv, 0)  # a filled cache: every earlier position holds keys, values and index keys
    pages = (spare + torch.randperm(pages_needed, generator=torch.Generator().manual_seed(1))).tolist()
    pages[-1] = spare + pages_needed - 1  # the last position's slot is the pool's very last
    token = [7]

    meta = AttentionMetadata.build([1], [CONTEXT], [pages], device)
    assert meta.positions.tolist() == [CONTEXT - 1]
    assert meta.slot_mapping.tolist() == [(spare + pages_needed) * PAGE_SIZE - 1]
    _, want, *_ = reference(torch.tensor(token, device=device), meta, kv, torch.tensor([0], device=device))
    written = [t[-1, :, -1].clone() for t in (*kv.k, *kv.v)]  # the new token's K, V (plain layout)

    graphs = DecodeGraphs(kernels, kv, max_num_seqs=2, max_model_len=CONTEXT, device=device)
    key = graphs.key(1, 1, CONTEXT, len(pages))
    assert key == (1, CONTEXT, 1)
    for t in (*kv.k, *kv.v):  # the kernels write the token's K, V again
        t[-1, :, -1].zero_()
    graphs.stage(key, token, [1], [CONTEXT], [pages])
    _, got, *_ = graphs.replay(key)
    assert torch.equal(graphs.page_table[0], torch.tensor(pages, dtype=torch.int32, device=device))
    assert graphs.positions[0].item() == CONTEXT - 1
    for before, t in zip(written, (*kv.k, *kv.v), strict=True):
        torch.testing.assert_close(t[-1, :, -1], before, rtol=1e-5, atol=1e-5)
    # the sparse layer attends to the blocks its indexer picked among 8,192: a different pick (a block id, page or
    # slot computed wrong anywhere on the way) changes the logits of these random keys and values
    torch.testing.assert_close(got[:1], want, rtol=2e-4, atol=2e-4)

