"""A pre-recorded file through the engine: what the HTTP transcription endpoints share.

The file is decoded lazily (PyAV, in a worker thread) and resampled as a stream, so a long
file is never whole in memory. It runs in the engine as a background request: live
sessions never wait behind its decode (Scheduler.schedule), and it gets the compute they
leave over. Its audio is fed a few seconds at a time while its backlog is under
`AHEAD_S`, which keeps windows full and each VAD pass short (the VAD runs on the event loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, BinaryIO, TypeVar

import numpy as np
from starlette.requests import Request

from app.session import ServerContext, new_id
from audio.container import RawFormat, iter_decode, probe
from audio.io import SAMPLE_RATE
from audio.stream import StreamResampler
from engine.engine import EngineOutput
from engine.words import Word

AHEAD_S = 60.0  # decoded audio kept ahead of the engine (full 30 s windows, bounded memory)
PIECE_S = 5.0  # audio fed per piece

DISCONNECT_POLL_S = 0.5
WordsCallback = Callable[[list[Word]], Awaitable[None]]
T = TypeVar("T")


class UploadError(RuntimeError):
    """The engine could not transcribe the file (not the client's fault)."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR):
        super().__init__(message)
        self.status = status


@dataclass
class UploadResult:
    words: list[Word] = field(default_factory=list)  # times in ms from the file's start
    duration_s: float = 0.0  # of the decoded audio


class ClientGone(Exception):
    """The HTTP client disconnected before its transcription was done."""


def admit_upload(ctx: ServerContext, request: Request) -> tuple[HTTPStatus, str] | None:
    """Why an upload is refused before its body is read (None: go ahead)."""
    config = ctx.config
    length = request.headers.get("content-length")
    if length is None:
        return HTTPStatus.LENGTH_REQUIRED, "send the upload with a Content-Length header"
    if not length.isdigit() or int(length) > config.max_upload_bytes:
        return (HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the upload is over the limit of {config.max_upload_bytes >> 20} MiB")
    if ctx.draining:
        return HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down; try another or later"
    if not ctx.loop.engine.healthy:
        return HTTPStatus.SERVICE_UNAVAILABLE, "the model worker is not running; try again later"
    if ctx.uploads >= config.max_uploads:
        return (HTTPStatus.TOO_MANY_REQUESTS,
                f"{config.max_uploads} files are being transcribed; try again later")
    return None


class UploadSlot:
    """One of the `max_uploads` transcriptions in progress, from its admission to release."""

    def __init__(self, ctx: ServerContext, endpoint: str,
                 close: Callable[[], Awaitable[None]] | None = None):
        """`close`: what to close at release (an uploaded file spooled to disk)."""
        self.ctx, self.endpoint, self.close = ctx, endpoint, close
        self.outcome = "error"  # set to "ok" once the transcript is out
        self.released = False
        ctx.uploads += 1

    async def release(self) -> None:
        if not self.released:
            self.released = True
            self.ctx.uploads -= 1
            self.ctx.metrics.uploads.labels(self.endpoint, self.outcome).inc()
            if self.close is not None:
                await self.close()


async def probe_upload(source: BinaryIO, raw: RawFormat | None = None) -> None:
    """AudioError now, before any response, when the upload holds no decodable audio."""
    await asyncio.to_thread(probe, source, raw)


async def until_disconnected(ctx: ServerContext, request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`; cancel it and raise ClientGone if the client disconnects meanwhile, or
    UploadError (503) if the server stops (its drain is over)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
            if ctx.stopping:
                raise UploadError("the server is shutting down; send the file again",
                                  HTTPStatus.SERVICE_UNAVAILABLE)
    finally:
        task.cancel()


def _pieces(source: BinaryIO, max_seconds: float, raw: RawFormat | None) -> Iterator[np.ndarray]:
    """(n,) float32 16 kHz pieces of about PIECE_S each (the last one shorter)."""
    resampler: StreamResampler | None = None
    buffered: list[np.ndarray] = []
    size = 0
    for samples, rate in iter_decode(source, max_seconds, raw):
        resampler = resampler or StreamResampler(rate)
        out = resampler.push(samples)
        buffered.append(out)
        size += out.size
        if size >= PIECE_S * SAMPLE_RATE:
            yield np.concatenate(buffered)
            buffered, size = [], 0
    if resampler is not None:
        buffered.append(resampler.flush())
    if buffered and sum(b.size for b in buffered):
        yield np.concatenate(buffered)


async def transcribe_upload(ctx: ServerContext, source: BinaryIO, on_words: WordsCallback | None = None,
                            raw: RawFormat | None = None) -> UploadResult:
    """Transcribe a file through the engine loop -> its words. `on_words` gets each batch of
    newly committed words as it comes (for a streamed response). AudioError for a file
    that cannot be decoded (nothing else is transcribed then); UploadError if the engine
    failed. Cancelled (the client went away): the request is aborted."""
    pieces = _pieces(source, ctx.config.max_upload_s, raw)
    try:
        return await transcribe_pieces(ctx, pieces, on_words, ctx.metrics.upload_audio_seconds.inc)
    finally:
        try:
            pieces.close()
        except ValueError:  # still decoding in its thread (cancelled meanwhile); it ends there
            pass


async def transcribe_pieces(ctx: ServerContext, pieces: Iterator[np.ndarray],
                            on_words: WordsCallback | None = None,
                            on_seconds: Callable[[float], None] | None = None) -> UploadResult:
    """Transcribe (n,) float32 16 kHz pieces (read in a worker thread) as a background
    request of the engine loop -> the words, in ms from the first piece's start."""
    loop, request_id = ctx.loop, new_id("file")
    outputs: asyncio.Queue[EngineOutput] = asyncio.Queue()
    loop.open(request_id, outputs.put_nowait, background=True)
    result = UploadResult()
    collector = asyncio.create_task(_collect(outputs, result, on_words))
    num_fed = 0
    try:
        while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
            if collector.done():
                break  # the engine failed; the collector raises below
            loop.add_audio(request_id, piece)
            num_fed += piece.size
            if on_seconds is not None:
                on_seconds(piece.size / SAMPLE_RATE)
            await loop.wait_backlog_below(request_id, AHEAD_S)
        loop.finish(request_id)
        await collector
    except BaseException:
        loop.abort(request_id)
        collector.cancel()
        raise
    result.duration_s = num_fed / SAMPLE_RATE
    return result


async def _collect(outputs: asyncio.Queue[EngineOutput], result: UploadResult,
                   on_words: WordsCallback | None) -> None:
    while True:
        output = await outputs.get()
        if output.error is not None:
            raise UploadError(f"transcription failed: {output.error}")
        if output.committed:
            result.words += output.committed
            if on_words is not None:
                await on_words(output.committed)
        if output.finished:
            return
