"""Image parts of chat messages: taken out of the user messages, in order, each replaced by the image placeholder
as a text part, so that any chat template renders the placeholder where the image was (MiniMax-M3's own template
renders an image part as the same `]<]image[>[`). The engine then expands each placeholder to its image's tokens.

Accepted parts (what OpenAI, vLLM and transformers users send):
- `{"type": "image_url", "image_url": {"url": URL}}` (OpenAI; also `"image_url": URL`): a `data:image/...;base64,`
  URL, a `file://` URL or a path, or an http(s) URL (fetched only by an engine given an `image_fetcher`);
- `{"type": "image_pil", "image_pil": <PIL.Image>}` (vLLM's offline chat);
- `{"type": "image", "image": <any image form>}`, or with `"url"` / `"path"` instead of `"image"` (transformers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from m3sdk.errors import InvalidRequestError

IMAGE_PLACEHOLDER = "]<]image[>["
IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def split_image_parts(messages: Any) -> tuple[Any, list[Any]]:
    """(the messages with every image part replaced by a placeholder text part, the images in order). Messages that
    hold no image part come back as they are; malformed image parts are InvalidRequestErrors."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        return messages, []  # validate_messages says what is wrong with them
    images: list[Any] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not _listed(content) or not any(map(is_image_part, content)):
            out.append(message)
            continue
        where = f"messages[{i}]"
        if message.get("role") != "user":
            raise InvalidRequestError(f"{where}: image parts belong in user messages, not {message.get('role')!r}")
        parts = []
        for j, part in enumerate(content):
            if is_image_part(part):
                images.append(image_of_part(part, f"{where}.content[{j}]"))
                part = {"type": "text", "text": IMAGE_PLACEHOLDER}
            parts.append(part)
        out.append({**message, "content": parts})
    return (out if images else messages), images


def has_image_parts(messages: Any) -> bool:
    """Whether any message's content holds an image part (cheap: nothing is checked)."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        return False
    return any(isinstance(m, Mapping) and _listed(m.get("content")) and any(map(is_image_part, m["content"]))
               for m in messages)


def _listed(content: Any) -> bool:
    return isinstance(content, Sequence) and not isinstance(content, str | bytes)


def is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES


def image_of_part(part: Mapping[str, Any], where: str) -> Any:
    """The image an image part refers to (a URL, a path, or an image object)."""
    kind = part["type"]
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, Mapping) else ref
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(f"{where}: an image_url part is {{'type': 'image_url', 'image_url': "
                                      f"{{'url': str}}}}, got {part!r:.120}")
        return url
    keys = ("image_pil",) if kind == "image_pil" else ("image", "url", "path")
    given = [k for k in keys if part.get(k) is not None]
    if len(given) != 1:
        raise InvalidRequestError(f"{where}: an {kind} part holds one of {list(keys)}, got keys {sorted(part)}")
    return part[given[0]]
