"""A talker's pauses, step by step: the ones long enough end a live utterance (an engine's
endpoint, a realtime turn). A step is an engine's 80 ms audio item or a turn detector's 32 ms
VAD chunk ("item" below).

An item is a pause where the VAD hears no speech in it. Under other voices (a café, a room
of talkers) the VAD hears speech everywhere, so a talker's pauses never show and a final
waits for agreement, 8 s and more after the words. So once the VAD has heard speech for
`LONG_TALK_MS` without a pause, an item `DIP_DB` or more under the talker's level counts as
a pause too: the voices behind a talker reach the microphone quieter than its own. The
talker's level is a high percentile of its last few seconds of speech items: it follows a
voice that grows louder or quieter, and a word's quiet items do not lower it. A pause with
such items ends an utterance only at `DIP_PAUSE_MS`: the quiet consonants of a word and the
gaps between words, under other voices, are shorter.

Only endpoints and turns read these pauses: what is speech (the speech map, the log-mel
floor, the scheduler's decodes) is the VAD's alone. Torch-free.
"""

from __future__ import annotations

from collections import deque

LONG_TALK_MS = 8000  # speech without a VAD pause, after which quieter items are pauses too
DIP_DB = 8.0  # an item this far under the talker's level is a pause ...
DIP_PAUSE_MS = 480  # ... and a pause with such items ends an utterance at this length
TALKER_MS = 3200  # the talker's level is that of its speech items in the last this much talk ...
TALKER_PERCENTILE = 80  # ... this percentile of their levels
MIN_TALKER_MS = 800  # a level needs this much talk


class PauseTracker:
    """One stream's pauses. `dips`: quieter items count (a live talker's); else only the
    VAD's pauses do (a file's windows end at its long silences)."""

    def __init__(self, item_ms: int, endpoint_items: int, dips: bool = True):
        self.item_ms = item_ms
        self.set_endpoint(endpoint_items)  # endpoint_items, dip_items
        self.dips = dips
        self.levels: deque[float] = deque(maxlen=TALKER_MS // item_ms)  # recent speech items' dBFS
        self.talk_items = 0  # speech items since the VAD's last pause
        self.quiet_items = 0  # items in a row the VAD heard no speech in
        self.pause_items = 0  # items in a row that are pauses
        self.dipped = False  # the current pause holds a quieter item the VAD heard as speech

    def set_endpoint(self, endpoint_items: int) -> None:
        """A VAD pause of `endpoint_items` ends an utterance from now on (one with quieter
        items, at least DIP_PAUSE_MS)."""
        self.endpoint_items = endpoint_items
        self.dip_items = max(endpoint_items, -(-DIP_PAUSE_MS // self.item_ms))

    @property
    def ends_utterance(self) -> bool:
        """Whether the pause so far is long enough to end the utterance before it."""
        return self.pause_items >= (self.dip_items if self.dipped else self.endpoint_items)

    def push(self, speech: bool, level_db: float) -> bool:
        """The next item: whether the VAD heard speech in it, and its level (dBFS) ->
        whether it is a pause."""
        pause = not speech or self._dip(level_db)
        if speech:
            self.quiet_items = 0
            self.talk_items += 1
            self.levels.append(level_db)
        else:
            self.quiet_items += 1
            if self.quiet_items >= self.endpoint_items:
                self.talk_items = 0  # a pause the VAD hears: the talker's own
        if pause:
            self.pause_items += 1
            self.dipped = self.dipped or speech
        else:
            self.pause_items, self.dipped = 0, False
        return pause

    def _dip(self, level_db: float) -> bool:
        """Whether a speech item is quiet enough, under a talker who has not paused for
        LONG_TALK_MS, to be one of its pauses."""
        return (self.dips and self.talk_items * self.item_ms >= LONG_TALK_MS
                and len(self.levels) * self.item_ms >= MIN_TALKER_MS
                and level_db <= percentile(self.levels, TALKER_PERCENTILE) - DIP_DB)


def percentile(values: deque[float], q: float) -> float:
    """The q-th percentile of a few values, interpolated as numpy's default (a sort of 40
    values costs a tenth of np.percentile's call)."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    i = int(at)
    return ordered[i] + (ordered[min(i + 1, len(ordered) - 1)] - ordered[i]) * (at - i)
