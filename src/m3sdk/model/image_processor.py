"""Images -> the vision encoder's input, in two halves.

On the caller's thread (`ImageProcessor.process`): decode to uint8 RGB [3, H, W], check its size, choose the size
it is resized to (sides that are multiples of patch*merge, 28, within the checkpoint's pixel range) and hash it.
A request keeps that uint8 image (3 bytes a pixel).

Where the encoder runs, on its device, batched over the images a step encodes (`ImageProcessor.patches`): resize,
rescale to [0, 1], normalize with CLIP's mean/std, and cut into patches laid out merge-window-major, each patch
repeated over the temporal patch (a still image is a 1-frame clip). The same function serves every device; on a
CPU its output is what transformers' MiniMaxM3VLImageProcessor gives (within a level of the resize, below).

Decoding needs Pillow (the `vision` extra): it reads every common format (PNG, JPEG, WebP, GIF, BMP) safely, which
our own code should not attempt. Resizing is bicubic with antialiasing in two passes rounded to uint8, as torch's
uint8 kernel (transformers' torchvision backend) does, so pixels match its MiniMaxM3VLImageProcessor within a level.

Accepted image forms: a filesystem path (str or Path, or a `file://` URL), raw bytes, a `data:image/...;base64,`
URL, or a PIL image. Remote (http/https) URLs are refused unless the application passes a `fetcher`. Every failure
is an InvalidRequestError, raised on the caller's thread before anything is queued.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from m3sdk.errors import InvalidRequestError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
# a side shrunk more than this is refused: CUDA's antialiased resize holds a pass's filter weights in 48 KB of shared
# memory, which fits a downscale of about 90 (64 leaves room). Only a checkpoint with a small max_pixels reaches it
MAX_DOWNSCALE = 64
# the width pass of a resize converts this many pixels to float at a time
RESIZE_BAND_PIXELS = 1 << 22
# decoding guard: larger images are refused before their pixels are allocated (Pillow's own bomb limit is ~179M)
MAX_DECODED_PIXELS = 64 * 1024 * 1024

# bytes of a remote image, given its URL; the application's choice (no network access from the engine by default)
Fetcher = Callable[[str], bytes]


@dataclass(frozen=True)
class ProcessedImage:
    """One decoded and checked image: `pixels` uint8 RGB [3, H, W] (contiguous, as decoded: `ImageProcessor.patches`
    resizes and patches it where the encoder runs) and its patch grid (t, h, w) after resizing."""

    pixels: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int
    digest: bytes  # content hash of the pixels and the resized size: keys the prefix cache and the encoder cache
    data: bytes = b""  # the image file (a PIL image given: as PNG) when asked for, for a prefill node to decode


@dataclass(frozen=True)
class ImageProcessor:
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 451584
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ImageProcessor:
        """The checkpoint's preprocessor_config.json (min/max pixels, patching, mean/std); defaults without one."""
        file = Path(path) / "preprocessor_config.json"
        if not file.is_file():
            return cls()
        raw: dict[str, Any] = json.loads(file.read_text())
        size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
        default = cls()
        return cls(
            min_pixels=int(raw.get("min_pixels", size.get("shortest_edge", default.min_pixels))),
            max_pixels=int(raw.get("max_pixels", size.get("longest_edge", default.max_pixels))),
            patch_size=int(raw.get("patch_size", default.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", default.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", default.merge_size)),
            mean=tuple(raw.get("image_mean", default.mean)),
            std=tuple(raw.get("image_std", default.std)),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing: multiples of `factor`, pixel count within [min_pixels, max_pixels],
        aspect ratio kept as closely as possible."""
        if height <= 0 or width <= 0:
            raise InvalidRequestError(f"image has zero size ({width}x{height})")
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise InvalidRequestError(f"image aspect ratio {width}x{height} exceeds {MAX_ASPECT_RATIO}:1")
        f = self.factor
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        if max(height / h, width / w) > MAX_DOWNSCALE:
            raise InvalidRequestError(f"image of {width}x{height} would shrink more than {MAX_DOWNSCALE}x to "
                                      f"{w}x{h} (the checkpoint's max_pixels {self.max_pixels})")
        return h, w

    def num_tokens(self, height: int, width: int) -> int:
        h, w = self.target_size(height, width)
        return (h // self.factor) * (w // self.factor)

    def process(self, image: Any, fetcher: Fetcher | None = None, keep_file: bool = False) -> ProcessedImage:
        """Decode `image` (see the module doc for the accepted forms), check and hash it; `keep_file`: with the image
        file too (a PIL image encoded as PNG), for a prefill node."""
        if not keep_file:
            return self.process_array(decode_image(image, fetcher))
        data = image_file(image, fetcher)
        return self.process_array(decode_image(data), data)

    def process_array(self, rgb: torch.Tensor, data: bytes = b"") -> ProcessedImage:
        """`rgb`: uint8 [3, H, W] -> the checked image with its grid and digest (`data`: the file it was decoded
        from)."""
        rgb = rgb.contiguous()
        h, w = self.target_size(*rgb.shape[-2:])
        gh, gw = h // self.patch_size, w // self.patch_size
        return ProcessedImage(rgb, (1, gh, gw), gh * gw // self.merge_size ** 2, _digest(rgb, (h, w)), data)

    def patches(self, images: Sequence[torch.Tensor], grids: Sequence[tuple[int, int, int]],
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The encoder's input for uint8 RGB images [3, H, W] of grids (1, h, w) (`process`'s): [sum h*w,
        C*T*ps*ps] in `dtype`, on the images' device, each image's patches in order."""
        ps, t = self.patch_size, self.temporal_patch_size
        device = images[0].device if images else torch.device("cpu")
        out = torch.empty(sum(h * w for _, h, w in grids), 3 * t * ps * ps, dtype=dtype, device=device)
        row = 0
        for rgb, (frames, gh, gw) in zip(images, grids, strict=True):
            if frames != 1:
                raise ValueError(f"a still image has one frame, not {frames}")
            self._patchify(rgb, gh, gw, out[row:row + gh * gw])
            row += gh * gw
        return out

    def _patchify(self, rgb: torch.Tensor, gh: int, gw: int, out: torch.Tensor) -> None:
        """One image's patches (grid gh x gw) into `out` [gh*gw, C*T*ps*ps]."""
        ps, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        x = _resized(rgb, gh * ps, gw * ps)
        x.div_(255.0)
        # per channel by Python scalars: a tensor of mean/std made on a GPU would be a blocking host copy
        for c in range(3):
            x[:, c].sub_(self.mean[c]).div_(self.std[c])
        x = x.reshape(3, gh // m, m, ps, gw // m, m, ps).permute(1, 4, 2, 5, 0, 3, 6)  # windows, then C, ps, ps
        out.view(gh // m, gw // m, m, m, 3, t, ps, ps).copy_(x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1))


def _resized(rgb: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """uint8 [3, H, W] -> float32 [1, 3, h, w] of uint8 levels, resized as torch's uint8 kernel (transformers'
    torchvision path) resizes: width first, then height, each pass rounded to uint8 (within 1 level of it: its
    weights are fixed-point). These float passes run alike on every device. The width pass goes by bands of rows
    (a row resizes alone, so the bands' results are the whole's), so that a large image's float copy never exists
    whole on the device."""
    height, width = rgb.shape[-2:]
    if (h, w) == (height, width):
        return rgb[None].float()
    x = torch.empty(1, 3, height, w, device=rgb.device)
    rows = max(1, RESIZE_BAND_PIXELS // width)
    for r in range(0, height, rows):
        band = rgb[None, :, r:r + rows].float()
        x[:, :, r:r + rows] = _resize_pass(band, (band.shape[2], w))
    return _resize_pass(x, (h, w))


def _resize_pass(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    return F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).round_().clamp_(0, 255)


def _digest(rgb: torch.Tensor, size: tuple[int, int]) -> bytes:
    """128 bits of SHA-256 over the decoded pixels and the size they are resized to (the key of the encoder cache
    and of the prefix cache's image pages). SHA-256, not blake2b: x86 and Arm CPUs hash it in hardware, at about
    twice blake2b's speed over the megabytes of a decoded image."""
    h = hashlib.sha256()
    h.update(repr((tuple(rgb.shape), size)).encode())
    h.update(rgb.numpy())  # `rgb` is contiguous: hashed in place
    return h.digest()[:16]


def decode_image(image: Any, fetcher: Fetcher | None = None) -> torch.Tensor:
    """Any accepted image form -> uint8 RGB [3, H, W]."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as e:
        raise InvalidRequestError("images need Pillow: pip install 'm3sdk[vision]'") from e

    if isinstance(image, Image.Image):
        pil = image
    else:
        data = _image_bytes(image, fetcher)
        try:
            pil = Image.open(io.BytesIO(data))
            if pil.width * pil.height > MAX_DECODED_PIXELS:
                raise InvalidRequestError(f"image of {pil.width}x{pil.height} exceeds {MAX_DECODED_PIXELS} pixels")
            pil.load()
        except InvalidRequestError:
            raise
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise InvalidRequestError(f"image could not be decoded: {e}") from e
    if pil.width == 0 or pil.height == 0:
        raise InvalidRequestError(f"image has zero size ({pil.width}x{pil.height})")
    if pil.width * pil.height > MAX_DECODED_PIXELS:
        raise InvalidRequestError(f"image of {pil.width}x{pil.height} exceeds {MAX_DECODED_PIXELS} pixels")
    rgb = pil if pil.mode == "RGB" else pil.convert("RGB")
    out = np.empty((3, rgb.height, rgb.width), dtype=np.uint8)
    for c, band in enumerate("RGB"):  # each plane straight from Pillow's packer: no [H, W, 3] copy to transpose
        out[c] = np.frombuffer(rgb.tobytes("raw", band), dtype=np.uint8).reshape(rgb.height, rgb.width)
    return torch.from_numpy(out)


def image_file(image: Any, fetcher: Fetcher | None = None) -> bytes:
    """The bytes of an image file: as given (bytes, a path, a data URL, a fetched URL), or a PIL image's RGB as
    PNG (lossless: decoding it gives the same pixels, hence the same digest)."""
    try:
        from PIL import Image
    except ImportError as e:
        raise InvalidRequestError("images need Pillow: pip install 'm3sdk[vision]'") from e
    if not isinstance(image, Image.Image):
        return _image_bytes(image, fetcher)
    if image.width * image.height > MAX_DECODED_PIXELS:
        raise InvalidRequestError(f"image of {image.width}x{image.height} exceeds {MAX_DECODED_PIXELS} pixels")
    if image.width == 0 or image.height == 0:
        raise InvalidRequestError(f"image has zero size ({image.width}x{image.height})")
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _image_bytes(image: Any, fetcher: Fetcher | None) -> bytes:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, Path):
        return _read_file(image)
    if not isinstance(image, str):
        raise InvalidRequestError(f"an image must be a path, bytes, a data URL or a PIL image, not {type(image)}")
    if image.startswith("data:"):
        header, sep, payload = image.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidRequestError("a data URL image must be base64: data:image/<type>;base64,<data>")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise InvalidRequestError(f"the data URL's base64 is invalid: {e}") from e
    if image.startswith(("http://", "https://")):
        if fetcher is None:
            raise InvalidRequestError("remote image URLs are refused: pass image bytes, a path or a data URL, "
                                      "or give the engine an image fetcher")
        return fetcher(image)
    return _read_file(Path(image.removeprefix("file://")))


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise InvalidRequestError(f"image file {str(path)!r} cannot be read: {e.strerror or e}") from e
