"""Factory helpers shared by the tests: real recordings, their transcripts, the model."""

from __future__ import annotations

import io
import os
import re
from functools import lru_cache
from pathlib import Path

import av
import numpy as np
import torch
import torchaudio.functional as AF

from audio import load_audio

DATA = Path("/usr/share/pocketsphinx/test/data")
# The tests run the model on the CPU unless VOXTIDE_TEST_DEVICE names another (cuda): the
# token-for-token references are CPU float32 runs.
DEVICE = os.environ.get("VOXTIDE_TEST_DEVICE", "cpu")
LIBRIVOX = DATA / "librivox"
CARDS = DATA / "cards"
ARCTIC_IDS = ["0870", "0880", "0890", "0920", "0930"]

torch.set_num_threads(2)


def librivox_path(clip: str) -> Path:
    return LIBRIVOX / f"sense_and_sensibility_01_austen_64kb-{clip}.wav"


@lru_cache(maxsize=1)
def transcripts() -> dict[Path, str]:
    """Recording path -> reference transcript, from the package's transcription files."""
    out = {}
    for folder, name in ((LIBRIVOX, "transcription"), (CARDS, "cards.transcription")):
        for line in (folder / name).read_text().splitlines():
            m = re.match(r"<s>(.*)</s>\s*\((.+)\)", line.strip())
            if m:
                out[folder / f"{m.group(2)}.wav"] = m.group(1).strip()
    return out


@lru_cache(maxsize=8)
def audio(path: Path) -> torch.Tensor:
    return load_audio(path)


@lru_cache(maxsize=1)
def bundle():
    """The model as the server runs it (bf16 parts where the CPU has native bf16; float16
    on CUDA)."""
    from engine.model import load_bundle

    return load_bundle(device=DEVICE)


@lru_cache(maxsize=1)
def exact_bundle():
    """The model all in float32: what the loaders are compared with references on."""
    from engine.model import load_bundle

    exact = load_bundle(device="cpu", bf16=False)
    exact.model.set_projection_dtype(None)
    return exact


def concatenated(paths: list[Path], gap_seconds: float = 1.0) -> tuple[torch.Tensor, str]:
    """Recordings joined by silence -> (audio, joined reference transcript)."""
    gap = torch.zeros(int(16000 * gap_seconds))
    pieces, text = [], []
    for p in paths:
        pieces += [audio(p), gap]
        text.append(transcripts()[p])
    return torch.cat(pieces), " ".join(text)


def speech_onset_ms(samples) -> int:
    """Where a recording's speech starts: its first 10 ms frame within 15 dB of the loudest
    (the librivox recordings open on room noise 20-30 dB under their peak; samples: 16 kHz)."""
    x = torch.as_tensor(samples, dtype=torch.float64)
    frames = x[: x.numel() // 160 * 160].reshape(-1, 160)
    level = 10 * torch.log10(frames.pow(2).mean(dim=1) + 1e-12)
    return int(torch.argmax((level > level.max() - 15).int())) * 10


def fail_decodes(monkeypatch, runner, request_ids: set[str]) -> None:
    """Make the model runner fail the windows of these sessions, as a fault in their decode
    would (the runner in this process: a thread-mode engine)."""
    window_result = runner._window_result

    def failing(window, decoded, starts=None):
        if window.request_id in request_ids:
            raise RuntimeError("injected failure")
        return window_result(window, decoded, starts)

    monkeypatch.setattr(runner, "_window_result", failing)


def encode(samples: torch.Tensor | np.ndarray, fmt: str, codec: str, rate: int = 16000,
           channels: int = 1) -> bytes:
    """16 kHz float samples -> a file of that container and codec (PyAV), at `rate`, the same
    signal in every channel."""
    x = torch.as_tensor(samples, dtype=torch.float32)
    if rate != 16000:
        x = AF.resample(x, 16000, rate)
    planes = np.tile(x.numpy()[None], (channels, 1)).astype(np.float32)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout="mono" if channels == 1 else f"{channels}c")
        frame = av.AudioFrame.from_ndarray(planes, format="fltp", layout=stream.layout.name)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buffer.getvalue()


def faint_noisy_speech() -> np.ndarray:
    """A recording 60 dB down (RMS about -84 dBFS) under white noise 5 dB below it: speech the
    VAD hears for 4.5 s, whose decode Whisper's no-speech rule would call silence
    (no-speech probability 0.73, mean log-probability -1.10)."""
    x = audio(librivox_path("0890")).numpy() * 10 ** (-60 / 20)
    noise = np.random.default_rng(0).standard_normal(x.size) * np.sqrt(np.mean(x**2)) * 10 ** (-5 / 20)
    return (x + noise).astype(np.float32)


def with_click(samples, lead_seconds: float = 1.0, at_seconds: float = 0.4) -> np.ndarray:
    """Samples after `lead_seconds` of silence holding one click at `at_seconds` (the corpus's:
    6 ms of a decaying 1.8 kHz burst peaking near full scale)."""
    from scripts.corpus import click

    burst = click(16000, 1800.0)
    lead = np.zeros(int(16000 * lead_seconds), np.float32)
    at = int(16000 * at_seconds)
    lead[at : at + burst.size] = burst
    return np.concatenate([lead, np.asarray(samples, np.float32)])


LOUD_WORDS = "Please hold while I connect your call."


def after_loud_sound(samples, sound: str) -> np.ndarray:
    """Samples after a loud sound and a second of silence: "tone" (0.4 s of 1 kHz at -9 dBFS,
    a phone's beep) or "speech" (an espeak voice saying `LOUD_WORDS` at the corpus's normal
    level, -23 dBFS)."""
    from scripts.corpus import Voice, tts_piece

    if sound == "tone":
        lead = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(6400) / 16000)
    else:
        lead = tts_piece(LOUD_WORDS, Voice("espeak", "en-us", 160)).samples
    silence = np.zeros(16000, np.float32)
    return np.concatenate([lead.astype(np.float32), silence, np.asarray(samples, np.float32)])


def gain_floors_of(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n,) float32 samples -> (items,) their gains and (items,) log-mel floors, as offline and
    streaming give them."""
    from audio.frames import item_gain_floors
    from audio.vad import SpeechDetector
    from engine.config import EngineConfig

    return item_gain_floors(samples, SpeechDetector().push(samples), EngineConfig.vad_threshold)


def floors_of(samples: np.ndarray) -> np.ndarray:
    """(n,) float32 samples -> (items,) their log-mel floors, as offline and streaming give them."""
    return gain_floors_of(samples)[1]


def heard_items(samples: np.ndarray) -> tuple[list[np.ndarray], list[float]]:
    """(n,) float32 samples -> the contexts of its whole items as the model hears them
    (brought up by their gains) and their floors: what a stream hashes."""
    from audio.frames import AudioFramer, brought_up

    contexts = AudioFramer().push(samples)
    gains, floors = gain_floors_of(samples)
    gains = gains.tolist()[: len(contexts)]  # (the flush's item is not whole)
    return ([brought_up(c, g) for c, g in zip(contexts, gains, strict=True)],
            floors.tolist()[: len(contexts)])


def stream_turns(samples: np.ndarray, threshold: float = 0.5, silence_ms: int = 500,
                 dips: bool = True) -> list[tuple[str, int]]:
    """(n,) 16 kHz samples sent to an engine stream in 100 ms pieces -> the (kind, ms) of the
    speech started / stopped events its VAD gives a session that asked for them
    (Engine.set_turns), without a model."""
    from audio.frames import ITEM_SAMPLES
    from audio.vad import TurnSettings, detect
    from engine.config import EngineConfig
    from engine.stream import Stream, hash_key

    stream = Stream("s", EngineConfig(), hash_key("model", ITEM_SAMPLES), 0)
    stream.set_turns(TurnSettings(threshold, silence_ms))
    assert stream.turns is not None
    stream.turns.pauses.dips = dips
    for at in range(0, samples.size, 1600):
        stream.add_audio(samples[at : at + 1600])
        stream.hear(detect([stream.vad], [stream.take_unheard()])[0])
    return [(e.kind, e.ms) for e in stream.turn_events]
