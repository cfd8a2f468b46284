"""The streaming commit rules: what a decode of a window commits, and where the window is cut.

Pure functions of a window's facts, in positions of the session timeline; the session's
stream (engine/stream.py) applies them to its commit policy and timeline. Torch-free.

- A preview (a partial over only the audio since the last final) shows words, never commits.
- A final window (it ends at a pause, a flush or the end of the input) commits its decode
  whole; it is cut there when it was flushed, else its utterance stays in the window as
  context for the next one (a short window alone decodes worse); once over 10 s, only its
  last sentence does (cut at that sentence's start; at its end if none began in its last 8 s
  and it is over 15 s). A final whose committed words end seconds of speech before its end,
  or half a second of an utterance after a pause (Whisper, re-reading a committed utterance
  it was given as context, may end its text there; a file's final may stop before its last
  sentence) is cut at its committed end instead (past the last word's sound, where the VAD
  hears it end just after: `SpeechMap.past_tail`), and decoded again from there: that
  speech is never cut away unheard. So is a final whose decode passed over the
  committed words in its window (their times would be the alignment's guess), uncommitted.
- A live final whose new words the decoder read unsure (their tokens' mean log-probability
  under DOUBT_LOGPROB), with committed utterances before them in its window as context, is
  read again from the last final's end (the window stays as it is), and the surer of the two
  readings is committed (of a decode Whisper's fallback rule fails and one it passes, the
  latter). The utterance before is the context that reads the next one's first
  words best when one talker goes on, and worst after a change of voice or of room; which,
  the decoder's certainty tells (docs/evaluation.md, A second reading).
- A live final read unsure with nothing committed before it in its window (a session's first
  utterance, or the first after a long silence) has no context to drop: it is held (its
  words shown) and read again with the next utterance, in the next final of the same window,
  or alone once HOLD_SILENCE_MS pass with no speech. Whisper reads a voice better having
  heard more of it, after as well as before.
- A live final whose reading stops inside a sentence (on an ellipsis, a comma, or a word no
  sentence ends on: "across the.") is held the same way, sure or not, where its window has
  room: a talker stopped to think mid-sentence, and the rest read alone as a new sentence
  reads worse ("Coming in a mood to see no one hand across the." for "carrying our boots in
  our hands across the"). So is every live final of a talker whom the finals after three
  of their last eight pauses read going on with the sentence (`PauseHabit`); the final after
  such a hold that reads the held pause as a sentence's end commits the held words and
  holds only the new utterance. One that reads none of seconds of speech after the held
  words commits them as it read them and is retried from their end, as any final that ends
  short of speech is: held again, that speech would be read a final later, in a long window.
- A partial commits what two consecutive decodes agree on (LocalAgreement-2); with
  endpointing, only once `agree_after_ms` of audio wait uncommitted: pauses commit sooner.
  A decode Whisper's fallback rule fails counts for nothing: two decodes of one loop agree on
  it (a sentence said over and over, under babble that leaves no pause), and two that read a
  window unsure agree on what they made up (two partials read "I am afraid I was unable to
  create a connection to the Digium..." as "to the digital demonstration.", at a mean token
  log-probability of -2.2, its "to" and "the" stretched over the skipped clause, and the
  final that read it right found those words committed). So does a decode that passed over
  the window's committed words to later speech (its first words stretched over the speech
  between, as a final that does is not committed). Speech that repeats itself looks
  alike (its text compresses as well): it waits for a final or a full window.
- A window that cannot take another decode interval within 30 s commits its whole segments
  and moves to the end of the last one, as offline Whisper seeks; with none, it commits the
  words that end before its last 5 s and moves there.
- A window over 15 s is cut at its committed end, so that decodes stay short; where the
  committed words end inside a sentence that began in their last 5 s, at that sentence's start
  instead (or, in run-on speech read with no full stop, its clause's): a window that starts
  inside a sentence is often read from the next one on (under babble, 6 s of speech after a
  committed "Then," were never read). Where they end inside a phrase with no such start, it
  is not cut until agreement commits to a phrase's end or one's start comes within reach, or
  the window is full (run-on speech read with no punctuation: cut after "from a broken gate
  to", Whisper read the next window from the sentence after "a leaking roof. Nobody on a farm
  ever complains of being bored." on).
- A full window or a file's final whose decode passed over seconds of speech commits only what
  came before it (the stream's `_unskipped`; a final then reads that speech again, cut short).
  So do agreement and a live final (the stream's `_before_skip`), where that speech begins a
  second or more into the window: agreement waits, and the final is retried from there.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from engine.timeline import MAX_WINDOW_POSITIONS, POSITIONS_PER_SECOND
from engine.words import Word

TRIM_AFTER_POSITIONS = 15 * POSITIONS_PER_SECOND  # 750: a window over 15 s is cut at its commit
# a final with this much VAD speech past its committed words and this much committed audio in
# its window is decoded again from the committed end (a word end aligned early leaves well
# under 2 s of speech behind it)
RETRY_SPEECH_MS = 2000
RETRY_PROGRESS_POSITIONS = POSITIONS_PER_SECOND
# ... or this much in runs that begin after a pause past them: an utterance of its own that
# the decode ended before (not a last word's tail; a click or a breath is shorter)
RETRY_UTTERANCE_MS = 500
# a live final's new words read with a mean token log-probability under this, after
# context, are read again without it (`doubted`)
DOUBT_LOGPROB = -0.4
DOUBT_MIN_WORDS = 3  # ... when they are this many words or more
# ... with nothing committed before them, they wait for the next utterance (`held`), up to
# this much silence, when their window is no longer than HOLD_MAX_POSITIONS
HOLD_SILENCE_MS = 1000
HOLD_MAX_POSITIONS = 10 * POSITIONS_PER_SECOND
# a live final whose reading stops inside a sentence waits for the next utterance when its
# window has this much room left for it (`unfinished`)
UNFINISHED_ROOM_POSITIONS = 10 * POSITIONS_PER_SECOND
# ... and so does every live final of a talker who pauses inside sentences: the finals after
# this many of their last PAUSE_HABIT_PAUSES pauses read on across them (`PauseHabit`)
PAUSE_HABIT_PAUSES = 8
PAUSE_HABIT_MIN = 3
# a given sentence's closing mark the decoder, hearing the speech after it, finds less likely
# than not: the talker went on with the sentence (`reads_on`)
GIVEN_MARK_LOGPROB = -0.69  # log(1/2)
SHORT_READING = 0.75  # a reading with fewer letters than this share of the other's skipped speech
# a hold's release whose words over the held words spell under this share of their letters
# passed over them (`skips_held`; a garbled reading of a few words may spell a quarter fewer)
SKIPPED_HELD = 0.5
REPEAT_MIN_WORDS = 4  # a span this long said twice back to back is a copy (`copied_words`)
FORCE_KEEP_POSITIONS = 5 * POSITIONS_PER_SECOND  # 250: a forced cut keeps the last 5 s
# a long window is cut at the start of the committed words' unfinished sentence (or clause) if
# it began within this much before their end (else at their end)
SENTENCE_CUT_POSITIONS = 5 * POSITIONS_PER_SECOND
# a live final's window over KEEP_AFTER_POSITIONS is cut at the start of the last sentence it
# committed, when that began within KEEP_SENTENCE_POSITIONS before its end: that sentence stays
# as the next final's context (a sentence read alone, with no speech before it in its window,
# reads worse than after one), and windows stay as long as cuts at 15 s left them
KEEP_AFTER_POSITIONS = 10 * POSITIONS_PER_SECOND
KEEP_SENTENCE_POSITIONS = 8 * POSITIONS_PER_SECOND


class Action(enum.Enum):
    SHOW = "show"  # a preview: its words are the tentative tail, nothing is committed
    FINAL = "final"  # commit the decode whole
    AGREE = "agree"  # commit what agrees with the previous decode (when `agree`)
    WHOLE = "whole"  # agree, then commit the whole segments; cut at their end
    FORCE = "force"  # agree, then commit the tentative words ending by `force_until`; cut


def commits_whole(start: int, end: int, final: bool, decode_interval: int) -> bool:
    """Whether the decode of window [start, end) is committed whole, with no agreement to
    check it: a final, or a window too long for another decode interval within 30 s. (The
    model runner re-decodes such a decode at higher temperatures when it looks wrong.)"""
    return final or end - start >= MAX_WINDOW_POSITIONS - decode_interval


def may_commit(preview: bool, whole: bool, pending_ms: int, agree_after_ms: int) -> bool:
    """Whether a decode of a window can commit words (`plan` below), known before it runs:
    not a preview, and committed whole or with agreement on. (Only such decodes need word
    times from the audio: the others' words are a tentative tail.)"""
    return not preview and (whole or pending_ms > agree_after_ms)


@dataclass(frozen=True)
class WindowFacts:
    """A decoded window, as the rules see it."""

    start: int  # first position of the window
    end: int  # one past its last position
    final: bool  # it ends at a pause, a flush or the end of the input
    preview: bool  # it holds only the audio since the last final
    flushed: bool  # (final) it reaches a flush or the end of the input
    silence: bool  # the decode found no speech
    complete: int | None  # the decode's words are whole segments up to this position
    pending_ms: int  # audio from the committed words' end (or a held final's pause) to the window's end
    failed: bool = False  # Whisper's fallback rule fails the decode (WindowResult.failed)
    # (a live final) where the reading after it starts: early in the pause that ended it
    # (SpeechMap.after_pause); None: at its end
    resume: int | None = None
    # the decode's odds for the closing mark of the sentence it was given (WindowResult.given_logprob)
    given_logprob: float | None = None
    # (a partial) the decode read the window's committed words again (LocalAgreement.rereads),
    # as one that agreement may commit has to (a final's are checked as it is applied, a
    # preview commits nothing): one that passed over them to later speech stretches
    # its first words over the speech between ("The rainforest" over 4 s of "patterns in the
    # milk foam. The shop is busy all day", after a committed "... a lot")
    rereads: bool = True

    @property
    def next_start(self) -> int:
        """Where the reading after this window starts once it is done."""
        return self.end if self.resume is None else self.resume


@dataclass(frozen=True)
class Plan:
    action: Action
    agree: bool = False  # AGREE, WHOLE, FORCE: words that agree are committed
    force_until: int = 0  # FORCE: tentative words ending by this position are committed
    # AGREE: the decode's words count (they agree and become the tentative tail); False for
    # a failed decode (a loop, or one read unsure): the tail stays the last decode's
    counts: bool = True


def plan(facts: WindowFacts, decode_interval: int, agree_after_ms: int) -> Plan:
    """What the decode of a window commits. `agree_after_ms`: audio that must wait
    uncommitted before agreement commits (0 without endpointing)."""
    if facts.preview:
        return Plan(Action.SHOW)
    if facts.final:
        return Plan(Action.FINAL)
    agree = facts.pending_ms > agree_after_ms
    if not commits_whole(facts.start, facts.end, False, decode_interval):
        # two decodes of one loop, or two read unsure, agree on it; or on the speech after a skip
        if facts.failed or not facts.rereads:
            return Plan(Action.AGREE, counts=False)
        return Plan(Action.AGREE, agree)
    complete = facts.complete
    if not facts.silence and complete is not None and facts.start < complete <= facts.end:
        return Plan(Action.WHOLE, agree)
    return Plan(Action.FORCE, agree, facts.end - FORCE_KEEP_POSITIONS)


class Unread(NamedTuple):
    """VAD speech in a final's window past its committed words (ms): all of it, and that in
    runs that begin after a pause past them (`SpeechMap.unread`)."""
    speech_ms: int = 0
    utterance_ms: int = 0


NOTHING_UNREAD = Unread()


def retries(facts: WindowFacts, committed_end: int, unread: Unread, passed_over: bool) -> bool:
    """Whether a final is decoded again from the committed end (`committed_end`, in
    positions), which lies a second or more into its window: VAD speech follows it (2 s or
    more, or half a second of an utterance after a pause: "go forward ten meters" after a
    kept sentence that the decode ended on), or its decode passed over the window's committed
    words (`passed_over`: not LocalAgreement.rereads), and so is not committed."""
    if not may_retry(facts, committed_end):
        return False
    return passed_over or unread.speech_ms >= RETRY_SPEECH_MS or unread.utterance_ms >= RETRY_UTTERANCE_MS


def done_with_hold(facts: WindowFacts, held_end: int, unread: Unread) -> bool:
    """Whether the final after a hold, whose decode read nothing past the held words (they
    end at `held_end`, positions), is done with them: seconds of VAD speech follow them
    unread (`unread`), a second or more into the window, as would make any final retry. A
    short utterance unread at the window's end (a hesitant talker's "Scientists", 0.7 s) is
    read with the next one, the held words before it; seconds of speech the decoder passed
    over are read alone."""
    return may_retry(facts, held_end) and unread.speech_ms >= RETRY_SPEECH_MS


def doubted(new_logprob: float | None, num_words: int) -> bool:
    """Whether a live final's new words, read after the window's committed words (their
    tokens' mean log-probability: `new_logprob`; `num_words` of them), are worth a second
    reading without them: an utterance of a few words (a VAD that hears a voice only here and
    there ends one every word or two) reads worse alone than with the context before it."""
    return new_logprob is not None and new_logprob < DOUBT_LOGPROB and num_words >= DOUBT_MIN_WORDS


def held(facts: WindowFacts, committed_end: int, new_logprob: float | None, num_words: int) -> bool:
    """Whether a live final's new words wait for the next utterance, to be read with it: read
    unsure (`doubted`) with nothing committed before them in the window (no context to read
    them again without: not `may_retry`), in a short window that no flush ends. (The stream
    asks only of a window no commit cut: after a cut the speech before it is near.)"""
    return (not facts.flushed and facts.end - facts.start <= HOLD_MAX_POSITIONS
            and not may_retry(facts, committed_end) and doubted(new_logprob, num_words))


def unfinished(facts: WindowFacts, ends_open: bool) -> bool:
    """Whether a live final's words wait for the next utterance, to be read with it, as
    `held` ones do, however sure: its reading stops inside a sentence (its last word
    `ends_open`: a talker's pause mid-sentence, where the rest read alone as a new sentence
    reads worse), no flush ends the window, and the window has room for the next utterance."""
    return (ends_open and not facts.flushed
            and facts.end - facts.start <= MAX_WINDOW_POSITIONS - UNFINISHED_ROOM_POSITIONS)


def reads_on(before: Word | None, after: Word, given: bool, given_logprob: float | None = None) -> bool:
    """Whether a final reads on as one sentence across the pause a final before it ended at:
    the first word after the pause (`after`) begins in lower case, or the word before it
    (`before`, as this final read it again; None: not found) ends no sentence. Where its text
    was taken as given (`given`: a kept sentence's, with the mark the final before read), the
    decoder is asked instead how likely that mark is (`given_logprob`, its log-probability
    hearing the speech after the pause; None: not known): under GIVEN_MARK_LOGPROB, it reads
    on. (A given mark fixes the case of the word after it, and read without the rest, a
    fragment ends on a full stop as surely as a sentence does.) Whisper, hearing the speech
    after a pause, reads a sentence's end or its going on where the final at the pause,
    without it, could not."""
    letter = next((c for c in after.text if c.isalpha()), "")
    if letter.islower():
        return True
    if given:
        return given_logprob is not None and given_logprob < GIVEN_MARK_LOGPROB
    return before is not None and not before.ends_sentence


class PauseHabit:
    """Whether the talker pauses inside sentences, from how the finals after their pauses
    read them (`reads_on`): some talkers stop to think mid-sentence as long as between
    sentences, and a final at such a pause, read without the rest, reads worse ("Scientists
    leave it many years." for "Scientists needed many years ..."). Three of the last eight
    pauses read on make every live final wait for the next utterance (`unfinished`): whole
    sentences, for the latency of one utterance. One may be a misread capital, another a
    fluent talker's breath at a comma; a talker whose pauses end sentences keeps finals at
    the pause, and one who reads a voice per sentence has no sentence read with the next
    voice's."""

    def __init__(self) -> None:
        self.read_on: deque[bool] = deque(maxlen=PAUSE_HABIT_PAUSES)

    def observe(self, read_on: bool) -> None:
        self.read_on.append(read_on)

    @property
    def inside_sentences(self) -> bool:
        return sum(self.read_on) >= PAUSE_HABIT_MIN


def copied_words(keys: list[str], num_new: int) -> int:
    """How many of a decode's last `num_new` words (of its word keys) copy the words right
    before them: spans of REPEAT_MIN_WORDS or more said twice back to back, the first copy
    possibly before the new words (the window's committed words, read as context). Whisper,
    reading on from context it cannot make the next speech out after, says it again."""
    copied, i = 0, len(keys) - num_new
    while i < len(keys):
        longest = min(i, len(keys) - i)
        span = next((n for n in range(longest, REPEAT_MIN_WORDS - 1, -1)
                     if keys[i - n : i] == keys[i : i + n]), 0)
        copied += span
        i += max(span, 1)
    return copied


Reading = tuple[float | None, list[str], int, bool]


def surer(first: Reading, second: Reading) -> bool:
    """Whether the first of two readings of the same speech, each (its mean token
    log-probability, its words' keys, how many of them are a copy: `copied_words`, whether
    Whisper's fallback rule failed its decode at every temperature), is the one to keep. One
    whose decode failed loses to one whose decode passed, however their words compare (a
    second reading sampled hot, "they don't go off.", rated surer than the greedy first's "The
    angle of ...": the decoder giving up on the speech). Else one that copies loses to one
    that does not (under babble, "The middle of the dream that London was full of life
    again." said again for the next sentence; speech that does repeat, read alone, is no copy
    in the reading without context). Else, counted
    without their copies: the surer, unless it spells under SHORT_READING of the other's
    letters (a decode that passed over some of the speech and read the rest surely: "no hand
    in cross and cold stream." for "We started the climb before dawn, carrying our boots in
    our hands across the cold stream."). Letters, not words: a reading that garbles speech
    splits it into more, shorter words ("ski stay the way it comes" for "he stayed awake").
    """
    (p1, keys1, c1, f1), (p2, keys2, c2, f2) = first, second
    if f1 != f2:
        return f2
    if (c1 > 0) != (c2 > 0):
        return c2 > 0
    n1, n2 = _letters(keys1, c1), _letters(keys2, c2)
    if p1 is None or n1 < SHORT_READING * n2:
        return False
    return p2 is None or n2 < SHORT_READING * n1 or p1 > p2


def skips_held(held: list[str], release: list[str]) -> bool:
    """Whether a hold's release, whose words that start before the held words end are
    `release` (their keys), passed over speech the held reading `held` read: they spell under
    SKIPPED_HELD of the held reading's letters, copies not counted. They are stretched over
    the speech they skip, so no stretch of it goes unheard (`SpeechMap.unheard`): "himself."
    over 2 s, then nothing, for 7 s held as "And Mr. John Dashwood had then leisure to consider
    ..." (a recording that says the passage twice, its first saying in the prompt). A release
    that reads none of it leaves it to `SpeechMap.unheard`: the held reading may be of noise
    ("Mhmm" five times over a noise the VAD took for speech, read as nothing after it)."""
    return bool(release) and _letters(release, copied_words(release, len(release))) < \
        SKIPPED_HELD * _letters(held, copied_words(held, len(held)))


def _letters(keys: list[str], copied: int) -> float:
    """The letters of a reading's words, less its copies' share of them."""
    return sum(map(len, keys)) * (len(keys) - copied) / max(len(keys), 1)


def may_retry(facts: WindowFacts, committed_end: int) -> bool:
    """Whether a final whose committed words end at `committed_end` may be decoded again from
    there: a second or more into its window (each retry starts that much later: they end)."""
    return committed_end >= facts.start + RETRY_PROGRESS_POSITIONS


def new_window_start(facts: WindowFacts, action: Action, committed_end: int,
                     unread: Unread = NOTHING_UNREAD, sentence_start: int | None = None,
                     passed_over: bool = False, mid_phrase: bool = False) -> int | None:
    """Where the window starts once the plan is applied (None: where it was).
    `committed_end`: the committed words' end after it, in positions; `unread`: VAD speech in
    the window past them, for a FINAL; `sentence_start`: where
    the committed words' unfinished sentence starts (for a live FINAL, their last sentence,
    finished or not); `passed_over`: a FINAL's decode passed over the window's committed words
    and was not committed (`retries`); `mid_phrase`: the committed words end inside a sentence
    or clause (no full stop or comma after the last). A FINAL cut at its committed end before
    where the reading after it starts (`WindowFacts.next_start`) is a retry; one that keeps its
    last sentence is done."""
    length = facts.end - facts.start
    if action is Action.SHOW:
        return None
    if action is Action.FINAL:
        if retries(facts, committed_end, unread, passed_over):
            return committed_end  # (each retry starts a second or more later: they end)
        keep = max(facts.start, committed_end - KEEP_SENTENCE_POSITIONS)
        if not facts.flushed and length > KEEP_AFTER_POSITIONS and sentence_start is not None \
                and keep < sentence_start < committed_end:
            return sentence_start  # the next final reads its sentence after this one
        return facts.next_start if facts.flushed or length > TRIM_AFTER_POSITIONS else None
    if action is Action.WHOLE:
        return facts.complete
    if action is Action.FORCE:
        if committed_end <= facts.start or facts.silence:
            return facts.end - FORCE_KEEP_POSITIONS
        return committed_end
    if length > TRIM_AFTER_POSITIONS or (facts.silence and length > FORCE_KEEP_POSITIONS):
        boundary = facts.end - FORCE_KEEP_POSITIONS if facts.silence else committed_end
        if not facts.silence and sentence_start is not None \
                and max(facts.start, committed_end - SENTENCE_CUT_POSITIONS) < sentence_start < committed_end:
            boundary = sentence_start  # not inside a sentence: Whisper skips its rest
        elif not facts.silence and mid_phrase:
            return None  # no phrase's start to cut at: the window grows to one, or to full
        if boundary > facts.start:
            return boundary
    return None
