"""The vision encoder with FP8 W8A8 linears (`load_vision_encoder(..., quantization="fp8")`, the CPU reference GEMMs)
held against the same checkpoint's encoder in the loaded dtype, on the tiny VL checkpoint and odd patch grids.

The bound: e4m3 keeps 3 mantissa bits, so rounding a weight or an activation moves it by up to 2^-4 of itself
(uniform, ~3.6 % RMS); a W8A8 linear's output on random data is then off by ~5 % RMS of its own size. Through the
tiny tower (2 layers: 6 FP8 linears on the residual path, 4 more in the projector) the normalized error of each
output embedding, |fp8 - ref| / |ref|, measured 3.1 % on average and 3.8 % (float32) / 4.7 % (bfloat16) at most
(cosine >= 0.9988). The test allows 6 % (and cosine >= 0.998, i.e. |a - b| / |b| ~ sqrt(2 (1 - cos)) <= 6.3 %),
1.3x the measured worst case (the CPU references are deterministic); one linear's scales off by 2x, even the last MLP's
fc2 whose output the residual stream dilutes (7.7 %), exceeds it (checked below)."""

from __future__ import annotations

import pytest
import torch
from oracle import make_vl_checkpoint

from m3sdk.model.image_processor import ImageProcessor
from m3sdk.model.quantize import Fp8Linear
from m3sdk.model.vision_loader import load_vision_encoder

MAX_REL = 0.06
MIN_COS = 0.998
# (height, width) -> patch grids 4x10, 6x4, 2x2 (a 1x1 image: one merge window), 4x8, 14x4: patch counts 40, 24, 4,
# 32, 56, each image a different one and the batch's total (156) no power of two
SIZES = [(61, 150), (97, 43), (1, 1), (28, 84), (200, 60)]


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return make_vl_checkpoint(tmp_path_factory.mktemp("vl_fp8"))


@pytest.fixture(scope="module")
def images():
    proc = ImageProcessor()
    out = [proc.process_array(torch.randint(0, 256, (3, h, w), dtype=torch.uint8,
                                            generator=torch.Generator().manual_seed(k)))
           for k, (h, w) in enumerate(SIZES)]
    return proc, out


def errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(lowest cosine similarity, highest normalized error) over the output embeddings (rows)."""
    got, want = got.float(), want.float()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    return cos.min().item(), rel.max().item()


def linears(encoder) -> list[torch.nn.Module]:
    """Every linear of the tower and the projector (q|k|v one packed linear in every dtype)."""
    out = []
    for layer in encoder.layers:
        a, m = layer.self_attn, layer.mlp
        out += [a.qkv_proj, a.out_proj, m.fc1, m.fc2]
    p = encoder.projector
    return out + [p.linear_1, p.linear_2, p.merge_linear_1, p.merge_linear_2]


def biases(encoder) -> list[torch.Tensor]:
    """The loaded encoder's biases, in the order of `linears`."""
    return [m.bias.detach() for m in linears(encoder)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_encoder_is_close_to_the_loaded_dtype(vl_checkpoint, images, dtype):
    proc, done = images
    grid = [i.grid_thw for i in done]
    assert len({t * h * w for t, h, w in grid}) == len(grid)
    ref = load_vision_encoder(vl_checkpoint, dtype=dtype)
    fp8 = load_vision_encoder(vl_checkpoint, dtype=dtype, quantization="fp8")
    # every linear of the tower and the projector is FP8, with its bias as loaded; the rest is as loaded
    for q, bias in zip(linears(fp8), biases(ref), strict=True):
        assert isinstance(q, Fp8Linear) and q.weight.dtype == torch.float8_e4m3fn and q.out_dtype == dtype
        assert q.weight.data_ptr() % 16 == 0 and q.weight.stride(0) % 16 == 0  # rows 16 bytes apart (K = 40: 48)
        assert torch.equal(q.bias, bias)
    assert fp8.dtype == dtype and fp8.layers[0].layer_norm1.weight.dtype == dtype
    torch.testing.assert_close(fp8.embeddings.proj.weight, ref.embeddings.proj.weight, rtol=0, atol=0)

    pixels = proc.patches([i.pixels for i in done], grid, dtype)
    got, want = fp8(pixels, grid), ref(pixels, grid)
    assert got.shape == want.shape == (sum(i.num_tokens for i in done), 64) and got.dtype == dtype
    assert torch.isfinite(got).all()
    assert not torch.equal(got, want)  # quantized indeed
    cos, rel = errors(got, want)
    assert cos >= MIN_COS and rel <= MAX_REL, (cos, rel)


def test_fp8_rows_do_not_depend_on_the_batch(vl_checkpoint, images):
    """Activations are quantized per token: an image's embeddings are the same alone as in a batch of others (a
    scale shared by the batch's rows would move them)."""
    proc, done = images
    fp8 = load_vision_encoder(vl_checkpoint, dtype=torch.float32, quantization="fp8")
    grid = [i.grid_thw for i in done]
    batched = fp8(proc.patches([i.pixels for i in done], grid), grid)
    alone = torch.cat([fp8(proc.patches([i.pixels], [i.grid_thw]), [i.grid_thw]) for i in done])
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-6)


def test_the_bound_catches_a_wrong_scale(vl_checkpoint, images):
    """The tolerance is tight enough to fail a real bug: the last MLP's output-channel scales doubled."""
    proc, done = images
    grid = [i.grid_thw for i in done]
    pixels = proc.patches([i.pixels for i in done], grid)
    ref = load_vision_encoder(vl_checkpoint, dtype=torch.float32)
    fp8 = load_vision_encoder(vl_checkpoint, dtype=torch.float32, quantization="fp8")
    fp8.layers[1].mlp.fc2.weight_scale.mul_(2)
    cos, rel = errors(fp8(pixels, grid), ref(pixels, grid))
    assert not (cos >= MIN_COS and rel <= MAX_REL), (cos, rel)


def test_quantization_none_and_unknown(vl_checkpoint):
    plain = load_vision_encoder(vl_checkpoint, dtype=torch.float32, quantization="none")
    assert len(linears(plain)) == 2 * 4 + 4 and all(type(m) is torch.nn.Linear for m in linears(plain))
    for q in ("fp8_experts", "mxfp4"):  # the tower has no experts: every other choice gives the FP8 linears
        assert all(isinstance(m, Fp8Linear) for m in linears(load_vision_encoder(vl_checkpoint, quantization=q)))
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_vision_encoder(vl_checkpoint, quantization="int4")


@pytest.mark.gpu
def test_fp8_encoder_on_the_gpu(vl_checkpoint, images):
    """The Triton path (FP8 GEMMs with the bias in the epilogue, GELU fused with the quantization), bf16: within the
    same bound of the bf16 encoder on the GPU, and close to the CPU references' FP8 encoder."""
    proc, done = images
    grid = [i.grid_thw for i in done]
    pixels = proc.patches([i.pixels for i in done], grid, torch.bfloat16)
    ref = load_vision_encoder(vl_checkpoint, "cuda", torch.bfloat16)
    fp8 = load_vision_encoder(vl_checkpoint, "cuda", torch.bfloat16, quantization="fp8")
    got = fp8(pixels.cuda(), grid)
    assert torch.isfinite(got).all()
    cos, rel = errors(got, ref(pixels.cuda(), grid))
    assert cos >= MIN_COS and rel <= MAX_REL, (cos, rel)
    cos, rel = errors(got.cpu(), load_vision_encoder(vl_checkpoint, dtype=torch.bfloat16, quantization="fp8")(
        pixels, grid))
    assert cos >= 0.999 and rel <= 0.04, (cos, rel)


def test_encoder_warm_up_meets_every_gemm_table(vl_checkpoint):
    """The engine's warm-up images (GPU engines) run through the FP8 encoder; their patch counts (the tower's rows)
    and merge windows (the projector's second MLP's rows) each reach the decode (<= 16), mid (<= 256) and prefill
    tile tables of the FP8 GEMM."""
    from m3sdk.core.warmup import ENCODER_WARM_UP_GRIDS, warm_up_encoder

    rows = [[t * h * w // d for t, h, w in ENCODER_WARM_UP_GRIDS] for d in (1, 4)]
    for counts in rows:
        assert [c <= 16 for c in counts] == [True, False, False] and [c <= 256 for c in counts] == [True, True, False]
    warm_up_encoder(load_vision_encoder(vl_checkpoint, dtype=torch.float32, quantization="fp8"))
