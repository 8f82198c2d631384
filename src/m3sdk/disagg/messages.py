"""Control-plane messages, checked: what a peer sends becomes a typed order only inside the limits.

The node checks every Prefill call (sizes, token ids, page ids, plan parameters, deadline, sampling) before it
computes anything; the decode side checks the node's replies. A refusal is a `WireError` naming the field.
"""

from __future__ import annotations

import array
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from m3sdk.disagg._proto import m3sdk_disagg_pb2 as pb
from m3sdk.disagg.wire import MAX_TRANSFER_ID, WireError
from m3sdk.errors import InvalidRequestError
from m3sdk.params import SamplingParams
from m3sdk_kernels.layout import PAGE_SIZE

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: it goes into logs and maps
MIN_MESSAGE_BYTES = 64 << 10


@dataclass(frozen=True)
class Limits:
    """What a node accepts, reported by Handshake. gRPC refuses bigger calls than `max_call_bytes` before they
    are parsed. The node lowers `max_prompt_tokens` to what its KV cache can hold (PrefillServicer)."""

    max_prompt_tokens: int = 1 << 17
    # one data-plane message: a staged decode side posts buffers of up to this size (its window of them), a
    # decode side that receives in place (plans of pieces) asks for 2 GiB messages (client.py)
    max_message_bytes: int = 1 << 31
    max_deadline_s: float = 120.0  # a caller's later deadline is cut to this many seconds from its arrival
    max_in_flight: int = 32  # prefills a node holds at once; more are refused with RESOURCE_EXHAUSTED
    # once the first token is computed, the decode side must have taken every page within this many seconds:
    # a receiver that does not read (a closed transport port, a stalled process) frees the node's slot then
    receiver_timeout_s: float = 10.0
    # the image files one prefill may carry, in bytes; 0: no images (the node lowers it to 0 without a vision
    # encoder, PrefillServicer)
    max_image_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_message_bytes", "max_in_flight", "max_image_bytes"):
            value = getattr(self, name)
            least = 0 if name == "max_image_bytes" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Limits.{name} must be an int >= {least}, got {value!r}")
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(f"Limits.max_message_bytes must be >= {MIN_MESSAGE_BYTES}")
        for name in ("max_deadline_s", "receiver_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"Limits.{name} must be a positive number of seconds, got {value!r}")

    @property
    def max_call_bytes(self) -> int:
        # token ids of 4 bytes and page ids (varints of at most 5 bytes) per token at most, the image files with
        # their offsets and digests (well under 64 bytes an image, at most one image a token), small fixed fields
        images = self.max_image_bytes + 64 * self.max_prompt_tokens if self.max_image_bytes else 0
        return 9 * self.max_prompt_tokens + images + (64 << 10)


DIGEST_BYTES = 16  # m3sdk.model.image_processor's content hash


@dataclass(frozen=True)
class WireImage:
    """One image of a Prefill call, checked against the prompt: its tokens are positions [offset, offset +
    num_tokens); `data` is the image file the node decodes."""

    offset: int
    num_tokens: int
    digest: bytes
    data: bytes


@dataclass(frozen=True)
class PrefillOrder:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    transport_port: int
    transfer_id: int
    num_cached_pages: int
    dst_pages: list[int]
    layers_per_group: int
    max_message_bytes: int
    deadline: float  # time.time() seconds
    pieces: bool = False  # each message as one transport message per piece (wire.TransferPlan.pieces)
    images: tuple[WireImage, ...] = ()

    @property
    def num_pages(self) -> int:
        return -(-len(self.token_ids) // PAGE_SIZE)


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as PrefillRequest.token_ids carries them: 4-byte little-endian signed integers."""
    packed = array.array("i", token_ids)
    if packed.itemsize != 4:
        raise ValueError(f"this platform's C int is {packed.itemsize} bytes, not 4")
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """What the first token needs (output penalties have no output yet; stops apply on the decode side)."""
    return pb.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                             min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                             has_seed=params.seed is not None, seed=params.seed or 0,
                             top_logprobs=params.logprobs or 0)


def _sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=1, temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
                              min_p=msg.min_p, repetition_penalty=msg.repetition_penalty,
                              seed=msg.seed if msg.has_seed else None, ignore_eos=True,
                              logprobs=msg.top_logprobs)
    except InvalidRequestError as e:
        raise WireError(f"sampling: {e}") from e


def check_prefill(req: pb.PrefillRequest, limits: Limits, compat_hash: str, vocab_size: int,
                  num_layers: int, now: float | None = None) -> PrefillOrder:
    now = time.time() if now is None else now
    if not _REQUEST_ID.fullmatch(req.request_id):
        raise WireError("request_id must be 1-128 printable ASCII characters without spaces")
    if req.compat_hash != compat_hash:
        raise WireError(f"compat_hash {req.compat_hash[:16]!r}... does not match this node's "
                        f"{compat_hash[:16]!r}...: handshake again")
    if len(req.token_ids) % 4:
        raise WireError(f"token_ids must be 4 bytes per token, got {len(req.token_ids)} bytes")
    ids = np.frombuffer(req.token_ids, dtype="<i4")
    n = len(ids)
    if not 0 < n <= limits.max_prompt_tokens:
        raise WireError(f"token_ids must hold 1..{limits.max_prompt_tokens} tokens (the node's max_prompt_tokens), "
                        f"got {n}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise WireError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    token_ids = ids.tolist()
    if not 0 < req.transport_port < 65536:
        raise WireError(f"transport_port must be in [1, 65535], got {req.transport_port}")
    if not 0 < req.transfer_id <= MAX_TRANSFER_ID:
        raise WireError(f"transfer_id must be in [1, {MAX_TRANSFER_ID}], got {req.transfer_id}")
    num_pages = -(-n // PAGE_SIZE)
    # the last prompt token is always computed here (its logits give the first token): its page is sent
    if not 0 <= req.num_cached_pages < num_pages or req.num_cached_pages * PAGE_SIZE >= n:
        raise WireError(f"num_cached_pages must leave the last token's page to send, got {req.num_cached_pages} "
                        f"of {num_pages} pages")
    if len(req.dst_pages) != num_pages - req.num_cached_pages:
        raise WireError(f"dst_pages must name the {num_pages - req.num_cached_pages} pages sent, got "
                        f"{len(req.dst_pages)}")
    dst_pages = list(req.dst_pages)
    if min(dst_pages) < 0 or len(set(dst_pages)) != len(dst_pages):
        raise WireError("dst_pages must be distinct non-negative page ids")
    if not 0 < req.layers_per_group <= num_layers:
        raise WireError(f"layers_per_group must be in [1, {num_layers}], got {req.layers_per_group}")
    if not MIN_MESSAGE_BYTES <= req.max_message_bytes <= limits.max_message_bytes:
        raise WireError(f"max_message_bytes must be in [{MIN_MESSAGE_BYTES}, {limits.max_message_bytes}], "
                        f"got {req.max_message_bytes}")
    if not math.isfinite(req.deadline_unix_s) or not now < req.deadline_unix_s:
        raise WireError("deadline_unix_s must be a time in the future")
    images = _check_images(req.images, n, limits.max_image_bytes) if req.images else ()
    return PrefillOrder(request_id=req.request_id, token_ids=token_ids,
                        params=_sampling_from_proto(req.sampling), transport_port=req.transport_port,
                        transfer_id=req.transfer_id, num_cached_pages=req.num_cached_pages,
                        dst_pages=dst_pages, layers_per_group=req.layers_per_group,
                        max_message_bytes=req.max_message_bytes,
                        deadline=min(req.deadline_unix_s, now + limits.max_deadline_s),
                        pieces=req.message_per_piece, images=images)


def _check_images(images: Sequence[pb.PromptImage], num_tokens: int, max_bytes: int) -> tuple[WireImage, ...]:
    """The images' spans in prompt order, apart, within the prompt; their files within `max_bytes` (whether each
    span holds image tokens, and the files decode to as many tokens and the same digest, the backend checks)."""
    if not max_bytes:
        raise WireError("this node takes no images (it has no vision encoder, or max_image_bytes is 0)")
    size = sum(len(i.data) for i in images)
    if size > max_bytes:
        raise WireError(f"images of {size} bytes exceed the node's max_image_bytes of {max_bytes}")
    end = 0
    for k, image in enumerate(images):
        if image.offset < end or image.num_tokens < 1 or image.offset + image.num_tokens > num_tokens:
            raise WireError(f"image {k}: tokens [{image.offset}, {image.offset + image.num_tokens}) must be in "
                            f"prompt order, apart and within the {num_tokens}-token prompt")
        if len(image.digest) != DIGEST_BYTES or not image.data:
            raise WireError(f"image {k}: a {DIGEST_BYTES}-byte digest and the image's bytes are needed")
        end = image.offset + image.num_tokens
    return tuple(WireImage(i.offset, i.num_tokens, i.digest, i.data) for i in images)


def images_to_proto(images: Sequence[WireImage]) -> list[pb.PromptImage]:
    return [pb.PromptImage(offset=i.offset, num_tokens=i.num_tokens, digest=i.digest, data=i.data) for i in images]


def _is_logprob(x: float) -> bool:
    return math.isfinite(x) and x <= 0


def check_reply(reply: pb.PrefillReply, vocab_size: int, num_prompt_tokens: int, num_pages: int,
                num_messages: int, total_bytes: int, top_logprobs: int) -> None:
    """The node's final message must agree with what the decode side asked and received."""
    if not 0 <= reply.first_token < vocab_size:
        raise WireError(f"first_token {reply.first_token} is outside the vocabulary")
    if not _is_logprob(reply.first_logprob):
        raise WireError(f"first_logprob {reply.first_logprob} is not a log-probability")
    top = reply.top_logprobs
    if len(top) != top_logprobs:
        raise WireError(f"top_logprobs holds {len(top)} entries, {top_logprobs} were asked")
    if any(not 0 <= t.token_id < vocab_size or not _is_logprob(t.logprob) for t in top) \
            or any(a.logprob < b.logprob for a, b in zip(top, top[1:], strict=False)):
        raise WireError("top_logprobs must be in-vocabulary tokens with log-probabilities, best first")
    got = (reply.num_prompt_tokens, reply.num_pages_sent, reply.num_messages_sent, reply.bytes_sent)
    want = (num_prompt_tokens, num_pages, num_messages, total_bytes)
    if got != want:
        raise WireError(f"final message counts (tokens, pages, messages, bytes) {got} != expected {want}")

