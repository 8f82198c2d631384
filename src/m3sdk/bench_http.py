"""The bench's HTTP target: an OpenAI-compatible endpoint's streamed /completions (`m3sdk serve`, vLLM, SGLang).

Each request is one streamed completion of the bench prompt (token ids or text) with `ignore_eos` (a vLLM extra
that m3sdk serve also reads) so every request generates its drawn length, and `stream_options.include_usage`, so
the server's own token counts replace the client's count of events. Every event that carries a choice is one
arrival: ITL is measured between events, as vLLM's benchmark_serving measures it over HTTP.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator

import httpx

from m3sdk.bench import Arrival, BenchRequest
from m3sdk.params import SamplingParams


class HTTPTarget:
    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None):
        self.base_url = base_url.rstrip("/")
        key = api_key or os.environ.get("OPENAI_API_KEY")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.model = model
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> HTTPTarget:
        # no pool cap and no timeout: the bench's concurrency, not the client's, bounds requests in flight
        self._client = httpx.AsyncClient(headers=self._headers, timeout=None,
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        if self.model is None:
            response = await self._client.get(self.base_url + "/models")
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._client.aclose()

    async def stream(self, request: BenchRequest, params: SamplingParams) -> AsyncIterator[Arrival]:
        body = {"model": self.model, "prompt": request.prompt, "max_tokens": request.output_len,
                "temperature": params.temperature, "ignore_eos": params.ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}}
        async with self._client.stream("POST", self.base_url + "/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                message = json.loads(data)
                if "error" in message:
                    raise RuntimeError(message["error"].get("message", "error event"))
                for choice in message.get("choices") or ():
                    if choice.get("finish_reason") == "abort":
                        raise RuntimeError("aborted by the server")
                    yield Arrival(1)
                if usage := message.get("usage"):
                    yield Arrival(0, usage["prompt_tokens"], usage["completion_tokens"])

    async def stats(self) -> None:
        return None
