"""The runner's side of the encoder cache: the stem outputs of the cached items.

Every item's positions are rows of one device tensor, at a slot of their own, so the
windows of a step are gathered with one index (`gather`) instead of a slice per item and
window: a step of 64 windows of 15 s reads 12,000 items, which as slices would keep a GPU
waiting on Python. The scheduler's `EncoderCacheManager` decides what is cached; `pop` follows it and
frees the slot for the next item. The tensor doubles when full and never shrinks: it holds
what the encoder cache held at its fullest (`encoder_cache_s`, 64 minutes of items: 295 MB of
float32 for tiny.en).
"""

from __future__ import annotations

import numpy as np
import torch

INITIAL_SLOTS = 1024  # items; the store doubles when full


class StemStore:
    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None  # (slots * item positions, n_state)
        self.item_positions = 0  # rows per slot, set by the first item stored
        self.slots: dict[str, int] = {}  # an item's hash -> its slot
        self.pinned: dict[str, int] = {}  # the same for what is never evicted (paddings)
        self.free: list[int] = []

    def __contains__(self, key: str) -> bool:
        return key in self.slots or key in self.pinned

    def __iter__(self):
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def put(self, keys: list[str], stems: torch.Tensor, pinned: bool = False) -> None:
        """stems: (N, positions, n_state), the item of each key (N keys, none stored yet).
        `pinned`: kept for good (not an item: not listed, never popped)."""
        if self.rows is None:
            self.item_positions = stems.shape[1]
            self.rows = stems.new_empty(INITIAL_SLOTS * self.item_positions, stems.shape[2])
            self.free = list(range(INITIAL_SLOTS - 1, -1, -1))
        if stems.shape[1] != self.item_positions:
            raise ValueError(f"items of {stems.shape[1]} positions in a store of {self.item_positions}")
        while len(self.free) < len(keys):
            self._grow()
        slots = [self.free.pop() for _ in keys]
        first = torch.tensor(slots, device=self.rows.device)[:, None] * self.item_positions
        index = (first + torch.arange(self.item_positions, device=self.rows.device)).flatten()
        self.rows[index] = stems.reshape(-1, stems.shape[2]).to(self.rows.dtype)
        (self.pinned if pinned else self.slots).update(zip(keys, slots, strict=True))

    def pop(self, key: str) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.free.append(slot)

    def get(self, key: str) -> torch.Tensor:
        """(positions, n_state) of one stored key."""
        first = self._slot(key) * self.item_positions
        return self.rows[first : first + self.item_positions]

    def gather(self, windows: list[list[tuple[str, int, int]]], pads: list[str], length: int) -> torch.Tensor:
        """Per window its pieces (key, first, end position of the item) and the key of the
        padding after them (a stored item whose first row is the padding's) ->
        (B, length, n_state): the pieces' rows in order, then padding up to `length`."""
        index = np.empty((len(windows), length), np.int64)
        for b, (pieces, pad) in enumerate(zip(windows, pads, strict=True)):
            firsts = np.array([self.slots[key] * self.item_positions + lo for key, lo, _ in pieces],
                              np.int64)
            counts = np.array([hi - lo for _, lo, hi in pieces], np.int64)
            total = int(counts.sum())
            if total > length:
                raise ValueError(f"a window of {total} positions in a batch of {length}")
            # each piece's rows: its first row, then one more per position
            index[b, :total] = np.repeat(firsts - (np.cumsum(counts) - counts), counts) + np.arange(total)
            index[b, total:] = self._slot(pad) * self.item_positions
        return self.rows[torch.from_numpy(index).to(self.rows.device)]

    def _slot(self, key: str) -> int:
        slot = self.slots.get(key)
        return self.pinned[key] if slot is None else slot

    def _grow(self) -> None:
        slots = self.rows.shape[0] // self.item_positions
        rows = self.rows.new_empty(2 * slots * self.item_positions, self.rows.shape[1])
        rows[: self.rows.shape[0]] = self.rows
        self.rows = rows
        self.free = list(range(2 * slots - 1, slots - 1, -1)) + self.free
