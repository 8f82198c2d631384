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


def since(before: dict, after: dict) -> dict:
    """`after` with the step counters counted from `before`."""
    return {**after, **{k: after[k] - before[k] for k in ("steps", "graph_steps")}}


def replay_step(graphs: DecodeGraphs, ids: list[int], counts: list[int], context_lens: list[int],
                tables: list[list[int]], aux_layers: tuple[int, ...] = ()) -> tuple:
    """(hidden, logits, aux) of every real token of a step run as the engine runs it (`stage` from host lists, then
    `replay`), in the step's token order; sequence i's token j sits at row i * q + j of the graph's outputs."""
    key = graphs.key(len(counts), max(counts), max(context_lens), max(map(len, tables)), aux_layers)
    assert key is not None
    graphs.stage(key, ids, counts, context_lens, tables)
    hidden, logits, *aux = graphs.replay(key)
    q = key[2]
    rows = torch.tensor([i * q + j for i, c in enumerate(counts) for j in range(c)], device=logits.device)
    return hidden[rows], logits[rows], aux[0][rows] if aux else None


def test_batch_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


def _small_slice(tmp_path: Path, dtype: torch.dtype):
    """A narrow 1 dense + 1 sparse slice (scripts/make_m3_slice.py) loaded on the GPU with the triton backend."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_m3_slice import make_slice

    path = make_slice(tmp_path / "slice", dense=1, sparse=1, device="cuda", max_position_embeddings=4096,
                      overrides=SMALL)
    return load_model(path, torch.device("cuda"), dtype, "triton")


@pytest.mark.gpu
def test_replay_matches_eager_and_padding_writes_nowhere(tmp_path):
    dev = torch.device("cuda")
    model = _small_slice(tmp_path, torch.bfloat16)
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

    context_lens = [n + 1 for n in lengths]
    step = AttentionMetadata.build([1, 1, 1], context_lens, tables, device=dev)
    ids = [5, 6, 7]
    _, eager = model(torch.tensor(ids, device=dev), step, kv, torch.arange(3, device=dev))
    eager = eager.clone()
    written = [t.clone() for t in (*kv.k, *kv.v, *kv.k_scale, *kv.v_scale, kv.index_k[1])]
    replay = replay_step(graphs, ids, [1, 1, 1], context_lens, tables)[1]
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


@pytest.mark.gpu
def test_verify_replay_matches_eager_with_aux(tmp_path, monkeypatch):
    """A verify step (1 + k tokens per sequence, logits at every token, aux states) replayed from its graph gives
    the eager forward's logits and aux states."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")  # fp32 tl.dot is TF32 by default: bf16-like rounding
    dev = torch.device("cuda")
    model = _small_slice(tmp_path, torch.float32)
    kv = KVPool(KVCacheSpec.for_model(model.config, 64, kv_dtype="fp32", index_dtype="fp32",
                                      model_dtype=torch.float32, device=dev))
    lengths, q, aux_layers = [40, 300, 17], 4, (0, 1)
    pages = torch.randperm(64).tolist()
    tables = [[pages.pop() for _ in range(-(-(n + q) // PAGE_SIZE))] for n in lengths]
    model(torch.randint(0, 1000, (sum(lengths),), device=dev), AttentionMetadata.build(lengths, lengths, tables,
                                                                                      device=dev), kv)
    graphs = DecodeGraphs(model, kv, max_num_seqs=8, max_model_len=1024, device=dev, query_lens=(1, q),
                          aux_layers=aux_layers)
    context_lens = [n + q for n in lengths]
    step = AttentionMetadata.build([q] * 3, context_lens, tables, device=dev)
    ids = torch.randint(0, 1000, (3 * q,)).tolist()
    assert graphs.key(3, q, max(context_lens), len(tables[1])) is None  # verify graphs come with their aux layers
    hidden, eager, aux = (t.clone() for t in model(torch.tensor(ids, device=dev), step, kv,
                                                   torch.arange(3 * q, device=dev), aux_layers))
    g_hidden, replay, g_aux = replay_step(graphs, ids, [q] * 3, context_lens, tables, aux_layers)
    for a, b in ((replay, eager), (g_aux, aux), (g_hidden, hidden)):
        assert a.shape == b.shape and ((a - b).norm() / b.norm()).item() < 1e-4
    assert torch.equal(replay.argmax(-1), eager.argmax(-1))

    # a mixed step (a plain decode row, a verify row, a verify row with 1 draft) padded to q inside the graph
    counts = [1, q, 2]
    context_lens = [n + c for n, c in zip(lengths, counts, strict=True)]
    step = AttentionMetadata.build(counts, context_lens, tables, device=dev)
    ids = torch.randint(0, 1000, (sum(counts),)).tolist()
    hidden, eager, aux = (t.clone() for t in model(torch.tensor(ids, device=dev), step, kv,
                                                   torch.arange(sum(counts), device=dev), aux_layers))
    g_hidden, replay, g_aux = replay_step(graphs, ids, counts, context_lens, tables, aux_layers)
    for a, b in ((replay, eager), (g_aux, aux), (g_hidden, hidden)):
        assert a.shape == b.shape and ((a - b).norm() / b.norm()).item() < 1e-4
    assert torch.equal(replay.argmax(-1), eager.argmax(-1))


@pytest.mark.gpu
def test_speculation_with_graphs_equals_plain_and_eager(monkeypatch):
    """m3-tiny + its EAGLE3 head, fp32, batch 1, greedy: with graphs (verify and draft chain) the output equals
    plain decoding's and the eager speculative run's, and the graph drafts are accepted as often as eager ones."""
    import asyncio

    from m3sdk import Engine

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")  # fp32 tl.dot is TF32 by default: bf16-like rounding

    async def go(**kw):
        async with Engine(device="cuda", dtype="float32", max_num_seqs=4, **kw) as engine:
            before = engine.stats()  # after the engine's warm-up
            out = [(await engine.generate(p, max_tokens=48, temperature=0, ignore_eos=True)).token_ids
                   for p in ([5, 6, 7, 8, 9, 10, 11, 12], list(range(100, 140)))]
            return out, since(before, engine.stats())

    plain, s_plain = asyncio.run(go())
    graphs, s_graphs = asyncio.run(go(speculative="eagle3"))
    eager, s_eager = asyncio.run(go(speculative="eagle3", cuda_graphs=False))
    assert graphs == plain and eager == plain
    # float32 captures too (the MoE's dense form while capturing): every step after a prompt's was replayed
    assert s_plain["graph_steps"] == s_plain["steps"] - 2 and s_graphs["graph_steps"] == s_graphs["steps"] - 2
    assert s_eager["graph_steps"] == 0
    assert abs(s_graphs["spec_mean_accepted_length"] - s_eager["spec_mean_accepted_length"]) < 0.2
    assert s_graphs["spec_mean_accepted_length"] > 1.5


@pytest.mark.gpu
@pytest.mark.parametrize("speculative", [None, "eagle3"])
def test_default_gpu_engine_replays_graphs(speculative):
    """What a GPU user gets (m3-tiny, bf16, triton backend, graphs and overlap by default): the graphs are captured
    and every step after a prompt's replays one (w1 found m3-tiny running eagerly)."""
    import asyncio

    from m3sdk import Engine

    async def go():
        async with Engine(speculative=speculative, max_num_seqs=4) as engine:
            before = engine.stats()  # after the engine's warm-up
            for p in ([5, 6, 7, 8, 9, 10, 11, 12], list(range(100, 140))):
                done = await engine.generate(p, max_tokens=32, temperature=0, ignore_eos=True)
                assert len(done.token_ids) == 32
            return since(before, engine.stats())

    stats = asyncio.run(go())
    assert stats["graph_steps"] == stats["steps"] - 2


def test_padding_a_sequence_at_its_end_keeps_its_tokens_outputs(oracle_checkpoint):
    """What a graph does to a step whose sequences add fewer than q tokens (CPU, torch backend): each sequence
    padded at its end to q tokens (slot -1, context grown by the padding) gives its real tokens the outputs and
    cache writes of the unpadded step."""
    dev = torch.device("cpu")
    model = load_model(oracle_checkpoint, dev, torch.float32, "torch")
    spec = KVCacheSpec.for_model(model.config, 32, kv_dtype="fp32", index_dtype="fp32", model_dtype=torch.float32,
                                 device=dev)
    kv, kv2 = KVPool(spec), KVPool(spec)
    for t in (*kv.k, *kv.v, *kv2.k, *kv2.v):
        t.zero_()  # unwritten memory compares equal
    lengths, counts, q = [40, 19], [1, 3], 4
    tables = [[0, 1, 2, 3], [4, 5, 6]]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=g)
    model(prompt, AttentionMetadata.build(lengths, lengths, tables), kv)
    ids = torch.randint(0, model.config.vocab_size, (sum(counts),), generator=g)
    step = AttentionMetadata.build(counts, [n + c for n, c in zip(lengths, counts, strict=True)], tables)
    hidden, logits, aux = model(ids, step, kv, torch.arange(sum(counts)), (1, 2))
    written = [t.clone() for t in (*kv.k, *kv.v)]

    model(prompt, AttentionMetadata.build(lengths, lengths, tables), kv2)
    dest = torch.tensor([i * q + j for i, c in enumerate(counts) for j in range(c)])
    padded_ids = torch.zeros(len(counts) * q, dtype=torch.int64)
    padded_ids[dest] = ids
    positions = torch.zeros(len(counts) * q, dtype=torch.int64)
    positions[dest] = step.positions
    slots = torch.full((len(counts) * q,), -1, dtype=torch.int64)
    slots[dest] = step.slot_mapping
    padded = AttentionMetadata(positions=positions, slot_mapping=slots,
                               cu_seqlens_q=torch.arange(0, (len(counts) + 1) * q, q, dtype=torch.int32),
                               context_lens=step.context_lens + q - step.cu_seqlens_q.diff(),
                               page_table=step.page_table, max_seqlen_q=q, max_context_len=step.max_context_len + q)
    p_hidden, p_logits, p_aux = model(padded_ids, padded, kv2, dest, (1, 2))
    torch.testing.assert_close(p_logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p_hidden[dest], hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p_aux[dest], aux, rtol=1e-5, atol=1e-5)
    # the same slots written, with the same values up to the GEMMs' rounding at another batch shape
    for a, b in zip(written, (*kv2.k, *kv2.v), strict=True):
        assert torch.equal(a != 0, b != 0)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_engine_takes_the_graphs_for_every_decode_and_verify_step(monkeypatch, concurrency):
    """The benchmark's engines (m3-tiny, max_num_seqs = concurrency, plain and EAGLE3) with the graph wiring the
    core does on a GPU, on the CPU (each graph step runs eagerly on the static buffers): every step after the
    prompts' prefills is a graph step (none falls back to eager on a context bucket, max_model_len or aux
    condition), the drafter's read and chain run their fixed-shape steps, and outputs equal the eager engine's."""
    import asyncio

    from m3sdk import Engine
    from m3sdk.core import resolved

    prompts = [list(range(10 + 7 * i, 40 + 7 * i)) for i in range(2 * concurrency)]

    async def go(**kw):
        async with Engine(device="cpu", dtype="float32", max_num_seqs=concurrency, **kw) as engine:
            gate = asyncio.Semaphore(concurrency)

            async def one(p):
                async with gate:
                    return (await engine.generate(p, max_tokens=12, temperature=0, ignore_eos=True)).token_ids

            out = await asyncio.gather(*[one(p) for p in prompts])
            return out, engine.stats(), engine._core.executor.spec.drafter if kw.get("speculative") else None

    plain, _, _ = asyncio.run(go())
    spec_eager, _, _ = asyncio.run(go(speculative="eagle3"))
    monkeypatch.setattr(resolved, "cuda_graphs_wanted", lambda config, device, backend: True)
    monkeypatch.setattr(DecodeGraphs, "supported", staticmethod(lambda model: True))
    for kw, eager in (({}, plain), ({"overlap_scheduling": True}, plain), ({"speculative": "eagle3"}, spec_eager)):
        out, stats, drafter = asyncio.run(go(**kw))
        assert out == eager == plain
        # a step holding a prompt runs eagerly, but for a speculating engine, whose 30-token prompts fit its
        # four-page join graph; with one request at a time that is one step per prompt
        assert stats["graph_steps"] > 0.5 * stats["steps"]
        if concurrency == 1:
            assert stats["graph_steps"] == stats["steps"] - (0 if drafter is not None else len(prompts))
        if drafter is not None:
            assert sum(r.calls for r in drafter._read_graphs.values()) > 0
            assert sum(r.calls for r in drafter._graphs.values()) > 0
