"""The engine's load: the share of wall time its required work takes, and what it sheds.

Required work is a step with a live final in it: a client waits for that text. Partials,
previews and background files are optional: nobody loses a word without them. When the
required share grows (more sessions, or a busy neighbour taking CPU), optional work goes
first: partials come less often, then previews stop (the partials of long unbroken speech,
which commit by agreement, stay), so finals keep their latency; over
`ADMIT_SHARE` no new session is taken (its finals would add to everyone's wait).
"""

from __future__ import annotations

from collections import deque
from enum import IntEnum

WINDOW_S = 20.0  # the share is over this much recent wall time (a few sentences of everyone)
FEWER_PARTIALS_SHARE = 0.5  # over this, partials come PARTIAL_SLOWDOWN times less often
NO_PREVIEWS_SHARE = 0.7  # over this, no previews either (only partials that can commit)
ADMIT_SHARE = 0.8  # a new session is refused when the share with it would be over this
PARTIAL_SLOWDOWN = 3
HYSTERESIS = 0.1  # a level is left only once the share is this far under its threshold


class Shedding(IntEnum):
    NONE = 0
    FEWER_PARTIALS = 1  # every partial waits PARTIAL_SLOWDOWN decode intervals
    NO_PREVIEWS = 2  # and previews (shown, never committed) are not decoded at all


class LoadMeter:
    """The wall time of recent required steps, and the shedding level it calls for."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.busy: deque[tuple[float, float]] = deque()  # (start, end) of required steps
        self.shedding = Shedding.NONE

    def record(self, start: float, end: float, required: bool) -> None:
        """A step ran from `start` to `end` (monotonic seconds)."""
        if required:
            self.busy.append((start, end))

    def update(self, now: float) -> Shedding:
        """The shedding level the share calls for now (before each schedule)."""
        while self.busy and self.busy[0][1] <= now - self.window_s:
            self.busy.popleft()
        self.shedding = self._level(self.share(now))
        return self.shedding

    def _level(self, share: float) -> Shedding:
        """The deepest level whose threshold the share reaches; a level held is kept until
        the share falls HYSTERESIS under its threshold (no flapping at the edge)."""
        for level, threshold in ((Shedding.NO_PREVIEWS, NO_PREVIEWS_SHARE),
                                 (Shedding.FEWER_PARTIALS, FEWER_PARTIALS_SHARE)):
            if share >= threshold or (self.shedding >= level and share >= threshold - HYSTERESIS):
                return level
        return Shedding.NONE

    def share(self, now: float) -> float:
        """Share of the last `window_s` seconds before `now` spent on required steps."""
        since = now - self.window_s
        busy = sum(max(0.0, min(end, now) - max(start, since)) for start, end in self.busy)
        return busy / self.window_s

    def admits(self, now: float, num_sessions: int) -> bool:
        """Whether one more session fits: the share, grown by one session's part of it,
        stays under ADMIT_SHARE."""
        share = self.share(now)
        return share * (num_sessions + 1) / max(num_sessions, 1) < ADMIT_SHARE
