"""Audio in containers and compressed codecs, decoded by PyAV (ffmpeg's libraries).

Whatever ffmpeg reads: wav, flac, ogg (vorbis, opus), mp3, m4a/aac, webm (opus), and more.
The decoded audio keeps its rate; the caller resamples with audio.io.resample, so a file
gives the same samples whichever way it reaches the server. `StreamDecoder` decodes a
container that arrives in pieces over a websocket (a browser MediaRecorder's webm/opus, Ogg
Opus) in a thread of its own.
"""

from __future__ import annotations

import io
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import av
import numpy as np
import torch

from audio.io import AudioError, resample

FORMATS_HINT = "send wav, flac, ogg, opus, mp3, m4a, aac or webm audio"
# the first bytes of the containers a stream may start with (for streams that do not say)
MAGIC = (b"OggS", b"\x1aE\xdf\xa3", b"RIFF", b"fLaC", b"ID3")
# a live stream: find its audio stream in the first packets, not in ffmpeg's default 5 MB
LIVE_OPTIONS = {"probesize": "4096", "analyzeduration": "0"}
# audio.io's PCM encodings -> ffmpeg's demuxers of headerless audio
RAW_DEMUXERS = {"pcm16": "s16le", "linear32": "s32le", "float32": "f32le", "mulaw": "mulaw",
                "alaw": "alaw"}


@dataclass(frozen=True)
class RawFormat:
    """Headerless PCM: what a container would have said."""

    encoding: str  # an audio.io PCM encoding
    rate: int
    channels: int = 1


def load_audio(path: str | Path, max_seconds: float | None = None) -> torch.Tensor:
    """An audio file -> (n,) float32 at 16 kHz mono."""
    path = Path(path)
    if not path.is_file():
        raise AudioError(f"{path}: no such file")
    try:
        audio, rate = decode(path, max_seconds)
    except AudioError as e:
        raise AudioError(f"{path}: {e}") from None
    return resample(torch.from_numpy(audio), rate)


def decode(source: str | Path | BinaryIO, max_seconds: float | None = None,
           raw: RawFormat | None = None) -> tuple[np.ndarray, int]:
    """A file (path or file object) -> ((n,) float32 mono, its sample rate). Channels are
    averaged. AudioError if it holds no decodable audio or more than `max_seconds`."""
    pieces = list(iter_decode(source, max_seconds, raw))
    if not pieces:
        raise AudioError("the file holds no audio samples")
    return np.concatenate([p for p, _ in pieces]), pieces[0][1]


def iter_decode(source: str | Path | BinaryIO, max_seconds: float | None = None,
                raw: RawFormat | None = None, live: bool = False) -> Iterator[tuple[np.ndarray, int]]:
    """Decode lazily (a long file is never whole in memory): ((n,) float32 mono, rate)
    pieces, one rate throughout. AudioError as `decode`; none yielded for an empty file.
    `raw`: the source is headerless PCM of that format; `live`: it is still arriving."""
    fmt, options = None, dict(LIVE_OPTIONS) if live else None
    if raw is not None:
        fmt = RAW_DEMUXERS[raw.encoding]
        options = {"sample_rate": str(raw.rate), "ch_layout": f"{raw.channels}C"}
    try:
        container = av.open(str(source) if isinstance(source, str | Path) else source, mode="r",
                            format=fmt, options=options, metadata_errors="ignore")
    except av.error.FFmpegError as e:
        raise AudioError(f"cannot read this audio ({_reason(e)}); {FORMATS_HINT}") from None
    with container:
        stream = next((s for s in container.streams if s.type == "audio"), None)
        if stream is None:
            raise AudioError(f"the file holds no audio stream; {FORMATS_HINT}")
        # planar float at the first frame's rate and layout for every frame (a chained ogg
        # may change them midway)
        resampler = av.AudioResampler(format="fltp")
        end = _exact_end(container, stream)
        num_samples = 0
        try:
            for out in _resampled(resampler, container.decode(stream)):
                samples = _mono(out.to_ndarray())[: max(0, end - num_samples)]
                num_samples += out.samples
                if max_seconds is not None and num_samples > max_seconds * out.sample_rate:
                    raise AudioError(f"the audio is longer than the limit of {max_seconds:g} s")
                if samples.size:
                    yield samples, out.sample_rate
        except av.error.FFmpegError as e:
            at = f" at {num_samples / resampler.rate:.1f} s" if resampler.rate else ""
            raise AudioError(f"cannot decode this audio{at} ({_reason(e)}); {FORMATS_HINT}") from None


def _resampled(resampler: av.AudioResampler, frames: Iterator[av.AudioFrame]) -> Iterator[av.AudioFrame]:
    for frame in frames:
        yield from resampler.resample(frame)
    yield from resampler.resample(None)


def _exact_end(container: av.container.InputContainer, stream: av.AudioStream) -> int:
    """The samples an ogg stream holds by its last granule position (ffmpeg's vorbis decoder
    gives the last packet's padding as well); no limit for other containers, whose duration
    may be an estimate (mp3 from its bit rate)."""
    if container.format.name != "ogg" or not stream.duration or stream.time_base is None:
        return 1 << 62
    return round(stream.duration * stream.time_base * stream.rate)


def is_container(data: bytes) -> bool:
    """Whether a stream's first message starts like a container (not headerless PCM)."""
    return data.startswith(MAGIC) or data[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf1", b"\xff\xf9")


class _Pipe(io.RawIOBase):
    """Bytes put by one thread, read by another: reads wait for data or the end."""

    def __init__(self) -> None:
        self.chunks: deque[bytes] = deque()
        self.ended = False
        self.cond = threading.Condition()

    def readable(self) -> bool:
        return True

    def put(self, data: bytes) -> None:
        with self.cond:
            self.chunks.append(bytes(data))
            self.cond.notify()

    def end(self) -> None:
        with self.cond:
            self.ended = True
            self.cond.notify()

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        with self.cond:
            self.cond.wait_for(lambda: self.chunks or self.ended)
            if not self.chunks:
                return 0  # the end
            chunk = self.chunks.popleft()
            n = min(len(buffer), len(chunk))
            buffer[:n] = chunk[:n]
            if n < len(chunk):
                self.chunks.appendleft(chunk[n:])
            return n


class StreamDecoder:
    """A container arriving in pieces, decoded in a thread of its own as its bytes come in.
    `on_audio((n,) float32 mono, rate)` and `on_error(message)` are called from that thread;
    after `close()`, `thread` ends once everything is decoded."""

    def __init__(self, on_audio: Callable[[np.ndarray, int], None], on_error: Callable[[str], None]):
        self.pipe = _Pipe()
        self.thread = threading.Thread(target=self._run, args=(on_audio, on_error), daemon=True,
                                       name="stream-decoder")
        self.thread.start()

    def feed(self, data: bytes) -> None:
        self.pipe.put(data)

    def close(self) -> None:
        self.pipe.end()

    def _run(self, on_audio: Callable[[np.ndarray, int], None], on_error: Callable[[str], None]) -> None:
        try:
            for samples, rate in iter_decode(self.pipe, live=True):
                on_audio(samples, rate)
        except AudioError as e:
            on_error(str(e))
            while self.pipe.read(1 << 16):  # what still comes is dropped, not left to block
                pass


def probe(source: BinaryIO, raw: RawFormat | None = None) -> None:
    """Check that a file object holds decodable audio (AudioError if not), then rewind it."""
    try:
        pieces = iter_decode(source, raw=raw)
        first = next(pieces, None)
        pieces.close()
    finally:
        source.seek(0)
    if first is None:
        raise AudioError("the file holds no audio samples")


def _mono(planes: np.ndarray) -> np.ndarray:
    """(channels, n) float32 -> (n,) float32."""
    return planes[0] if planes.shape[0] == 1 else planes.mean(axis=0)


def _reason(error: Exception) -> str:
    return getattr(error, "strerror", None) or str(error)
