"""build_app(engine): the ASGI app of the OpenAI-compatible API over one running Engine.

The engine must be started on the event loop that serves the app (`m3sdk serve` starts both in one loop; an
application that mounts the app does the same). The app never starts or stops the engine: its owner does.
Routes under /v1 need `Authorization: Bearer <api_key>` when an api_key is given; /health and /metrics do not,
so that probes and scrapers need no secret.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from m3sdk.engine import Engine
from m3sdk.server import chat, completions
from m3sdk.server.context import ServerContext, context
from m3sdk.server.errors import APIError, install_handlers
from m3sdk.server.protocol import ErrorResponse, ModelCard, ModelList


async def _require_key(ctx: Annotated[ServerContext, Depends(context)], request: Request) -> None:
    key = ctx.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                       type="authentication_error", code="invalid_api_key")


_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 500, 503)}

ops = APIRouter()


@ops.get("/health", responses={503: {"model": ErrorResponse}})
async def health(ctx: Annotated[ServerContext, Depends(context)]) -> JSONResponse:
    """200 while the engine runs; 503 once its thread (or process) has died."""
    ctx.engine.stats()  # raises EngineDeadError -> 503
    return JSONResponse({"status": "ok"})


@ops.get("/metrics", response_class=Response,
         responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}, "description": "Prometheus text"}})
async def metrics(ctx: Annotated[ServerContext, Depends(context)]) -> Response:
    return Response(ctx.engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)


models = APIRouter()


@models.get("/v1/models", response_model=ModelList)
async def list_models(ctx: Annotated[ServerContext, Depends(context)]) -> ModelList:
    limit = ctx.engine.max_model_len
    return ModelList(data=[ModelCard(id=name, max_model_len=limit) for name in ctx.model_names])


def default_model_name(engine: Engine) -> str:
    """The bundled model's name, or the checkpoint folder's name."""
    return engine.config.model_path().name


def build_app(engine: Engine, *, model_names: Sequence[str] | None = None, api_key: str | None = None,
              allowed_local_media_path: str | Path | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine` (started). `model_names`: the names requests may give as `model`
    (default: the checkpoint folder's name); `api_key`: required as a bearer token on /v1 routes if set;
    `allowed_local_media_path`: a folder whose image files clients may name in image parts (default: none)."""
    names = tuple(model_names) if model_names else (default_model_name(engine),)
    app = FastAPI(title="m3sdk", summary="OpenAI-compatible API over an m3sdk Engine", responses=_ERRORS)
    media = Path(allowed_local_media_path).resolve() if allowed_local_media_path is not None else None
    app.state.m3sdk = ServerContext(engine, names, api_key, media)
    install_handlers(app)
    app.include_router(ops)
    for router in (models, completions.router, chat.router):
        app.include_router(router, dependencies=[Depends(_require_key)])
    return app
