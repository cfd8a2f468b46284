"""The engine's load: the share of wall time its required work takes, and what it sheds.

Required work is a step with a live final in it: a client waits for that text. Partials,
previews and background files are optional: nobody loses a word without them. When the
required share grows (more sessions, or a busy neighbour taking CPU), partials come less
often. They are not dropped: a final decode verifies its window's last partial as its draft
instead of generating every token, so finals without partials cost more. Over
`ADMIT_SHARE` no new session is taken: its finals would add to everyone's wait.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 20.0  # the share is over this much recent wall time (a few sentences of everyone)
SHED_SHARE = 0.5  # over this, partials come PARTIAL_SLOWDOWN times less often
HYSTERESIS = 0.1  # and again as often once the share is this far under SHED_SHARE
PARTIAL_SLOWDOWN = 3
# a new session is refused when the share with it would reach this: with everyone's pauses
# at once (the worst case), final latency p95 reaches 1.5 s at a share of about 0.6
ADMIT_SHARE = 0.7


class LoadMeter:
    """The wall time of recent required steps, and whether to shed partials."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.busy: deque[tuple[float, float]] = deque()  # (start, end) of required steps
        self.shedding = False

    def record(self, start: float, end: float, required: bool) -> None:
        """A step ran from `start` to `end` (monotonic seconds)."""
        if required:
            self.busy.append((start, end))

    def update(self, now: float) -> bool:
        """Whether partials are shed now (asked before each schedule)."""
        while self.busy and self.busy[0][1] <= now - self.window_s:
            self.busy.popleft()
        share = self.share(now)
        self.shedding = share >= SHED_SHARE or (self.shedding and share >= SHED_SHARE - HYSTERESIS)
        return self.shedding

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
