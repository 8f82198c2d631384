"""HttpImageFetcher: an `image_fetcher` (EngineConfig) that downloads http(s) image URLs, bounded in size and time.

The engine reads no network by default: an application (or `m3sdk serve --allow-image-urls`) opts in by passing
one. A fetch runs where its image is decoded: in a worker thread for `generate`, `chat` and the server, on the
caller's thread for `stream` and `chat_stream` (they validate as they are called); never on the engine thread.
Only http and https, no redirects (a redirect could leave the allowed domains), at most `max_bytes` read,
`timeout_s` for the whole download; `allowed_domains`, when given, names the hosts (and their subdomains; an IP
address only as itself) a URL may point to. Every failure is an InvalidRequestError with a short reason, so the
request is refused before it is queued.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from m3sdk.errors import InvalidRequestError


class HttpImageFetcher:
    def __init__(self, max_bytes: int = 20 << 20, timeout_s: float = 10.0,
                 allowed_domains: Sequence[str] | None = None):
        try:
            import httpx
        except ImportError as e:
            raise ImportError("fetching image URLs needs httpx: pip install 'm3sdk[server]'") from e
        self._httpx = httpx
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.allowed_domains = tuple(d.lower().strip(".") for d in allowed_domains) if allowed_domains else None

    def __call__(self, url: str) -> bytes:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        if parts.scheme not in ("http", "https") or not host:
            raise InvalidRequestError("an image URL must be http(s)://host/...")
        if not self._allowed(host):
            raise InvalidRequestError(f"image URLs may point to {', '.join(self.allowed_domains)} only, not {host}")
        deadline = time.monotonic() + self.timeout_s
        try:
            with self._httpx.stream("GET", url, timeout=self.timeout_s, follow_redirects=False) as response:
                if response.status_code != 200:
                    raise InvalidRequestError(f"the image URL answered HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise InvalidRequestError(f"the image at the URL is over {self.max_bytes} bytes")
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise InvalidRequestError(f"the image at the URL is over {self.max_bytes} bytes")
                    if time.monotonic() > deadline:
                        raise InvalidRequestError(f"the image URL took over {self.timeout_s:g} s")
                return bytes(data)
        except self._httpx.HTTPError as e:
            raise InvalidRequestError(f"the image URL could not be fetched: {type(e).__name__}") from e

    def _allowed(self, host: str) -> bool:
        """An allowed domain or a subdomain of one; an IP address only as itself."""
        if self.allowed_domains is None:
            return True
        try:
            ipaddress.ip_address(host)
            return host in self.allowed_domains
        except ValueError:
            return any(host == d or host.endswith("." + d) for d in self.allowed_domains)
