"""What every route reads: the engine it serves and the names it answers to. One per app, set by build_app."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from m3sdk.engine import Engine
from m3sdk.server.errors import APIError


@dataclass(frozen=True)
class ServerContext:
    engine: Engine
    model_names: tuple[str, ...]  # the first is the one responses name
    api_key: str | None = None
    allowed_local_media_path: Path | None = None  # image files a client may name lie under it (resolved); None: none

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> str:
        """The served name a request's `model` refers to (404 for another; None means the served model)."""
        if model is None or model in self.model_names:
            return self.model_name
        raise APIError(404, f"The model `{model}` does not exist; this server serves {list(self.model_names)}",
                       param="model", code="model_not_found")


async def context(request: Request) -> ServerContext:
    """The FastAPI dependency that hands a route its app's context (async: FastAPI runs a plain function
    dependency in its thread pool, two thread hops per request for a dict lookup)."""
    return request.app.state.m3sdk


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
