"""Host <-> device copies that never hold the host behind the device's queue.

On a GPU a copy from pageable host memory, and a `.tolist()` of a device tensor, wait for everything queued on the
stream, e.g. the step still running in an overlapped engine or a drafter's read launched behind a verify. So every
upload here goes from pinned memory with `non_blocking`, and every download lands in pinned memory under an event
that the host waits for alone. On a CPU the same calls are plain copies.

- `to_device`: a host list (or tensor) as a new device tensor.
- `to_device_packed`: host tensors of one dtype as device tensors, in one copy.
- `UploadRing`: reused host buffers, filled by the host and uploaded into one device tensor, in turn.
- `HostCopy`: device tensors copied to the host, read once their copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a host list or tensor) as a tensor on `device` without blocking the host; a tensor already
    there is returned as it is."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor) and values.device == device:
        return values if values.dtype == dtype else values.to(dtype)
    t = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_device_packed(tensors: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host tensors of one dtype as tensors of their shapes on `device`, uploaded in one copy (from one pinned buffer
    on CUDA, freed to torch's pinned cache only once that copy has run) without blocking the host."""
    device = torch.device(device)
    if device.type != "cuda" or not tensors:
        return [t.to(device) for t in tensors]
    sizes = [t.numel() for t in tensors]
    host = torch.empty(sum(sizes), dtype=tensors[0].dtype, pin_memory=True)
    torch.cat([t.reshape(-1) for t in tensors], out=host)
    packed = host.to(device, non_blocking=True)
    return [p.view(t.shape) for p, t in zip(packed.split(sizes), tensors, strict=True)]


class UploadRing:
    """`copies` host buffers of `shape` / `dtype` (pinned for a CUDA device, zero-filled), used in turn to upload
    into device tensors: `take` the next one (it waits only for that buffer's own last upload, so that the host may
    rewrite it; with several copies that upload is, in practice, long done), fill it, `upload` its prefix. Several
    copies let the host stage a step while the upload of the one before is still queued behind the step in
    flight."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, copies: int = 1):
        cuda = device.type == "cuda"
        self._buffers = [torch.zeros(tuple(shape), dtype=dtype, pin_memory=cuda) for _ in range(copies)]
        self._uploaded = [torch.cuda.Event() if cuda else None for _ in range(copies)]
        self._turn = 0

    def take(self) -> torch.Tensor:
        """The buffer whose turn it is, free to rewrite."""
        if (done := self._uploaded[self._turn]) is not None:
            done.synchronize()
        return self._buffers[self._turn]

    def upload(self, dst: torch.Tensor, n: int | None = None) -> None:
        """Queue the copy of the taken buffer's first `n` elements (all: None) into `dst` (as many), and pass the
        turn on."""
        src = self._buffers[self._turn]
        if n is None:
            dst.copy_(src, non_blocking=True)
        else:
            dst[:n].copy_(src[:n], non_blocking=True)
        if (done := self._uploaded[self._turn]) is not None:
            done.record()
        self._turn = (self._turn + 1) % len(self._buffers)


class HostCopy:
    """Device tensors copied into host memory (pinned on CUDA) without blocking the host; `get` waits for that copy
    alone. `send` reuses the host buffers of the copy before (the host `get`s a copy before it sends the next)."""

    def __init__(self, *tensors: torch.Tensor | None):
        self._buffers: list[torch.Tensor | None] = []
        self._copies: tuple[torch.Tensor | None, ...] = ()
        self._event: torch.cuda.Event | None = None
        if tensors:
            self.send(*tensors)

    def send(self, *tensors: torch.Tensor | None) -> None:
        self._buffers += [None] * (len(tensors) - len(self._buffers))
        copies, cuda = [], False
        for i, t in enumerate(tensors):
            if t is None:
                copies.append(None)
                continue
            cuda = cuda or t.is_cuda
            buf = self._buffers[i]
            if buf is None or buf.dtype != t.dtype or buf.numel() < t.numel():
                buf = self._buffers[i] = torch.empty(max(2 * t.numel(), 64), dtype=t.dtype, pin_memory=t.is_cuda)
            copies.append(buf[:t.numel()].view(t.shape).copy_(t, non_blocking=t.is_cuda))
        self._copies = tuple(copies)
        if not cuda:
            self._event = None
            return
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> tuple[torch.Tensor | None, ...]:
        """The host copies, in the order sent (None stays None), once they have arrived."""
        if self._event is not None:
            self._event.synchronize()
        return self._copies
