"""Endpoints: a talker's pauses, under other voices too (audio/pauses.py), without a model."""

import random
from functools import lru_cache

import numpy as np
import pytest

from audio.frames import ITEM_SAMPLES
from audio.pauses import DIP_DB, DIP_PAUSE_MS, LONG_TALK_MS, PauseTracker
from audio.vad import TurnSettings, detect
from engine.config import EngineConfig
from engine.stream import Stream, hash_key
from engine.timeline import positions_to_ms
from scripts import corpus
from tests.helpers import ARCTIC_IDS, librivox_path, stream_turns, transcripts

ITEM_MS = 80


def endpoints_ms(samples: np.ndarray) -> tuple[list[int], list[int]]:
    """A live stream's endpoints over (n,) 16 kHz samples sent in 100 ms pieces (VAD only),
    and those of one that counts the VAD's pauses only (as before audio/pauses.py)."""
    streams = [Stream("s", EngineConfig(), hash_key("model", ITEM_SAMPLES), 0) for _ in range(2)]
    streams[1].pauses.dips = False  # type: ignore[union-attr]
    streams[1].vad = streams[0].vad  # one VAD pass for both
    for at in range(0, samples.size, 1600):
        probs = None
        for stream in streams:
            stream.add_audio(samples[at : at + 1600])
            unheard = stream.take_unheard()
            probs = detect([stream.vad], [unheard])[0] if probs is None else probs
            stream.hear(probs)
    ms = [[positions_to_ms(p) for p in stream.request.endpoints] for stream in streams]
    return ms[0], ms[1]


@lru_cache(maxsize=1)
def talker() -> corpus.Clip:
    """Ten sentences, 0.8 s apart: the LibriVox recordings (a real voice, with its own pauses
    inside sentences) and five read by a TTS voice."""
    pieces = [corpus.recording_piece(librivox_path(c), transcripts()[librivox_path(c)]) for c in ARCTIC_IDS]
    voice = corpus.Voice("espeak", "en-us+m3", 160, 50)
    pieces += [corpus.tts_piece(text, voice) for text in corpus.PASSAGES[0]]
    order = random.Random(5).sample(pieces, len(pieces))
    return corpus.layout("talker", "talker", order, [0.8] * (len(order) - 1))


@pytest.mark.parametrize("snr_db", [12, 16])
def test_under_other_voices_an_utterance_ends_in_the_talkers_pause(snr_db):
    """Under other people talking (three TTS voices, 12 or 16 dB under the talker) the VAD
    hears speech in most pauses, and no utterance ended there: finals waited for agreement,
    6-12 s after the words. Once the talker has spoken LONG_TALK_MS without a pause the VAD
    hears, a pause 8 dB under its level ends an utterance: one in every pause from then on,
    and at most one inside a sentence (a real voice's own pause at a comma)."""
    clip = talker()
    sentences = clip.sentences
    pauses = [(a["end"] * 1000, b["onset"] * 1000) for a, b in zip(sentences, sentences[1:], strict=False)]

    def ended(found: list[int], start: float, end: float) -> bool:
        return any(start + ITEM_MS <= ms <= end + ITEM_MS for ms in found)

    found, vad_only = endpoints_ms(corpus.with_babble(clip, "babble", snr_db, seed=3).audio)
    assert sum(ended(vad_only, *p) for p in pauses) <= len(pauses) // 2  # the VAD hears few
    later = [(start, end) for start, end in pauses if start >= LONG_TALK_MS + 1000]
    assert len(later) >= 6 and sum(ended(found, *p) for p in later) >= len(later) - 1, (found, later)
    inside = [ms for ms in found if any(s["onset"] * 1000 + ITEM_MS < ms < s["end"] * 1000
                                        for s in sentences)]
    assert len(inside) <= 1, (inside, found)
    # alone, the talker's pauses are the VAD's, one in each
    found, vad_only = endpoints_ms(clip.audio)
    assert found == vad_only and all(ended(found, *p) for p in pauses)


def test_a_pause_under_other_voices_ends_an_utterance_only_after_long_talk_and_at_length():
    """Levels in dBFS, every item heard as speech by the VAD: a talker at -20, other voices
    at -32 between its sentences."""
    tracker = PauseTracker(ITEM_MS, endpoint_items=3)
    talk, quiet = -20.0, -20.0 - DIP_DB - 4

    def run(levels: list[float], speech: bool = True) -> list[bool]:
        ends = []
        for level in levels:
            tracker.push(speech, level)
            ends.append(tracker.ends_utterance)
        return ends

    first = LONG_TALK_MS // ITEM_MS
    assert not any(run([talk] * (first - 10) + [quiet] * 10))  # before LONG_TALK_MS: talk
    run([talk] * 20)
    short = DIP_PAUSE_MS // ITEM_MS - 1  # a gap between words
    assert not any(run([quiet] * short + [talk]))
    ends = run([quiet] * (short + 1))
    assert ends[-1] and not any(ends[:-1])  # at DIP_PAUSE_MS
    assert not any(run([talk - DIP_DB + 2] * 20))  # a quieter word is no pause
    assert run([talk] * 3, speech=False) == [False, False, True]  # a VAD pause: at 3 items ...
    assert not any(run([quiet] * 20))  # ... and the talk starts over
    # a file's tracker counts the VAD's pauses only
    file = PauseTracker(ITEM_MS, endpoint_items=38, dips=False)
    assert not any(file.push(True, level) for level in [talk] * 200 + [quiet] * 50)


def turns_ms(samples: np.ndarray, dips: bool = True) -> list[tuple[str, int]]:
    """A realtime session's turn events over (n,) 16 kHz samples sent in 100 ms pieces."""
    return stream_turns(samples, silence_ms=500, dips=dips)


def test_under_other_voices_a_realtime_turn_ends_in_the_talkers_pause():
    """`/v1/realtime`'s server_vad (and Deepgram's vad_events) end a turn at a pause of
    silence_duration_ms: under other voices 12 dB down the VAD heard none, and no turn ever
    ended. The turn detector counts the talker's pauses as endpoints do, on 32 ms chunks:
    after LONG_TALK_MS a turn ends in every later pause, and none inside a sentence."""
    clip = talker()
    sentences = clip.sentences
    pauses = [(a["end"] * 1000, b["onset"] * 1000) for a, b in zip(sentences, sentences[1:], strict=False)]
    noisy = corpus.with_babble(clip, "babble", 12, seed=3).audio
    assert [ms for kind, ms in turns_ms(noisy, dips=False) if kind == "speech_stopped"] == []
    stops = [ms for kind, ms in turns_ms(noisy) if kind == "speech_stopped"]
    later = [(start, end) for start, end in pauses if start >= LONG_TALK_MS + 1000]
    # a stop marks where the pause began: up to a few hundred ms before the sentence's end
    # (the tail of its last word is under the talker's level too)
    ended = [any(start - 300 <= ms <= end for ms in stops) for start, end in later]
    assert len(later) >= 6 and sum(ended) >= len(later) - 1, (stops, later)
    inside = [ms for ms in stops if any(s["onset"] * 1000 + 100 < ms < s["end"] * 1000 - 300
                                        for s in sentences)]
    assert inside == [], (inside, stops)
    # alone, the talker's pauses are the VAD's: the same turns as without the dips
    assert turns_ms(clip.audio) == turns_ms(clip.audio, dips=False)


def test_turn_events_are_in_received_audio_across_a_flush_and_start_when_asked():
    """A session's turn events come from its engine stream's one VAD (no VAD of its own), in
    ms of the audio the client sent: a flush (a realtime commit) pads the stream's timeline to
    a whole item, and the turns after it must not move by that padding. Events start with
    the request (Engine.set_turns), from the audio after it."""
    clip = talker()
    samples = clip.audio
    plain = stream_turns(samples)
    assert [kind for kind, _ in plain[:4]] == ["speech_started", "speech_stopped"] * 2
    pause = int(clip.sentences[0]["end"] * 16000) + 4000  # in the first pause ...
    cut = pause - pause % ITEM_SAMPLES + 10  # ... 10 samples into an item: 79 ms of padding
    stream = Stream("s", EngineConfig(), hash_key("model", ITEM_SAMPLES), 0)
    for at in range(0, samples.size, 1600):
        if at == 1600:
            stream.set_turns(TurnSettings())
        piece = samples[at : min(at + 1600, cut) if at < cut else at + 1600]
        stream.add_audio(piece)
        if at < cut <= at + 1600:
            stream.flush()
            stream.add_audio(samples[cut : at + 1600])
        stream.hear(detect([stream.vad], [stream.take_unheard()])[0])
    assert stream.padding.ends  # the flush padded the timeline
    assert stream.padding.totals[-1] == 79
    flushed = [(e.kind, e.ms) for e in stream.turn_events]
    assert [kind for kind, _ in flushed] == [kind for kind, _ in plain]
    # after the flush, within a VAD chunk of the unflushed stream's (the chunks lie 79 ms
    # later on the timeline; a decision near the threshold may flip a chunk or two), not a
    # padding's length later
    later = sorted(abs(a - b) for (_, a), (_, b) in zip(flushed, plain, strict=True) if b > cut / 16)
    assert len(later) >= 10 and later[len(later) // 2] < 32 and later[-1] < 100, (flushed, plain)
