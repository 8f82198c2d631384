"""Images on one GPU: the vision encoder's throughput at MiniMax-M3's real widths, and what an image adds to the
time to first token.

    PYTHONPATH=src python benchmarks/vision.py [--out DIR] [--steps ...] [--slice DIR] [--dense N --sparse N] [--tiny]
        [--quantization none fp8] [--vision-quantization auto fp8]

  host     the caller's thread's work per prompt (ImagePrompts.prepare: decode, check, hash, expand; what runs
           before the request is queued) and the bytes the request then holds, for a 1344x1344 noise PNG, a
           4032x3024 photo-like JPEG (resized to the slice's 2016x2016 pixel cap) and a prompt of four 1344x1344
           PNGs; median of --repeats. Needs no GPU.
  preprocess  the device's share: the uint8 images uploaded (one pinned copy) and resized, normalized and cut into
           bf16 patches on the GPU (ImageProcessor.patches), CUDA-synchronized, median of --iters.
  encoder  images/s of the vision tower + projector (MiniMax-M3's vision_config, src/m3sdk/assets/minimax-m3:
           width 1280, 32 layers, 16 heads, projector to 6144; random weights, bf16), at 448x448 and 1344x1344
           (--sides), one encoder call per batch of images, as a step runs it; after warm-up, CUDA-synchronized.
           Each row twice: the linears in bf16, then the same encoder's linears in FP8 W8A8 (what
           vision_quantization="fp8" loads), with the FP8 embeddings' lowest cosine and largest normalized error
           against bf16's.
  ttft     time to first token through the engine on an M3 slice with the vision tower (scripts/make_m3_slice.py
           --vision, written to --slice when it is missing): a prompt of one image (1344x1344 by default) against
           a text prompt of the same token count, both prefilled in one step, no cache hits (every image new).
           The encoder's share is (image - text) / text. A slice has few text layers, so that share is an upper
           bound; the full-model estimate scales the text prefill's per-layer time to M3's 60 layers
           (per layer = (text TTFT - 1-token TTFT) / slice layers). Goal: the encoder adds at most 15 %.
           One run per --quantization x --vision-quantization ("auto" keeps the tower in bf16, "fp8" serves its
           linears in FP8).
  --tiny   m3-tiny-vl (built with tests/oracle, needs transformers) on the CPU, fp32, small batches: checks that
           the script runs; its figures mean nothing.

Prints a table per step and appends JSON rows to OUT/vision.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
M3_LAYERS = 60
GOAL = 0.15
SLICE_MAX_PIXELS = 2016 * 2016  # M3's image_size, the pixel cap of scripts/make_m3_slice.py --vision


def record(out: Path, **row) -> None:
    with open(out / "vision.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def png(side: int, seed: int) -> bytes:
    from PIL import Image

    rgb = torch.randint(0, 256, (side, side, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    buf = io.BytesIO()
    Image.frombytes("RGB", (side, side), rgb.numpy().tobytes()).save(buf, format="PNG")
    return buf.getvalue()


def photo(width: int, height: int, seed: int) -> bytes:
    """A JPEG (quality 90) of smooth color gradients with a little noise: decodes like a camera photo."""
    from PIL import Image

    y, x = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    rgb = torch.stack([x * 200 + 30 * torch.sin(y * 40), y * 180 + 40 * torch.cos(x * 25), (x + y) * 100], -1)
    rgb += torch.randn(rgb.shape, generator=torch.Generator().manual_seed(seed)) * 12
    buf = io.BytesIO()
    Image.fromarray(rgb.clamp(0, 255).to(torch.uint8).numpy()).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@functools.cache
def host_images() -> list[tuple[str, list[bytes]]]:
    square = png(1344, 1)
    return [("1344x1344 PNG", [square]), ("4032x3024 JPEG", [photo(4032, 3024, 2)]),
            ("4 x 1344x1344 PNG", [square] + [png(1344, 3 + i) for i in range(3)])]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_encoder(args, device: torch.device, dtype: torch.dtype) -> None:
    from m3sdk.model.image_processor import ImageProcessor
    from m3sdk.model.quantize import quantize_vision_encoder
    from m3sdk.model.vision import VisionEncoder
    from m3sdk.model.vision_loader import load_vision_encoder, vision_config

    if args.tiny:
        encoder = load_vision_encoder(args.checkpoint, device, dtype)
    else:
        with torch.device(device):
            torch.manual_seed(0)
            encoder = VisionEncoder(vision_config(ROOT / "src" / "m3sdk" / "assets" / "minimax-m3"))
        for p in encoder.parameters():  # fan-in scaled, so activations keep their scale through 32 layers
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
        encoder = encoder.to(dtype).eval()
    processor = ImageProcessor(max_pixels=SLICE_MAX_PIXELS)  # neither size is resized
    cases = []
    for side, batches in zip(args.sides, (args.batches_small, args.batches_large), strict=True):
        image = processor.process(png(side, side))
        for batch in batches:
            grid = [image.grid_thw] * batch
            cases.append((side, batch, image.num_tokens, grid,
                          processor.patches([image.pixels.to(device)] * batch, grid, dtype)))
    params = sum(p.numel() for p in encoder.parameters()) / 1e9
    times, first, weights = {}, {}, {}
    # the loaded dtype first, then the same encoder's linears in FP8 (in place, as the loader does)
    for linears in ("bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch."), "fp8"):
        if linears == "fp8":
            quantize_vision_encoder(encoder, "fp8")
        weights[linears] = sum(t.numel() * t.element_size() for t in (*encoder.parameters(), *encoder.buffers()))
        for side, batch, _, grid, pixels in cases:
            with torch.inference_mode():
                out = encoder(pixels, grid)  # the first warm-up call
                for _ in range(args.warmup - 1):
                    encoder(pixels, grid)
                sync(device)
                t = time.perf_counter()
                for _ in range(args.iters):
                    encoder(pixels, grid)
                sync(device)
            times[linears, side, batch] = (time.perf_counter() - t) / args.iters * 1e3
            if batch == 1:
                first[linears, side] = out.float()
    base = next(iter(times))[0]
    print(f"\nencoder: width {encoder.config.hidden_size}, {encoder.config.num_hidden_layers} layers, "
          f"{params:.3f} B parameters, {dtype}, {device}; linears {base} vs FP8 W8A8 (quantization='fp8'); weights "
          f"{weights[base] / 2**20:.1f} vs {weights['fp8'] / 2**20:.1f} MiB")
    print(f"{'size':>10} {'batch':>6} {'patches':>8} {'tokens':>7} {base + ' ms':>9} {'fp8 ms':>8} {'speedup':>8} "
          f"{base + ' img/s':>10} {'fp8 img/s':>10} {'min cos':>8} {'max rel':>8}")
    for side, batch, tokens, _, pixels in cases:
        ref, fp8 = times[base, side, batch], times["fp8", side, batch]
        a, b = first["fp8", side], first[base, side]  # each image's embeddings, batch 1: FP8 against the loaded dtype
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
        rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
        for linears, ms in ((base, ref), ("fp8", fp8)):
            record(args.out, step="encoder", linears=linears, side=side, batch=batch, patches=pixels.shape[0] // batch,
                   tokens=tokens, ms_per_batch=round(ms, 3), images_per_s=round(batch / ms * 1e3, 2),
                   **({"min_cos_vs_" + base: round(cos, 5), "max_rel_vs_" + base: round(rel, 4)}
                      if linears == "fp8" else {}), tiny=args.tiny, device=str(device))
        print(f"{side:>5}x{side:<4} {batch:>6} {pixels.shape[0] // batch:>8} {tokens:>7} {ref:>9.2f} {fp8:>8.2f} "
              f"{ref / fp8:>7.2f}x {batch / ref * 1e3:>10.1f} {batch / fp8 * 1e3:>10.1f} {cos:>8.5f} {rel:>8.4f}")


def step_host(args) -> None:
    from m3sdk.images import ImagePrompts
    from m3sdk.model.image_processor import ImageProcessor
    from m3sdk.tokenizer import Tokenizer

    token = 5  # the image placeholder's id here: any id will do
    prompts = ImagePrompts(ImageProcessor(max_pixels=SLICE_MAX_PIXELS), None,
                           Tokenizer.from_pretrained(ROOT / "src" / "m3sdk" / "assets" / "m3-tiny"), 8,
                           torch.device("cpu"), token)
    print(f"\nhost: ImagePrompts.prepare on the caller's thread, median of {args.repeats}, "
          f"{torch.get_num_threads()} torch threads")
    print(f"{'prompt':<20} {'file MB':>8} {'tokens':>7} {'ms/prompt':>10} {'held MB':>8}")
    for name, files in host_images():
        ids = [7, *[token] * len(files), 8]
        prompts.prepare(ids, files)  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            _, images = prompts.prepare(ids, files)
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        held = sum(i.pixels.nbytes for i in images) / 1e6
        tokens = sum(i.num_tokens for i in images)
        size = sum(len(f) for f in files) / 1e6
        record(args.out, step="host", prompt=name, file_mb=round(size, 2), tokens=tokens, ms=round(ms, 2),
               held_mb=round(held, 2))
        print(f"{name:<20} {size:>8.2f} {tokens:>7} {ms:>10.2f} {held:>8.2f}")


def step_preprocess(args, device: torch.device, dtype: torch.dtype) -> None:
    from m3sdk.model.image_processor import ImageProcessor
    from m3sdk.staging import to_device_packed

    processor = ImageProcessor(max_pixels=SLICE_MAX_PIXELS)
    print(f"\npreprocess: upload (uint8, one pinned copy) + resize / normalize / patchify to {dtype} on {device}, "
          f"median of {args.iters}")
    print(f"{'prompt':<20} {'patches':>8} {'upload ms':>10} {'patch ms':>9} {'total ms':>9}")
    for name, files in host_images():
        images = [processor.process(f) for f in files]
        rgbs, grids = [i.pixels for i in images], [i.grid_thw for i in images]
        ups, totals = [], []
        for k in range(args.warmup + args.iters):
            sync(device)
            t = time.perf_counter()
            on_device = to_device_packed(rgbs, device)
            sync(device)
            up = time.perf_counter()
            pixels = processor.patches(on_device, grids, dtype)
            sync(device)
            if k >= args.warmup:
                ups.append(up - t)
                totals.append(time.perf_counter() - t)
        upload, total = statistics.median(ups) * 1e3, statistics.median(totals) * 1e3
        record(args.out, step="preprocess", prompt=name, patches=pixels.shape[0], upload_ms=round(upload, 3),
               total_ms=round(total, 3), dtype=str(dtype), device=str(device))
        print(f"{name:<20} {pixels.shape[0]:>8} {upload:>10.3f} {total - upload:>9.3f} {total:>9.3f}")


async def _ttft(engine, prompt, repeats: int) -> float:
    """Median seconds to the first token of `prompt(i)` (a fresh prompt each time: no cache hit)."""
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        await engine.generate(prompt(i), max_tokens=1, temperature=0, ignore_eos=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def step_ttft(args, device: torch.device, quantization: str, vision_quantization: str) -> None:
    from m3sdk import Engine
    from m3sdk.model.config import ModelConfig

    model = args.checkpoint if args.tiny else args.slice
    layers = ModelConfig.from_pretrained(model).num_layers
    config = dict(model=str(model), device=str(device), dtype="float32" if args.tiny else "bfloat16",
                  max_model_len=1024 if args.tiny else 16384, max_num_seqs=4, max_num_batched_tokens=16384,
                  enable_prefix_caching=False, quantization=quantization, vision_quantization=vision_quantization,
                  kv_cache_memory=(64 << 20) if args.tiny else (8 << 30))
    t = time.perf_counter()
    async with Engine(**config) as e:
        core = e._core
        load_s = time.perf_counter() - t
        image_token = core.images.image_token_id
        top = min(core.vocab_size, image_token)  # text ids below the image token
        images = [png(args.image_side, 100 + i) for i in range(args.repeats + 2)]
        probe = await e.generate({"prompt_token_ids": [7, image_token, 8], "images": [images[-1]]}, max_tokens=1)
        n = probe.usage.prompt_tokens  # the image prompt's length once its placeholder is expanded

        def ids(i: int, length: int) -> list[int]:
            g = torch.Generator().manual_seed(1000 + i)
            return torch.randint(3, top, (length,), generator=g).tolist()

        await e.generate(ids(-1, n), max_tokens=1)  # warm-up of the text path at this length
        one = await _ttft(e, lambda i: ids(i, 1), args.repeats)
        text = await _ttft(e, lambda i: ids(i, n), args.repeats)
        image = await _ttft(e, lambda i: {"prompt_token_ids": [7, image_token, 8], "images": [images[i]]},
                            args.repeats)
    extra = image - text
    share = extra / text
    per_layer = max(text - one, 0.0) / layers
    full_text = one + per_layer * M3_LAYERS
    full_share = extra / full_text
    tower = "fp8" if vision_quantization == "fp8" else "model dtype"
    row = dict(step="ttft", model=str(model), layers=layers, quantization=quantization, vision_linears=tower,
               image_side=args.image_side, prompt_tokens=n,
               ttft_one_token_ms=round(one * 1e3, 2), ttft_text_ms=round(text * 1e3, 2),
               ttft_image_ms=round(image * 1e3, 2), encoder_extra_ms=round(extra * 1e3, 2),
               share_on_slice=round(share, 4), full_model_text_ttft_ms=round(full_text * 1e3, 2),
               share_full_model_estimate=round(full_share, 4), goal=GOAL, meets_goal=full_share <= GOAL,
               load_s=round(load_s, 1), tiny=args.tiny, device=str(device))
    record(args.out, **row)
    print(f"\nttft: {model} ({layers} text layers), quantization={quantization!r}, vision linears {tower}, one "
          f"{args.image_side}x{args.image_side} image = {n} prompt tokens, median of {args.repeats}")
    print(f"{'prompt':<34} {'TTFT ms':>9}")
    for name, v in (("1 token", one), (f"text, {n} tokens", text), (f"1 image, {n} tokens", image)):
        print(f"{name:<34} {v * 1e3:>9.2f}")
    print(f"{'encoder adds':<34} {extra * 1e3:>9.2f}  {share:6.1%} of the slice's text TTFT")
    print(f"{'full model (60 layers) estimate':<34} {full_text * 1e3:>9.2f}  encoder {full_share:6.1%}  "
          f"goal <= {GOAL:.0%}: {'met' if full_share <= GOAL else 'NOT met'}")


def main() -> None:
    from m3sdk.config import QUANTIZATIONS, VISION_QUANTIZATIONS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."))
    steps = ["host", "preprocess", "encoder", "ttft"]
    p.add_argument("--steps", nargs="+", default=steps, choices=steps)
    p.add_argument("--tiny", action="store_true", help="m3-tiny-vl on the CPU: checks the script runs")
    p.add_argument("--slice", type=Path, default=Path("/dev/shm/m3-slice-vl"))
    p.add_argument("--dense", type=int, default=1, help="the slice's dense layers, when it is written here")
    p.add_argument("--sparse", type=int, default=1, help="the slice's sparse layers, when it is written here")
    p.add_argument("--image-side", type=int, default=1344)
    p.add_argument("--quantization", nargs="+", default=["none"], choices=QUANTIZATIONS,
                   help="ttft: the text model's quantization, one run each")
    p.add_argument("--vision-quantization", nargs="+", default=["auto"], choices=VISION_QUANTIZATIONS,
                   help="ttft: the vision tower's linears ('auto': bf16, 'fp8'), one run each")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sides", type=int, nargs=2, default=[448, 1344], help="the two image sizes of `encoder`")
    p.add_argument("--batches-small", type=int, nargs="+", default=[1, 8, 32], help="batches of the first size")
    p.add_argument("--batches-large", type=int, nargs="+", default=[1, 4], help="batches of the second size")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from oracle import make_vl_checkpoint

        device, dtype = torch.device("cpu"), torch.float32
        scratch = tempfile.TemporaryDirectory(prefix="m3-tiny-vl-")
        args.checkpoint = make_vl_checkpoint(Path(scratch.name))
        args.iters, args.warmup, args.repeats = 2, 1, min(args.repeats, 2)
        args.sides, args.batches_small, args.batches_large = [112, 224], [1, 4], [1]
        args.image_side = min(args.image_side, 224)
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        if "ttft" in args.steps and not (args.slice / "preprocessor_config.json").is_file():
            sys.path.insert(0, str(ROOT / "scripts"))
            from make_m3_slice import make_slice

            t = time.perf_counter()
            make_slice(args.slice, args.dense, args.sparse, device="cuda", max_position_embeddings=32768,
                       vision=True)
            print(f"wrote {args.slice} in {time.perf_counter() - t:.0f} s")
    if "host" in args.steps:
        step_host(args)
    if "preprocess" in args.steps:
        step_preprocess(args, device, dtype)
    if "encoder" in args.steps:
        step_encoder(args, device, dtype)
    if "ttft" in args.steps:
        for quantization in args.quantization:
            for vision_quantization in args.vision_quantization:
                asyncio.run(step_ttft(args, device, quantization, vision_quantization))


if __name__ == "__main__":
    main()
