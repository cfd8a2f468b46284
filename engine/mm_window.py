"""Which audio items overlap a window of the timeline: bisect, O(log n)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from engine.request import MMFeature


def _end(feature: MMFeature) -> int:
    return feature.mm_position.offset + feature.mm_position.length


def _offset(feature: MMFeature) -> int:
    return feature.mm_position.offset


def get_mm_features_in_window(features: list[MMFeature], start: int, end: int) -> tuple[int, int]:
    """-> (lo, hi): features[lo:hi] are the items overlapping positions [start, end).

    `features` is sorted and non-overlapping, so item ends and offsets are both increasing:
    lo = first item ending after `start`, hi = first item starting at or after `end`.
    """
    if start >= end:
        lo = bisect_right(features, start, key=_end)
        return lo, lo
    lo = bisect_right(features, start, key=_end)
    hi = bisect_left(features, end, lo=lo, key=_offset)
    return lo, hi


def window_pieces(items: list[MMFeature], start: int, end: int) -> list[tuple[str, int, int]]:
    """The embeddings of positions [start, end) in `items`, the items overlapping it (the
    scheduler's `mm_features[item_lo:item_hi]`): per item, in order, (item hash, first
    embedding, end embedding) of the part inside the window."""
    pieces = []
    for feature in items:
        pos = feature.mm_position
        first, last = pos.get_embeds_indices_in_range(start - pos.offset, end - pos.offset)
        pieces.append((feature.identifier, first, last))
    return pieces
