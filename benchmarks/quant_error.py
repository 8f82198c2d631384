"""Error of the online-quantized model against full precision on the bundled m3-tiny (or --model).

    python benchmarks/quant_error.py [--model m3-tiny] [--device auto|cpu|cuda] [--prompts 16] [--prompt-len 64]
                                     [--new-tokens 64]

Prompts are passages of the model's own corpus (data/austen.txt.xz) at evenly spaced offsets. The full-precision
model continues each greedily; then every model (none / fp8 / mxfp4, `load_model(..., quantization=...)`) reads
prompt + continuation in one prefill, and at each continuation position we compare it with the full model:
  - greedy agreement: its argmax is the full model's greedy token;
  - logprob error: |its log-probability of that token - the full model's| (mean and max over positions);
  - KL: mean KL(full || quantized) of the next-token distributions.
The full model is float32 on a CPU (the kernels' references), bf16 on a GPU (the Triton kernels, triton attention);
its own row is the control (zero by construction). Prints a table.
"""

from __future__ import annotations

import argparse
import lzma
from pathlib import Path

import torch

from m3sdk.attention.base import PAGE_SIZE, AttentionMetadata
from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.config import EngineConfig
from m3sdk.core.resolved import resolve
from m3sdk.model import load_model
from m3sdk.tokenizer import Tokenizer

CORPUS = Path(__file__).resolve().parents[1] / "data" / "austen.txt.xz"


def pool(model, tokens: int, device: torch.device) -> tuple[KVPool, list[int]]:
    """A cache for `tokens` tokens of `model` (its dtype, or fp32 KV in float32) and its page table."""
    pages = -(-tokens // PAGE_SIZE)
    kv_dtype = "bf16" if model.dtype == torch.bfloat16 else "fp32"
    spec = KVCacheSpec.for_model(model.config, pages, kv_dtype=kv_dtype, index_dtype=kv_dtype, model_dtype=model.dtype,
                                 device=device)
    return KVPool(spec), list(range(pages))


@torch.no_grad()
def step(model, kv: KVPool, table: list[int], new: list[int], context: int, device: torch.device) -> torch.Tensor:
    """float32 logits [len(new), vocab] of `new`, the last tokens of a `context`-token sequence."""
    meta = AttentionMetadata.build([len(new)], [context], [table], device=device)
    _, out = model(torch.tensor(new, device=device), meta, kv, torch.arange(len(new), device=device))
    return out.float().cpu()


def logits(model, ids: list[int], device: torch.device) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one prefill of `ids`."""
    kv, table = pool(model, len(ids), device)
    return step(model, kv, table, ids, len(ids), device)


def greedy(model, prompt: list[int], n: int, device: torch.device) -> list[int]:
    """n greedy tokens after `prompt`: one prefill, then one decode step per token through the paged cache."""
    kv, table = pool(model, len(prompt) + n, device)
    out = [int(step(model, kv, table, prompt, len(prompt), device)[-1].argmax())]
    while len(out) < n:
        out.append(int(step(model, kv, table, out[-1:], len(prompt) + len(out), device)[-1].argmax()))
    return out


def prompts(tokenizer: Tokenizer, count: int, length: int) -> list[list[int]]:
    text = lzma.decompress(CORPUS.read_bytes()).decode()
    step = len(text) // (count + 1)
    out = []
    for i in range(count):
        ids = tokenizer.encode(text[(i + 1) * step : (i + 1) * step + 8 * length], add_special_tokens=False)
        out.append(ids[:length])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="m3-tiny")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    resolved = resolve(EngineConfig(model=args.model, device=args.device))
    device, dtype, backend, path = resolved.device, resolved.dtype, resolved.attention_backend, resolved.model_path
    tokenizer = Tokenizer.from_pretrained(path)
    full = load_model(path, device, dtype, backend)
    seqs = [(p, greedy(full, p, args.new_tokens, device)) for p in prompts(tokenizer, args.prompts, args.prompt_len)]
    reference = [logits(full, p + c, device)[len(p) - 1 : -1].log_softmax(-1) for p, c in seqs]
    del full
    print(f"{path.name} on {device} ({str(dtype).removeprefix('torch.')}, {backend} attention): {len(seqs)} prompts "
          f"of {args.prompt_len} tokens, {args.new_tokens} greedy tokens each, teacher-forced")
    print("| quantization | greedy agreement | mean |dlogprob| | max |dlogprob| | mean KL |")
    print("|---|---|---|---|---|")
    for quantization in ("none", "fp8", "mxfp4"):
        model = load_model(path, device, dtype, backend, quantization=quantization)
        agree = total = 0
        errors, kls = [], []
        for (p, c), ref in zip(seqs, reference, strict=True):
            got = logits(model, p + c, device)[len(p) - 1 : -1].log_softmax(-1)
            tokens = torch.tensor(c)[:, None]
            agree += int((got.argmax(-1) == tokens[:, 0]).sum())
            total += len(c)
            errors.append((got.gather(1, tokens) - ref.gather(1, tokens)).abs().squeeze(1))
            kls.append((ref.exp() * (ref - got)).sum(-1))
        err, kl = torch.cat(errors), torch.cat(kls)
        print(f"| {quantization} | {agree / total:.3f} ({agree}/{total}) | {err.mean():.4f} | {err.max():.4f} | "
              f"{kl.mean():.5f} |")
        del model


if __name__ == "__main__":
    main()
