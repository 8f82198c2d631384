"""The vision encoder and the image preprocessing, held against transformers' MiniMax-M3 VL model."""

from __future__ import annotations

import base64
import io
import shutil
from importlib.metadata import version as _version

import pytest
import torch
from oracle import ORACLE_IMAGE_TOKEN, image_features, oracle_vl_model
from safetensors.torch import save_file

from m3sdk.errors import CheckpointError, InvalidRequestError
from m3sdk.model.image_processor import ImageProcessor, decode_image
from m3sdk.model.vision_loader import load_vision_encoder

PIL = pytest.importorskip("PIL.Image")

# transformers before 5.24 rotated the vision tower's whole head dim by a 2D (height, width) RoPE; MiniMax-M3's
# tower uses the partial 3D (temporal, height, width) RoPE that 5.24 implements, the one the encoder follows.
_THREE_D_ROPE = tuple(int(v) for v in _version("transformers").split(".")[:2]) >= (5, 24)


@pytest.fixture(scope="module")
def vl_checkpoints(tmp_path_factory):
    """The same random VL model in both layouts: minimax (transformers' save_pretrained writes the published names)
    and hf (the module names of transformers' model)."""
    model = oracle_vl_model()
    minimax = tmp_path_factory.mktemp("vl_minimax")
    model.save_pretrained(minimax)
    hf = tmp_path_factory.mktemp("vl_hf")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, hf / "model.safetensors")
    shutil.copy(minimax / "config.json", hf / "config.json")
    return model, {"minimax": minimax, "hf": hf}


def _random_image(h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.skipif(not _THREE_D_ROPE, reason="this transformers' vision RoPE is the older 2D one")
@pytest.mark.parametrize("layout", ["hf", "minimax"])
def test_encoder_matches_transformers(vl_checkpoints, layout):
    model, paths = vl_checkpoints
    encoder = load_vision_encoder(paths[layout], dtype=torch.float32)
    assert encoder is not None and encoder.config.image_token_id == ORACLE_IMAGE_TOKEN
    for ours, theirs in zip(encoder.layers, model.model.vision_tower.layers, strict=True):
        # the packed projection's rows are the checkpoint's q | k | v, weights and biases
        for what in ("weight", "bias"):
            parts = [getattr(getattr(theirs.self_attn, f"{n}_proj"), what) for n in "qkv"]
            assert torch.equal(getattr(ours.self_attn.qkv_proj, what), torch.cat(parts))
    proc = ImageProcessor()
    # two sizes that need resizing (odd sides, non-square), so grids and merge windows differ per image
    images = [proc.process_array(_random_image(61, 150, 0)), proc.process_array(_random_image(97, 43, 1))]
    assert images[0].grid_thw != images[1].grid_thw
    grid = [i.grid_thw for i in images]
    pixels = proc.patches([i.pixels for i in images], grid)
    ours = encoder(pixels, grid)
    with torch.no_grad():
        ref = image_features(model, pixels, torch.tensor(grid))
    assert ours.shape == (sum(i.num_tokens for i in images), 64)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not _THREE_D_ROPE, reason="this transformers' vision RoPE is the older 2D one")
def test_encoder_on_the_gpu_matches_transformers(vl_checkpoints):
    """The GPU path (q/k/v split and rotated by m3sdk_kernels.vision_rope, compiled; SDPA's GPU kernels) in fp32
    against transformers on the CPU, two images of different grids."""
    model, paths = vl_checkpoints
    encoder = load_vision_encoder(paths["hf"], "cuda", torch.float32)
    proc = ImageProcessor()
    images = [proc.process_array(_random_image(61, 150, 0)), proc.process_array(_random_image(97, 43, 1))]
    grid = [i.grid_thw for i in images]
    pixels = proc.patches([i.pixels for i in images], grid)
    with torch.no_grad():
        ref = image_features(model, pixels, torch.tensor(grid))
    torch.testing.assert_close(encoder(pixels.cuda(), grid).cpu(), ref, rtol=1e-3, atol=1e-3)
    alone = encoder(proc.patches([images[1].pixels], grid[1:]).cuda(), grid[1:]).cpu()
    torch.testing.assert_close(alone, ref[-images[1].num_tokens:], rtol=1e-3, atol=1e-3)


def test_text_only_checkpoint_has_no_encoder(tmp_path):
    from oracle import make_oracle_checkpoint

    assert load_vision_encoder(make_oracle_checkpoint(tmp_path / "hf", layout="hf")) is None
    # a stray vision tensor without a vision_config: text only
    assert load_vision_encoder(make_oracle_checkpoint(tmp_path / "minimax", layout="minimax")) is None


def test_vl_checkpoint_without_vision_tensors_has_no_encoder(vl_checkpoints, tmp_path):
    from safetensors import safe_open

    _, paths = vl_checkpoints
    with safe_open(paths["minimax"] / "model.safetensors", "pt") as f:
        text = {k: f.get_tensor(k) for k in f.keys() if k.startswith("language_model.")}
    save_file(text, tmp_path / "model.safetensors")
    shutil.copy(paths["minimax"] / "config.json", tmp_path / "config.json")
    assert load_vision_encoder(tmp_path) is None


@pytest.mark.parametrize("left_out", ["pre_layrnorm", "layers.1.self_attn.k_proj.bias"])
def test_partial_vision_weights_are_a_checkpoint_error(vl_checkpoints, tmp_path, left_out):
    from safetensors import safe_open

    _, paths = vl_checkpoints
    with safe_open(paths["minimax"] / "model.safetensors", "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if left_out not in k}
    save_file(kept, tmp_path / "model.safetensors")
    shutil.copy(paths["minimax"] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=f"incomplete vision encoder: missing .*{left_out}"):
        load_vision_encoder(tmp_path)


@pytest.mark.parametrize("size", [(61, 150), (97, 43), (1000, 30), (20, 20), (900, 1400)])
def test_resize_keeps_multiples_and_pixel_range(size):
    proc = ImageProcessor(min_pixels=3136, max_pixels=200_000)
    h, w = proc.target_size(*size)
    assert h % 28 == 0 and w % 28 == 0
    assert 3136 <= h * w <= 200_000
    assert abs(h / w - size[0] / size[1]) / (size[0] / size[1]) < 0.35
    out = proc.process_array(_random_image(*size, 2))
    assert out.grid_thw == (1, h // 14, w // 14)
    assert out.pixels.dtype == torch.uint8 and out.pixels.shape == (3, *size)  # as decoded: 3 bytes a pixel
    assert proc.patches([out.pixels], [out.grid_thw]).shape == (h * w // 196, 3 * 2 * 14 * 14)
    assert out.num_tokens == h * w // 784


def _reference_patches(proc: ImageProcessor, rgb: torch.Tensor) -> torch.Tensor:
    """The plain single-image CPU preprocessing the device path must reproduce bit for bit: two bicubic antialiased
    float passes (width, then height) each rounded and clamped to uint8 values, rescale, normalize with tensors of
    mean/std, patchify merge-window-major, repeat over the temporal patch."""
    import torch.nn.functional as F

    height, width = rgb.shape[-2:]
    h, w = proc.target_size(height, width)
    x = rgb[None].float()
    if (h, w) != (height, width):
        for size in ((height, w), (h, w)):
            x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).round().clamp(0, 255)
    x = (x / 255.0 - torch.tensor(proc.mean).view(1, 3, 1, 1)) / torch.tensor(proc.std).view(1, 3, 1, 1)
    ps, m, t = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    gh, gw = h // ps, w // ps
    x = x.reshape(1, 3, gh // m, m, ps, gw // m, m, ps).permute(0, 2, 5, 3, 6, 1, 4, 7)
    return x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1).reshape(gh * gw, 3 * t * ps * ps).contiguous()


# (height, width): no resize; resized down and up; odd sides; extreme but allowed aspect ratios (up to 200:1, both
# ways, on the min_pixels floor and on the max_pixels cap); tiny images (1x1 included)
ODD_SIZES = [(56, 84), (61, 150), (97, 43), (1000, 1300), (1, 1), (3, 5), (20, 20), (4, 800), (800, 4),
             (7, 1400), (2000, 10), (200, 1)]


def test_device_path_equals_the_reference_exactly():
    """`patches` (the function every device runs; here a CPU), over one batch of images of many sizes, equals the
    plain reference of each image, bit for bit, in float32 and in bfloat16 (the cast is per element)."""
    proc = ImageProcessor()
    images = [proc.process_array(_random_image(*size, k)) for k, size in enumerate(ODD_SIZES)]
    grids = [i.grid_thw for i in images]
    want = torch.cat([_reference_patches(proc, i.pixels) for i in images])
    got = proc.patches([i.pixels for i in images], grids)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(proc.patches([i.pixels for i in images], grids, torch.bfloat16), want.to(torch.bfloat16))
    assert [i.num_tokens for i in images] == [h * w // 4 for _, h, w in grids]
    assert proc.patches([], []).shape == (0, 3 * 2 * 14 * 14)


def test_resize_by_bands_of_rows_equals_the_whole(monkeypatch):
    """The width pass in bands of a few rows (as a large image goes) gives the reference's patches exactly."""
    from m3sdk.model import image_processor

    monkeypatch.setattr(image_processor, "RESIZE_BAND_PIXELS", 3000)
    proc = ImageProcessor()
    for k, size in enumerate([(61, 150), (97, 43), (1000, 1300), (7, 1400), (2000, 10)]):
        rgb = _random_image(*size, 20 + k)
        image = proc.process_array(rgb)
        assert torch.equal(proc.patches([image.pixels], [image.grid_thw]), _reference_patches(proc, rgb))


def test_device_path_equals_the_reference_with_another_configuration():
    """A checkpoint's own range and mean/std (resized up onto a larger floor, down under a smaller cap)."""
    proc = ImageProcessor(min_pixels=56 * 56 * 4, max_pixels=28 * 28 * 40, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    for k, size in enumerate([(30, 31), (640, 480), (28 * 5, 28 * 8)]):
        rgb = _random_image(*size, 10 + k)
        image = proc.process_array(rgb)
        assert torch.equal(proc.patches([image.pixels], [image.grid_thw]), _reference_patches(proc, rgb))


@pytest.mark.gpu
def test_device_path_on_cuda_matches_the_cpu():
    """On a GPU, from uint8 uploaded in one packed copy: the CPU's patches within one uint8 level of the resize
    (the GPU's bicubic sums in another order, so a value on a rounding edge may land one level off)."""
    from m3sdk.staging import to_device_packed

    proc = ImageProcessor()
    images = [proc.process_array(_random_image(*size, k)) for k, size in enumerate(ODD_SIZES)]
    grids = [i.grid_thw for i in images]
    cpu = proc.patches([i.pixels for i in images], grids)
    cuda = proc.patches(to_device_packed([i.pixels for i in images], "cuda"), grids)
    assert cuda.device.type == "cuda"
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=0, atol=1.01 / 255 / min(proc.std))
    # level flips are rare (the rest differs by float rounding alone: a GPU divides by a scalar's reciprocal)
    assert ((cuda.cpu() - cpu).abs() > 1e-3).float().mean() < 0.01


def test_patch_layout_is_merge_window_major():
    """Patch i of the output is the 14x14 block at the position the encoder's RoPE gives it, repeated in time."""
    from m3sdk.model.vision import vision_positions

    proc = ImageProcessor()
    rgb = _random_image(56, 84, 3)  # already a multiple of 28: no resize
    out = proc.process_array(rgb)
    patches = proc.patches([out.pixels], [out.grid_thw])
    mean = torch.tensor(proc.mean).view(3, 1, 1)
    std = torch.tensor(proc.std).view(3, 1, 1)
    norm = (rgb.float() / 255 - mean) / std
    for i, (_, ph, pw) in enumerate(vision_positions([out.grid_thw], 2, torch.device("cpu")).tolist()):
        block = norm[:, ph * 14:(ph + 1) * 14, pw * 14:(pw + 1) * 14]
        expect = block[:, None].expand(3, 2, 14, 14).reshape(-1)
        torch.testing.assert_close(patches[i], expect)


def test_against_transformers_image_processor():
    try:
        from transformers.models.minimax_m3_vl import MiniMaxM3VLImageProcessor
        ref = MiniMaxM3VLImageProcessor()
    except (ImportError, ModuleNotFoundError) as e:
        pytest.skip(f"transformers' image processor does not load here: {e}")
    proc = ImageProcessor()
    for size, seed in (((61, 150), 0), ((97, 43), 1), ((800, 1300), 2)):
        rgb = _random_image(*size, seed)
        want = ref(images=[rgb], return_tensors="pt")
        got = proc.process_array(rgb)
        assert tuple(want["image_grid_thw"][0].tolist()) == got.grid_thw
        patches = proc.patches([got.pixels], [got.grid_thw])
        torch.testing.assert_close(patches, want["pixel_values"], rtol=0, atol=2 / 255 / 0.26)


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    PIL.new("RGB", (w, h), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_image_forms_decode_alike(tmp_path):
    data = _png(40, 30)
    (tmp_path / "a.png").write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    forms = [data, url, str(tmp_path / "a.png"), tmp_path / "a.png", f"file://{tmp_path / 'a.png'}",
             PIL.open(io.BytesIO(data))]
    decoded = [decode_image(f) for f in forms]
    assert decoded[0].shape == (3, 30, 40) and decoded[0][:, 0, 0].tolist() == [10, 200, 30]
    for d in decoded[1:]:
        assert torch.equal(d, decoded[0])


@pytest.mark.parametrize("bad, match", [
    (b"not an image at all", "could not be decoded"),
    (_png(40, 30)[:60], "could not be decoded"),
    ("https://example.com/cat.png", "remote image URLs are refused"),
    ("data:image/png;base64,@@@", "base64"),
    ("/no/such/file.png", "cannot be read"),
    (12345, "must be a path"),
])
def test_bad_images_are_invalid_requests(bad, match):
    with pytest.raises(InvalidRequestError, match=match):
        ImageProcessor().process(bad)


def test_extreme_aspect_ratio_zero_size_and_extreme_shrink():
    with pytest.raises(InvalidRequestError, match="aspect ratio"):
        ImageProcessor().process(_png(1000, 4))
    with pytest.raises(InvalidRequestError, match="zero size"):
        ImageProcessor().target_size(0, 10)
    # under a small pixel cap a large image would shrink beyond what the device's resize takes; the default cap
    # never gets there (at most about 24x, for 64M pixels)
    small = ImageProcessor(max_pixels=28 * 28 * 4)
    assert small.target_size(56 * 64, 56 * 64) == (56, 56)
    with pytest.raises(InvalidRequestError, match="shrink more than 64x"):
        small.target_size(56 * 65, 56 * 65)
    assert max(8192 / s for s in ImageProcessor().target_size(8192, 8192)) < 25


def test_fetcher_serves_remote_urls():
    seen = []
    out = ImageProcessor().process("https://example.com/x.png", fetcher=lambda u: seen.append(u) or _png(56, 56))
    assert seen == ["https://example.com/x.png"] and out.num_tokens == 4


def test_digest_follows_content():
    proc = ImageProcessor()
    a, b = _random_image(56, 56, 0), _random_image(56, 56, 1)
    assert proc.process_array(a).digest == proc.process_array(a.clone()).digest
    assert proc.process_array(a).digest != proc.process_array(b).digest


@pytest.mark.parametrize("layout", ["hf", "minimax"])
def test_text_model_of_a_vl_checkpoint_loads(vl_checkpoints, layout):
    """The text loader skips the vision tensors of either layout and reads the same text weights."""
    from m3sdk.model.loader import load_model

    model, paths = vl_checkpoints
    ours = load_model(paths[layout], dtype=torch.float32)
    torch.testing.assert_close(ours.embed_tokens.weight, model.model.language_model.embed_tokens.weight)
    torch.testing.assert_close(ours.lm_head.weight, model.lm_head.weight)
