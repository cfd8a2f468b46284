"""The engine on the real model: item features, batching, streaming text, faults."""

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from app.engine_loop import EngineLoop
from app.metrics import Metrics
from audio.frames import (
    FLOOR_STEP,
    ITEM_SAMPLES,
    QUIET_LEVEL,
    STREAM_LOG_FLOOR,
    UTTERANCE_MARGIN,
    AudioFramer,
    item_log_mel,
)
from audio.mel import DYNAMIC_RANGE, log_mel_power, normalize_log_mel
from audio.vad import detect
from engine import model_runner, worker
from engine.commit import GIVEN_MARK_LOGPROB
from engine.config import EngineConfig
from engine.engine import Engine, StepInput
from engine.model.transcribe import transcribe
from engine.model.whisper import ModelDimensions, Whisper
from engine.model_runner import ModelRunner
from engine.speech_map import LEAD_IN_MS
from engine.stem_store import INITIAL_SLOTS, StemStore
from engine.stream import Stream, hash_key
from engine.timeline import positions_to_ms
from scripts.corpus import align, sound
from scripts.evaluate import replay_clip
from scripts.wer import normalize, word_errors
from tests.helpers import (
    ARCTIC_IDS,
    DEVICE,
    LOUD_WORDS,
    after_loud_sound,
    audio,
    bundle,
    concatenated,
    fail_decodes,
    faint_noisy_speech,
    gain_floors_of,
    heard_items,
    librivox_path,
    speech_onset_ms,
    transcripts,
    with_click,
)


def stream(engine: Engine, request_ids: list[str], samples: list[np.ndarray],
           chunk: int = 3200, flush_at: int | None = None) -> dict[str, list]:
    """Feed sessions chunk by chunk (200 ms), step after each, finish, drain -> words.
    `flush_at`: each session is flushed (a client's Finalize) once that sample is in."""
    words: dict[str, list] = {rid: [] for rid in request_ids}
    for rid in request_ids:
        engine.add_request(rid)
    longest = max(len(s) for s in samples)
    for i in range(0, longest, chunk):
        for rid, s in zip(request_ids, samples, strict=True):
            if i < len(s):
                engine.add_audio(rid, s[i : i + chunk])
            if flush_at is not None and i < flush_at <= i + chunk:
                engine.flush(rid)
        for out in engine.step():
            words[out.request_id] += out.committed
    for rid in request_ids:
        engine.finish(rid)
    while any(engine.has_request(rid) for rid in request_ids):
        for out in engine.step():
            words[out.request_id] += out.committed
    return words


def test_item_stem_equals_whole_window_stem():
    model = bundle().model
    samples = audio(librivox_path("0880"))
    framer = AudioFramer()
    contexts = framer.push(samples.numpy()) + framer.flush()
    items = torch.from_numpy(np.stack(contexts))
    engine = Engine(bundle())
    per_item = engine.runner._stem(item_log_mel(items)).reshape(-1, 384)  # (n_items * 4, d)
    # the same audio computed as one window with the same clamp floor
    padded = torch.nn.functional.pad(samples, (0, len(contexts) * 1280 - len(samples)))
    mel = normalize_log_mel(log_mel_power(padded), STREAM_LOG_FLOOR)
    with torch.inference_mode():
        whole = model.encoder.stem(mel[None].to(model.device, model.dtype))[0]
    assert whole.shape == per_item.shape
    # at the two ends the whole-window STFT reflects and the conv pads with zeros, where
    # items see silence; everywhere between, per-item computation is the same (to float16's
    # rounding on CUDA)
    tolerance = 1e-4 if model.dtype == torch.float32 else 1e-2
    assert (whole[4:-4] - per_item[4:-4]).abs().max().item() < tolerance


@pytest.mark.parametrize("db", [0, -50])
def test_window_padding_is_whisper_padding_at_any_level(db):
    """Whisper pads a window with digital silence, whose log power its clamp raises to the
    floor. Under speech quiet enough for the floor to lie below silence's log power, the
    padding stays silence: the runner's padding is that, not the floor (2 dB of log-mel
    apart at -50 dB)."""
    model = bundle().model
    samples = audio(librivox_path("0880")) * 10 ** (db / 20)
    log_spec = log_mel_power(torch.nn.functional.pad(samples, (0, 16000 * 5)))
    floor = float(log_spec.max()) - DYNAMIC_RANGE
    with torch.inference_mode():
        whole = model.encoder.stem(normalize_log_mel(log_spec, floor)[None].to(model.device, model.dtype))[0]
    pad = Engine(bundle()).runner.pad(floor)
    tolerance = 1e-4 if model.dtype == torch.float32 else 1e-2
    assert (whole[-100:-10] - pad).abs().max().item() < tolerance  # (the end: the conv's zeros)


@pytest.mark.parametrize(("db", "sound"), [(-40, "tone"), (-30, "speech")])
def test_a_quiet_voice_after_a_loud_sound_keeps_its_own_log_mel_floor(db, sound):
    """Counted from the loudest sound of the session (offline, of the file), the log-mel floor
    lay over a voice 30 dB under a loud one before it, or 40 dB under a loud beep: most of its
    range clamped away. An utterance more than 10 dB under the session's loudest counts from
    its own loudest level (plus those 10 dB), as it would alone: it is brought up by at least
    the gain it would have alone less those 10 dB, and its floor is then counted as for speech
    at a normal level. Streaming (the audio in uneven pieces, each item made once the VAD has
    heard it) and offline (`item_gain_floors`) give every item the same gain and floor."""
    quiet = (audio(librivox_path("0870")).numpy() * 10 ** (db / 20)).astype(np.float32)
    samples = after_loud_sound(quiet, sound)
    lead = samples.size - quiet.size
    alone = np.concatenate([np.zeros(lead, np.float32), quiet])

    (gains, floors), (gains_alone, _) = gain_floors_of(samples), gain_floors_of(alone)
    # its items from two seconds in (the VAD has heard it by then, and the gain has risen)
    voice = slice((lead + speech_onset_ms(quiet) * 16 + 32000) // ITEM_SAMPLES, None)
    assert floors[: lead // ITEM_SAMPLES].max() >= STREAM_LOG_FLOOR - 0.5
    assert gains[voice].min() >= 0.5 and np.all(gains[voice] >= gains_alone[voice] - UTTERANCE_MARGIN)
    assert np.all(floors[voice] >= QUIET_LEVEL - DYNAMIC_RANGE - UTTERANCE_MARGIN - FLOOR_STEP)

    stream = Stream("s", EngineConfig(), hash_key("model", ITEM_SAMPLES), 0)
    rng, at = np.random.default_rng(0), 0
    while at < samples.size:
        size = int(rng.integers(100, 6000))
        stream.add_audio(samples[at : at + size])
        at += size
        stream.hear(detect([stream.vad], [stream.take_unheard()])[0])
    stream.finish()
    stream.hear(detect([stream.vad], [stream.take_unheard()])[0])
    assert [f.data[1] for f in stream.request.mm_features] == floors.tolist()
    contexts, _ = heard_items(samples)
    for feature, context in zip(stream.request.mm_features, contexts, strict=False):
        np.testing.assert_allclose(feature.data[0], context, rtol=1e-6)


def test_streaming_matches_offline_transcription():
    samples, reference = concatenated([librivox_path(c) for c in ARCTIC_IDS], gap_seconds=0.7)
    words = stream(Engine(bundle()), ["s"], [samples.numpy()])["s"]
    streamed = "".join(w.text for w in words)
    offline = transcribe(bundle(), samples).text
    stream_errors, n = word_errors(reference, streamed)
    offline_errors, _ = word_errors(reference, offline)
    assert (stream_errors - offline_errors) / n <= 0.05, (streamed, offline)
    assert "dashwood" in normalize(streamed)
    # timestamps: absolute, monotonic, inside the audio
    duration_ms = len(samples) * 1000 // 16000
    previous = 0
    for w in words:
        assert previous <= w.start_ms <= w.end_ms <= duration_ms
        previous = w.end_ms


def test_two_sessions_batch_the_encoder_and_keep_their_own_text():
    engine = Engine(bundle(), EngineConfig(decode_interval_ms=1000))
    a = audio(librivox_path("0930")).numpy()
    b = audio(librivox_path("0880")).numpy()
    for rid in ("a", "b"):
        engine.add_request(rid)
    engine.add_audio("a", a[:32000])
    engine.add_audio("b", b[:32000])
    engine.step()
    stats = engine.last_stats
    assert stats.num_windows == 2 and stats.num_encoder_calls == 1
    assert stats.num_encoded_items == 2 * 24  # 2 s each, minus the look-ahead item
    words = stream(Engine(bundle()), ["a", "b"], [a, b])
    text_a = normalize("".join(w.text for w in words["a"]))
    text_b = normalize("".join(w.text for w in words["b"]))
    assert "amiable" in text_a and "young" not in text_a
    assert "young" in text_b and "amiable" not in text_b


def test_identical_audio_is_encoded_once_across_sessions():
    engine = Engine(bundle())
    x = audio(librivox_path("0930")).numpy()[:32000]
    engine.add_request("a")
    engine.add_request("b")
    engine.add_audio("a", x)
    engine.add_audio("b", x)
    engine.step()
    assert engine.last_stats.num_windows == 2
    assert engine.last_stats.num_encoded_items == 24  # deduplicated by content hash


def test_failure_in_one_session_ends_it_and_others_continue(monkeypatch):
    engine = Engine(bundle())
    fail_decodes(monkeypatch, engine.runner, {"bad"})
    x = audio(librivox_path("0930")).numpy()
    for rid in ("bad", "good"):
        engine.add_request(rid)
        engine.add_audio(rid, x)
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["bad"].finished and "injected" in outputs["bad"].error
    assert not engine.has_request("bad")
    assert "bad" not in engine.scheduler.encoder_cache.request_cached_ids
    assert outputs["good"].error is None
    words = []
    engine.finish("good")
    while engine.has_request("good"):
        for o in engine.step():
            words += o.committed
    assert "amiable" in normalize("".join(w.text for w in words))


def test_abort_releases_everything_and_silence_dedupes():
    engine = Engine(bundle())
    engine.add_request("r")
    engine.add_audio("r", np.zeros(16000 * 3, dtype=np.float32))
    assert engine.step() == [] and not engine.has_work()  # silence alone is never decoded
    engine.abort("r")
    engine = Engine(bundle(), EngineConfig(decode_only_speech=False))
    engine.add_request("r")
    engine.add_audio("r", np.zeros(16000 * 3, dtype=np.float32))
    engine.step()
    assert engine.last_stats.num_windows == 1
    cache = engine.scheduler.encoder_cache
    assert len(cache.get_cached_input_ids("r")) <= 3  # silence items share a hash
    engine.abort("r")
    assert cache.request_cached_ids == {} and cache.num_referenced == 0
    assert engine.num_requests == 0


def test_processor_cache_inject_skips_processing_and_counts_hits():
    engine = Engine(bundle())
    x = audio(librivox_path("0880")).numpy()[:16000]
    engine.add_request("r")
    engine.add_audio("r", x)
    engine.hear()
    request = engine.streams["r"].request
    # features computed "outside" (as a client sending log-mel would): same values
    contexts = torch.from_numpy(np.stack([f.data[0] for f in request.mm_features]))
    floors = torch.tensor([f.data[1] for f in request.mm_features])
    hashes = [f.identifier for f in request.mm_features]
    engine.inject(hashes, list(item_log_mel(contexts, 80, floors)))
    for f in request.mm_features:
        f.data = None  # the runner must not need the PCM any more
    engine.flush("r")
    engine.step()
    queries, hits = engine.processor_counts
    assert queries == len(request.mm_features)
    assert hits == len(hashes)  # all but the flushed tail came from inject
    assert engine.last_stats.num_encoded_items == len(request.mm_features)


def test_processor_cache_is_bytes_bounded_lru():
    from engine.processor_cache import ProcessorCache

    cache = ProcessorCache(max_bytes=3 * 400)
    for i in range(5):
        cache.put(str(i), np.zeros(100, dtype=np.float32))  # 400 bytes each
    assert list(cache.entries) == ["2", "3", "4"] and cache.num_bytes == 1200
    assert cache.get("2") is not None and cache.get("0") is None
    cache.put("5", np.zeros(100, dtype=np.float32))
    assert list(cache.entries) == ["4", "2", "5"]
    assert (cache.num_queries, cache.num_hits) == (2, 1)


def test_async_scheduling_overlaps_the_next_schedule_with_execution():
    """Step N executes in a thread while the caller adds audio, aborts and schedules N+1."""
    engine = Engine(bundle())
    first, second = audio(librivox_path("0930")).numpy(), audio(librivox_path("0890")).numpy()
    for rid in ("a", "gone"):
        engine.add_request(rid)
        engine.add_audio(rid, first)
    step_n = engine.schedule()
    assert sorted(w.request_id for w in step_n.scheduled.windows) == ["a", "gone"]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(engine.execute, step_n)
        engine.add_request("b")
        engine.add_audio("b", second)
        engine.add_audio("a", second[:16000])  # "a" is in flight: not scheduled again yet
        engine.abort("gone")
        step_n1 = engine.schedule()
        output_n = running.result()
    assert [w.request_id for w in step_n1.scheduled.windows] == ["b"]
    results = {o.request_id: o for o in engine.update_from_output(output_n)}
    assert set(results) == {"a"}  # the aborted session's result is dropped
    assert not engine.scheduler.encoder_cache.get_cached_input_ids("gone")
    outputs = engine.update_from_output(engine.execute(step_n1))
    assert [o.request_id for o in outputs] == ["b"]
    assert "unless" in normalize("".join(w.text for w in outputs[0].tentative + outputs[0].committed))
    assert engine.has_work()  # "a" has new audio now that its output is in


def test_shorter_padding_keeps_the_streamed_words():
    samples, reference = concatenated([librivox_path(c) for c in ARCTIC_IDS[:3]], gap_seconds=0.7)
    engine = Engine(bundle(), EngineConfig(pad_seconds=10))
    assert engine.runner.padded_length(120) == 500 and engine.runner.padded_length(501) == 1000
    words = stream(engine, ["s"], [samples.numpy()])["s"]
    errors, n = word_errors(reference, "".join(w.text for w in words))
    assert errors / n <= 0.1
    with pytest.raises(ValueError, match="pad_seconds"):
        Engine(bundle(), EngineConfig(pad_seconds=0))
    with pytest.raises(ValueError, match="preview_pad_seconds"):
        Engine(bundle(), EngineConfig(preview_pad_seconds=31))
    with pytest.raises(ValueError, match="max_partials"):
        Engine(bundle(), EngineConfig(max_partials=0))


def test_a_pause_after_speech_commits_the_utterance_without_finishing():
    samples = np.concatenate([audio(librivox_path("0880")).numpy(), np.zeros(16000, np.float32)])
    offline = transcribe(bundle(), audio(librivox_path("0880"))).text

    speech_samples = len(samples) - 16000
    silence_windows = 0

    def run(endpoint_ms: int | None) -> tuple[list, list]:
        nonlocal silence_windows
        engine = Engine(bundle(), EngineConfig(endpoint_ms=endpoint_ms))
        engine.add_request("s")
        committed, tentative = [], []
        for i in range(0, len(samples), 3200):  # 200 ms chunks, a step after each, no finish
            engine.add_audio("s", samples[i : i + 3200])
            for out in engine.step():
                committed += out.committed
                tentative = out.tentative
            silence_windows += engine.last_stats.num_windows if i >= speech_samples + 3200 else 0
        while engine.has_work():
            for out in engine.step():
                committed += out.committed
                tentative = out.tentative
        return committed, tentative

    committed, tentative = run(400)
    assert silence_windows <= 2  # one final at the pause (and a partial): the silence is not re-decoded
    assert tentative == []  # the pause ended the utterance: all of it is final
    assert normalize("".join(w.text for w in committed)) == normalize(offline)
    assert committed[-1].end_ms <= len(samples) * 1000 // 16000 - 400
    _, tentative = run(None)  # without endpointing the last words wait for more audio
    assert tentative
    with pytest.raises(ValueError, match="endpoint_ms"):
        Engine(bundle(), EngineConfig(endpoint_ms=10))


def speech_then_silence_to_an_endpoint(engine: Engine, items: int) -> Stream:
    """A recording up to its last word into session "s", then silence one item at a time (at
    most `items`) until the VAD has heard an endpoint -> the stream."""
    speech = audio(librivox_path("0870")).numpy()
    engine.add_audio("s", speech[: np.nonzero(np.abs(speech) > 0.05)[0][-1]])
    stream = engine.streams["s"]
    for _ in range(items):
        engine.hear()
        if stream.request.endpoints:
            break
        engine.add_audio("s", np.zeros(engine.config.item_samples, np.float32))
    return stream


@pytest.mark.parametrize(("endpoint_ms", "silent_items"), [(100, 2), (240, 3), (250, 3), (320, 4)])
def test_an_endpoint_comes_after_whole_silent_items(endpoint_ms, silent_items):
    """Silence is counted in 80 ms items against the setting rounded down to 20 ms (docs)."""
    engine = Engine(bundle(), EngineConfig(endpoint_ms=endpoint_ms))
    engine.add_request("s")
    stream = speech_then_silence_to_an_endpoint(engine, 8)
    request = stream.request
    # at the end of the last item the VAD has heard whole (the next waits for its last chunk)
    assert list(request.endpoints) == [request.num_positions]
    assert request.num_positions - request.endpoints[0] <= stream.item_positions
    silence = request.endpoints[0] - request.last_speech_end
    assert silence // stream.item_positions == silent_items


@pytest.mark.parametrize(("asked_ms", "silent_items"), [(None, 3), (100, 3), (600, 8)])
def test_a_session_may_ask_for_a_longer_endpoint_never_a_shorter_one(asked_ms, silent_items):
    """Stream.set_endpoint: 600 ms is 8 whole items; 100 ms is under the server's 250."""
    engine = Engine(bundle(), EngineConfig(endpoint_ms=250))
    engine.add_request("s")
    if asked_ms is not None:
        engine.set_endpoint("s", asked_ms)
    stream = speech_then_silence_to_an_endpoint(engine, 12)
    request = stream.request
    assert (request.endpoints[0] - request.last_speech_end) // stream.item_positions == silent_items


def test_with_a_longer_endpoint_a_pause_inside_the_talk_ends_no_final():
    """Two recordings 1 s apart: the server's endpoint commits the first at the pause; a session
    that asked for 2 s gets no final until the stream ends, then all of it."""
    paths = [librivox_path(c) for c in ("0880", "0930")]
    first, second = (audio(p).numpy() for p in paths)
    samples = np.concatenate([first, np.zeros(16000, np.float32), second])
    reference = " ".join(transcripts()[p] for p in paths)

    def run(asked_ms: int | None) -> tuple[list, list]:
        engine = Engine(bundle(), EngineConfig(endpoint_ms=250))
        engine.add_request("s")
        if asked_ms is not None:
            engine.set_endpoint("s", asked_ms)
        before = []
        for i in range(0, len(samples), 3200):  # 200 ms chunks, a step after each
            engine.add_audio("s", samples[i : i + 3200])
            for out in engine.step():
                before += out.committed
        while engine.has_work():
            for out in engine.step():
                before += out.committed
        engine.finish("s")
        after = []
        while engine.has_work():
            for out in engine.step():
                after += out.committed
        return before, after

    before, _ = run(None)
    assert any(w.end_ms <= first.size / 16 for w in before)  # a final in the pause
    before, after = run(2000)
    assert before == []
    errors, n = word_errors(reference, "".join(w.text for w in after))
    assert errors / n <= 0.15


def test_finals_per_step_default_to_two_on_the_cpu():
    on_cpu = bundle().device.type == "cpu"
    assert Engine(bundle()).scheduler.config.max_finals == (2 if on_cpu else None)
    assert Engine(bundle(), EngineConfig(max_finals=5)).scheduler.config.max_finals == 5
    with pytest.raises(ValueError, match="max_finals"):
        Engine(bundle(), EngineConfig(max_finals=0))


def test_a_partial_that_whispers_fallback_rule_fails_says_so_to_the_commit_rules():
    """Partials are not decoded again at higher temperatures: the rules are told the rule
    failed one (a loop, or a mean log-probability under -1), and agreement does not count it
    (tests/test_commit.py)."""
    from engine.model.decoding import DecodingResult
    from engine.scheduler import ScheduledWindow

    runner = ModelRunner(bundle())
    tokenizer = runner.bundle.tokenizer
    text = [tokenizer.id_to_token.index(t) for t in ("Ġto", "Ġthe", "Ġdigital", "Ġdemonstration", ".")]
    tokens = [tokenizer.timestamp_begin + 65, *text, tokenizer.timestamp_begin + 275]
    window = ScheduledWindow("s", 0, 500, 0, 1, final=False)
    for logprob, stop, failed in ((-2.2, "eot", True), (-0.3, "eot", False), (-0.3, "repetition", True)):
        decoded = DecodingResult(tokens, "", logprob, 0.1, 1.2, stop, token_logprobs=[logprob] * len(tokens))
        result = runner._window_result(window, decoded)
        assert [w.text for w in result.words] == [" to", " the", " digital", " demonstration."]
        assert result.failed is failed


def test_a_window_decoded_again_gets_its_last_tokens_as_the_draft():
    """Partials of a growing window pass the last decode's tokens as a draft (verified, so the
    text is plain greedy's); after the window moves, timestamps no longer line up: no draft."""
    samples = audio(librivox_path("0920")).numpy()
    engine = Engine(bundle(), EngineConfig(endpoint_ms=None))
    engine.add_request("s")
    engine.add_audio("s", samples[:32000])  # 2 s
    first = engine.schedule()
    assert [w.draft for w in first.model_input.windows] == [[]]
    engine.update_from_output(engine.execute(first))
    stream = engine.streams["s"]
    end, tokens = stream.drafts[0]
    assert 90 <= end <= 100  # where the 2 s window ended (the framer keeps back a little)
    assert tokens and list(stream.drafts) == [0]
    engine.add_audio("s", samples[32000:64000])
    second = engine.schedule()
    assert [w.draft for w in second.model_input.windows] == [tokens]
    out = engine.update_from_output(engine.execute(second))[0]
    assert "married" in normalize("".join(w.text for w in out.committed + out.tentative))
    assert stream.drafts[0] != (end, tokens)  # the 4 s decode replaced the draft
    stream._cut(100)  # the window no longer starts where it was decoded
    assert stream.drafts == {}
    engine.add_audio("s", samples[64000:])
    assert [w.draft for w in engine.schedule().model_input.windows] == [[]]


def scheduled_steps(engine: Engine, samples: np.ndarray, chunk: int = 3200) -> Iterator[StepInput]:
    """Feed session "s" 200 ms chunks; after each, the step the engine schedules, if any."""
    for i in range(0, len(samples), chunk):
        engine.add_audio("s", samples[i : i + chunk])
        step = engine.schedule()
        if step is not None:
            yield step


def test_after_a_final_partials_preview_only_the_new_audio_and_commit_nothing(monkeypatch):
    """With endpointing, a partial under agree_after_ms since the last final decodes only
    that audio (10 s padding, all committed words as its prompt): shown, never committed."""
    samples, _ = concatenated([librivox_path("0880"), librivox_path("0920")], gap_seconds=1.0)
    samples = samples.numpy()
    engine = Engine(bundle(), EngineConfig(beam_size=1))  # (a search adds a call per token)
    engine.add_request("s")
    request = engine.streams["s"].request
    finals, previews, calls = [], [], []
    hidden = engine.runner.model.decoder.hidden
    monkeypatch.setattr(engine.runner.model.decoder, "hidden",
                        lambda *a, **k: calls.append(1) or hidden(*a, **k))
    for step in scheduled_steps(engine, samples):
        (window,) = step.scheduled.windows
        calls.clear()
        output = engine.execute(step)
        (out,) = engine.update_from_output(output)
        if window.final:  # (its end, its words, where what comes after it is read from)
            finals.append((window.window_end, out.committed, request.preview_start))
            if len(finals) == 2:  # drafted: the first final's tokens, then the last preview's
                tokens = output.results[0].tokens  # 35, most of them the draft's
                assert len(calls) < len(tokens) // 2
        elif finals and window.preview:
            # from the last final's pause (SpeechMap.after_pause), not after its end
            assert window.window_start == finals[-1][2] <= finals[-1][0]
            (inp,) = step.model_input.windows
            ts_begin = bundle().tokenizer.timestamp_begin
            assert [t for t in inp.prompt if t < ts_begin] == [
                t for w in engine.streams["s"].policy.committed for t in w.tokens]
            assert out.committed == [] and output.results[0].preview
            previews.append(" ".join(normalize("".join(w.text for w in out.tentative))))
    texts = [" ".join(normalize("".join(w.text for w in c))) for _, c, _ in finals]
    assert "young man" in texts[0] and "amiable woman" in texts[1]  # one final per sentence
    # the last final stays in the window as context (over 10 s, from its sentence's start)
    assert request.preview_start == finals[-1][2]
    assert positions_to_ms(request.window_start) <= finals[-1][1][0].start_ms < positions_to_ms(finals[-1][0])
    assert previews and "amiable woman" in previews[-1]  # the second sentence, tentative
    assert engine.runner.padded_length(100, preview=True) == 500  # a 10 s encoder pass
    assert engine.runner.padded_length(100) == 1500


def test_a_windows_prompt_is_the_latest_committed_words_within_prompt_tokens():
    """The prompt holds at most `prompt_tokens` tokens, timestamps included: the committed
    words nearest the window, whole."""
    samples, _ = concatenated([librivox_path("0880"), librivox_path("0920")], gap_seconds=1.0)
    samples = samples.numpy()
    engine = Engine(bundle(), EngineConfig(prompt_tokens=8))
    engine.add_request("s")
    policy = engine.streams["s"].policy
    ts_begin = bundle().tokenizer.timestamp_begin
    prompts, texts = [], []
    for step in scheduled_steps(engine, samples):
        (inp,) = step.model_input.windows
        committed = [t for w in policy.context for t in w.tokens]  # as last read
        text = [t for t in inp.prompt if t < ts_begin]
        assert len(inp.prompt) <= 8 and text == committed[len(committed) - len(text):]
        prompts.append(text)
        (out,) = engine.update_from_output(engine.execute(step))
        if inp.window.final:
            texts.append(" ".join(normalize("".join(w.text for w in out.committed))))
    assert any(prompts) and len(committed) > 8  # the cap cut the prompt
    assert "young man" in texts[0] and "amiable woman" in texts[1]


def test_a_partials_only_step_is_given_up_when_asked_and_a_final_step_is_not():
    """The engine loop asks (stop_partials) when a final falls due during a step of partials:
    the step ends at its next transformer or decoder call, without results."""
    samples = audio(librivox_path("0920")).numpy()
    engine = Engine(bundle(), EngineConfig())
    engine.add_request("s")
    engine.add_audio("s", samples[:48000])  # 3 s of speech, no pause: a partial
    step = engine.schedule()
    (window,) = step.scheduled.windows
    assert not window.final
    engine.stop_partials.set()
    output = engine.execute(step)
    assert [r.cancelled for r in output.results] == [True]
    assert output.num_encoded_items > 0  # the items are encoded all the same
    assert engine.update_from_output(output) == []  # nothing to show
    stream = engine.streams["s"]
    assert stream.drafts == {} and -1 not in stream.request.output_token_ids
    engine.finish("s")
    step = engine.schedule()  # clears the request: a new step runs
    assert not engine.stop_partials.is_set()
    engine.stop_partials.set()  # a final step runs to its end
    (out,) = engine.update_from_output(engine.execute(step))
    assert step.scheduled.windows[0].final and out.finished
    assert "married" in normalize("".join(w.text for w in out.committed))


def test_a_background_files_final_is_given_up_like_a_partial_and_redone():
    """A step of a file's windows is given up for a live final too; the file's final stays
    due and is decoded in a later step."""
    samples = audio(librivox_path("0920")).numpy()
    engine = Engine(bundle(), EngineConfig())
    engine.add_request("file", background=True)
    engine.add_audio("file", samples)
    engine.finish("file")
    step = engine.schedule()
    (window,) = step.scheduled.windows
    assert window.final and window.background
    engine.stop_partials.set()
    output = engine.execute(step)
    assert [r.cancelled for r in output.results] == [True]
    assert engine.update_from_output(output) == []
    step = engine.schedule()  # still due
    assert [w.final for w in step.scheduled.windows] == [True]
    (out,) = engine.update_from_output(engine.execute(step))
    assert out.finished and "married" in normalize("".join(w.text for w in out.committed))
    for rid, background in (("live", False), ("file", True)):  # finals that fall due now
        engine.add_request(rid, background=background)
        engine.add_audio(rid, samples[:16000])
        engine.finish(rid)
    assert engine.final_fell_due(["live"]) and not engine.final_fell_due(["file"])


async def test_the_engine_loop_gives_up_a_partials_step_for_a_final_that_falls_due():
    """Commands are applied while a step runs; a finish (a final due) stops the partials."""
    samples = audio(librivox_path("0920")).numpy()
    engine = Engine(bundle(), EngineConfig())
    loop = EngineLoop(engine, Metrics())
    outputs = []
    loop.open("s", outputs.append)
    loop.add_audio("s", samples[:64000])  # 4 s of speech: a partial
    loop._apply_commands()
    step = engine.schedule()
    assert not step.scheduled.windows[0].final
    loop.finish("s")  # comes in while the step runs
    output = await loop._execute(step)
    assert [r.cancelled for r in output.results] == [True]
    assert engine.streams["s"].request.input_finished  # applied during the step
    engine.update_from_output(output)
    step = engine.schedule()  # the final, right away
    assert step.scheduled.windows[0].final
    (out,) = engine.update_from_output(await loop._execute(step))
    assert out.finished and "married" in normalize("".join(w.text for w in out.committed))


async def test_a_final_that_cannot_be_placed_does_not_give_up_the_partials():
    """A final due when the step was scheduled and left out of it (here: more audio than the
    encoder cache holds) does not stop a step of partials at every command; a final that
    falls due during the step does."""
    samples = audio(librivox_path("0920")).numpy()  # 6 s
    config = EngineConfig(encoder_cache_s=8, endpoint_ms=None)  # 400 positions
    engine = Engine(bundle(), config)  # no endpointing: no pause ends a window early
    loop = EngineLoop(engine, Metrics())
    for rid in ("a", "b"):
        loop.open(rid, lambda _: None)
    loop.add_audio("b", np.concatenate([samples, samples]))  # 12 s: 600 positions, the cache holds 400
    loop.flush("b")  # its final is due, and cannot be placed
    loop.add_audio("a", samples[:48000])  # 3 s of speech: a partial
    loop._apply_commands()
    step = engine.schedule()
    assert [(w.request_id, w.final) for w in step.scheduled.windows] == [("a", False)]
    assert engine.streams["b"].request.due_number == engine.num_due_at_schedule == 1
    assert engine.streams["a"].request.due_number is None
    loop.add_audio("b", samples[:16000])  # b streams on while the step runs
    output = await loop._execute(step)
    assert [r.cancelled for r in output.results] == [False]  # the partial ran to its end
    engine.update_from_output(output)
    loop.add_audio("a", samples[48000:80000])
    loop._apply_commands()
    step = engine.schedule()
    assert [(w.request_id, w.final) for w in step.scheduled.windows] == [("a", False)]
    assert not engine.final_fell_due(["a", "b"])
    loop.finish("a")  # a's final falls due during the step
    output = await loop._execute(step)
    assert [r.cancelled for r in output.results] == [True]


def test_finals_that_fall_due_during_a_step_go_in_the_order_they_fell_due():
    samples = audio(librivox_path("0920")).numpy()
    engine = Engine(bundle(), EngineConfig(max_finals=1))
    for rid in ("a", "b"):
        engine.add_request(rid)
        engine.add_audio(rid, samples[:48000])
    step = engine.schedule()
    assert [(w.request_id, w.final) for w in step.scheduled.windows] == [("a", False), ("b", False)]
    engine.flush("b")  # while the step runs: b first, then a
    engine.flush("a")
    engine.update_from_output(engine.execute(step))
    order = []
    while len(order) < 2:
        step = engine.schedule()
        order += [(w.request_id, w.final) for w in step.scheduled.windows]
        engine.update_from_output(engine.execute(step))
    assert order == [("b", True), ("a", True)]  # not the queue's order (a, b)


def test_a_given_up_partials_step_keeps_finished_decodes_and_the_others_tokens_so_far(monkeypatch):
    """Stopped after some decoder calls: the short window's decode had finished and is shown;
    the long one's tokens so far (a greedy prefix) become the draft of its next decode."""
    samples = audio(librivox_path("0920")).numpy()
    engine = Engine(bundle(), EngineConfig())
    for rid, n in (("short", 24000), ("long", 80000)):  # 1.5 s and 5 s of speech: previews
        engine.add_request(rid)
        engine.add_audio(rid, samples[:n])
    step = engine.schedule()
    assert [(w.request_id, w.preview) for w in step.scheduled.windows] == [("short", True),
                                                                           ("long", True)]
    decoder = engine.runner.model.decoder
    hidden, calls = decoder.hidden, []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 10:
            engine.stop_partials.set()  # as the engine loop does when a final falls due
        return hidden(*args, **kwargs)

    monkeypatch.setattr(decoder, "hidden", counted)
    output = engine.execute(step)
    assert [r.cancelled for r in output.results] == [False, True]
    prefix = output.results[1].tokens
    assert 0 < len(prefix) < 20
    outs = {o.request_id: o for o in engine.update_from_output(output)}
    assert list(outs) == ["short"] and outs["short"].tentative  # shown
    assert engine.streams["long"].drafts[0] == (step.scheduled.windows[1].window_end, prefix)
    monkeypatch.setattr(decoder, "hidden", hidden)
    alone = Engine(bundle(), EngineConfig())
    alone.add_request("long")
    alone.add_audio("long", samples[:80000])
    full = alone.execute(alone.schedule()).results[0].tokens
    assert len(full) > len(prefix) and full[: len(prefix)] == prefix


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU a step is one batch")
def test_on_the_cpu_a_step_that_may_be_given_up_runs_in_batches_of_one_windows_positions(monkeypatch):
    """A final that falls due waits for the transformer call in flight: a step of partials
    calls it on at most 1,500 positions at a time (three 10 s previews), and asks whether to
    go on between calls; a step of finals, which nobody gives up, is one call."""
    samples = audio(librivox_path("0920")).numpy()
    encoder = bundle().model.encoder
    transformer, batches = encoder.transformer, []

    def counted(x):
        batches.append(tuple(x.shape[:2]))
        return transformer(x)

    monkeypatch.setattr(encoder, "transformer", counted)

    def engine_with_previews(stop_after_first_batch: bool) -> Engine:
        engine = Engine(bundle(), EngineConfig())
        for i in range(4):
            engine.add_request(f"s{i}")
            engine.add_audio(f"s{i}", samples[: 24000 + 8000 * i])  # 1.5-3 s of speech
        decode_windows = engine.runner.decode_windows

        def decoded(*args, **kwargs):
            results = decode_windows(*args, **kwargs)
            if stop_after_first_batch:
                engine.stop_partials.set()  # as the engine loop does when a final falls due
            return results

        monkeypatch.setattr(engine.runner, "decode_windows", decoded)
        return engine

    engine = engine_with_previews(stop_after_first_batch=True)
    step = engine.schedule()
    assert [w.preview for w in step.scheduled.windows] == [True] * 4
    output = engine.execute(step)
    assert batches == [(3, 500)]
    assert [r.cancelled for r in output.results] == [False, False, False, True]
    assert all(r.words for r in output.results[:3])

    batches.clear()
    engine = engine_with_previews(stop_after_first_batch=False)
    output = engine.execute(engine.schedule())
    assert batches == [(3, 500), (1, 500)] and not any(r.cancelled for r in output.results)
    engine.update_from_output(output)
    batches.clear()
    for i in range(2):
        engine.finish(f"s{i}")
    step = engine.schedule()
    assert [w.final for w in step.scheduled.windows] == [True, True]
    engine.update_from_output(engine.execute(step))
    assert batches == [(2, 1500)]


def test_the_model_in_a_worker_process_gives_the_same_words_and_is_stopped_alike():
    """With `worker_process` the runner runs in a process of its own (the server's default):
    the same words and timestamps as in-process; stop_partials reaches it; a stopped worker
    fails the steps after it instead of hanging them."""
    samples = audio(librivox_path("0920")).numpy()
    engine = Engine(bundle(), EngineConfig(worker_process=True))
    try:
        engine.add_request("cut")
        engine.add_audio("cut", samples[:48000])  # 3 s of speech, no pause: a partial
        step = engine.schedule()
        engine.stop_partials.set()  # set here, read by the worker
        output = engine.execute(step)
        assert [r.cancelled for r in output.results] == [True] and output.num_encoded_items > 0
        engine.update_from_output(output)
        engine.abort("cut")
        words = stream(engine, ["s"], [samples])["s"]
        assert engine.processor_counts[0] > 0  # the worker's counters come back
    finally:
        engine.close()
    expected = stream(Engine(bundle()), ["s"], [samples])["s"]
    assert [(w.text, w.start_ms, w.end_ms) for w in words] == \
        [(w.text, w.start_ms, w.end_ms) for w in expected]
    assert "married" in normalize("".join(w.text for w in words))
    assert not engine.healthy
    engine.add_request("late")
    engine.add_audio("late", samples[:48000])
    (out,) = engine.update_from_output(engine.execute(engine.schedule()))
    assert out.finished and out.error.startswith("WorkerError")


def test_the_worker_takes_the_torch_threads_and_gives_them_back():
    """A worker runs with this process's torch threads while this process keeps one (its VAD
    at two threads would spin on the worker's cores); closed, the threads come back, so a
    server started after it (a second capacity run) gets a worker with them again."""
    threads = torch.get_num_threads()
    assert threads == 2  # tests/helpers.py
    samples = audio(librivox_path("0920")).numpy()[:32000]
    for _ in range(2):
        engine = Engine(bundle(), EngineConfig(worker_process=True))
        try:
            assert torch.get_num_threads() == 1
            engine.add_request("s")
            engine.add_audio("s", samples)
            engine.finish("s")
            output = engine.execute(engine.schedule())
            assert output.num_threads == threads  # what the worker ran the step with
        finally:
            engine.close()
            engine.close()  # twice: the threads come back once
        assert torch.get_num_threads() == threads


KEPT_MEMORY_PROBE = """
import resource, sys
import torch
from engine.worker import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.ones(10 << 20)  # a 40 MB block, freed: the peak
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    block = torch.ones(10 << 20)
    del block
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_the_worker_serves_a_steps_big_buffers_from_memory_the_last_step_freed():
    """Each step allocates and frees blocks of tens of MB; glibc by default maps each one
    afresh and faults in every page of it again. In the worker (keep_freed_memory) the freed
    memory serves the next block: a tenth of the page faults or fewer."""
    root = Path(__file__).resolve().parent.parent
    faults = {mode: int(subprocess.run([sys.executable, "-c", KEPT_MEMORY_PROBE, mode], cwd=root, check=True,
                                       capture_output=True, text=True).stdout)
              for mode in ("default", "keep")}
    assert faults["default"] >= 10 * 1000, faults  # ~10,000 pages of 4 KB a block
    assert faults["keep"] * 10 <= faults["default"], faults


def test_a_model_too_big_for_dev_shm_runs_in_a_thread(monkeypatch, caplog):
    """Sharing weights with the worker puts them in /dev/shm (64 MB in a default container,
    and writing past it is a SIGBUS): a model that does not fit stays in this process."""
    dims = ModelDimensions(n_mels=80, n_audio_ctx=10, n_audio_state=8, n_audio_head=2,
                           n_audio_layer=1, n_vocab=50, n_text_ctx=6, n_text_state=8,
                           n_text_head=2, n_text_layer=1)
    small = Whisper(dims)
    expected = sum(t.numel() * t.element_size() for t in [*small.parameters(), *small.buffers()])
    assert worker.shared_bytes(SimpleNamespace(model=small)) == expected
    monkeypatch.setattr(worker, "shm_free_bytes", lambda: 64 << 20)
    monkeypatch.setattr(worker, "shared_bytes", lambda bundle: 168 << 20)  # tiny.en's
    with caplog.at_level("WARNING"):
        engine = Engine(bundle(), EngineConfig(worker_process=True))
    assert isinstance(engine.runner, ModelRunner) and engine.healthy
    assert "do not fit in /dev/shm" in caplog.text


@pytest.mark.parametrize(("db", "chunk", "most", "sound"), [
    (0, 3200, 0.12, None), (-30, 3200, 0.12, None), (-50, 3200, 0.2, None),
    (-50, 16000 * 60, 0.2, None), (-50, 3200, 0.2, "click"), (-50, 3200, 0.2, "offset"),
    (-30, 3200, 0.12, "tone"), (-30, 3200, 0.12, "speech")])
def test_quiet_speech_is_transcribed_like_loud_speech(db, chunk, most, sound):
    """Speech 30 and 50 dB down (RMS about -54 and -74 dBFS) is still speech to the VAD:
    the session gets its finals, not silence (an energy gate at -45 dBFS decoded nothing of
    it). Also when the audio comes all at once (a backlog: finals with no partial before
    them), where Whisper's no-speech probability called windows of it silence; after a
    click near full scale or on a DC offset of 2% (either set the log-mel floor and the VAD's
    gain for the session); and 30 dB under a loud voice or a loud beep before it (a far voice
    after a near one: counted from the session's loudest sound, the floor lay over it).
    At -50 dB the model itself reads a little worse: float32 "old-sposed" for "ill-disposed"
    (3 errors of 30), int8 on AVX2 also "and is" for "in his" (5), where both read 0 and -30
    dB without an error."""
    samples, reference = concatenated([librivox_path(c) for c in ARCTIC_IDS[:2]], gap_seconds=1.0)
    quiet = (samples.numpy() * 10 ** (db / 20)).astype(np.float32)
    if sound == "click":
        quiet = with_click(quiet)
    elif sound == "offset":
        quiet = quiet + np.float32(0.02)
    elif sound in ("tone", "speech"):
        quiet = after_loud_sound(quiet, sound)
        reference = f"{LOUD_WORDS} {reference}" if sound == "speech" else reference
    words = stream(Engine(bundle()), ["s"], [quiet], chunk)["s"]
    errors, n = word_errors(reference, "".join(w.text for w in words))
    assert errors / n <= most, "".join(w.text for w in words)


def test_a_sessions_words_do_not_depend_on_how_its_audio_is_cut_into_messages():
    """A browser sends 20 ms messages, a replay script seconds at a time, a client any odd
    size: when compute keeps up, a session's words and their times are the same. Finals
    commit at pauses found in the audio, not at messages; the partials, which come as
    messages do, commit nothing in utterances under `agree_after_ms` (at 1 s they would, and
    the words differ with every message size here)."""
    samples, _ = concatenated([librivox_path(c) for c in ARCTIC_IDS[:2]], gap_seconds=0.3)
    samples = samples.numpy()

    def words(chunk: int) -> list[tuple[float, float, str]]:
        return replay_clip(Engine(bundle()), samples, chunk)

    expected = words(1600)
    assert len(expected) >= 20
    for chunk in (320, 4999, 32000):
        assert words(chunk) == expected, chunk


def test_the_decode_trace_shows_each_final_of_its_span_and_what_it_committed(capsys):
    """scripts/trace_decodes.py, on two recordings a second apart: each final in its span is
    printed with its window and reading, and the words committed in the span; a span over the
    second recording alone leaves the first recording's words out."""
    from scripts import trace_decodes

    samples, reference = concatenated([librivox_path(c) for c in ARCTIC_IDS[:2]], gap_seconds=1.0)
    second = transcripts()[librivox_path(ARCTIC_IDS[1])]
    second_ms = int(audio(librivox_path(ARCTIC_IDS[0])).shape[0] / 16) + 1000

    def trace(lo_ms: int, hi_ms: int) -> list[str]:
        engine = Engine(bundle())
        trace_decodes.traced(engine, bundle().tokenizer, lo_ms, hi_ms, previews=False)
        trace_decodes.replay(engine, samples.numpy(), 1600, lo_ms, hi_ms)
        return capsys.readouterr().out.splitlines()

    lines = trace(0, 10**9)
    assert sum(line.startswith("--- final") for line in lines) >= 2
    assert not any(line.startswith("--- preview") for line in lines)
    text = "".join(line.split(" s: ", 1)[1] for line in lines if line.startswith("    committed from"))
    errors, n = word_errors(reference, text)
    assert errors / n <= 0.2, text
    later = trace(second_ms, 10**9)
    text = "".join(line.split(" s: ", 1)[1] for line in later if line.startswith("    committed from"))
    errors, n = word_errors(second, text)
    assert errors / n <= 0.2, text


def edit_vad(monkeypatch, edit) -> list[int]:
    """Patch the engine's VAD: `edit(probs, index)` changes the speech probabilities of each
    call in place, `index` each chunk's in the session (one session) -> [chunks heard]."""
    from engine import engine as engine_module

    real_detect, seen = engine_module.detect, [0]

    def edited(detectors, samples):
        probs = real_detect(detectors, samples)
        for p in probs:
            edit(p, seen[0] + np.arange(p.size))
            seen[0] += p.size
        return probs

    monkeypatch.setattr(engine_module, "detect", edited)
    return seen


def test_a_voice_the_vad_hears_only_here_and_there_keeps_every_word(monkeypatch):
    """Silero barely hears some voices (a falsetto: its probability at most 0.55, over 0.5 in
    3 chunks of 3.5 s of speech), so most of their words have no VAD speech near them; a
    segment with any is kept whole, as offline. The VAD here hears one chunk in 25 (0.8 s)."""

    def blips(probs: np.ndarray, index: np.ndarray) -> None:
        probs[index % 25 != 0] = np.minimum(probs[index % 25 != 0], 0.3)

    edit_vad(monkeypatch, blips)
    samples, reference = concatenated([librivox_path(c) for c in ARCTIC_IDS[:2]], gap_seconds=1.0)
    words = stream(Engine(bundle()), ["s"], [samples.numpy()])["s"]
    errors, n = word_errors(reference, "".join(w.text for w in words))
    assert errors / n <= 0.12, "".join(w.text for w in words)


def test_a_final_of_speech_the_vad_hears_is_not_dropped_as_whispers_silence():
    """The decode of a final over faint speech in noise (tests/helpers.py) has Whisper's
    no-speech probability high and its log-probability low: the VAD heard seconds of speech
    in it, so its words are committed."""
    words = stream(Engine(bundle()), ["s"], [faint_noisy_speech()])["s"]
    text = "".join(w.text for w in words)
    assert "rather cold" in text.lower(), text


def noise_between_sentences() -> tuple[np.ndarray, str, tuple[int, int], int]:
    """Two sentences with 20 s of pink noise at -45 dBFS between -> (audio, reference, the
    noise's (start, end) ms less 0.5 s at each edge, the second sentence's speech onset ms)."""
    (first, second), text = [audio(librivox_path(c)).numpy() for c in ("0870", "0880")], transcripts()
    rng = np.random.default_rng(1)
    spectrum = np.fft.rfft(rng.standard_normal(16000 * 20))
    spectrum[1:] /= np.sqrt(np.arange(1, spectrum.size))
    noise = np.fft.irfft(spectrum, 16000 * 20)
    noise = (noise / np.sqrt(np.mean(noise**2)) * 10 ** (-45 / 20)).astype(np.float32)
    reference = text[librivox_path("0870")] + " " + text[librivox_path("0880")]
    gap = (len(first) * 1000 // 16000 + 500, (len(first) + len(noise)) * 1000 // 16000 - 500)
    onset = (len(first) + len(noise)) * 1000 // 16000 + speech_onset_ms(second)
    return np.concatenate([first, noise, second]), reference, gap, onset


def test_steady_noise_between_sentences_invents_no_words():
    samples, reference, _, _ = noise_between_sentences()
    words = stream(Engine(bundle()), ["s"], [samples])["s"]
    errors, n = word_errors(reference, "".join(w.text for w in words))
    assert errors / n <= 0.1, "".join(w.text for w in words)


def test_words_after_a_long_pause_are_timed_from_the_audio():
    """Word times come from the audio (cross-attention alignment): none falls inside the
    pause, and the sentence after it starts where its speech starts."""
    samples, _, (gap_start, gap_end), onset = noise_between_sentences()
    words = stream(Engine(bundle()), ["s"], [samples])["s"]
    inside = [w.text for w in words if gap_start < (w.start_ms + w.end_ms) // 2 < gap_end]
    assert not inside and len(words) > 10, inside
    after = [w for w in words if w.start_ms > gap_start]
    assert after and abs(after[0].start_ms - onset) <= 300, (after[0], onset)


def test_where_speech_is_does_not_depend_on_how_the_audio_arrives():
    """The VAD runs when the engine next needs it (Engine.hear), over whatever came in since;
    an item's speech is decided once the chunk across its end is heard, so each item's
    decision, the pauses and the endpoints come out the same for 100 ms messages, for one
    item at a time and for odd sizes."""
    samples, _ = concatenated([librivox_path(c) for c in ARCTIC_IDS], gap_seconds=0.4)
    samples = samples.numpy()

    def track(size: int) -> tuple[dict[int, int], list[int]]:
        """-> (items tracked -> the end of the last speech then, after each hear; endpoints)"""
        engine = Engine(bundle())
        engine.add_request("s")
        stream = engine.streams["s"]
        trace = {}
        for i in range(0, samples.size, size):
            engine.add_audio("s", samples[i : i + size])
            engine.hear()
            trace[stream.request.num_items] = stream.request.last_speech_end
        engine.flush("s")
        engine.hear()
        return trace, list(stream.request.endpoints)

    trace, endpoints = track(1600)
    assert len(endpoints) >= len(ARCTIC_IDS)  # the pauses, and the end before the flush's padding
    for size in (1280, 517):  # one item a time: its last chunk comes with the next
        other, other_endpoints = track(size)
        assert other_endpoints == endpoints
        common = trace.keys() & other.keys()
        assert len(common) > len(trace) // 3
        assert {k: trace[k] for k in common} == {k: other[k] for k in common}


def longest_missing_run(reference: str, text: str) -> int:
    """The most consecutive reference words the text lacks (a dropped passage)."""
    _, matches = align(normalize(reference), normalize(text))
    longest = run = 0
    for match in matches:
        run = run + 1 if match is None else 0
        longest = max(longest, run)
    return longest


@pytest.mark.parametrize("background", [False, True])
def test_audio_pushed_far_ahead_loses_no_passage(background):
    """A session whose audio all arrives at once (a replay) is decoded final window by final
    window, each reaching back to the utterance kept as context. Whisper, given that
    utterance again, may end its text there: the final is then decoded again from its
    committed end, and every passage is kept (it used to drop one of these 11 s). A file
    (`background`) is decoded in 30 s windows that seek, as offline: where the decoder skips
    a repeated passage, the window is decoded again up to the pause after it."""
    first, second = (audio(librivox_path(c)) for c in ("0930", "0890"))
    text = transcripts()
    one = torch.cat([first, torch.zeros(40000), second])
    reference = " ".join([text[librivox_path("0930")] + " " + text[librivox_path("0890")]] * 4)
    engine = Engine(bundle())
    engine.add_request("s", background=background)
    engine.add_audio("s", torch.cat([one] * 4).numpy())
    engine.finish("s")
    words = []
    while engine.has_request("s"):
        words += [w for out in engine.step() for w in out.committed]
    hypothesis = "".join(w.text for w in words)
    errors, n = word_errors(reference, hypothesis)
    assert longest_missing_run(reference, hypothesis) <= 3 and errors / n <= 0.15, hypothesis


def test_a_note_the_vad_takes_for_speech_in_a_long_pause_leaves_the_pause_skipped(monkeypatch):
    """Music between two sentences, louder than the speech; the VAD takes a note of it for
    speech (0.2 s, 1 s in), and a final reads that as nothing. The window still skips the
    pause before the next sentence, as it does with no such note: kept, 20 s of music before
    a sentence had its first words stamped at the window's start, in the music (the decoder's
    first timestamp is at most 1 s into a window)."""
    (first, second), text = [audio(librivox_path(c)).numpy() for c in ("0870", "0880")], transcripts()
    music = 10 ** (-15 / 20) * sound("music", 20 * 16000, 16000, np.random.default_rng(2))  # -15 dBFS
    music = music.astype(np.float32)
    pause = np.zeros(8000, np.float32)
    samples = np.concatenate([first, pause, music, pause, second])
    gap_start, gap_end = (len(first) + 8000) // 16, (len(first) + 8000 + len(music)) // 16 + 500
    onset = gap_end + speech_onset_ms(second)
    knock = range((gap_start + 1000) * 16 // 512, (gap_start + 1200) * 16 // 512)  # VAD chunks

    def knocked(probs: np.ndarray, index: np.ndarray) -> None:
        probs[np.isin(index, knock)] = 0.9

    seen = edit_vad(monkeypatch, knocked)
    windows, apply = [], Stream.apply  # (start, end) ms of each decode of the window

    def noted(self, result):
        request = self.request
        if not result.preview:
            windows.append((positions_to_ms(request.window_start),
                            positions_to_ms(request.num_decoded_positions)))
        return apply(self, result)

    monkeypatch.setattr(Stream, "apply", noted)
    # a Finalize after the first sentence cuts the window there
    words = stream(Engine(bundle()), ["s"], [samples], flush_at=len(first))["s"]
    assert seen[0] > knock.stop
    # a decode of the next sentence reads it from a second before its onset (100: an item)
    late = [(start, end) for start, end in windows if end > onset + 500 and start < onset - LEAD_IN_MS - 100]
    assert not late, (late, onset)
    hypothesis = "".join(w.text for w in words)
    errors, n = word_errors(text[librivox_path("0870")] + " " + text[librivox_path("0880")], hypothesis)
    inside = [w.text for w in words if gap_start + 500 < (w.start_ms + w.end_ms) // 2 < gap_end - 500]
    assert errors / n <= 0.1 and not inside, (hypothesis, inside)
    after = [w for w in words if w.start_ms > gap_start]
    assert after and abs(after[0].start_ms - onset) <= 300, (after[0], onset)


def test_speech_after_a_long_silence_is_decoded_without_the_silence():
    """Three sentences with 12 s of digital silence after each. A window that held the silence
    before the next sentence made Whisper repeat the prompt's last sentence or make up words
    (47% WER here: "He was not an old-sposed young man. He was a young young. man. He was an
    ..."); the window now starts a second before the speech (Stream.skip_silence)."""
    clips = [audio(librivox_path(c)).numpy() for c in ("0880", "0920", "0870")]
    text = transcripts()
    reference = " ".join(text[librivox_path(c)] for c in ("0880", "0920", "0870"))
    silence = np.zeros(12 * 16000, np.float32)
    samples = np.concatenate([clips[0], silence, clips[1], silence, clips[2]])
    words = stream(Engine(bundle()), ["s"], [samples])["s"]
    hypothesis = "".join(w.text for w in words)
    errors, n = word_errors(reference, hypothesis)
    gaps = [(len(clips[0]) / 16, len(clips[0]) / 16 + 12_000),
            ((len(clips[0]) + len(silence) + len(clips[1])) / 16,
             (len(clips[0]) + len(silence) + len(clips[1])) / 16 + 12_000)]
    inside = [w.text for w in words for a, b in gaps if a + 500 < (w.start_ms + w.end_ms) / 2 < b - 500]
    assert errors / n <= 0.1 and not inside, (hypothesis, inside)


def test_the_stem_store_gathers_each_windows_pieces_then_its_padding():
    """The runner's encoder cache: items stored in batches past its first size (it grows),
    some evicted and their slots taken by new ones; a step's windows read with one index must
    be each window's item slices in order, then the padding's row, as slicing gives them."""
    rng = np.random.default_rng(0)
    store, stems = StemStore(), {}
    for batch in range(6):
        keys = [f"{batch}-{i}" for i in range(300)]
        values = torch.from_numpy(rng.standard_normal((300, 4, 8)).astype(np.float32))
        store.put(keys, values)
        stems.update(zip(keys, values, strict=True))
        for key in list(stems)[: 100 * (batch % 2)]:  # evict some: their slots are reused
            store.pop(key)
            del stems[key]
    assert len(stems) > INITIAL_SLOTS and set(store) == set(stems)
    assert all(torch.equal(store.get(key), value) for key, value in stems.items())  # none overwritten
    store.put(["pad"], torch.ones(1, 4, 8), pinned=True)
    assert "pad" in store and "pad" not in set(store)
    keys = list(stems)
    windows = [[(keys[int(k)], int(lo), int(lo) + int(n))
                for k, lo, n in zip(rng.integers(0, len(keys), 40), rng.integers(0, 3, 40),
                                    rng.integers(1, 2, 40), strict=True)] for _ in range(3)]
    windows[1] = windows[1][:5]
    gathered = store.gather(windows, ["pad"] * 3, 60)  # (3, 60, 8)
    for b, pieces in enumerate(windows):
        expected = torch.cat([stems[key][lo:hi] for key, lo, hi in pieces])
        assert torch.equal(gathered[b, : len(expected)], expected)
        assert (gathered[b, len(expected) :] == 1).all()


def test_after_a_final_that_a_short_pause_ended_the_next_reading_starts_in_the_pause(monkeypatch):
    """Sentences a third of a second apart, one voice: the endpoint, a quarter second of VAD
    pause, lies at the next sentence's onset. A window, a preview or a second reading that
    starts there reads its first word wrong ("Pour in" read "Or,"); they start early in the
    pause instead (SpeechMap.after_pause), and every sentence is read."""
    from scripts import corpus

    voice = corpus.Voice("espeak", "en-us", 165)
    texts = corpus.PASSAGES[15][:4] + corpus.PASSAGES[16][:3]
    pieces = [corpus.tts_piece(text, voice) for text in texts]
    clip = corpus.layout("one-voice", "pauses-short", pieces, [0.33] * (len(pieces) - 1))
    onsets = [s["onset"] * 1000 for s in clip.sentences]
    ends = [s["end"] * 1000 for s in clip.sentences]
    starts: list[tuple[int, int]] = []  # (a live final's end, where the reading after it starts), ms
    apply = Stream.apply

    def record(self: Stream, result):
        before = self.request.preview_start
        out = apply(self, result)
        if result.final and self.request.preview_start != before:  # (not held, nor read again)
            starts.append((positions_to_ms(self.request.num_decoded_positions),
                           positions_to_ms(self.request.preview_start)))
        return out

    monkeypatch.setattr(Stream, "apply", record)
    words = stream(Engine(bundle()), ["s"], [clip.audio])["s"]
    between = [(end, start) for end, start in starts
               if any(e <= end <= o + 200 for e, o in zip(ends[:-1], onsets[1:], strict=True))]
    assert len(between) >= 2, starts
    for end, start in between:  # in the pause before the onset the endpoint lies near
        k = min(range(1, len(onsets)), key=lambda i: abs(onsets[i] - end))
        assert ends[k - 1] + 50 <= start <= onsets[k] - 80, (start, end, ends[k - 1], onsets[k])
    hypothesis = "".join(w.text for w in words)
    errors, num_words = word_errors(" ".join(texts), hypothesis)
    assert errors <= 0.2 * num_words, hypothesis


def test_a_long_windows_final_keeps_its_last_sentence_as_the_next_ones_context(monkeypatch):
    """Sentences 1.5 s apart, one voice: a final's window grows past TRIM_AFTER_POSITIONS and
    is cut at the start of the sentence it committed last, not at its end, so the next final
    reads its sentence after that one (read alone, a sentence reads worse). The kept sentence
    is read again as context, never committed twice, and the final is not taken for a retry;
    its tokens open the window's draft and are taken as given (its text is not read again:
    the next final's decode opens with it and reads on after it). The decoder, hearing the
    next sentence, believes the given full stop: the talker is not taken to pause inside
    sentences."""
    from scripts import corpus

    voice = corpus.Voice("espeak", "en-us", 160)
    texts = corpus.PASSAGES[2] + corpus.PASSAGES[5][:2]
    pieces = [corpus.tts_piece(text, voice) for text in texts]
    clip = corpus.layout("one-voice", "long-session", pieces, [1.5] * (len(pieces) - 1))
    cuts: list[tuple[int, int]] = []  # (window start, committed end), ms, after each final's cut
    drafts: list[tuple[list[int], list[int]]] = []  # (the kept words' tokens, the draft's text)
    habits: list[bool] = []
    apply = Stream.apply

    givens: list[float | None] = []  # per final read in a window that starts with a kept sentence

    def record(self: Stream, result):
        start = self.request.window_start
        if result.final and result.words and self.forced(start, preview=False) > 0:
            givens.append(result.given_logprob)
        out = apply(self, result)
        habits.append(self.habit.inside_sentences)
        if result.final and self.request.window_start != start:
            cuts.append((positions_to_ms(self.request.window_start), self.policy.committed_end_ms))
            window = self.policy.committed[len(self.policy.committed) - self.policy.num_window_committed :]
            kept = [w for w in window if w.start_ms >= positions_to_ms(self.request.window_start)]
            if kept:
                _, draft = self.drafts.get(self.request.window_start, (0, []))
                drafts.append(([t for w in kept for t in w.tokens],
                               [t for t in draft if t < self.timestamp_begin]))
        return out

    decode_batch = model_runner.decode_batch
    forced: list[tuple[list[int], list[int]]] = []  # (forced tokens, the decode's), per such decode

    def given(model, tokenizer, features, options, *args, **kwargs):
        results = decode_batch(model, tokenizer, features, options, *args, **kwargs)
        forced.extend((o.draft[: o.forced], r.tokens) for o, r in zip(options, results, strict=True)
                      if o.forced)
        return results

    monkeypatch.setattr(Stream, "apply", record)
    monkeypatch.setattr(model_runner, "decode_batch", given)
    words = stream(Engine(bundle()), ["s"], [clip.audio])["s"]
    onsets = [s["onset"] * 1000 for s in clip.sentences]
    ends = [s["end"] * 1000 for s in clip.sentences]
    kept = [(c, end) for c, end in cuts if c < end - 1000]
    assert kept, cuts
    for c, end in kept:  # at the pause before the last committed sentence (200 ms into the
        k = max(i for i, onset in enumerate(onsets) if onset < end)  # word before, as aligned)
        assert ends[k - 1] - 300 <= c <= onsets[k], (c, onsets[k], ends[k - 1])
    assert len(drafts) == len(kept)
    for tokens, draft in drafts:
        assert draft[: len(tokens)] == tokens
    # each kept window with speech after its kept sentence (the stream's last has none)
    assert len(forced) >= sum(end < ends[-1] - 500 for _, end in kept) >= len(kept) - 1
    for prefix, tokens in forced:
        assert len(tokens) > len(prefix) and tokens[: len(prefix)] == prefix
    assert len(givens) >= len(kept) - 2 and None not in givens
    assert sum(g > GIVEN_MARK_LOGPROB for g in givens) >= 0.8 * len(givens), givens
    assert not any(habits)
    reference = " ".join(texts)
    hypothesis = "".join(w.text for w in words)
    errors, num_words = word_errors(reference, hypothesis)
    assert errors <= 0.25 * num_words, hypothesis
    assert len(normalize(hypothesis)) <= num_words + 3, hypothesis  # no sentence committed twice
