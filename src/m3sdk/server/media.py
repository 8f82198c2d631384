"""What a remote client's image parts may refer to. A data URL always; an http(s) URL reaches the engine, which
refuses it unless it has an image fetcher (`m3sdk serve --allow-image-urls`: m3sdk.image_fetcher); a file on the
server (a path or a `file://` URL) only under the folder `m3sdk serve --allowed-local-media-path` names, since the
server must not read its own files for a client otherwise. Checked before anything is queued (400)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from m3sdk.chat.image_parts import image_of_part, is_image_part
from m3sdk.errors import InvalidRequestError
from m3sdk.server.errors import bad_request


def checked_media(messages: list[dict[str, Any]], allowed: Path | None) -> list[dict[str, Any]]:
    """The messages with each image part as `{"type": "image", "image": ref}`, a local file's ref resolved
    (symlinks followed) and inside `allowed`; an APIError (400) for any other local file."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(map(is_image_part, content)):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if is_image_part(part):
                where = f"messages[{i}].content[{j}]"
                try:
                    ref = image_of_part(part, where)
                except InvalidRequestError as e:
                    raise bad_request(str(e), "messages") from e
                part = {"type": "image", "image": _checked(ref, allowed, where)}
            parts.append(part)
        out.append({**message, "content": parts})
    return out


def _checked(ref: Any, allowed: Path | None, where: str) -> Any:
    if not isinstance(ref, str) or ref.startswith(("data:", "http://", "https://")):
        return ref  # the engine decodes it, refuses it, or fetches it through the application's fetcher
    if allowed is None:
        raise bad_request(f"{where}: this server reads no local image files; send the image as a data URL "
                          "(data:image/png;base64,...)", "messages")
    path = Path(ref.removeprefix("file://")).resolve()
    if not path.is_relative_to(allowed):
        raise bad_request(f"{where}: the image file is outside the folder this server may read images from",
                          "messages")
    return str(path)
