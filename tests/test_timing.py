"""Word times from the audio: the DTW path search, the alignment of decoded text over
cross-attention (offline and streaming), the VAD's speech map that moves word edges into
speech, and the timestamped prompt of long-form transcription."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.engine import Engine
from engine.model import transcribe as transcribe_module
from engine.model.timing import dtw
from engine.model.transcribe import transcribe
from engine.speech_map import (
    LAG_MS,
    MIN_WORD_MS,
    ONSET_PAD_MS,
    RESUME_MS,
    SHORT_WORD_MS,
    SNAP_MS,
    WORD_MS_PER_LETTER,
    SpeechMap,
)
from engine.words import Word, aligned_words, window_words
from scripts import corpus
from scripts.evaluate import replay_clip
from scripts.wer import word_errors
from tests.helpers import audio, bundle, librivox_path, speech_onset_ms, transcripts


def cheapest_total(cost: np.ndarray) -> float:
    """The textbook O(N M) recursion, as the reference."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    total[0, 0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            total[i, j] = cost[i - 1, j - 1] + min(total[i - 1, j - 1], total[i - 1, j], total[i, j - 1])
    return float(total[n, m])


SHAPES = [(1, 1), (1, 9), (7, 1), (5, 40), (30, 12), (25, 300)]


@pytest.mark.parametrize("shape", SHAPES)
def test_dtw_finds_a_cheapest_monotonic_path(shape):
    rng = np.random.default_rng(sum(shape))
    cost = rng.standard_normal(shape)
    [(rows, cols)] = dtw([torch.from_numpy(cost)])
    assert (rows[0], cols[0]) == (0, 0) and (rows[-1], cols[-1]) == (shape[0] - 1, shape[1] - 1)
    steps = np.stack([np.diff(rows), np.diff(cols)], axis=1)
    assert ((steps >= 0) & (steps <= 1)).all() and (steps.sum(axis=1) >= 1).all()
    assert cost[rows, cols].sum() == pytest.approx(cheapest_total(cost))


def test_dtw_of_matrices_together_is_each_alone():
    """The matrices of a step are padded to the largest and searched in one pass: the
    padding must not move any path (ties included: rounded costs)."""
    rng = np.random.default_rng(1)
    costs = [torch.from_numpy(np.round(rng.standard_normal(shape), 1)) for shape in SHAPES]
    together = dtw(costs)
    for cost, (rows, cols) in zip(costs, together, strict=True):
        [(alone_rows, alone_cols)] = dtw([cost])
        assert np.array_equal(rows, alone_rows) and np.array_equal(cols, alone_cols)
        assert cost.numpy()[rows, cols].sum() == pytest.approx(cheapest_total(cost.numpy()))


def test_aligned_words_take_token_times_and_cut_a_first_word_that_took_in_a_pause():
    tokenizer = bundle().tokenizer
    ids = {token: i for i, token in enumerate(tokenizer.id_to_token)}
    text = [ids[t] for t in ("ĠHe", "Ġwas", "Ġnot", "Ġan", "Ġold", "Ġyoung", "Ġman", ".")]
    starts = [0.0] + [3.0 + 0.25 * i for i in range(len(text))]  # the first token from 0 s
    words = aligned_words(tokenizer, text, starts)
    assert [w.text for w in words] == [" He", " was", " not", " an", " old", " young", " man."]
    assert all(a.end_ms == b.start_ms for a, b in zip(words, words[1:], strict=False))
    assert words[0].end_ms == 3000 and words[0].start_ms >= 2000  # not 0: cut to twice a median word
    assert words[-1].end_ms == 4500  # where its full stop starts, not where the text ends (4.75 s)


@pytest.mark.parametrize("aligned", [True, False])
def test_a_windows_words_know_their_segment(aligned):
    """SpeechMap.fit keeps or drops a segment whole: each word carries its segment's index,
    timed from the aligner or spread over the segment."""
    tokenizer = bundle().tokenizer
    ids = {token: i for i, token in enumerate(tokenizer.id_to_token)}
    ts = tokenizer.timestamp_begin
    first = [ids[t] for t in ("ĠHe", "Ġwas", "Ġnot", ".")]
    second = [ids[t] for t in ("ĠAn", "Ġold", "Ġman", ".")]
    tokens = [ts, *first, ts + 100, ts + 150, *second, ts + 300]
    starts = [0.2 * i for i in range(9)] if aligned else None
    words, _ = window_words(tokenizer, tokens, 10.0, 8.0, starts)
    assert [(w.text, w.segment) for w in words] == [
        (" He", 0), (" was", 0), (" not.", 0), (" An", 1), (" old", 1), (" man.", 1)]


def speech_map(runs_ms: list[tuple[int, int]], total_ms: int) -> SpeechMap:
    """A map fed probabilities that are speech (1.0) inside the runs, silence (0.0) elsewhere."""
    chunk_ms = 32
    probs = np.array([1.0 if any(a <= k * chunk_ms < b for a, b in runs_ms) else 0.0
                      for k in range(total_ms // chunk_ms)], np.float32)
    speech = SpeechMap(threshold=0.5)
    speech.push(probs)
    return speech


def test_speech_map_finds_speech_the_words_leave_out_and_the_next_onset():
    def said(start_ms: int, end_ms: int) -> list[Word]:  # words of 400 ms over a stretch
        return [Word(" w", t, t + 400) for t in range(start_ms, end_ms - 399, 400)]

    # speech 0-3 s, 4-7 s, 8-12 s (in 32 ms chunks)
    speech = speech_map([(0, 3008), (4000, 7008), (8000, 12000)], 12800)
    first, middle, last = said(100, 2900), said(4100, 6900), said(8100, 11900)
    # 4-7 s has no word: (where the word before ends, where the word after starts)
    assert speech.unheard(0, 12800, first + last, 2000) == (first[-1].end_ms, 8100)
    assert speech.unheard(0, 12800, first + middle + last, 2000) is None
    assert speech.unheard(0, 12800, last, 2000) == (0, 8100)  # before the first word
    assert speech.unheard(0, 12800, first, 2000) == (first[-1].end_ms, 12800)  # after the last
    assert speech.unheard(0, 12800, first + last, 4000) is None  # 3 s of speech < 4 s
    # a word stretched over seconds covers only its edges
    stretched = Word(" of", first[-1].end_ms, 8100)
    assert speech.unheard(0, 12800, [*first, stretched, *last], 2000) == (3400, 7600)
    # a word stamped inside the speech the words skip splits it into stretches of 1.3 and 1.0 s:
    # together, less the speech the word covers, 2.2 s are left out
    inside = Word(" he", 5600, 5700)
    assert speech.unheard(0, 12800, [*first, inside, *last], 2000) == (first[-1].end_ms, 8100)
    assert speech.unheard(0, 12800, [*first, *middle[:4], inside, *last], 2000) is None
    # from 6 s on (words before it committed, read again with the window): the gap before
    # `last` holds 1 s of speech since 6 s, not the 3 s since `first`; a gap after 6 s counts
    assert speech.unheard(6000, 12800, first + last, 2000) is None
    assert speech.unheard(6000, 12800, first + last[:2], 2000) == (last[1].end_ms, 12800)
    assert speech.unheard(3500, 12800, first + last, 2000) == (3500, 8100)
    assert speech.onset_within(3000, 12800) == 4000
    assert speech.onset_within(4100, 7900) is None
    assert speech.onset_within(0, 12800) == 0
    # the first pause of 500 ms (1 s) once 2 s (4 s) of speech were heard from 1 s
    assert speech.pause_after(1000, 2000, 500) == 3008
    assert speech.pause_after(1000, 4000, 500) == 7008
    assert speech.pause_after(1000, 2000, 1000) == 12000  # the pauses are 992 ms
    assert speech.pause_after(1000, 9500, 500) is None


def test_a_window_goes_on_before_an_onset_its_consumed_end_lies_just_before():
    """The VAD hears an onset late (a quiet first consonant under noise: "From the summit"
    heard 0.1 s after it began): a window that consumed up to 50 ms before the run starts
    has cut into its first word, and the next window, starting there, read the sentence
    after it. It goes on ONSET_PAD_MS before the run."""
    speech = speech_map([(0, 3008), (4000, 7008)], 8000)
    assert speech.resume_at(3000, 3950) == 4000 - ONSET_PAD_MS  # the run starts 50 ms after
    assert speech.resume_at(3000, 4000 - ONSET_PAD_MS - 10) is None  # before the pad: as it is
    assert speech.resume_at(3800, 3950) is None  # a run 200 ms after the last word is its own
    assert speech.resume_at(3000, 3500) is None  # a pause of 500 ms before the onset
    assert speech.resume_at(3000, 4300) == 4000 - ONSET_PAD_MS  # the run started before the end


def test_the_reading_after_a_final_starts_early_in_the_pause_that_ended_it():
    """Sentences 0.3 s apart: the endpoint (a quarter second of VAD pause) lies at the next
    sentence's onset or in its first word. What comes after the final starts RESUME_MS into
    the pause, where the VAD's speech ended, not at the endpoint."""
    speech = speech_map([(0, 3008), (3296, 6016)], 6400)  # a pause of 288 ms
    assert speech.after_pause(3264) == 3008 + RESUME_MS  # the endpoint, just before the onset
    assert speech.after_pause(3328) == 3008 + RESUME_MS  # ... just after it (heard before)
    assert speech.after_pause(3040) == 3040  # (never after the endpoint)
    # speech runs through the endpoint (a dip under other voices): it stays where it is
    assert speech.after_pause(2500) == 2500
    assert speech.after_pause(3600) == 3600  # the next run began 304 ms before: its own
    long = speech_map([(0, 3008), (4512, 6016)], 6400)  # a pause of 1.5 s
    assert long.after_pause(3328) == 3008 + RESUME_MS
    assert speech_map([], 6400).after_pause(3328) == 3328  # no speech remembered


def test_speech_map_moves_word_edges_into_speech_and_drops_segments_of_silence():
    speech = speech_map([(1024, 2048), (8000, 9024)], 12000)
    early = Word(" early", 200, 1500)  # starts in the silence before the speech
    late = Word(" late", 1700, 3500)  # ends in the silence after it
    ghost = Word(" you.", 5000, 5400, segment=1)  # a segment nowhere near speech
    inside = Word(" inside", 8100, 8900, segment=2)  # starts late in its speech (moved back)
    unheard = Word(" unheard", 11990, 12500, segment=3)  # past what the VAD has analysed
    words = speech.fit([early, late, ghost, inside, unheard])
    assert [w.text for w in words] == [" early", " late", " inside", " unheard"]
    # a word the VAD did not hear, in a segment it did (a voice it barely hears), is kept
    between = Word(" between", 5000, 5400, segment=2)
    assert " between" in [w.text for w in speech.fit([between, Word(" inside", 8100, 8900, segment=2)])]
    assert speech.fit([between]) == []
    assert early.start_ms == 1024 - SpeechMap.PAD_MS and early.end_ms == 1500
    assert late.start_ms == 1700 and late.end_ms == 2048 + SpeechMap.PAD_MS
    assert (inside.start_ms, inside.end_ms) == (8000 - SpeechMap.PAD_MS, 8900)
    near = Word(" near", 7000, 8000 - SpeechMap.PAD_MS - SNAP_MS // 2)  # ends just before speech
    assert speech.fit([near]) == [near] and near.start_ms > 7000
    speech.forget_before(5000)
    assert speech.starts == [8000]


def test_speech_map_starts_a_late_first_word_where_its_speech_starts():
    """The alignment starts the first word after a pause late; it moves back to the onset of
    its run of speech, unless a word before it (or the window's start) lies in that run, or
    the run began more than ONSET_LEAD_MS before it."""
    speech = speech_map([(1024, 3008), (5024, 7008), (9024, 12000)], 12800)
    pad = SpeechMap.PAD_MS
    late = Word(" late", 1500, 1900)  # 476 ms into its speech, nothing before it
    second = Word(" second", 2000, 2500)  # the word before it lies in the same speech
    after_window = Word(" cut", 5300, 5600)  # the window starts after that speech began
    long_after = Word(" far", 6100, 6500)  # over a second into its speech
    again = Word(" again", 9300, 9700)
    assert speech.fit([late, second, again]) == [late, second, again]
    assert late.start_ms == 1024 - pad and second.start_ms == 2000
    assert again.start_ms == 9024 - pad
    speech.fit([after_window], floor_ms=5100)
    speech.fit([long_after])
    assert after_window.start_ms == 5300 and long_after.start_ms == 6100


def test_a_first_word_left_at_the_start_of_a_window_before_its_speech_starts_there():
    """A window opens 1 s before speech after a long gap; DTW left the first word at the
    window's start, zero seconds long (offline's " Let" in a 40 s gap of noise): it moves to
    where the speech starts. Not a word the VAD did not hear between runs it did hear, nor
    one aligned later than the window's start (it has its own place)."""
    pad = SpeechMap.PAD_MS
    speech = speech_map([(1024, 2048), (41_024, 45_024)], 46_000)
    first, second = Word(" Let", 40_000, 40_000, segment=1), Word(" me", 41_050, 41_300, segment=1)
    assert speech.fit([first, second], floor_ms=40_000) == [first, second]
    assert first.start_ms == 41_024 - pad and first.end_ms == first.start_ms + MIN_WORD_MS
    assert second.start_ms == 41_050
    alone = Word(" you.", 40_000, 40_300, segment=1)  # a segment of its own: dropped
    assert speech.fit([alone], floor_ms=40_000) == []
    placed = Word(" between", 39_000, 39_400, segment=1)  # 1 s past the window's start
    speech.fit([placed, Word(" me", 41_050, 41_300, segment=1)], floor_ms=38_000)
    assert placed.start_ms == 39_000
    inside = Word(" Let", 1_500, 1_500, segment=1)  # the window starts in speech before it
    speech.fit([inside, Word(" me", 41_050, 41_300, segment=1)], floor_ms=1_500)
    assert inside.start_ms == 1_500


def test_a_first_word_whose_next_word_also_lies_before_the_speech_heard_stays_in_order():
    """The VAD may hear an onset late (0.6 s after a tune ends, "The old stone bridge"): where
    DTW places the next word before that onset too, the first word is not the window's
    lead-in but speech the VAD has not heard. It stays where it is, before the next word."""
    speech = speech_map([(1024, 2048), (41_024, 45_024)], 46_000)
    first, second = Word(" The", 40_150, 40_580, segment=1), Word(" old", 40_580, 40_850, segment=1)
    third = Word(" stone", 41_050, 41_400, segment=1)
    assert speech.fit([first, second, third], floor_ms=40_000) == [first, second, third]
    assert first.start_ms == 40_150
    assert first.start_ms <= second.start_ms <= third.start_ms


def test_a_word_after_punctuation_with_no_pause_starts_where_the_word_before_ends():
    """DTW gives a full stop the start of the next word where there is no pause for it: the
    gap it leaves goes to the next word when the VAD heard speech all through it, not when it
    heard a pause there (the pause's onset), nor when the gap is longer than LAG_MS. Where the
    full stop starts before the VAD hears the speech end (within SNAP_MS), the word ends there."""
    speech = speech_map([(1024, 4000), (4512, 8000)], 9000)
    end, run_on = Word(" corridor.", 1500, 2000), Word(" The", 2250, 2500)
    assert speech.fit([end, run_on]) == [end, run_on] and run_on.start_ms == 2000
    end, after_pause = Word(" planets.", 3500, 3900), Word(" Two", 4600, 4900)
    speech.fit([end, after_pause])
    assert end.end_ms == 4000 + SpeechMap.PAD_MS and after_pause.start_ms == 4512 - SpeechMap.PAD_MS
    end, far = Word(" apart.", 5000, 5200), Word(" Later", 5200 + LAG_MS + 100, 6000)
    speech.fit([end, far])
    assert far.start_ms == 5200 + LAG_MS + 100


def test_a_word_moved_back_to_speech_is_moved_no_further_than_its_letters_allow():
    """The alignment starts a sentence's first word late after a pause, so a first word in a
    run of speech starts where the run does. Under other voices (babble) the VAD hears the
    pause as speech, and a run may begin at a dip in them long before the word: " We",
    aligned where it is said, was moved 0.7 s back into the pause. A start moved back to a
    run with no pause before it, or over punctuation with none, goes no further than makes
    the word as long as its letters allow (WORD_MS_PER_LETTER each, at least SHORT_WORD_MS),
    and never after where it was aligned; a word of many letters, or one aligned late by
    less, starts at the run (after a pause, it always does:
    test_speech_map_starts_a_late_first_word_where_its_speech_starts)."""
    speech = speech_map([(0, 4000), (4064, 9000)], 9000)  # a dip between two sentences
    onset = 4064 - SpeechMap.PAD_MS
    end, first = Word(" close.", 3420, 3860), Word(" We", 4740, 5020)
    assert speech.fit([end, first]) == [end, first]
    assert first.start_ms == 5020 - max(SHORT_WORD_MS, 2 * WORD_MS_PER_LETTER) and first.end_ms == 5020
    lagged = Word(" We", 4300, 4500)
    speech.fit([Word(" close.", 3420, 3860), lagged])
    assert lagged.start_ms == onset
    long_word = Word(" Nevertheless", 4740, 5300)  # 12 letters may take 1.8 s
    speech.fit([Word(" close.", 3420, 3860), long_word])
    assert long_word.start_ms == onset
    run_on = speech_map([(0, 9000)], 9000)  # no pause: the full stop took the word's start
    lag = Word(" We", 4400, 4700)
    run_on.fit([Word(" close.", 3700, 4000), lag])
    assert lag.start_ms == 4700 - SHORT_WORD_MS


def test_a_word_read_across_a_pause_starts_where_its_speech_after_the_pause_does():
    """With no timestamp or punctuation between two sentences ("customers Everyone"), DTW
    gives the pause to the next word, which then starts in the VAD's hangover of the speech
    before: it starts where the speech after the pause does, when most of it lies there. A
    word that lies mostly before the pause, or spans a dip shorter than PAUSE_MS, stays."""
    pad = SpeechMap.PAD_MS
    speech = speech_map([(1024, 4000), (5024, 8000)], 9000)
    before = Word(" customers", 3300, 3620)
    across = Word(" Everyone", 3620, 5600)  # 410 ms before the pause's 1 s, 606 ms after it
    assert speech.fit([before, across]) == [before, across]
    assert across.start_ms == 5024 - pad and before.start_ms == 3300
    long = Word(" everything", 3300, 5200)  # mostly before the pause: its end is the misplaced edge
    speech.fit([long])
    assert long.start_ms == 3300
    dip = speech_map([(1024, 3008), (3200, 6016)], 7000)  # a 192 ms dip in speech, no pause
    word = Word(" across", 2800, 3600)
    dip.fit([word])
    assert word.start_ms == 2800


def test_a_mark_before_a_closing_quote_or_bracket_still_ends_the_phrase():
    assert Word(' said."', 0, 1).ends_sentence and Word(" (really)?", 0, 1).ends_sentence
    assert Word(" it),", 0, 1).ends_clause and Word(" \u201cno,\u201d", 0, 1).ends_phrase
    assert not any(Word(t, 0, 1).ends_phrase for t in (' "quoted"', " (aside)", " 'tis"))
    speech = speech_map([(1024, 4000)], 5000)
    end, run_on = Word(' corridor."', 1500, 2000), Word(" The", 2250, 2500)
    speech.fit([end, run_on])
    assert run_on.start_ms == 2000


def test_sentences_spoken_with_little_or_no_pause_between_keep_their_onsets():
    """Run-on speech (0.04 s between sentences) and short pauses (0.2 s), by turns: the first
    word of each sentence is stamped at its onset, offline and streaming. The alignment alone
    starts some 0.25-0.4 s late in run-on speech (the full stop before it took its start)."""
    voice = corpus.Voice("espeak", "en-gb+f2", 175, 50)
    pieces = [corpus.tts_piece(text, voice) for text in corpus.PASSAGES[2] + corpus.PASSAGES[5]]
    clip = corpus.layout("run-on", "run-on", pieces, [(0.04, 0.2)[k % 2] for k in range(len(pieces) - 1)])
    manifest = corpus.manifest(clip, "run-on.wav")
    offline = [(w.start_ms / 1000, w.end_ms / 1000, w.text)
               for s in transcribe(bundle(), torch.from_numpy(clip.audio)).segments for w in s.words]
    streamed = replay_clip(Engine(bundle()), clip.audio, 1600)
    for words in (offline, streamed):
        onsets = sorted(corpus.score(manifest, words).onset_errors)
        text = "".join(w for _, _, w in words)
        assert len(onsets) >= 6 and onsets[len(onsets) // 2] <= 0.1 and onsets[-1] <= 0.3, (onsets, text)


def test_offline_word_times_follow_the_speech():
    """Two recordings with 2 s of silence before and 6 s between: every word lies in speech,
    and each recording's first word starts where its speech starts."""
    first, second = (audio(librivox_path(c)) for c in ("0870", "0930"))
    lead, gap = torch.zeros(32000), torch.zeros(96000)
    samples = torch.cat([lead, first, gap, second])
    onsets = [2000 + speech_onset_ms(first),
              (32000 + first.numel() + 96000) // 16 + speech_onset_ms(second)]
    gap_ms = ((32000 + first.numel()) // 16 + 300, (32000 + first.numel() + 96000) // 16 - 300)
    words = [w for s in transcribe(bundle(), samples).segments for w in s.words]
    assert len(words) > 15
    assert not [w.text for w in words if w.end_ms > gap_ms[0] and w.start_ms < gap_ms[1]]
    assert abs(words[0].start_ms - onsets[0]) <= 300, (words[0], onsets[0])
    second_first = next(w for w in words if w.start_ms > gap_ms[0])
    assert abs(second_first.start_ms - onsets[1]) <= 300, (second_first, onsets[1])


def test_long_form_prompts_carry_the_earlier_windows_timestamps(monkeypatch):
    """Whisper was trained on prompts of earlier windows with their timestamps; a prompt of
    text alone makes it stop after one sentence and skip the rest of the window."""
    prompts: list[list[int]] = []
    decode = transcribe_module.decode_with_fallback

    def recording(bundle_, features, prompt, seconds, *args, **kwargs):
        prompts.append(list(prompt))
        return decode(bundle_, features, prompt, seconds, *args, **kwargs)

    monkeypatch.setattr(transcribe_module, "decode_with_fallback", recording)
    clips = [audio(librivox_path(c)) for c in ("0870", "0880", "0890", "0920", "0930")] * 2
    result = transcribe(bundle(), torch.cat([torch.cat([c, torch.zeros(8000)]) for c in clips]))
    ts_begin = bundle().tokenizer.timestamp_begin
    later = [p for p in prompts[1:] if p]
    assert len(prompts) >= 2 and later
    assert all(sum(t >= ts_begin for t in p) >= 2 for p in later)
    assert result.text.lower().count("dashwood") >= 2  # the passage of 0870, in both rounds


def test_streaming_prompts_put_each_sentence_between_timestamps():
    from engine.policy import LocalAgreement

    tokenizer = bundle().tokenizer
    ids = {token: i for i, token in enumerate(tokenizer.id_to_token)}
    ts = tokenizer.timestamp_begin
    policy = LocalAgreement()
    texts = [" He", " was", " not.", " A", " young", " man.", " It"]
    times = [(40_000, 40_300), (40_300, 40_500), (40_500, 41_000), (42_000, 42_200),
             (42_200, 42_600), (42_600, 43_000), (75_000, 75_400)]
    policy.flush([Word(t, a, b, [ids["Ġ" + t.strip(" .")]]) for t, (a, b) in zip(texts, times, strict=True)])
    policy.cut_window(80_000)  # every committed word is before the window
    plain = policy.prompt_tokens(200)
    timed = policy.prompt_tokens(200, timestamp_begin=ts)
    assert [t for t in timed if t < ts] == plain
    stamps = [(t - ts) * 20 for t in timed if t >= ts]
    # sentences at 0-1.0 s and 2.0-3.0 s from the first word; past 30 s, from 0 again
    assert stamps == [0, 1000, 2000, 3000, 0, 400]
    assert len(policy.prompt_tokens(5, timestamp_begin=ts)) <= 5


def test_offline_silence_of_a_minute_yields_no_words_and_the_next_sentence_keeps_its_time():
    """Sentences with 60 s and 30 s of digital silence between them. A window holding a
    minute of silence made Whisper say " He was a young man." inside it; windows now
    start a second before speech that follows a long silence, and a segment the VAD heard no
    speech in is dropped."""
    names = ("0880", "0920", "0870")
    clips = [audio(librivox_path(c)) for c in names]
    silences = [torch.zeros(60 * 16000), torch.zeros(30 * 16000)]
    samples = torch.cat([clips[0], silences[0], clips[1], silences[1], clips[2]])
    starts = [0, clips[0].numel() + silences[0].numel(),
              clips[0].numel() + silences[0].numel() + clips[1].numel() + silences[1].numel()]
    onsets = [(start + speech_onset_ms(c) * 16) // 16 for start, c in zip(starts, clips, strict=True)]
    gaps = [((starts[k] + clips[k].numel()) // 16 + 300, starts[k + 1] // 16 - 300) for k in (0, 1)]
    result = transcribe(bundle(), samples)
    words = [w for s in result.segments for w in s.words]
    assert not [w.text for w in words if any(w.end_ms > a and w.start_ms < b for a, b in gaps)]
    for onset, (_, gap_end) in zip(onsets[1:], gaps, strict=True):
        first = next(w for w in words if w.start_ms > gap_end - 1000)
        assert abs(first.start_ms - onset) <= 300, (first, onset)
    errors, n = word_errors(" ".join(transcripts()[librivox_path(c)] for c in names), result.text)
    assert errors / n <= 0.15, result.text
