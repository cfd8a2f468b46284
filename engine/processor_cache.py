"""LRU of processed audio features (log-mel of an item's context) keyed by content hash.

Bytes-bounded. Features processed outside the server (a client or replay that sends
log-mel) enter through `inject`. Query and hit counters feed /metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def _nbytes(value: Any) -> int:
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if hasattr(value, "element_size"):
        return int(value.element_size() * value.nelement())
    return 64


class ProcessorCache:
    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.entries: OrderedDict[str, Any] = OrderedDict()
        self.num_queries = 0
        self.num_hits = 0

    def get(self, mm_hash: str) -> Any | None:
        self.num_queries += 1
        value = self.entries.get(mm_hash)
        if value is not None:
            self.num_hits += 1
            self.entries.move_to_end(mm_hash)
        return value

    def put(self, mm_hash: str, value: Any) -> None:
        size = _nbytes(value)
        if size > self.max_bytes:
            return
        old = self.entries.pop(mm_hash, None)
        if old is not None:
            self.num_bytes -= _nbytes(old)
        self.entries[mm_hash] = value
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.num_bytes -= _nbytes(evicted)

    def inject(self, hashes: list[str], features: list[Any]) -> None:
        """Add features processed elsewhere, so the runner skips their processing."""
        if len(hashes) != len(features):
            raise ValueError(f"inject got {len(hashes)} hashes but {len(features)} features")
        for mm_hash, value in zip(hashes, features, strict=True):
            self.put(mm_hash, value)

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0
