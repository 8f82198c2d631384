"""Image prompts: each image of a prompt becomes a run of image tokens whose input embeddings come from the vision
encoder instead of the token embedding table.

Caller's thread (engine.py, before queueing): `ImagePrompts.prepare` decodes, checks and hashes every image (the
images of one prompt in threads: Pillow decodes without holding the GIL), checks their number, and expands each
placeholder (the image token, once per image; `]<]image[>[` in a text prompt) into the image's run of image tokens,
wrapped in the checkpoint's start/end-of-image tokens where its tokenizer has them (as transformers'
MiniMaxM3VLProcessor does). A request holds its images as decoded, uint8.

Engine thread (runner.py): `ImagePrompts.overrides` gives, for the requests of one step, the rows of the step's
tokens that are image tokens and their embeddings; a chunk that cuts through an image takes the slice of the
image's embeddings at the chunk's positions. Embeddings are kept in an LRU cache keyed by image content, so an
image is encoded once across chunks, preemptions and later requests that show it again; the images a step needs
and the cache lacks are uploaded as uint8 in one copy, resized and patched on the encoder's device and encoded in
one batched encoder call.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from m3sdk.chat.image_parts import IMAGE_PLACEHOLDER
from m3sdk.errors import InvalidRequestError
from m3sdk.model.image_processor import Fetcher, ImageProcessor, ProcessedImage
from m3sdk.request import Request
from m3sdk.staging import to_device, to_device_packed
from m3sdk.tokenizer import Tokenizer

if TYPE_CHECKING:
    from m3sdk.model.vision import VisionEncoder

IMAGE_START = "]<]start of image[>["
IMAGE_END = "]<]end of image[>["


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image of a request: its tokens are prompt positions [offset, offset + num_tokens)."""

    offset: int
    num_tokens: int
    digest: bytes  # content hash (m3sdk.model.image_processor): the prefix cache and the encoder cache key on it
    pixels: torch.Tensor  # the decoded image, uint8 RGB [3, H, W] on the host (patched where it is encoded)
    grid_thw: tuple[int, int, int]  # its patch grid after resizing
    data: bytes = b""  # the image file (with ImagePrompts.keep_files): what a prefill node gets (m3sdk.disagg)


class ImagePrompts:
    """`encoder` None: this engine computes no image token itself (the decode side of prefill nodes that encode
    the images, m3sdk.disagg): `prepare` still expands and hashes its images, and `encodes` tells the core."""

    def __init__(self, processor: ImageProcessor, encoder: VisionEncoder | None, tokenizer: Tokenizer, limit: int,
                 device: torch.device, image_token_id: int, fetcher: Fetcher | None = None,
                 cache_tokens: int = 1 << 15, keep_files: bool = False):
        self.processor = processor
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.limit = limit
        self.device = device
        self.fetcher = fetcher
        self.image_token_id = image_token_id
        self.keep_files = keep_files  # each PromptImage carries its image file (for prefill nodes)
        start, end = tokenizer.token_to_id(IMAGE_START), tokenizer.token_to_id(IMAGE_END)
        self._wrap = (start, end) if start is not None and end is not None else None
        # encoder-output cache (engine thread only): digest -> [num_tokens, hidden] on the device, LRU first
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._cache_tokens = cache_tokens
        self._cached = 0
        self.num_encoded = 0  # images run through the encoder (the cache's misses)
        self.num_encoder_tokens = 0  # the patches of those images

    # -- caller's thread -----------------------------------------------------------------------------------------
    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids, each `]<]image[>[` one image token whatever the tokenizer makes of the string."""
        pieces = text.split(IMAGE_PLACEHOLDER)
        ids = self.tokenizer.encode(pieces[0], add_special_tokens=add_special_tokens) if pieces[0] else []
        for piece in pieces[1:]:
            ids.append(self.image_token_id)
            ids += self.tokenizer.encode(piece, add_special_tokens=False) if piece else []
        return ids

    def prepare(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], tuple[PromptImage, ...]]:
        """(`ids` with each placeholder expanded to its image's tokens, the images) or InvalidRequestError."""
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
            raise InvalidRequestError(f"images must be a list, got {type(images).__name__}")
        if len(images) > self.limit:
            raise InvalidRequestError(f"{len(images)} images in one prompt; this engine takes at most {self.limit} "
                                      "(limit_images)")
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise InvalidRequestError(f"the prompt holds {len(slots)} image placeholders ({IMAGE_PLACEHOLDER!r}, "
                                      f"token {self.image_token_id}) for {len(images)} images: one per image")
        processed = self._process(images, self.fetcher, self.keep_files)
        out: list[int] = []
        spans = []
        last = 0
        for slot, image in zip(slots, processed, strict=True):
            out += ids[last:slot]
            if self._wrap:
                out.append(self._wrap[0])
            spans.append(_prompt_image(len(out), image))
            out += [self.image_token_id] * image.num_tokens
            if self._wrap:
                out.append(self._wrap[1])
            last = slot + 1
        out += ids[last:]
        return out, tuple(spans)

    def _process(self, images: Sequence[Any], fetcher: Fetcher | None, keep_files: bool) -> list[ProcessedImage]:
        """`processor.process` of each image, several at once in threads (decoding, fetching and hashing release
        the GIL); the first failure in image order is raised."""
        def one(image: Any) -> ProcessedImage:
            return self.processor.process(image, fetcher, keep_files)

        workers = min(len(images), os.cpu_count() or 1)
        if workers < 2:
            return [one(image) for image in images]
        with ThreadPoolExecutor(workers, thread_name_prefix="m3sdk-image") as pool:
            return list(pool.map(one, images))

    def place(self, ids: Sequence[int], images: Sequence[tuple[int, int, bytes, bytes]]) -> tuple[PromptImage, ...]:
        """A prompt whose placeholders another engine expanded (a prefill node's): its images as (offset,
        num_tokens, digest, image file), each checked to decode here to that many tokens and that digest, over
        positions that hold the image token; InvalidRequestError otherwise."""
        if len(images) > self.limit:
            raise InvalidRequestError(f"{len(images)} images in one prompt; this engine takes at most {self.limit} "
                                      "(limit_images)")
        for k, (offset, num_tokens, _, _) in enumerate(images):
            if any(t != self.image_token_id for t in ids[offset:offset + num_tokens]):
                raise InvalidRequestError(f"image {k}: positions [{offset}, {offset + num_tokens}) do not all hold "
                                          f"the image token {self.image_token_id}")
        out = []
        decoded = self._process([data for *_, data in images], None, False)
        for k, ((offset, num_tokens, digest, _), image) in enumerate(zip(images, decoded, strict=True)):
            if (image.num_tokens, image.digest) != (num_tokens, digest):
                raise InvalidRequestError(f"image {k} decodes here to {image.num_tokens} tokens and digest "
                                          f"{image.digest.hex()}, not {num_tokens} and {digest.hex()} (another "
                                          "image processor configuration or decoder)")
            out.append(_prompt_image(offset, image))
        return tuple(out)

    # -- engine thread -------------------------------------------------------------------------------------------
    def encoder_tokens(self, image: PromptImage) -> int:
        """The encoder's tokens to embed `image` (its patches, t*h*w), or 0 when its output is cached: what it costs
        a step's budget (scheduler.base.EncoderWork)."""
        if image.digest in self._cache:
            return 0
        t, h, w = image.grid_thw
        return t * h * w

    def overrides(self, entries: Sequence[tuple[Request, int, int, int]]
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For entries (request, first position, number of tokens, first row in the step): (rows [K] int64 on the
        device, embeddings [K, hidden]) of the step's image tokens, or None when the step has none."""
        wanted = []
        for request, start, n, row in entries:
            for image in request.images:
                lo, hi = max(start, image.offset), min(start + n, image.offset + image.num_tokens)
                if lo < hi:
                    wanted.append((image, lo - image.offset, hi - image.offset, row + lo - start))
        if not wanted:
            return None
        embeds = self._embeddings([w[0] for w in wanted])
        rows: list[int] = []
        values = []
        for image, a, b, row in wanted:
            rows += range(row, row + b - a)
            values.append(embeds[image.digest][a:b])
        return to_device(rows, torch.int64, self.device), torch.cat(values)

    @property
    def encodes(self) -> bool:
        return self.encoder is not None

    def _embeddings(self, images: Sequence[PromptImage]) -> dict[bytes, torch.Tensor]:
        out = {}
        missing: dict[bytes, PromptImage] = {}
        for image in images:
            if image.digest in self._cache:
                self._cache.move_to_end(image.digest)
                out[image.digest] = self._cache[image.digest]
            else:
                missing[image.digest] = image
        if missing:
            if self.encoder is None:  # the core never schedules an image token here (EngineCore.new_request)
                raise RuntimeError("image tokens scheduled on an engine without a vision encoder")
            todo = list(missing.values())
            rgbs = to_device_packed([i.pixels for i in todo], self.device)
            pixels = self.processor.patches(rgbs, [i.grid_thw for i in todo], self.encoder.dtype)
            encoded = self.encoder(pixels, [i.grid_thw for i in todo]).split([i.num_tokens for i in todo])
            self.num_encoded += len(todo)
            self.num_encoder_tokens += pixels.shape[0]
            for image, e in zip(todo, encoded, strict=True):
                out[image.digest] = e
                self._remember(image.digest, e)
        return out

    def _remember(self, digest: bytes, embeds: torch.Tensor) -> None:
        self._cache[digest] = embeds
        self._cached += embeds.shape[0]
        while self._cached > self._cache_tokens and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= old.shape[0]


def _prompt_image(offset: int, image: ProcessedImage) -> PromptImage:
    return PromptImage(offset, image.num_tokens, image.digest, image.pixels, image.grid_thw, image.data)
