"""Decoded tokens -> timed segments and words. Torch-free.

Whisper's tokens interleave text with timestamp tokens (one per encoder position, from
`timestamp_begin`): a pair of timestamps ends one segment and starts the next. Segments get
their times from those tokens; words are the segment's text split at leading spaces, its
time spread over them by character count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from engine.timeline import MAX_WINDOW_POSITIONS, TIME_PRECISION, seconds_to_ms

Tokenizer = Any  # engine.model.tokenizer.Tokenizer: decode(), id_to_token


@dataclass
class Word:
    text: str  # with its leading space, as decoded
    start_ms: int  # absolute session time
    end_ms: int
    tokens: list[int] = field(default_factory=list)

    @property
    def key(self) -> str:
        return re.sub(r"[^\w']", "", self.text.lower())


@dataclass
class Segment:
    start: float  # seconds from the start of the audio
    end: float
    text: str
    tokens: list[int]


def split_segments(tokens: list[int], ts_begin: int, offset: float, window_seconds: float,
                   tokenizer: Tokenizer) -> tuple[list[Segment], float]:
    """Timestamped tokens -> (segments with absolute times, seconds consumed in this window)."""
    is_ts = [t >= ts_begin for t in tokens]
    single_ending = len(tokens) >= 2 and not is_ts[-2] and is_ts[-1]
    cuts = [i for i in range(1, len(tokens)) if is_ts[i] and is_ts[i - 1]]
    segments = []
    if cuts:
        if single_ending:
            cuts.append(len(tokens))
        last = 0
        for cut in cuts:
            piece = tokens[last:cut]
            start = (piece[0] - ts_begin) * TIME_PRECISION if piece[0] >= ts_begin else 0.0
            end = (piece[-1] - ts_begin) * TIME_PRECISION if piece[-1] >= ts_begin else start
            text_tokens = [t for t in piece if t < ts_begin]
            segments.append(Segment(offset + start, offset + end,
                                    tokenizer.decode(text_tokens), text_tokens))
            last = cut
        consumed = window_seconds if single_ending else (tokens[last - 1] - ts_begin) * TIME_PRECISION
    else:
        stamps = [t for t in tokens if t >= ts_begin]
        end = window_seconds
        if stamps and stamps[-1] != ts_begin:
            end = (stamps[-1] - ts_begin) * TIME_PRECISION
        text_tokens = [t for t in tokens if t < ts_begin]
        segments.append(Segment(offset, offset + end, tokenizer.decode(text_tokens), text_tokens))
        consumed = window_seconds
    return segments, consumed


def segment_words(tokenizer: Tokenizer, tokens: list[int], start: float, end: float) -> list[Word]:
    """Split a segment's text tokens at leading spaces; spread its time by character count."""
    groups: list[list[int]] = []
    for t in tokens:
        piece = tokenizer.id_to_token[t] if t < len(tokenizer.id_to_token) else ""
        if not groups or piece.startswith("Ġ"):
            groups.append([t])
        else:
            groups[-1].append(t)
    texts = [tokenizer.decode(g) for g in groups]
    total = sum(len(t.strip()) or 1 for t in texts)
    words, t0 = [], start
    for group, text in zip(groups, texts, strict=True):
        t1 = t0 + (end - start) * (len(text.strip()) or 1) / total
        words.append(Word(text, seconds_to_ms(t0), seconds_to_ms(t1), group))
        t0 = t1
    return words


def window_words(tokenizer: Tokenizer, tokens: list[int], offset: float,
                 seconds: float) -> tuple[list[Word], float]:
    """A window's decoded tokens -> (its words in session time, the end in seconds of its
    whole segments: where offline Whisper would seek to). The window starts at `offset`
    seconds and holds `seconds` of audio; no word ends past it."""
    segments, consumed = split_segments(tokens, tokenizer.timestamp_begin, offset, seconds, tokenizer)
    words: list[Word] = []
    limit = offset + seconds
    for segment in segments:
        words += segment_words(tokenizer, segment.tokens, min(segment.start, limit),
                               min(max(segment.end, segment.start), limit))
    return words, offset + min(consumed, seconds)


def shift_timestamps(tokens: list[int], positions: int, timestamp_begin: int,
                     num_timestamps: int = MAX_WINDOW_POSITIONS + 1) -> list[int]:
    """A decode's tokens as they would read in a window starting `positions` earlier: every
    timestamp moved by that much (one timestamp token per encoder position; negative: later);
    cut before the first one that falls outside the timestamps."""
    shifted = []
    for t in tokens:
        if t >= timestamp_begin:
            t += positions
            if not timestamp_begin <= t < timestamp_begin + num_timestamps:
                break
        shifted.append(t)
    return shifted
