"""The KV transport seam: what moves a transfer's pages from a prefill node to the decode side, and its registry.

The decode side posts receive buffers for a transfer's messages (`receive`); the prefill side packs pages into
messages as they are computed and queues them in an `Outbox` (outbox.py; from any thread), which `push` sends in
order; the decode side checks each message against the plan before it scatters the pages into its pool (wire.py).

Connection direction: the decode side listens; a prefill node connects to the port the decode side declared,
on the address its gRPC call came from. So a node never parses a peer-supplied address (a malformed one can abort
the process inside UCX), and the decode side accepts nothing but messages whose 64-bit tags it posted, whose
headers and trailers it checks.

Transports are built by name from TRANSPORTS (`build_transport`); "ucx" (ucx_transport.py) is the built-in one.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from m3sdk.disagg.outbox import Outbox
from m3sdk.disagg.wire import TransferPlan
from m3sdk.registry import Registry

DEFAULT_TRANSPORT = "ucx"


class TransportError(RuntimeError):
    """The transport could not move a transfer (peer gone, connection refused, message refused)."""


class Receive(Protocol):
    async def wait(self) -> None:
        """Return once every message arrived, was checked and scattered; raise TransportError otherwise."""

    async def cancel(self) -> None:
        """Retire the posted buffers; once this returns no page of the transfer is written any more. Returns
        within the transport's drain_timeout: a receive UCX still holds then (its peer died mid-message, so no
        bytes are coming) is logged and left to UCX."""


class KVTransport(Protocol):
    name: str
    in_place: bool  # the decode side asks for plans of pieces, and a node may send from its pages (UcxTransport)

    async def start(self, listen: bool) -> None:
        """Initialize; `listen` (decode side) opens the port prefill nodes push to."""

    @property
    def port(self) -> int: ...

    def receive(self, plan: TransferPlan, rows: list[list[torch.Tensor]], dst_pages: torch.Tensor) -> Receive:
        """Post buffers for `plan` and scatter each checked message into `rows` at `dst_pages`."""

    def outbox(self, plan: TransferPlan, device: torch.device, in_place: bool = False) -> Outbox:
        """Where a producer queues the packed messages of `plan` (call on the disagg loop); `in_place`: the
        producer keeps the pages unchanged until the outbox's `released` (see Outbox), so they may be sent without
        a copy."""

    async def push(self, host: str, port: int, outbox: Outbox) -> None:
        """Send every message of `outbox.plan`, in order as they are queued, to the decode side at host:port."""

    async def close(self) -> None: ...


# name -> a KVTransport class (or factory) taking keyword options; the built-ins register themselves on import
TRANSPORTS: Registry[Any] = Registry("KV transport", builtin={"ucx": "m3sdk.disagg.ucx_transport"})


def build_transport(name: str = DEFAULT_TRANSPORT, **options: Any) -> KVTransport:
    """A new transport of the kind registered as `name` (options go to its constructor)."""
    return TRANSPORTS.get(name)(**options)
