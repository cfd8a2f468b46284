"""The evaluation corpus (scripts/corpus.py): a quick build's files agree with their manifests,
and the fidelity metrics give the right numbers on hand-made transcripts. No model runs here."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from scripts import corpus
from scripts.corpus import (
    Score,
    TimedWord,
    align,
    alignment,
    longest_drop,
    onset_errors,
    paired_difference,
    score,
    words_in_gaps,
)
from scripts.wer import edit_distance

CONDITIONS = {"level-0", "level-20", "level-30", "level-50", "level-drop", "pink-snr20", "pink-snr10",
              "white-snr20", "white-snr10", "babble-snr12", "reverb", "cheap-mic", "hot-mic", "telephone-8k",
              "stereo-44k", "festival", "festival-pink-snr10", "gaps-silence", "gaps-noise", "gaps-sounds",
              "pauses-short", "run-on", "hesitant", "long-session", "end-abrupt", "previous-set", "real-ivr"}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("corpus")
    index = json.loads(corpus.build(folder, seeds=[0], quick=True).read_text())
    return folder, index


def test_a_corpus_folder_is_read_again_not_rebuilt_over_another_seed(built):
    """A folder keeps the corpus it holds: asked for with its seed, it is read as it is;
    asked for with another, it is an error, not silently rebuilt over (a replay of seed 7
    once ran on seed 0's audio that way)."""
    folder, index = built
    assert corpus.load_index(folder, seeds=[0], quick=True) == index
    with pytest.raises(ValueError, match="seed 0 \\(quick\\)"):
        corpus.load_index(folder, seeds=[7], quick=True)
    assert json.loads((folder / "index.json").read_text()) == index


def test_a_corpus_of_some_conditions_over_several_seeds(built, tmp_path):
    """Some conditions over several seeds: each clip once per seed, named for it, its
    condition kept (a row pools the seeds); a clip built alone is the one built with the rest,
    and a folder does not stand in for conditions it lacks."""
    folder, index = built
    index2 = json.loads(corpus.build(tmp_path, seeds=[0, 5], quick=True, conditions=["hesitant"]).read_text())
    assert [(c["name"], c["condition"], c["seed"]) for c in index2["clips"]] == \
        [("hesitant-s0", "hesitant", 0), ("hesitant-s5", "hesitant", 5)]
    alone, _ = sf.read(str(tmp_path / "hesitant-s0.wav"), dtype="int16")
    whole, _ = sf.read(str(folder / "hesitant.wav"), dtype="int16")
    other, _ = sf.read(str(tmp_path / "hesitant-s5.wav"), dtype="int16")
    assert np.array_equal(alone, whole) and not np.array_equal(alone[: other.size], other[: alone.size])
    assert json.loads((tmp_path / "hesitant-s5.json").read_text())["name"] == "hesitant-s5"
    assert corpus.load_index(tmp_path, seeds=[0, 5], quick=True, conditions=["hesitant"]) == index2
    assert corpus.load_index(tmp_path, seeds=[0, 5], quick=True) == index2  # (what it holds)
    with pytest.raises(ValueError, match="seeds 0, 5 \\(quick\\), without \\['level-0'\\]"):
        corpus.load_index(tmp_path, seeds=[0, 5], quick=True, conditions=["hesitant", "level-0"])
    with pytest.raises(ValueError, match="unknown conditions"):
        corpus.build(tmp_path, seeds=[0], quick=True, conditions=["hesitnat"])


def clips(built) -> list[tuple[dict, np.ndarray, int]]:
    """-> (manifest, audio (n, channels), rate) of every clip."""
    folder, index = built
    out = []
    for entry in index["clips"]:
        manifest = json.loads((folder / entry["manifest"]).read_text())
        audio, rate = sf.read(str(folder / manifest["file"]), dtype="float64", always_2d=True)
        out.append((manifest, audio, rate))
    return out


def by_name(built) -> dict[str, tuple[dict, np.ndarray, int]]:
    return {m["name"]: (m, a, r) for m, a, r in clips(built)}


def level_db(audio: np.ndarray, rate: int, start: float, end: float) -> float:
    piece = audio[int(start * rate) : int(end * rate)]
    return float(10 * np.log10(np.mean(piece**2) + 1e-20))


def test_the_quick_corpus_has_every_condition_and_minutes_of_speech(built):
    _, index = built
    assert {c["condition"] for c in index["clips"]} == CONDITIONS == set(corpus.CONDITIONS)
    speech = sum(c["speech"] for c in index["clips"])
    assert 120 < speech < 600, speech


def test_sentences_and_gaps_tile_each_file_in_order(built):
    for manifest, audio, rate in clips(built):
        assert rate == manifest["sample_rate"] and audio.shape[1] == manifest["channels"]
        assert abs(audio.shape[0] / rate - manifest["duration"]) < 1e-3
        spans = sorted([(s["onset"], s["end"]) for s in manifest["sentences"]]
                       + [(g["start"], g["end"]) for g in manifest["gaps"]])
        assert spans[0][0] == 0 and abs(spans[-1][1] - manifest["duration"]) < 1e-3, manifest["name"]
        for (a0, a1), (b0, _) in zip(spans, spans[1:], strict=False):
            assert a0 < a1 and abs(a1 - b0) < 1e-3, (manifest["name"], a1, b0)  # no overlap, no hole
        onsets = [s["onset"] for s in manifest["sentences"]]
        assert onsets == sorted(onsets) and all(s["text"] for s in manifest["sentences"])


def test_gaps_hold_silence_or_the_declared_noise_and_sentences_hold_speech(built):
    for manifest, audio, rate in clips(built):
        mono = audio[:, 0]
        noise = [g for g in manifest["gaps"] if g["kind"] == "noise" and g["end"] - g["start"] > 0.3]
        for g in manifest["gaps"]:
            if g["kind"] == "silence" and g["end"] - g["start"] > 0.1:
                assert level_db(mono, rate, g["start"] + 0.05, g["end"] - 0.05) < -80, (manifest["name"], g)
            if g["kind"] == "reverb" and g["end"] - g["start"] > 0.5:  # the tail, then its decay
                assert level_db(mono, rate, g["start"], g["start"] + 0.05) > manifest["speech_dbfs"] - 30
                assert level_db(mono, rate, g["end"] - 0.05, g["end"]) < manifest["speech_dbfs"] - 30
            if g["kind"] == "offset":  # the offset, louder than the speech; a click or none
                pause = mono[int(g["start"] * rate) : int(g["end"] * rate)]
                assert abs(20 * np.log10(np.median(pause)) - g["noise_dbfs"]) < 0.5
                assert g["noise_dbfs"] > manifest["speech_dbfs"] + 10
        if manifest["condition"] == "cheap-mic":
            clicks = [g for g in manifest["gaps"]
                      if np.abs(mono[int(g["start"] * rate) : int(g["end"] * rate)]).max() > 0.5]
            assert clicks[0] == manifest["gaps"][0] and len(clicks) == manifest["noise"]["clicks"] > 1
        if noise:  # pooled over the gaps: short stretches of pink noise vary
            pooled = np.concatenate([mono[int((g["start"] + 0.05) * rate) : int((g["end"] - 0.05) * rate)]
                                     for g in noise])
            assert abs(10 * np.log10(np.mean(pooled**2)) - noise[0]["noise_dbfs"]) < 1.5, manifest["name"]
        drop = manifest.get("drop") or {"at": np.inf, "db": 0.0}
        for s in manifest["sentences"]:
            speech = manifest["speech_dbfs"] + (drop["db"] if s["onset"] > drop["at"] else 0.0)
            assert level_db(mono, rate, s["onset"], s["end"]) > speech - 8, (manifest["name"], s)
            assert level_db(mono, rate, s["onset"], s["onset"] + 0.1) > speech - 25, (manifest["name"], s)


def test_levels_noise_rates_and_channels_are_as_the_condition_says(built):
    clip = by_name(built)

    def speech_db(name: str, channel: int = 0) -> float:
        m, a, r = clip[name]
        return float(10 * np.log10(np.mean(np.concatenate(
            [a[int(s["onset"] * r) : int(s["end"] * r), channel] for s in m["sentences"]]) ** 2)))

    assert abs(speech_db("level-0") - corpus.SPEECH_DBFS) < 2
    for name, db in (("level-20", -20), ("level-30", -30), ("level-50", -50)):
        assert clip[name][0]["gain_db"] == db and abs(speech_db(name) - speech_db("level-0") - db) < 0.1
    m, a, r = clip["level-drop"]  # as level-0 up to a pause, 40 dB down after it
    cut = round(m["drop"]["at"] * r)
    first = m["sentences"][m["drop"]["first_sentence"]]
    assert m["sentences"][m["drop"]["first_sentence"] - 1]["end"] < m["drop"]["at"] < first["onset"]
    np.testing.assert_array_equal(a[:cut], clip["level-0"][1][:cut])
    step = 2**-15  # the WAV's 16-bit step
    np.testing.assert_allclose(a[cut:], clip["level-0"][1][cut:] * 10 ** (-40 / 20), atol=step)
    m, a, r = clip["hot-mic"]  # 20 dB up, clipped: a few dB short of it
    assert m["gain_db"] == 20 and 0.02 < m["clipped"] < 0.3
    assert abs(np.mean(np.abs(a) > 0.999) - m["clipped"]) < 0.005
    assert 10 < speech_db("hot-mic") - speech_db("level-0") < 20
    noisy = (("pink-snr20", 20), ("pink-snr10", 10), ("white-snr10", 10), ("festival-pink-snr10", 10))
    for name, snr in noisy:
        assert clip[name][0]["noise"]["snr_db"] == snr
        assert clip[name][0]["noise"]["dbfs"] == clip[name][0]["speech_dbfs"] - snr
    assert clip["gaps-noise"][0]["noise"]["dbfs"] == -60
    m, a, r = clip["telephone-8k"]
    assert (r, a.shape[1]) == (8000, 1)
    spectrum = np.abs(np.fft.rfft(a[:, 0])) ** 2
    f = np.fft.rfftfreq(a.shape[0], 1 / r)
    assert spectrum[(f < 150) | (f > 3800)].sum() < 1e-3 * spectrum.sum()
    m, a, r = clip["stereo-44k"]
    assert (r, a.shape[1]) == (44100, 2)
    assert abs(speech_db("stereo-44k", 1) - speech_db("stereo-44k", 0) + 2) < 0.1
    assert abs(speech_db("stereo-44k") - speech_db("level-0")) < 0.2
    others = [(r, a.shape[1]) for m, a, r in clips(built)
              if m["condition"] not in ("telephone-8k", "stereo-44k")]
    assert set(others) == {(16000, 1)}


def test_long_gaps_abrupt_ends_and_the_long_session(built):
    clip = by_name(built)
    for name, kind in (("gaps-silence", "silence"), ("gaps-noise", "noise")):
        long = [g["end"] - g["start"] for g in clip[name][0]["gaps"] if g["end"] - g["start"] >= 5]
        assert len(long) >= 2 and max(long) <= 60
        assert {g["kind"] for g in clip[name][0]["gaps"]} == {kind}
    manifest, audio, rate = next((m, a, r) for m, a, r in clips(built) if m["name"] == "gaps-sounds")
    sounded = [g for g in manifest["gaps"] if g["kind"] == "sound"]
    assert len(sounded) >= 2 and len({g["sound"] for g in sounded}) == len(sounded)
    for g in manifest["gaps"]:  # a sound at its level, stopping short of the speech; else silence
        a, b = round(g["start"] * rate), round(g["end"] * rate)
        edge = round(corpus.SOUND_EDGE_S * rate)
        if g["kind"] == "sound":
            level = 10 * np.log10(np.mean(audio[a + edge : b - edge, 0].astype(np.float64) ** 2))
            assert abs(level - g["noise_dbfs"]) < 0.5 and not audio[a : a + edge].any(), g
        else:
            assert g["end"] - g["start"] < 5 and not audio[a:b].any()
    ends = [m for m, _, _ in clips(built) if m["condition"] == "end-abrupt"]
    assert ends and all(m["duration"] - m["sentences"][-1]["end"] <= 0.05 for m in ends)
    long = clip["long-session"][0]
    pauses = [b["onset"] - a["end"] for a, b in zip(long["sentences"], long["sentences"][1:], strict=False)]
    assert all(abs(p - 1.5) < 1e-3 for p in pauses)
    assert len({s["speaker"] for s in long["sentences"]}) >= 3


def test_close_pauses_are_as_short_as_their_condition_says(built):
    clip = by_name(built)
    for name, low, high in (("pauses-short", 0.12, 0.35), ("run-on", 0.03, 0.08)):
        sentences = clip[name][0]["sentences"]
        pauses = [b["onset"] - a["end"] for a, b in zip(sentences, sentences[1:], strict=False)]
        assert len(pauses) >= 2 and all(low - 1e-3 <= p <= high + 1e-3 for p in pauses), (name, pauses)


def test_hesitant_sentences_stop_inside_as_long_as_between(built):
    manifest, audio, rate = by_name(built)["hesitant"]
    sentences = manifest["sentences"]
    assert len({s["speaker"] for s in sentences}) == 1  # one passage in the quick corpus
    for s in sentences:
        inside = corpus.frame_db(audio[round(s["onset"] * rate) : round(s["end"] * rate)])
        quiet = np.convolve(inside < -70, np.ones(30), mode="valid") == 30  # 0.3 s with no speech
        assert quiet.any(), s["text"]
    pauses = [b["onset"] - a["end"] for a, b in zip(sentences, sentences[1:], strict=False)]
    assert all(0.6 - 1e-3 <= p <= 1.2 + 1e-3 for p in pauses)


def test_festival_reads_the_programs_sentences_in_its_own_voices(built):
    clip = by_name(built)
    program = [s["text"] for s in clip["level-0"][0]["sentences"]
               if not s["speaker"].startswith("recording:")]
    for name in ("festival", "festival-pink-snr10"):
        sentences = clip[name][0]["sentences"]
        assert [s["text"] for s in sentences] == program
        assert all(s["speaker"].split(":")[0] == "festival" for s in sentences)
        assert all(s["end"] - s["onset"] > 0.2 * len(s["text"].split()) for s in sentences)  # spoken, not cut
    assert abs(clip["festival"][0]["speech_dbfs"] - corpus.SPEECH_DBFS) < 1e-6


def test_the_build_is_deterministic(built):
    folder, _ = built
    again = corpus.gap_clip("gaps-silence", 0, True, 6, [5.0, 8.0])
    saved = json.loads((folder / "gaps-silence.json").read_text())
    assert corpus.manifest(again, "gaps-silence.wav") == saved
    audio, _ = sf.read(str(folder / "gaps-silence.wav"), dtype="float32")
    assert np.abs(audio - again.audio).max() < 1 / 32767


# ---------------------------------------------------------------------------------------------
# The metrics on hand-made transcripts


def timed(words: str, start: float, step: float = 0.5, sentence: int = -1) -> list[TimedWord]:
    return [TimedWord(w, start + i * step, start + (i + 1) * step, sentence)
            for i, w in enumerate(words.split())]


def test_align_matches_equal_words_and_counts_edits():
    distance, matches = align("a b c d".split(), "a x c".split())
    assert distance == 2 and matches == [0, None, 2, None]
    distance, matches = align("a b c".split(), "z a b y c".split())
    assert distance == 2 and matches == [1, 2, 4]
    assert align([], ["a"]) == (1, []) and align(["a"], []) == (1, [None])
    rng = random.Random(0)
    for _ in range(200):  # the distance is the plain edit distance
        ref = [rng.choice("abcd") for _ in range(rng.randrange(0, 12))]
        hyp = [rng.choice("abcd") for _ in range(rng.randrange(0, 12))]
        distance, matches = align(ref, hyp)
        assert distance == edit_distance(ref, hyp)
        found = [m for m in matches if m is not None]
        assert found == sorted(set(found))
        assert all(ref[i] == hyp[m] for i, m in enumerate(matches) if m is not None)
        _, _, _, charged = alignment(ref, hyp)
        assert len(charged) == len(ref) and sum(charged) == (distance if ref else 0)


def test_alignment_charges_each_error_to_a_reference_word():
    # 'z' inserted before the first word goes to it, 'y' inserted after 'b' to 'b'
    assert alignment("a b c".split(), "z a b y c".split())[3] == [1, 1, 0]
    assert alignment("a b c d".split(), "a x d".split())[3] == [0, 1, 1, 0]  # b misheard, c deleted
    assert alignment("a b".split(), [])[3] == [1, 1]
    assert alignment("a b".split(), "a b c d".split())[3] == [0, 2]


def test_longest_drop_is_the_longest_run_of_missing_words_in_speech_seconds():
    ref = timed("one two three four five six", 0.0) + timed("seven eight nine", 20.0, sentence=1)
    words = [w.word for w in ref]
    hyp = "one three seven".split()  # 'two' (0.5 s); then 'four five six' + 'eight nine' (2.5 s)
    _, matches, deleted, _ = alignment(words, hyp)
    assert longest_drop(ref, deleted) == (1.5, 3)  # four five six: 1.5 s; eight nine: 1.0 s
    _, _, deleted, _ = alignment(words, "one two three four five eight nine".split())
    assert longest_drop(ref, deleted) == (1.0, 2)  # six seven: the 17 s pause between not counted
    _, _, deleted, _ = alignment(words, words)
    assert longest_drop(ref, deleted) == (0.0, 0)
    # misheard words are not missing: a run of substitutions is no drop, but is not found
    _, matches, deleted, _ = alignment(words, "one two tree for fife sex seven eight nine".split())
    assert longest_drop(ref, deleted) == (0.0, 0)
    assert longest_drop(ref, [m is None for m in matches]) == (2.0, 4)
    _, matches, deleted, _ = alignment(words, "one two xx seven eight nine".split())
    assert longest_drop(ref, deleted) == (1.5, 3)  # one of the four words heard as 'xx'


def test_words_in_gaps_count_only_words_inside_long_gaps_less_the_edges():
    gaps = [{"start": 10.0, "end": 20.0}, {"start": 3.0, "end": 4.0}]
    words = [TimedWord("in", 12.0, 12.5), TimedWord("edge", 9.9, 10.3), TimedWord("near", 10.25, 10.6),
             TimedWord("late", 19.7, 19.85), TimedWord("short", 3.2, 3.5), TimedWord("out", 25, 26)]
    assert words_in_gaps(words, gaps) == [0, 2]  # 'in' and 'near'


def test_onset_errors_time_each_found_first_word():
    ref = timed("hello there", 1.0, sentence=0) + timed("second one", 5.0, sentence=1) \
        + timed("third time", 9.0, sentence=2)
    hyp = timed("hello there", 1.3) + timed("one", 5.5) + timed("third time", 8.8)
    _, matches = align([w.word for w in ref], [w.word for w in hyp])
    assert onset_errors(ref, matches, hyp) == [0.3, 0.2]  # 'second' missing: no onset


def test_score_on_a_hand_made_manifest():
    manifest = {"sentences": [{"text": "The cat sat on the mat.", "onset": 1.0, "end": 2.8},
                              {"text": "Mr. Smith went to 10 shops today.", "onset": 12.0, "end": 14.0}],
                "gaps": [{"start": 0.0, "end": 1.0}, {"start": 2.8, "end": 12.0},
                         {"start": 14.0, "end": 15.0}]}
    words = [(1.1, 1.3, "The"), (1.3, 1.6, "cat"), (1.6, 1.9, "sat"), (1.9, 2.1, "on"), (2.1, 2.3, "the"),
             (2.3, 2.8, "mat."), (6.0, 6.5, "Thank"), (6.5, 7.0, "you."),
             (13.0, 13.4, "to"), (13.4, 13.8, "ten"), (13.8, 14.0, "shops")]
    result = score(manifest, words)
    assert (result.errors, result.words) == (4, 13)  # thank you for mister smith; went, today deleted
    assert result.gap_words == 2 and result.gap_inserted == 2
    assert result.onset_errors == [0.1]  # the second sentence's first word is missing
    assert result.sentence_errors == [0, 4] and result.sentence_words == [6, 7]
    assert (result.start_errors, result.start_words) == (2, 4)  # 'mister smith' heard as 'thank you'
    # 'mister smith went' not found (15 of 30 characters of 2 s), of which one word is
    # missing (two are heard as 'thank you'): 'mister', the longest lone word missing
    assert result.unmatched_s == pytest.approx(1.0)
    assert (result.drop_s, result.drop_words) == (pytest.approx(2 * 6 / 30, abs=1e-3), 1)
    words[5] = (8.0, 8.5, "mat.")  # a found word placed in the gap: in it, but not inserted
    result = score(manifest, words)
    assert (result.errors, result.gap_words, result.gap_inserted) == (4, 3, 2)


def sentences_scored(errors: list[int], words: int = 10) -> Score:
    return Score(sum(errors), words * len(errors), 0.0, 0, 0.0, 0, 0, [], errors, [words] * len(errors))


def test_paired_difference_is_the_wer_difference_with_a_bootstrap_interval():
    rng = random.Random(1)
    same = [sentences_scored([rng.randrange(4) for _ in range(30)]) for _ in range(2)]
    assert paired_difference(same, same) == (0.0, 0.0, 0.0)  # the same decodes: no spread
    # b: one more error than a in every sentence, 600 words: a is 10 points better, surely
    a = [sentences_scored([1] * 30), sentences_scored([0] * 30)]
    b = [sentences_scored([2] * 30), sentences_scored([1] * 30)]
    diff, low, high = paired_difference(a, b)
    assert diff == pytest.approx(-0.1) and low == pytest.approx(-0.1) and high == pytest.approx(-0.1)
    # the same total difference from a few sentences is a far wider interval around it
    c = [sentences_scored([0] * 27 + [20, 20, 20]), sentences_scored([0] * 30)]
    d = [sentences_scored([0] * 30), sentences_scored([0] * 30)]
    diff, low, high = paired_difference(c, d)
    assert diff == pytest.approx(0.1) and low < 0.05 and high > 0.15


def test_runs_saved_apart_are_scored_as_one_table_and_a_system_twice_is_refused(tmp_path):
    """evaluate.py --rescore: a replay and an offline run of one corpus, made apart, are
    scored together; a system in two runs is refused unless one run is narrowed."""
    from scripts.evaluate import Clip, Result, rescore, words_table

    manifest = {"duration": 4.0, "sentences": [{"text": "the cat sat", "onset": 0.5, "end": 1.5}],
                "gaps": []}

    def run(path: Path, **systems: list) -> str:
        path.write_text(json.dumps([{"clip": "c", "words": systems, "seconds": dict.fromkeys(systems, 1.0),
                                     "latencies": [], "first_partial_s": None}]))
        return str(path)

    def unscored() -> list[Result]:
        return [Result(Clip("c", "level-0", tmp_path / "c.wav", manifest))]

    said = [[0.5, 0.8, "the"], [0.8, 1.1, "cat"], [1.1, 1.5, "sat"]]
    replay = run(tmp_path / "replay.json", replay=said[:2])
    both = run(tmp_path / "old.json", replay=said, offline=said)
    with pytest.raises(ValueError, match="replay"):
        rescore([replay, both], unscored())
    results = unscored()
    assert rescore([replay, f"{both}:offline"], results) == ["replay", "offline"]
    assert results[0].scores["replay"].errors == 1 and results[0].scores["offline"].errors == 0
    table = words_table(results, ["replay", "offline"])
    assert "replay - offline, points" in table and "| 33.3% | 0.0% | +33.3" in table
    with pytest.raises(ValueError, match="no stream"):
        rescore([f"{both}:stream"], unscored())
    other = tmp_path / "other.json"
    other.write_text(Path(replay).read_text().replace('"clip": "c"', '"clip": "c-s7"'))
    with pytest.raises(ValueError, match="none of its clips"):
        rescore([str(other)], unscored())


def test_a_sentence_is_final_when_the_last_of_its_words_comes():
    """evaluate.py's sentence latency: from when the audio to a sentence's end was sent to
    when the last of its words came in a final, a word held for a later final included."""
    from scripts.evaluate import sentence_latencies
    sentences = [{"onset": 0.0, "end": 2.0}, {"onset": 3.0, "end": 5.0}, {"onset": 6.0, "end": 7.0}]
    words = [(0.2, 0.6, "We"), (1.5, 1.9, "started."), (3.2, 3.6, "Before"), (4.5, 4.9, "dawn.")]
    arrived = [10.0, 12.0, 12.0, 13.5]  # "started." held, and committed with "Before"
    sent_ms = [1000, 2000, 3000, 4000, 5000, 6000, 7000]
    sent_at = [8.0 + i for i in range(len(sent_ms))]  # 2000 ms sent at 9.0, 5000 ms at 12.0
    # (no word was read in the third)
    assert sentence_latencies(sentences, words, arrived, sent_ms, sent_at) == [3.0, 1.5]
