"""The prefill node: a gRPC service (disagg/server.py) in front of a prefill backend, pushing pages over a KV
transport. Startable in-process (`PrefillNode(...).start()`) or as the `m3sdk prefill-node` daemon, which
drains gracefully on SIGTERM: new prefills are refused, running ones finish (up to a grace period). A daemon
whose engine failed stops serving and exits non-zero, so that its supervisor restarts it.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from pathlib import Path
from typing import Any

import grpc

from m3sdk.config import PREFILL_TOKEN_ENV
from m3sdk.disagg import loop
from m3sdk.disagg.messages import Limits
from m3sdk.disagg.server import PrefillBackend, PrefillServicer, check_listen, start_server, stop_server
from m3sdk.disagg.transport import KVTransport, build_transport
from m3sdk.errors import M3Error
from m3sdk.observability import get_logger

log = get_logger("m3sdk.node")


class PrefillNode:
    def __init__(self, backend: PrefillBackend, listen: str = "127.0.0.1:0", *,
                 transport: KVTransport | None = None, limits: Limits | None = None, token: str | None = None,
                 tls: tuple[bytes, bytes] | None = None, insecure: bool = False):
        self.backend = backend
        self.listen = listen
        self.transport = transport or build_transport()
        self.token, self.tls, self.insecure = token, tls, insecure
        self.node_id = uuid.uuid4().hex[:12]
        self.servicer = PrefillServicer(backend, self.transport, limits or Limits(), self.node_id)
        self.limits = self.servicer.limits  # max_prompt_tokens lowered to what the backend's cache holds
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        host = self.listen.rpartition(":")[0]
        return f"{host}:{self.port}"

    def start(self) -> PrefillNode:
        loop.run(self._start())
        log.info("prefill node serving", address=self.address, node_id=self.node_id)
        return self

    async def _start(self) -> None:
        await self.transport.start(listen=False)
        try:
            self._server, self.port = await start_server(self.servicer, self.listen, self.token, self.tls,
                                                         self.insecure)
        except BaseException:
            await self.transport.close()
            raise

    def stop(self, grace: float = 30.0) -> None:
        """Drain: refuse new prefills, let running ones finish within `grace` seconds, then stop."""
        loop.run(self._stop(grace))

    async def _stop(self, grace: float) -> None:
        await self.servicer.drain(grace)
        if self._server is not None:
            await stop_server(self._server, 1.0)
        await self.transport.close()

    def serve_until_signal(self, grace: float = 30.0) -> None:
        """Block until SIGTERM or SIGINT, then drain and stop (main thread only). If the backend fails meanwhile
        (its engine thread died), stop at once and raise M3Error: a node that cannot compute must not answer."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            if (dead := self.backend.failure()) is not None:
                log.warning("prefill node stops: its engine failed", address=self.address, error=repr(dead))
                self.stop(0.0)
                raise M3Error(f"the prefill node's engine failed: {dead!r}") from dead
        log.info("prefill node draining", address=self.address)
        self.stop(grace)


def run_prefill_node(args: Any, engine_overrides: dict[str, Any]) -> None:
    """`m3sdk prefill-node`: an engine core of its own (EngineConfig(**engine_overrides)) behind the node service,
    until SIGTERM. `args`: listen, tls_cert, tls_key.

    The shared token comes from $M3SDK_PREFILL_TOKEN (not a flag: flags show in `ps`)."""
    from m3sdk.config import EngineConfig
    from m3sdk.disagg.backend import EngineBackend

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    tls = (Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes()) if args.tls_cert else None
    check_listen(args.listen)  # before the model loads: a port in use fails at once
    flags = dict(max_prompt_tokens=args.max_prompt_tokens, max_in_flight=args.max_in_flight,
                 max_deadline_s=args.max_deadline, max_message_bytes=args.max_message_bytes,
                 receiver_timeout_s=args.receiver_timeout, max_image_bytes=args.max_image_bytes)
    limits = Limits(**{name: value for name, value in flags.items() if value is not None})
    backend = EngineBackend(EngineConfig(**engine_overrides))
    try:
        node = PrefillNode(backend, args.listen, token=os.environ.get(PREFILL_TOKEN_ENV) or None, tls=tls,
                           limits=limits, insecure=args.insecure).start()
    except BaseException:
        backend.stop()
        raise
    print(f"m3sdk prefill node {node.node_id} (max_prompt_tokens {node.limits.max_prompt_tokens}, max_in_flight "
          f"{node.limits.max_in_flight}) serving on {node.address}", flush=True)
    try:
        node.serve_until_signal()
    finally:
        backend.stop()
