"""The engine's load: the share of wall time its required work takes, and what it sheds.

Required work is a step with a live final in it: a client waits for that text. Partials,
previews and background files are optional: nobody loses a word without them. When the
required share grows (more sessions, or a busy neighbour taking CPU), partials come less
often. They are not dropped: a final decode verifies its window's last partial as its draft
instead of generating every token, so finals without partials cost more. A final's beam
search (EngineConfig.beam_size) is spent from headroom: it runs only while the share is under
`SEARCH_SHARE`, set under what 8 sessions' greedy finals take on 2 CPU cores
(docs/performance.md, Searched finals), so a busy engine keeps its finals' latency and an idle
one reads them better.

A new session is admitted while the sessions' lag at their finals (audio received minus
audio committed, which the sessions note here) stays under `ADMIT_LAG_S` (p90 of the last
`WINDOW_S`), and while the share, with its part and that of the sessions taken in the last
`WINDOW_S` whose finals have not come yet, stays under `ADMIT_SHARE`: a session's part is
the share over the sessions whose finals it counts. (Sessions that were open the whole window
without a final are idle microphones, and cost nothing.) The lag says when the sessions
already wait for each other; the share, when one more would make them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

WINDOW_S = 20.0  # the share is over this much recent wall time (a few sentences of everyone)
MIN_SPAN_S = 5.0  # ... or the time since the first step, but at least this
SHED_SHARE = 0.5  # over this, partials come PARTIAL_SLOWDOWN times less often
HYSTERESIS = 0.1  # and again as often once the share is this far under SHED_SHARE
PARTIAL_SLOWDOWN = 3
SEARCH_SHARE = 0.2  # finals are searched while the share is under this (docs/performance.md)
# a new session is refused when the share with it would reach this (with everyone's pauses at
# once, the worst case, the p95 final latency nears 1.5 s a little under it: docs/performance.md)
ADMIT_SHARE = 0.7
# ... or while the p90 of the sessions' lags at their finals is over this (the pause that ends
# an utterance and the final's step are part of every lag)
ADMIT_LAG_S = 1.5
MIN_LAGS = 3  # lags needed for a p90


class LoadMeter:
    """The wall time of recent required steps, and whether to shed partials."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        # (start, end, ids of the live finals) of the required steps
        self.busy: deque[tuple[float, float, frozenset[str]]] = deque()
        self.shedding = False
        self.searching = True  # finals are searched with beams
        self.since: float | None = None  # the first step's start: a share needs time behind it
        self.lags: deque[tuple[float, float]] = deque()  # (when, seconds) of sessions' lags at finals

    def record(self, start: float, end: float, final_ids: Iterable[str]) -> None:
        """A step ran from `start` to `end` (monotonic seconds) with these sessions' live
        finals (none: optional work)."""
        final_ids = frozenset(final_ids)
        if self.since is None:
            self.since = start
        if final_ids:
            self.busy.append((start, end, final_ids))

    def update(self, now: float) -> bool:
        """Whether partials are shed now, and (`searching`) whether finals are searched
        (asked before each schedule)."""
        while self.busy and self.busy[0][1] <= now - self.window_s:
            self.busy.popleft()
        share = self.share(now)
        self.shedding = share >= SHED_SHARE or (self.shedding and share >= SHED_SHARE - HYSTERESIS)
        self.searching = share < SEARCH_SHARE
        return self.shedding

    def note_lag(self, now: float, lag_s: float) -> None:
        """A session's final committed words `lag_s` seconds of audio behind what it received."""
        self.lags.append((now, lag_s))
        while self.lags[0][0] <= now - self.window_s:
            self.lags.popleft()

    def lag(self, now: float) -> float:
        """The p90 of the lags noted in the last `window_s` (0 with fewer than MIN_LAGS)."""
        lags = sorted(lag for when, lag in self.lags if when > now - self.window_s)
        return lags[int(0.9 * (len(lags) - 1))] if len(lags) >= MIN_LAGS else 0.0

    def share(self, now: float) -> float:
        """Share of the last `window_s` seconds before `now` (of the time since the first
        step, when shorter, but at least MIN_SPAN_S) spent on required steps."""
        if self.since is None:
            return 0.0
        since = now - self.window_s
        busy = sum(max(0.0, min(end, now) - max(start, since)) for start, end, _ in self.busy)
        return busy / max(min(self.window_s, now - self.since), MIN_SPAN_S)

    def admits(self, now: float, sessions: dict[str, float]) -> bool:
        """Whether one more session fits. `sessions`: the open sessions' ids -> when each
        was opened (monotonic seconds)."""
        if self.lag(now) > ADMIT_LAG_S:
            return False
        share = self.share(now)
        if share == 0.0:
            return True
        counted = {i for start, end, ids in self.busy if end > now - self.window_s for i in ids}
        to_come = sum(i not in counted and opened > now - self.window_s for i, opened in sessions.items())
        part = share / max(len(counted), 1)
        return share + (to_come + 1) * part < ADMIT_SHARE
