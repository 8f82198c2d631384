"""Check the m3-tiny assets with transformers (the oracle): samples, and what the MSA selection really does.

Prints greedy and sampled continuations of "Once upon a time", a chat reply through the chat template, and,
on a 512-token passage of the held-out validation text:
- how many (sparse layer, index head, query) selections leave out visible blocks (MSA really dropping keys),
- the share of each layer's dense attention probability that falls inside the selected blocks, next to the same
  share for the 4 most recent blocks (what a sliding window of the same size would keep),
- the loss with MSA as configured and with every block selected (dense attention on every layer).

    .venv/bin/python scripts/check_m3_tiny.py [--model DIR]
"""

import argparse
import json
import lzma
from pathlib import Path

import torch
from transformers import AutoTokenizer
from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb, repeat_kv

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "src" / "m3sdk" / "assets" / "m3-tiny"
CORPUS = ROOT / "data" / "austen.txt.xz"
PROMPT = "Once upon a time"


def samples(model: MiniMaxM3VLForCausalLM, tokenizer) -> dict:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    greedy = model.generate(ids, max_new_tokens=64, do_sample=False)
    torch.manual_seed(0)
    sampled = model.generate(ids, max_new_tokens=64, do_sample=True, temperature=0.8, top_p=0.95)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story that begins: It was a fine "
                                           "morning in the country."}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True).input_ids
    torch.manual_seed(0)
    reply = model.generate(chat, max_new_tokens=96, do_sample=True, temperature=0.7, top_p=0.95)
    return {
        "greedy": tokenizer.decode(greedy[0]),
        "sampled (temperature 0.8, top_p 0.95, seed 0)": tokenizer.decode(sampled[0]),
        "chat reply (temperature 0.7, seed 0)": tokenizer.decode(reply[0, chat.shape[1]:]),
    }


def validation_passage(tokenizer, length: int) -> torch.Tensor:
    """Held-out paragraphs (the trainer keeps every 50th paragraph of each novel out), joined up to `length`."""
    paragraphs = [p for book in lzma.decompress(CORPUS.read_bytes()).decode().strip().split("\n\n")
                  for i, p in enumerate(book.split("\n")) if i % 50 == 49]
    return tokenizer("\n".join(paragraphs)[: 4 * length], return_tensors="pt").input_ids[:, :length]


@torch.no_grad()
def selection_stats(model: MiniMaxM3VLForCausalLM, ids: torch.Tensor) -> list[dict]:
    captured = {}

    def keep(attn, args, kwargs, output):
        captured[attn.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    def keep_selection(indexer, args, output):
        captured[("sel", indexer.layer_idx)] = output

    sparse = [layer.self_attn for layer in model.model.layers if layer.self_attn.indexer is not None]
    handles = [a.register_forward_hook(keep, with_kwargs=True) for a in sparse]
    handles += [a.indexer.register_forward_hook(keep_selection) for a in sparse]
    model(input_ids=ids)
    for handle in handles:
        handle.remove()

    stats = []
    seq = ids.shape[1]
    for attn in sparse:
        hidden, (cos, sin) = captured[attn.layer_idx]
        selection = captured[("sel", attn.layer_idx)][0]  # [Hidx, S, topk], -1 padded
        block = attn.indexer.block_size
        q = attn.q_norm(attn.q_proj(hidden).view(1, seq, -1, attn.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(hidden).view(1, seq, -1, attn.head_dim)).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        scores = (q @ repeat_kv(k, attn.num_key_value_groups).transpose(-1, -2))[0] * attn.scaling
        future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        groups = probs.view(-1, attn.num_key_value_groups, seq, seq).mean(1)  # [Hkv, S, S]
        block_mass = groups.view(groups.shape[0], seq, seq // block, block).sum(-1)  # [Hkv, S, blocks]
        chosen = torch.zeros_like(block_mass, dtype=torch.bool)
        chosen.scatter_(-1, selection.clamp(min=0).long(), selection >= 0)
        query_block = torch.arange(seq) // block
        recent = (query_block[:, None] - torch.arange(seq // block)[None, :]).clamp(min=-1)
        recent = (recent >= 0) & (recent < selection.shape[-1])
        visible = query_block + 1
        valid = (selection >= 0).sum(-1)
        past_window = query_block >= selection.shape[-1]
        stats.append({
            "layer": attn.layer_idx,
            "selections_dropping_blocks": f"{int((valid < visible).sum())} of {valid.numel()}",
            "dense_attention_mass_in_selected_blocks": round(
                float(block_mass.masked_fill(~chosen, 0).sum(-1)[:, past_window].mean()), 3),
            "same_for_the_4_most_recent_blocks": round(
                float(block_mass.masked_fill(~recent, 0).sum(-1)[:, past_window].mean()), 3),
        })
    return stats


@torch.no_grad()
def loss_sparse_and_dense(model: MiniMaxM3VLForCausalLM, ids: torch.Tensor) -> dict:
    def loss() -> float:
        logits = model(input_ids=ids[:, :-1]).logits
        return round(float(torch.nn.functional.cross_entropy(logits[0].float(), ids[0, 1:])), 4)

    indexers = [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]
    sparse = loss()
    topk = [ix.topk_blocks for ix in indexers]
    for ix in indexers:
        ix.topk_blocks = ids.shape[1]  # every visible block: MSA becomes dense causal attention
    dense = loss()
    for ix, k in zip(indexers, topk, strict=True):
        ix.topk_blocks = k
    return {"loss_msa": sparse, "loss_all_blocks": dense}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ASSETS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = MiniMaxM3VLForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    for name, text in samples(model, tokenizer).items():
        print(f"--- {name}:\n{text}\n")
    passage = validation_passage(tokenizer, 512)
    print(json.dumps({"passage_tokens": passage.shape[1], **loss_sparse_and_dense(model, passage)}))
    for row in selection_stats(model, passage):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
