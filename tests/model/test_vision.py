"""The vision encoder and the image preprocessing, held against transformers' MiniMax-M3 VL model."""

from __future__ import annotations

import base64
import io
import shutil

import pytest
import torch
from oracle import ORACLE_IMAGE_TOKEN, oracle_vl_model
from safetensors.torch import save_file

from m3sdk.errors import CheckpointError, InvalidRequestError
from m3sdk.model.image_processor import ImageProcessor, decode_image
from m3sdk.model.vision_loader import load_vision_encoder

PIL = pytest.importorskip("PIL.Image")


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


@pytest.mark.parametrize("layout", ["hf", "minimax"])
def test_encoder_matches_transformers(vl_checkpoints, layout):
    model, paths = vl_checkpoints
    encoder = load_vision_encoder(paths[layout], dtype=torch.float32)
    assert encoder is not None and encoder.config.image_token_id == ORACLE_IMAGE_TOKEN
    proc = ImageProcessor()
    # two sizes that need resizing (odd sides, non-square), so grids and merge windows differ per image
    images = [proc.process_array(_random_image(61, 150, 0)), proc.process_array(_random_image(97, 43, 1))]
    assert images[0].grid_thw != images[1].grid_thw
    pixels = torch.cat([i.pixels for i in images])
    grid = [i.grid_thw for i in images]
    ours = encoder(pixels, grid)
    with torch.no_grad():
        ref = torch.cat(model.model.get_image_features(pixels, torch.tensor(grid)).pooler_output)
    assert ours.shape == (sum(i.num_tokens for i in images), 64)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


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


def test_partial_vision_weights_are_a_checkpoint_error(vl_checkpoints, tmp_path):
    from safetensors import safe_open

    _, paths = vl_checkpoints
    with safe_open(paths["minimax"] / "model.safetensors", "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if "pre_layrnorm" not in k}
    save_file(kept, tmp_path / "model.safetensors")
    shutil.copy(paths["minimax"] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="incomplete vision encoder: missing .*pre_layrnorm"):
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
    assert out.pixels.shape == (h * w // 196, 3 * 2 * 14 * 14)
    assert out.num_tokens == h * w // 784


def test_patch_layout_is_merge_window_major():
    """Patch i of the output is the 14x14 block at the position the encoder's RoPE gives it, repeated in time."""
    from m3sdk.model.vision import vision_positions

    proc = ImageProcessor()
    rgb = _random_image(56, 84, 3)  # already a multiple of 28: no resize
    out = proc.process_array(rgb)
    mean = torch.tensor(proc.mean).view(3, 1, 1)
    std = torch.tensor(proc.std).view(3, 1, 1)
    norm = (rgb.float() / 255 - mean) / std
    for i, (_, ph, pw) in enumerate(vision_positions([out.grid_thw], 2, torch.device("cpu")).tolist()):
        block = norm[:, ph * 14:(ph + 1) * 14, pw * 14:(pw + 1) * 14]
        expect = block[:, None].expand(3, 2, 14, 14).reshape(-1)
        torch.testing.assert_close(out.pixels[i], expect)


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
        torch.testing.assert_close(got.pixels, want["pixel_values"], rtol=0, atol=2 / 255 / 0.26)


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


def test_extreme_aspect_ratio_and_zero_size():
    with pytest.raises(InvalidRequestError, match="aspect ratio"):
        ImageProcessor().process(_png(1000, 4))
    with pytest.raises(InvalidRequestError, match="zero size"):
        ImageProcessor().target_size(0, 10)


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
