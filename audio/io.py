"""PCM byte frames into float32 tensors, and resampling to Whisper's 16 kHz."""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torchaudio.functional as AF

SAMPLE_RATE = 16000  # Whisper's input rate
MIN_RATE, MAX_RATE = 8000, 48000  # rates accepted from streaming clients
PCM_DTYPES = {"pcm16": np.dtype("<i2"), "linear32": np.dtype("<i4"), "float32": np.dtype("<f4"),
              "mulaw": np.dtype("u1"), "alaw": np.dtype("u1")}


def _g711_table(law: str) -> torch.Tensor:
    """(256,) float32: each G.711 byte's sample in [-1, 1] (ITU-T G.711 expansion)."""
    byte = np.arange(256)
    if law == "mulaw":
        u = ~byte & 0xFF
        magnitude = (((u & 0x0F) << 3) + 0x84 << ((u >> 4) & 7)) - 0x84
        sample = np.where(u & 0x80, -magnitude, magnitude)
    else:
        a = byte ^ 0x55
        exponent, mantissa = (a >> 4) & 7, a & 0x0F
        magnitude = np.where(exponent == 0, (mantissa << 4) + 8,
                             ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
        sample = np.where(a & 0x80, magnitude, -magnitude)
    return torch.from_numpy((sample / 32768.0).astype(np.float32))


G711 = {law: _g711_table(law) for law in ("mulaw", "alaw")}


class AudioError(ValueError):
    """Input audio that cannot be decoded; the message says what to fix."""


def resample(audio: torch.Tensor, rate: int) -> torch.Tensor:
    """(n,) float32 at `rate` -> (n * 16000 / rate,) float32 at 16 kHz (band-limited sinc)."""
    if rate == SAMPLE_RATE:
        return audio
    if rate <= 0:
        raise AudioError(f"sample rate must be positive, got {rate}")
    g = np.gcd(int(rate), SAMPLE_RATE)
    return AF.resample(audio, int(rate) // g, SAMPLE_RATE // g)


def check_stream_rate(rate: int) -> int:
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioError(f"sample_rate {rate} is out of range; use {MIN_RATE}-{MAX_RATE} Hz")
    return rate


def _tensor_view(array: np.ndarray) -> torch.Tensor:
    """torch.from_numpy without a copy; read-only buffers (websocket bytes) are never written."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def pcm_to_float(data: bytes | bytearray | memoryview, encoding: str = "pcm16",
                 channels: int = 1) -> torch.Tensor:
    """PCM bytes (interleaved when `channels` > 1) -> (n,) float32 mono in [-1, 1], the
    channels averaged. Zero-copy view for mono float32, one scale for the integer encodings.

    np.frombuffer views the bytes without copying and torch.from_numpy shares that memory.
    """
    dtype = PCM_DTYPES.get(encoding)
    if dtype is None:
        raise AudioError(f"unknown encoding {encoding!r}; use one of {sorted(PCM_DTYPES)}")
    frame = dtype.itemsize * channels
    if len(data) % frame:
        what = f"{channels} channels of " if channels > 1 else ""
        raise AudioError(f"{what}{encoding} frames must hold a multiple of {frame} bytes, got {len(data)}")
    raw = _tensor_view(np.frombuffer(data, dtype=dtype))
    if encoding in G711:
        samples = G711[encoding][raw.long()]
    elif encoding == "float32":
        if not bool(torch.isfinite(raw).all()):
            raise AudioError("float32 frames hold NaN or infinite samples")
        samples = raw
    else:
        samples = raw.float() / float(1 << (8 * dtype.itemsize - 1))
    if channels > 1:
        samples = samples.view(-1, channels).mean(dim=1)
    return samples


def float_to_pcm16(audio: torch.Tensor | np.ndarray) -> bytes:
    """(n,) float in [-1, 1] -> little-endian PCM16 bytes (clipped; (n, channels) frames come
    out interleaved), each sample the nearest step: the inverse of `pcm_to_float`, so PCM16
    audio read and written again is unchanged (truncated, every sample would lose a step, and
    speech a few steps high its quiet half)."""
    array = audio.numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio)
    return np.clip(np.rint(array * 32768.0), -32768, 32767).astype("<i2").tobytes()
