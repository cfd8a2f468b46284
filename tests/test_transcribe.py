"""Offline transcription of real recordings: golden transcripts, long audio, the CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile
import torch
import torchaudio.functional as AF

from engine.model.decoding import repeated_tail
from engine.model.transcribe import transcribe
from scripts.corpus import Voice, layout, sound, tts_piece
from scripts.wer import normalize, word_errors
from tests.helpers import (
    ARCTIC_IDS,
    CARDS,
    LOUD_WORDS,
    after_loud_sound,
    audio,
    bundle,
    concatenated,
    faint_noisy_speech,
    librivox_path,
    transcripts,
    with_click,
)

# What Whisper tiny.en (bundled CTranslate2 weights, our PyTorch port) actually says, decoding
# greedily (as streaming does), and with offline's five beams where that reads otherwise.
GOLDEN = {
    "0890": "Unless to be rather coldhearted and rather selfish is to be ill-disposed.",
    "0920": "Had he married a more amiable woman, he might have been made still more "
            "respectable than he was.",
    "0930": "He might even have been made amiable himself.",
}
SEARCHED = {**GOLDEN, "0890": "Unless to be rather cold-hearted and rather selfish is to be ill-disposed."}
# a live final is searched when the server has the headroom and no other session's final
# waits for it (docs/architecture.md, Decoding): with other sessions about, either reading
READINGS = {clip: {GOLDEN[clip], SEARCHED[clip]} for clip in GOLDEN}


@pytest.mark.parametrize("clip", sorted(GOLDEN))
def test_golden_transcripts(clip):
    for beams, golden in ((5, SEARCHED), (1, GOLDEN)):
        result = transcribe(bundle(), audio(librivox_path(clip)), beams)
        assert result.text == golden[clip]
        assert len(result.segments) == 1
        assert 0.0 <= result.segments[0].start < result.segments[0].end <= result.duration


def test_arctic_set_word_error_rate_at_most_15_percent():
    errors = words = 0
    for clip in ARCTIC_IDS:
        path = librivox_path(clip)
        e, n = word_errors(transcripts()[path], transcribe(bundle(), audio(path)).text)
        errors, words = errors + e, words + n
    assert words == 71
    assert errors / words <= 0.15, f"WER {errors / words:.1%}"


@pytest.mark.parametrize(("db", "sound"), [(-50, None), (-50, "click"), (-50, "offset"), (-40, "tone"),
                                         (-30, "speech")])
def test_quiet_speech_keeps_every_sentence(db, sound):
    """Speech 50 dB down (RMS about -74 dBFS): the VAD still hears it (the detector's gain), so
    no segment of it is dropped as unheard and no window of it as Whisper's silence. Also
    after a click near full scale or on a DC offset of 2%, which counted as the file's loudest
    sound set the log-mel floor over the speech and the VAD's gain under it; and 30 or 40 dB under a
    loud voice or a loud beep before it, which set the floor over it too."""
    samples, reference = concatenated([librivox_path(c) for c in ARCTIC_IDS], gap_seconds=1.0)
    samples = samples * 10 ** (db / 20)
    if sound == "click":
        samples = torch.from_numpy(with_click(samples.numpy()))
    elif sound == "offset":
        samples = samples + 0.02
    elif sound in ("tone", "speech"):
        samples = torch.from_numpy(after_loud_sound(samples.numpy(), sound))
        reference = f"{LOUD_WORDS} {reference}" if sound == "speech" else reference
    result = transcribe(bundle(), samples)
    errors, n = word_errors(reference, result.text)
    assert errors / n <= 0.15, result.text


def test_speech_the_vad_hears_is_not_dropped_as_whispers_silence():
    text = transcribe(bundle(), torch.from_numpy(faint_noisy_speech())).text
    assert "rather cold" in text.lower(), text


def test_short_utterances_between_long_silences_are_each_found_at_their_onset():
    """Commands of half a second with 5-9 s of silence between them: a 30 s window across
    the silences passed over some ("Yes.") and timed others seconds late, next to the speech
    after the silence; a window ends at a silence of 3 s."""
    voice = Voice("espeak", "en-us", 160)
    pieces = [tts_piece(t, voice) for t in ("Yes.", "Stop.", "Call mom.", "Okay.", "Go back.", "Thank you.")]
    clip = layout("commands", "commands", pieces, [6.0, 8.5, 5.0, 9.0, 7.0], lead=1.0)
    result = transcribe(bundle(), torch.from_numpy(clip.audio))
    starts = [s.words[0].start_ms / 1000 for s in result.segments if s.words]
    assert len(starts) == len(pieces), result.segments
    for start, sentence in zip(starts, clip.sentences, strict=True):
        assert abs(start - sentence["onset"]) <= 0.3, (start, sentence)


HUM_TEXTS = ("The city plans to close the main street to cars on weekends.",
             "The next morning we put up posters on every lamp post in the neighborhood.",
             "Monkeys swing through the high branches while colorful birds call to each other.")


@pytest.mark.parametrize("first, hum_dbfs", [(0, -30.8), (0, -36.0), (1, -24.0)])
def test_a_hum_starting_in_a_pause_reads_as_no_speech(first, hum_dbfs):
    """Mains hum that starts half a second after a sentence and goes on for seconds: the VAD
    took its onset for 0.3-0.4 s of speech, and the decoder read that with its prompt as
    " you." (no-speech probability 0.98, mean log-probability -0.8: speech by Whisper's
    rule). The sentences around it are still read."""
    awb, rp = Voice("flite", "awb", 100), Voice("espeak", "en-gb-x-rp+m3", 170)
    texts, voices = HUM_TEXTS[first:], [awb, awb, rp][first:]
    pauses = [8.7, 6.58][first:]
    clip = layout("hum", "hum", [tts_piece(t, v) for t, v in zip(texts, voices, strict=True)], pauses)
    gap = clip.gaps[-2]  # the pause before the last sentence
    a, b = round((gap["start"] + 0.5) * clip.rate), round((gap["end"] - 0.5) * clip.rate)
    samples = clip.audio.copy()
    samples[a:b] += 10 ** (hum_dbfs / 20) * sound("hum", b - a, clip.rate, np.random.default_rng(0))
    result = transcribe(bundle(), torch.from_numpy(samples))
    words = [w for s in result.segments for w in s.words]
    inside = [w.text for w in words if gap["start"] + 0.3 < (w.start_ms + w.end_ms) / 2000 < gap["end"] - 0.3]
    assert not inside, result.segments
    errors, n = word_errors(" ".join(texts), result.text)
    assert errors / n <= 0.2, result.text


def test_multi_minute_audio_has_monotonic_timestamps_and_no_loops():
    paths = [librivox_path(c) for c in ARCTIC_IDS] * 5  # ~2.5 minutes with 1 s gaps
    samples, reference = concatenated(paths, gap_seconds=1.0)
    duration = samples.shape[0] / 16000
    assert duration > 120
    result = transcribe(bundle(), samples)
    assert len(result.segments) >= 10
    previous_end = 0.0
    for s in result.segments:
        assert previous_end <= s.start <= s.end <= duration
        previous_end = s.end
        assert repeated_tail(s.tokens) == 0
    # the last sentence is transcribed near the end of the audio
    assert result.segments[-1].end > duration - 10
    errors, words = word_errors(reference, result.text)
    assert errors / words <= 0.2, f"WER {errors / words:.1%}"
    assert len(normalize(result.text)) <= 1.2 * words  # no runaway repetition


def test_repeated_tail_detects_loops_not_short_repeats():
    assert repeated_tail([1, 2, 3, 4]) == 0
    assert repeated_tail([9, 5, 5]) == 0  # "bye bye"
    assert repeated_tail([9, 5, 5, 5, 5, 5]) == 4
    assert repeated_tail([7, 1, 2, 1, 2, 1, 2]) == 4
    assert repeated_tail([1, 2, 1, 2]) == 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_transcribe_json_and_bad_file(tmp_path):
    # a stereo 44.1 kHz copy of a recording decodes to the same words
    up = AF.resample(audio(CARDS / "003.wav"), 16000, 44100).numpy()
    resampled = tmp_path / "cards.flac"
    soundfile.write(resampled, np.stack([up, up], axis=1), 44100)
    out = run_cli("transcribe", "--json", str(resampled))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert normalize(data["text"]) == ["seven", "of", "clubs"]
    assert data["segments"][0]["end"] <= data["duration"] + 1e-6

    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"definitely not audio")
    out = run_cli("transcribe", str(bad))
    assert out.returncode == 1
    assert "cannot read this audio" in out.stderr

    out = run_cli("transcribe", "--model", str(tmp_path / "missing"), str(resampled))
    assert out.returncode == 2
    assert "does not exist" in out.stderr


def test_a_decode_that_copies_a_prompts_sentence_is_done_again_without_it(monkeypatch):
    """A window whose decode opens with one of the prompt's sentences, word for word (its
    last, or one before it), or with its first five words, is decoded again without the
    prompt (the decoder read the text before the window instead of the window); other
    decodes, and short repeats, stand."""
    from engine.model import transcribe as transcribe_module
    from engine.model.decoding import DecodingOptions, copies_prompt, decode
    from tests.test_model import window_mel

    b = bundle()
    model, tokenizer, ts = b.model, b.tokenizer, b.tokenizer.timestamp_begin
    features = {c: model.encoder(window_mel(c).to(model.device, model.dtype)) for c in ("0870", "0880")}
    said = {c: decode(model, tokenizer, f, DecodingOptions(), b.suppress).tokens for c, f in features.items()}
    prompt = said["0870"]  # "<|0.00|> And Mr. John Dashwood ... for them.<|7.00|>" in Whisper's form
    assert prompt[0] >= ts and prompt[-1] >= ts and len(tokenizer.decode(prompt).split()) > 10
    assert copies_prompt(tokenizer, said["0870"], said["0880"] + prompt)
    assert copies_prompt(tokenizer, said["0870"], prompt + said["0880"])  # an earlier sentence
    for n, copied in ((5, True), (4, False)):  # its opening words, then the decoder's own
        own = tokenizer_words(tokenizer, said["0880"], 4)
        opening = [ts, *tokenizer_words(tokenizer, said["0870"], n), *own, ts + 50]
        assert copies_prompt(tokenizer, opening, prompt + said["0880"]) == copied
    assert not copies_prompt(tokenizer, said["0880"], prompt)
    assert not copies_prompt(tokenizer, said["0870"], [])
    short = [ts, *tokenizer_words(tokenizer, said["0880"], 2), ts + 50]
    assert not copies_prompt(tokenizer, short, short)  # "He was" twice is no copy

    prompts = []

    def copying(model_, tokenizer_, features_, options, suppress, cross=None):
        prompts.append(list(options.prompt))
        if options.prompt:  # as the decoder that read the prompt instead of the audio
            return decode(model_, tokenizer_, features["0870"], DecodingOptions(), suppress)
        return decode(model_, tokenizer_, features_, options, suppress, cross)

    monkeypatch.setattr(transcribe_module, "decode_batch", per_row(copying))
    result = transcribe_module.decode_with_fallback(b, features["0880"], prompt, 3.0)
    assert prompts == [prompt, []]
    assert result.tokens == said["0880"]


def spelled(vocab: dict[str, int], text: str) -> list[int]:
    """`text` as tokens, each piece the longest the vocabulary (each text token's text -> the
    token) spells: a test's own encoder, the engine only decodes."""
    tokens, at = [], 0
    while at < len(text):
        end = max(e for e in range(at + 1, len(text) + 1) if text[at:e] in vocab)
        tokens.append(vocab[text[at:end]])
        at = end
    return tokens


def test_a_short_sentence_the_prompt_opens_its_segments_with_is_a_copy_where_one_goes_on_after_it():
    """A segment that opens with a short sentence that opens one of the prompt's segments,
    and goes on after it, copies the prompt's habit (read once at a reverberant onset, "M."
    opened every later segment); a title ends no sentence, and a short sentence read alone,
    or another one, is no copy."""
    from engine.model.decoding import copies_prompt

    tokenizer = bundle().tokenizer
    ts = tokenizer.timestamp_begin
    vocab = {tokenizer.decode([i]): i for i in range(tokenizer.eot)}

    def segments(*texts: str) -> list[int]:
        out = [ts]
        for k, text in enumerate(texts, 1):
            out += spelled(vocab, text) + [ts + 50 * k]
        return out

    prompt = segments(" M. Shaped below, put it on a tray.", " Let it cool before you cut it.")
    assert tokenizer.decode(prompt[1:-1]).startswith(" M. Shaped below")
    assert copies_prompt(tokenizer, segments(" M. My grandmother spent every afternoon."), prompt)
    assert copies_prompt(tokenizer, segments(" The morning train left the station.",
                                             " M. Mr. John Dashwood had leisure."), prompt)  # any segment
    assert not copies_prompt(tokenizer, segments(" The morning train left the station."), prompt)
    assert not copies_prompt(tokenizer, segments(" M.", " The morning train left."), prompt)  # alone
    assert not copies_prompt(tokenizer, segments(" Yes. The morning train left."), prompt)
    titled = segments(" Mr. Palmer came in late.")
    assert not copies_prompt(tokenizer, segments(" Mr. John Dashwood had leisure."), titled)
    assert copies_prompt(tokenizer, segments(" Yes. Mr. John Dashwood had leisure."),
                         segments(" Yes. Mr. Palmer came in late."))


def per_row(decode_one):
    """A `decode_batch` that decodes each row alone with `decode_one` (model, tokenizer,
    features, options, suppress, cross), as a stand-in decoder reads it. (Cross keys of
    batch 1 are every row's.)"""
    def batch(model, tokenizer, features, options, suppress, stop=None, cross=None):
        def row(i: int) -> list | None:
            if not cross:
                return None
            return [(k[i : i + 1], v[i : i + 1]) if k.shape[0] > 1 else (k, v) for k, v in cross]

        return [decode_one(model, tokenizer, features[i : i + 1], o, suppress, row(i))
                for i, o in enumerate(options)]
    return batch


def tokenizer_words(tokenizer, tokens: list[int], n: int) -> list[int]:
    """The text tokens of the first `n` words of a decode."""
    text = [t for t in tokens if t < tokenizer.timestamp_begin]
    for k in range(1, len(text) + 1):
        if len(tokenizer.decode(text[:k]).split()) > n:
            return text[: k - 1]
    return text


def every_temperature_failing(monkeypatch, changes: dict):
    """Decodes of a 3 s window of speech, each 3 lower in mean log-probability (every
    temperature fails), those of the temperatures in `changes` changed so -> (bundle,
    features, the decodes tried, the decode function patched in)."""
    import dataclasses

    from engine.model import transcribe as transcribe_module
    from engine.model.decoding import decode
    from tests.test_model import window_mel

    b = bundle()
    features = b.model.encoder(window_mel("0880").to(b.model.device, b.model.dtype))
    tried = []

    def unsure(model_, tokenizer_, features_, options, suppress, cross=None):
        result = decode(model_, tokenizer_, features_, options, suppress, cross)
        result = dataclasses.replace(result, avg_logprob=result.avg_logprob - 3.0)
        result = changes.get(options.temperature, lambda r: r)(result)
        tried.append(result)
        return result

    monkeypatch.setattr(transcribe_module, "decode_batch", per_row(unsure))
    return b, features, tried, unsure


def test_when_every_temperature_fails_the_likeliest_decode_that_is_no_runaway_is_kept(monkeypatch):
    """Hard audio fails the log-probability check at every temperature: the decode kept is
    the likeliest that is no runaway (not the hottest, sounds spelled as made-up words; one
    stopped at a repeat competes, its copies dropped), marked with the last temperature so
    that its text is no prompt; a budget overrun is kept only if all overran."""
    import dataclasses

    from engine.model import transcribe as transcribe_module

    b, features, tried, unsure = every_temperature_failing(monkeypatch, {
        0.4: lambda r: dataclasses.replace(r, avg_logprob=-1.01, stop="budget"),  # likeliest: a runaway
        0.6: lambda r: dataclasses.replace(r, avg_logprob=-1.5, stop="repetition"),  # then this one
    })
    result = transcribe_module.decode_with_fallback(b, features, [], 3.0)
    assert [r.temperature for r in tried] == list(transcribe_module.TEMPERATURES)
    assert all(r.needs_fallback for r in tried)
    assert result.stop == "repetition" and result.avg_logprob == -1.5
    assert max(r.avg_logprob for r in tried if r.stop == "eot") < -1.5
    assert result.temperature == transcribe_module.TEMPERATURES[-1]
    assert len({tuple(r.tokens) for r in tried}) > 1  # the choice was among different texts

    whole = [r for r in tried if r.stop == "eot"]
    tried.clear()
    earlier = dataclasses.replace(whole[0], avg_logprob=-1.02)  # the batch's greedy decode
    result = transcribe_module.decode_with_fallback(b, features, [], 3.0, transcribe_module.TEMPERATURES[1:],
                                                    earlier=earlier)
    assert result.tokens == earlier.tokens and result.avg_logprob == -1.02

    monkeypatch.setattr(transcribe_module, "decode_batch", per_row(lambda *a, **k: dataclasses.replace(
        unsure(*a, **k), stop="budget")))
    tried.clear()
    result = transcribe_module.decode_with_fallback(b, features, [], 3.0)
    assert result.avg_logprob == max(r.avg_logprob for r in tried)  # all loop: the likeliest


def test_when_every_temperature_fails_a_loop_that_began_at_once_is_not_kept(monkeypatch):
    """A decode that stopped at a repeat after a word or two ("No, no" over seconds of
    speech) reads nothing of the window, however likely its few tokens: it is left out of the
    choice; one that read most of the window before its repeat still competes."""
    import dataclasses

    from engine.model import transcribe as transcribe_module

    b, features, tried, _ = every_temperature_failing(monkeypatch, {
        # the likeliest of all: one word, then a repeat
        0.4: lambda r: dataclasses.replace(r, text=" " + r.text.split()[0], avg_logprob=-1.01,
                                           stop="repetition"),
        # read the window, then repeated itself: the likeliest of the rest
        0.6: lambda r: dataclasses.replace(r, avg_logprob=-1.5, stop="repetition"),
    })
    result = transcribe_module.decode_with_fallback(b, features, [], 3.0)
    assert all(r.needs_fallback for r in tried)
    loop = next(r for r in tried if r.temperature == 0.4)
    assert len(loop.text.split()) == 1 and len(tried[0].text.split()) >= 4  # (the window holds a sentence)
    assert result.stop == "repetition" and result.avg_logprob == -1.5
    assert result.temperature == transcribe_module.TEMPERATURES[-1]


def test_the_hotter_temperatures_are_decoded_in_one_batch_as_each_reads_alone(monkeypatch):
    """After greedy and 0.2 fail, the four hotter temperatures are one batch: each row
    reads as that temperature's decode alone (its own sampling, its own prompt: none over
    0.5), the first that passes is kept, and a window that fails them all costs three
    decoder batches, not six decodes in a row."""
    import dataclasses

    from engine.model import transcribe as transcribe_module
    from engine.model.decoding import DecodingOptions, decode, decode_batch
    from tests.test_model import window_mel

    b = bundle()
    before, features = (b.model.encoder(window_mel(c).to(b.model.device, b.model.dtype))
                        for c in ("0870", "0880"))
    cross = b.model.decoder.cross_kv(features)
    prompt = decode(b.model, b.tokenizer, before, DecodingOptions(), b.suppress).tokens
    hot = transcribe_module.TEMPERATURES[1:]
    ladder, _ = transcribe_module._decode_ladder(b, features, cross, prompt, hot, 3.0, True)
    alone = [decode(b.model, b.tokenizer, features,
                    DecodingOptions(prompt=prompt if t <= 0.5 else [], temperature=t, audio_seconds=3.0,
                                    speech_heard=True), b.suppress, cross) for t in hot]
    assert [r.tokens for r in ladder] == [r.tokens for r in alone]
    assert len({tuple(r.tokens) for r in ladder}) > 1  # the rows sampled apart

    batches = []

    def failing(model, tokenizer, features_, options, suppress, stop=None, cross=None):
        batches.append([o.temperature for o in options])
        return [dataclasses.replace(r, avg_logprob=-2.0)
                for r in decode_batch(model, tokenizer, features_, options, suppress, stop, cross)]

    monkeypatch.setattr(transcribe_module, "decode_batch", failing)
    result = transcribe_module.decode_with_fallback(b, features, [], 3.0)
    assert batches == [[0.0], [hot[0]], list(hot[1:])] and result.temperature == hot[-1]


def whole_window_edited(monkeypatch, clips: tuple[str, ...], edit) -> tuple[np.ndarray, str]:
    """The LibriVox `clips` joined with 1 s gaps -> (samples, reference), with offline
    `transcribe`'s decode of the window of the whole file passed through `edit(result,
    tokenizer)`, as a decoder that read it so."""
    from engine.model import transcribe as transcribe_module

    samples, reference = concatenated([librivox_path(c) for c in clips], gap_seconds=1.0)
    whole_seconds = samples.shape[0] / 16000
    real = transcribe_module.decode_with_fallback

    def edited(bundle_, features, prompt, audio_seconds, *args, **kwargs):
        result = real(bundle_, features, prompt, audio_seconds, *args, **kwargs)
        return result if audio_seconds < whole_seconds - 1 else edit(result, bundle_.tokenizer)

    monkeypatch.setattr(transcribe_module, "decode_with_fallback", edited)
    return samples, reference


def test_speech_a_window_skips_is_decoded_again_up_to_where_the_skip_ends(monkeypatch):
    """Whisper's decoder may jump over unclear speech to clearer speech later in the window
    (or stop early), and its seek passes over what it skipped. The VAD hears speech no word
    covers: the window is decoded again with its audio cut where the skipped speech ends."""
    import dataclasses

    jumped = []

    def jumping(result, tokenizer):
        # the window of the whole file: its first two sentences left out, as a decoder that jumped
        tokens, ts = result.tokens, tokenizer.timestamp_begin
        pairs = [i for i in range(1, len(tokens)) if tokens[i] >= ts and tokens[i - 1] >= ts]
        jumped.append(tokenizer.decode([t for t in tokens[: pairs[1]] if t < ts]))
        return dataclasses.replace(result, tokens=tokens[pairs[1] :])

    samples, reference = whole_window_edited(monkeypatch, ("0880", "0890", "0920", "0930"), jumping)
    result = transcribe(bundle(), samples)
    assert len(jumped) == 1 and normalize(jumped[0])[:3] == ["he", "was", "not"]
    assert normalize(result.text)[:3] == ["he", "was", "not"]
    errors, words = word_errors(reference, result.text)
    assert errors / words <= 0.15, f"WER {errors / words:.1%}: {result.text}"
    assert result.segments[0].words[0].start_ms < 1000
    assert all(a.end <= b.start for a, b in zip(result.segments, result.segments[1:], strict=False))


def test_the_next_window_starts_after_the_last_word_kept_not_inside_it(monkeypatch):
    """A window's last segment may close with a timestamp inside its own words (real-ivr: "...
    sample sounds and configuration for the<|28.00|>", the words aligned 2 s past it), and a
    seek to that timestamp reads those words again. As Whisper does with word timestamps, the
    next window starts where the last word kept ends."""
    import dataclasses

    stamped = []

    def early(result, tokenizer):
        tokens, ts = result.tokens, tokenizer.timestamp_begin
        if stamped or not (tokens[-1] >= ts > tokens[-2]):
            return result
        # the last segment closed halfway through it, then a segment begun and cut off
        opening = max(i for i in range(len(tokens) - 1) if tokens[i] >= ts and tokens[i + 1] < ts)
        middle = (tokens[opening] + tokens[-1]) // 2
        stamped.append((middle - ts) * 0.02)
        return dataclasses.replace(result, tokens=[*tokens[:-1], middle, middle])

    samples, reference = whole_window_edited(monkeypatch, ("0890", "0920", "0930"), early)
    result = transcribe(bundle(), samples)
    assert len(stamped) == 1
    words = normalize(result.text)
    assert words.count("himself") == 1, result.text
    errors, count = word_errors(reference, result.text)
    assert errors / count <= 0.15, f"WER {errors / count:.1%}: {result.text}"
    starts = [w.start_ms for s in result.segments for w in s.words]
    assert starts == sorted(starts)
