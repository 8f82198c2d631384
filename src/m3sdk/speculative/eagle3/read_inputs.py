"""ReadInts: the packed int64 inputs of the EAGLE3 drafter's read graph (drafter.py `_draft_ahead`), as named
views of one buffer, so one upload fills every input of a step."""

from __future__ import annotations

import numpy as np
import torch


class ReadInts:
    """The read graph's packed int64 inputs for one batch bucket, as named views of one buffer (host: numpy, device:
    torch). Per entry row (bucket x (k + 1), context i's at i (k + 1) ..): the step row of its features and token
    (`src`), its pool row and index, its position. Per context: the flat indices (in `_drafts_out`) of the drafts
    a verify step verified and which of them count (`valid`, [bucket, k] each), its pool row, `lim`, and its first
    entry's row, working-copy index and position (`base`, [3, bucket]). Then the verdict region: a token per step
    row (the entries' next tokens, or a verify step's argmax)."""

    def __init__(self, buf: np.ndarray | torch.Tensor, bucket: int, k: int):
        rows = bucket * (k + 1)
        self.src, self.slot, self.idx, self.pos, self.drafts, self.valid, self.ctx_slot, self.lim, base, \
            self.verdict = (buf[a:b] for a, b in _runs(rows, bucket, k))
        self.base = base.reshape(3, bucket)

    @staticmethod
    def size(bucket: int, k: int) -> int:
        return _runs(bucket * (k + 1), bucket, k)[-1][1]


def _runs(rows: int, bucket: int, k: int) -> list[tuple[int, int]]:
    """`ReadInts`' fields as (start, end) runs, in order."""
    out, at = [], 0
    for n in (rows, rows, rows, rows, bucket * k, bucket * k, bucket, bucket, 3 * bucket, rows):
        out.append((at, at + n))
        at += n
    return out
