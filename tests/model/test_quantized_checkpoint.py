"""Pre-quantized checkpoints in the published layouts (docs/kernels.md), written from the oracle's weights with the
reference quantizers: MiniMax's MXFP8 (every linear but the router and lm_head: `weight` F8_E4M3 +
`weight_scale_inv` E8M0 [out, in / 32]) and AMD Quark's MXFP4 (routed and shared experts: `weight` U8, two E2M1 per
byte + `weight_scale` E8M0). Loaded as stored, they give the logits of the same weights dequantized (tight), and
stay near the unquantized model (loose)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from oracle import PagedSequences
from safetensors.torch import load_file, save_file

from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.errors import CheckpointError
from m3sdk.model import load_model
from m3sdk.model.quantize import Fp8Linear, QuantizedMoE
from m3sdk_kernels import formats

LAYER = r"^language_model\.model\.layers\.\d+\."
EXPERTS = LAYER + r"block_sparse_moe\.(experts\.\d+\.w[123]|shared_experts\.(gate|up|down)_proj)\.weight$"
# MiniMax's ignored_layers keep lm_head, embeddings and the router in bf16; norms are not linears
MXFP8_LINEARS = LAYER + r"(?!.*norm\.weight$)(?!block_sparse_moe\.gate\.weight$).*\.weight$"
FORMATS = {
    "mxfp8": dict(pattern=MXFP8_LINEARS, scale="weight_scale_inv", quantize=formats.quantize_mxfp8,
                  dequantize=formats.dequantize_mxfp8,
                  config={"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
                          "ignored_layers": ["lm_head", "model.embed_tokens", "vision_tower"]}),
    "mxfp4": dict(pattern=EXPERTS, scale="weight_scale", quantize=formats.quantize_mxfp4,
                  dequantize=formats.dequantize_mxfp4,
                  config={"quant_method": "quark", "global_quant_config": {
                      "weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0",
                                 "is_dynamic": False},
                      "input_tensors": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32,
                                        "scale_format": "e8m0", "is_dynamic": True}},
                          "layer_quant_config": {}, "exclude": ["*lm_head", "*block_sparse_moe.gate", "*self_attn*",
                                                               "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj"]}),
}


def write_quantized(src: Path, dst: Path, fmt: str, dequantized: bool = False,
                    scale_dtype: torch.dtype = torch.uint8) -> Path:
    """The minimax-layout checkpoint `src` with the linears `fmt` quantizes stored in its layout (same shards, the
    index updated); `dequantized`: the same rounded weights stored back as float32, with no quantization_config."""
    f = FORMATS[fmt]
    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        out = {}
        for name, t in load_file(src / file).items():
            if re.match(f["pattern"], name):
                q, scale = f["quantize"](t)
                if dequantized:
                    out[name] = f["dequantize"](q, scale)
                else:
                    out[name], out[name[: -len("weight")] + f["scale"]] = q, scale.view(scale_dtype)
            else:
                out[name] = t
        save_file(out, dst / file)
        weight_map.update(dict.fromkeys(out, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    if not dequantized:
        config["quantization_config"] = f["config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def checkpoints(oracle_checkpoint_minimax, tmp_path_factory):
    """{fmt: (quantized checkpoint, its dequantized twin)}"""
    root = tmp_path_factory.mktemp("quantized")
    return {fmt: (write_quantized(oracle_checkpoint_minimax, root / fmt, fmt),
                  write_quantized(oracle_checkpoint_minimax, root / f"{fmt}-dequantized", fmt, dequantized=True))
            for fmt in FORMATS}


SEQS = {f"s{n}": torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (20, 64, 100)}  # below and above the point where MSA drops blocks (24 tokens)


def logits(model) -> torch.Tensor:
    kv = KVPool(KVCacheSpec.for_model(model.config, 40, kv_dtype="fp32", index_dtype="fp32",
                                      model_dtype=model.dtype))
    out = PagedSequences(kv).step(model, SEQS)
    return torch.cat([out[k].float() for k in SEQS])


def rel_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_loaded_as_stored_equals_dequantized_weights(checkpoints, oracle_checkpoint_minimax, fmt):
    path, twin = checkpoints[fmt]
    model = load_model(path, dtype=torch.float32)
    moe = model.layers[1].mlp
    assert model.config.quant_format == fmt and isinstance(moe, QuantizedMoE) and moe.fmt == fmt
    # the experts hold the checkpoint's bytes: routed expert 5's up rows, the shared expert's down (row E = 8)
    pre = "language_model.model.layers.1.block_sparse_moe."
    files = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {n: load_file(path / files[n])[n] for n in (f"{pre}experts.5.w3.weight",
                                                           f"{pre}shared_experts.down_proj.weight")}
    assert torch.equal(moe.gate_up[5, 32:].view(torch.uint8), tensors[f"{pre}experts.5.w3.weight"].view(torch.uint8))
    assert torch.equal(moe.down[8].view(torch.uint8),
                       tensors[f"{pre}shared_experts.down_proj.weight"].view(torch.uint8))
    got, same_weights = logits(model), logits(load_model(twin, dtype=torch.float32))
    unquantized = logits(load_model(oracle_checkpoint_minimax, dtype=torch.float32))
    tight, loose = rel_error(got, same_weights), rel_error(got, unquantized)
    agree = (got.argmax(-1) == unquantized.argmax(-1)).float().mean().item()
    print(f"\n{fmt}: vs dequantized weights max {tight.max():.2e}; vs unquantized median {loose.median():.3f} "
          f"max {loose.max():.3f}, greedy agreement {agree:.3f}")
    # same weights: only the order of fp32 sums may differ (measured: identical)
    assert tight.max() < 1e-5
    # measured (docs/kernels.md): mxfp8 median 0.174, agreement 0.620; mxfp4 experts 0.293, 0.533
    assert loose.median() < {"mxfp8": 0.25, "mxfp4": 0.4}[fmt] and agree > {"mxfp8": 0.5, "mxfp4": 0.4}[fmt]


def test_dense_mx_weights_dequantize_exactly_into_bf16(checkpoints):
    path, twin = checkpoints["mxfp8"]
    got, want = load_model(path, dtype=torch.bfloat16), load_model(twin, dtype=torch.float32)
    for name in ("layers.2.self_attn.qkv_proj.weight", "layers.0.mlp.down_proj.weight", "layers.3.self_attn.o_proj"
                 ".weight"):
        assert torch.equal(got.get_parameter(name).float(), want.get_parameter(name))
    assert torch.equal(got.layers[1].mlp.router_weight, want.layers[1].mlp.router_weight)  # stored float: as is


def test_online_quantization_on_top(checkpoints):
    mxfp8, mxfp4 = checkpoints["mxfp8"][0], checkpoints["mxfp4"][0]
    as_stored = load_model(mxfp4, dtype=torch.float32)
    for path, fmt in ((mxfp8, "mxfp8"), (mxfp4, "mxfp4")):
        model = load_model(path, dtype=torch.float32, quantization="fp8" if fmt == "mxfp8" else "mxfp4")
        assert isinstance(model.layers[1].self_attn.qkv_proj, Fp8Linear)
        assert model.layers[1].mlp.fmt == fmt  # the stored experts, not requantized
    assert torch.equal(model.layers[2].mlp.gate_up, as_stored.layers[2].mlp.gate_up)
    with pytest.raises(ValueError, match="would requantize the checkpoint's mxfp8 experts"):
        load_model(mxfp8, quantization="mxfp4")


def test_e8m0_typed_scales_read_as_bytes(checkpoints, oracle_checkpoint_minimax, tmp_path):
    typed = load_model(write_quantized(oracle_checkpoint_minimax, tmp_path / "e8m0", "mxfp8",
                                       scale_dtype=torch.float8_e8m0fnu), dtype=torch.float32)
    plain = load_model(checkpoints["mxfp8"][0], dtype=torch.float32)
    for (name, a), (_, b) in zip(typed.state_dict().items(), plain.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def edited(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` with edit(tensors) applied to every shard (and the index to match)."""
    shutil.copytree(src, dst)
    weight_map = {}
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        edit(tensors)
        save_file(tensors, file)
        weight_map.update(dict.fromkeys(tensors, file.name))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def test_bad_quantized_checkpoints(checkpoints, tmp_path):
    path = checkpoints["mxfp8"][0]
    pre = "language_model.model.layers."

    def bad_shapes(t):
        for name in list(t):
            if name == f"{pre}0.self_attn.o_proj.weight_scale_inv":
                t[name] = t[name][:, :1].contiguous()
            if name == f"{pre}0.mlp.down_proj.weight":
                t[name] = t[name].float()

    with pytest.raises(CheckpointError) as e:
        load_model(edited(path, tmp_path / "a", bad_shapes))
    msg = str(e.value)
    assert "o_proj.weight_scale_inv: [64, 1], expected [64, 2]" in msg
    assert "0.mlp.down_proj.weight: F32, expected F8_E4M3" in msg

    def float_expert(t):  # one routed expert's down stored as floats: the layer cannot be one MXFP8 stack
        name = f"{pre}3.block_sparse_moe.experts.6.w2.weight"
        if name in t:
            t[name] = formats.dequantize_mxfp8(t[name], t.pop(name + "_scale_inv"))

    with pytest.raises(CheckpointError, match=r"layer 3: 26 of its 27 expert tensors"):
        load_model(edited(path, tmp_path / "b", float_expert))


def test_tensor_parallel_refuses_quantized_checkpoints(checkpoints):
    from m3sdk.parallel.sharding import Shard, load_shard

    with pytest.raises(CheckpointError, match="tensor parallel loading of mxfp4 checkpoints"):
        load_shard(checkpoints["mxfp4"][0], Shard(0, 2), "cpu", torch.float32, "torch")
