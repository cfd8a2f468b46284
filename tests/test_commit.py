"""The commit rules, without a model: window facts -> what to commit, where the window starts."""

import numpy as np
import pytest

from engine.commit import (
    FORCE_KEEP_POSITIONS,
    RETRY_SPEECH_MS,
    TRIM_AFTER_POSITIONS,
    Action,
    WindowFacts,
    commits_whole,
    new_window_start,
    plan,
)
from engine.speech_map import SpeechMap

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


def test_a_final_that_stopped_short_of_speech_is_decoded_again_from_its_committed_end():
    window = facts(start=0, end=1276, final=True, flushed=True)  # 25.5 s, the first 14 s committed
    assert new_window_start(window, Action.FINAL, 707, speech_after_ms=RETRY_SPEECH_MS) == 707
    assert new_window_start(window, Action.FINAL, 707, speech_after_ms=RETRY_SPEECH_MS - 1) == 1276
    # the retry, from the committed end: if it commits nothing either, it is cut at its end
    retry = facts(start=704, end=1276, final=True, flushed=True)
    assert new_window_start(retry, Action.FINAL, 707, speech_after_ms=5000) == 1276


def test_speech_map_measures_the_speech_in_a_span():
    speech = SpeechMap(0.5)
    speech.push(np.array([0, 1, 1, 0, 0, 1, 0], dtype=np.float32))  # 32 ms chunks
    assert speech.speech_ms(0, 1000) == 96
    assert speech.speech_ms(40, 170) == (96 - 40) + (170 - 160)
    assert speech.speech_ms(100, 160) == 0


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
