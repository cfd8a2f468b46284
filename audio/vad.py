"""Voice-activity detection with Silero VAD (the `silero-vad` package, which ships its weights).

Silero's network gives a speech probability for each 32 ms chunk (512 samples at 16 kHz),
from the chunk, the 64 samples before it and a recurrent state. It does not depend on the
level of the audio the way an energy threshold does: quiet speech is speech, and steady
noise is not. One network serves every stream of the process; each stream keeps its own
state (`SpeechDetector`), and `detect` runs many streams' chunks in one batch.

Silero is level-independent only down to a point: far under a normal level it hears less
and less of the speech, while Whisper still transcribes it. So each stream's chunks reach
the network with a gain that brings the loudest level of sound in the second up to the last
sound (`RECENT_CHUNKS`) up to `GAIN_TARGET_DBFS` (at most `MAX_GAIN_DB`, never down): speech
at any level meets the network as speech at a normal one, and a quiet talker a second after a
loud one is heard as alone (with the session's loudest level, a far talker after a near one
went unheard). Levels are held for `HOLD_CHUNKS` chunks (within `HOLD_RANGE_DB`, else the
quietest of them), each chunk less its mean: a click (shorter than a chunk) or a DC offset
does not set the gain, where quiet speech after it went unheard. Sound is a held level
`SOUND_MARGIN_DB` over the noise floor, the quietest chunk of the last `FLOOR_CHUNKS`: silence
and steady noise are none, so a pause keeps the gain of the sound before it (brought up in
every pause, low noise was read as speech). Steady noise brought up is still not speech to
the network, and the model itself reads the audio as it came (docs/architecture.md, Speech
tracking).

`TurnDetector` turns a stream's probabilities into speech started / stopped events (the
engine's stream runs one for a session that asks), as Silero's own `get_speech_timestamps`
does: speech starts at a chunk over `threshold`, and stops once `silence_ms` of chunks under
`threshold - 0.15` follow it.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from audio.mel import held_levels
from audio.pauses import PauseTracker

CHUNK_SAMPLES = 512  # 32 ms at 16 kHz: Silero's frame
CONTEXT_SAMPLES = 64  # samples before each chunk that the network also reads
CHUNK_MS = 32
NEG_THRESHOLD_OFFSET = 0.15  # speech continues while over threshold - this (Silero's hysteresis)
GAIN_TARGET_DBFS = -35.0  # the loudest chunk's RMS as the network hears it, when quieter
MAX_GAIN_DB = 36.0
HOLD_CHUNKS = 3  # 96 ms: a level sets the gain once held this long (a click spans two chunks at most)
HOLD_RANGE_DB = 10.0  # chunks in a row within this of the loudest of them hold its level
RECENT_CHUNKS = 31  # about a second: the loudest level of sound held over it sets the gain
FLOOR_CHUNKS = 94  # about 3 s: the quietest chunk level over them is the noise floor
SOUND_MARGIN_DB = 12.0  # a held level this far over the noise floor is sound

_model: torch.jit.ScriptModule | None = None
_model_lock = threading.Lock()


def weights_path() -> Path:
    """Silero's TorchScript file in the installed package, found without importing it: the
    package's `model` module sets torch's thread count to 1 for the whole process on import,
    which would leave the model (in this process, or in a worker started after) one core."""
    spec = find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the silero-vad package is not installed (pip install silero-vad)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.jit"


def speech_model() -> torch.jit.ScriptModule:
    """Silero's 16 kHz network, loaded once per process from the package's data."""
    global _model
    with _model_lock:
        if _model is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load's notice
                wrapper = torch.jit.load(str(weights_path()), map_location="cpu")
            _model = wrapper._model  # the 16 kHz network: (chunk with context, state) in
            _model.eval()
    return _model


def level_db(samples: np.ndarray, axis: int | None = None) -> np.ndarray | float:
    """RMS level in dBFS of float samples (over `axis`, or all of them)."""
    power = np.mean(np.square(samples, dtype=np.float64), axis=axis)
    return 10.0 * np.log10(power + 1e-12)


class SpeechDetector:
    """One stream's speech probabilities: 16 kHz samples in, one probability per 32 ms chunk."""

    def __init__(self) -> None:
        self.state = torch.zeros(2, 1, 128)  # the network's recurrent state
        self.context = torch.zeros(1, CONTEXT_SAMPLES)
        self.pending = np.zeros(0, dtype=np.float32)  # samples of the next, incomplete chunk
        self.num_chunks = 0  # chunks analysed
        self.recent_db = np.full(HOLD_CHUNKS - 1, -np.inf)  # RMS levels of the last chunks, dBFS
        self.floor_db = np.full(FLOOR_CHUNKS - 1, np.inf)  # ... of the chunks the floor counts over
        self.chunk_levels = np.zeros(0)  # (k,) dBFS of the chunks the last call took (before gain)
        self.sound_db = np.full(RECENT_CHUNKS - 1, -np.inf)  # held levels of the last chunks, if sound
        self.loudest_db = -np.inf  # the loudest sound in the second up to the last sound (sets the gain)

    def push(self, samples: np.ndarray) -> np.ndarray:
        """(n,) float32 16 kHz samples -> (k,) speech probabilities of the chunks they complete."""
        return detect([self], [samples])[0]

    def take_chunks(self, samples: np.ndarray) -> torch.Tensor:
        """Add samples -> (k, 512) the chunks they complete (the rest waits for more), each
        less its mean and with the gain of the loudest level of sound held in the second up
        to the last sound, or of its own level where that is louder (so the first word of quiet
        speech is heard at once, and nothing is raised over the target). A microphone's DC
        offset louder than quiet speech took the gain (and, brought up with the speech, the
        network's hearing) away."""
        data = np.concatenate([self.pending, samples.astype(np.float32, copy=False)])
        n = data.size // CHUNK_SAMPLES
        self.pending = data[n * CHUNK_SAMPLES :]
        chunks = data[: n * CHUNK_SAMPLES].reshape(n, CHUNK_SAMPLES)
        if not n:
            self.chunk_levels = np.zeros(0)
            return torch.from_numpy(chunks)
        chunks = chunks - chunks.mean(axis=1, keepdims=True)  # a DC offset: it is no level
        levels = self.chunk_levels = level_db(chunks, axis=1)  # (k,)
        run = np.concatenate([self.recent_db, levels])
        held = held_levels(run, HOLD_CHUNKS, HOLD_RANGE_DB)  # (k,) the runs ending at each chunk
        quiet = np.concatenate([self.floor_db, levels])
        floor = sliding_window_view(quiet, FLOOR_CHUNKS).min(axis=1)  # (k,) the floor at each chunk
        sound = held >= floor + SOUND_MARGIN_DB  # (k,)
        sounds = np.concatenate([self.sound_db, np.where(sound, held, -np.inf)])
        recent = sliding_window_view(sounds, RECENT_CHUNKS).max(axis=1)  # (k,) over the last second
        last = np.maximum.accumulate(np.where(sound, np.arange(n), -1))  # (k,) the last sound up to each
        loudest = np.where(last >= 0, recent[last], self.loudest_db)  # held through silence and noise
        self.recent_db, self.floor_db = run[-(HOLD_CHUNKS - 1) :], quiet[-(FLOOR_CHUNKS - 1) :]
        self.sound_db, self.loudest_db = sounds[-(RECENT_CHUNKS - 1) :], float(loudest[-1])
        gain_db = np.clip(GAIN_TARGET_DBFS - np.maximum(loudest, levels), 0.0, MAX_GAIN_DB)
        return torch.from_numpy(chunks * (10 ** (gain_db / 20)).astype(np.float32)[:, None])


@torch.inference_mode()
def detect(detectors: list[SpeechDetector], samples: list[np.ndarray]) -> list[np.ndarray]:
    """Each detector's new samples -> the speech probabilities of the chunks they complete.

    The network runs once per round over every stream with a chunk left (a batch of streams,
    each with its own state): with hundreds of sessions one call per chunk and stream costs
    more than all the rest of the server's Python."""
    model = speech_model()
    chunks = [d.take_chunks(x) for d, x in zip(detectors, samples, strict=True)]
    probs = [np.empty(c.shape[0], dtype=np.float32) for c in chunks]
    for r in range(max((c.shape[0] for c in chunks), default=0)):
        active = [i for i, c in enumerate(chunks) if c.shape[0] > r]
        new = torch.stack([chunks[i][r] for i in active])  # (b, 512)
        x = torch.cat([torch.cat([detectors[i].context for i in active]), new], dim=1)  # (b, 576)
        state = torch.cat([detectors[i].state for i in active], dim=1)  # (2, b, 128)
        prob, state = model(x, state)  # (b, 1), (2, b, 128)
        values = prob[:, 0].tolist()
        for row, i in enumerate(active):
            d = detectors[i]
            d.state = state[:, row : row + 1]
            d.context = new[row : row + 1, -CONTEXT_SAMPLES:]
            probs[i][r] = values[row]
    for d, p in zip(detectors, probs, strict=True):
        d.num_chunks += p.size
    return probs


def heard(probs: Iterable[float], in_speech: bool, threshold: float) -> bool:
    """Whether chunks hold speech: one at or above the threshold or, right after speech, at
    or above the threshold less Silero's hysteresis."""
    return max(probs, default=0.0) >= threshold - (NEG_THRESHOLD_OFFSET if in_speech else 0.0)


def item_chunks(item: int, item_samples: int) -> tuple[int, int]:
    """An item -> (first, end) of the chunks across it."""
    return item * item_samples // CHUNK_SAMPLES, -(-(item + 1) * item_samples // CHUNK_SAMPLES)


def item_speech(probs: np.ndarray, num_items: int, item_samples: int, threshold: float) -> list[bool]:
    """(chunks,) probabilities of a whole input -> whether each item is speech, as a stream
    tracks it (`heard` over the chunks across the item)."""
    out, in_speech = [], False
    for item in range(num_items):
        lo, hi = item_chunks(item, item_samples)
        in_speech = heard(probs[lo:hi].tolist(), in_speech, threshold)
        out.append(in_speech)
    return out


@dataclass
class VadEvent:
    kind: str  # "speech_started" or "speech_stopped"
    ms: int  # stream time of the event


@dataclass(frozen=True)
class TurnSettings:
    """What a session asks of its turn events: Silero's threshold and the pause that ends a
    turn (OpenAI Realtime's `threshold`, `silence_duration_ms`)."""

    threshold: float = 0.5
    silence_ms: int = 500


class TurnDetector:
    """Speech started / stopped events of one stream (OpenAI Realtime `server_vad`, Deepgram's
    `vad_events`) from the probabilities of the stream's VAD: a turn ends at a pause of
    `silence_ms`, the talker's pause (audio.pauses): where the VAD hears none, or, under
    other voices after long talk, a stretch well under the talker's level, which the VAD
    hears as speech (a turn would never end there)."""

    def __init__(self, settings: TurnSettings = TurnSettings()):
        self.threshold = min(max(settings.threshold, 0.0), 1.0)
        self.neg_threshold = max(self.threshold - NEG_THRESHOLD_OFFSET, 0.01)
        self.pauses = PauseTracker(CHUNK_MS, max(1, -(-settings.silence_ms // CHUNK_MS)))
        self.in_speech = False  # in a turn

    def push(self, probs: np.ndarray, levels: np.ndarray, first: int) -> list[VadEvent]:
        """(k,) speech probabilities of chunks `first`, `first + 1`, ... and (k,) their levels
        in dBFS (`SpeechDetector.chunk_levels`) -> the speech start/stop events they complete,
        at chunk times."""
        events = []
        for i, (prob, level) in enumerate(zip(probs, levels, strict=True), start=first):
            speech = prob >= self.threshold or (self.in_speech and prob >= self.neg_threshold)
            if not self.pauses.push(speech, float(level)):
                if not self.in_speech:
                    self.in_speech = True
                    events.append(VadEvent("speech_started", i * CHUNK_MS))
            elif self.in_speech and self.pauses.ends_utterance:
                self.in_speech = False
                end = (i - self.pauses.pause_items + 1) * CHUNK_MS  # where the pause began
                events.append(VadEvent("speech_stopped", end))
        return events
