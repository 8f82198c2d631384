"""Image parts through `m3sdk serve` of m3-tiny-vl, with the official `openai` client: data URLs, files under the
allowed folder only, remote URLs and bad images refused with a 400, the engine serving on; with
--allow-image-urls, http URLs fetched from a real HTTP server, within the allowed domains and size."""

import base64
import http.server
import io
import threading

import openai
import pytest
import torch
from oracle import make_vl_checkpoint
from server_process import Server

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
def checkpoint(tmp_path_factory):
    return make_vl_checkpoint(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def client(checkpoint, media):
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


class _Images(http.server.BaseHTTPRequestHandler):
    """/a.png: the image; /big.png: more bytes than the servers here fetch; /moved: a redirect to /a.png."""

    def do_GET(self) -> None:  # noqa: N802 (the handler's name is the method's)
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return
        body = {"/a.png": A, "/big.png": A + bytes(64 << 10)}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_site():
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield site.server_address[1]
    site.shutdown()


def test_the_fetcher_reads_an_image_url_within_its_bounds(image_site):
    from m3sdk.errors import InvalidRequestError
    from m3sdk.image_fetcher import HttpImageFetcher

    fetch = HttpImageFetcher(max_bytes=len(A) + 1000, allowed_domains=["127.0.0.1"])
    base = f"http://127.0.0.1:{image_site}"
    assert fetch(base + "/a.png") == A
    for url, match in ((base + "/big.png", "over"), (base + "/none.png", "HTTP 404"), (base + "/moved", "HTTP 302"),
                       (f"http://localhost:{image_site}/a.png", "may point to 127.0.0.1 only"),
                       ("ftp://127.0.0.1/a.png", "must be http"), ("http://127.0.0.1:9/a.png", "could not be fetched")):
        with pytest.raises(InvalidRequestError, match=match):
            fetch(url)
    assert HttpImageFetcher(allowed_domains=["0.0.1"])._allowed("127.0.0.1") is False


def test_a_server_with_allow_image_urls_fetches_them(checkpoint, image_site):
    srv = Server("--model", str(checkpoint), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
                 "--served-model-name", "m3-tiny-vl", "--allow-image-urls", "--allowed-media-domains", "127.0.0.1",
                 "--image-url-max-bytes", str(len(A) + 1000))
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)
        by_url = chat(client, ask(f"http://127.0.0.1:{image_site}/a.png"))
        assert by_url.choices[0].message.content == chat(client, ask(DATA_URL)).choices[0].message.content
        for url, match in ((f"http://127.0.0.1:{image_site}/big.png", "over"),
                           (f"http://localhost:{image_site}/a.png", "may point to 127.0.0.1 only")):
            with pytest.raises(openai.BadRequestError, match=match):
                chat(client, ask(url))
    finally:
        out = srv.stop()
    assert "Traceback" not in out, out
