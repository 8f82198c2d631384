"""The data plane's byte format: how a transfer's pages are cut into messages, and each message's framing.

A transfer moves pages `[num_cached_pages, num_pages)` of one prompt. It is cut into groups of layers (sent in
layer order, so a node can push a group as soon as it is computed) and, within a group, into page ranges that
keep each message under a byte cap. One message is

    header (64 B) | for each layer of the group, for each of its tensors (K, V, K scale, V scale, index keys):
                    the rows of the message's pages | trailer (16 B)

Both sides derive the same plan from the same `KVCacheSpec` (the handshake checked they agree) and the
parameters of the Prefill call, so the receiver knows every message's exact size and posts buffers of it.

A staged message travels as one UCX message, received into a staging buffer; its header and trailer are checked
against the plan before a single page is written (a message cut short, from another transfer or misplaced never
reaches the cache), then its pages are scattered into the pool. Where the destination pages form runs of
`MIN_RUN` pages or more on average (a fresh engine's page tables do), the plan carries them and the scatter (like
the node's gather) copies one contiguous piece per (layer, tensor, run), all in one `torch._foreach_copy_` with
the header and trailer, the pieces worked out once per transfer (`Layout`); otherwise one index kernel per
tensor. No host sync but the header and trailer check (one copy to the host).

A decode side that receives in place asks for a plan of `pieces`: the same bytes, each message as one transport
message per part (header, each (layer, tensor, destination run) piece, trailer), received straight into its
pages and checked once they arrived (the transport zeroes a failed transfer's pages). They beat staging from
1 GiB messages on, provided the Python work per message stays small (`Layout`) and UCX's progress thread spins on
GPU hosts (docs/perf.md).
"""

from __future__ import annotations

import bisect
import contextlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from m3sdk.cache.kv_pool import KVPool
from m3sdk.staging import to_device

MAGIC = b"M3KV"
TRAILER_MAGIC = b"M3KE"
WIRE_VERSION = 4  # 4: every message staged (2 and 3 sent host-memory messages direct): an older peer fails at the
# header (its direct message's header alone arrives in our full-size buffer) or by truncation (ours into its header)
KIND_DATA = 0
KIND_CANCEL = 1  # sent by a receiver to itself to retire a buffer it posted (ucxx cannot cancel one receive)
_HEADER = struct.Struct("<4sHHQIIHHIIQ")  # magic ver kind transfer index count layer0 nlayers page0 npages payload
_TRAILER = struct.Struct("<4sIQ")  # magic index transfer
HEADER_BYTES = 64
TRAILER_BYTES = _TRAILER.size
MESSAGE_INDEX_BITS = 20  # a tag is transfer_id << 20 | message index
MAX_TRANSFER_ID = (1 << (64 - MESSAGE_INDEX_BITS)) - 1
MAX_MESSAGES = 1 << MESSAGE_INDEX_BITS
MIN_RUN = 8  # pages per run, on average, for runs to be copied as runs (shorter: index kernels)


class WireError(ValueError):
    """A peer sent something outside the protocol: refused, never applied."""


def page_rows(pool: KVPool) -> list[list[torch.Tensor]]:
    """Per layer, its page tensors viewed as bytes `[num_pages, bytes per page]`: K, V, scales, index keys.

    Byte views make packing dtype-blind (bf16, fp8, fp32 and both layouts move the same way) and write
    through to the pool's storage.
    """
    layers = []
    for layer in range(pool.spec.num_layers):
        tensors = (pool.k[layer], pool.v[layer], pool.k_scale[layer], pool.v_scale[layer], pool.index_k[layer])
        layers.append([t.view(torch.uint8).view(t.shape[0], -1) for t in tensors if t is not None])
    return layers


@dataclass(frozen=True)
class MessageSpec:
    index: int
    first_layer: int
    num_layers: int
    page_start: int  # offset into the transfer's page list
    page_count: int
    payload_bytes: int

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes + TRAILER_BYTES

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)


@dataclass(frozen=True)
class TransferPlan:
    transfer_id: int
    num_pages: int
    messages: tuple[MessageSpec, ...]
    widths: tuple[tuple[int, ...], ...] = ()  # bytes per page of each layer's tensors
    runs: tuple[tuple[int, int, int], ...] | None = None  # (offset, first dst page, length), when long enough
    # each message travels as one transport message per part: header, each piece (`piece_bytes`), trailer (a
    # decode side that receives in place asks for it); only with runs
    pieces: bool = False

    @classmethod
    def build(cls, rows: list[list[torch.Tensor]], transfer_id: int, num_pages: int, layers_per_group: int,
              max_message_bytes: int, dst_pages: Sequence[int] | None = None, pieces: bool = False) -> TransferPlan:
        """`dst_pages`: the destination page ids (both sides know them): their runs, when long enough, let the
        decode side scatter without reading ids; without them it scatters by index. `pieces`: one UCX message per
        piece where the runs allow (see the class)."""
        if not 0 < transfer_id <= MAX_TRANSFER_ID:
            raise WireError(f"transfer_id must be in [1, {MAX_TRANSFER_ID}], got {transfer_id}")
        if not 0 < layers_per_group <= len(rows):
            raise WireError(f"layers_per_group must be in [1, {len(rows)}], got {layers_per_group}")
        if num_pages < 1:
            raise WireError(f"a transfer moves at least one page, got {num_pages}")
        messages = []
        for first in range(0, len(rows), layers_per_group):
            layers = range(first, min(first + layers_per_group, len(rows)))
            page_bytes = sum(t.shape[1] for layer in layers for t in rows[layer])
            per_message = (max_message_bytes - HEADER_BYTES - TRAILER_BYTES) // page_bytes
            if per_message < 1:
                raise WireError(f"max_message_bytes {max_message_bytes} is below one page of {len(layers)} "
                                f"layers ({page_bytes + HEADER_BYTES + TRAILER_BYTES} bytes)")
            # the group's pages cut evenly: a short last message would cost a message's worth of parts (a UCX
            # rendezvous each) for a few pages, and arrive after the others
            per_message = -(-num_pages // -(-num_pages // per_message))
            for start in range(0, num_pages, per_message):
                count = min(per_message, num_pages - start)
                messages.append(MessageSpec(len(messages), first, len(layers), start, count, count * page_bytes))
        widths = tuple(tuple(t.shape[1] for t in layer) for layer in rows)
        runs = None
        if dst_pages is not None:
            if len(dst_pages) != num_pages:
                raise WireError(f"{len(dst_pages)} destination pages for a transfer of {num_pages}")
            runs = long_runs(dst_pages)
        if len(messages) > MAX_MESSAGES:
            raise WireError(f"transfer would need {len(messages)} messages, more than {MAX_MESSAGES}")
        return cls(transfer_id, num_pages, tuple(messages), widths, runs, pieces and runs is not None)

    def piece_bytes(self, msg: MessageSpec) -> list[int]:
        """The bytes of each of message `msg`'s pieces in payload order: per layer, per tensor, per destination run
        within the message's pages (what the decode side's `Layout` cuts)."""
        lo, hi = msg.page_start, msg.page_start + msg.page_count
        counts = [min(at + n, hi) - max(at, lo) for at, _, n in self.runs or () if at < hi and at + n > lo]
        return [n * width for layer in msg.layers for width in self.widths[layer] for n in counts]

    def source_runs(self, src_pages: torch.Tensor) -> list[tuple[int, int, int]] | None:
        """The sending side's runs cut where the destination's are (`runs`, with source page ids), so that its
        pieces are the decode side's; None where the source pages break inside a destination run."""
        if self.runs is None:
            return None
        src = src_pages.tolist()
        if any(src[i + 1] - src[i] != 1 for at, _, n in self.runs for i in range(at, at + n - 1)):
            return None
        return [(at, src[at], n) for at, _, n in self.runs]

    def tag(self, index: int) -> int:
        """The UCX tag of message `index`."""
        return (self.transfer_id << MESSAGE_INDEX_BITS) | index

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.messages)


def _header(plan: TransferPlan, msg: MessageSpec, kind: int) -> bytes:
    return _HEADER.pack(MAGIC, WIRE_VERSION, kind, plan.transfer_id, msg.index, len(plan.messages),
                        msg.first_layer, msg.num_layers, msg.page_start, msg.page_count,
                        msg.payload_bytes).ljust(HEADER_BYTES, b"\0")


def _trailer(plan: TransferPlan, msg: MessageSpec) -> bytes:
    return _TRAILER.pack(TRAILER_MAGIC, msg.index, plan.transfer_id)


def long_runs(pages: Sequence[int]) -> tuple[tuple[int, int, int], ...] | None:
    """(offset, first page, length) of each run of consecutive page ids, when they are `MIN_RUN` pages long on
    average (a plan carries them; shorter: index kernels); None otherwise. In numpy: both sides work it out for
    every transfer, and a Python loop over a 32K prompt's 2048 pages took 0.3-0.6 ms on the H200 host."""
    ids = np.asarray(pages, dtype=np.int64)
    if not len(ids):
        return ()
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    if (len(breaks) + 1) * MIN_RUN > len(ids):
        return None
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], len(ids)]
    return tuple((a, page, b - a) for a, b, page in zip(starts, ends, ids[starts].tolist(), strict=True))


def _runs(pages: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """(offset, first page, length) of each run of consecutive page ids, when the pages form runs of 8 pages on
    average or longer (a fresh engine's page tables do) and live on a CPU; None otherwise (reading the ids of a
    device tensor would cost a sync, so device page ids always take the index path)."""
    if pages.device.type != "cpu":
        return None
    breaks = ((pages[1:] - pages[:-1]) != 1).nonzero().flatten() + 1
    if (len(breaks) + 1) * MIN_RUN > len(pages):
        return None
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], len(pages)]
    return [(a, page, b - a) for a, b, page in zip(starts, ends, pages[starts].tolist(), strict=True)]


def _words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two byte-row tensors of one width, both viewed as 8-byte words where the width and both addresses allow:
    gathers and scatters of uint8 rows run a byte at a time on CPUs (index_copy_ about 0.8 GB/s measured here,
    4-12 GB/s on the same rows as int64)."""
    if a.shape[1] % 8 == 0 and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0:
        return a.view(torch.int64), b.view(torch.int64)
    return a, b


class Layout:
    """Where each message of one transfer lives in one side's pool (`rows` at `pages`, the transfer's page ids on
    this side), worked out once per transfer, so that moving a message costs a few Python calls whatever its
    number of pieces: host time per message, not bytes, paces a GPU transfer (building a message's ~36 slices while
    UCX runs costs about a millisecond of Python; docs/perf.md).

    With runs (`runs`, else found in host `pages`; 8 pages or more on average: a fresh engine's page tables): a
    message is one contiguous piece per (layer, tensor, run) of the pool tensors' flat views, in payload order. The
    node gathers them with the header and trailer by one `torch.cat` into the message buffer, the decode side places
    them by one `torch._foreach_copy_` (one multi-tensor kernel on a GPU; slice copies on a CPU, about 27 GB/s
    against 5-13 for index_copy_ on the same rows; a `copy_` per piece measured slower on two H200s). The decode
    side works out every message before its first post, the node when it plans the step that computes the pages,
    before the forward (`prepare`: Python runs several times slower while UCX moves data, and pieces built between
    packs would hold the sends). Not prepared, a side works out the first message it moves alone, then eight at a
    time. `prepare` cuts each (tensor, run) of a span of messages by one `split`. 8-byte words throughout where
    every width and address allow. Without runs: one index kernel per tensor, the page ids on the pool's device once
    per transfer."""

    def __init__(self, plan: TransferPlan, rows: list[list[torch.Tensor]], pages: torch.Tensor,
                 runs: Sequence[tuple[int, int, int]] | None = None):
        if len(pages) != plan.num_pages:
            raise ValueError(f"{len(pages)} page ids for a transfer of {plan.num_pages} pages")
        self.plan, self.rows, self.pages = plan, rows, pages
        self.runs = runs if runs is not None else _runs(pages)
        self.unit, self._flat = _flat_views(rows)
        self.index = None if self.runs is not None else to_device(pages, pages.dtype, rows[0][0].device)
        self._pieces: dict[int, tuple[list[torch.Tensor], list[int]]] = {}  # message -> pool pieces, their sizes
        if self.runs is not None:
            self._starts = [at for at, _, _ in self.runs]

    def prepare(self, messages: Sequence[MessageSpec] | None = None) -> None:
        """Work out `messages` (default: all) not worked out yet."""
        if self.runs is None:
            return
        spans: list[list[MessageSpec]] = []  # runs of consecutive messages of one group of layers
        for msg in messages if messages is not None else self.plan.messages:
            if msg.index in self._pieces:
                continue
            last = spans[-1][-1] if spans else None
            if last is not None and last.index + 1 == msg.index and last.first_layer == msg.first_layer:
                spans[-1].append(msg)
            else:
                spans.append([msg])
        for msgs in spans:
            # the span's pages cut where a run or a message begins: per run, its first page and its parts (message
            # of the span, pages), the same for every tensor of the group's layers
            starts = [m.page_start for m in msgs]
            lo, hi = starts[0], msgs[-1].page_start + msgs[-1].page_count
            cuts = []
            for at, page, length in self.runs[max(0, bisect.bisect_right(self._starts, lo) - 1):]:
                if at >= hi:
                    break
                a, b = max(at, lo), min(at + length, hi)
                if a < b:
                    bounds = [a, *starts[bisect.bisect_right(starts, a):bisect.bisect_left(starts, b)], b]
                    first = bisect.bisect_right(starts, a) - 1
                    cuts.append((page + a - at, [(first + i, y - x) for i, (x, y) in
                                                 enumerate(zip(bounds, bounds[1:], strict=False))]))
            lists: list[tuple[list[torch.Tensor], list[int]]] = [([], []) for _ in msgs]
            for layer in msgs[0].layers:
                for flat, width in self._flat[layer]:
                    for page, parts in cuts:
                        if len(parts) == 1:  # a slice is cheaper than a split of one
                            k, n = parts[0]
                            lists[k][0].append(flat[page * width:(page + n) * width])
                            lists[k][1].append(n * width)
                            continue
                        sizes = [n * width for _, n in parts]
                        views = flat[page * width:page * width + sum(sizes)].split(sizes)
                        for (k, _), view, size in zip(parts, views, sizes, strict=True):
                            lists[k][0].append(view)
                            lists[k][1].append(size)
            self._pieces.update((m.index, entry) for m, entry in zip(msgs, lists, strict=True))

    def pool(self, msg: MessageSpec) -> tuple[list[torch.Tensor], list[int]]:
        """Message `msg`'s pool pieces in payload order and their sizes (in words; runs only). Not worked out yet:
        the first message a side moves alone (it must not wait for the others'), later ones eight at a time."""
        if msg.index not in self._pieces:
            self.prepare(self.plan.messages[msg.index:msg.index + (8 if self._pieces else 1)])
        return self._pieces[msg.index]

    def words(self, buf: torch.Tensor) -> torch.Tensor:
        """A message buffer as the words its pieces are counted in."""
        if buf.data_ptr() % self.unit:
            raise ValueError(f"message buffers must be {self.unit}-byte aligned")
        return _as(buf, self.unit)


_FLAT: dict[int, tuple[list[list[torch.Tensor]], int, list[list[tuple[torch.Tensor, int]]]]] = {}


def _flat_views(rows: list[list[torch.Tensor]]) -> tuple[int, list[list[tuple[torch.Tensor, int]]]]:
    """The word size of `rows` and, per layer and tensor, its flat view in words and its width: made once per pool
    (an engine's rows stay the same list), not per transfer (72 views of an 8-layer pool: on the H200 pair that is
    host time before a transfer's first gather). A few pools are kept, each with its list (so its id stays its)."""
    hit = _FLAT.get(id(rows))
    if hit is None or hit[0] is not rows:
        tensors = [t for layer in rows for t in layer]
        unit = 8 if all(t.shape[1] % 8 == 0 and t.data_ptr() % 8 == 0 for t in tensors) else 1
        hit = (rows, unit, [[(_as(t, unit).view(-1), t.shape[1] // unit) for t in layer] for layer in rows])
        while len(_FLAT) >= 8:
            _FLAT.pop(next(iter(_FLAT)))
        _FLAT[id(rows)] = hit
    return hit[1], hit[2]


def _as(t: torch.Tensor, unit: int) -> torch.Tensor:
    return t.view(torch.int64) if unit == 8 else t


def _blocks(msg: MessageSpec, rows: list[list[torch.Tensor]],
            buf: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each (pool rows, the message's block of them `[page_count, width]`) in payload order: the one layout that
    `pack` writes and `scatter` reads."""
    offset = HEADER_BYTES
    for layer in msg.layers:
        for t in rows[layer]:
            n = msg.page_count * t.shape[1]
            yield t, buf[offset:offset + n].view(msg.page_count, -1)
            offset += n


def frames(plan: TransferPlan, device: torch.device | str) -> torch.Tensor:
    """Every message's header and trailer, `[messages, HEADER_BYTES + TRAILER_BYTES]` uint8 on `device`, made once
    per transfer (on a GPU one queued copy from pinned memory), so that packing a message allocates no pinned
    memory: a pinned block per message (its copy queued behind the previous gather, so never free for reuse) would
    cost the node about a millisecond of host time per message whatever its size."""
    blob = b"".join(_header(plan, m, KIND_DATA) + _trailer(plan, m) for m in plan.messages)
    table = torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(len(plan.messages), -1)
    if torch.device(device).type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)  # torch keeps the pinned block until it ran
    return table


def pack(plan: TransferPlan, msg: MessageSpec, layout: Layout, out: torch.Tensor, framing: torch.Tensor) -> None:
    """Gather message `msg`'s pages (where `layout`, the sending side's, says) into `out`, with its header and
    trailer from `framing` (`frames`, on `out`'s device). Queued on the current stream, never waited for."""
    if out.dtype != torch.uint8 or out.numel() != msg.nbytes:
        raise ValueError(f"message {msg.index} needs a uint8 buffer of {msg.nbytes} bytes")
    if layout.runs is None:
        out[:HEADER_BYTES].copy_(framing[msg.index, :HEADER_BYTES], non_blocking=True)
        out[-TRAILER_BYTES:].copy_(framing[msg.index, HEADER_BYTES:], non_blocking=True)
        idx = layout.index[msg.page_start:msg.page_start + msg.page_count]
        for t, block in _blocks(msg, layout.rows, out):
            t, block = _words(t, block)
            torch.index_select(t, 0, idx, out=block)
        return
    pool, _ = layout.pool(msg)
    frame, head = _as(framing[msg.index], layout.unit), HEADER_BYTES // layout.unit
    torch.cat([frame[:head], *pool, frame[head:]], out=layout.words(out))


def cancel_message(plan: TransferPlan, msg: MessageSpec) -> bytes:
    """The short message that completes a posted receive of `msg` without data."""
    return _header(plan, msg, KIND_CANCEL)


def arm(buf: torch.Tensor) -> None:
    """Clear the trailer slot of a receive buffer, so a message cut short cannot pass the trailer check."""
    buf[-TRAILER_BYTES:].zero_()


def check(plan: TransferPlan, msgs: Sequence[MessageSpec], bufs: Sequence[torch.Tensor]) -> None:
    """Raise WireError unless each of `bufs` holds exactly its message of `msgs` (of `plan`): one copy to the host
    of every header and trailer, one host wait (on the current stream) for all of them."""
    ends = bytes(torch.cat([part for buf in bufs for part in (buf[:_HEADER.size], buf[-TRAILER_BYTES:])])
                 .cpu().numpy())
    step = _HEADER.size + TRAILER_BYTES
    for i, msg in enumerate(msgs):
        _check_header(plan, msg, ends[i * step:i * step + _HEADER.size])
        _check_trailer(plan, msg, ends[i * step + _HEADER.size:(i + 1) * step])


def _check_header(plan: TransferPlan, msg: MessageSpec, head: bytes) -> None:
    got = _HEADER.unpack(head)
    want = _HEADER.unpack(_header(plan, msg, KIND_DATA)[:_HEADER.size])
    if got != want:
        names = ("magic", "version", "kind", "transfer_id", "index", "count", "first_layer", "num_layers",
                 "page_start", "page_count", "payload_bytes")
        bad = [f"{n}={g!r} (expected {w!r})" for n, g, w in zip(names, got, want, strict=True) if g != w]
        raise WireError(f"message {msg.index} of transfer {plan.transfer_id}: bad header: {', '.join(bad)}")


def _check_trailer(plan: TransferPlan, msg: MessageSpec, tail: bytes) -> None:
    if tail != _trailer(plan, msg):
        raise WireError(f"message {msg.index} of transfer {plan.transfer_id}: bad trailer (cut short?)")


def scatter(plan: TransferPlan, msg: MessageSpec, layout: Layout, buf: torch.Tensor,
            stream: torch.cuda.Stream | None = None) -> None:
    """`check`, then `place`, of one message."""
    check(plan, [msg], [buf])
    place([msg], layout, [buf], stream)


def place(msgs: Sequence[MessageSpec], layout: Layout, bufs: Sequence[torch.Tensor],
          stream: torch.cuda.Stream | None = None) -> None:
    """Write the pages of `bufs`, which `check` passed, into the pool where `layout` (the receiving side's) says:
    with runs, all of them in one `_foreach_copy_`. Queued on `stream` when given (the caller waits for it before
    the pages or `bufs` are used)."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if layout.runs is None:
            for msg, buf in zip(msgs, bufs, strict=True):
                idx = layout.index[msg.page_start:msg.page_start + msg.page_count]
                for t, block in _blocks(msg, layout.rows, buf):
                    t, block = _words(t, block)
                    t.index_copy_(0, idx, block)
            return
        pool, payload = [], []
        for msg, buf in zip(msgs, bufs, strict=True):
            into, sizes = layout.pool(msg)
            pool += into
            payload += layout.words(buf)[HEADER_BYTES // layout.unit:(msg.nbytes - TRAILER_BYTES) // layout.unit] \
                .split(sizes)
        torch._foreach_copy_(pool, payload)
