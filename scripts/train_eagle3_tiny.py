"""Train the EAGLE3 draft head of m3-tiny and write it, in the published EAGLE3 layout, to
src/m3sdk/assets/m3-tiny-eagle3 (the engine's `speculative="eagle3"` then uses it with the bundled model).

Data: the training paragraphs of m3-tiny's corpus (data/austen.txt.xz, the same held-out rule as
scripts/train_m3_tiny.py: every 100th paragraph of each book is kept out), as windows of the corpus and as the
target's own greedy continuations of corpus windows (what greedy speculative decoding will see). The target
(transformers' MiniMaxM3VLForCausalLM, output_hidden_states) gives, per position, the hidden states entering
layers 1, 2, 3 (the aux states) and its greedy next token (the label: the draft learns to agree with the
target, which is what acceptance measures).

Head: one Llama layer (hidden 256 = the target's, so the target's embedding is shared and not stored), its own
lm_head over a reduced draft vocabulary (the 1024 most frequent target tokens; `d2t`/`t2d` map it).
Training-time test (EAGLE3): each anchor position t is unrolled for DEPTH draft steps exactly as the drafter
runs them: step j sits at position t + j, reads the previous step's pre-norm output and token t + j + 1, and
attends to the step-0 entries at positions <= t plus its own chain's entries (a diagonal per earlier step).
Loss: cross-entropy of each step against the target's greedy token, weighted 0.8^j.

Fixed seeds; about 6 minutes on 2 busy CPU cores (the target's transformers forward is most of the data
time). CI does not run this; it uses the committed head.

    .venv/bin/python scripts/train_eagle3_tiny.py [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

from m3sdk.speculative.eagle3 import Eagle3Config, Eagle3Head, save_eagle3

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "austen.txt.xz"
TARGET = ROOT / "src" / "m3sdk" / "assets" / "m3-tiny"
OUT = ROOT / "src" / "m3sdk" / "assets" / "m3-tiny-eagle3"
VAL_EVERY = 100  # as scripts/train_m3_tiny.py: paragraph i of a book is held out when i % 100 == 99

SEED = 0
AUX_LAYERS = (1, 2, 3)  # inputs of target layers 1..3 (m3-tiny has 4: the default (2, n//2, n-3) repeats one)
DRAFT_VOCAB = 1024
SEQ = 128
CORPUS_SEQS = 256
GENERATED_SEQS = 64  # greedy continuations: PROMPT corpus tokens + SEQ - PROMPT generated
PROMPT = 32
BATCH = 12
DEPTH = 3
LR = 3e-3
STEPS = 110


def paragraphs(held_out: bool) -> list[str]:
    text = lzma.decompress(CORPUS.read_bytes()).decode("utf-8")
    out = []
    for book in text.strip().split("\n\n"):
        out += [p for i, p in enumerate(book.split("\n")) if (i % VAL_EVERY == VAL_EVERY - 1) == held_out]
    return out


@torch.no_grad()
def build_data(target: MiniMaxM3VLForCausalLM, tokenizer: Tokenizer, rng: random.Random):
    """Token windows (corpus and greedy continuations) -> tokens [N, SEQ], aux [N, SEQ, 3H], labels [N, SEQ]
    (the target's greedy token after each position)."""
    stream = [i for enc in tokenizer.encode_batch(paragraphs(held_out=False)) for i in enc.ids]
    starts = [rng.randrange(len(stream) - SEQ) for _ in range(CORPUS_SEQS + GENERATED_SEQS)]
    windows = torch.tensor([stream[s:s + SEQ] for s in starts])
    corpus, prompts = windows[:CORPUS_SEQS], windows[CORPUS_SEQS:, :PROMPT]
    generated = []
    for chunk in prompts.split(64):  # equal-length prompts: no padding (transformers' MSA needs none)
        generated.append(target.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=SEQ - PROMPT,
                                         min_new_tokens=SEQ - PROMPT, do_sample=False, eos_token_id=None,
                                         pad_token_id=0))
    tokens = torch.cat([corpus, *generated])
    aux, labels = [], []
    for chunk in tokens.split(32):
        out = target(chunk, output_hidden_states=True)
        aux.append(torch.cat([out.hidden_states[i] for i in AUX_LAYERS], dim=-1).to(torch.bfloat16))
        labels.append(out.logits.argmax(-1))
    return tokens, torch.cat(aux), torch.cat(labels)


def draft_vocab(labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The DRAFT_VOCAB most frequent target tokens (ascending ids) -> (d2t offsets, target->draft index or -1)."""
    counts = torch.bincount(labels.flatten(), minlength=vocab)
    ids = counts.argsort(descending=True)[:DRAFT_VOCAB].sort().values
    to_draft = torch.full((vocab,), -1, dtype=torch.long)
    to_draft[ids] = torch.arange(DRAFT_VOCAB)
    return ids - torch.arange(DRAFT_VOCAB), to_draft


def ttt_loss(head: Eagle3Head, to_draft: torch.Tensor, tokens: torch.Tensor, aux: torch.Tensor,
             labels: torch.Tensor) -> tuple:
    """Training-time-test loss of one batch; also the per-step top-1 agreement with the target."""
    c = head.config
    b, t = tokens.shape
    scale = 1.0 / math.sqrt(c.head_dim)
    group = c.num_heads // c.num_kv_heads
    anchor = torch.arange(t)
    causal = anchor[None, :] <= anchor[:, None]  # step-0 key s visible from anchor t
    hidden = head.combine(aux.float().view(b * t, -1))
    keys, values, total, agree = [], [], 0.0, []
    for j in range(DEPTH):
        # step j at anchor t: token t + j + 1, position t + j; label: the target's token after t + j + 1
        idx = (anchor + j + 1).clamp(max=t - 1)
        valid = (anchor + j + 1 < t)[None, :].expand(b, t)
        tok = tokens.gather(1, idx[None, :].expand(b, t))
        lab = labels.gather(1, idx[None, :].expand(b, t))
        positions = (anchor + j).repeat(b)
        q, k, v, residual = head.project(head.embed(tok.view(-1)), hidden, positions)
        q = q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = k.view(b, t, c.num_kv_heads, c.head_dim).repeat_interleave(group, 2).transpose(1, 2)
        v = v.view(b, t, c.num_kv_heads, c.head_dim).repeat_interleave(group, 2).transpose(1, 2)
        keys.append(k)
        values.append(v)
        s0 = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
        diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # the chain's own entries
        p = torch.cat([s0, *diag], dim=-1).softmax(-1)
        o = p[..., :t] @ values[0]
        for i, vv in enumerate(values[1:]):
            o = o + p[..., t + i:t + i + 1] * vv
        normed, prenorm = head.finish(o.transpose(1, 2).reshape(b * t, -1), residual)
        logits = head.logits(normed)
        target = to_draft[lab.view(-1)]
        target = torch.where(valid.reshape(-1) & (target >= 0), target, -100)
        total = total + 0.8**j * F.cross_entropy(logits, target, ignore_index=-100)
        keep = valid.reshape(-1)
        agree.append(float((head.to_target(logits.argmax(-1))[keep] == lab.view(-1)[keep]).float().mean()))
        hidden = prenorm
    return total, agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=TARGET)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args()
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    t0 = time.time()
    target = MiniMaxM3VLForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    tc = target.config
    tokens, aux, labels = build_data(target, tokenizer, rng)
    print(f"data: {tokens.shape[0]} x {SEQ} tokens, {time.time() - t0:.0f}s", flush=True)

    d2t, to_draft = draft_vocab(labels, tc.vocab_size)
    config = Eagle3Config(hidden_size=tc.hidden_size, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
                          vocab_size=tc.vocab_size, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=tc.hidden_size,
                          rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=tc.max_position_embeddings,
                          aux_layer_ids=AUX_LAYERS)
    head = Eagle3Head(config, own_embedding=False, own_lm_head=True)
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    head.d2t.copy_(d2t)
    head.t2d.zero_()
    head.t2d[torch.arange(DRAFT_VOCAB) + d2t] = True
    head.shared_embed = target.get_input_embeddings().requires_grad_(False)

    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps))))
    g = torch.Generator().manual_seed(SEED)
    agree_log = []
    for step in range(args.steps):
        batch = torch.randint(0, tokens.shape[0], (BATCH,), generator=g)
        loss, agree = ttt_loss(head, to_draft, tokens[batch], aux[batch], labels[batch])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        agree_log.append(agree)
        if step % 20 == 0 or step == args.steps - 1:
            recent = torch.tensor(agree_log[-20:]).mean(0).tolist()
            print(f"step {step:4d}  loss {loss.item():.3f}  agreement per depth "
                  f"{' '.join(f'{a:.2f}' for a in recent)}  {time.time() - t0:.0f}s", flush=True)

    head.shared_embed = None
    save_eagle3(head.to(torch.bfloat16), args.out)
    final = torch.tensor(agree_log[-20:]).mean(0).tolist()
    target_sha = hashlib.sha256((args.target / "model.safetensors").read_bytes()).hexdigest()
    (args.out / "TRAINING.md").write_text(
        f"EAGLE3 head of m3-tiny, trained by scripts/train_eagle3_tiny.py ({args.steps} steps of {BATCH} x {SEQ}, "
        f"depth {DEPTH}, seed {SEED}, {time.time() - t0:.0f} s on this machine).\n"
        f"Aux layers {list(AUX_LAYERS)}, draft vocabulary {DRAFT_VOCAB} of {tc.vocab_size}, embedding shared with "
        f"the target.\nTarget: {args.target.name}/model.safetensors sha256 {target_sha}.\n"
        f"Top-1 agreement with the target's greedy token per draft depth (last 20 training batches): "
        f"{json.dumps([round(a, 3) for a in final])}.\n")
    print(f"wrote {args.out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
