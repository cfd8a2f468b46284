"""Where the VAD heard speech on a timeline, and word times fitted to it."""

from __future__ import annotations

import bisect

import numpy as np

from audio.vad import CHUNK_SAMPLES, heard
from engine.timeline import samples_to_ms
from engine.words import Word

SNAP_MS = 200  # the alignment and the VAD may disagree on a word edge by this much
MIN_WORD_MS = 100  # a word whose edge moves keeps at least this long
# a decode window is moved up to speech after this much silence, keeping this much of the
# silence before the speech (streaming's Stream.skip_silence, offline transcribe)
LONG_SILENCE_MS = 3000
LEAD_IN_MS = 1000
# a window with this much VAD speech is speech, whatever Whisper's no-speech probability says
# (DecodingOptions.speech_heard); a breath or a click is not this long
HEARD_SPEECH_MS = 500
ONSET_LEAD_MS = 1000  # a first word in a run of speech starts at most this much later than the run
# ... and a word after punctuation, with no pause between, this much later than the word before
# ends (longer: a pause the VAD hears as speech, under other voices)
LAG_MS = 500
# a word's start moved back to speech with no pause before it is moved no further than makes
# the word this long per letter (at least SHORT_WORD_MS): under other voices the speech before
# a word is not its own
WORD_MS_PER_LETTER = 150
SHORT_WORD_MS = 500
WORD_SLACK_MS = 300  # `unheard`: speech this near a word may be that word's ...
LONG_WORD_EDGE_MS = 500  # ... and a word longer than twice this covers this much at each edge
UNHEARD_SPEECH_MS = 2000  # this much VAD speech between a window's words is speech it skipped
ONSET_PAD_MS = 200  # a window starts this far before a speech onset (the VAD hears onsets late)
PAUSE_MS = 300  # a window cut short ends at a pause of this much
# the reading after a live final starts this far into the pause that ended it (the VAD's
# speech ends a few tens of ms after a word; its endpoint, a quarter second later, often
# lies at the next sentence's onset)
RESUME_MS = 100


class SpeechMap:
    """Where the VAD heard speech on the session timeline, as runs of its chunks in ms.

    Cross-attention alignment lets a word take in the silence beside it (the first word of
    a window starts at the window's start) and starts the first word after a pause late;
    `fit` moves a word edge that lies in silence to the edge of the speech next to it, when
    that is within the word or SNAP_MS past it, and a late first word back to its speech."""

    PAD_MS = 30  # kept around speech: the VAD's chunks are coarse and it hears onsets late

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.starts: list[int] = []  # run starts, ms
        self.ends: list[int] = []  # run ends, ms
        self.num_chunks = 0
        self.in_speech = False
        self.last_end = 0  # ms: the end of the last speech chunk (runs behind may be forgotten)

    def push(self, probs: np.ndarray) -> None:
        """The VAD's speech probability of the timeline's next chunks."""
        for prob in probs:
            k = self.num_chunks
            self.num_chunks += 1
            self.in_speech = heard((prob,), self.in_speech, self.threshold)
            if not self.in_speech:
                continue
            start, end = samples_to_ms(k * CHUNK_SAMPLES), samples_to_ms((k + 1) * CHUNK_SAMPLES)
            self.last_end = end
            if self.ends and self.ends[-1] >= start:
                self.ends[-1] = end
            else:
                self.starts.append(start)
                self.ends.append(end)

    @property
    def quiet_ms(self) -> int:
        """How long the VAD has heard no speech, up to the last chunk it heard."""
        return samples_to_ms(self.num_chunks * CHUNK_SAMPLES) - self.last_end

    def forget_before(self, ms: int) -> None:
        """Drop the runs that end before `ms` (behind the decode window)."""
        n = bisect.bisect_left(self.ends, ms)
        del self.starts[:n], self.ends[:n]

    def next_speech(self, ms: int) -> int | None:
        """Where speech is next heard at or after `ms` (None: not yet)."""
        k = bisect.bisect_right(self.ends, ms)  # the first run ending after ms
        return max(self.starts[k], ms) if k < len(self.starts) else None

    def onset_within(self, start_ms: int, end_ms: int) -> int | None:
        """Where the first run of speech that begins in [start_ms, end_ms) begins (None: none)."""
        k = bisect.bisect_left(self.starts, start_ms)
        return self.starts[k] if k < len(self.starts) and self.starts[k] < end_ms else None

    def pause_after(self, start_ms: int, speech_ms: int, pause_ms: int) -> int | None:
        """Where the first pause of at least `pause_ms` begins once `speech_ms` of speech has
        been heard from `start_ms` (None: not in what the VAD has analysed)."""
        first = bisect.bisect_right(self.ends, start_ms)  # the first run ending after start_ms
        heard = 0
        for k in range(first, len(self.starts)):
            heard += self.ends[k] - max(self.starts[k], start_ms)
            following = self.starts[k + 1] if k + 1 < len(self.starts) else None
            if heard >= speech_ms and (following is None or following - self.ends[k] >= pause_ms):
                return self.ends[k]
        return None

    def after_pause(self, end_ms: int) -> int:
        """Where the reading after a live final that ended at `end_ms` (its endpoint) starts:
        RESUME_MS into the pause that ended it, the end of the last run of speech before
        `end_ms`. A run that begins within ONSET_PAD_MS before `end_ms` is the next speech, its
        onset heard before the endpoint's item. The pause, not the endpoint: where pauses are
        short, the next sentence begins at the endpoint or before it, and a window that starts
        at its onset, or inside its first word, reads that word wrong or not at all ("Pour in"
        read "Or,"). `end_ms` itself where no pause is heard before it (speech runs through it,
        or the runs before it are forgotten)."""
        k = bisect.bisect_left(self.starts, end_ms) - 1  # the last run that begins before end_ms
        if k >= 0 and self.starts[k] >= end_ms - ONSET_PAD_MS:
            k -= 1
        if k < 0 or self.ends[k] >= end_ms:
            return end_ms
        return min(end_ms, self.ends[k] + RESUME_MS)

    def past_tail(self, end_ms: int, tail_ms: int) -> int:
        """Where a reading after words that end at `end_ms` starts: RESUME_MS into the pause
        after the run of speech `end_ms` lies in, where that run ends within `tail_ms` (the
        last word's sound, its aligned end early), and ONSET_PAD_MS or more before the next
        run; else `end_ms`."""
        k = bisect.bisect_right(self.starts, end_ms) - 1  # the run that begins at or before end_ms
        if k < 0 or not end_ms < self.ends[k] <= end_ms + tail_ms:
            return end_ms
        start = self.ends[k] + RESUME_MS
        if k + 1 < len(self.starts):
            start = min(start, self.starts[k + 1] - ONSET_PAD_MS)
        return max(end_ms, start)

    def skip_end(self, hole: tuple[int, int]) -> int | None:
        """Where a window that skipped the speech of `hole` (`unheard`) ends when it is decoded
        again: ONSET_PAD_MS into the first pause after UNHEARD_SPEECH_MS of that speech, or
        where its words resume (None: no such pause heard)."""
        pause = self.pause_after(hole[0], UNHEARD_SPEECH_MS, PAUSE_MS)
        return None if pause is None else min(hole[1], pause + ONSET_PAD_MS)

    def resume_at(self, last_ms: int, end_ms: int, window_end_ms: int | None = None) -> int | None:
        """Where a window consumed up to `end_ms` goes on after its last word kept (ending at
        `last_ms`) when speech begins between them, or within ONSET_PAD_MS after `end_ms` (the
        VAD hears an onset late, and a window that starts inside a sentence's first word reads
        it from the next on): ONSET_PAD_MS before that onset, as a late segment end cuts it
        off. Given the window's end, also where its decode stopped reading run-on speech
        (UNHEARD_SPEECH_MS of it past the word, with no pause up to `end_ms`): at the word's
        end, as the segment's end stretches over the speech not read. None: neither."""
        onset = self.onset_within(last_ms + WORD_SLACK_MS, end_ms + ONSET_PAD_MS)
        if onset is not None:
            return onset - ONSET_PAD_MS  # (past the last word: WORD_SLACK_MS > ONSET_PAD_MS)
        after = end_ms - last_ms
        if window_end_ms is not None and after > WORD_SLACK_MS and self.speech_ms(last_ms, end_ms) == after \
                and self.speech_ms(last_ms + WORD_SLACK_MS, window_end_ms) >= UNHEARD_SPEECH_MS:
            return last_ms
        return None

    def runs(self, start_ms: int, end_ms: int) -> list[tuple[int, int]]:
        """The runs of speech that overlap [start_ms, end_ms), as (start, end) in ms."""
        k = bisect.bisect_right(self.ends, start_ms)  # the first run ending after start_ms
        found = []
        while k < len(self.starts) and self.starts[k] < end_ms:
            found.append((self.starts[k], self.ends[k]))
            k += 1
        return found

    def speech_ms(self, start_ms: int, end_ms: int) -> int:
        """How much of [start_ms, end_ms) the VAD heard as speech."""
        k = bisect.bisect_right(self.ends, start_ms)  # the first run ending after start_ms
        total = 0
        while k < len(self.starts) and self.starts[k] < end_ms:
            total += min(self.ends[k], end_ms) - max(self.starts[k], start_ms)
            k += 1
        return total

    def unread(self, end_ms: int, until_ms: int) -> tuple[int, int]:
        """The speech in [end_ms, until_ms) after words that end at `end_ms` (ms): all the VAD
        heard, and that in runs beginning PAUSE_MS or more after `end_ms` (not their tail)."""
        k = bisect.bisect_left(self.starts, end_ms + PAUSE_MS)  # the first such run
        after = self.speech_ms(self.starts[k], until_ms) if k < len(self.starts) else 0
        return self.speech_ms(end_ms, until_ms), after

    def _ended(self, run: int) -> bool:
        """Whether the VAD heard the end of a run (not the speech it still hears)."""
        return run + 1 < len(self.ends) or not self.in_speech

    def _across_pause(self, i: int, word: Word) -> bool:
        """Whether `word`, starting in run `i`, reaches over a pause of at least PAUSE_MS into
        the next run and lies mostly there: DTW gives a pause to the word after it where no
        timestamp or punctuation stands between them, and the word then starts in the
        speech before the pause (the VAD's hangover of it)."""
        if i + 1 >= len(self.starts):
            return False
        end, after = self.ends[i] + self.PAD_MS, self.starts[i + 1] - self.PAD_MS
        return after - end >= PAUSE_MS and word.start_ms < end and word.end_ms - after > end - word.start_ms

    def _after_pause(self, i: int) -> bool:
        """Whether run `i` begins after a pause (PAUSE_MS or more, or nothing heard before it):
        its onset is the speech's own, not a dip in other voices'."""
        return i == 0 or self.starts[i] - self.ends[i - 1] >= PAUSE_MS

    def _leads_in(self, i: int, k: int, words: list[Word], before: int) -> bool:
        """Whether words[k] lies in silence before run `i`, where the alignment starts the
        words (`before`: the word before it ends, or the window starts) with no speech
        between, and its segment goes on after it: DTW left a segment's first word at the
        start of a window that opens on the silence before speech (offline read " Let",
        zero seconds long, 1 s before the speech after a 40 s gap of noise). It is spoken
        where the speech starts. (A word the VAD did not hear between runs of speech it did
        hear stays where it is: a voice it barely hears; so does one whose next word DTW also
        places before the run: speech the VAD hears late, after a tune that just ended.)"""
        word, onset = words[k], self.starts[i] - self.PAD_MS
        return (k + 1 < len(words) and words[k + 1].segment == word.segment
                and words[k + 1].start_ms >= onset - SNAP_MS
                and word.start_ms < before + SNAP_MS and not self._near_speech(word)
                and (i == 0 or self.ends[i - 1] + self.PAD_MS <= before))

    def _near_speech(self, word: Word) -> bool:
        """Whether a run of speech comes within SNAP_MS of the word."""
        k = bisect.bisect_left(self.ends, word.start_ms - SNAP_MS)  # the first run ending after
        return k < len(self.starts) and self.starts[k] <= word.end_ms + SNAP_MS

    def heard(self, start_ms: int, end_ms: int) -> bool:
        """Whether [start_ms, end_ms) holds HEARD_SPEECH_MS of speech: a decode of it is no
        silence, whatever Whisper's no-speech probability says."""
        return self.speech_ms(start_ms, end_ms) >= HEARD_SPEECH_MS

    def unheard(self, start_ms: int, end_ms: int, words: list[Word], min_ms: int) -> tuple[int, int] | None:
        """The first stretch of [start_ms, end_ms) outside the (timed, ordered) words in which
        the VAD heard at least `min_ms` of speech: speech the words leave out, as (where the
        word before it ends or start_ms, where the word after it starts or end_ms). None:
        none. A word counts with WORD_SLACK_MS around it (aligned times are estimates), and a
        word of seconds for its edges only (the alignment stretches a word over speech the
        text skipped). A stretch goes on past words that cover under half of the speech it left
        out before them, and counts what it leaves out less what they cover: a skip's first
        words are stamped inside it ("He" 2 s into 4 s of a sentence passed over, each side of
        it under `min_ms`)."""
        spans, edge = [], LONG_WORD_EDGE_MS
        for w in words:
            if w.end_ms - w.start_ms > 2 * edge:
                spans += [(w.start_ms, w.start_ms + edge), (w.end_ms - edge, w.end_ms)]
            else:
                spans.append((w.start_ms, w.end_ms))
        after = [start_ms] + [b + WORD_SLACK_MS for _, b in spans]  # where each gap begins
        before = [a - WORD_SLACK_MS for a, _ in spans] + [end_ms]  # and ends
        left_out, first = 0, 0  # speech left out (less what words cover) since gap `first`
        for k, (lo, hi) in enumerate(zip(after, before, strict=True)):
            lo = max(lo, start_ms)  # words before start_ms (committed, read again) bound no hole
            if left_out:
                a, b = spans[k - 1]
                left_out -= self.speech_ms(max(a, start_ms), b)
                if left_out < min_ms // 2:  # words that cover most of it end the stretch
                    left_out = 0
            if not left_out:
                first = k
            left_out += self.speech_ms(lo, hi) if hi > lo else 0
            if left_out >= min_ms:
                begin = max(spans[first - 1][1], start_ms) if first else start_ms
                return begin, spans[k][0] if k < len(spans) else end_ms
        return None

    def fit(self, words: list[Word], drop: bool = True, floor_ms: int = 0) -> list[Word]:
        """Words with their edges moved into speech: a start in silence to the next run's
        start, an end in silence to the last run's end. A segment none of whose words has
        speech within SNAP_MS is dropped (`drop`): Whisper made it of silence or noise
        (" you"). Whole segments, as offline `transcribe` keeps them: a voice the VAD barely
        hears (a falsetto) gives a run here and there, and the words between them are no
        less spoken.

        The alignment also starts a word late when speech begins after a pause (the
        attention follows the audio with a lag): the first word in a run of speech, when no
        earlier word (nor `floor_ms`, where the words' window starts) lies in that run and
        the run began at most ONSET_LEAD_MS before it, starts where the run does; a word after
        a full stop or a comma and a gap of at most LAG_MS (the punctuation's: `aligned_words`)
        the VAD heard as speech throughout starts where the gap does; a word read over a
        pause, mostly after it, starts where the speech after it does (`_across_pause`); a
        segment's first word left in the silence before its speech starts there (`_leads_in`).
        A start moved back to speech with no pause before it is moved no further than its
        letters allow (`moved_back`): under other voices a run may begin long before the word."""
        heard = samples_to_ms(self.num_chunks * CHUNK_SAMPLES)
        pad = self.PAD_MS

        def following(k: int) -> int:  # where the word after words[k] starts, as aligned
            return words[k + 1].start_ms if k + 1 < len(words) else heard

        spoken = {w.segment for w in words if w.end_ms > heard or self._near_speech(w)}
        kept: list[Word] = []
        for k, word in enumerate(words):
            before = max(floor_ms, kept[-1].end_ms if kept else floor_ms)
            if drop and word.segment not in spoken:
                continue
            kept.append(word)
            if word.end_ms > heard:  # past what the VAD has analysed
                continue
            i = bisect.bisect_right(self.ends, word.start_ms + pad)  # the first run ending after it
            onset = self.starts[i] - pad if i < len(self.starts) else None
            if onset is not None and self._leads_in(i, k, words, before):
                word.start_ms = onset
                word.end_ms = max(onset + MIN_WORD_MS, min(following(k), self.ends[i] + pad))
            elif onset is not None and word.start_ms < onset < word.end_ms + SNAP_MS:
                word.start_ms = min(onset, word.end_ms - MIN_WORD_MS)
            elif onset is not None and before <= onset < word.start_ms <= onset + ONSET_LEAD_MS:
                word.start_ms = onset if self._after_pause(i) else moved_back(word, onset)
            elif len(kept) > 1 and before == kept[-2].end_ms < word.start_ms <= before + LAG_MS \
                    and kept[-2].ends_phrase \
                    and self.speech_ms(before, word.start_ms) >= word.start_ms - before:
                word.start_ms = moved_back(word, before)  # punctuation with no pause: the lag is this word's
            elif self._across_pause(i, word):
                word.start_ms = min(self.starts[i + 1] - pad, word.end_ms - MIN_WORD_MS)
            j = bisect.bisect_left(self.starts, word.end_ms - pad) - 1  # the last run starting before
            if j >= 0 and word.start_ms - SNAP_MS < self.ends[j] + pad < word.end_ms:
                word.end_ms = max(self.ends[j] + pad, word.start_ms + MIN_WORD_MS)
            elif j >= 0 and word.ends_phrase and self._ended(j) \
                    and word.end_ms < self.ends[j] + pad <= min(word.end_ms + SNAP_MS, following(k)):
                word.end_ms = self.ends[j] + pad  # its punctuation started before its speech ended
        return kept


def moved_back(word: Word, start_ms: int) -> int:
    """Where a word moved back to speech that starts at `start_ms` (before its aligned start),
    with no pause before that speech, starts: there, or where the word is as long as its
    letters allow (`WORD_MS_PER_LETTER`, at least `SHORT_WORD_MS`) when that is later, and never
    after its aligned start. Under other voices (babble) the VAD hears the pause before a
    sentence as speech, with a dip where a run begins: moved to that run's start, " We" took
    0.7 s of the pause before it."""
    longest = max(SHORT_WORD_MS, WORD_MS_PER_LETTER * len(word.key))
    return max(start_ms, min(word.start_ms, word.end_ms - longest))
