"""A transcript's words as segments and as subtitles (SRT, WebVTT).

A segment is a run of words a reader takes in one go: it ends after a sentence, at a pause,
or before it grows past a subtitle's two lines. Times are seconds from the audio's start.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from app.session import text_of
from engine.words import Word

PAUSE_MS = 1000  # a pause this long between words starts a new segment
MAX_SEGMENT_CHARS = 84  # two subtitle lines of 42 characters
SENTENCE_END = (".", "?", "!")


@dataclass
class Segment:
    start: float
    end: float
    words: list[Word]

    @property
    def text(self) -> str:
        return text_of(self.words)

    @property
    def tokens(self) -> list[int]:
        return [t for w in self.words for t in w.tokens]

    @property
    def avg_logprob(self) -> float:
        """The mean log-probability of its words (0.0 where the decoder gave none)."""
        probs = [w.probability for w in self.words if w.probability is not None]
        return sum(math.log(max(p, 1e-9)) for p in probs) / len(probs) if probs else 0.0

    @property
    def compression_ratio(self) -> float:
        """Whisper's repetition check: text bytes / zlib-compressed bytes."""
        data = self.text.encode()
        return len(data) / len(zlib.compress(data)) if data else 0.0


def segments(words: list[Word]) -> list[Segment]:
    out: list[Segment] = []
    current: list[Word] = []
    for word in words:
        if current and _breaks(current, word):
            out.append(_segment(current))
            current = []
        current.append(word)
    if current:
        out.append(_segment(current))
    return out


def _breaks(current: list[Word], word: Word) -> bool:
    last = current[-1]
    length = len(text_of(current)) + len(word.text)
    return (last.text.rstrip().endswith(SENTENCE_END) or word.start_ms - last.end_ms >= PAUSE_MS
            or length > MAX_SEGMENT_CHARS)


def _segment(words: list[Word]) -> Segment:
    return Segment(words[0].start_ms / 1000, words[-1].end_ms / 1000, words)


def _clock(seconds: float, decimal: str) -> str:
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


def srt(segs: list[Segment]) -> str:
    blocks = [f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text}\n"
              for i, s in enumerate(segs, 1)]
    return "\n".join(blocks)


def vtt(segs: list[Segment]) -> str:
    blocks = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text}\n" for s in segs]
    return "\n".join(["WEBVTT\n", *blocks])
