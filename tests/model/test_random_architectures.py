"""MiniMax-M3-architecture models of random small shapes, held against transformers' MiniMaxM3 and each other.

`random_architecture(seed)` draws a config the architecture allows, off the powers of two on purpose: head dims
16-48 (24, 40, ...), rotary dims that are not powers of two, index head dims 16-48, MSA blocks of 8 to 64 tokens,
3-6 experts with top-1..3, a shared expert wider or narrower than the routed ones, hidden sizes like 40 or 56.
A random checkpoint of it is written by transformers (tests/oracle.py) and, on each:
  - the torch path's logits equal transformers' at every prompt position, and its greedy tokens (decoded step by
    step through the paged cache) are transformers' argmax when it reads them back;
  - the Triton path (compiled on a GPU, the interpreter on a CPU) gives the torch path's logits, prefill and
    decode;
  - online FP8 and MXFP4 stay within a stated distance of full precision (padding for odd widths included).
A handful of seeds run on the CPU; the `gpu` seeds add more where a GPU is.
"""

from __future__ import annotations

import random

import pytest
import torch
from oracle import ORACLE_CONFIG, PagedSequences, load_oracle, make_oracle_checkpoint

from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.model import load_model

CPU_SEEDS = [0, 1, 2, 3]
SEEDS = CPU_SEEDS + [pytest.param(s, marks=pytest.mark.gpu) for s in range(4, 16)]
# under the interpreter, two cheap odd ones: head 40 / rotary 38 / index 40 and head 24 / rotary 18 / index 24,
# both with MSA blocks of 8 (seed 0, blocks of 32 over 192 tokens, took minutes there)
TRITON_SEEDS = [5, 7] + [pytest.param(s, marks=pytest.mark.gpu) for s in range(16) if s not in (5, 7)]
DECODE_STEPS = 6
# Relative RMS error of the quantized model's logits against full precision. These random models are chaotic
# (weights large enough that the SwiGLU-OAI clamp engages everywhere), so a small weight error grows through the
# layers: measured 0.30-0.51 (fp8) and 0.40-0.59 (mxfp4) over seeds 0-5 on the CPU. The bound catches a broken
# layout (misplaced padding, a wrong scale: > 1); exactness of the padding is tests/model/test_quantize_widths.py's,
# and the error on a real model (m3-tiny) is benchmarks/quant_error.py's.
QUANT_BOUND = {"fp8": 0.7, "mxfp4": 0.8}


def random_architecture(seed: int) -> dict:
    """Overrides of ORACLE_CONFIG: one random small MiniMax-M3 the loader accepts."""
    rng = random.Random(seed)
    kv_heads = rng.choice([1, 2])
    head_dim = rng.choice([16, 24, 40, 48])
    # even rotary dims whose partial_rotary_factor gives them back exactly, most of them not powers of two
    rotary = rng.choice([d for d in range(6, head_dim + 1, 2) if int(head_dim * (d / head_dim)) == d])
    block = rng.choice([8, 16, 32, 64])
    topk = rng.randint(2, 4)
    num_layers = rng.choice([3, 4])
    sparse = [rng.random() < 0.6 for _ in range(num_layers - 1)]
    moe = [rng.random() < 0.7 for _ in range(num_layers - 1)]
    sparse[rng.randrange(num_layers - 1)] = moe[rng.randrange(num_layers - 1)] = True
    experts = rng.randint(3, 6)
    routed = rng.choice([24, 32, 40, 56, 64])
    return dict(
        hidden_size=rng.choice([40, 48, 56, 64, 72, 96]), num_hidden_layers=num_layers,
        num_attention_heads=kv_heads * rng.choice([1, 2, 4]), num_key_value_heads=kv_heads, head_dim=head_dim,
        rotary_dim=rotary, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": rotary / head_dim},
        intermediate_size=routed, shared_intermediate_size=rng.choice([w for w in (24, 32, 48, 56, 96) if w != routed]),
        dense_intermediate_size=rng.choice([40, 56, 96]), num_local_experts=experts,
        num_experts_per_tok=rng.randint(1, min(3, experts)),
        layer_types=["full_attention"] + ["minimax_m3_sparse" if s else "full_attention" for s in sparse],
        mlp_layer_types=["dense"] + ["sparse" if m else "dense" for m in moe],
        index_n_heads=kv_heads, index_head_dim=rng.choice([d for d in (16, 24, 32, 40, 48) if d >= rotary]),
        index_block_size=block, index_topk_blocks=topk, index_local_blocks=rng.randint(1, min(2, topk)),
    )


def prompt_len(overrides: dict, seed: int) -> int:
    """Long enough that MSA drops blocks (more than the top-k fit), short enough for the CPU."""
    return min(300, (overrides["index_topk_blocks"] + 2) * overrides["index_block_size"] + seed % 7)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """seed -> (its overrides, its transformers checkpoint), each written once."""
    made: dict[int, tuple[dict, object]] = {}

    def get(seed: int):
        if seed not in made:
            overrides = random_architecture(seed)
            made[seed] = overrides, make_oracle_checkpoint(tmp_path_factory.mktemp(f"arch{seed}"), seed=seed,
                                                           **overrides)
        return made[seed]

    return get


def ids_for(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pool(model, device: torch.device, pages: int = 24) -> KVPool:
    return KVPool(KVCacheSpec.for_model(model.config, pages, kv_dtype="fp32", index_dtype="fp32",
                                        model_dtype=model.dtype, device=device))


def prefill_and_decode(model, device: torch.device, ids: list[int], steps: int = DECODE_STEPS,
                       forced: list[int] | None = None) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """(prefill logits [n, V], greedy tokens, decode logits [steps, V]): the prompt in one prefill, then one
    token per step through the paged cache, the argmax fed back (or the `forced` tokens)."""
    seqs = PagedSequences(pool(model, device))
    prefill = seqs.step(model, {"s": ids})["s"]
    tokens, decode = [], []
    nxt = int(prefill[-1].argmax())
    for i in range(steps):
        token = forced[i] if forced is not None else nxt
        tokens.append(token)
        decode.append(seqs.step(model, {"s": [token]})["s"][0])
        nxt = int(decode[-1].argmax())
    return prefill, tokens, torch.stack(decode)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst position's max |error| over that position's max |logit|."""
    return ((out - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()


@torch.no_grad()
def transformers_logits(path, ids: list[int]) -> torch.Tensor:
    return load_oracle(path)(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("seed", range(40))
def test_the_generator_gives_configs_the_loader_accepts(seed, tmp_path):
    from m3sdk.model.config import ModelConfig

    o = random_architecture(seed)
    config = ModelConfig.from_dict({**ORACLE_CONFIG, **o, "architectures": ["MiniMaxM3VLForCausalLM"]})
    assert config.rotary_dim == o["rotary_dim"] and config.index_head_dim == o["index_head_dim"]
    assert config.shared_intermediate_size != config.moe_intermediate_size
    assert config.sparse_layers and config.moe_layers


def test_the_generator_reaches_odd_shapes():
    drawn = [random_architecture(s) for s in range(16)]
    assert {24, 40} <= {d["head_dim"] for d in drawn} and {8, 64} <= {d["index_block_size"] for d in drawn}
    assert any(d["rotary_dim"] & (d["rotary_dim"] - 1) for d in drawn)  # a rotary dim not a power of two
    assert any(d["index_head_dim"] == 24 for d in drawn)
    assert {3, 6} <= {d["num_local_experts"] for d in drawn}


@pytest.mark.parametrize("seed", SEEDS)
def test_torch_path_matches_transformers(checkpoints, device, ieee_fp32, seed):
    overrides, path = checkpoints(seed)
    model = load_model(path, device, torch.float32, "torch")
    ids = ids_for(prompt_len(overrides, seed), seed)
    prefill, tokens, decode = prefill_and_decode(model, device, ids)
    ref = transformers_logits(path, ids + tokens)
    assert rel_err(prefill, ref[: len(ids)]) < 1e-4
    assert rel_err(decode[:-1], ref[len(ids) : -1]) < 1e-4
    # greedy: each token we chose is transformers' argmax at that position
    assert ref[len(ids) - 1 : -1].argmax(-1).tolist() == tokens


@pytest.mark.parametrize("seed", TRITON_SEEDS)
def test_triton_path_matches_torch_path(checkpoints, device, ieee_fp32, few_prefill_splits, seed):
    overrides, path = checkpoints(seed)
    ids = ids_for(prompt_len(overrides, seed), seed)
    torch_out = prefill_and_decode(load_model(path, device, torch.float32, "torch"), device, ids)
    triton_out = prefill_and_decode(load_model(path, device, torch.float32, "triton"), device, ids,
                                    forced=torch_out[1])
    assert rel_err(triton_out[0], torch_out[0]) < 1e-4
    assert rel_err(triton_out[2], torch_out[2]) < 1e-4
    assert triton_out[2].argmax(-1)[:-1].tolist() == torch_out[1][1:]


@pytest.mark.parametrize("quantization", ["fp8", "mxfp4"])
@pytest.mark.parametrize("seed", SEEDS)
def test_quantized_within_bound(checkpoints, device, seed, quantization):
    """Every width quantizes (odd ones padded at load); the error against full precision stays bounded. On a GPU
    in bf16 through the FP8 / MXFP4 kernels, on a CPU in float32 through their references."""
    overrides, path = checkpoints(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "triton" if device.type == "cuda" else "torch"
    ids = ids_for(prompt_len(overrides, seed), seed)
    full = prefill_and_decode(load_model(path, device, dtype, backend), device, ids)
    quantized = prefill_and_decode(load_model(path, device, dtype, backend, quantization=quantization), device,
                                   ids, forced=full[1])
    got, want = torch.cat((quantized[0], quantized[2])), torch.cat((full[0], full[2]))
    assert got.isfinite().all()
    assert ((got - want).norm() / want.norm()).item() < QUANT_BOUND[quantization]
