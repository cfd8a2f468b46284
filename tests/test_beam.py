"""Beam search (engine.model.beam): openai-whisper's, and the decodes that use it."""

from dataclasses import replace

import numpy as np
import pytest
import torch

import app.cli as cli
import engine.model.transcribe as offline
import engine.model_runner as model_runner
from app.engine_loop import EngineLoop
from app.metrics import Metrics
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.beam import decode_beam
from engine.model.decoding import DecodingCancelled, DecodingOptions, DecodingResult, decode, decode_batch
from engine.model.loader import default_model_path, load_state
from engine.model.transcribe import transcribe
from scripts.wer import normalize
from tests.helpers import ARCTIC_IDS, audio, bundle, concatenated, exact_bundle, librivox_path
from tests.test_engine import stream
from tests.test_model import three_windows, window_mel


def test_beam_search_is_openai_whispers():
    """Five beams over real windows, with and without a prompt: openai-whisper's beam search
    (same weights, float32) chooses the same tokens with the same mean log-probability."""
    decoding = pytest.importorskip("whisper.decoding")
    whisper_model = pytest.importorskip("whisper.model")
    dims, state = load_state(default_model_path())
    reference = whisper_model.Whisper(whisper_model.ModelDimensions(**dims.__dict__))
    reference.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()})
    reference.eval()
    b = exact_bundle()
    _, prompt, _ = three_windows()  # a real reading of another window
    for clip, given in (("0870", []), ("0930", prompt)):
        mel = window_mel(clip)
        with torch.inference_mode():
            features = b.model.encoder(mel.to(b.device, b.model.dtype))
            ours = decode_beam(b.model, b.tokenizer, features, b.model.decoder.cross_kv(features),
                               DecodingOptions(prompt=given), b.suppress, beam_size=5)
            theirs = decoding.decode(reference, mel[0], decoding.DecodingOptions(
                language="en", beam_size=5, fp16=False, prompt=given or None))
        assert ours.tokens == list(theirs.tokens), (b.tokenizer.decode(ours.tokens), theirs.text)
        assert abs(ours.avg_logprob - theirs.avg_logprob) < 1e-3
        assert abs(ours.no_speech_prob - theirs.no_speech_prob) < 1e-3
        assert ours.stop == "eot" and len(ours.tokens) > 10


def test_one_beam_is_greedy_decoding():
    b = bundle()
    features, _, options = three_windows()
    with torch.inference_mode():
        cross = b.model.decoder.cross_kv(features)
    for row, opts in enumerate(options):
        greedy = decode(b.model, b.tokenizer, features[row : row + 1], opts, b.suppress)
        window = [(k[row : row + 1], v[row : row + 1]) for k, v in cross]
        one = decode_beam(b.model, b.tokenizer, features[row : row + 1], window, opts, b.suppress, 1)
        assert one.tokens == greedy.tokens and one.stop == greedy.stop == "eot"
        assert abs(one.avg_logprob - greedy.avg_logprob) < 1e-3


def test_forced_tokens_open_every_beam_and_weigh_nothing():
    """A final's window that keeps a committed sentence as context reads its text as given,
    with beams as greedy (`decode_batch`'s `forced`)."""
    b = bundle()
    features, _, options = three_windows()
    row = decode_batch(b.model, b.tokenizer, features[:1], options[:1], b.suppress)[0].tokens
    k = 9
    other = list(row[:k])
    texts = [i for i in range(k) if row[i] < b.tokenizer.timestamp_begin]
    other[texts[1]] = other[texts[0]]  # a word greedy would not read there
    with torch.inference_mode():
        cross = b.model.decoder.cross_kv(features[:1])
    searched = decode_beam(b.model, b.tokenizer, features[:1], cross,
                           replace(options[0], draft=other + [1, 2, 3], forced=k), b.suppress, beam_size=5)
    assert searched.tokens[:k] == other and searched.token_logprobs[:k] == [0.0] * k
    assert len(searched.tokens) > k + 3 and searched.stop == "eot"
    chosen = searched.token_logprobs[k:]
    assert sum(chosen) / (len(chosen) + 1) >= searched.avg_logprob  # (end-of-text's counts too)


def test_beam_size_must_be_sane(capsys):
    for bad in (0, 17):
        with pytest.raises(ValueError, match="beam_size"):
            EngineConfig(beam_size=bad)
        assert cli.main(["transcribe", "missing.wav", "--beam-size", str(bad)]) == 2  # before the model loads
        assert "--beam-size must be 1-16" in capsys.readouterr().err


def searched_windows(monkeypatch) -> list[tuple[int, bool]]:
    """Replaces the model runner's beam search with one that records each call's beams and
    whether the window's draft gave forced tokens; the list it appends to."""
    calls = []

    def recording(model, tokenizer, features, cross, options, suppress, beam_size=5, stop=None):
        calls.append((beam_size, options.forced > 0))
        return decode_beam(model, tokenizer, features, cross, options, suppress, beam_size, stop)

    monkeypatch.setattr(model_runner, "decode_beam", recording)
    return calls


def test_finals_are_searched_with_beams_and_partials_stay_greedy(monkeypatch):
    samples, _ = concatenated([librivox_path(c) for c in ARCTIC_IDS[:3]], gap_seconds=0.8)
    calls = searched_windows(monkeypatch)
    finals = []
    record = model_runner.ModelRunner._decode_whole
    monkeypatch.setattr(model_runner.ModelRunner, "_decode_whole",
                        lambda self, *a, **k: finals.append(1) or record(self, *a, **k))
    engine = Engine(bundle(), EngineConfig(beam_size=4))
    words = stream(engine, ["s"], [samples.numpy()])["s"]
    assert len(words) > 20
    # every decode committed whole, and only those, searched with the session's beams
    assert len(calls) == len(finals) >= 3 and {c[0] for c in calls} == {4}
    assert any(forced for _, forced in calls)  # a final that keeps the sentence before it
    calls.clear()
    stream(Engine(bundle(), EngineConfig(beam_size=1)), ["s"], [samples.numpy()])
    assert calls == []


def test_partials_that_agreement_may_commit_are_searched(monkeypatch):
    """An utterance that runs past agree_after_ms with no pause to end it (no endpoint under
    2 s here): its partials whose words agreement may commit are searched with the session's
    beams, as finals are, and agreement commits words before the stream ends; the partials
    before that stay greedy."""
    samples, _ = concatenated([librivox_path(c) for c in ARCTIC_IDS[:2]], gap_seconds=0.3)
    calls = searched_windows(monkeypatch)
    agreed = []
    record = model_runner.ModelRunner._decode_agreed
    monkeypatch.setattr(model_runner.ModelRunner, "_decode_agreed",
                        lambda self, *a, **k: agreed.append(a[0]) or record(self, *a, **k))

    def committed_before_the_end(beam_size: int) -> list:
        engine = Engine(bundle(), EngineConfig(beam_size=beam_size, endpoint_ms=2000, agree_after_ms=2000))
        engine.add_request("s")
        words = []
        for i in range(0, len(samples), 3200):
            engine.add_audio("s", samples[i : i + 3200].numpy())
            words += [w for out in engine.step() for w in out.committed]
        return words

    words = committed_before_the_end(3)
    assert len(words) >= 5  # agreement committed them
    assert len(agreed) >= 2 and set(agreed) == {3} and len(calls) == len(agreed)
    assert all(beams == 3 for beams, _ in calls)
    calls.clear()
    agreed.clear()
    assert len(committed_before_the_end(1)) >= 5 and calls == []

    # two such partials in one step are read greedy (each would wait for the other's search)
    for sessions, beams in ((["a"], [3]), (["a", "b"], [1, 1])):
        engine = Engine(bundle(), EngineConfig(beam_size=3, endpoint_ms=2000, agree_after_ms=2000))
        for rid in sessions:
            engine.add_request(rid)
            engine.add_audio(rid, samples[: 4 * 16000].numpy())
        step = engine.schedule()
        assert [(w.timed, w.window.preview, w.beam_size) for w in step.model_input.windows] == \
            [(True, False, b) for b in beams]


def test_a_searched_partial_that_passes_over_what_the_greedy_one_read_is_not_kept(monkeypatch):
    """In run-on speech five beams read a window from "The rainforest", 5 s in, where the greedy
    decode read its first words, decode after decode: the beams passed over speech the greedy
    one read, and the partial keeps its greedy reading, where the search starts reading over a
    second later or spells under SHORT_READING of its letters. A search that starts within a
    second of it and reads as much is kept; the greedy decode stays where the search fails
    Whisper's fallback rule, and with one beam."""
    runner = model_runner.ModelRunner(bundle())
    begin = runner.bundle.tokenizer.timestamp_begin
    said = " On quiet mornings she teaches students to draw."

    def reading(start: int, text: str = said, logprob: float = -0.3) -> DecodingResult:
        return DecodingResult([begin + start, 383, begin + start + 40], text, logprob, 0.1, 1.2, "eot")

    greedy = reading(0)
    for searched, kept in ((reading(250), greedy), (reading(0, " The rainforest is home."), greedy),
                           (reading(40, " On quiet mornings she teaches students two draw."), None),
                           (reading(0, logprob=-1.5), greedy)):
        monkeypatch.setattr(model_runner, "decode_beam", lambda *a, found=searched, **k: found)
        assert runner._decode_agreed(5, DecodingOptions(), greedy, None, []).text == (kept or searched).text
    assert runner._decode_agreed(1, DecodingOptions(), greedy, None, []) is greedy


def final_text(output) -> str:
    (result,) = output.results
    return " ".join(normalize("".join(w.text for w in result.words)))


def test_a_final_is_searched_only_while_no_other_sessions_final_waits(monkeypatch):
    """Two finals due, one per step: the first is read greedy (the other waits for its step),
    the second searched. A search that is given up leaves the greedy reading: on this clip
    greedy reads "coldhearted", 5 beams "cold-hearted" (tests/test_transcribe.py). Two finals
    in one step are read greedy (each would wait for the other's search)."""
    calls = searched_windows(monkeypatch)
    samples = audio(librivox_path("0890")).numpy()
    engine = Engine(bundle(), EngineConfig(max_finals=1))
    for rid in ("a", "b"):
        engine.add_request(rid)
        engine.add_audio(rid, samples)
        engine.finish(rid)
    step = engine.schedule()
    assert [(w.request_id, w.window.final, w.beam_size) for w in step.model_input.windows] == [("a", True, 1)]
    output = engine.execute(step)
    assert "coldhearted" in final_text(output) and calls == []
    engine.update_from_output(output)
    step = engine.schedule()
    assert [(w.request_id, w.beam_size) for w in step.model_input.windows] == [("b", 5)]
    assert "cold hearted" in final_text(engine.runner.execute(step.model_input))
    assert calls == [(5, False)]
    given_up = engine.runner.execute(step.model_input, lambda: True)
    assert calls == [(5, False)] * 2
    assert "coldhearted" in final_text(given_up) and not given_up.results[0].error
    together = Engine(bundle(), EngineConfig(max_finals=2))  # two finals in one step: read greedy
    for rid in ("a", "b"):
        together.add_request(rid)
        together.add_audio(rid, samples)
        together.finish(rid)
    step = together.schedule()
    assert [(w.request_id, w.beam_size) for w in step.model_input.windows] == [("a", 1), ("b", 1)]


def test_a_search_asked_to_stop_raises_before_its_next_decoder_call():
    b = bundle()
    features, _, options = three_windows()
    with torch.inference_mode():
        cross = b.model.decoder.cross_kv(features[:1])
    asked = []
    with pytest.raises(DecodingCancelled):
        decode_beam(b.model, b.tokenizer, features[:1], cross, options[0], b.suppress, 5,
                    lambda: asked.append(1) or len(asked) > 3)
    assert len(asked) == 4


async def test_the_engine_loop_gives_up_a_search_for_another_sessions_final(monkeypatch):
    """A final's search runs while its own session streams on; another session's final that
    falls due during the step gives it up (the greedy reading is committed)."""
    samples = audio(librivox_path("0890")).numpy()
    texts = []
    for other_final in (False, True):
        engine = Engine(bundle(), EngineConfig())
        loop = EngineLoop(engine, Metrics())
        for rid in ("a", "b"):
            loop.open(rid, lambda _: None)
        loop.add_audio("a", samples)
        loop.finish("a")
        loop._apply_commands()
        step = engine.schedule()
        assert [(w.request_id, w.beam_size) for w in step.model_input.windows] == [("a", 5)]
        loop.add_audio("b", samples[:16000])  # come in while the step runs
        if other_final:
            loop.finish("b")
        texts.append(final_text(await loop._execute(step)))
    assert "cold hearted" in texts[0] and "coldhearted" in texts[1]


def test_offline_transcription_searches_with_beams_unless_told_greedy(monkeypatch):
    samples = audio(librivox_path("0880"))
    calls = []

    def recording(*args):
        calls.append(args[-1])
        return decode_beam(*args)

    monkeypatch.setattr(offline, "decode_beam", recording)
    searched = transcribe(bundle(), samples)
    assert calls and set(calls) == {5}
    calls.clear()
    greedy = transcribe(bundle(), samples, beam_size=1)
    assert calls == []
    assert searched.text.strip() and greedy.text.strip()
