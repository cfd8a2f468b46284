"""What every websocket session does, whatever its protocol.

A session reads client messages (with an idle timeout), turns audio into 16 kHz samples for
the engine loop, and in a second task turns engine outputs into protocol events. Finalized
text goes to the transcript store before it is sent. When the client disconnects without
closing, the session still finishes: the rest of its audio is transcribed into the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from app.config import ServerConfig
from app.engine_loop import EngineLoop
from app.metrics import Metrics
from app.store import TranscriptStore
from audio.io import SAMPLE_RATE, check_stream_rate
from audio.stream import StreamResampler
from engine.engine import EngineOutput
from engine.policy import Word

log = logging.getLogger(__name__)

CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008  # idle timeout
CLOSE_INTERNAL = 1011  # the engine failed this session


@dataclass
class ServerContext:
    """What sessions share: the engine loop, metrics, the store and the settings."""

    config: ServerConfig
    loop: EngineLoop
    metrics: Metrics
    store: TranscriptStore
    model_name: str
    multilingual: bool  # the model transcribes languages other than English


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def query_rate(params: dict[str, str], default: int) -> int:
    """The `sample_rate` query parameter (8000-48000); ValueError with the fix if bad."""
    value = params.get("sample_rate", str(default))
    try:
        rate = int(value)
    except ValueError:
        raise ValueError(f"sample_rate must be an integer, got {value!r}") from None
    return check_stream_rate(rate)


def words_json(words: list[Word]) -> list[dict[str, Any]]:
    return [{"word": w.text.strip(), "start_ms": w.start_ms, "end_ms": w.end_ms} for w in words]


def text_of(words: list[Word]) -> str:
    return "".join(w.text for w in words).strip()


class Session:
    protocol = "base"

    def __init__(self, ws: ServerConnection, ctx: ServerContext, rate: int):
        self.ws = ws
        self.ctx = ctx
        self.id = new_id("sess")
        self.outputs: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self.resampler = StreamResampler(rate)
        self.num_fed = 0  # 16 kHz samples given to the engine
        self.connected = True
        self.closing = False  # the reader stops after the current message
        self.close_code, self.close_reason = CLOSE_NORMAL, ""
        self.first_audio_at: float | None = None
        self.sent_text = False
        self.tentative: list[str] = []  # texts of the current tentative words
        self.tentative_since: list[float] = []  # when each was first shown

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        loop = self.ctx.loop
        loop.open(self.id, self.outputs.put_nowait)
        self.ctx.metrics.sessions_total.inc(protocol=self.protocol)
        writer = asyncio.create_task(self._write_loop(), name=f"writer-{self.id}")
        try:
            await self.on_open()
            await self._read_loop()
            self._feed(self.resampler.flush())
            loop.finish(self.id)
            await writer  # the rest of the text, to the store and (if still there) the client
            if self.connected:
                await self.on_finished()
                await self.ws.close(self.close_code, self.close_reason)
        except asyncio.CancelledError:  # server shutdown
            loop.abort(self.id)
            writer.cancel()
            raise
        finally:
            self.ctx.store.close(self.id)

    async def _read_loop(self) -> None:
        idle = self.ctx.config.idle_timeout_s
        while not self.closing:
            try:
                message = await asyncio.wait_for(self.ws.recv(), idle)
            except TimeoutError:
                await self.send_error("idle_timeout", f"no message for {idle:g} s; closing")
                self.close_code, self.close_reason = CLOSE_POLICY, "idle timeout"
                return
            except ConnectionClosed:
                self.connected = False
                return
            try:
                if isinstance(message, bytes):
                    await self.on_binary(message)
                else:
                    await self.on_text(message)
            except Exception:  # a bug on one message must not end the session silently
                log.exception("session %s: handling a message failed", self.id)
                await self.send_error("internal_error", "the server could not handle that message")

    async def _write_loop(self) -> None:
        while True:
            output = await self.outputs.get()
            try:
                if output.error is not None:  # the engine dropped the request: end the session
                    await self.send_error("engine_error", f"transcription failed: {output.error}")
                    self.closing = True
                    if self.connected:
                        self.connected = False
                        await self.ws.close(CLOSE_INTERNAL, "engine error")
                else:
                    self._observe(output)
                    await self.on_output(output)
            except Exception:  # never leave the session without its writer
                log.exception("session %s: output handling failed", self.id)
            if output.finished:
                return

    # ------------------------------------------------------------------ helpers

    def parse_json(self, text: str) -> dict[str, Any] | str:
        """A JSON object, or the reason it is not one."""
        try:
            message = json.loads(text)
        except ValueError as e:
            return f"message is not valid JSON: {e}"
        if not isinstance(message, dict):
            return "message must be a JSON object"
        return message

    def ingest(self, samples: torch.Tensor) -> None:
        """(n,) float32 at the session's rate -> the engine (resampled to 16 kHz)."""
        if not samples.numel():
            return
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
        self.ctx.metrics.audio_seconds.inc(samples.numel() / self.resampler.rate)
        self._feed(self.resampler.push(samples.numpy()))

    def _feed(self, samples: np.ndarray) -> None:
        if samples.size:
            self.num_fed += samples.size
            self.ctx.loop.add_audio(self.id, samples)
            self.on_fed(samples)

    @property
    def fed_ms(self) -> int:
        return self.num_fed * 1000 // SAMPLE_RATE

    async def send(self, event: dict[str, Any]) -> None:
        if not self.connected:
            return
        try:
            await self.ws.send(json.dumps(event, ensure_ascii=False))
        except ConnectionClosed:
            self.connected = False

    def _observe(self, output: EngineOutput) -> None:
        """Time to first text, and partial -> final latency of each committed word."""
        metrics, now = self.ctx.metrics, time.monotonic()
        if not self.sent_text and (output.committed or output.tentative) and self.first_audio_at:
            metrics.first_partial.observe(now - self.first_audio_at)
            self.sent_text = True
        n = len(output.committed)
        for since in self.tentative_since[:n]:  # committed words are a prefix of the tentative
            metrics.final_latency.observe(now - since)
        previous, since = self.tentative[n:], self.tentative_since[n:]
        self.tentative = [w.text for w in output.tentative]
        self.tentative_since = [since[i] if i < len(previous) and previous[i] == text else now
                                for i, text in enumerate(self.tentative)]

    # ------------------------------------------------------------------ protocol hooks

    async def on_open(self) -> None: ...

    async def on_text(self, text: str) -> None: ...

    async def on_binary(self, data: bytes) -> None: ...

    def on_fed(self, samples: np.ndarray) -> None:
        """(n,) 16 kHz samples just given to the engine (for turn detection)."""

    async def on_output(self, output: EngineOutput) -> None: ...

    async def on_finished(self) -> None:
        """Everything is transcribed and sent; the socket is about to close."""

    async def send_error(self, code: str, message: str, **extra: Any) -> None:
        raise NotImplementedError
