"""Streaming commit policy: LocalAgreement-2 (ufal whisper_streaming) over timed words.

Each decode of the window gives a hypothesis; words that two consecutive hypotheses agree
on (after the committed point) are committed. Committed words are append-only; the rest of
the latest hypothesis is the tentative tail. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher

from engine.words import Word, timed_prompt

OVERLAP_NGRAM = 5  # longest committed tail looked for at the start of a new hypothesis
TIME_TOLERANCE_MS = 100
TRIM_SLACK_WORDS = 2  # how far from where it should be a committed tail may be found ...
LONG_TAIL_WORDS = 3  # ... times m for a tail of m words from this many on
# a word a window's cut falls in, ending this close after it, leaves the window: Whisper rarely
# reads its last 0.3 s again (a sentence cut starts 200 ms before it ends, on an item)
CUT_TAIL_MS = 300
CONTEXT_WORDS = 512  # context words kept before the window: more than a prompt takes
# two readings' word agrees only where they place it this close (the gap between their times):
# one reading that passed over seconds of speech times its words where it read them
AGREE_GAP_MS = 1000


def respelled(a: str, b: str) -> bool:
    """Whether two word keys are one word spelled twice: not the same, but nearly (a re-decode
    of unclear speech drops or changes a letter). Short words differ as words do."""
    return a != b and min(len(a), len(b)) >= 4 and SequenceMatcher(None, a, b).ratio() >= 0.8


@dataclass
class PolicyUpdate:
    committed: list[Word]  # newly committed, in order
    tentative: list[Word]  # the current uncommitted tail


class LocalAgreement:
    def __init__(self) -> None:
        self.committed: list[Word] = []  # all committed words (append-only)
        self.previous: list[Word] = []  # last hypothesis past the committed point
        self.previous_timed = True  # its words were timed from the audio (`update`)
        self.num_window_committed = 0  # committed words whose audio is in the decode window
        # the committed words as the window's latest decode read them: the prompts' text
        # (`read_window`), and how many of them are the window's
        self.context: list[Word] = []
        self.num_window_context = 0
        self.prompt_floor = 0  # context words before this index are never a prompt

    @property
    def committed_end_ms(self) -> int:
        return self.committed[-1].end_ms if self.committed else 0

    @property
    def ends_inside_phrase(self) -> bool:
        """Whether the committed words end with no full stop or comma after the last."""
        return bool(self.committed) and not self.committed[-1].ends_phrase

    def new_words(self, hypothesis: list[Word], start_ms: int | None = None) -> list[Word]:
        """The part of a hypothesis past the committed words whose audio it decoded: the
        window's (`start_ms` None), or those of a decode from `start_ms` (`num_reread`).

        The decoded audio holds the n words committed there, so a hypothesis repeats them
        first. Find the committed tail (m = 5 ... 1 words) in it, or the m words before the
        last one (a re-decode that changed the last word, or put a word before it), at the
        occurrence nearest to where it should be, give or take a word the re-decode split or
        merged; or the last word spelled nearly the same; else fall back to word mid-times
        (which keep a re-spelled last word placed late: "of the fridge. Ridge."). ("... is to
        be ill-disposed. He was not an old-sposed young man" after "... is to be old-sposed."
        must not match the repeat.) A tail of three words or more may be found further off: a
        re-decode of unclear speech spells it in other words, and mid-times from a decode that
        misplaced them would commit the tail again. So may one further off still where the
        word it ends on starts inside the committed word it matches: the same audio read
        again, in more words ("after sunlight. sunlight." and "our plans. lands." had the
        last word aligned over the committed one, its middle past its end).
        """
        n = self.num_reread(start_ms)
        if n == 0:
            return hypothesis
        end = self._tail_end(hypothesis, n)
        if end is not None:
            return hypothesis[end:]
        cutoff = self.committed_end_ms - TIME_TOLERANCE_MS
        return [w for w in hypothesis if w.mid_ms >= cutoff]

    def num_reread(self, start_ms: int | None = None) -> int:
        """How many committed words a decode reads again: the window's (`start_ms` None), or,
        of them, those whose middle lies at or past `start_ms`, for a decode from there. (A
        second reading starts at the last final's end, where its words end: the words partials
        committed since, in an utterance too long to wait for its pause, are in its audio; a
        preview's start has none.)"""
        return _num_since(self.committed, self.num_window_committed, start_ms)

    def _tail_end(self, hypothesis: list[Word], n: int) -> int | None:
        """Where the last `n` committed words end in a hypothesis, found by their tail
        (`new_words`), or by their last word spelled nearly the same where no tail is found;
        None: not found. Past the hypothesis's end where it stops before the last of them
        (found by the words before it): no new words, and no reading of them all
        (`read_window`)."""
        keys = [w.key for w in hypothesis]
        words = self.committed[len(self.committed) - n :]
        committed = [w.key for w in words]
        for m in range(min(OVERLAP_NGRAM, n), 0, -1):
            for skip in (0, 1) if m + 1 <= n else (0,):
                tail = committed[n - m - skip : n - skip]
                expected = n - m - skip  # where the tail should start in the hypothesis
                hits = [j for j in range(len(keys) - m + 1) if keys[j : j + m] == tail]
                slack = TRIM_SLACK_WORDS * (m if m >= LONG_TAIL_WORDS else 1)
                j = _placed(hits, expected, slack, hypothesis, words[n - 1 - skip], m - 1)
                if j is not None:
                    if skip and _after(hypothesis[j + m : j + m + 1], words[-1]):
                        return j + m  # the last word left out: the next is new speech
                    end = j + m + skip
                    if skip and keys[end : end + 1] == committed[-1:]:
                        end += 1  # a word put before the last one ("most of the afternoon")
                    return end
        hits = [j for j, key in enumerate(keys) if respelled(key, committed[-1])]
        j = _placed(hits, n - 1, TRIM_SLACK_WORDS, hypothesis, words[-1], 0)
        return None if j is None else j + 1  # the last word spelled again ("fridge" as "Ridge")

    def rereads(self, hypothesis: list[Word]) -> bool:
        """Whether a decode of the window read its committed words again: their tail is in
        it, or at least a quarter as many of its words lie before their end (a garbled re-read
        has fewer words than the committed text, rarely under half as many). Whisper, given them
        as context, may pass over them to the new speech; the alignment then stretches its
        few words over their audio, and their times no longer tell the new words from the
        old ("He might even have been made amiable himself." over 13 s, its first three
        words placed in the committed sentences)."""
        n = self.num_window_committed
        if n == 0 or not hypothesis or self._tail_end(hypothesis, n) is not None:
            return True  # (an empty decode misplaces nothing: `flush` keeps the tentative tail)
        cutoff = self.committed_end_ms - TIME_TOLERANCE_MS
        return 4 * sum(w.mid_ms < cutoff for w in hypothesis) >= n

    def sentence_start_ms(self, within_ms: int, lead_ms: int = 200,
                          finished: bool = False) -> int | None:
        """Where the committed words' unfinished sentence starts, or failing one in their last
        `within_ms`, their unfinished clause (after a comma: run-on speech, read without full
        stops): `lead_ms` before the earlier of its first word's start and the word before's
        end, not before that word starts. Across a pause the VAD cannot hear, the alignment
        may end the one and start the other late (by up to about 0.2 s): a window that starts
        inside its first word is often read from the next sentence on, and one that starts
        deep inside the word before reads its tail as words.
        With `finished`, the last sentence also when the committed words end it (a final's
        window keeps it as the next final's context: `commit.KEEP_SENTENCE_POSITIONS`).
        None: the committed words end a sentence (and not `finished`), or neither ends in their
        last `within_ms` (the words before are not looked at: a session's committed words grow
        for hours)."""
        words = self.committed
        if not words or (words[-1].ends_sentence and not finished):
            return None

        def after(k: int) -> int:  # the cut before the words after words[k]
            return max(words[k].start_ms, min(words[k].end_ms, words[k + 1].start_ms) - lead_ms)

        clause = None
        for k in range(len(words) - 2, -1, -1):
            if words[k + 1].start_ms < words[-1].end_ms - within_ms:
                break
            if words[k].ends_sentence:
                return after(k)
            if clause is None and words[k].ends_clause:
                clause = after(k)
        return clause

    def cut_window(self, start_ms: int) -> None:
        """The decode window now starts at `start_ms`: committed words before it leave it, and
        so does one ending within TIME_TOLERANCE_MS after it, or within CUT_TAIL_MS where the
        cut falls in it. (A window cut at the committed end starts on an item, up to 80 ms
        before it: counted in the window, the last word left the prompt without its full stop,
        and a re-decode found it in the new speech, " it" in "Leave it covered", and dropped
        the words up to there. A cut at a kept sentence's start falls 200-280 ms before the end
        of the word before: a decode rarely reads that tail again, and counted in the window the
        word left the prompts, full stop and all, "soft and slightly Leave it covered".)"""
        self.num_window_committed = _num_after(self.committed, self.num_window_committed, start_ms)
        self.num_window_context = _num_after(self.context, self.num_window_context, start_ms)
        drop = len(self.context) - self.num_window_context - CONTEXT_WORDS
        if drop > 0:  # a session's context grows for hours; a prompt takes its last words
            del self.context[:drop]
            self.prompt_floor = max(0, self.prompt_floor - drop)

    def update(self, hypothesis: list[Word], commit: bool = True, timed: bool = True) -> PolicyUpdate:
        """A new hypothesis of the window; `commit=False` only refreshes the tentative tail.
        Its words that the previous one read the same and placed near (`AGREE_GAP_MS`) are
        committed: the same text seconds apart is two readings of different speech (a
        decode that passed over run-on speech to the sentence at its window's end). Places
        are compared only where both were `timed` from the audio (a decode that may not
        commit spreads its segment's time over its words by characters)."""
        words = self.new_words(hypothesis)
        place = timed and self.previous_timed
        self.previous_timed = timed
        if not commit:
            self.previous = words
            return PolicyUpdate([], list(words))
        agreed = 0
        for old, new in zip(self.previous, words, strict=False):
            if old.key != new.key or not new.key or (place and not _near(old, new)):
                break
            agreed += 1
        newly = words[:agreed]
        self._commit(newly)
        self.previous = words[agreed:]
        return PolicyUpdate(newly, list(self.previous))

    def flush(self, hypothesis: list[Word] | None = None, new: bool = False) -> PolicyUpdate:
        """Commit everything: the given final hypothesis (`new_words`; `new`: found already),
        or the last tentative tail.

        A final decode with nothing new (a short window decoded as silence, or a last word
        dropped) commits the last tentative tail instead: words seen are not lost."""
        words = [] if hypothesis is None else hypothesis if new else self.new_words(hypothesis)
        if not words:
            words = self.previous
        self._commit(words)
        self.previous = []
        return PolicyUpdate(list(words), [])

    def close(self, full_stop: int) -> None:
        """A live final ended on the last committed word at a pause: where it has no full stop
        or comma, later prompts read one after it (`Word.stop`). Whisper carries a prompt's
        style on: prompted with sentences that end without one, it reads the next ones
        without, and reads them worse (docs/evaluation.md, A final's full stop)."""
        if self.committed and not self.committed[-1].ends_phrase:
            self.committed[-1].stop = [full_stop]

    def force_commit_until(self, end_ms: int) -> PolicyUpdate:
        """Commit tentative words ending before `end_ms` (the window is about to be cut)."""
        n = 0
        while n < len(self.previous) and self.previous[n].end_ms <= end_ms:
            n += 1
        newly, self.previous = self.previous[:n], self.previous[n:]
        self._commit(newly)
        return PolicyUpdate(newly, list(self.previous))

    def _commit(self, words: list[Word]) -> None:
        """Append words, keeping times monotonic (word times within a segment are estimates)."""
        for word in words:
            word.start_ms = max(word.start_ms, self.committed_end_ms)
            word.end_ms = max(word.end_ms, word.start_ms)
            self.committed.append(word)
        self.context += words
        self.num_window_committed += len(words)
        self.num_window_context += len(words)

    def read_window(self, hypothesis: list[Word]) -> None:
        """A greedy decode of the window from its start (`Stream` gives no fallback's sample)
        read its committed words again: that reading, which heard more of the speech after
        them, is now their text in later prompts (as Whisper's offline prompt is its reading
        of a whole 30 s window: "He was not an old-sposed young man." committed with 0.3 s of
        audio after it, read "ill-disposed" with the next sentence; prompted with the first
        reading, the session's later windows copied it). Not where their tail is not found in
        it or it ends before their last word (a partial that stopped early, its last word left
        out: `Stream._before_skip`), nor while the window holds words from before a hot
        decode's prompt reset (the floor counts the words before it). A reading with more
        words than they are whose first ones start inside the word before the window read that
        word's tail again (`cut_window`: "humor." as "a human."): those are not their text."""
        start = len(self.context) - self.num_window_context
        n = self.num_window_committed
        if n == 0 or start < self.prompt_floor:
            return
        end = self._tail_end(hypothesis, n)
        if end is None or end > len(hypothesis):
            return
        tail = 0
        while start > 0 and tail < end - n and hypothesis[tail].start_ms < self.context[start - 1].end_ms:
            tail += 1
        self.context[start:] = hypothesis[tail:end]
        self.num_window_context = end - tail

    def reset_prompt(self) -> None:
        """Later windows get no prompt from the words committed so far."""
        self.prompt_floor = len(self.context)

    def prompt_tokens(self, max_tokens: int, start_ms: int | None = None,
                      timestamp_begin: int | None = None) -> list[int]:
        """Tokens of the committed words (as last read: `context`) before the decoded audio
        (those in it get re-decoded: of the window, or those from `start_ms`). With
        `timestamp_begin`, their sentences between timestamps (`timed_prompt`)."""
        words: list[Word] = []
        timed = timestamp_begin is not None
        num_tokens = 2 if timed else 0  # the last segment's timestamps
        before = len(self.context) - _num_since(self.context, self.num_window_context, start_ms)
        for word in reversed(self.context[max(self.prompt_floor, before - max_tokens) : before]):
            extra = 2 if timed and word.ends_prompt_sentence else 0
            if num_tokens + len(word.prompt_tokens) + extra > max_tokens:
                break
            words.insert(0, word)
            num_tokens += len(word.prompt_tokens) + extra
        if timed:
            return timed_prompt(words, timestamp_begin)
        return [t for word in words for t in word.prompt_tokens]


def _num_since(words: list[Word], n: int, start_ms: int | None) -> int:
    """Of the last `n` words, how many a decode from `start_ms` reads again: those whose
    middle lies at or past it (all `n`: None, a decode of the window)."""
    if start_ms is None:
        return n
    k = 0
    while k < n and words[-1 - k].mid_ms >= start_ms:
        k += 1
    return k


def _num_after(words: list[Word], n: int, start_ms: int) -> int:
    """Of the last `n` words, how many a window cut at `start_ms` keeps (`cut_window`)."""
    while n > 0 and words[-n].end_ms <= start_ms + (
            CUT_TAIL_MS if words[-n].start_ms < start_ms else TIME_TOLERANCE_MS):
        n -= 1
    return n


def _placed(hits: list[int], expected: int, slack: int, hypothesis: list[Word], word: Word,
            offset: int) -> int | None:
    """Of the places a committed tail was found at (`hits`), the nearest to `expected` within
    `slack` words; else one whose word at `offset` (the tail's last) starts inside `word`,
    the committed word it matches (`LocalAgreement.new_words`); None: neither."""
    j = min(hits, key=lambda j: abs(j - expected), default=None)
    if j is not None and abs(j - expected) <= slack:
        return j
    for j in hits:
        if word.start_ms - TIME_TOLERANCE_MS <= hypothesis[j + offset].start_ms < word.end_ms:
            return j
    return None


def _after(hypothesis: list[Word], word: Word) -> bool:
    """Whether a hypothesis's first word starts past the committed `word`'s end (give or take
    TIME_TOLERANCE_MS): new speech, not `word` read again."""
    return bool(hypothesis) and hypothesis[0].start_ms >= word.end_ms + TIME_TOLERANCE_MS


def _near(a: Word, b: Word) -> bool:
    """Whether two readings place a word close enough to be one word (`AGREE_GAP_MS`)."""
    return max(a.start_ms, b.start_ms) - min(a.end_ms, b.end_ms) <= AGREE_GAP_MS
