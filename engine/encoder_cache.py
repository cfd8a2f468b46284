"""Bookkeeping for the encoder cache (no tensors): which item hashes are cached, who uses them.

Sizes are in encoder positions. An entry referenced by no request stays cached in an LRU
of freeable entries until room is needed; evicted hashes are handed to the model runner,
which drops the tensors.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, cache_size: int):
        self.cache_size = cache_size  # positions the cache may hold
        self.num_free_slots = cache_size
        self.cached: dict[str, dict[str, int]] = {}  # hash -> {request id: references}
        self.sizes: dict[str, int] = {}  # hash -> positions
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced hashes, LRU first
        self.freed: list[str] = []  # evicted since the last get_freed_mm_hashes()
        self.request_cached_ids: dict[str, set[str]] = {}  # request id -> hashes it references
        self.num_queries = 0  # check_and_update_cache calls (for /metrics)
        self.num_hits = 0  # ... that found the hash cached

    def reset(self) -> None:
        """Forget every entry (the runner holding the tensors was replaced); counters stay."""
        self.num_free_slots = self.cache_size
        self.cached.clear()
        self.sizes.clear()
        self.freeable.clear()
        self.freed.clear()
        self.request_cached_ids.clear()

    def check_and_update_cache(self, request_id: str, mm_hash: str) -> bool:
        """If `mm_hash` is cached, add a reference from the request and return True."""
        self.num_queries += 1
        refs = self.cached.get(mm_hash)
        if refs is None:
            return False
        self.num_hits += 1
        if not refs:
            self.freeable.pop(mm_hash, None)
        refs[request_id] = refs.get(request_id, 0) + 1
        self.request_cached_ids.setdefault(request_id, set()).add(mm_hash)
        return True

    def can_allocate(self, num_positions: int) -> bool:
        """Whether `num_positions` fit, evicting unreferenced entries (LRU) to make room."""
        if num_positions > self.cache_size:
            return False
        while self.num_free_slots < num_positions and self.freeable:
            mm_hash, size = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            del self.sizes[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += size
        return self.num_free_slots >= num_positions

    def allocate(self, request_id: str, mm_hash: str, num_positions: int) -> None:
        assert mm_hash not in self.cached, "allocate after check_and_update_cache said no"
        assert self.num_free_slots >= num_positions, "allocate without can_allocate"
        self.cached[mm_hash] = {request_id: 1}
        self.sizes[mm_hash] = num_positions
        self.num_free_slots -= num_positions
        self.request_cached_ids.setdefault(request_id, set()).add(mm_hash)

    def free_encoder_input(self, request_id: str, mm_hash: str) -> None:
        """Drop one reference of the request to `mm_hash`.

        The request's index is cleaned even when the hash was already evicted.
        """
        refs = self.cached.get(mm_hash)
        count = refs.pop(request_id, 0) if refs is not None else 0
        if count > 1:
            refs[request_id] = count - 1  # the request still uses another item with this hash
            return
        ids = self.request_cached_ids.get(request_id)
        if ids is not None:
            ids.discard(mm_hash)
            if not ids:
                del self.request_cached_ids[request_id]
        if refs is not None and not refs:
            self.freeable[mm_hash] = self.sizes[mm_hash]

    def free(self, request_id: str) -> None:
        """Release every reference of a finished or aborted request."""
        for mm_hash in list(self.request_cached_ids.get(request_id, ())):
            refs = self.cached.get(mm_hash)
            while refs is not None and refs.get(request_id, 0) > 1:
                self.free_encoder_input(request_id, mm_hash)
            self.free_encoder_input(request_id, mm_hash)
        self.request_cached_ids.pop(request_id, None)

    def get_cached_input_ids(self, request_id: str) -> set[str]:
        """Hashes the request references, O(1)."""
        return self.request_cached_ids.get(request_id, set())

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    @property
    def num_referenced(self) -> int:
        return len(self.cached) - len(self.freeable)
