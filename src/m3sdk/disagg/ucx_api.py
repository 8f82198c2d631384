"""The ucxx entry points the UCX transport uses: its import (with the environment UCX needs), buffers as ucxx
takes them, tag sends and receives as asyncio futures.

CUDA buffers: UCX must see them as CUDA memory (then cuda_ipc / cuda_copy move them). Its memory type cache,
filled by CUDA allocation hooks (libucm_cuda), answers "host" for any allocation it saw no hook for; a CUDA
buffer taken for host memory is copied by the CPU: the sender dies of SIGSEGV and the receiver waits forever
(a libucx build without the libcudart that libucm_cuda loads does exactly that). ucxx turns the cache off
(UCX_MEMTYPE_CACHE=n), but only after its import loaded libucs, which reads its global options when it loads:
too late. So `load_ucxx` sets it before ucxx is imported, and UCX asks the CUDA driver about each buffer (about
a microsecond a message); UcxTransport.start refuses to run on a GPU when UCX has no CUDA transport. Every import
of ucxx in m3sdk goes through `load_ucxx`; nothing is set when m3sdk is imported (`set_environment` runs when a
UcxTransport is built, and again before ucxx is imported).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from typing import Any

import torch


class CudaBytes:
    """A CUDA tensor's bytes as ucxx takes them (`__cuda_array_interface__`), without torch's Python property
    (a dozen Python steps per message on each side)."""

    __slots__ = ("__cuda_array_interface__", "tensor")

    def __init__(self, t: torch.Tensor):
        self.tensor = t  # kept alive while UCX uses its memory
        self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.numel() * t.element_size(),),
                                         "typestr": "|u1", "strides": None, "version": 2}


def ucx_buffer(t: torch.Tensor) -> Any:
    # ucxx takes the buffer protocol (numpy for host memory) or __cuda_array_interface__ (CUDA tensors)
    if t.is_cuda:
        if not t.is_contiguous():
            raise ValueError("UCX moves contiguous buffers only")
        return CudaBytes(t)
    return t.numpy()


def set_environment() -> None:
    """The UCX settings m3sdk needs, as process environment defaults (a value the user set stays): called when a
    UcxTransport is built and before ucxx is imported, never at import."""
    # a UCX global option, read once when libucs loads (which importing ucxx does)
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    # completions reach asyncio through ucxx's notifier thread (one wake-up of the loop per batch of finished
    # requests) rather than each outstanding request's coroutine polling with asyncio.sleep(0) (ucxx's default,
    # `wait_yield`), which turns every loop pass into a sweep over all of them (docs/disaggregation.md has the
    # rates). Read by ucxx.init; the notifier thread is started from the disagg loop's (daemon) thread, so it never
    # holds a process at exit
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    # no CMA (process_vm_readv) for host memory between processes of one host: a peer killed during such a read
    # makes UCX end this process (a fatal error in cma_ep.c). Shared-memory copies carry those bytes instead, at
    # about 0.7x the rate on a CPU loopback; device memory (cuda_ipc) and other hosts (tcp, rdma) are unaffected
    os.environ.setdefault("UCX_TLS", "^cma")


def load_ucxx() -> Any:
    """The ucxx module, imported with the UCX environment it needs (module docstring)."""
    set_environment()
    import ucxx

    return ucxx


def api() -> Any:
    """ucxx's binding layer (listeners and endpoints without peer error handling: ucx_transport.py says why)."""
    load_ucxx()
    from ucxx._lib import libucxx

    return libucxx


def worker() -> Any:
    return load_ucxx().core._get_ctx().worker


_listening = threading.Lock()
_listener: Any = None
_accepted: list[Any] = []  # endpoints that peers opened to this process, kept alive with it


def listener() -> Any:
    """The process's one UCX listener (created on first use, without peer error handling as the connecting side),
    never destroyed: UCX cannot destroy a listener while a connection arrives (its async thread then runs the
    connection request callback on freed memory, openucx/ucx#11087), and a peer may connect at any moment. Every
    transport of the process receives through it: the worker is the process's too, and transfer tags are unique
    in the process (client.py)."""
    global _listener
    with _listening:
        if _listener is None:
            _listener = api().UCXListener.create(worker(), 0, _accept, (), deliver_endpoint=False)
        return _listener


def _accept(conn_request: int, *_: Any) -> None:
    # UCX's progress thread; the listener is set before its port is known to any peer
    _accepted.append(_listener.create_endpoint_from_conn_request(conn_request, False))


def using(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _held(req: Any, buf: Any) -> asyncio.Future:
    """`req`'s asyncio future (set by ucxx's notifier; an exception on UCX errors), holding the request and its
    buffer until it completes, whoever else lets go of them (a receive left to UCX after a cancel may still be
    written). The future itself, not a coroutine awaiting it in a task of its own: a completion reaches the code
    that waits for it a loop pass earlier, at no task's cost."""
    fut = req.future
    fut.add_done_callback(lambda _, held=(req, buf): None)
    return fut


def start_send(ep: Any, buf: Any, tag: int) -> asyncio.Future:
    """Post a tag send of `buf` on endpoint `ep`."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    return _held(ep.tag_send(Array(buf), Tag(tag)), buf)


def start_recv(buf: Any, tag: int) -> asyncio.Future:
    """Post a tag receive on the worker (what `ucxx.recv` does, without formatting its debug line every call)."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    return _held(worker().tag_recv(Array(buf), Tag(tag)), buf)


async def send(ep: Any, buf: Any, tag: int) -> None:
    await start_send(ep, buf, tag)
