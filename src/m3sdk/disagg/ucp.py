"""UCP calls that ucxx's Python API lacks, through ctypes on the libucp that ucxx itself loaded (the libucx wheel),
on ucxx's worker and endpoints: tag messages from and into many buffers under one future (a message's parts: its
header slot, one piece per (layer, tensor, run of pages), its trailer slot), cancelling posted receives, and
one-sided writes into a peer's registered memory (`register` / `put`: the benchmark's raw-put probe).

Why parts: a message sent from one staging buffer must first be gathered from the pool's pages, and one received
into a staging buffer then scattered into them; sent as one UCX message per part, both copies go. UCX matches the
messages of one tag from one endpoint in the order they were sent, so the decode side posts the parts in order on
the message's tag. Each part is a rendezvous with one zero-copy read by the receiver (`cma` between processes of
one host, `cuda_ipc` between GPUs: UCX_PROTO_INFO=y); an iov message of the same parts moved through host memory
as fragments copied in and out (sysv), at 0.5 GB/s between two H200s, and on this CPU faster than contiguous
messages in 1 GiB messages but slower in 64 MiB ones and falling apart under load (docs/perf.md).

ucxx creates its worker with UCS_THREAD_MODE_MULTI (checked here with ucp_worker_query before first use), so
posting from any thread (the disagg loop's, or the node's thread that saw a message's pages computed: outbox.py)
while ucxx's progress thread progresses the worker is allowed. That thread
may sleep until the worker's event fd fires, so every post signals the worker (ucp_worker_signal), as ucxx does for
its own requests: without it a message moves only when some other event wakes the thread (a fraction of the
link's rate, and flushes that wait for seconds). Completions arrive in a ctypes callback on that thread (or inside the
post), which hands them to the operation's asyncio loop; the requests are freed there, after the waiter was woken.
ctypes releases the GIL around every foreign call, so the callback (which takes the GIL) cannot deadlock with a post
that holds the worker's lock. Every request says its buffer's memory type (UCX would otherwise ask the CUDA driver
about each buffer: UCX_MEMTYPE_CACHE=n, ucx_api.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from m3sdk.disagg import ucx_api

_VOIDP, _SIZE, _U64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
# void (*)(void *request, ucs_status_t status, void *user_data)
_SEND_CB = ctypes.CFUNCTYPE(None, _VOIDP, ctypes.c_int, _VOIDP)
# void (*)(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info, void *user_data)
_RECV_CB = ctypes.CFUNCTYPE(None, _VOIDP, ctypes.c_int, _VOIDP, _VOIDP)

_OP_ATTR_FIELD_CALLBACK = 1 << 1
_OP_ATTR_FIELD_USER_DATA = 1 << 2
_OP_ATTR_FIELD_DATATYPE = 1 << 3
_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6
_OP_ATTR_FLAG_NO_IMM_CMPL = 1 << 16  # always a request and its callback, even when UCX could finish at once
_DATATYPE_BYTES = 1 << 3  # ucp_dt_make_contig(1): a contiguous buffer, its length in bytes
_MEMORY_TYPES = {"cpu": 0, "cuda": 1}  # ucs_memory_type_t: UCS_MEMORY_TYPE_HOST, UCS_MEMORY_TYPE_CUDA
_THREAD_MODE_MULTI = 2
_ERR_LAST = (1 << 64) - 100  # a returned pointer at or above this is a negative ucs_status_t
_FULL_MASK = (1 << 64) - 1


class _RequestParam(ctypes.Structure):
    """ucp_request_param_t of UCX 1.21 (ucp/api/ucp.h), LP64."""

    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("request", _VOIDP),
                ("cb", _VOIDP),  # a union of callback pointers (_SEND_CB, _RECV_CB)
                ("datatype", _U64), ("user_data", _VOIDP), ("reply_buffer", _VOIDP),
                ("memory_type", ctypes.c_int), ("recv_info", _VOIDP), ("memh", _VOIDP)]


class UcpError(RuntimeError):
    """A UCP operation failed (its ucs_status_t and UCX's name for it)."""

    def __init__(self, status: int, what: str):
        super().__init__(f"{what}: UCX status {status} ({_lib()[1].ucs_status_string(status).decode()})" if status
                         else what)
        self.status = status


@functools.cache
def _lib() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    import libucx

    ucx_api.load_ucxx()  # loads libucx's libraries first, with their own search path

    root = os.path.join(os.path.dirname(libucx.__file__), "lib")
    ucp = ctypes.CDLL(os.path.join(root, "libucp.so"), mode=ctypes.RTLD_GLOBAL)
    ucs = ctypes.CDLL(os.path.join(root, "libucs.so"), mode=ctypes.RTLD_GLOBAL)
    ucp.ucp_tag_send_nbx.restype = _VOIDP
    ucp.ucp_tag_send_nbx.argtypes = [_VOIDP, _VOIDP, _SIZE, _U64, ctypes.POINTER(_RequestParam)]
    ucp.ucp_tag_recv_nbx.restype = _VOIDP
    ucp.ucp_tag_recv_nbx.argtypes = [_VOIDP, _VOIDP, _SIZE, _U64, _U64, ctypes.POINTER(_RequestParam)]
    ucp.ucp_request_free.argtypes = [_VOIDP]
    ucp.ucp_request_free.restype = None
    ucp.ucp_worker_query.argtypes = [_VOIDP, _VOIDP]
    ucp.ucp_worker_query.restype = ctypes.c_int
    ucp.ucp_worker_signal.argtypes = [_VOIDP]
    ucp.ucp_worker_signal.restype = ctypes.c_int
    ucp.ucp_request_cancel.argtypes = [_VOIDP, _VOIDP]
    ucp.ucp_request_cancel.restype = None
    ucp.ucp_mem_map.argtypes = [_VOIDP, _VOIDP, _VOIDP]
    ucp.ucp_mem_map.restype = ctypes.c_int
    ucp.ucp_mem_unmap.argtypes = [_VOIDP, _VOIDP]
    ucp.ucp_mem_unmap.restype = ctypes.c_int
    ucp.ucp_rkey_pack.argtypes = [_VOIDP, _VOIDP, _VOIDP, _VOIDP]
    ucp.ucp_rkey_pack.restype = ctypes.c_int
    ucp.ucp_rkey_buffer_release.argtypes = [_VOIDP]
    ucp.ucp_rkey_buffer_release.restype = None
    ucp.ucp_ep_rkey_unpack.argtypes = [_VOIDP, ctypes.c_char_p, _VOIDP]
    ucp.ucp_ep_rkey_unpack.restype = ctypes.c_int
    ucp.ucp_rkey_destroy.argtypes = [_VOIDP]
    ucp.ucp_rkey_destroy.restype = None
    ucp.ucp_put_nbx.restype = _VOIDP
    ucp.ucp_put_nbx.argtypes = [_VOIDP, _VOIDP, _SIZE, _U64, _VOIDP, ctypes.POINTER(_RequestParam)]
    ucp.ucp_ep_flush_nbx.restype = _VOIDP
    ucp.ucp_ep_flush_nbx.argtypes = [_VOIDP, ctypes.POINTER(_RequestParam)]
    ucs.ucs_status_string.argtypes = [ctypes.c_int]
    ucs.ucs_status_string.restype = ctypes.c_char_p
    return ucp, ucs


def thread_mode(worker: int) -> int:
    """The UCP worker's ucs_thread_mode_t (2: UCS_THREAD_MODE_MULTI)."""
    attr = (ctypes.c_uint64 * 32)()  # ucp_worker_attr_t: field_mask, then thread_mode; nothing else asked
    attr[0] = 1  # UCP_WORKER_ATTR_FIELD_THREAD_MODE
    status = _lib()[0].ucp_worker_query(worker, ctypes.addressof(attr))
    if status:
        raise UcpError(status, "ucp_worker_query")
    return ctypes.c_int.from_buffer(attr, 8).value


class _Op:
    """One send or receive of parts under one future: its requests, freed on the future's loop once all of them
    completed (so `cancel`, on that loop too, never meets a freed request), and what must live until then. A part
    that fails, or a receive's part filled short (a message other than the one posted for: a longer one fails as
    truncated), fails the operation, and its other receives are taken back at once (`cancel`): one message per
    piece must not leave the rest posted, waiting for bytes that will not come. `open` counts the requests not yet
    completed plus one for the posting itself, so an operation posted from another thread than its loop's settles
    only once every request it posted was recorded."""

    __slots__ = ("failed", "fut", "keep", "loop", "open", "requests", "sizes", "worker")

    def __init__(self, worker: int, fut: asyncio.Future, keep: Any, sizes: list[int]):
        self.worker, self.fut, self.keep, self.loop = worker, fut, keep, fut.get_loop()
        self.sizes = sizes  # each request's bytes posted (receives: checked against what arrived)
        self.open, self.failed, self.requests = len(sizes) + 1, "", []


_PART_BITS = 20  # user_data = operation key << _PART_BITS | request index
_ops: dict[int, _Op] = {}  # by key, until their last request completed
_by_future: dict[asyncio.Future, _Op] = {}  # until settled on the loop (for cancel)
_lock = threading.Lock()
_keys = itertools.count(1)
_multi: set[int] = set()  # workers found in UCS_THREAD_MODE_MULTI


def _settle(op: _Op) -> None:
    # the operation's loop: every request of `op` completed. The waiter is woken first (its callbacks are queued
    # ahead of the frees): freeing a message's 38 requests through ctypes took about 0.1 ms
    _by_future.pop(op.fut, None)
    if not op.fut.done():
        if op.failed:
            op.fut.set_exception(UcpError(0, op.failed))
        else:
            op.fut.set_result(None)
    requests, op.requests = op.requests, []
    op.loop.call_soon(_free, requests)


def _free(requests: list[int]) -> None:
    free = _lib()[0].ucp_request_free
    for request in requests:
        free(request)


def _done(user_data: int, status: int, received: int | None = None) -> None:
    """A request of an operation finished (`received`: a receive's bytes): the operation completes when its last
    one did, with its first failure."""
    key, index = user_data >> _PART_BITS, user_data & ((1 << _PART_BITS) - 1)
    with _lock:
        op = _ops.get(key)
        if op is None:
            return
        first = not op.failed
        if status and first:
            op.failed = f"tag message: UCX status {status} ({_lib()[1].ucs_status_string(status).decode()})"
        elif received is not None and received != op.sizes[index] and first:
            op.failed = f"tag message cut short: {received} bytes arrived for {op.sizes[index]} posted"
    _release(key, op, first and bool(op.failed))


def _release(key: int, op: _Op, failed_now: bool = False) -> None:
    """One of `op`'s open counts (a request, or the posting) is over: the last one settles it on its loop."""
    with _lock:
        op.open -= 1
        last = not op.open
        if last:
            del _ops[key]
    try:
        if last:
            op.loop.call_soon_threadsafe(_settle, op)
        elif failed_now:
            op.loop.call_soon_threadsafe(cancel, op.fut)
    except RuntimeError:  # the loop closed: nobody waits for this operation any more (its requests leak)
        pass


class _RecvInfo(ctypes.Structure):
    """ucp_tag_recv_info_t."""

    _fields_ = [("sender_tag", _U64), ("length", _SIZE)]


def _on_recv(request: int, status: int, info: int, user_data: int) -> None:
    # ucxx's progress thread (or the posting thread): the request is freed on the poster's loop (_settle)
    _done(user_data, status, _RecvInfo.from_address(info).length if info and not status else None)


_sent = _SEND_CB(lambda request, status, user_data: _done(user_data, status))
_received = _RECV_CB(_on_recv)


def _post(worker: int, keep: Any, callback: Any, calls: Sequence[tuple[int, str | None, Callable[[Any], int]]],
          loop: asyncio.AbstractEventLoop | None) -> asyncio.Future:
    """Post each of `calls` ((bytes, memory type, call(param) -> request)), in order, under one future of `loop`
    (the running one if None; posting from another thread is allowed). The memory type ("cpu", "cuda") is told to
    UCX, so that it does not look it up per buffer (None: no buffer, or let UCX find out)."""
    if worker not in _multi:
        if (mode := thread_mode(worker)) != _THREAD_MODE_MULTI:
            raise UcpError(0, f"worker thread mode {mode} is not UCS_THREAD_MODE_MULTI: no posts from this thread")
        _multi.add(worker)
    if len(calls) >> _PART_BITS:
        raise ValueError(f"{len(calls)} requests in one operation")
    fut = (loop or asyncio.get_running_loop()).create_future()
    key = next(_keys)
    mask = _OP_ATTR_FIELD_CALLBACK | _OP_ATTR_FIELD_USER_DATA | _OP_ATTR_FIELD_DATATYPE | _OP_ATTR_FLAG_NO_IMM_CMPL
    param = _RequestParam(cb=ctypes.cast(callback, _VOIDP), datatype=_DATATYPE_BYTES)
    op = _Op(worker, fut, keep, [n for n, _, _ in calls])
    with _lock:
        _ops[key] = op
    _by_future[fut] = op
    try:
        for index, (_, memory, call) in enumerate(calls):
            param.user_data = key << _PART_BITS | index  # read by UCX during the call only
            if memory is None:
                param.op_attr_mask = mask
            else:
                param.op_attr_mask, param.memory_type = mask | _OP_ATTR_FIELD_MEMORY_TYPE, _MEMORY_TYPES[memory]
            request = call(ctypes.byref(param))
            if request is None:  # done at once (a flush with nothing to wait for): no callback comes
                _done(param.user_data, 0)
            elif request >= _ERR_LAST:  # refused at once: no callback comes for this one
                _done(param.user_data, request - (1 << 64))
            else:
                op.requests.append(request)
    finally:
        _lib()[0].ucp_worker_signal(worker)  # wake the progress thread (module docstring)
        _release(key, op)  # the posting is over: the operation may settle once its requests completed
    return fut


def cancel(fut: asyncio.Future) -> None:
    """On the future's loop, for a receive posted there: take back each of its receives that no message matched yet
    (it completes with UCS_ERR_CANCELED); those a message already matched go on and complete as they will."""
    op = _by_future.get(fut)
    if op is None:
        return
    for request in list(op.requests):
        _lib()[0].ucp_request_cancel(op.worker, request)
    _lib()[0].ucp_worker_signal(op.worker)


def send(ep: int, worker: int, parts: Sequence[tuple[int, int, str]], tag: int, keep: Any = None,
         loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future:
    """Send `parts` ((address, bytes, memory type)) as one message each, in order, tagged `tag` on the UCP endpoint
    `ep` of `worker` (ucxx's `.handle` and `.worker_handle`), from any thread. Returns a future of `loop` (the
    running one if None): done once UCX let go of all the memory, or UcpError. `keep` (the objects owning those
    addresses) is held until then."""
    ucp = _lib()[0]
    return _post(worker, keep, _sent, [(n, memory, lambda param, at=at, n=n: ucp.ucp_tag_send_nbx(
        ep, at, n, tag, param)) for at, n, memory in parts], loop)


def recv(worker: int, parts: Sequence[tuple[int, int, str]], tag: int, keep: Any = None) -> asyncio.Future:
    """Post receives, in order, of what `send` sends tagged `tag` (all 64 bits) into `parts` ((address, bytes,
    memory type)) on `worker`, from the running loop. The future is done once every part was filled, or UcpError:
    UCS_ERR_MESSAGE_TRUNCATED (-9) for a message longer than its part, "cut short" for a shorter one (`_Op`)."""
    ucp = _lib()[0]
    return _post(worker, keep, _received, [(n, memory, lambda param, at=at, n=n: ucp.ucp_tag_recv_nbx(
        worker, at, n, tag, _FULL_MASK, param)) for at, n, memory in parts], None)


class _MemMapParams(ctypes.Structure):
    """ucp_mem_map_params_t."""

    _fields_ = [("field_mask", _U64), ("address", _VOIDP), ("length", _SIZE), ("flags", ctypes.c_uint),
                ("prot", ctypes.c_uint), ("memory_type", ctypes.c_int), ("exported_memh_buffer", _VOIDP)]


def register(context: int, address: int, length: int, memory: str) -> tuple[int, bytes]:
    """Map [address, address + length) of `memory` on the UCP `context` for remote writes: (its memh, its packed
    remote key, for a peer's `remote_key`)."""
    ucp = _lib()[0]
    params = _MemMapParams(field_mask=0b10011, address=address, length=length,  # address, length, memory type
                           memory_type=_MEMORY_TYPES[memory])
    memh = _VOIDP()
    if status := ucp.ucp_mem_map(context, ctypes.byref(params), ctypes.byref(memh)):
        raise UcpError(status, "ucp_mem_map")
    packed, size = _VOIDP(), _SIZE()
    if status := ucp.ucp_rkey_pack(context, memh, ctypes.byref(packed), ctypes.byref(size)):
        ucp.ucp_mem_unmap(context, memh)
        raise UcpError(status, "ucp_rkey_pack")
    blob = ctypes.string_at(packed, size.value)
    ucp.ucp_rkey_buffer_release(packed)
    return memh.value, blob


def unregister(context: int, memh: int) -> None:
    if status := _lib()[0].ucp_mem_unmap(context, memh):
        raise UcpError(status, "ucp_mem_unmap")


def remote_key(ep: int, blob: bytes) -> int:
    """A peer's packed remote key (`register`), unpacked for writes on `ep`; `drop_key` when done."""
    rkey = _VOIDP()
    if status := _lib()[0].ucp_ep_rkey_unpack(ep, blob, ctypes.byref(rkey)):
        raise UcpError(status, "ucp_ep_rkey_unpack")
    return rkey.value


def drop_key(rkey: int) -> None:
    _lib()[0].ucp_rkey_destroy(rkey)


def put(ep: int, worker: int, parts: Sequence[tuple[int, int, int, int]], keep: Any = None) -> asyncio.Future:
    """Write each of `parts` ((local address, bytes, remote address, remote key)) into the peer's registered memory,
    then flush `ep`: the future is done once every write is complete at the peer (with everything posted on `ep`
    before the flush)."""
    ucp = _lib()[0]
    calls = [(n, None, lambda param, at=at, n=n, to=to, rkey=rkey: ucp.ucp_put_nbx(ep, at, n, to, rkey, param))
             for at, n, to, rkey in parts]
    calls.append((0, None, lambda param: ucp.ucp_ep_flush_nbx(ep, param)))
    return _post(worker, keep, _sent, calls, None)
