"""The commit rules, without a model: window facts -> what to commit, where the window starts."""

import numpy as np
import pytest

from audio.vad import CHUNK_SAMPLES
from engine.commit import (
    DOUBT_LOGPROB,
    FORCE_KEEP_POSITIONS,
    HOLD_SILENCE_MS,
    KEEP_AFTER_POSITIONS,
    KEEP_SENTENCE_POSITIONS,
    RETRY_SPEECH_MS,
    RETRY_UTTERANCE_MS,
    TRIM_AFTER_POSITIONS,
    UNFINISHED_ROOM_POSITIONS,
    Action,
    PauseHabit,
    Unread,
    WindowFacts,
    commits_whole,
    copied_words,
    new_window_start,
    plan,
    reads_on,
    skips_held,
    unfinished,
)
from engine.config import EngineConfig
from engine.model_runner import WindowResult
from engine.scheduler import Scheduler
from engine.speech_map import LONG_SILENCE_MS, ONSET_PAD_MS, SpeechMap
from engine.stream import EngineOutput, Stream
from engine.timeline import MAX_WINDOW_POSITIONS, ms_to_positions, positions_to_ms
from engine.words import Word

INTERVAL = 50  # a 1 s decode interval, in positions


def facts(start: int = 0, end: int = 200, final: bool = False, preview: bool = False,
          flushed: bool = False, silence: bool = False, complete: int | None = None,
          pending_ms: int = 1000) -> WindowFacts:
    return WindowFacts(start, end, final, preview, flushed, silence, complete, pending_ms)


def test_a_window_is_committed_whole_when_final_or_too_long_for_another_interval():
    assert commits_whole(0, 10, True, INTERVAL)
    assert not commits_whole(0, 1449, False, INTERVAL)
    assert commits_whole(0, 1450, False, INTERVAL)
    assert not commits_whole(100, 1549, False, INTERVAL)
    # one definition: the threshold follows the decode interval
    assert commits_whole(0, 1475, False, 25) and not commits_whole(0, 1474, False, 25)


def test_previews_show_and_finals_commit_whole():
    assert plan(facts(preview=True), INTERVAL, 0).action is Action.SHOW
    assert new_window_start(facts(preview=True), Action.SHOW, 100) is None
    assert plan(facts(final=True), INTERVAL, 8000).action is Action.FINAL


@pytest.mark.parametrize("pending_ms, agree_after_ms, agree", [
    (1000, 0, True), (0, 0, False), (8000, 8000, False), (8001, 8000, True)])
def test_agreement_commits_only_past_agree_after(pending_ms, agree_after_ms, agree):
    decided = plan(facts(pending_ms=pending_ms), INTERVAL, agree_after_ms)
    assert decided.action is Action.AGREE and decided.agree is agree


def test_a_final_is_cut_at_its_end_when_flushed_or_long_else_kept_as_context():
    short = facts(end=300, final=True)
    assert new_window_start(short, Action.FINAL, 300) is None  # the utterance stays as context
    assert new_window_start(facts(end=300, final=True, flushed=True), Action.FINAL, 300) == 300
    long = facts(end=TRIM_AFTER_POSITIONS + 1, final=True)
    assert new_window_start(long, Action.FINAL, 0) == TRIM_AFTER_POSITIONS + 1
    # a window over KEEP_AFTER_POSITIONS keeps the last sentence it committed, when that began
    # within KEEP_SENTENCE_POSITIONS of the committed end, as the next final's context
    for length in (KEEP_AFTER_POSITIONS + 1, TRIM_AFTER_POSITIONS + 1):
        window = facts(end=length, final=True)
        end = length - 12
        keep = end - KEEP_SENTENCE_POSITIONS
        assert new_window_start(window, Action.FINAL, end, sentence_start=keep + 1) == keep + 1
        expected = length if length > TRIM_AFTER_POSITIONS else None  # none began in its last 8 s
        assert new_window_start(window, Action.FINAL, end, sentence_start=keep) == expected
        flushed = facts(end=length, final=True, flushed=True)
        assert new_window_start(flushed, Action.FINAL, end, sentence_start=keep + 1) == length
    window = facts(end=KEEP_AFTER_POSITIONS, final=True)  # not over: it all stays
    assert new_window_start(window, Action.FINAL, KEEP_AFTER_POSITIONS, sentence_start=100) is None
    # the kept sentence must begin after the window's start (else nothing would leave it)
    window = facts(start=100, end=100 + KEEP_AFTER_POSITIONS + 1, final=True)
    assert new_window_start(window, Action.FINAL, 400, sentence_start=100) is None
    assert new_window_start(window, Action.FINAL, 400, sentence_start=101) == 101


def test_a_final_that_stopped_short_of_speech_is_decoded_again_from_its_committed_end():
    window = facts(start=0, end=1276, final=True, flushed=True)  # 25.5 s, the first 14 s committed
    assert new_window_start(window, Action.FINAL, 707, unread=Unread(RETRY_SPEECH_MS)) == 707
    assert new_window_start(window, Action.FINAL, 707, unread=Unread(RETRY_SPEECH_MS - 1)) == 1276
    # half a second of an utterance after a pause past them is read again too, not a second
    # of the last word's tail
    assert new_window_start(window, Action.FINAL, 707, unread=Unread(600, RETRY_UTTERANCE_MS)) == 707
    assert new_window_start(window, Action.FINAL, 707, unread=Unread(600, RETRY_UTTERANCE_MS - 1)) == 1276
    # the retry, from the committed end: if it commits nothing either, it is cut at its end
    retry = facts(start=704, end=1276, final=True, flushed=True)
    assert new_window_start(retry, Action.FINAL, 707, unread=Unread(5000)) == 1276


def test_a_final_that_ended_before_an_utterance_after_a_pause_reads_it_again():
    """A final read its window's kept sentence and ended there ("... lasted him a whole
    week."), before the 1.9 s "go forward ten meters" after a pause: under the 2 s of speech
    that retry a final, so the reading after it started past that speech, and it was lost.
    An utterance of its own after the committed words is read again from their end."""
    stream = speech_stream([(0, 4_000), (5_400, 7_300)], seconds=9)
    request = stream.request
    request.num_decoded_positions = ms_to_positions(7_600)
    request.endpoints.append(ms_to_positions(7_600))
    out = stream.apply(WindowResult("s", read("they thanked him with a basket.", 400, 600, -0.1), final=True))
    assert len(out.committed) == 6
    assert 4_000 <= positions_to_ms(request.window_start) < 5_400 - ONSET_PAD_MS  # read from there
    assert ms_to_positions(7_600) in request.endpoints  # its final is due again


def test_speech_map_measures_the_speech_in_a_span():
    speech = SpeechMap(0.5)
    speech.push(np.array([0, 1, 1, 0, 0, 1, 0], dtype=np.float32))  # 32 ms chunks
    assert speech.speech_ms(0, 1000) == 96
    assert speech.speech_ms(40, 170) == (96 - 40) + (170 - 160)
    assert speech.speech_ms(100, 160) == 0


def test_speech_map_tells_the_speech_after_words_from_their_tail():
    """Speech past words that end at a time: all of it, and that of runs that begin a pause
    (PAUSE_MS) or more after it: an utterance the words did not read."""
    speech = SpeechMap(0.5)
    speech.push(np.array([1] * 10 + [0] * 10 + [1] * 5 + [0] * 2, dtype=np.float32))  # 32 ms chunks
    # runs 0-320 ms and 640-800 ms; words to 300 ms leave 20 ms of the first run's tail
    assert speech.unread(300, 1000) == (20 + 160, 160)
    assert speech.unread(300, 700) == (20 + 60, 60)
    assert speech.unread(400, 1000) == (160, 0)  # the run begins 240 ms after: no pause


def test_a_partial_over_15_s_is_cut_at_its_committed_end():
    assert new_window_start(facts(end=TRIM_AFTER_POSITIONS), Action.AGREE, 400) is None
    over = facts(end=TRIM_AFTER_POSITIONS + 10)
    assert new_window_start(over, Action.AGREE, 400) == 400
    assert new_window_start(over, Action.AGREE, 0) is None  # nothing committed in the window
    # silence longer than the 5 s kept: cut, keeping the last 5 s
    silent = facts(start=100, end=100 + FORCE_KEEP_POSITIONS + 1, silence=True)
    assert new_window_start(silent, Action.AGREE, 0) == 101


def test_a_full_window_seeks_to_its_last_whole_segment():
    full = facts(start=100, end=1550, complete=1400)
    decided = plan(full, INTERVAL, 8000)
    assert decided.action is Action.WHOLE and not decided.agree
    assert new_window_start(full, Action.WHOLE, 1400) == 1400


@pytest.mark.parametrize("complete, silence", [(None, False), (100, False), (1551, False), (1400, True)])
def test_a_full_window_without_a_whole_segment_commits_all_but_its_last_5_s(complete, silence):
    full = facts(start=100, end=1550, complete=complete, silence=silence)
    decided = plan(full, INTERVAL, 0)
    assert decided.action is Action.FORCE and decided.force_until == 1550 - FORCE_KEEP_POSITIONS
    # cut at the committed end, or with nothing committed there (or silence) 5 s before the end
    assert new_window_start(full, Action.FORCE, 1200) == (1300 if silence else 1200)
    assert new_window_start(full, Action.FORCE, 100) == 1300


def words(text: str, start_ms: int, step_ms: int = 300) -> list[Word]:
    return [Word(f" {w}", start_ms + i * step_ms, start_ms + (i + 1) * step_ms)
            for i, w in enumerate(text.split())]


def read_partials(stream: Stream, said: list[Word], rest_ms: int,
                  readings: list[tuple[int, str]]) -> EngineOutput:
    """Partial decodes of the stream's window to each end (ms), each reading `said` and then
    its rest of the words from `rest_ms` -> the last one's output."""
    for end_ms, rest in readings:
        stream.request.num_decoded_positions = ms_to_positions(end_ms)
        out = stream.apply(WindowResult("s", said + words(rest, rest_ms), final=False))
    return out


def speech_stream(runs_ms: list[tuple[int, int]], background: bool = False, seconds: int = 0) -> Stream:
    """A stream of `seconds` of audio (silence: it is not read here) whose VAD heard speech in
    these runs (ms), as Engine.hear would tell it."""
    stream = Stream("s", EngineConfig(), b"k" * 16, timestamp_begin=50363, background=background)
    end = max(b for _, b in runs_ms) + 2000
    chunk_ms = CHUNK_SAMPLES * 1000 // 16000
    probs = np.array([float(any(a <= k * chunk_ms < b for a, b in runs_ms))
                      for k in range(end // chunk_ms)], np.float32)
    stream.add_audio(np.zeros(seconds * 16000, np.float32))
    stream.take_unheard()
    stream.vad.num_chunks = probs.size
    stream.hear(probs)
    return stream


def test_a_files_windows_end_at_long_silences_only():
    """A live session's final falls due at a short pause; a file's audio is there before its
    decode, so its windows run on to a long silence and seek, as offline `transcribe`'s."""
    live, file = speech_stream([(0, 1000)]).pauses, speech_stream([(0, 1000)], background=True).pauses
    assert live is not None and file is not None
    item_ms = EngineConfig.item_samples // 16
    assert live.endpoint_items == -(-ms_to_positions(EngineConfig.endpoint_ms) * 20 // item_ms) == 3
    assert file.endpoint_items == -(-LONG_SILENCE_MS // item_ms) == 38
    assert live.dips and not file.dips  # (audio/pauses.py: a talker's pauses under other voices)


def test_a_files_final_that_skips_speech_commits_nothing_and_is_decoded_again_to_the_pause():
    """The decoder jumped from the first words to the sentence after a pause, leaving 7 s the
    VAD heard as speech: nothing of it counts, and the next final ends at that pause."""
    stream = speech_stream([(0, 10_000), (11_000, 14_000)], background=True)
    request = stream.request
    request.num_decoded_positions = ms_to_positions(14_400)
    request.endpoints.append(ms_to_positions(14_400))
    skipping = words("the first words", 0) + words("then the last sentence", 11_000, 700)
    out = stream.apply(WindowResult("s", skipping, final=True))
    assert out.committed == [] and request.window_start == 0
    assert list(request.endpoints) == [ms_to_positions(10_000 + ONSET_PAD_MS), ms_to_positions(14_400)]
    assert Scheduler.final_due(request)

    request.num_decoded_positions = request.endpoints[0]  # that final, read whole this time
    whole = words("the first words and all the rest of the sentence up to the pause", 0, 600)
    out = stream.apply(WindowResult("s", whole, final=True))
    assert [w.text for w in out.committed] == [w.text for w in whole]
    assert list(request.endpoints) == [ms_to_positions(14_400)]


def test_a_window_cut_at_a_complete_segment_starts_before_the_next_onset():
    """Whisper's seek moves a full window to its last complete segment's end, which may lie
    past the onset of the next sentence; the next window starts before that onset."""
    stream = speech_stream([(0, 28_400), (29_200, 31_000)], seconds=31)
    request = stream.request
    request.num_decoded_positions = ms_to_positions(30_000)
    said = words(" ".join(["word"] * 71), 0, 400)  # up to 28.4 s
    out = stream.apply(WindowResult("s", said, final=False, complete_ms=29_280))
    assert len(out.committed) == 71
    assert ms_to_positions(28_400) <= request.window_start <= ms_to_positions(29_200 - ONSET_PAD_MS)


def test_a_window_cut_at_a_complete_segment_in_run_on_speech_starts_at_its_last_word():
    """In run-on speech a full window read to "... dreaming in the new language." (80.5 s)
    and no further; its segment ended at 81.2 s, and the next window, started there, inside
    "The storm arrived", read "The first time I've been born". With no pause after the last
    word, the next window starts where that word ends."""
    stream = speech_stream([(0, 31_000)], seconds=31)
    request = stream.request
    request.num_decoded_positions = ms_to_positions(30_000)
    said = words(" ".join(["word"] * 50), 0, 400)  # up to 20 s, then 10 s of speech unread
    out = stream.apply(WindowResult("s", said, final=False, complete_ms=20_800))
    assert len(out.committed) == 50
    assert ms_to_positions(19_920) <= request.window_start <= ms_to_positions(20_000)


def test_a_final_ended_early_at_skipped_speech_is_not_ended_there_twice():
    """Where the final cut short reads nothing either (speech too faint for the model), the
    whole final's words are kept as decoded: a window is ended early once per pause. (A live
    final, one utterance to its pause, is retried from its committed end instead.)"""
    live = speech_stream([(0, 10_000), (11_000, 14_000)])
    live.request.num_decoded_positions = ms_to_positions(14_400)
    skipping = words("the first words", 0) + words("then the last sentence", 11_000, 700)
    assert len(live.apply(WindowResult("s", skipping, final=True)).committed) == len(skipping)

    stream = speech_stream([(0, 10_000), (11_000, 14_000)], background=True)
    request = stream.request
    request.num_decoded_positions = ms_to_positions(14_400)
    request.endpoints.append(ms_to_positions(14_400))
    assert stream.apply(WindowResult("s", skipping, final=True)).committed == []
    request.num_decoded_positions = request.endpoints[0]
    assert stream.apply(WindowResult("s", [], final=True, silence=True)).committed == []
    request.num_decoded_positions = ms_to_positions(14_400)
    out = stream.apply(WindowResult("s", skipping, final=True))
    assert [w.text for w in out.committed] == [w.text for w in skipping]
    assert not request.endpoints


def test_a_decode_caught_in_a_loop_is_a_failure_that_its_log_probability_does_not_tell():
    from engine.model.decoding import DecodingResult

    def result(stop: str = "eot", ratio: float = 1.5, logprob: float = -0.3) -> DecodingResult:
        return DecodingResult([], "", logprob, 0.1, ratio, stop)

    assert not result().looped and not result().needs_fallback
    assert result(stop="budget").looped and result(stop="repetition").looped
    assert result(ratio=2.5).looped and result(ratio=2.5).needs_fallback
    assert not result(logprob=-1.5).looped and result(logprob=-1.5).needs_fallback


def test_a_partial_caught_in_a_loop_commits_nothing_and_leaves_the_tail_as_it_was():
    """Under babble the VAD hears no pause and partials run on; a decode that says one sentence
    over and over agrees with the next decode's loop, and agreement would commit the repeats."""
    decided = plan(facts(pending_ms=5000), INTERVAL, 0)
    looped = plan(WindowFacts(0, 200, False, False, False, False, None, 5000, failed=True), INTERVAL, 0)
    assert decided.agree and decided.counts
    assert looped.action is Action.AGREE and not looped.agree and not looped.counts

    stream = speech_stream([(0, 20_000)])
    request = stream.request
    said = words("she said that tomatoes grow better", 0)  # to 1.8 s
    loop = said + words("nobody believed that tomatoes grow better " * 3, 2000)  # to 7.4 s
    request.num_decoded_positions = ms_to_positions(3_000)
    assert stream.apply(WindowResult("s", said, final=False)).committed == []  # agreement needs two
    for end_ms in (7_000, 8_000):
        request.num_decoded_positions = ms_to_positions(end_ms)
        out = stream.apply(WindowResult("s", loop, final=False, failed=True))
        assert out.committed == [] and [w.text for w in out.tentative] == [w.text for w in said]
    request.num_decoded_positions = ms_to_positions(9_000)
    after = words("nobody believed her until the plants grew taller than the fence", 2000, 600)
    out = stream.apply(WindowResult("s", said + after, final=False))
    assert [w.text for w in out.committed] == [w.text for w in said]  # agrees with the last sound one


def test_partials_that_pass_over_the_committed_words_agree_on_nothing():
    """Two partials of run-on speech (no pause ends it) read on from 4 s after the window's
    committed "... going to soak a lot", "The rainforest" stretched over the speech between:
    agreed on, the 4 s ("patterns in the milk foam. The shop is busy ...") were lost. They count
    for nothing; the tail stays the last decode's that read the committed words again."""
    stream = speech_stream([(0, 20_000)])
    said = words("on quiet mornings she is still going to soak a lot", 0)  # to 3.3 s
    rest = "patterns in the milk foam the shop is busy all day"
    out = read_partials(stream, said, 3_300, [(8_600, rest), (9_200, rest)])
    assert [w.text for w in out.committed] == [w.text for w in said + words(rest, 3_300)][:-1]
    committed = list(stream.policy.committed)
    skipping = words("the rainforest", 3_300, 2_000) + words("is home to more kinds of animals", 7_300)
    for end_ms in (10_400, 11_000):
        stream.request.num_decoded_positions = ms_to_positions(end_ms)
        assert not stream.policy.rereads(skipping)
        out = stream.apply(WindowResult("s", skipping, final=False))
        assert out.committed == [] and stream.policy.committed == committed
    reread = said + words(rest, 3_300) + words("the rainforest is home", 6_600)
    stream.request.num_decoded_positions = ms_to_positions(11_600)
    assert stream.policy.rereads(reread) and stream.apply(WindowResult("s", reread, final=False)).tentative


def test_partials_read_unsure_agree_on_nothing_and_the_final_reads_the_sentence_whole():
    """Two partials of a window read "I am afraid I was unable to create a connection to the
    Digium demonstration" (a recorded prompt) as "to the digital demonstration.", their "to"
    and "the" stretched over the clause they skipped, at a mean token log-probability of -2.2:
    agreed on, the final that read the sentence found them committed and the clause was lost."""
    stream = speech_stream([(500, 5_800)])
    request = stream.request
    unsure = words("to the digital", 500, 1200) + words("demonstration.", 4_100, 700)  # to 4.8 s
    for end_ms in (8_600, 9_200):  # (agreement commits past 8 s of audio)
        request.num_decoded_positions = ms_to_positions(end_ms)
        out = stream.apply(WindowResult("s", unsure, final=False, failed=True))
        assert out.committed == [] and out.tentative == []
    request.num_decoded_positions = ms_to_positions(9_600)
    read = words("I am afraid I was unable to create a connection to the Digium demonstration.",
                 500, 330)  # to 4.8 s
    out = stream.apply(WindowResult("s", read, final=True))
    assert [w.text for w in out.committed] == [w.text for w in read]

    # a sound reading, after an unsure one, is agreed on with the next sound one
    stream = speech_stream([(500, 5_800)])
    stream.request.num_decoded_positions = ms_to_positions(8_600)
    stream.apply(WindowResult("s", read, final=False))
    stream.request.num_decoded_positions = ms_to_positions(9_200)
    assert stream.apply(WindowResult("s", unsure, final=False, failed=True)).committed == []
    stream.request.num_decoded_positions = ms_to_positions(9_800)
    out = stream.apply(WindowResult("s", read, final=False))
    assert [w.text for w in out.committed] == [w.text for w in read]


def test_a_full_window_or_a_final_in_a_loop_is_committed_as_offline_commits_it():
    """The runner re-decodes them at higher temperatures first. Speech that repeats itself (a
    file of four copies of one utterance) compresses as well as a loop: where a full window
    dropped its decode for that, the file lost two of the copies."""
    full = WindowFacts(100, 1550, False, False, False, False, 1400, 8000, failed=True)
    decided = plan(full, INTERVAL, 0)
    assert decided.action is Action.WHOLE and decided.counts
    final = WindowFacts(100, 400, True, False, False, False, None, 8000, failed=True)
    assert plan(final, INTERVAL, 0).action is Action.FINAL

    stream = speech_stream([(0, 31_000)], seconds=31)
    request = stream.request
    request.num_decoded_positions = ms_to_positions(30_000)
    repeated = words("he might even have been made amiable himself " * 10, 0, 370)  # to 29.6 s
    out = stream.apply(WindowResult("s", repeated, final=False, complete_ms=29_600, failed=True))
    assert [w.text for w in out.committed] == [w.text for w in repeated]


def test_a_long_partial_is_cut_where_its_unfinished_sentence_starts_not_inside_it():
    """Under babble no pause ends a window; agreement commits up to "... in size. Then," and
    the window, over 15 s, is cut. Cut after "Then," Whisper read the window from the next
    sentence on and 6 s of speech were never read: it is cut before "Then" instead."""
    from engine.policy import LocalAgreement

    policy = LocalAgreement()
    sentence = words("it has doubled in size.", 9_000, 900)  # to 13.5 s
    policy.update(sentence + words("Then", 14_000))
    assert policy.sentence_start_ms(5_000) is None  # nothing agreed yet
    policy.update(sentence + words("Then shape", 14_000))
    assert [w.text for w in policy.committed][-1] == " Then"
    assert policy.sentence_start_ms(5_000) == 13_500 - 200  # before "size." ends: both may be late
    assert policy.sentence_start_ms(5_000, lead_ms=2_000) == 12_600  # not before "size." starts
    assert policy.sentence_start_ms(100) is None  # "Then" starts 0.3 s before its own end
    policy.update(sentence + words("Then shape it.", 14_000))
    policy.update(sentence + words("Then shape it. And", 14_000))
    assert [w.text for w in policy.committed][-1] == " it."
    assert policy.sentence_start_ms(5_000) is None  # the committed words end a sentence
    # ... which a final's cut keeps: "Then shape it." from 200 ms before "size." ends
    assert policy.sentence_start_ms(5_000, finished=True) == policy.committed[-4].end_ms - 200

    long = facts(start=0, end=TRIM_AFTER_POSITIONS + 40)
    committed_end = ms_to_positions(14_400)
    assert new_window_start(long, Action.AGREE, committed_end) == committed_end
    assert new_window_start(long, Action.AGREE, committed_end, sentence_start=ms_to_positions(13_300)) \
        == ms_to_positions(13_300)
    # a sentence that began over 5 s before the committed end: cut at the committed end
    assert new_window_start(long, Action.AGREE, committed_end, sentence_start=ms_to_positions(9_000)) \
        == committed_end
    # ... unless the committed words end inside it: no cut until a phrase's end or start
    assert new_window_start(long, Action.AGREE, committed_end, sentence_start=ms_to_positions(9_000),
                            mid_phrase=True) is None
    assert new_window_start(long, Action.AGREE, committed_end, mid_phrase=True) is None
    assert new_window_start(long, Action.AGREE, committed_end, sentence_start=ms_to_positions(13_300),
                            mid_phrase=True) == ms_to_positions(13_300)
    full = facts(start=0, end=MAX_WINDOW_POSITIONS, complete=1400)
    assert new_window_start(full, Action.WHOLE, committed_end, mid_phrase=True) == 1400
    silent = facts(start=100, end=100 + FORCE_KEEP_POSITIONS + 1, silence=True)
    assert new_window_start(silent, Action.AGREE, 0, mid_phrase=True) == 101

    stream = speech_stream([(0, 20_000)], seconds=20)
    request = stream.request
    said = words("leave it covered for an hour until it has doubled in size. Then", 4_000, 800)
    out = read_partials(stream, said, 15_000, [(15_800, "shape the loaf"), (16_800, "shaped a loaf")])
    assert [w.text for w in out.committed][-2:] == [" size.", " Then"]
    size, then = out.committed[-2:]
    assert ms_to_positions(size.start_ms) <= request.window_start <= ms_to_positions(then.start_ms - 200)
    assert stream.policy.num_window_committed == 1  # "Then" is read again; the prompt ends on "size."


def test_a_long_partial_read_with_no_punctuation_is_not_cut_inside_a_phrase():
    """Run-on speech, read with no full stop or comma: cut after "from a broken gate to",
    Whisper read the next window from the sentence after "a leaking roof. Nobody on a farm
    ever complains of being bored." on. The window waits for a phrase's start to cut at."""
    stream = speech_stream([(0, 30_000)], seconds=30)
    request = stream.request
    said = words("in the afternoon there is always something to repair from a broken gate to", 1_000, 1_000)
    out = read_partials(stream, said, 17_000, [(18_000, "a leaking"), (19_000, "a leaking roof")])
    assert out.committed[-1].text == " leaking" and request.window_start == 0
    rest = words("a leaking roof. Nobody on a farm ever complains of being bored", 17_000, 550)
    for end_ms in (25_500, 26_000):  # 8 s uncommitted: agreed
        request.num_decoded_positions = ms_to_positions(end_ms)
        out = stream.apply(WindowResult("s", said + rest, final=False))
    roof, nobody = out.committed[:2]
    assert [roof.text, nobody.text] == [" roof.", " Nobody"] and not out.committed[-1].ends_phrase
    assert ms_to_positions(roof.start_ms) <= request.window_start <= ms_to_positions(nobody.start_ms)


def test_a_partial_that_stopped_early_leaves_the_prompts_reading_of_the_committed_words_whole():
    """Agreement committed "... a little cheese on the side"; the partials after it stopped
    there ("... on the side."), seconds of speech short of the window's end, and their last
    word is not agreed on (`Stream._before_skip`). Their reading, which ends before the last
    committed word, took the place of the committed words' reading in later prompts: the
    prompt lost "side" and read "... cheese on the". It is not taken."""
    stream = speech_stream([(0, 30_000)], seconds=30)
    request = stream.request

    def said() -> list[Word]:
        return words("serve it hot with thick slices of bread and a little cheese on the side", 1_000, 600)

    for end_ms, reading in ((10_500, said() + words("for", 10_000)),
                            (11_500, said() + words("far from the city", 10_000))):
        request.num_decoded_positions = ms_to_positions(end_ms)
        stream.apply(WindowResult("s", reading, final=False))
    assert stream.policy.committed[-1].text == " side"
    for end_ms in (13_000, 14_500):  # each stops at "side." (to 10 s)
        request.num_decoded_positions = ms_to_positions(end_ms)
        out = stream.apply(WindowResult("s", said()[:-1] + [Word(" side.", 9_400, 10_000)], final=False))
        assert out.committed == []
        assert [w.key for w in stream.policy.context] == [w.key for w in said()]


def test_a_sentence_cut_starts_before_a_first_word_the_alignment_starts_late():
    """Sentences 0.1-0.3 s apart: the VAD hears no pause, and the alignment may end the last
    word before and start the first word after late (by up to 0.2 s, p95, docs/evaluation.md).
    A window that starts inside the first word is read from the sentence after; one that
    starts deep inside the word before reads its tail as words ("fail." cut 0.3 s in: "to be
    able to help establish a treasure" for "It helps to listen to the radio"). The cut goes
    0.2 s before the earlier of the two edges, not before the word before starts."""
    from engine.policy import LocalAgreement

    policy = LocalAgreement()
    said = words("compared with the sun.", 26_500, 500)  # " sun." 28.0-28.5 s
    said += [Word(" Families", 28_600, 29_000), Word(" spread", 29_000, 29_400)]  # spoken from 28.35 s
    policy.update(said)
    policy.update(said + words("out", 29_400))
    assert [w.text for w in policy.committed][-2:] == [" Families", " spread"]
    assert policy.sentence_start_ms(5_000) == 28_500 - 200 < 28_350
    policy = LocalAgreement()
    said = [*words("allowed to", 64_500, 360), Word(" fail.", 65_220, 65_730), Word(" It", 65_840, 65_940),
            Word(" helps", 65_940, 66_300)]
    policy.update(said)
    policy.update(said + words("to", 66_300))
    assert policy.sentence_start_ms(5_000) == 65_730 - 200  # 0.2 s of "fail." in the window, not 0.4 s
    policy = LocalAgreement()
    short = [*words("we found it.", 70_000, 100), *words("Then it", 70_300, 300)]  # " it." 70.2-70.3 s
    policy.update(short)
    policy.update(short + words("rained", 70_900))
    assert policy.sentence_start_ms(5_000) == 70_200  # not before " it." starts


def test_run_on_speech_is_cut_where_its_unfinished_clause_starts():
    """Speech with no pause is read without full stops ("..., the museum keeps its oldest maps
    in a dark room at the"): a window over 15 s, cut at the committed end, started inside
    "back of the building" and read it "dark, in the building". With no sentence end in the
    last 5 s, the cut goes before the unfinished clause, after its comma."""
    from engine.policy import LocalAgreement

    policy = LocalAgreement()
    said = words("and bounced into the net, the museum keeps its maps in a dark room at the", 30_000, 400)
    policy.update(said)
    policy.update(said + words("back", 36_000))
    museum = next(w for w in policy.committed if w.text == " museum")
    assert policy.sentence_start_ms(5_000) == 32_000 - 200  # " net," ends at 32.0 s
    assert policy.sentence_start_ms(5_000) < museum.start_ms
    assert policy.sentence_start_ms(1_000) is None  # no clause ends in the last second
    policy.update(said + words("back of it.", 36_000))
    policy.update(said + words("back of it. And", 36_000))
    assert policy.sentence_start_ms(5_000) is None  # the committed words end a sentence


def test_a_final_that_passes_over_its_windows_committed_words_is_decoded_again_from_their_end():
    """Given a window's committed words as its prompt, Whisper may pass over their audio to the
    new speech; the alignment then stretches the new words back over it ("He might even have
    been made amiable himself." over 13 s, its first words among the committed sentences).
    Such a final commits nothing and is decoded again from the committed end."""
    said = "he might even have been made amiable himself"
    stream = speech_stream([(0, 4_000), (5_000, 9_000)], seconds=10)
    request = stream.request
    request.num_decoded_positions = ms_to_positions(4_400)
    request.endpoints.append(ms_to_positions(4_400))
    first = words("the first sentence ends right here", 400, 600)  # to 4.0 s
    assert len(stream.apply(WindowResult("s", first, final=True)).committed) == 6
    assert request.window_start == 0  # a short final stays in the window as context

    request.num_decoded_positions = ms_to_positions(9_400)
    request.endpoints.append(ms_to_positions(9_400))
    passing = words(said, 3_000, 900)  # one of its words before the committed end
    assert stream.apply(WindowResult("s", passing, final=True)).committed == []
    assert request.window_start == ms_to_positions(4_000) and Scheduler.final_due(request)

    out = stream.apply(WindowResult("s", words(said, 5_000, 500), final=True))
    assert " ".join(w.text.strip() for w in out.committed) == said
    assert out.committed[0].start_ms > 4_900 and not Scheduler.final_due(request)

    # a decode that reads the committed words again commits the new ones, in one final
    again = speech_stream([(0, 4_000), (5_000, 9_000)], seconds=10)
    again.request.num_decoded_positions = ms_to_positions(4_400)
    again.apply(WindowResult("s", first, final=True))
    again.request.num_decoded_positions = ms_to_positions(9_400)
    out = again.apply(WindowResult("s", first + words(said, 5_000, 500), final=True))
    assert " ".join(w.text.strip() for w in out.committed) == said


def read(text: str, start_ms: int, step_ms: int, logprob: float) -> list[Word]:
    """Words of one token each, decoded with this log-probability."""
    return [Word(w.text, w.start_ms, w.end_ms, [0], logprob=logprob) for w in words(text, start_ms, step_ms)]


# where what comes after the first final of `first_utterance_committed` is read from:
# RESUME_MS into the pause after its speech (4.0 s), on an item (SpeechMap.after_pause)
AFTER_FIRST = ms_to_positions(4_160)


def first_utterance_committed() -> tuple[Stream, list[Word]]:
    """A stream of two utterances (0-4 s and 5-9 s) whose first final (to its endpoint at
    4.4 s) committed the first one's words (returned), sure of them."""
    stream = speech_stream([(0, 4_000), (5_000, 9_000)], seconds=10)
    stream.request.num_decoded_positions = ms_to_positions(4_400)
    stream.request.endpoints.append(ms_to_positions(4_400))
    first = read("we walked up to the hill", 400, 600, -0.1)  # to 4.0 s
    assert len(stream.apply(WindowResult("s", first, final=True)).committed) == 6
    return stream, first


@pytest.mark.parametrize("second_text, second_logprob, failed, keep_second", [
    ("then shape the loaf", -0.1, (False, False), True),  # surer
    ("then shape the loaf", -1.5, (False, False), False),  # less sure
    ("the loaf", -0.1, (False, False), False),  # surer, but it passed over some of the speech
    # more words, as many letters: the speech split into short words, and less sure
    ("then sh ape the lo af", 2 * DOUBT_LOGPROB - 0.2, (False, False), False),
    # one of the two decodes failed at every temperature: the other, however they compare
    ("then shape the loaf", -0.1, (False, True), False),
    ("then shape the loaf", -1.5, (True, False), True),
    ("then shape the loaf", -0.1, (True, True), True)])
def test_a_final_read_unsure_after_its_context_is_read_again_without_it_and_the_surer_kept(
        second_text, second_logprob, failed, keep_second):
    """The utterance before a final, in its window as context, reads the next one's first
    words best when one talker goes on, and worst after a change of voice ("Men shape the
    loaf" for "Then shape the loaf"). A live final whose new words the decoder read unsure
    after committed words commits nothing at first (its words are shown), is decoded again
    from the last final's end, and the surer of the two readings is committed; the window
    keeps its context for the finals after it. The second reading starts past the committed
    words: a word of their tail in it ("the") is no repeat of them to trim at. A decode that
    Whisper's fallback rule fails at every temperature loses to one it passes (`failed`: the
    first reading's, the second's)."""
    stream, first = first_utterance_committed()
    request = stream.request
    assert request.window_start == 0  # a short final stays in the window as context

    request.num_decoded_positions = ms_to_positions(9_400)
    request.endpoints.append(ms_to_positions(9_400))
    unsure = read("men shape the loaf", 5_000, 900, 2 * DOUBT_LOGPROB)
    out = stream.apply(WindowResult("s", first + unsure, final=True, failed=failed[0]))
    assert out.committed == [] and [w.text for w in out.tentative] == [w.text for w in unsure]
    assert request.window_start == 0 and Scheduler.final_due(request)
    window = Scheduler()._window(request, partial=False)  # the second reading's window
    assert window.window_start == AFTER_FIRST and window.final

    again = read(second_text, 5_000, min(900, 3_600 // len(second_text.split())), second_logprob)
    out = stream.apply(WindowResult("s", again, final=True, failed=failed[1]))
    kept = again if keep_second else unsure
    assert [w.text for w in out.committed] == [w.text for w in kept]
    assert not Scheduler.final_due(request) and stream.doubt is None and request.reread_start is None
    assert request.window_start == 0  # the context stays for the next final
    assert Scheduler()._window(request, partial=False).window_start == 0

    # read sure enough after its context: committed in one final
    sure = speech_stream([(0, 4_000), (5_000, 9_000)], seconds=10)
    sure.request.num_decoded_positions = ms_to_positions(4_400)
    sure.apply(WindowResult("s", first, final=True))
    sure.request.num_decoded_positions = ms_to_positions(9_400)
    out = sure.apply(WindowResult("s", first + read("then shape the loaf", 5_000, 900, -0.1), final=True))
    assert [w.text.strip() for w in out.committed] == ["then", "shape", "the", "loaf"]


@pytest.mark.parametrize("keys, num_new, copied", [
    ("a b c d a b c d e".split(), 5, 4),  # the context said again
    ("a b c d e f g e f g".split(), 6, 0),  # three words twice: speech does that
    ("x a b c d e a b c d e y".split(), 6, 5),  # the longest span
    ("a b c d a b c d".split(), 0, 0),  # no new words
    ("a b c d x y a b c d".split(), 6, 0)])  # not back to back
def test_copied_words(keys, num_new, copied):
    assert copied_words(keys, num_new) == copied


@pytest.mark.parametrize("second_text, second_logprob, kept", [
    ("then shape the loaf", -0.5, "then shape the loaf"),  # less sure, but no copy
    ("we walked up to the hill", -0.1, "we walked up to the hill"),  # the speech did repeat
    # both copy: counted without it, the first has no word
    ("then shape the loaf then shape the loaf", -0.1, "then shape the loaf then shape the loaf")])
def test_a_final_that_says_its_context_again_is_read_again_without_it(second_text, second_logprob, kept):
    """Whisper, reading on from context it cannot make the next speech out after, may say the
    context again, and surely: under babble "The middle of the dream that London was full of
    life again." twice, for two sentences. A live final whose new words copy the words right
    before them is read again without the context, and the reading that copies nothing is
    kept, sure or not; speech that does repeat reads the same alone and is kept so."""
    stream, first = first_utterance_committed()
    request = stream.request

    request.num_decoded_positions = ms_to_positions(9_400)
    request.endpoints.append(ms_to_positions(9_400))
    copy = read("we walked up to the hill", 5_000, 600, -0.1)
    out = stream.apply(WindowResult("s", first + copy, final=True))
    assert out.committed == [] and [w.text for w in out.tentative] == [w.text for w in copy]
    assert Scheduler()._window(request, partial=False).window_start == AFTER_FIRST

    again = read(second_text, 5_000, 4_000 // len(second_text.split()), second_logprob)
    out = stream.apply(WindowResult("s", again, final=True))
    assert " ".join(w.text.strip() for w in out.committed) == kept
    assert stream.doubt is None and not Scheduler.final_due(request)


def agree(stream: Stream, texts: tuple[str, ...], before: list[Word], start_ms: int,
          logprob: float = -0.1) -> list[Word]:
    """Partials of the window (`before` its new words, read from `start_ms`), one per text,
    each past `agree_after_ms` of audio uncommitted -> the words they committed."""
    committed = []
    for text in texts:
        partial = before + read(text, start_ms, 900, logprob)
        committed += stream.apply(WindowResult("s", partial, final=False)).committed
    return committed


@pytest.mark.parametrize("second_logprob, kept", [
    (-0.1, "and put it on a plate"), (-1.5, "and put it on a tray")])
def test_a_second_reading_reads_the_words_partials_committed_since_the_last_final_again(
        second_logprob, kept):
    """An utterance that runs past `agree_after_ms` with no pause has its first words
    committed by partials before its final. A second reading of that final starts at the
    last final's end, before them: it reads them again, with the committed words before its
    start as its prompt, not them, and commits only what it reads past them."""
    stream, first = first_utterance_committed()
    request = stream.request
    request.num_decoded_positions = ms_to_positions(4_400 + EngineConfig.agree_after_ms + 200)
    early = agree(stream, ("then shape the loaf and", "then shape the loaf but"), first, 5_000)
    assert [w.text for w in early] == [" then", " shape", " the", " loaf"]

    request.num_decoded_positions = ms_to_positions(14_400)
    request.endpoints.append(ms_to_positions(14_400))
    said = "then shape the loaf and put it on a "
    out = stream.apply(WindowResult("s", first + read(said + "tray", 5_000, 900, 2 * DOUBT_LOGPROB),
                                    final=True))
    assert out.committed == [] and " ".join(w.text.strip() for w in out.tentative) == "and put it on a tray"
    window = Scheduler()._window(request, partial=False)  # the second reading's
    assert window.window_start == AFTER_FIRST
    assert len(stream.policy.prompt_tokens(224, start_ms=4_160)) == len(first)  # one token each

    out = stream.apply(WindowResult("s", read(said + "plate", 5_000, 900, second_logprob), final=True))
    assert " ".join(w.text.strip() for w in out.committed) == kept
    assert stream.doubt is None and not Scheduler.final_due(request)


def test_a_first_utterance_that_partials_began_to_commit_has_no_context_to_read_again_without():
    """A session's first utterance, long enough for partials to commit its first words: its
    final read unsure has those words before its new ones, but no final ended before them; a
    second reading would start where the window does and read it as the first did. It is
    committed as read."""
    stream = speech_stream([(0, 12_000)], seconds=13)
    request = stream.request
    request.num_decoded_positions = ms_to_positions(EngineConfig.agree_after_ms + 400)
    early = agree(stream, ("the fresh wet and flour and", "the fresh wet and flour but"), [], 400)
    assert len(early) == 5
    request.num_decoded_positions = request.endpoints[0]
    unsure = read("the fresh wet and flour and water so tenderly it will eat", 400, 900, 2 * DOUBT_LOGPROB)
    out = stream.apply(WindowResult("s", unsure, final=True))
    assert [w.text for w in early + out.committed] == [w.text for w in unsure]
    assert stream.doubt is None and request.reread_start is None and not Scheduler.final_due(request)


def hear_silence(stream: Stream, ms: int) -> None:
    """`ms` more of audio in which the VAD hears no speech, as Engine.hear would tell it."""
    chunks = ms * 16 // CHUNK_SAMPLES
    stream.add_audio(np.zeros(ms * 16, np.float32))
    stream.take_unheard()
    stream.vad.num_chunks += chunks
    stream.hear(np.zeros(chunks, np.float32))


@pytest.mark.parametrize("logprob, flushed, held", [
    (2 * DOUBT_LOGPROB, False, True), (-0.1, False, False), (2 * DOUBT_LOGPROB, True, False)])
def test_a_first_final_read_unsure_waits_to_be_read_with_the_next_utterance(logprob, flushed, held):
    """Whisper reads a voice better having heard more of it: a session's first sentences
    alone ("We're not going to take stations on the same consumer.") read worse than with the
    next one ("... on an adult takes patience and the sense of humour."). A live final read
    unsure with nothing committed before it in its window is shown, not committed, and read
    again with the next utterance in the next final of the window; a flush commits it now."""
    stream = speech_stream([(0, 4_000), (5_000, 9_000)], seconds=10)
    request = stream.request
    pause, next_pause = request.endpoints  # where the VAD heard each utterance end
    request.num_decoded_positions = pause
    if flushed:
        request.flush_position = pause
    first = read("learning a new language", 400, 900, logprob)  # to 4.0 s
    out = stream.apply(WindowResult("s", first, final=True))
    assert [w.text for w in (out.tentative if held else out.committed)] == [w.text for w in first]
    assert out.committed == [] if held else out.tentative == []
    assert list(request.endpoints) == [next_pause]
    assert request.window_start == (pause // 4 * 4 if flushed else 0)  # a flush cuts the window
    if not held:
        return
    assert request.preview_start == 0  # previews read from the window's start: the held words too

    request.num_decoded_positions = next_pause
    both = read("learning a new language as an adult takes patience", 400, 900, -0.5)
    out = stream.apply(WindowResult("s", both, final=True))
    assert [w.text for w in out.committed] == [w.text for w in both] and out.tentative == []
    assert stream.held is None and not Scheduler.final_due(request)


def test_held_words_wait_for_agreement_past_the_held_pause():
    """Partials over a held window read the held words as the held final did while the next
    utterance has only begun; agreement on them would commit that reading before the next
    final reads it whole. Agreement waits `agree_after_ms` past the held final's pause (as
    for any utterance); partials past that commit as any, and the final after them commits
    the rest, unsure or not, with no second reading (it would start at the last final's end,
    which a hold leaves behind the words those partials committed)."""
    stream = speech_stream([(0, 4_000), (5_000, 13_000)], seconds=14)
    request = stream.request
    pause = request.num_decoded_positions = request.endpoints[0]
    first = read("learning a new language", 400, 900, 2 * DOUBT_LOGPROB)
    assert stream.apply(WindowResult("s", first, final=True)).committed == []
    texts = ("learning a new language as an ant", "learning a new language as an adult")
    request.num_decoded_positions = ms_to_positions(9_000)  # 9 s of audio past no commit
    for text in texts:  # two partials agree on six words: shown, not committed
        out = stream.apply(WindowResult("s", read(text, 400, 900, 2 * DOUBT_LOGPROB), final=False))
        assert out.committed == [] and out.tentative
    request.num_decoded_positions = pause + ms_to_positions(EngineConfig.agree_after_ms + 200)
    committed = agree(stream, texts, [], 400, 2 * DOUBT_LOGPROB)
    assert len(committed) == 6
    both = read("learning a new language as an adult takes patience and a sense of humour",
                400, 900, 2 * DOUBT_LOGPROB)
    request.num_decoded_positions = request.endpoints[0]
    out = stream.apply(WindowResult("s", both, final=True))
    assert [w.text for w in committed + out.committed] == [w.text for w in both]
    assert not Scheduler.final_due(request) and request.reread_start is None


def test_the_final_after_a_hold_that_passes_over_the_held_utterance_commits_the_held_words():
    """The final after a hold may read the window from its second utterance on (after loud
    breathing, "Going to bed at the same time..." was read only as a loop and held, and the
    next final read "Bright screens late at night..." alone). The speech it passed over keeps
    the held reading: no utterance is lost to a hold."""
    stream = speech_stream([(0, 4_000), (5_000, 9_000)], seconds=10)
    request = stream.request
    request.num_decoded_positions = request.endpoints[0]
    first = read("going to be the same time", 400, 600, 2 * DOUBT_LOGPROB)
    assert stream.apply(WindowResult("s", first, final=True)).committed == []
    request.num_decoded_positions = request.endpoints[0]
    second = read("bright screens late at night", 5_000, 800, -0.2)
    out = stream.apply(WindowResult("s", second, final=True))
    assert [w.text for w in out.committed] == [w.text for w in first + second]
    assert stream.held is None and not Scheduler.final_due(request)


@pytest.mark.parametrize("held, release, skips", [
    ("and mister john dashwood had then", "himself he", True),
    ("learning a new language", "learning a new language as", False),
    ("he stayed awake", "ski stay the way it comes", False),  # garbled: more, shorter words
    ("asteriskorg", "after the", False),  # garbled: a word for two, with more letters
    ("mhmm mhmm mhmm mhmm mhmm", "", False),  # read as nothing: `unheard` decides
    ("going to bed at going to bed at the same time", "going to bed at the same time", False),  # a copy held
])
def test_a_release_skips_the_held_speech_when_it_spells_far_fewer_letters(held, release, skips):
    assert skips_held(held.split(), release.split()) is skips


def released(held: list[Word], release: list[Word]) -> tuple[Stream, EngineOutput]:
    """A stream of two utterances (0-4 s, 5-9 s) whose first final read `held` unsure and held
    it, and whose next final read `release` -> the stream and that final's output."""
    stream = speech_stream([(0, 4_000), (5_000, 9_000)], seconds=10)
    request = stream.request
    request.num_decoded_positions = request.endpoints[0]
    assert stream.apply(WindowResult("s", held, final=True)).committed == []
    request.num_decoded_positions = request.endpoints[0]
    return stream, stream.apply(WindowResult("s", release, final=True))


def test_a_hold_release_whose_words_stretch_over_the_held_speech_keeps_the_held_words():
    """The final after a hold may pass over the held speech with its words stretched over it
    ("himself." then "He" 2 s later, where "And Mr. John Dashwood had then leisure ..." was
    held): no stretch between them holds seconds of unheard speech, but they spell a fraction
    of the held reading's letters. The held words are kept, and the release's words after them."""
    first = read("and mister john dashwood had then", 400, 600, 2 * DOUBT_LOGPROB)  # to 4.0 s
    stretched = [Word(text, a, b, [0], logprob=-0.2)
                 for text, a, b in ((" himself.", 400, 1_400), (" He", 2_600, 2_900), (" was", 4_100, 5_400))]
    release = stretched + read("not an ill disposed young man", 5_400, 500, -0.2)
    stream, out = released(first, release)
    assert [w.text for w in out.committed] == [w.text for w in first + release[2:]]
    assert stream.held is None


def test_a_hold_release_that_reads_the_held_words_a_little_later_commits_its_own_reading():
    """A release's reading of the held words is timed anew: its last word over them may end
    after the held reading's (" conference." 0.3 s later); it is that word read again, not
    speech the release passed over, and is committed once."""
    first = read("five to extend the conference.", 400, 600, 2 * DOUBT_LOGPROB)  # to 3.4 s
    release = read("five to extend the", 400, 600, -0.2) + read("conference. seven or nine", 3_200, 700, -0.2)
    _, out = released(first, release)
    assert [(w.text, w.start_ms) for w in out.committed] == [(w.text, w.start_ms) for w in release]


def test_a_final_after_a_commit_cut_is_not_held():
    """A window cut at its committed words (over 15 s) starts right after speech: its first
    final is committed as read, unsure or not (only a session's first utterance, or the first
    after a long silence, waits for the next one)."""
    stream = speech_stream([(0, 16_000), (17_000, 20_000)], seconds=21)
    request = stream.request
    pause, next_pause = request.endpoints
    request.num_decoded_positions = pause
    long = read(" ".join(["word"] * 20), 400, 780, -0.1)  # to 16 s
    assert len(stream.apply(WindowResult("s", long, final=True)).committed) == 20
    assert request.window_start > 0  # cut at the committed end
    request.num_decoded_positions = next_pause
    unsure = read("learning a new language", 17_000, 700, 2 * DOUBT_LOGPROB)
    out = stream.apply(WindowResult("s", unsure, final=True))
    assert [w.text for w in out.committed] == [w.text for w in unsure]


@pytest.mark.parametrize("read_again", [True, False])
def test_held_words_are_committed_when_no_utterance_follows(read_again):
    """A held final (above) waits HOLD_SILENCE_MS for the next utterance: a talker who said
    one sentence and waits for an answer gets its final then, read alone."""
    stream = speech_stream([(0, 4_000)], seconds=5)
    request = stream.request
    pause = request.num_decoded_positions = request.endpoints[0]
    first = read("learning a new language", 400, 900, 2 * DOUBT_LOGPROB)
    assert stream.apply(WindowResult("s", first, final=True)).committed == []
    hear_silence(stream, 160)  # audio to 5.16 s, under HOLD_SILENCE_MS past the pause (4.24 s)
    assert not Scheduler.final_due(request)
    hear_silence(stream, 1_000)
    assert Scheduler.final_due(request)
    window = Scheduler()._window(request, partial=False)
    assert window.final and window.speech and window.window_start == 0
    waited = window.window_end - pause
    assert ms_to_positions(HOLD_SILENCE_MS) <= waited < ms_to_positions(HOLD_SILENCE_MS + 100)
    request.num_decoded_positions = window.window_end
    # (read again, the same; a final after a hold that reads nothing commits the held words)
    out = stream.apply(WindowResult("s", first if read_again else [], final=True))
    assert [w.text for w in out.committed] == [w.text for w in first] and not Scheduler.final_due(request)


@pytest.mark.parametrize("said, held", [
    ("carrying our boots across the", True), ("carrying our boots across the.", True),
    ("carrying our boots and", True),
    ("carrying our boots across...", True), ("carrying our boots,", True),
    ("carrying our boots across it.", False), ("carrying our boots across", False)])
def test_a_final_read_stopping_inside_a_sentence_waits_to_be_read_with_the_next_utterance(said, held):
    """A talker who stops to think inside a sentence gets a live final at the pause, and the
    rest read alone as a new sentence reads worse ("We started the climb before dawn.
    Coming in a mood to see no one hand across the. Cold dream." for "... before dawn,
    carrying our boots in our hands across the cold stream."). A final whose reading stops
    where no sentence ends (on an ellipsis, a comma, or a word such as "the" or "and") is
    shown, not committed, however sure, and read again with the next utterance; one that
    ends on a full stop, or on a word a sentence may end on, is committed."""
    stream = speech_stream([(0, 4_000), (5_000, 7_000), (8_000, 10_000)], seconds=11)
    request = stream.request
    request.num_decoded_positions = request.endpoints[0]
    first = read("We started the climb before dawn.", 400, 600, -0.1)  # to 4.0 s
    assert len(stream.apply(WindowResult("s", first, final=True)).committed) == 6
    request.num_decoded_positions = request.endpoints[0]
    second = read(said.capitalize(), 5_000, 500, -0.1)  # (read as a sentence of its own)
    out = stream.apply(WindowResult("s", first + second, final=True))
    assert [w.text for w in (out.tentative if held else out.committed)] == [w.text for w in second]
    assert (stream.held is not None) == held
    request.num_decoded_positions = request.endpoints[0]
    rest = read("hands across the cold stream.", 8_000, 400, -0.1)
    out = stream.apply(WindowResult("s", first + second + rest, final=True))
    assert [w.text for w in out.committed] == [w.text for w in (second if held else []) + rest]
    assert stream.held is None and not Scheduler.final_due(request)


def test_a_final_after_a_hold_that_again_stops_inside_the_sentence_holds_again():
    """A talker may stop twice in one sentence: the final that reads the held words with the
    next utterance, stopping inside the sentence again, holds them all; the final at the
    sentence's end, of a talker whose finals read on across both pauses (and one before), is
    held too, and the silence after it commits the whole sentence, read in one."""
    stream = speech_stream([(0, 2_000), (3_000, 5_000), (6_000, 8_000)], seconds=9)
    stream.habit.observe(True)  # (the final after an earlier pause of this talker read on)
    request = stream.request
    said = [read("carrying our boots in our", 400, 300, -0.1), read("hands across the", 3_000, 600, -0.1),
            read("cold stream.", 6_000, 900, -0.1)]  # one utterance each
    for i in range(len(said)):
        reading = [w for words in said[: i + 1] for w in words]
        request.num_decoded_positions = request.endpoints[0]
        out = stream.apply(WindowResult("s", reading, final=True))
        assert [w.text for w in out.tentative] == [w.text for w in reading] and stream.held is not None
    # (the finals read on across both pauses: this talker's next finals wait too; this one
    # until HOLD_SILENCE_MS of silence)
    hear_silence(stream, 1_200)
    request.num_decoded_positions = Scheduler()._window(request, partial=False).window_end
    out = stream.apply(WindowResult("s", reading, final=True))
    assert [w.text for w in out.committed] == [w.text for w in reading] and stream.held is None
    assert not Scheduler.final_due(request)


@pytest.mark.parametrize("unread_ms, again, done", [
    (3_000, "Carrying our boots across the.", True), (1_900, "Carrying our boots across the.", False),
    (700, "Carrying our boots across the.", False),
    (3_000, "Carrying our", False)])  # (two words stretched over the held speech: read nothing)
def test_a_final_after_a_hold_that_reads_no_seconds_of_speech_after_it_commits_the_held_words_and_retries(
        unread_ms, again, done):
    """The final after a hold may end its text at the held words, reading none of the speech
    after them (a far talker 40 dB under a near one, 3 s of a sentence unread). Held again,
    that speech would be read only a final later, in a window grown long, after the held
    words ("Do it" for "By the middle of spring the garden was full of life again."). The
    held words are done with this reading, and the final is retried from their end: the
    speech is read alone, and committed. A short utterance unread at the window's end (a
    hesitant talker's "Scientists") waits with the held words for the next one, and so do
    held words a decode did not read again (its words stretched over their speech)."""
    stream = speech_stream([(0, 4_000), (5_000, 7_000), (8_000, 8_000 + unread_ms)], seconds=12)
    request = stream.request
    request.num_decoded_positions = request.endpoints[0]
    first = read("We started the climb before dawn.", 400, 600, -0.1)  # to 4.0 s
    assert len(stream.apply(WindowResult("s", first, final=True)).committed) == 6
    request.num_decoded_positions = request.endpoints[0]
    second = read("Carrying our boots across the", 5_000, 400, -0.1)  # to 7.0 s
    assert stream.apply(WindowResult("s", first + second, final=True)).committed == []
    assert stream.held is not None
    pause = request.num_decoded_positions = request.endpoints[0]  # after the unread speech
    again = read(again, 5_000, 2_000 // len(again.split()), -0.1)  # to 7.0 s
    out = stream.apply(WindowResult("s", first + again, final=True))
    if not done:
        assert out.committed == [] and stream.held is not None and not Scheduler.final_due(request)
        return
    assert [w.text for w in out.committed] == [w.text for w in again] and stream.held is None
    assert Scheduler.final_due(request)  # the retry, from the held words' end
    window = Scheduler()._window(request, partial=False)
    assert ms_to_positions(6_900) <= window.window_start < ms_to_positions(8_000)
    assert window.window_end == pause
    request.num_decoded_positions = pause
    rest = read("Hands across the cold stream.", 8_000, 600, -0.1)
    out = stream.apply(WindowResult("s", rest, final=True))
    assert [w.text for w in out.committed] == [w.text for w in rest] and not Scheduler.final_due(request)


@pytest.mark.parametrize("text, flushed, length, held", [
    (" the", False, 500, True), (" Of.", False, 500, True), (" ago...", False, 500, True),
    (" said,\"", False, 500, True), (" fly.", False, 500, False), (" on", False, 500, False),
    (" the", True, 500, False),  # a flush (Finalize, the end of the stream) commits now
    (" the", False, MAX_WINDOW_POSITIONS - UNFINISHED_ROOM_POSITIONS, True),
    (" the", False, MAX_WINDOW_POSITIONS - UNFINISHED_ROOM_POSITIONS + 4, False)])  # no room
def test_a_reading_stopping_inside_a_sentence_is_held_where_the_window_has_room(text, flushed, length, held):
    """Its last word ends on an ellipsis or a clause mark, or is one no sentence ends on,
    whatever mark follows; a flush commits it, and so does a window with under 10 s of room
    for the next utterance (a full window commits before that utterance's pause)."""
    last = Word(text, 0, 300)
    window = facts(100, 100 + length, final=True, flushed=flushed)
    assert unfinished(window, last.ends_open) == held


def test_a_window_cut_at_the_committed_end_holds_none_of_the_committed_words():
    """The cut starts the window on an item, up to 80 ms before the committed end: the last
    committed word is not in the window (it stays in the prompt), and a decode that says it
    again in new speech keeps every word."""
    from engine.policy import LocalAgreement

    policy = LocalAgreement()
    policy.flush(words("and slightly cook it.", 7_534, 300))  # to 8.734 s
    policy.cut_window(8_720)
    assert policy.num_window_committed == 0
    said = "Leave it covered in a warm place"
    out = policy.flush(words(said, 9_800))
    assert " ".join(w.text.strip() for w in out.committed) == said
    policy.cut_window(11_250)  # a cut inside the committed words keeps those past it
    assert policy.num_window_committed == 2


def test_a_final_decoded_again_from_its_committed_end_starts_past_the_last_words_sound():
    """A retry's window (`commit.retries`) starts where the committed words end, on an item:
    the alignment ends a last word before its sound does, and a window that opens on that
    tail reads it as a word ("bed." read again as "Mmm dum", and the sentence after it lost).
    Where the VAD's run of speech ends within SPEECH_TAIL_MS past the committed end, the
    retry starts in the pause after it, still before the next speech's onset."""
    stream = speech_stream([(0, 10_150), (11_000, 14_000)], seconds=15)
    request = stream.request
    request.num_decoded_positions = ms_to_positions(14_400)
    request.endpoints.append(ms_to_positions(14_400))
    first = words("the first sentence is read", 0, 2_000)  # to 10 s
    out = stream.apply(WindowResult("s", first, final=True))  # the sentence after passed over
    assert [w.text for w in out.committed] == [w.text for w in first] and Scheduler.final_due(request)
    assert ms_to_positions(10_150) <= request.window_start <= ms_to_positions(11_000 - 200)
    stream = speech_stream([(0, 10_800), (11_000, 14_000)], seconds=15)  # speech on past the tail
    stream.request.num_decoded_positions = ms_to_positions(14_400)
    stream.request.endpoints.append(ms_to_positions(14_400))
    stream.apply(WindowResult("s", first, final=True))
    assert stream.request.window_start == ms_to_positions(10_000)


def test_a_final_that_stops_seconds_of_speech_short_of_its_end_is_decoded_again_from_there():
    """A file's final read to "... than he was." and passed over the last sentence; cut short
    at the pause after that sentence, it passed over it again, and the file lost it. A final
    whose committed words end 2 s or more of VAD speech before its end is decoded again from
    there, whatever it committed before them."""
    stream = speech_stream([(0, 10_000), (11_000, 14_000)], background=True, seconds=15)
    request = stream.request
    request.num_decoded_positions = ms_to_positions(14_400)
    request.endpoints.append(ms_to_positions(14_400))
    first = words("the first sentence is read", 0, 2_000)  # to 10 s
    assert stream.apply(WindowResult("s", first, final=True)).committed == []  # cut short next
    request.num_decoded_positions = request.endpoints[0]
    out = stream.apply(WindowResult("s", first, final=True))  # the last sentence passed over again
    assert len(out.committed) == 5
    # (from the committed end, or past the VAD's run that ends just after it)
    assert ms_to_positions(10_000) <= request.window_start <= ms_to_positions(10_800)
    assert Scheduler.final_due(request)
    last = words("then the last sentence", 11_000, 700)
    out = stream.apply(WindowResult("s", last, final=True))
    assert [w.text for w in out.committed] == [w.text for w in last]


def test_agreement_and_a_live_final_commit_no_word_past_speech_their_decodes_skipped():
    """Under babble, two partials that both passed over "She said that tomatoes grow better..."
    agreed on the sentence after it, and the sentence was lost. Agreement commits the words
    before seconds of VAD speech that no word covers; a live final that skips it commits the
    same and is retried from there."""
    runs = [(0, 4_000), (5_000, 9_000), (10_000, 13_000)]
    first = words("my grandmother talked to her plants.", 400, 600)  # to 4.0 s
    skipped = words("she said that tomatoes grow better", 5_000, 600)
    after = words("nobody believed her", 10_000, 900)
    stream = speech_stream(runs, seconds=15)
    request = stream.request
    for end_ms in (13_000, 14_000):
        request.num_decoded_positions = ms_to_positions(end_ms)
        out = stream.apply(WindowResult("s", first + after, final=False))
    assert [w.text for w in out.committed] == [w.text for w in first] and out.tentative == []
    # speech at the window's end that no word reads yet is no skip: the words before it
    # agree, all but the last (`test_a_partial_that_stops_seconds_of_speech_short...`)
    request.num_decoded_positions = ms_to_positions(15_000)
    stream.apply(WindowResult("s", first + skipped[:3], final=False))
    out = stream.apply(WindowResult("s", first + skipped[:3], final=False))
    assert [w.text for w in out.committed] == [w.text for w in skipped[:2]]

    live = speech_stream(runs, seconds=15)
    request = live.request
    request.num_decoded_positions = ms_to_positions(14_400)
    request.endpoints.append(ms_to_positions(14_400))
    out = live.apply(WindowResult("s", first + after, final=True))
    assert [w.text for w in out.committed] == [w.text for w in first]
    assert request.window_start == ms_to_positions(4_000) and Scheduler.final_due(request)
    out = live.apply(WindowResult("s", skipped + after, final=True))
    assert [w.text for w in out.committed] == [w.text for w in skipped + after]
    assert not Scheduler.final_due(request)
    # read from the committed end, the speech is skipped again: the words are kept as decoded
    again = speech_stream(runs, seconds=15)
    again.request.num_decoded_positions = ms_to_positions(14_400)
    again.apply(WindowResult("s", first + after, final=True))
    out = again.apply(WindowResult("s", after, final=True))
    assert [w.text for w in out.committed] == [w.text for w in after]


def test_a_partial_that_stops_seconds_of_speech_short_of_its_end_commits_not_its_last_word():
    """In run-on speech a window cut at "The storm arrived in the middle of the night..." was
    read "story." and nothing after, over 9 s of speech, by two partials in a row: they agreed,
    and the final, read right, found "storm" in the committed "story." and dropped "The
    storm". A decode that ends its text with seconds of VAD speech after its last word stopped
    early, and that word often took the speech after it: agreement commits the words before it
    and waits."""
    stream = speech_stream([(0, 12_000)], seconds=13)
    request = stream.request
    for end_ms in (9_000, 10_000, 11_000):
        request.num_decoded_positions = ms_to_positions(end_ms)
        out = stream.apply(WindowResult("s", words("story.", 100, 600), final=False))
    assert out.committed == [] and stream.policy.committed == []
    early = words("the storm arrived in", 100, 400)  # to 1.7 s, then stops
    for end_ms in (11_500, 12_000):
        request.num_decoded_positions = ms_to_positions(end_ms)
        out = stream.apply(WindowResult("s", early, final=False))
    assert [w.text for w in out.committed] == [w.text for w in early[:3]]
    # a reading to the window's end commits its last word as agreement does
    read_on = early + words("the middle of the night and knocked out the power", 1_700, 1_000)
    for end_ms in (12_500, 13_000):
        request.num_decoded_positions = ms_to_positions(end_ms)
        out = stream.apply(WindowResult("s", read_on, final=False))
    assert [w.text for w in stream.policy.committed] == [w.text for w in read_on]


FULL_STOP = 13  # "." in the model's vocabulary


def live_final(runs_ms: list[tuple[int, int]], end_ms: int, flushed: bool,
               said: list[Word]) -> tuple[Stream, EngineOutput]:
    """A stream whose VAD heard these runs, with a first final (to its endpoint at `end_ms`,
    or flushed there) that read `said`, given the model's full stop."""
    stream = speech_stream(runs_ms, seconds=max(b for _, b in runs_ms) // 1000 + 1)
    stream.full_stop = FULL_STOP
    request = stream.request
    request.num_decoded_positions = ms_to_positions(end_ms)
    request.endpoints.append(ms_to_positions(end_ms))
    if flushed:
        request.flush_position = ms_to_positions(end_ms)
    return stream, stream.apply(WindowResult("s", said, final=True))


@pytest.mark.parametrize("last, flushed, stop", [
    (" hill", False, [FULL_STOP]),  # ended at a pause with no mark: its prompts read one
    (" hill.", False, []), (" hill?", False, []),  # the decoder's own mark
    (" hill", True, [])])  # a flush ends it where the client asked, not at a pause
def test_a_live_final_that_ends_at_a_pause_with_no_full_stop_is_read_with_one_in_later_prompts(
        last, flushed, stop):
    """Whisper carries a prompt's style on: a final that ended its sentence with no full stop
    made the prompts of the finals after it end theirs without, and they went on so and read
    worse. A live final ends at a pause the VAD heard: its last word ends a sentence in later
    prompts (its segment closes there) and in the draft of a window that keeps it; the
    committed text stays as decoded."""
    said = read("we walked up to the hill", 400, 600, -0.1)
    said[-1].text = last
    stream, out = live_final([(0, 4_000), (5_000, 9_000)], 4_400, flushed, said)
    assert [w.text for w in out.committed] == [w.text for w in said]
    assert stream.policy.committed[-1].stop == stop
    ts = 50363
    after = 4_400  # a decode of the audio after them (the window keeps them: it reads them)
    assert stream.policy.prompt_tokens(100, after) == [0] * 6 + stop
    timed = stream.policy.prompt_tokens(100, after, timestamp_begin=ts)
    assert timed[0] == ts and timed[1:-1] == [0] * 6 + stop and timed[-1] > ts  # one segment
    # a long window's final keeps its last sentence as the next one's context: that sentence's
    # text opens the next decode, given as read, with the stop
    said = read("we walked up to the hill.", 400, 700, -0.1) + read("then shape the loaf", 6_200, 1_000, -0.1)
    said[-1].text = last
    stream, _ = live_final([(0, 5_000), (6_000, 11_000)], 11_400, flushed, said)
    if not flushed:  # (a flushed window is cut at its end)
        start, num_forced = stream.kept
        assert 4_000 < positions_to_ms(start) < 6_200  # (in the pause before the sentence)
        forced = stream.drafts[start][1][:num_forced]
        assert forced[1:-1] == [0] * 4 + stop and min(forced[0], forced[-1]) >= ts


@pytest.mark.parametrize("temperature, context", [
    (0.0, "we walked up to a hill then shape the loaf"),  # the greedy reading, with more audio
    (0.4, "we walked up to the hill then shape the loaf")])  # a fallback's sample: not taken
def test_a_greedy_final_reads_the_windows_committed_words_for_later_prompts(temperature, context):
    """A final that decodes the window from its start reads its committed words again, with
    the speech after them: its reading (a greedy one) is their text in later prompts; the
    committed text stays."""
    stream, first = first_utterance_committed()
    request = stream.request
    request.num_decoded_positions = ms_to_positions(9_400)
    request.endpoints.append(ms_to_positions(9_400))
    again = read("we walked up to a hill", 400, 600, -0.1)
    out = stream.apply(WindowResult("s", again + read("then shape the loaf", 5_000, 900, -0.1),
                                    final=True, temperature=temperature))
    assert [w.key for w in out.committed] == ["then", "shape", "the", "loaf"]
    assert " ".join(w.key for w in stream.policy.context) == context
    assert [w.key for w in stream.policy.committed[:6]] == [w.key for w in first]


@pytest.mark.parametrize("temperature, prompted", [(0.0, True), (0.6, False), (1.0, False)])
def test_a_hot_finals_words_are_in_no_later_prompt(temperature, prompted):
    """A decode that every low temperature failed (under babble: "Thank you." for 10 s of
    speech, sampled at 1.0) is no prompt, as Whisper's rule has it: its own words included.
    Prompted with them, the retries from its committed end read "Thank you." again and again
    over the talker's first sentences. The words before it are no prompt either."""
    stream, first = first_utterance_committed()
    request = stream.request
    request.num_decoded_positions = ms_to_positions(9_400)
    request.endpoints.append(ms_to_positions(9_400))
    said = read("thank you", 5_000, 600, -0.3)
    out = stream.apply(WindowResult("s", first + said, final=True, temperature=temperature))
    assert [w.key for w in out.committed] == ["thank", "you"]
    later = stream.policy.prompt_tokens(100, 9_400)
    assert later == ([0] * 8 if prompted else [])


def test_partials_that_skip_speech_after_committed_words_near_the_windows_start_agree_on_none_past_it():
    """A window cut at "We ate", committed by agreement, to read its sentence again: two
    partials read it and the 8 s after it, "cold sandwiches on the floor...", as the one word
    "wall.", the first stretched over all of it, the second at its end; they agreed, and the
    speech was lost. Speech a partial skips after the window's committed words holds
    agreement back however near the window's start they end."""
    stream = speech_stream([(0, 12_000)], seconds=13)
    request = stream.request
    out = read_partials(stream, [], 0, [(9_000, "we ate cold sandwiches"), (9_500, "we ate told")])
    assert [w.text for w in out.committed] == [" we", " ate"]  # they end 0.6 s into the window
    for end_ms, word in ((10_000, Word(" wall.", 0, 9_800)), (11_000, Word(" wall.", 9_500, 10_900))):
        request.num_decoded_positions = ms_to_positions(end_ms)
        out = stream.apply(WindowResult("s", [word], final=False))
    assert out.committed == [] and [w.text for w in stream.policy.committed] == [" we", " ate"]
    read = words("we ate cold sandwiches on the floor and laughed about it", 0, 1_000)
    for end_ms in (11_500, 12_000):
        request.num_decoded_positions = ms_to_positions(end_ms)
        out = stream.apply(WindowResult("s", read, final=False))
    assert [w.text for w in stream.policy.committed] == [w.text for w in read]


@pytest.mark.parametrize("before, after, given, given_logprob, read_on", [
    (" climb", " before", False, None, True), (" climb.", " before", False, None, True),
    (" climb", " Before", False, None, True),  # read again with no sentence end before the pause
    (" climb.", " Before", False, None, False), (" climb!", " I", False, None, False),
    (" climb.", " 20", False, None, False), (" climb", " Before", True, None, False),
    (None, " before", False, None, True), (None, " Before", False, None, False),
    # given: its mark is the final before's; the decoder's odds for it tell
    (" climb.", " Before", True, -2.0, True), (" climb.", " Before", True, -0.1, False),
    (" climb.", " before", True, -0.1, True), (" climb.", " Before", False, -2.0, False)])
def test_a_final_reads_on_across_the_pause_before_it(before, after, given, given_logprob, read_on):
    """The final after a pause reads the word before it again, with the speech after it: no
    sentence end there, or the word after in lower case, is a sentence the talker went on
    with. Text taken as given (a kept sentence) has its mark from the final before: there the
    decoder's log-probability of that mark, hearing the speech after it, tells."""
    word = None if before is None else Word(before, 1_000, 1_300)
    assert reads_on(word, Word(after, 2_000, 2_300), given, given_logprob) == read_on


def test_a_talker_pauses_inside_sentences_when_three_of_the_last_eight_pauses_are_read_on():
    habit = PauseHabit()
    for _ in range(2):
        habit.observe(True)
    assert not habit.inside_sentences  # a misread capital, or a fluent talker's pause at a comma
    habit.observe(True)
    assert habit.inside_sentences
    for _ in range(5):
        habit.observe(False)
    assert habit.inside_sentences
    habit.observe(False)
    assert not habit.inside_sentences


def test_a_talker_seen_pausing_inside_sentences_has_each_final_read_with_the_next_utterance():
    """The finals after a talker's pauses read on across three of them as one sentence: from
    then on each live final waits, however it ends, to be read again with the next utterance
    (or alone after HOLD_SILENCE_MS of silence), as one that stops on "the" does."""
    stream = speech_stream([(k * 3_000, k * 3_000 + 2_000) for k in range(5)], seconds=15)
    request = stream.request
    said = ["We started the climb", "before dawn", "carrying our boots", "in our hands", "across the stream"]
    starts = [400, 3_000, 6_000, 9_000, 12_000]

    def reading(n: int) -> list[Word]:  # the first n utterances, each ended by a full stop if last
        texts = [t + ("." if i == n - 1 else "") for i, t in enumerate(said[:n])]
        return [w for t, s in zip(texts, starts, strict=False) for w in read(t, s, 400, -0.1)]

    committed = []
    for n in range(1, 6):
        request.num_decoded_positions = request.endpoints[0]
        out = stream.apply(WindowResult("s", reading(n), final=True))
        committed += [w.text for w in out.committed]
        assert stream.held is None if n < 4 else stream.held is not None
    # the fourth and fifth wait
    assert committed == [w.text for w in reading(1) + reading(2)[4:] + reading(3)[6:]]
    assert [w.text for w in out.tentative] == [w.text for w in reading(5)][len(committed):]
    hear_silence(stream, 1_200)
    assert Scheduler.final_due(request)
    request.num_decoded_positions = Scheduler()._window(request, partial=False).window_end
    out = stream.apply(WindowResult("s", reading(5), final=True))
    assert [w.text for w in out.committed] == [w.text for w in reading(5)][len(committed):]
    assert stream.held is None


def test_a_talker_whose_pauses_end_sentences_has_each_final_committed_at_once():
    stream = speech_stream([(0, 2_000), (3_000, 5_000), (6_000, 8_000)], seconds=10)
    request = stream.request
    said = [("We started the climb.", 400), ("Before dawn it rained.", 3_000), ("Then it snowed.", 6_000)]
    for n in range(1, 4):
        request.num_decoded_positions = request.endpoints[0]
        reading = [w for t, s in said[:n] for w in read(t, s, 400, -0.1)]
        out = stream.apply(WindowResult("s", reading, final=True))
        assert [w.text for w in out.committed] == [w.text for w in read(*said[n - 1], 400, -0.1)]
        assert stream.held is None


def test_held_words_read_to_a_sentence_end_at_their_pause_are_committed_and_the_rest_waits():
    """The final after a held one reads its pause as a sentence's end (a full stop, and a
    capital after it): the held words are done and committed; the new utterance, of a
    talker who pauses inside sentences, waits for the next one."""
    stream = speech_stream([(k * 3_000, k * 3_000 + 2_000) for k in range(5)], seconds=15)
    request = stream.request
    utterances = [read("We started the climb", 400, 400, -0.1), read("before dawn", 3_000, 400, -0.1),
                  read("carrying our boots", 6_000, 400, -0.1), read("in our hands", 9_000, 400, -0.1),
                  read("Then we rested.", 12_000, 400, -0.1)]
    ended = [read("We started the climb.", 400, 400, -0.1), read("before dawn.", 3_000, 400, -0.1),
             read("carrying our boots.", 6_000, 400, -0.1), read("in our hands.", 9_000, 400, -0.1)]
    for n in range(4):  # the finals after the first three pauses read on: the fourth is held
        request.num_decoded_positions = request.endpoints[0]
        stream.apply(WindowResult("s", [w for u in utterances[:n] for w in u] + ended[n], final=True))
    assert stream.held is not None
    request.num_decoded_positions = request.endpoints[0]
    out = stream.apply(WindowResult("s", [w for u in utterances[:3] for w in u] + ended[3] + utterances[4],
                                    final=True))
    assert [w.text for w in out.committed] == [" in", " our", " hands."]
    assert [w.text for w in out.tentative] == [" Then", " we", " rested."] and stream.held is not None


@pytest.mark.parametrize("given_logprob, inside", [(-2.0, True), (-0.1, False)])
def test_a_talker_is_seen_pausing_inside_sentences_where_the_decoder_doubts_a_given_full_stop(
        given_logprob, inside):
    """A talker's fragments, each read alone as a sentence ("The old bridge.") and committed,
    then given as the next final's context with their full stop: the word after one takes its
    case from that stop, so the finals read no sentence going on. The decoder, hearing the
    speech after the pause, finds the given stop unlikely (`given_logprob`): the talker pauses
    inside sentences, and later finals wait for the next utterance. Sure of the stops, the
    talker's pauses end sentences."""
    texts = ["The old bridge.", "Over the river.", "Was closed.", "For repairs.", "All winter.",
             "Nobody minded.", "In the village.", "At all."]
    stream = speech_stream([(k * 3_000, k * 3_000 + 2_000) for k in range(len(texts))], seconds=26)
    stream.full_stop = FULL_STOP
    request = stream.request
    given = 0
    for k in range(len(texts)):
        request.num_decoded_positions = request.endpoints[0]
        start = positions_to_ms(request.window_start)
        given += stream.forced(request.window_start, preview=False) > 0
        reading = [w for i, t in enumerate(texts[: k + 1]) if i * 3_000 + 400 >= start
                   for w in read(t, i * 3_000 + 400, 400, -0.1)]
        stream.apply(WindowResult("s", reading, final=True, given_logprob=given_logprob))
    assert given >= 2
    assert stream.habit.inside_sentences == inside
    assert (stream.held is not None) == inside
