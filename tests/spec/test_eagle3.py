"""EAGLE3 draft heads in the published layout: loading (names, shapes, reduced vocabulary maps, both file
formats) and the drafter's incremental cache + chain against a plain full-recompute reference."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from m3sdk.errors import CheckpointError
from m3sdk.runner import PLACEHOLDER
from m3sdk.speculative import eagle3
from m3sdk.speculative.base import DraftRequest, TargetInfo, TargetStates
from m3sdk.speculative.eagle3 import Eagle3Drafter, load_eagle3

H, HT, HEADS, KV, D, INTER, VOCAB, DVOCAB, EPS, THETA = 32, 24, 4, 2, 8, 48, 64, 40, 1e-5, 500.0
TARGET = SimpleNamespace(vocab_size=VOCAB, hidden_size=HT, num_layers=6)


def published_tensors(seed=0) -> dict[str, torch.Tensor]:
    """A random head under the names the published EAGLE3 checkpoints use (written here by hand, not from the
    module's state_dict, so the layout is checked independently)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.2: torch.randn(*s, generator=g) * std  # noqa: E731
    vocab_ids = torch.randperm(VOCAB, generator=g)[:DVOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[vocab_ids] = True
    return {
        "midlayer.input_layernorm.weight": 1 + r(H), "midlayer.hidden_norm.weight": 1 + r(H),
        "midlayer.post_attention_layernorm.weight": 1 + r(H),
        "midlayer.self_attn.q_proj.weight": r(HEADS * D, 2 * H), "midlayer.self_attn.k_proj.weight": r(KV * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(KV * D, 2 * H), "midlayer.self_attn.o_proj.weight": r(H, HEADS * D),
        "midlayer.mlp.gate_proj.weight": r(INTER, H), "midlayer.mlp.up_proj.weight": r(INTER, H),
        "midlayer.mlp.down_proj.weight": r(H, INTER),
        "fc.weight": r(H, 3 * HT), "norm.weight": 1 + r(H), "lm_head.weight": r(DVOCAB, H, std=1.0),
        "embed_tokens.weight": r(VOCAB, H, std=1.0),
        "d2t": vocab_ids - torch.arange(DVOCAB), "t2d": t2d,
    }


CONFIG = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
          "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D, "intermediate_size": INTER,
          "num_hidden_layers": 1, "vocab_size": VOCAB, "draft_vocab_size": DVOCAB, "target_hidden_size": HT,
          "rms_norm_eps": EPS, "rope_theta": THETA, "hidden_act": "silu", "tie_word_embeddings": False,
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}}


def write(path, tensors, config=CONFIG, fmt="safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(tensors, str(path / "model.safetensors"))
    else:
        torch.save(tensors, path / "pytorch_model.bin")
    return path


def reference_next_tokens(W, tokens, aux, start, k):
    """Plain full recompute of every draft entry (no cache): entry t reads fc(aux[t]) (or, along the chain, the
    previous entry's pre-norm output) and token t + 1; the draft token is argmax of lm_head, mapped by d2t."""
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w  # noqa: E731

    def rope(x, pos):
        inv = 1.0 / THETA ** (torch.arange(0, D, 2).float() / D)
        a = pos.float()[:, None, None] * inv
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([x1 * a.cos() - x2 * a.sin(), x2 * a.cos() + x1 * a.sin()], -1)

    def run(hidden_in, ids, pos):
        n = len(ids)
        x = torch.cat([rms(W["embed_tokens.weight"][ids], W["midlayer.input_layernorm.weight"]),
                       rms(hidden_in, W["midlayer.hidden_norm.weight"])], -1)
        q = rope((x @ W["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, D), pos)
        kk = rope((x @ W["midlayer.self_attn.k_proj.weight"].T).view(n, KV, D), pos).repeat_interleave(2, 1)
        v = (x @ W["midlayer.self_attn.v_proj.weight"].T).view(n, KV, D).repeat_interleave(2, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) / D**0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, HEADS * D)
        res = o @ W["midlayer.self_attn.o_proj.weight"].T + hidden_in
        m = rms(res, W["midlayer.post_attention_layernorm.weight"])
        m = F.silu(m @ W["midlayer.mlp.gate_proj.weight"].T) * (m @ W["midlayer.mlp.up_proj.weight"].T)
        res = m @ W["midlayer.mlp.down_proj.weight"].T + res
        logits = rms(res, W["norm.weight"]) @ W["lm_head.weight"].T
        return res, logits

    n = len(aux)
    hidden_in = aux @ W["fc.weight"].T
    ids = list(tokens[start + 1:start + n + 1])
    pos = torch.arange(start, start + n)
    drafts = []
    for _ in range(k):
        res, logits = run(hidden_in, torch.tensor(ids), pos)
        d = int(logits[-1].argmax())
        drafts.append(d + int(W["d2t"][d]))
        hidden_in = torch.cat([hidden_in, res[-1:]])
        ids.append(drafts[-1])
        pos = torch.cat([pos, pos[-1:] + 1])
    return drafts


def target_info(**kw):
    return TargetInfo(config=TARGET, **kw)


def test_load_published_layout_and_draft_matches_reference(tmp_path):
    W = published_tensors()
    head = load_eagle3(write(tmp_path / "st", W), target_info())
    assert head.aux_layers == (1, 3, 4)
    assert head.embed_tokens is not None and head.lm_head.weight.shape == (DVOCAB, H)
    drafter = Eagle3Drafter(head, 3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    aux = torch.randn(19, 3 * HT, generator=g)
    # chunked: positions 0..10 then 11..18 (a prefill in two chunks); token 19 is the last, not yet computed
    drafter.observe([("r", TargetStates(0, tokens[1:12], torch.zeros(11, HT), aux[:11]))])
    drafter.observe([("r", TargetStates(11, tokens[12:20], torch.zeros(8, HT), aux[11:]))])
    got = drafter.propose([DraftRequest("r", tokens, 3)])[0]
    want = reference_next_tokens(W, tokens, aux, 0, 3)
    assert got.tokens == want and got.probs is None
    assert all(W["t2d"][t] for t in want)  # drafts are target ids inside the reduced vocabulary
    # proposing does not disturb the cache: proposing again gives the same chain
    assert drafter.propose([DraftRequest("r", tokens, 2)])[0].tokens == want[:2]
    # a verify step that accepted 1 draft + 1 correction commits positions 19, 20
    tokens2 = tokens + [want[0], 7]
    aux2 = torch.randn(2, 3 * HT, generator=g)
    drafter.observe([("r", TargetStates(19, tokens2[20:22], torch.zeros(2, HT), aux2))])
    got = drafter.propose([DraftRequest("r", tokens2, 3)])[0]
    assert got.tokens == reference_next_tokens(W, tokens2, torch.cat([aux, aux2]), 0, 3)
    # a request whose draft has not read its last committed position proposes nothing
    assert drafter.propose([DraftRequest("r", tokens2 + [1], 3)])[0].tokens == []
    drafter.release("r")
    assert drafter.propose([DraftRequest("r", tokens2, 3)])[0].tokens == []


def test_bin_file_layers0_names_and_derived_t2d(tmp_path):
    W = published_tensors()
    alt = {k.replace("midlayer.", "layers.0."): v for k, v in W.items() if k != "t2d"}
    head = load_eagle3(write(tmp_path / "bin", alt, fmt="bin"), target_info())
    assert torch.equal(head.t2d, W["t2d"])
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, W["midlayer.self_attn.q_proj.weight"])


def test_shared_embedding_and_lm_head(tmp_path):
    """A head without embed_tokens / lm_head (same hidden size, full vocabulary) uses the target's."""
    W = published_tensors()
    W = {k: v for k, v in W.items() if k not in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")}
    W = {k: (v[:, : 3 * HT] if k == "fc.weight" else v) for k, v in W.items()}
    cfg = {**CONFIG, "draft_vocab_size": VOCAB, "target_hidden_size": H}
    cfg.pop("eagle_config")
    embed, lm_head = nn.Embedding(VOCAB, H), nn.Linear(H, VOCAB, bias=False)
    W["fc.weight"] = torch.randn(H, 3 * H)
    head = load_eagle3(write(tmp_path / "shared", W, cfg),
                       TargetInfo(config=SimpleNamespace(vocab_size=VOCAB, hidden_size=H, num_layers=10),
                                  embed_tokens=embed, lm_head=lm_head))
    assert head.embed_tokens is None and head.lm_head is None
    assert head.aux_layers == (2, 5, 7)  # the default for a 10-layer target
    assert torch.equal(head.embed(torch.tensor([3])), embed(torch.tensor([3])))


def test_bad_checkpoints_are_named(tmp_path):
    W = published_tensors()
    bad = {**W, "fc.weight": torch.zeros(H, 3 * HT + 1)}
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_eagle3(write(tmp_path / "a", bad), target_info())
    missing = {k: v for k, v in W.items() if k != "midlayer.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match="midlayer.mlp.up_proj.weight"):
        load_eagle3(write(tmp_path / "b", missing), target_info())
    with pytest.raises(CheckpointError, match="vocab_size"):
        load_eagle3(write(tmp_path / "c", W, {**CONFIG, "vocab_size": 65}), target_info())
    with pytest.raises(CheckpointError, match="architectures"):
        load_eagle3(write(tmp_path / "d", W, {**CONFIG, "architectures": ["LlamaForCausalLM"]}), target_info())


def test_vocab_maps_that_disagree_are_refused(tmp_path):
    """d2t holds offsets (target = draft + d2t[draft]); a d2t written as absolute target ids, or one that leaves
    the vocabulary or maps two draft ids to one target, would draft garbage silently: the loader refuses it."""
    W = published_tensors()
    vocab_ids = W["d2t"] + torch.arange(DVOCAB)
    with pytest.raises(CheckpointError, match="d2t"):  # absolute ids: disagrees with t2d
        load_eagle3(write(tmp_path / "abs", {**W, "d2t": vocab_ids}), target_info())
    no_t2d = {k: v for k, v in W.items() if k != "t2d"}
    with pytest.raises(CheckpointError, match="d2t"):  # absolute ids run past the vocabulary
        load_eagle3(write(tmp_path / "range", {**no_t2d, "d2t": vocab_ids}), target_info())
    twice = W["d2t"].clone()
    twice[1] = vocab_ids[0] - 1  # draft ids 0 and 1 both map to vocab_ids[0]
    with pytest.raises(CheckpointError, match="d2t"):
        load_eagle3(write(tmp_path / "dup", {**no_t2d, "d2t": twice}), target_info())


def test_fixed_shape_chain_matches_eager_chain(tmp_path):
    """The chain as a CUDA graph runs it (every row reads the pool's whole span, padding rows on the scratch row)
    drafts what the eager chain drafts, for requests of different lengths sharing the pool."""
    W = published_tensors()
    head = load_eagle3(write(tmp_path / "st", W), target_info())
    drafter = Eagle3Drafter(head, 4, max_num_seqs=2, capacity=64)  # 3 requests: the pool grows
    g = torch.Generator().manual_seed(2)
    seqs, want = [], []
    for rid, n in (("a", 9), ("b", 17), ("c", 4)):
        tokens = torch.randint(0, VOCAB, (n + 1,), generator=g).tolist()
        aux = torch.randn(n, 3 * HT, generator=g)
        drafter.observe([(rid, TargetStates(0, tokens[1:], torch.zeros(n, HT), aux))])
        seqs.append(drafter._seqs[rid])
        want.append(reference_next_tokens(W, tokens, aux, 0, 4))
    eager = drafter.chain(seqs, 3)
    assert [[s.next_token] + e for s, e in zip(seqs, eager, strict=True)] == want
    assert [s.ctx.length for s in seqs] == [9, 17, 4]  # the chain's entries are not kept
    # the graph's layout: one padding context (on the scratch row), every context reading the pool's whole span
    ints = torch.tensor(drafter._chain_ints(seqs, len(seqs) + 1, 3))
    hidden = torch.cat([torch.stack([s.hidden for s in seqs]), torch.zeros(1, seqs[0].hidden.shape[0])])
    with torch.inference_mode():
        fixed = drafter._chain_from(ints, hidden, len(seqs) + 1, 3, drafter.capacity).tolist()
    assert fixed[:3] == eager


@pytest.mark.parametrize("k", [1, 3])
def test_fixed_shape_steps_draft_like_eager_steps(tmp_path, k):
    """`capture_graphs` (on the CPU: the same fixed-shape steps run eagerly on the static buffers, padding rows
    on the scratch row) drafts exactly what the eager drafter drafts, over prefills (eager in both), verify-sized
    reads of 1 .. k + 1 entries (read and chain drafted ahead at observe), requests joining, leaving and asking
    for fewer drafts."""
    W = published_tensors()
    head = load_eagle3(write(tmp_path / "st", W), target_info())
    eager, fixed = Eagle3Drafter(head, k, max_num_seqs=4, capacity=96), Eagle3Drafter(head, k, max_num_seqs=4,
                                                                                        capacity=96)
    fixed.capture_graphs(4)
    assert sorted(fixed._read_graphs) == [1, 2, 4] and sorted(fixed._graphs) == ([1, 2, 4] if k > 1 else [])
    drafted_ahead = 0
    g = torch.Generator().manual_seed(3)
    tokens = {rid: torch.randint(0, VOCAB, (n + 1,), generator=g).tolist() for rid, n in (("a", 12), ("b", 5))}
    pending = {rid: (0, t[1:], torch.randn(len(t) - 1, 3 * HT, generator=g)) for rid, t in tokens.items()}
    for step in range(6):
        items = [(rid, TargetStates(start, nxt, torch.zeros(len(nxt), HT), aux))
                 for rid, (start, nxt, aux) in pending.items()]
        eager.observe(items)
        fixed.observe(items)
        drafted_ahead += sum(s.ahead is not None for s in fixed._seqs.values())
        asks = [DraftRequest(rid, tokens[rid], k if step % 3 else max(k - 1, 1)) for rid in tokens]
        want = eager.propose(asks)
        got = fixed.propose(asks)
        # drafted ahead: placeholders, one per draft, for the drafts on the device the verify step reads
        assert all(p.tokens == [PLACEHOLDER] * len(w.tokens) for p, w in zip(got, want, strict=True) if p.pending)
        drafted = [p.pending.host()[p.row][:len(p.tokens)] if p.pending else p.tokens for p in got]
        assert drafted == [p.tokens for p in want]
        assert all(len(p.tokens) == a.max_drafts for p, a in zip(want, asks, strict=True))
        pending = {}
        for r, p in zip(asks, want, strict=True):  # accept a prefix of the drafts and one more token
            accepted = p.tokens[: step % 4] + [int(torch.randint(0, VOCAB, (1,), generator=g))]
            start = len(tokens[r.request_id]) - 1
            tokens[r.request_id] += accepted
            pending[r.request_id] = (start, tokens[r.request_id][start + 1:],
                                     torch.randn(len(accepted), 3 * HT, generator=g))
        if step == 2:  # one leaves, one joins with a prefill
            for d in (eager, fixed):
                d.release("a")
            del tokens["a"], pending["a"]
            tokens["c"] = torch.randint(0, VOCAB, (8,), generator=g).tolist()
            pending["c"] = (0, tokens["c"][1:], torch.randn(7, 3 * HT, generator=g))
    assert drafted_ahead >= 8  # every observe after the prefills (steps 1..5, two requests each but one)


@pytest.mark.parametrize(("k", "table"), [(1, True), (3, True), (3, False)])
def test_read_before_the_verdict_drafts_like_the_read_after_it(tmp_path, monkeypatch, k, table):
    """A greedy verify step's read launched before the host has read the step (`read_unverified`: the device
    counts each request's accepted drafts from the step's argmax and the drafts it verified) leaves the drafter as
    the read of the settled entries does: the same next drafts and context lengths, for requests accepting none,
    some or all of their drafts, one verifying fewer than k (3 requests: a padding context in bucket 4); with and
    without the draft vocabulary's embedding table."""
    if not table:
        monkeypatch.setattr(eagle3.drafter, "DRAFT_EMBED_TABLE_BYTES", 0)
    W = published_tensors()
    head = load_eagle3(write(tmp_path / "st", W), target_info())
    after, before = (Eagle3Drafter(head, k, max_num_seqs=4, capacity=96) for _ in range(2))
    assert (before._draft_embeds is not None) == table
    for d in (after, before):
        d.capture_graphs(4)
    g = torch.Generator().manual_seed(5)
    tokens = {rid: torch.randint(0, VOCAB, (n + 1,), generator=g).tolist() for rid, n in (("a", 12), ("b", 5),
                                                                                           ("c", 9))}
    # a prefill, then a verify-sized step read as usual: both hold the drafts of the next step on the device
    for step in range(2):
        items = []
        for rid, t in tokens.items():
            start = 0 if step == 0 else len(t) - 2
            items.append((rid, TargetStates(start, t[start + 1:], torch.zeros(len(t) - 1 - start, HT),
                                            torch.randn(len(t) - 1 - start, 3 * HT, generator=g))))
        for d in (after, before):
            d.observe(items)
            d.propose([DraftRequest(rid, t, k) for rid, t in tokens.items()])
        if step == 0:
            for t in tokens.values():
                t.append(int(torch.randint(0, VOCAB, (1,), generator=g)))
    asks = [DraftRequest(rid, t, k if rid != "c" else max(k - 1, 1)) for rid, t in tokens.items()]
    for _ in range(3):
        proposals = before.propose(asks)
        assert all(p.pending is not None for p in proposals)
        verified = {a.request_id: p.pending.host()[p.row][:len(p.tokens)] for a, p in zip(asks, proposals,
                                                                                           strict=True)}
        items, argmax, states, settled, observed, row = [], [], [], {}, [], 0
        for (rid, t), p in zip(tokens.items(), proposals, strict=True):
            drafts = verified[rid]
            accepted = int(torch.randint(0, len(drafts) + 1, (1,), generator=g))
            bonus = (drafts[accepted] + 1) % VOCAB if accepted < len(drafts) else 7
            n = 1 + len(drafts)
            # past the rejected draft the argmax equals the drafts again: a count that went on would take them
            rows = (drafts[:accepted] + [bonus] + drafts[accepted + 1:] + [5])[:n]
            aux = torch.randn(n, 3 * HT, generator=g)
            items.append((rid, len(t) - 1, n, row, p.row * k))
            argmax += rows
            states.append(aux)
            settled[rid] = accepted + 1
            observed.append((rid, TargetStates(len(t) - 1, rows[:accepted + 1], torch.zeros(accepted + 1, HT),
                                               aux[:accepted + 1])))
            t += rows[:accepted + 1]
            row += n
        after.observe(observed)
        # logits whose argmax is `argmax` (the drafts it verified are the latest read's, still on the device)
        logits = F.one_hot(torch.tensor(argmax), VOCAB).float()
        drafts = proposals[0].pending.drafts.reshape(-1)
        flat = drafts.tolist()
        read = before.read_unverified(items, logits, torch.cat(states), drafts)
        # (sent before the read overwrote them)
        assert read is not None and read.verdict.get()[0].tolist() == argmax + flat
        before.settle(read, settled)
        want = [p.pending.host()[p.row] if p.pending else p.tokens for p in after.propose(asks)]
        got = [p.pending.host()[p.row] if p.pending else p.tokens for p in before.propose(asks)]
        assert got == want
        assert [s.ctx.length for s in before._seqs.values()] == [s.ctx.length for s in after._seqs.values()]
