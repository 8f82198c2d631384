"""CUDA graphs of decode steps (GPU only): a replay gives the eager forward's logits, and padding rows write
nowhere (the cache changes only at the real tokens' slots)."""

import sys
from pathlib import Path

import pytest
import torch

from m3sdk.attention.base import PAGE_SIZE, AttentionMetadata
from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.graphs import DecodeGraphs, batch_buckets
from m3sdk.model.loader import load_model

SMALL = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=64, rotary_dim=32,
             intermediate_size=256, shared_intermediate_size=256, dense_intermediate_size=512, num_local_experts=8,
             num_experts_per_tok=2, index_head_dim=64, index_block_size=32, index_topk_blocks=3, vocab_size=1024,
             bos_token_id=1000, eos_token_id=1001)


def test_batch_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replay_matches_eager_and_padding_writes_nowhere(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_m3_slice import make_slice

    dev = torch.device("cuda")
    path = make_slice(tmp_path / "slice", dense=1, sparse=1, device="cuda", max_position_embeddings=4096,
                      overrides=SMALL)
    model = load_model(path, dev, torch.bfloat16, "triton")
    kv = KVPool(KVCacheSpec.for_model(model.config, 64, kv_dtype="fp8", index_dtype="fp8",
                                      fp8_dtype=torch.float8_e4m3fn, model_dtype=torch.bfloat16, device=dev))
    lengths = [40, 300, 17]
    pages = torch.randperm(64).tolist()
    tables = []
    for n in lengths:
        tables.append([pages.pop() for _ in range(-(-(n + 1) // PAGE_SIZE))])
    prompt = AttentionMetadata.build(lengths, lengths, tables, device=dev)
    model(torch.randint(0, 1000, (sum(lengths),), device=dev), prompt, kv)
    before = [t.clone() for t in (*kv.k, *kv.v, *kv.k_scale, *kv.v_scale, kv.index_k[1])]

    graphs = DecodeGraphs(model, kv, max_num_seqs=8, max_model_len=1024, device=dev)  # captures padding-only steps
    after_capture = [t.clone() for t in (*kv.k, *kv.v, *kv.k_scale, *kv.v_scale, kv.index_k[1])]
    assert all(torch.equal(a, b) for a, b in zip(before, after_capture, strict=True))

    step = AttentionMetadata.build([1, 1, 1], [n + 1 for n in lengths], tables, device=dev)
    ids = torch.tensor([5, 6, 7], device=dev)
    assert graphs.fits(step, 3)
    _, eager = model(ids, step, kv, torch.arange(3, device=dev))
    eager = eager.clone()
    written = [t.clone() for t in (*kv.k, *kv.v, *kv.k_scale, *kv.v_scale, kv.index_k[1])]
    _, replay = graphs.run(ids, step)
    err = ((replay - eager).norm() / eager.norm()).item()
    assert err < 2e-2 and torch.equal(replay.argmax(-1), eager.argmax(-1))
    # the replay wrote the same K/V as the eager step at the same slots, and nothing else anywhere
    after = [t.clone() for t in (*kv.k, *kv.v, *kv.k_scale, *kv.v_scale, kv.index_k[1])]
    # The replay wrote what the eager step wrote, up to rounding: its batch-4 GEMMs round bf16 differently from
    # the eager batch-3 ones, and a one-ulp change can move an fp8 code. Everywhere else both equal `before`.
    for old, eager_t, replay_t in zip(before, written, after, strict=True):
        touched = (eager_t != old) | (replay_t != old)
        a, b = replay_t[touched].float(), eager_t[touched].float()
        assert (a - b).norm() <= 0.05 * b.norm()
    changed = sum(int((a != b).any(dim=tuple(range(1, a.dim()))).sum()) for a, b in zip(before, after, strict=True))
    assert 0 < changed <= 3 * len(before)  # at most the 3 new tokens' pages, in each tensor
