"""A session's timeline as the scheduler sees it: its audio items and where decoding stands.

Torch-free. Positions are encoder positions (engine/timeline.py); an audio item covers a
fixed number of them (4 for 80 ms items). The session's stream (engine/stream.py) owns the
request; the scheduler reads it and notes what it scheduled.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any


@dataclass
class PlaceholderRange:
    """Where an item's embeddings sit on the session timeline (in encoder positions)."""

    offset: int  # first position of the item
    length: int  # positions the item covers
    is_embed: list[bool] | None = None  # None: every position is an embedding
    embeds_cumsum: list[int] = field(init=False, repr=False)  # running count of embeds

    def __post_init__(self) -> None:
        self.embeds_cumsum = list(accumulate(self.is_embed)) if self.is_embed is not None else []

    @property
    def end(self) -> int:
        return self.offset + self.length

    def get_num_embeds(self) -> int:
        if self.is_embed is None:
            return self.length
        return self.embeds_cumsum[-1] if self.embeds_cumsum else 0

    def get_embeds_indices_in_range(self, start: int, end: int) -> tuple[int, int]:
        """Item-relative positions [start, end) -> embedding indices [lo, hi), O(1)."""
        start, end = max(start, 0), min(end, self.length)
        if start >= end:
            return 0, 0
        if self.is_embed is None:
            return start, end
        cumsum = self.embeds_cumsum
        if not cumsum:
            return 0, 0
        lo = cumsum[start - 1] if start > 0 else 0
        return lo, cumsum[end - 1]


@dataclass
class MMFeature:
    """One audio item: its content hash, place on the timeline and host-side input."""

    identifier: str  # blake2b of context PCM + model id + feature params
    mm_position: PlaceholderRange
    data: Any | None = None  # host PCM context until the runner has processed it


class RequestStatus(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"  # input closed and everything flushed
    ABORTED = "aborted"
    ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self is not RequestStatus.RUNNING


@dataclass
class Request:
    request_id: str
    mm_features: list[MMFeature] = field(default_factory=list)  # sorted, non-overlapping
    status: RequestStatus = RequestStatus.RUNNING
    input_finished: bool = False  # no more audio will come
    flush_position: int = 0  # commit everything before this position (0: no flush pending)
    last_speech_end: int = 0  # end of the last item loud enough to be speech
    endpoints: deque[int] = field(default_factory=deque)  # pauses after speech, not yet decoded
    last_endpoint: int = 0  # the latest pause found (a pause needs speech after this)
    window_start: int = 0  # first position of the decode window (a committed boundary)
    preview_start: int = 0  # the last final window's end: all audio before it is committed
    # the due final is read again from here (the last final's end), without the context
    # before it, the window staying where it is (Stream.doubt); None: read as usual
    reread_start: int | None = None
    num_decoded_positions: int = 0  # window end at the last decode
    num_encoded_items: int = 0  # items [0, n) have encoder-cache entries or were freed
    num_freed_items: int = 0  # items [0, n) were released from the encoder cache
    output_token_ids: list[int] = field(default_factory=list)  # -1: placeholder not filled yet
    # the session's place in the scheduler's round-robin: renumbered when it is added and
    # each time it is decoded, so the lowest number is the one waiting longest
    queue_number: int = 0
    # while a final is due: its place in line among the finals of all sessions (the scheduler
    # numbers them in the order it first sees them due); None: no final waiting
    due_number: int | None = None
    # a pre-recorded file, not a live session: decoded with what live sessions leave over
    background: bool = False
    error: str | None = None

    @property
    def num_positions(self) -> int:
        """Positions covered by items on the timeline."""
        return self.mm_features[-1].mm_position.end if self.mm_features else 0

    @property
    def num_items(self) -> int:
        return len(self.mm_features)


def first_placeholder(token_ids: list[int]) -> int:
    """Index of the first -1 placeholder in the trailing run of placeholders (scan from the end).

    Placeholders are only ever appended and filled in order, so they form a suffix: walking
    back from the end touches only the pending ones, never the whole output.
    """
    i = len(token_ids)
    while i > 0 and token_ids[i - 1] == -1:
        i -= 1
    return i


def fill_placeholders(token_ids: list[int], new_ids: list[int]) -> None:
    """Replace the oldest pending placeholders with the tokens a finished step produced."""
    start = first_placeholder(token_ids)
    assert start + len(new_ids) <= len(token_ids), "more tokens than placeholders"
    token_ids[start : start + len(new_ids)] = new_ids
