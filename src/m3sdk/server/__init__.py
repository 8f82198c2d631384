"""An OpenAI-compatible HTTP server over the embedded Engine (`pip install m3sdk[server]`).

    async with Engine() as engine:
        app = build_app(engine)   # any ASGI server, or `m3sdk serve`
"""

from m3sdk.server.app import build_app

__all__ = ["build_app"]
