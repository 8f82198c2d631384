"""The EAGLE3 drafter's own KV cache: one pool tensor with a row per request (and a scratch row for padding), and
the contexts that hold its rows. It needs nothing from the target's paged cache: a draft context holds the
positions the head has seen of one request."""

from __future__ import annotations

import torch


class DraftKV:
    """One request's entries in the drafter's cache pool: row `slot`, positions first .. first + length - 1 at
    indices 0 .. length - 1."""

    def __init__(self, first: int, slot: int):
        self.first = first
        self.slot = slot
        self.length = 0

    @property
    def end(self) -> int:
        """The position after the last entry."""
        return self.first + self.length


class DraftKVPool:
    """`kv` [slots + 1, Hkv, 2 (key, value), capacity, D]: `slots` request rows and the scratch row (`scratch`,
    the last). Keys and values side by side: one write and one gather each for both, and a context's keys are
    still one stride per (context, head) for the attention's batched GEMMs. Zero-filled: a masked key's weight is
    exactly 0, but 0 * NaN is not. Entries sit at positions below `capacity` (the RoPE table's rows)."""

    def __init__(self, num_kv_heads: int, head_dim: int, capacity: int, slots: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_kv_heads, self.head_dim, self.capacity = num_kv_heads, head_dim, capacity
        self.dtype, self.device = dtype, device
        self.kv = torch.zeros(0, num_kv_heads, 2, capacity, head_dim, dtype=dtype, device=device)
        self.free: list[int] = []
        self.grow(slots)

    @property
    def slots(self) -> int:
        return self.kv.shape[0] - 1 if self.kv.shape[0] else 0

    def grow(self, slots: int) -> None:
        """Resize to `slots` request rows (+ the scratch row), keeping the rows in use. The tensor moves: whatever
        captured its address (a CUDA graph) must be made again."""
        used = self.slots
        kv = torch.zeros(slots + 1, self.num_kv_heads, 2, self.capacity, self.head_dim, dtype=self.dtype,
                         device=self.device)
        kv[:used] = self.kv[:used]
        self.kv = kv
        self.rows = torch.arange(slots + 1, device=self.device)  # context rows of the chain's working copies
        self.free += range(used, slots)
        self.scratch = slots

    @property
    def full(self) -> bool:
        return not self.free

    def take(self, first: int) -> DraftKV:
        """A context for a request whose first entry is at position `first` (the pool must not be `full`)."""
        return DraftKV(first, self.free.pop())

    def drop(self, ctx: DraftKV) -> None:
        self.free.append(ctx.slot)

    def has_room(self, ctx: DraftKV, n: int) -> bool:
        # positions bound the entries too (the RoPE table's rows): a context starting past 0 ends before capacity
        return ctx.end + n <= self.capacity
