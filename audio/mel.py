"""Whisper log-mel features (n_fft 400, hop 160, 80 or 128 bins), as openai/whisper computes them."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from audio.io import SAMPLE_RATE

N_FFT = 400
HOP_LENGTH = 160
CHUNK_LENGTH = 30
N_SAMPLES = CHUNK_LENGTH * SAMPLE_RATE  # 480000 samples in a 30 s window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames in a window
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100 mel frames/s, 10 ms each
DYNAMIC_RANGE = 8.0  # log10 units kept below the loudest bin (80 dB)
HOLD_FRAMES = 4  # 40 ms: how long a level must hold to count as the loudest (see loudest_levels)
HOLD_RANGE = 1.0  # 10 dB: a run of frames within this of its loudest holds that level
LOWEST_SPEECH_BIN = 2  # bins 0 and 1 (under 75 Hz: an offset, a rumble) set no floor
SILENCE_LOG_POWER = -10.0  # log10 of the power clamp (1e-10): what digital silence gives


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale (librosa's default): linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    mel = f / (200.0 / 3)
    log_region = f >= 1000.0
    mel[log_region] = 15.0 + np.log(f[log_region] / 1000.0) / (np.log(6.4) / 27.0)
    return mel


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f = m * (200.0 / 3)
    log_region = m >= 15.0
    f[log_region] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m[log_region] - 15.0))
    return f


@lru_cache(maxsize=4)
def mel_filters(n_mels: int = 80) -> torch.Tensor:
    """(n_mels, 201) slaney-normalized triangular filters = librosa.filters.mel(16000, 400, n)."""
    fft_freqs = np.linspace(0, SAMPLE_RATE / 2, 1 + N_FFT // 2)
    mel_points = _mel_to_hz(np.linspace(_hz_to_mel(np.array([0.0]))[0],
                                        _hz_to_mel(np.array([SAMPLE_RATE / 2]))[0], n_mels + 2))
    fdiff = np.diff(mel_points)
    ramps = np.subtract.outer(mel_points, fft_freqs)
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_points[2:] - mel_points[:-2]))[:, None]
    return torch.from_numpy(weights.astype(np.float32))


@lru_cache(maxsize=4)
def _window(device: torch.device) -> torch.Tensor:
    return torch.hann_window(N_FFT, device=device)


def log_mel_power(audio: torch.Tensor, n_mels: int = 80, center: bool = True) -> torch.Tensor:
    """(..., n) samples -> (..., n_mels, frames) log10 mel power, before range clamp and scaling.

    With center=True (openai/whisper) frames = n // 160 (the last STFT frame is dropped).
    With center=False the caller supplies 200 samples of context on each side.
    """
    window = _window(audio.device)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, center=center, return_complex=True)
    magnitudes = stft.abs() ** 2
    if center:
        magnitudes = magnitudes[..., :-1]
    mel = mel_filters(n_mels).to(audio.device) @ magnitudes
    return torch.clamp(mel, min=10.0**SILENCE_LOG_POWER).log10()


def normalize_log_mel(log_spec: torch.Tensor, floor: float | torch.Tensor) -> torch.Tensor:
    """Whisper's range clamp and scaling: max(x, floor) then (x + 4) / 4."""
    return (torch.maximum(log_spec, torch.as_tensor(floor, dtype=log_spec.dtype)) + 4.0) / 4.0


def log_mel_spectrogram(audio: torch.Tensor, n_mels: int = 80, padding: int = 0,
                        floors: torch.Tensor | None = None) -> torch.Tensor:
    """(n,) float32 16 kHz -> (n_mels, (n + padding) // 160), exactly as openai/whisper.

    The clamp floor is the loudest bin of the whole input minus 80 dB, or each frame's of
    `floors` (frames,) (streaming's, audio.frames.item_gain_floors; the last one holds on)."""
    if padding > 0:
        audio = torch.nn.functional.pad(audio, (0, padding))
    log_spec = log_mel_power(audio, n_mels)
    if floors is None:
        return normalize_log_mel(log_spec, float(log_spec.max()) - DYNAMIC_RANGE)
    frames = log_spec.shape[-1]
    floors = torch.cat([floors[:frames], floors[-1:].expand(max(frames - floors.numel(), 0))])
    return normalize_log_mel(log_spec, floors.to(log_spec.dtype))


def loudest_levels(log_spec: torch.Tensor) -> np.ndarray:
    """(..., n_mels, T) log mel power -> (...) the loudest level of a sound held for `HOLD_FRAMES`
    frames, in the bins from `LOWEST_SPEECH_BIN` up: over each run of frames (each frame's
    loudest of those bins), the run's loudest where the run stays within `HOLD_RANGE` of it,
    else its quietest.

    Whisper's floor counts from the single loudest bin. One click of a few ms (a microphone's
    bump, a key, a plug), or a DC offset, then sets it for the whole input, and speech 30 dB
    quieter is clamped away: no text. A click of about 10 ms stands out of its run for at most
    three frames, and an offset or a rumble lies under 75 Hz, where speech has no energy; a
    vowel holds its level, so speech's loudest bin counts as Whisper counts it.
    """
    peaks = log_spec[..., LOWEST_SPEECH_BIN:, :].amax(dim=-2).cpu().numpy()  # (..., T)
    if peaks.shape[-1] < HOLD_FRAMES:
        return peaks.max(axis=-1)
    return held_levels(peaks, HOLD_FRAMES, HOLD_RANGE).max(axis=-1)


def held_levels(levels: np.ndarray, run: int, within: float) -> np.ndarray:
    """(..., T) levels -> (..., T - run + 1) the level each `run` in a row holds: their
    loudest where all lie within `within` of it, else their quietest. A click stands out of
    its run; a vowel holds its level."""
    runs = np.lib.stride_tricks.sliding_window_view(levels, run, axis=-1)  # (..., T - run + 1, run)
    low, high = runs.min(axis=-1), runs.max(axis=-1)
    return np.where(high - low <= within, high, low)
