"""Image prompts through an engine with `quantization="fp8"`: with `vision_quantization="fp8"` the vision encoder's
linears are FP8 too, generation is finite and deterministic; by default ("auto", as "none") the tower stays in the
model dtype, bit for bit the unquantized encoder's."""

import math

import pytest
import torch
from oracle import make_vl_checkpoint, random_png

from m3sdk import Engine, EngineConfig
from m3sdk.model.image_processor import ImageProcessor
from m3sdk.model.quantize import Fp8Linear
from m3sdk.model.vision_loader import load_vision_encoder

pytest.importorskip("PIL.Image")
IMG = 250  # tests/oracle ORACLE_IMAGE_TOKEN
PROMPT = [5, 6, 7, IMG, 40, 41, IMG, 42]
A, B = random_png(100, 150, 0), random_png(61, 90, 1)  # 20 and 6 image tokens


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return make_vl_checkpoint(tmp_path_factory.mktemp("vl_fp8_engine"))


def engine(checkpoint, **overrides) -> Engine:
    return Engine(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=64, kv_cache_memory=1 << 22, enable_prefix_caching=False, **overrides)


def encode(encoder, images: list[bytes]) -> torch.Tensor:
    proc = ImageProcessor()
    done = [proc.process(i) for i in images]
    grid = [d.grid_thw for d in done]
    return encoder(proc.patches([d.pixels for d in done], grid, encoder.dtype), grid)


async def run(e: Engine) -> tuple[list[int], list[float]]:
    c = await e.generate({"prompt_token_ids": PROMPT, "images": [A, B]}, max_tokens=8, temperature=0,
                         ignore_eos=True, logprobs=0)
    return c.token_ids, [t.logprob for t in c.logprobs]


def test_vision_quantization_is_validated():
    with pytest.raises(ValueError, match="vision_quantization must be one of"):
        EngineConfig(vision_quantization="int8")


async def test_fp8_engine_with_images(vl_checkpoint):
    outs = []
    for _ in range(2):
        async with engine(vl_checkpoint, quantization="fp8", vision_quantization="fp8") as e:
            encoder = e._running_core().images.encoder
            assert isinstance(encoder.layers[0].mlp.fc1, Fp8Linear)
            assert isinstance(encoder.projector.merge_linear_2, Fp8Linear)
            assert "linears fp8" in e.describe()["vision"]
            # the engine's tower is the loader's FP8 one
            assert torch.equal(encode(encoder, [A, B]),
                               encode(load_vision_encoder(vl_checkpoint, dtype=torch.float32, quantization="fp8"),
                                      [A, B]))
            outs.append(await run(e))
    tokens, logprobs = outs[0]
    assert len(tokens) == 8 and all(0 <= t < 256 for t in tokens)
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
    assert outs[0] == outs[1]  # two engines, the same tokens and logprobs


@pytest.mark.parametrize("vision_quantization", ["auto", "none"])
async def test_the_default_and_none_keep_the_loaded_tower(vl_checkpoint, vision_quantization):
    plain = load_vision_encoder(vl_checkpoint, dtype=torch.float32)
    async with engine(vl_checkpoint, quantization="fp8", vision_quantization=vision_quantization) as e:
        encoder = e._running_core().images.encoder
        assert type(encoder.layers[0].mlp.fc1) is torch.nn.Linear
        assert "linears float32" in e.describe()["vision"]
        assert torch.equal(encode(encoder, [A, B]), encode(plain, [A, B]))
        # the text model is FP8 all the same
        assert isinstance(e._running_core().runner.model.layers[0].self_attn.o_proj, Fp8Linear)
        tokens, logprobs = await run(e)
    assert len(tokens) == 8 and all(math.isfinite(lp) for lp in logprobs)


def test_vision_quantization_from_the_cli(vl_checkpoint):
    from m3sdk.cli import _engine_config, build_parser

    def config(*flags: str) -> EngineConfig:
        return _engine_config(build_parser().parse_args(["info", "--model", str(vl_checkpoint), *flags]))

    assert config("--quantization", "fp8").vision_encoder_quantization() == "none"
    chosen = config("--vision-quantization", "fp8")
    assert (chosen.quantization, chosen.vision_encoder_quantization()) == ("none", "fp8")
