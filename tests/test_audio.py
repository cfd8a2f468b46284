import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from audio import AudioError, load_audio, pcm_to_float, resample
from audio.container import RawFormat, decode, iter_decode, probe
from audio.frames import CONTEXT_AFTER, ITEM_SAMPLES, AudioFramer
from audio.io import float_to_pcm16
from audio.mel import N_SAMPLES, log_mel_spectrogram, mel_filters
from audio.stream import StreamResampler
from audio.vad import SpeechDetector, detect, level_db
from tests.helpers import (
    audio,
    encode,
    floors_of,
    gain_floors_of,
    heard_items,
    librivox_path,
    stream_turns,
    with_click,
)


def test_mel_filters_match_openai_whisper():
    whisper_audio = pytest.importorskip("whisper.audio")
    theirs = whisper_audio.mel_filters("cpu", 80)
    assert torch.allclose(mel_filters(80), theirs, atol=1e-6)


def test_log_mel_matches_openai_whisper_on_real_speech():
    whisper_audio = pytest.importorskip("whisper.audio")
    samples = audio(librivox_path("0870"))
    ours = log_mel_spectrogram(samples, padding=N_SAMPLES)
    theirs = whisper_audio.log_mel_spectrogram(samples, padding=N_SAMPLES)
    assert ours.shape == theirs.shape == (80, (samples.shape[0] + N_SAMPLES) // 160)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_load_audio_downmixes_and_resamples_any_rate(tmp_path):
    rate, seconds = 44100, 1.5
    t = np.arange(int(rate * seconds)) / rate
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([tone, tone], axis=1).astype(np.float32)
    for ext in ("wav", "flac", "ogg"):
        path = tmp_path / f"tone.{ext}"
        soundfile.write(path, stereo, rate)
        out = load_audio(path)
        assert out.dtype == torch.float32 and out.ndim == 1
        assert abs(out.shape[0] - 24000) <= 1
        # a 440 Hz tone stays a 440 Hz tone after resampling
        spectrum = torch.fft.rfft(out[:16000]).abs()
        assert abs(int(spectrum.argmax()) - 440) <= 2


def test_resample_8k_keeps_length_and_band():
    x = torch.sin(2 * np.pi * 1000 * torch.arange(8000) / 8000)
    y = resample(x, 8000)
    assert y.shape == (16000,)
    assert abs(int(torch.fft.rfft(y).abs().argmax()) - 1000) <= 1


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(AudioError, match="no such file"):
        load_audio(tmp_path / "missing.wav")
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF\x00\x00garbage" * 10)
    with pytest.raises(AudioError, match="cannot read this audio"):
        load_audio(junk)
    empty = tmp_path / "empty.wav"
    soundfile.write(empty, np.zeros((0, 1), dtype=np.float32), 16000)
    with pytest.raises(AudioError, match="no audio samples"):
        load_audio(empty)


def test_pcm16_bytes_to_float():
    samples = np.array([0, 16384, -32768, 32767], dtype="<i2")
    out = pcm_to_float(samples.tobytes())
    assert out.tolist() == pytest.approx([0.0, 0.5, -1.0, 32767 / 32768])


def test_pcm16_samples_come_back_from_float_unchanged():
    # a client or the spool that writes PCM16 again must not take a step off every sample:
    # speech 50 dB down is a few steps high, and truncated it loses its quiet half
    every = np.arange(-32768, 32768, dtype=np.int64).astype("<i2")
    again = np.frombuffer(float_to_pcm16(pcm_to_float(every.tobytes())), dtype="<i2")
    assert np.array_equal(again, every)
    steps = np.array([0.4, -0.4, 0.6, -0.6, 2.5, 1e9, -1e9]) / 32768
    assert np.frombuffer(float_to_pcm16(steps), dtype="<i2").tolist() == [0, 0, 1, -1, 2, 32767, -32768]


def test_float32_frames_are_zero_copy():
    buffer = bytearray(np.arange(8, dtype="<f4").tobytes())
    out = pcm_to_float(buffer, "float32")
    view = np.frombuffer(buffer, dtype="<f4")
    assert out.data_ptr() == view.ctypes.data  # same memory, no copy
    assert out.tolist() == list(range(8))


@pytest.mark.parametrize("data,encoding,message", [
    (b"\x00\x01\x02", "pcm16", "multiple of 2"),
    (b"\x00" * 6, "float32", "multiple of 4"),
    (np.array([np.nan, 1.0], dtype="<f4").tobytes(), "float32", "NaN"),
    (b"\x00\x00", "opus", "unknown encoding"),
])
def test_bad_pcm_frames(data, encoding, message):
    with pytest.raises(AudioError, match=message):
        pcm_to_float(data, encoding)


def test_g711_expands_as_the_standard_and_channels_are_mixed_down():
    audioop = pytest.importorskip("audioop")  # the standard library's G.711 (gone in Python 3.13)
    codes = bytes(range(256))
    for law, expand in (("mulaw", audioop.ulaw2lin), ("alaw", audioop.alaw2lin)):
        reference = (np.frombuffer(expand(codes, 2), "<i2") / 32768).astype(np.float32)
        assert np.array_equal(pcm_to_float(codes, law).numpy(), reference), law
    stereo = np.array([[1000, 3000], [-2000, 0]], "<i2").tobytes()
    assert pcm_to_float(stereo, "pcm16", channels=2).tolist() == [2000 / 32768, -1000 / 32768]
    with pytest.raises(AudioError, match="multiple of 4"):
        pcm_to_float(b"\x00" * 6, "pcm16", channels=2)


@pytest.mark.parametrize("rate", [8000, 22050, 24000, 44100, 48000])
def test_stream_resampler_equals_whole_signal_resampling(rate):
    rng = np.random.default_rng(rate)
    signal = rng.standard_normal(rate * 2 + 17).astype(np.float32) * 0.1  # 2 s, odd length
    whole = resample(torch.from_numpy(signal), rate).numpy()
    resampler = StreamResampler(rate)
    pieces, i = [], 0
    while i < signal.size:  # network-like frames of random sizes, some empty
        n = int(rng.integers(0, rate // 10))
        pieces.append(resampler.push(signal[i : i + n]))
        i += n
    pieces.append(resampler.flush())
    streamed = np.concatenate(pieces)
    assert streamed.shape == whole.shape
    assert np.abs(streamed - whole).max() < 1e-5


@pytest.mark.parametrize("rate, max_held_ms", [(24000, 1), (48000, 2), (44100, 40), (8000, 1)])
def test_stream_resampler_holds_back_little(rate, max_held_ms):
    resampler = StreamResampler(rate)
    out = resampler.push(np.zeros(rate, dtype=np.float32))  # 1 s
    assert 16000 - 16 * max_held_ms <= out.size < 16000


def test_stream_resampler_rejects_absurd_rates():
    for rate in (0, 100, 7999, 48001, 10**9):
        with pytest.raises(AudioError, match="out of range"):
            StreamResampler(rate)


def test_framer_flush_then_more_audio_stays_aligned():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(3000).astype(np.float32)
    b = rng.standard_normal(5000).astype(np.float32)
    framer = AudioFramer()
    contexts = framer.push(a) + framer.flush() + framer.push(b) + framer.flush()
    pad = -a.size % ITEM_SAMPLES
    assert framer.num_padded == pad + (-b.size % ITEM_SAMPLES)
    reference = AudioFramer()  # the same timeline with the padding as real silence
    expected = reference.push(np.concatenate([a, np.zeros(pad, np.float32), b])) + reference.flush()
    assert len(contexts) == len(expected)
    flushed = -(-a.size // ITEM_SAMPLES) - 1  # a's last item: flush could not wait for b
    for i, (got, want) in enumerate(zip(contexts, expected, strict=True)):
        if i == flushed:  # its look-ahead is silence instead of b's first samples
            np.testing.assert_array_equal(got[-CONTEXT_AFTER:], 0)
            got, want = got[:-CONTEXT_AFTER], want[:-CONTEXT_AFTER]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("db", [0, -30, -50, -60])
def test_vad_finds_speech_turns_in_real_recordings_at_any_level(db):
    """Down to speech at about -80 dBFS RMS (Silero alone hears two thirds of its chunks 50
    dB down and none 60 dB down; the detector's gain brings them up)."""
    first, second = audio(librivox_path("0870")), audio(librivox_path("0880"))
    gap = torch.zeros(16000)
    stream = (torch.cat([gap, first, gap, second, gap]) * 10 ** (db / 20)).numpy()
    events = stream_turns(stream, silence_ms=500)
    kinds = [kind for kind, _ in events]
    assert kinds == ["speech_started", "speech_stopped"] * 2
    start_2 = (16000 + first.numel() + 16000) * 1000 // 16000
    assert 1000 <= events[0][1] < 1600
    assert start_2 <= events[2][1] < start_2 + 600
    assert events[1][1] < start_2 - 500  # stopped within the gap, before the next turn


def test_loading_the_vad_leaves_torchs_threads_alone():
    """silero-vad's own module sets torch's threads to 1 when imported: loading its weights
    must not, or the model in this process (offline transcribe, tests, a thread worker) would
    run on one core. A fresh interpreter, where the VAD was not loaded yet."""
    code = ("import torch; torch.set_num_threads(2); from audio.vad import speech_model; "
            "speech_model(); print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.split() == ["2"]


@pytest.mark.parametrize("kind", ["white", "pink"])
def test_the_vad_hears_no_speech_in_noise(kind):
    """Steady noise louder than quiet speech is not speech (an energy gate would call it so)."""
    rng = np.random.default_rng(0)
    noise = rng.standard_normal(16000 * 10)
    if kind == "pink":  # 1/f power: shape white noise in the frequency domain
        spectrum = np.fft.rfft(noise)
        spectrum[1:] /= np.sqrt(np.arange(1, spectrum.size))
        noise = np.fft.irfft(spectrum, noise.size)
    noise = (noise / np.sqrt(np.mean(noise**2)) * 10 ** (-40 / 20)).astype(np.float32)  # -40 dBFS
    probs = SpeechDetector().push(noise)
    assert probs.size == noise.size // 512 and float(np.mean(probs >= 0.5)) < 0.02
    quiet = SpeechDetector().push(noise * 10 ** (-30 / 20))  # -70 dBFS: the gain brings it up
    assert float(np.mean(quiet >= 0.5)) < 0.02


def test_streams_detected_in_one_batch_get_their_own_probabilities():
    """`detect` runs several streams' chunks through one batched call; each stream keeps its
    own state, so its probabilities are those it gets alone, however its audio is cut."""
    clips = [audio(librivox_path(c)).numpy() for c in ("0870", "0880", "0890")]
    alone = [SpeechDetector().push(c) for c in clips]
    detectors = [SpeechDetector() for _ in clips]
    got: list[list[np.ndarray]] = [[] for _ in clips]
    rng = np.random.default_rng(0)
    cuts = [0, 0, 0]
    while any(cut < c.size for cut, c in zip(cuts, clips, strict=True)):
        pieces = []
        for i, c in enumerate(clips):  # uneven pieces, some streams with nothing new
            n = int(rng.integers(0, 4000))
            pieces.append(c[cuts[i] : cuts[i] + n])
            cuts[i] += n
        for i, p in enumerate(detect(detectors, pieces)):
            got[i].append(p)
    for i, want in enumerate(alone):
        np.testing.assert_allclose(np.concatenate(got[i]), want, atol=1e-5)
        assert detectors[i].num_chunks == want.size == clips[i].size // 512
    assert max(float(p.max()) for p in alone) > 0.9  # there is speech to find


def test_quiet_speech_is_brought_up_to_a_usual_level_for_the_model():
    """Whisper reads quiet speech worse than the same speech at a usual level (its features
    are absolute log power). An item whose floor counts from a level under `FAINT_LEVEL` (15
    dB under a usual one) is brought up by the gain that puts that level near `USUAL_LEVEL`
    (never over it, none before the first speech), and its floor is counted in that audio:
    the same speech 20 dB and 30 dB quieter gives the model the features it has at its usual
    level, where a fixed floor clipped most of its range away (brought only 10 dB under it,
    some voices read up to 6 points worse). Speech 5 dB under that level is left as it came,
    and speech 12 dB under it is brought up no further than `QUIET_LEVEL`. The gain rises 2.5
    dB an item at most, and with one voice it never rises once it has risen."""
    from audio.frames import STREAM_LOG_FLOOR, USUAL_LEVEL, amplitude
    from audio.mel import log_mel_power, loudest_levels

    samples = audio(librivox_path("0870")).numpy()
    level = float(loudest_levels(log_mel_power(torch.from_numpy(samples))))
    # its loudest 0.4 dB under USUAL_LEVEL: on a gain step's edge (20 dB down needing 2.0
    # exactly), the last bit of the level's float decides the step, and hosts differ in it
    samples = samples * amplitude(USUAL_LEVEL - 0.04 - level)
    features, gains = {}, {}
    for db in (0, -5, -12, -20, -30):
        x = (samples * 10 ** (db / 20)).astype(np.float32)
        gains[db], floors = gain_floors_of(x)
        assert floors.max() <= STREAM_LOG_FLOOR
        contexts, _ = heard_items(x)
        log_spec = log_mel_power(torch.from_numpy(np.stack(contexts)), center=False)  # (n, 80, 11)
        features[db] = torch.maximum(log_spec, torch.tensor(floors[: len(contexts)])[:, None, None])
    raw = log_mel_power(torch.from_numpy(np.stack(AudioFramer().push(x))), center=False)  # -30 dB as it came
    clipped_by_fixed_floor = (raw <= STREAM_LOG_FLOOR).float().mean().item()
    heard = int(np.argmax(gains[-30]))  # the gain has risen (`GAIN_ATTACK` an item)
    assert heard < 20 and all(np.all(np.diff(g[int(np.argmax(g)):]) <= 0) for g in gains.values())
    speaking = (gains[-20] == 2.0) & (np.arange(gains[0].size) >= heard)  # its loudest level heard
    assert speaking.mean() > 0.75 and speaking[-10:].all()
    assert not gains[0][speaking].any() and not gains[-5][speaking].any() and not gains[-12][speaking].any()
    for db in (-20, -30):
        assert np.all(gains[db][speaking] == -db / 10)
        whole = torch.from_numpy(speaking[: features[db].shape[0]])  # (the framer's whole items)
        assert (features[db][whole] - features[0][whole]).abs().max().item() < 1e-3
    assert clipped_by_fixed_floor > 0.5


@pytest.mark.parametrize("louder", [0.5, 1.5])  # 5 and 15 dB over a usual level, clipped
def test_loud_speech_is_clamped_where_whisper_clamps_it(louder):
    """Whisper clamps the log-mel 80 dB under its input's loudest bin. Streaming's floor was
    held at -7, where speech at a usual level puts it: louder speech (a hot microphone, the
    corpus's program 6 to 30 dB up, clipped or limited) showed the model up to 15 dB more of
    its quiet range than Whisper does, and read worse on all five such clips
    (docs/evaluation.md, Loud speech). It counts from its own level, as offline's floor
    (`item_gain_floors`, unrounded) does, within a step's rounding."""
    from audio.frames import FLOOR_STEP, STREAM_LOG_FLOOR, USUAL_LEVEL, amplitude, item_gain_floors
    from audio.mel import DYNAMIC_RANGE, log_mel_power, loudest_levels
    from engine.config import EngineConfig

    samples = audio(librivox_path("0870")).numpy()
    level = float(loudest_levels(log_mel_power(torch.from_numpy(samples))))
    loud = np.clip(samples * amplitude(USUAL_LEVEL + louder - level), -1, 1).astype(np.float32)
    heard = float(loudest_levels(log_mel_power(torch.from_numpy(loud))))
    probs, threshold = SpeechDetector().push(loud), EngineConfig.vad_threshold
    gains, floors = item_gain_floors(loud, probs, threshold)
    _, whisper = item_gain_floors(loud, probs, threshold, bounded=False)
    assert not gains.any() and heard > USUAL_LEVEL + louder / 2
    assert floors.max() >= heard - DYNAMIC_RANGE - FLOOR_STEP / 2 > STREAM_LOG_FLOOR
    assert np.abs(floors - whisper).max() <= FLOOR_STEP / 2 + 1e-6


def test_a_quiet_sessions_first_words_are_brought_up_with_the_rest():
    """A session's first utterance is brought up from its first item of speech: heard fading
    in (its first 480 ms as it came, then 2.5 dB more an item), Whisper lost a quiet
    session's first words. A later utterance, after speech heard at the gain before, still
    waits for its level before the gain rises."""
    from audio.frames import USUAL_LEVEL, amplitude
    from audio.mel import log_mel_power, loudest_levels
    from audio.vad import item_speech
    from engine.config import EngineConfig

    clip = audio(librivox_path("0870")).numpy()
    level = float(loudest_levels(log_mel_power(torch.from_numpy(clip))))
    quiet = (clip * amplitude(USUAL_LEVEL - level - 3.5)).astype(np.float32)  # 35 dB under
    loud = clip * amplitude(USUAL_LEVEL - level)
    pause = np.zeros(16000, np.float32)
    for session in (quiet, np.concatenate([loud, pause, quiet])):
        gains, _ = gain_floors_of(session)
        speech = item_speech(SpeechDetector().push(session), gains.size, ITEM_SAMPLES,
                             EngineConfig.vad_threshold)
        onset = speech.index(True)
        assert np.all(gains[:onset] == 0)
        if session is quiet:  # every item of its speech heard at least at the gain it ends with
            assert gains[-1] >= 2.0 and np.all(gains[onset:] >= gains[-1])
        else:  # the quiet utterance after the loud one: held, then rising an item at a time
            at = loud.size // ITEM_SAMPLES + speech[loud.size // ITEM_SAMPLES:].index(True)
            assert gains[at] == 0 and gains[-1] >= 1.0
            assert np.all(np.diff(gains[at:at + 12]) <= 0.25)


@pytest.mark.parametrize("db", [0, -30])
def test_silence_before_the_first_speech_is_clamped_as_beside_the_speech(db):
    """Whisper clamps its window at the loudest bin less 80 dB, so a file's leading digital
    silence shows at the floor of the speech after it. The floor is causal: counted from the
    silence itself (nothing louder heard yet), the silence showed 30 dB darker (-10, against
    -7 beside the speech), which Whisper never saw beside speech, and a long file's first
    window, and the prompts after it, read otherwise (docs/evaluation.md, The floor before
    the first speech). Before the first speech the floor counts from at least the level
    speech is brought up to; streaming's floors (bounded) and offline's (not) alike."""
    from audio.frames import item_gain_floors
    from audio.vad import item_speech
    from engine.config import EngineConfig

    silence = -10.0  # digital silence's log10 mel power (the 1e-10 clamp)
    clip = audio(librivox_path("0870")).numpy() * np.float32(10 ** (db / 20))
    session = np.concatenate([np.zeros(16000, np.float32), clip])
    probs = SpeechDetector().push(session)
    for bounded in (True, False):
        gains, floors = item_gain_floors(session, probs, EngineConfig.vad_threshold, bounded=bounded)
        speech = item_speech(probs, floors.size, ITEM_SAMPLES, EngineConfig.vad_threshold)
        onset = speech.index(True)
        assert 12 <= onset <= 25  # (1 s of silence: 12.5 items, then the clip's own lead)
        lead, spoken = floors[: onset - 1], float(np.median(floors[onset:]))
        assert np.all(lead >= spoken - 1.5), (bounded, lead, spoken)  # within 15 dB
        assert np.all(lead <= spoken + 0.25) and np.all(gains[:onset] == 0)
        assert lead.min() > silence + 1.0  # the silence shows at the floor, not at its own level


@pytest.mark.parametrize("sound", ["click", "offset"])
def test_a_click_or_an_offset_sets_neither_the_log_mel_floor_nor_the_vad_gain(sound):
    """Quiet speech (about -74 dBFS) after one click (a microphone's bump: 6 ms near full
    scale), or on a DC offset of 2% of full scale: counted as the loudest sound, either set
    the log-mel floor over the speech (streaming for the whole session, offline for the whole
    file) and the VAD's gain under it, and the speech went unheard. The floor counts from a
    level held for 40 ms over 75 Hz, the gain from a chunk level held for 96 ms, each chunk
    less its mean: the floors are those of the speech alone (its loudest bin, held), and the
    VAD hears what it hears without them."""
    from audio.mel import log_mel_power, loudest_levels

    speech = audio(librivox_path("0870")).numpy() * 10 ** (-50 / 20)
    plain = np.concatenate([np.zeros(16000), speech]).astype(np.float32)
    disturbed = with_click(speech) if sound == "click" else plain + np.float32(0.02)
    assert np.abs(disturbed).max() > 0.019 > 10 * np.abs(plain).max()

    floors = [floors_of(x) for x in (disturbed, plain)]
    assert (floors[0] == floors[1]).mean() > 0.97 and floors[0].max() == floors[1].max()
    log_spec = log_mel_power(torch.from_numpy(plain))
    assert float(loudest_levels(log_spec)) == float(log_spec.max())  # held: what Whisper counts from

    heard = [SpeechDetector().push(x)[40:] >= 0.5 for x in (disturbed, plain)]  # past the click
    assert heard[1].mean() > 0.5 and (heard[0] == heard[1]).mean() > 0.97


@pytest.mark.parametrize("gap", ["silence", "noise"])
def test_a_quiet_voice_after_a_loud_one_is_heard_as_alone(gap):
    """A talker 50 dB under the one before (a far talker after a near one, a microphone
    turned down): the VAD's gain, set by the loudest level held so far, stayed at none for
    the rest of the session, and the quiet talker went unheard (a corpus clip turned 50 dB
    down after its first minute lost its next 30 s, streaming and offline alike). The gain
    counts from the loudest level of the last second of sound, so the quiet talker is heard
    past its first second as it is alone; silence and steady noise are no sound, and a gap of
    noise after the loud talker is not brought up."""
    loud = audio(librivox_path("0870")).numpy()
    loud = loud[: loud.size // 512 * 512]  # whole chunks: the gap's chunks are its own
    quiet = (audio(librivox_path("0880")).numpy() * 10 ** (-50 / 20)).astype(np.float32)
    if gap == "silence":
        pause = np.zeros(32 * 512, np.float32)
    else:  # a microphone's hiss, 20 s alone, then under the quiet talker
        from scripts.corpus import noise

        hiss = noise("pink", 20 * 16000 + quiet.size, np.random.default_rng(0)) * 10 ** (-90 / 20)
        hiss = hiss.astype(np.float32)
        pause, quiet = hiss[: 20 * 16000], quiet + hiss[20 * 16000 :]
    detector = SpeechDetector()
    detector.push(loud)
    heard = detector.take_chunks(pause).numpy()  # the gap's chunks as the network hears them
    raw = pause.reshape(-1, 512) - pause.reshape(-1, 512).mean(axis=1, keepdims=True)
    assert np.abs(level_db(heard, axis=1) - level_db(raw, axis=1)).max() < 0.01  # no gain
    after = detector.push(quiet)[31:] >= 0.5  # past its first second
    alone = SpeechDetector().push(quiet)[31:] >= 0.5
    assert alone.mean() > 0.5 and after.mean() >= 0.9 * alone.mean()


@pytest.mark.parametrize("fmt, codec, rate, channels", [
    ("flac", "flac", 16000, 1), ("ogg", "libopus", 48000, 2), ("webm", "libopus", 48000, 1),
    ("mp3", "libmp3lame", 44100, 2), ("mp4", "aac", 22050, 1), ("wav", "pcm_s16le", 8000, 1)])
def test_containers_decode_to_the_same_tone(fmt, codec, rate, channels, tmp_path):
    """Any container ffmpeg reads: the length (within a codec frame: AAC's priming is kept
    where the file has no edit list) and the pitch survive; channels are averaged; a path and
    a file object decode alike."""
    tone = 0.5 * torch.sin(2 * np.pi * 440 * torch.arange(32000) / 16000)  # 2 s at 16 kHz
    data = encode(tone, fmt, codec, rate, channels)
    path = tmp_path / f"tone.{fmt}"
    path.write_bytes(data)
    out = load_audio(path)
    assert abs(out.shape[0] - 32000) <= 0.1 * 16000, out.shape
    assert abs(int(torch.fft.rfft(out[4000:20000]).abs().argmax()) - 440) <= 2
    samples, got_rate = decode(io.BytesIO(data))
    assert got_rate == rate and torch.equal(resample(torch.from_numpy(samples), rate), out)


def test_headerless_pcm_limits_and_junk():
    tone = (8000 * np.sin(np.arange(16000) / 5)).astype("<i2")
    stereo = np.stack([tone, tone], axis=1).tobytes()
    samples, rate = decode(io.BytesIO(stereo), raw=RawFormat("pcm16", 8000, channels=2))
    assert rate == 8000 and np.allclose(samples, tone / 32768, atol=1e-6)
    with pytest.raises(AudioError, match="longer than the limit of 1 s"):
        decode(io.BytesIO(stereo), max_seconds=1.0, raw=RawFormat("pcm16", 8000, channels=2))
    pieces = iter_decode(io.BytesIO(tone.tobytes()), raw=RawFormat("pcm16", 16000))
    assert next(pieces)[0].size < tone.size  # lazily, a piece at a time
    for junk in (b"", b"\x00" * 3000, b"RIFF" + b"\xff" * 500):
        with pytest.raises(AudioError):
            probe(io.BytesIO(junk))
