"""Decoded tokens -> timed segments and words. Torch-free.

Whisper's tokens interleave text with timestamp tokens (one per encoder position, from
`timestamp_begin`): a pair of timestamps ends one segment and starts the next. Words are the
text split at leading spaces. Their times come from the audio where the aligner gave the
position of each text token (engine/model/timing.py); else a segment's time is spread over
its words by character count.
"""

from __future__ import annotations

import bisect
import math
import re
import string
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from engine.timeline import MAX_WINDOW_POSITIONS, TIME_PRECISION, ms_to_positions, seconds_to_ms

Tokenizer = Any  # engine.model.tokenizer.Tokenizer: decode(), id_to_token

MAX_MEDIAN_WORD_MS = 700
SENTENCE_ENDS = (".", "!", "?")
CLAUSE_ENDS = (",", ";", ":")
CLOSERS = "\"')]}\u201d\u2019"  # a quote or bracket after the mark: `said."`, `(really?)`
ELLIPSES = ("...", "\u2026")
# words no English sentence ends on (articles, possessive determiners, coordinating
# conjunctions, "of", "because"): a reading that stops on one stopped inside a sentence
OPEN_WORDS = frozenset("a an the and but or nor of my your our their its because".split())


@dataclass
class Word:
    text: str  # with its leading space, as decoded
    start_ms: int  # absolute session time
    end_ms: int
    tokens: list[int] = field(default_factory=list)
    probability: float | None = None  # the mean of its tokens' probabilities (None: unknown)
    logprob: float | None = None  # the sum of its tokens' log-probabilities (None: unknown)
    segment: int = 0  # the decode's segment it is in (SpeechMap.fit keeps or drops one whole)
    # tokens a prompt reads after it: a full stop where a live final ended on it at a pause
    # (`LocalAgreement.close`); the text stays as decoded
    stop: list[int] = field(default_factory=list)

    @property
    def key(self) -> str:
        return re.sub(r"[^\w']", "", self.text.lower())

    @property
    def mid_ms(self) -> int:
        """Its middle: which side of a time a word lies on, when its edges are estimates."""
        return (self.start_ms + self.end_ms) // 2

    @property
    def ends_sentence(self) -> bool:
        return self._last_mark.endswith(SENTENCE_ENDS)

    @property
    def ends_prompt_sentence(self) -> bool:
        """A prompt reads a sentence's end after it: its own full stop, or a `stop`."""
        return self.ends_sentence or bool(self.stop)

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens + self.stop

    @property
    def ends_clause(self) -> bool:
        return self._last_mark.endswith(CLAUSE_ENDS)

    @property
    def ends_phrase(self) -> bool:
        """A full stop or a comma ends it: a pause may follow, or the next word's first 0.1-0.4 s
        in the alignment (`aligned_words`)."""
        return self._last_mark.endswith(SENTENCE_ENDS + CLAUSE_ENDS)

    @property
    def ends_open(self) -> bool:
        """Its reading stops inside a sentence: on an ellipsis or a clause mark, or on a word
        no sentence ends on (whatever mark the decoder put after it, "across the.")."""
        return self._last_mark.endswith(ELLIPSES + CLAUSE_ENDS) or self.key in OPEN_WORDS

    @property
    def _last_mark(self) -> str:
        return self.text.rstrip().rstrip(CLOSERS)


@dataclass
class Segment:
    start: float  # seconds from the start of the audio
    end: float
    text: str
    tokens: list[int]  # text tokens
    words: list[Word] = field(default_factory=list)  # with times in ms from the audio's start
    # its tokens with their timestamps: a later window's prompt (a prompt of text alone
    # makes Whisper stop after one sentence and skip the rest of the window)
    prompt: list[int] = field(default_factory=list)


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
                                    tokenizer.decode(text_tokens), text_tokens, prompt=piece))
            last = cut
        consumed = window_seconds if single_ending else (tokens[last - 1] - ts_begin) * TIME_PRECISION
    else:
        stamps = [t for t in tokens if t >= ts_begin]
        end = window_seconds
        if stamps and stamps[-1] != ts_begin:
            end = (stamps[-1] - ts_begin) * TIME_PRECISION
        text_tokens = [t for t in tokens if t < ts_begin]
        segments.append(Segment(offset, offset + end, tokenizer.decode(text_tokens), text_tokens,
                                prompt=list(tokens)))
        consumed = window_seconds
    return segments, consumed


def word_groups(tokenizer: Tokenizer, tokens: list[int]) -> list[list[int]]:
    """Text tokens -> the tokens of each word (a word starts at a token with a leading space)."""
    groups: list[list[int]] = []
    for t in tokens:
        piece = tokenizer.id_to_token[t] if t < len(tokenizer.id_to_token) else ""
        if not groups or piece.startswith("Ġ"):
            groups.append([t])
        else:
            groups[-1].append(t)
    return groups


def segment_words(tokenizer: Tokenizer, tokens: list[int], start: float, end: float) -> list[Word]:
    """Split a segment's text tokens at leading spaces; spread its time by character count."""
    groups = word_groups(tokenizer, tokens)
    texts = [tokenizer.decode(g) for g in groups]
    total = sum(len(t.strip()) or 1 for t in texts)
    words, t0 = [], start
    for group, text in zip(groups, texts, strict=True):
        t1 = t0 + (end - start) * (len(text.strip()) or 1) / total
        words.append(Word(text, seconds_to_ms(t0), seconds_to_ms(t1), group))
        t0 = t1
    return words


def unspoken(text: str) -> bool:
    """Whether a token's text is punctuation only (a partial character is not)."""
    text = text.strip()
    return bool(text) and all(c in string.punctuation for c in text)


def aligned_words(tokenizer: Tokenizer, tokens: list[int], starts: list[float]) -> list[Word]:
    """Text tokens and, per token, the second it starts (one more: where the text ends) ->
    words timed from the audio. A word ends where its trailing punctuation starts: the
    punctuation is not spoken, and DTW gives it the pause after the word or, where there is
    none, the start of the next word (the attention follows the audio with a lag), so the
    next word starts late and the gap is left to `SpeechMap.fit`. DTW lets a word take in a
    pause next to it; a word longer than twice the median word (at most 1.4 s) at a
    sentence's or the text's edge is cut to that length on its pause side, as
    openai/whisper does."""
    words, i = [], 0
    for group in word_groups(tokenizer, tokens):
        spoken = len(group)
        while spoken > 1 and unspoken(tokenizer.decode(group[spoken - 1 : spoken])):
            spoken -= 1
        words.append(Word(tokenizer.decode(group), seconds_to_ms(starts[i]),
                          seconds_to_ms(starts[i + spoken]), group))
        i += len(group)
    durations = sorted(w.end_ms - w.start_ms for w in words if w.end_ms > w.start_ms)
    if not durations:
        return words
    longest = 2 * min(MAX_MEDIAN_WORD_MS, durations[len(durations) // 2])
    for k, word in enumerate(words):
        if word.end_ms - word.start_ms <= longest:
            continue
        if k == 0 or words[k - 1].ends_sentence:
            word.start_ms = word.end_ms - longest  # the pause before it
        elif k == len(words) - 1 or word.ends_sentence:
            word.end_ms = word.start_ms + longest  # the pause after it
    return words


def mark_segments(words: list[Word], segments: list[Segment]) -> None:
    """Number each word with the segment it is in: words aligned over the segments' text in
    one pass (a segment's text starts a word)."""
    ends = list(accumulate(len(segment.tokens) for segment in segments))  # text tokens up to each
    first = 0
    for word in words:
        word.segment = bisect.bisect_right(ends, first)
        first += len(word.tokens)


def window_words(tokenizer: Tokenizer, tokens: list[int], offset: float, seconds: float,
                 starts: list[float] | None = None) -> tuple[list[Word], float]:
    """A window's decoded tokens -> (its words in session time, the end in seconds of its
    whole segments: where offline Whisper would seek to). The window starts at `offset`
    seconds and holds `seconds` of audio; no word ends past it. `starts`: per text token
    the second it starts from the window's start, and where the text ends (the aligner's);
    None: segment times spread by character count."""
    segments, consumed = split_segments(tokens, tokenizer.timestamp_begin, offset, seconds, tokenizer)
    limit = offset + seconds
    words: list[Word] = []
    if starts is not None:
        # the segments' text is a prefix of the decode's (a tail after the last timestamp
        # pair of a decode that ran out of budget is left for the next window)
        text = [t for segment in segments for t in segment.tokens]
        words = aligned_words(tokenizer, text,
                              [offset + min(s, seconds) for s in starts[: len(text) + 1]])
        mark_segments(words, segments)
    else:
        for k, segment in enumerate(segments):
            for word in segment_words(tokenizer, segment.tokens, min(segment.start, limit),
                                      min(max(segment.end, segment.start), limit)):
                word.segment = k
                words.append(word)
    return words, offset + min(consumed, seconds)


def add_probabilities(words: list[Word], tokens: list[int], logprobs: list[float],
                      timestamp_begin: int) -> None:
    """Set each word's probability, the mean of its tokens' (as openai/whisper's), and its
    log-probability, from a decode's tokens and their log-probabilities; `words` hold a
    prefix of its text tokens."""
    text = [p for t, p in zip(tokens, logprobs, strict=True) if t < timestamp_begin]
    i = 0
    for word in words:
        n = len(word.tokens)
        if n and i + n <= len(text):
            word.probability = sum(math.exp(p) for p in text[i : i + n]) / n
            word.logprob = sum(text[i : i + n])
        i += n


def mean_logprob(words: list[Word]) -> float | None:
    """The mean log-probability of the words' tokens: how sure the decoder was of this
    reading (None: no word, or one of unknown log-probability)."""
    if not words or any(w.logprob is None for w in words):
        return None
    return sum(w.logprob for w in words if w.logprob is not None) / max(sum(len(w.tokens) for w in words), 1)


def timed_prompt(words: list[Word], timestamp_begin: int) -> list[int]:
    """Committed words as a prompt in the form Whisper was trained on, the earlier windows'
    segments with their timestamps: a segment per sentence, `<|start|> text <|end|>`, times
    from the first word's start, starting from 0 again every 30 s. (A prompt of text alone
    makes Whisper end a window after its first sentence.)"""
    out: list[int] = []
    origin, open_ = 0, False
    for k, word in enumerate(words):
        if not open_:
            if not out or ms_to_positions(word.start_ms - origin) >= MAX_WINDOW_POSITIONS:
                origin = word.start_ms
            out.append(timestamp_begin + _stamp(word.start_ms - origin))
            open_ = True
        out += word.prompt_tokens
        if word.ends_prompt_sentence or k == len(words) - 1:
            out.append(timestamp_begin + _stamp(max(word.end_ms, word.start_ms) - origin))
            open_ = False
    return out


def _stamp(ms: int) -> int:
    return min(ms_to_positions(max(ms, 0)), MAX_WINDOW_POSITIONS)


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
