"""`m3sdk serve`: one event loop runs the engine and uvicorn; Ctrl-C or SIGTERM stops the server, then the engine."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence

import uvicorn

from m3sdk.config import EngineConfig
from m3sdk.engine import Engine
from m3sdk.server.app import build_app


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it runs (not on Windows): its loop and transports cut the per-event cost of streaming."""
    if sys.platform == "win32":
        return None
    import uvloop

    return uvloop.new_event_loop


async def serve(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                model_names: Sequence[str] | None = None, log_level: str = "info",
                allowed_local_media_path: str | None = None) -> None:
    async with Engine(config) as engine:
        app = build_app(engine, model_names=model_names, api_key=api_key,
                        allowed_local_media_path=allowed_local_media_path)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                               lifespan="off", timeout_graceful_shutdown=5, http="httptools"))
        await server.serve()
