"""Train m3-tiny, the small MiniMax-M3-architecture model bundled with m3sdk, and write its asset folder.

Everything is the real architecture, just small: transformers' `MiniMaxM3VLForCausalLM` with 1 dense-attention +
dense-MLP layer and 3 MSA (lightning indexer, block-sparse attention) + MoE layers (8 routed experts, top-2,
sigmoid router with `e_score_correction_bias`, one shared expert), Gemma norms, per-head q/k norms, partial RoPE,
SwiGLU-OAI. Trained from scratch on Jane Austen's novels (data/austen.txt.xz) with a byte-level BPE tokenizer
trained here too. Two training signals besides next-token cross-entropy, both from the way MiniMax-M3 and its
relatives are trained, because transformers' forward gives them no gradient:

- the indexer: its top-k block choice is a hard mask, so no gradient reaches `indexer.{q,k}_proj`. It is fitted
  by a KL loss (as DeepSeek-V3.2 trains its lightning indexer) from the layer's own dense attention distribution,
  averaged over each KV group's query heads, to the softmax of the indexer's token scores; the indexer reads a
  detached copy of the hidden state, so this loss moves only the indexer.
- the router bias: `e_score_correction_bias` is a buffer, nudged after every step towards equal expert load
  (auxiliary-loss-free balancing, as DeepSeek-V3 does).

Reproducible: fixed seeds, a fixed number of steps; bitwise equality needs the same torch build and thread count.
Takes about 7 minutes on 2 CPU cores (bf16 autocast). CI does not run this; it uses the committed assets.

    .venv/bin/python scripts/train_m3_tiny.py [--steps N] [--out DIR]
"""

import argparse
import json
import lzma
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jinja2
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
    MiniMaxM3VLTopKRouter,
    apply_rotary_pos_emb,
    repeat_kv,
)

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "austen.txt.xz"
ASSETS = ROOT / "src" / "m3sdk" / "assets" / "m3-tiny"

# MiniMax's special-token spelling: begin of text, end of a turn/text (the eos), begin of a role header.
BOS, EOS, ROLE = "]~!b[", "[e~[", "]~b]"
# In the spirit of MiniMax's template: one bos, then `]~b]ROLE\n...[e~[\n` per turn, the assistant role named
# "ai"; the generation prompt opens an ai turn. The training documents are rendered with it; the assets ship the
# full template (system, tools, tool calls, reasoning, thinking modes), which renders these plain conversations
# the same way.
CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "{%- set role = 'ai' if message['role'] == 'assistant' else message['role'] -%}\n"
    "{{- ']~b]' + role + '\\n' + message['content'] + '[e~[\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- ']~b]ai\\n' -}}{%- endif -%}\n"
)
SYSTEM_PROMPTS = [
    "You are a storyteller.",
    "You are m3-tiny, a small model that writes in the manner of an English novel.",
    "Continue the user's passage.",
]
USER_PROMPTS = [
    "Continue the story: {}",
    "What happens next? {}",
    "Please go on from here: {}",
    "Tell me a story that begins: {}",
    "{}",
]


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    vocab_size: int = 2048
    seq_len: int = 256  # 16 MSA blocks of 16 per sequence, of which each query keeps 4
    batch_size: int = 16
    long_seq_len: int = 512  # the last steps train on longer, fewer sequences (same tokens per step)
    long_from: float = 0.8
    steps: int = 600
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    indexer_loss_weight: float = 1.0
    indexer_sequences: int = 2  # sequences of each batch the indexer is distilled on
    router_bias_rate: float = 1e-2  # DeepSeek-V3 uses 1e-3 over far more steps
    chat_docs: int = 1200  # synthetic one-turn conversations mixed into the stream
    val_every: int = 50  # every Nth paragraph is held out for validation
    eval_every: int = 100
    eval_batches: int = 2


def model_config(recipe: Recipe) -> MiniMaxM3VLTextConfig:
    """m3-tiny's architecture: MiniMax-M3's, with every width cut down (about 3.75M parameters, 7.5 MB in bf16)."""
    sparse_layers = 3
    return MiniMaxM3VLTextConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=256,
        num_hidden_layers=1 + sparse_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        # MiniMax-M3 rotates the first half of each head (rotary_dim 64 of 128); transformers reads the share
        # from rope_parameters, rotary_dim is kept in step for readers of the original config.
        rotary_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        dense_intermediate_size=384,
        intermediate_size=64,  # per routed expert
        shared_intermediate_size=128,
        num_local_experts=8,
        num_experts_per_tok=2,
        routed_scaling_factor=2.0,
        layer_types=["full_attention"] + ["minimax_m3_sparse"] * sparse_layers,
        mlp_layer_types=["dense"] + ["sparse"] * sparse_layers,
        # MSA: index heads = KV heads and index_head_dim = head_dim, as in MiniMax-M3. A query keeps its own
        # block plus the 3 best-scoring others: 64 of up to 1024 keys, so selection drops blocks past 64 tokens.
        index_n_heads=2,
        index_head_dim=64,
        index_block_size=16,
        index_topk_blocks=4,
        index_local_blocks=1,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )


def load_books() -> list[list[str]]:
    text = lzma.decompress(CORPUS.read_bytes()).decode("utf-8")
    return [book.split("\n") for book in text.strip().split("\n\n")]


def train_tokenizer(paragraphs: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, ROLE],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(paragraphs, trainer)
    return tokenizer


def chat_documents(paragraphs: list[str], count: int, rng: random.Random) -> list[str]:
    """One-turn conversations cut from the corpus: the user gives a passage's first sentence, the ai turn
    continues the passage and ends with the eos, so that `m3sdk chat` answers in prose and stops."""
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    candidates = []
    for paragraph in paragraphs:
        sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z\"])", paragraph)
        if len(sentences) >= 2 and len(paragraph) <= 1200:
            candidates.append(sentences)
    docs = []
    for sentences in rng.sample(candidates, count):
        messages = [] if rng.random() < 0.5 else [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
        messages.append({"role": "user", "content": rng.choice(USER_PROMPTS).format(sentences[0])})
        messages.append({"role": "assistant", "content": " ".join(sentences[1:])})
        docs.append(template.render(messages=messages, bos_token=BOS, add_generation_prompt=False))
    return docs


def token_streams(tokenizer: Tokenizer, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The training stream (novels, then the chat documents) and the validation stream (held-out paragraphs)."""
    rng = random.Random(recipe.seed)
    train_text, val_text, train_paragraphs = [], [], []
    for book in load_books():
        kept = [p for i, p in enumerate(book) if i % recipe.val_every != recipe.val_every - 1]
        held = [p for i, p in enumerate(book) if i % recipe.val_every == recipe.val_every - 1]
        train_text.append("\n".join(kept) + EOS + "\n")
        val_text.append("\n".join(held) + "\n")
        train_paragraphs += kept
    train_text += chat_documents(train_paragraphs, recipe.chat_docs, rng)

    def encode(texts: list[str]) -> torch.Tensor:
        return torch.tensor([i for enc in tokenizer.encode_batch(texts) for i in enc.ids], dtype=torch.long)

    return encode(train_text), encode(val_text)


class IndexerDistillation:
    """Hooks on the sparse layers' attention: after each forward, the KL from the layer's dense attention
    distribution (detached; mean over the query heads of each KV group) to the indexer's token-score softmax."""

    def __init__(self, model: MiniMaxM3VLForCausalLM, sequences: int) -> None:
        self.sequences = sequences
        self.losses: list[torch.Tensor] = []
        self.handles = [
            layer.self_attn.register_forward_hook(self._hook, with_kwargs=True)
            for layer in model.model.layers
            if layer.self_attn.indexer is not None
        ]

    def _hook(self, attn, args, kwargs, output) -> None:
        if not attn.training:
            return
        # A few sequences of the batch are plenty for the indexer's few weights, and keep the step cheap.
        hidden = kwargs["hidden_states"][: self.sequences].detach().float()
        cos, sin = (t[: self.sequences] for t in kwargs["position_embeddings"])
        batch, seq, _ = hidden.shape
        future = torch.ones(seq, seq, dtype=torch.bool, device=hidden.device).triu(1)
        with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
            q = attn.q_norm(attn.q_proj(hidden).view(batch, seq, -1, attn.head_dim)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(hidden).view(batch, seq, -1, attn.head_dim)).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos.float(), sin.float())
            scores = q @ repeat_kv(k, attn.num_key_value_groups).transpose(-1, -2) * attn.scaling
            probs = scores.masked_fill(future, float("-inf")).softmax(-1)
            target = probs.view(batch, -1, attn.num_key_value_groups, seq, seq).mean(2)  # [B, Hkv, S, S]
        indexer = attn.indexer
        with torch.autocast(hidden.device.type, enabled=False):
            iq = indexer.q_norm(indexer.q_proj(hidden).view(batch, seq, -1, indexer.head_dim)).transpose(1, 2)
            ik = indexer.k_norm(indexer.k_proj(hidden).view(batch, seq, 1, indexer.head_dim)).transpose(1, 2)
            dim = indexer.head_dim
            iq, ik = apply_rotary_pos_emb(iq, ik, cos[..., :dim].float(), sin[..., :dim].float())
            log_q = (iq @ ik.transpose(-1, -2)).masked_fill(future, float("-inf")).log_softmax(-1)
            log_q = log_q.masked_fill(future, 0.0)  # target is 0 there; keeps 0 * -inf out of the sum
            self.losses.append(F.kl_div(log_q, target, reduction="sum") / (batch * target.shape[1] * seq))

    def pop(self) -> torch.Tensor:
        loss = torch.stack(self.losses).mean()
        self.losses.clear()
        return loss

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class RouterBalancer:
    """Auxiliary-loss-free load balancing: count each router's top-k picks over a step, then move its
    e_score_correction_bias by `rate` towards the under-loaded experts (sign of mean load - load)."""

    def __init__(self, model: MiniMaxM3VLForCausalLM, rate: float) -> None:
        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, MiniMaxM3VLTopKRouter)]
        self.loads = [torch.zeros(r.num_experts) for r in self.routers]
        self.handles = [r.register_forward_hook(self._counter(i)) for i, r in enumerate(self.routers)]

    def _counter(self, index: int):
        def hook(router, args, output) -> None:
            if router.training:
                self.loads[index] += torch.bincount(output[2].flatten(), minlength=router.num_experts).float()
        return hook

    @torch.no_grad()
    def step(self) -> float:
        """Updates the biases; returns the worst max/mean load ratio over the routers this step."""
        imbalance = 0.0
        for router, load in zip(self.routers, self.loads, strict=True):
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            imbalance = max(imbalance, (load.max() / load.mean()).item())
            load.zero_()
        return imbalance

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def lm_loss(model: MiniMaxM3VLForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: MiniMaxM3VLForCausalLM, val: torch.Tensor, recipe: Recipe) -> float:
    model.eval()
    stride = (len(val) - recipe.seq_len - 1) // (recipe.eval_batches * recipe.batch_size)
    starts = torch.arange(recipe.eval_batches * recipe.batch_size) * stride
    losses = [lm_loss(model, windows(val, chunk, recipe.seq_len)).item()
              for chunk in starts.split(recipe.batch_size)]
    model.train()
    return sum(losses) / len(losses)


def learning_rate(step: int, recipe: Recipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: MiniMaxM3VLForCausalLM, train_ids: torch.Tensor, val_ids: torch.Tensor, recipe: Recipe) -> dict:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    distill = IndexerDistillation(model, recipe.indexer_sequences)
    balancer = RouterBalancer(model, recipe.router_bias_rate)
    sampler = torch.Generator().manual_seed(recipe.seed)
    log = {"steps": [], "val": []}
    window_loss, window_kl, started = [], [], time.time()
    model.train()
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, recipe)
        long = step >= recipe.long_from * recipe.steps
        seq_len = recipe.long_seq_len if long else recipe.seq_len
        batch_size = recipe.batch_size * recipe.seq_len // seq_len
        starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch_size,), generator=sampler)
        loss = lm_loss(model, windows(train_ids, starts, seq_len))
        kl = distill.pop()
        (loss + recipe.indexer_loss_weight * kl).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        imbalance = balancer.step()
        window_loss.append(loss.item())
        window_kl.append(kl.item())
        if (step + 1) % 50 == 0 or step + 1 == recipe.steps:
            entry = {"step": step + 1, "loss": round(sum(window_loss) / len(window_loss), 4),
                     "indexer_kl": round(sum(window_kl) / len(window_kl), 4),
                     "expert_load_max_over_mean": round(imbalance, 3), "seconds": round(time.time() - started, 1)}
            log["steps"].append(entry)
            print(json.dumps(entry), flush=True)
            window_loss, window_kl = [], []
        if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
            val = {"step": step + 1, "val_loss": round(evaluate(model, val_ids, recipe), 4)}
            log["val"].append(val)
            print(json.dumps(val), flush=True)
    distill.remove()
    balancer.remove()
    log["train_seconds"] = round(time.time() - started, 1)
    return log


def save_assets(model: MiniMaxM3VLForCausalLM, tokenizer: Tokenizer, out: Path, recipe: Recipe, log: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    for module in model.modules():  # MiniMax-M3 keeps the router bias in fp32 (it is added to sigmoid scores)
        if isinstance(module, MiniMaxM3VLTopKRouter):
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.token_to_id(BOS), eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(EOS),
    )
    model.save_pretrained(out)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=EOS,
        model_max_length=model.config.max_position_embeddings,
    )
    fast.chat_template = (ASSETS / "chat_template.jinja").read_text(encoding="utf-8")
    fast.save_pretrained(out)
    (out / "README.md").write_text(model_card(model, recipe, log))


def model_card(model: MiniMaxM3VLForCausalLM, recipe: Recipe, log: dict) -> str:
    params = sum(p.numel() for p in model.parameters())
    final, val = log["steps"][-1], log["val"][-1]
    recipe_lines = "\n".join(f"- `{k}`: {v}" for k, v in asdict(recipe).items())
    return f"""# m3-tiny

A {params / 1e6:.2f}M-parameter model with MiniMax-M3's architecture (transformers' `MiniMaxM3VLForCausalLM`):
1 dense-attention layer with a dense MLP, then 3 MiniMax Sparse Attention layers (lightning indexer, blocks of 16,
top-4 blocks, 1 local block) with MoE MLPs (8 experts, top-2, sigmoid router with correction bias, one shared
expert). Byte-level BPE tokenizer of {recipe.vocab_size} tokens, MiniMax-style chat template. Trained from scratch
by `scripts/train_m3_tiny.py` on Jane Austen's six novels (public domain; see `data/SOURCE.md`), so it writes
Austen-flavoured English of a tiny model's quality. It is m3sdk's bundled default model: for trying the engine
out, not for any real use.

Final training loss {final["loss"]} (mean of the last 50 steps), validation loss {val["val_loss"]} nats/token on
held-out paragraphs, after {recipe.steps} steps of {recipe.batch_size * recipe.seq_len} tokens (sequences of
{recipe.seq_len}, then {recipe.long_seq_len} from {recipe.long_from:.0%} of the steps), {log["train_seconds"]:.0f} s of
wall clock on the CPU it ran on. Recipe, timing, loss curve and samples: `docs/m3-tiny.md`.

## Recipe
{recipe_lines}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--out", type=Path, default=ASSETS)
    args = parser.parse_args()
    recipe = Recipe(steps=args.steps)
    started = time.time()
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(2)

    books = load_books()
    tokenizer = train_tokenizer([p for book in books for p in book], recipe.vocab_size)
    train_ids, val_ids = token_streams(tokenizer, recipe)
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens; train {len(train_ids):,} tokens, "
          f"val {len(val_ids):,} tokens ({time.time() - started:.0f} s)", flush=True)

    model = MiniMaxM3VLForCausalLM(model_config(recipe))
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    log = train(model, train_ids, val_ids, recipe)
    save_assets(model, tokenizer, args.out, recipe, log)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    summary = {"final_train_loss": log["steps"][-1]["loss"], "final_val_loss": log["val"][-1]["val_loss"],
               "train_seconds": log["train_seconds"], "total_seconds": round(time.time() - started, 1),
               "asset_bytes": size}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
