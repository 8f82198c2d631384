"""Image parts through `m3sdk serve` of m3-tiny-vl, with the official `openai` client: data URLs, files under the
allowed folder only, remote URLs and bad images refused with a 400, the engine serving on."""

import base64
import io

import openai
import pytest
import torch
from conftest import Server
from oracle import make_vl_checkpoint

from m3sdk.server.errors import APIError
from m3sdk.server.media import checked_media

Image = pytest.importorskip("PIL.Image")


def png(h: int, w: int, seed: int) -> bytes:
    rgb = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    buf = io.BytesIO()
    Image.frombytes("RGB", (w, h), rgb.numpy().tobytes()).save(buf, format="PNG")
    return buf.getvalue()


A = png(100, 150, 0)  # 20 image tokens
DATA_URL = "data:image/png;base64," + base64.b64encode(A).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "a.png").write_bytes(A)
    (tmp_path_factory.mktemp("elsewhere") / "b.png").write_bytes(A)
    return folder


@pytest.fixture(scope="module")
def client(tmp_path_factory, media):
    checkpoint = make_vl_checkpoint(tmp_path_factory.mktemp("vl"))
    srv = Server("--model", str(checkpoint), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
                 "--allowed-local-media-path", str(media), "--served-model-name", "m3-tiny-vl")
    yield openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)
    out = srv.stop()
    assert "Traceback" not in out, out


def ask(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                         {"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
                                         {"type": "text", "text": "?"}]}]


def chat(client, messages, **kw):
    return client.chat.completions.create(model="m3-tiny-vl", messages=messages, max_tokens=8, temperature=0, **kw)


def test_an_image_part_by_data_url_and_by_allowed_file(client, media):
    by_data = chat(client, ask(DATA_URL))
    text = len(b"<user>What is in ?\n<assistant>")
    assert by_data.usage.prompt_tokens == text + 20 and by_data.usage.completion_tokens == 8
    by_file = chat(client, ask(f"file://{media / 'a.png'}"))
    by_path = chat(client, ask(str(media / "sub" / ".." / "a.png")))
    assert by_file.choices[0].message.content == by_path.choices[0].message.content
    assert by_file.choices[0].message.content == by_data.choices[0].message.content
    streamed = list(chat(client, ask(DATA_URL), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (
        by_data.choices[0].message.content)


@pytest.mark.parametrize("url, match", [
    ("data:image/png;base64," + base64.b64encode(b"garbage").decode(), "could not be decoded"),
    ("https://example.com/a.png", "remote image URLs are refused"),
    ("file:///etc/hostname", "outside the folder"),
    ("../elsewhere0/b.png", "outside the folder"),
])
def test_bad_or_forbidden_images_are_400s(client, media, url, match):
    if url.startswith(".."):
        url = str(media / url)
    with pytest.raises(openai.BadRequestError, match=match):
        chat(client, ask(url))
    assert chat(client, ask(DATA_URL)).usage.completion_tokens == 8  # still serving


def test_a_server_reads_no_local_files_unless_allowed(media):
    messages = ask(str(media / "a.png"))
    with pytest.raises(APIError, match="reads no local image files"):
        checked_media(messages, None)
    for smuggled in ({"type": "image_pil", "image_pil": "/etc/passwd"}, {"type": "image", "path": "/etc/passwd"}):
        with pytest.raises(APIError, match="reads no local image files"):
            checked_media([{"role": "user", "content": [smuggled]}], None)
    (part,) = checked_media([{"role": "user", "content": [{"type": "image_url", "image_url": DATA_URL}]}],
                            None)[0]["content"]
    assert part == {"type": "image", "image": DATA_URL}
