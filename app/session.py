"""What every websocket session does, whatever its protocol.

A session reads client messages (with an idle timeout), turns audio into 16 kHz samples for
the engine loop (after writing it to the session's spool, app/spool.py), and in a second
task turns engine outputs into protocol events. Finalized text goes to the transcript store
before it is sent; the spool behind it is deleted. When the client disconnects without
closing, the session still finishes: the rest of its audio is transcribed into the store.

A resumable session (/v1/listen) that drops without a close frame waits `resume_grace_s`
for the client to come back with its resume token; meanwhile the engine goes on and its
finals go to the store and a replay buffer. After each message the session checks its
backlog: over `max_lag_s` the client gets a rate_limited warning (at most every 5 s); at
`max_backlog_s` the session stops reading its socket until the engine catches up. When the
engine starts shedding partials for load (engine/load.py), the client gets a rate_limited
warning too.

At shutdown the server ends each session's input at its next pause (`stop_input`); the
session tells the client how much audio it took, transcribes it, and closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.config import ServerConfig
from app.connection import CLOSE_INTERNAL, CLOSE_NORMAL, CLOSE_POLICY, Connection, Disconnected
from app.engine_loop import EngineLoop
from app.metrics import Metrics
from app.spool import SessionSpool, Spool
from app.store import TranscriptStore
from audio.io import check_stream_rate
from audio.stream import StreamResampler
from audio.vad import VadEvent
from engine.engine import EngineOutput
from engine.timeline import samples_to_ms
from engine.words import Word

log = logging.getLogger(__name__)

AHEAD_SLACK_S = 2.0  # audio a real-time client may send ahead of the wall clock (its buffering)
WARN_INTERVAL_S = 5.0  # at most one rate_limited warning per session this often
STOP_PAUSE_MS = 192  # a pause the VAD heard this long: where input stops at shutdown


@dataclass
class ServerContext:
    """What sessions share: the engine loop, metrics, the store and the settings."""

    config: ServerConfig
    loop: EngineLoop
    metrics: Metrics
    store: TranscriptStore
    spool: Spool
    model_name: str
    multilingual: bool  # the model transcribes languages other than English
    resumable: dict[str, Session] = field(default_factory=dict)  # resume token -> session
    draining: bool = False  # the server is shutting down: no new sessions or files
    stopping: bool = False  # ... and its drain is over: what is left is given up
    uploads: int = 0  # files being transcribed over HTTP (app/upload.py)


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


def clip_text(text: str, limit: int = 120) -> str:
    """Client input echoed in a message, bounded."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {clip_text(text, 40)}")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


async def _first(*waits: Awaitable[Any], timeout: float | None = None) -> None:
    """Wait until the first of `waits` is done (or `timeout`); cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def words_json(words: list[Word]) -> list[dict[str, Any]]:
    return [{"word": w.text.strip(), "start_ms": w.start_ms, "end_ms": w.end_ms} for w in words]


def text_of(words: list[Word]) -> str:
    return "".join(w.text for w in words).strip()


class Session:
    protocol = "base"
    resumable = False  # whether a dropped connection can be resumed with a token

    def __init__(self, ws: Connection, ctx: ServerContext, rate: int):
        self.ws = ws
        self.ctx = ctx
        self.id = new_id("sess")
        self.outputs: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self.resampler = StreamResampler(rate)
        self.num_received = 0  # samples at the client's rate accepted: the resume offset
        self.num_fed = 0  # 16 kHz samples given to the engine
        self.connected = True
        self.closing = False  # the reader stops after the current message
        self.close_code, self.close_reason = CLOSE_NORMAL, ""
        self.opened_at = time.perf_counter()  # (the engine loop's clock: its load meter's)
        self.first_audio_at: float | None = None
        self.warned_at = -WARN_INTERVAL_S  # last rate_limited warning (monotonic s)
        self.told_shedding = False  # whether the client was told of the engine's shedding
        self.sent_text = False
        self.tentative: list[str] = []  # texts of the current tentative words
        self.tentative_since: list[float] = []  # when each was first shown
        self.writer: asyncio.Task | None = None
        self.output_lock = asyncio.Lock()  # one sender of outputs at a time (writer or resume)
        self.attached = asyncio.Event()  # set when a resume takes the session over
        self.finishing = False  # no resume any more: the rest is being transcribed
        self.ended = False
        self.transcribed = False  # the engine's last output was handled
        self.resume_token: str | None = None
        self.store_warned = False  # the client was told the store cannot write now
        self.spool: SessionSpool | None = None  # the received audio on disk (from run())
        self.done_ms = 0  # no later engine output has words before this
        self.input_stopped = asyncio.Event()  # set by stop_input
        self.receiving: asyncio.Future | None = None  # the read of the next message
        self.stop_at_pause = False  # from stop_input: input ends at the next pause
        if self.resumable and ctx.config.resume_grace_s > 0:
            self.resume_token = secrets.token_urlsafe(24)
            ctx.resumable[self.resume_token] = self

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Serve the first connection; return when the session ended or a resume took over."""
        self.ctx.loop.open(self.id, self.outputs.put_nowait)
        self.spool = self.ctx.spool.open(self.id, self.protocol)
        self.ctx.metrics.sessions_total.labels(self.protocol).inc()
        self.writer = asyncio.create_task(self._write_loop(), name=f"writer-{self.id}")
        try:
            await self.on_open()
        except asyncio.CancelledError:
            self.abort()
            raise
        await self._serve(self.ws)

    async def resume(self, ws: Connection, last_seq: int) -> None:
        """Take the session over on a new connection (the old one dropped, or is half-open)."""
        old, self.ws, self.connected = self.ws, ws, False
        if old is not ws:
            old.abort()  # a half-open old connection: its reader ends now
        self.ctx.metrics.sessions_resumed.labels(self.protocol).inc()
        async with self.output_lock:  # nothing else is sent until the resume is told
            self.connected = True
            await self.on_resume(last_seq)
        self.attached.set()
        await self._serve(ws)

    async def _serve(self, ws: Connection) -> None:
        try:
            dropped = await self._read_loop(ws)
            if self.ws is not ws:
                return  # a resume took over while this connection was still open
            if self.input_stopped.is_set():
                await self._say_input_stopped()
            if dropped and await self._wait_for_resume():
                return
            await self._end()
        except asyncio.CancelledError:  # server shutdown
            if self.ws is ws:
                self.abort()
            raise

    async def _say_input_stopped(self) -> None:
        """Tell the client how much of its audio the server took before it stopped reading:
        it sends the rest to another server."""
        rate = self.resampler.rate
        await self.send_warning(
            "server_shutting_down", f"the server is shutting down: the audio received, "
            f"{self.num_received / rate:.3f} s ({self.num_received} samples at {rate} Hz), is "
            "transcribed and sent; send the rest to another server",
            audio_received_samples=self.num_received)

    async def _wait_for_resume(self) -> bool:
        """After a drop: wait the grace period for a resume; False when none came."""
        if self.resume_token is None or self.closing:
            return False
        self.attached.clear()
        assert self.writer is not None
        await _first(self.attached.wait(), self.input_stopped.wait(), asyncio.shield(self.writer),
                     timeout=self.ctx.config.resume_grace_s)  # (the writer ends on an engine error)
        return self.attached.is_set()

    async def _end(self) -> None:
        """No more audio: transcribe the rest (into the store, and to the client if there)."""
        self._stop_resume()
        try:
            await self.on_input_end()
            self._feed(self.resampler.flush())
            self.ctx.loop.finish(self.id)
            assert self.writer is not None
            await asyncio.wait({self.writer})  # (not cancelled with this task: abort() does that)
            if self.transcribed and self.connected:
                await self.on_finished()
                await self.ws.close(self.close_code, self.close_reason)
        finally:
            self.ended = True
            stored = self.ctx.store.close(self.id)
            if self.spool is not None:  # kept unless all is stored: the next start recovers it
                self.spool.remove() if stored and self.transcribed else self.spool.close()

    def abort(self) -> None:
        """Drop the session (the server stops, or a fault): its spool stays for the next
        start to transcribe."""
        self.on_abort()
        self._stop_resume()
        self.ctx.loop.abort(self.id)
        if self.writer is not None:
            self.writer.cancel()
        self.ended = True
        self.ctx.store.close(self.id)
        if self.spool is not None:
            self.spool.close()

    def _stop_resume(self) -> None:
        self.finishing = True
        if self.resume_token is not None:
            self.ctx.resumable.pop(self.resume_token, None)

    async def _read_loop(self, ws: Connection) -> bool:
        """Handle client messages; True when the connection dropped (no clean close)."""
        idle = self.ctx.config.idle_timeout_s
        while not self.closing and self.ws is ws:
            try:
                message = await self._receive(ws, idle)
            except TimeoutError:
                await self.send_error("idle_timeout", f"no message for {idle:g} s; closing")
                self.close_code, self.close_reason = self.on_idle(idle)
                return False
            except Disconnected as e:
                if self.ws is ws:
                    self.connected = False
                return e.dropped
            if message is None:  # the server ended this session's input (a drain)
                return False
            try:
                if isinstance(message, bytes):
                    await self.on_binary(message)
                else:
                    await self.on_text(message)
            except Exception:  # a bug on one message must not end the session silently
                log.exception("session %s: handling a message failed", self.id)
                await self.send_error("internal_error", "the server could not handle that message")
            await self._pace()
        return False

    async def _receive(self, ws: Connection, idle: float) -> bytes | str | None:
        """The next message, or None once `stop_input` was called. TimeoutError after
        `idle` seconds; Disconnected when the connection ended."""
        if self.input_stopped.is_set():
            return None
        self.receiving = recv = asyncio.ensure_future(ws.recv())
        try:
            done, _ = await asyncio.wait({recv}, timeout=idle)
        finally:
            self.receiving = None
            recv.cancel()  # (a no-op once done)
        if recv.cancelled():
            return None
        if not done:
            raise TimeoutError
        return recv.result()

    def stop_input(self, code: int, reason: str, within_s: float = 0.0) -> None:
        """End the session's input at its next pause, or after `within_s` (the server is
        shutting down; at a pause, no word is cut in two between this server and the one the
        client goes on with): what it received is transcribed and sent, then the connection
        closes with `code`."""
        self.close_code, self.close_reason = code, reason
        if within_s <= 0:
            self._stop_reading()
            return
        self.stop_at_pause = True
        asyncio.get_running_loop().call_later(within_s, self._stop_reading)

    def _stop_reading(self) -> None:
        if not self.input_stopped.is_set():
            self.closing = True
            self.input_stopped.set()
            if self.receiving is not None:
                self.receiving.cancel()

    def _watch_for_pause(self) -> None:
        """Stop reading once the engine's VAD (which has heard the audio up to the last
        message or so) hears a pause of STOP_PAUSE_MS."""
        if self.ctx.loop.quiet_ms(self.id) >= STOP_PAUSE_MS:
            self._stop_reading()

    async def _pace(self) -> None:
        """Warn a client that is ahead of the engine, or whose partials the engine sheds for
        load; stop reading while it is far ahead."""
        config, loop = self.ctx.config, self.ctx.loop
        shedding = loop.load.shedding
        if shedding and not self.told_shedding:
            self.ctx.metrics.rate_limited.labels(self.protocol).inc()
            await self.send_warning("rate_limited", "the server is under load: partial results come "
                                    "less often, to keep finals on time")
        self.told_shedding = shedding
        backlog = loop.backlog_s(self.id)
        now = time.monotonic()
        if backlog > config.max_lag_s and now - self.warned_at >= WARN_INTERVAL_S:
            self.warned_at = now
            self.ctx.metrics.rate_limited.labels(self.protocol).inc()
            await self.send_warning(
                "rate_limited", f"the server is {backlog:.1f} s behind this session's audio; "
                f"results are delayed (reading pauses beyond {config.max_backlog_s:g} s)",
                backlog_ms=int(backlog * 1000))
        if backlog >= config.max_backlog_s:  # TCP backpressure: no data is dropped
            await _first(loop.wait_backlog_below(self.id, config.max_backlog_s), self.input_stopped.wait())

    async def _write_loop(self) -> None:
        while True:
            output = await self.outputs.get()
            try:
                async with self.output_lock:
                    await self._handle_output(output)
                if self.spool is not None and output.error is None:
                    self.done_ms = max(self.done_ms, output.done_ms)
                    self.spool.release(self.stored_ms())
            except Exception:  # never leave the session without its writer
                log.exception("session %s: output handling failed", self.id)
            if output.finished:
                self.transcribed = True
                return

    async def _handle_output(self, output: EngineOutput) -> None:
        if output.error is not None:  # the engine dropped the request: end the session
            await self.send_error("engine_error", f"transcription failed: {output.error}")
            self.closing = True
            if self.connected:
                self.connected = False
                await self.ws.close(CLOSE_INTERNAL, "engine error")
        elif output.turns:
            await self.on_turns(output.turns)
        else:
            self._observe(output)
            await self.on_output(output)

    # ------------------------------------------------------------------ helpers

    def parse_json(self, text: str) -> dict[str, Any] | str:
        """A JSON object, or the reason it is not one (nesting too deep for the parser and
        numbers out of range, like 1e400 or NaN, are not)."""
        try:
            message = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
        except ValueError as e:
            return f"message is not valid JSON: {clip_text(str(e))}"
        except RecursionError:
            return "message is not valid JSON: nested too deeply"
        if not isinstance(message, dict):
            return "message must be a JSON object"
        return message

    async def store(self, record: dict[str, Any]) -> None:
        """Write a final to the transcript store before it is sent. If the store cannot
        write now, the record is kept and written later, and the client is told (once, until
        a write succeeds again)."""
        if self.ctx.store.append(self.id, record):
            self.store_warned = False
            return
        self.ctx.metrics.store_failures.inc()
        if not self.store_warned:
            self.store_warned = True
            await self.send_error("store_unavailable", "the server cannot write transcripts to disk "
                                  f"now ({self.ctx.store.failure}); they are kept and written when it "
                                  "can, and results are still sent")

    def ingest(self, samples: torch.Tensor, rate: int | None = None) -> None:
        """(n,) float32 at the session's rate -> the engine (resampled to 16 kHz). A
        container's decoder gives its own `rate`; the resampler follows it, and no other
        audio comes then."""
        if not samples.numel():
            return
        if rate is not None and rate != self.resampler.rate:
            self._feed(self.resampler.flush())
            self.resampler = StreamResampler(rate)
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
        self.num_received += samples.numel()
        self.ctx.metrics.audio_seconds.inc(samples.numel() / self.resampler.rate)
        self._feed(self.resampler.push(samples.numpy()))

    def _feed(self, samples: np.ndarray) -> None:
        if samples.size:
            self.num_fed += samples.size
            if self.spool is not None:  # on disk before the engine has it
                self.spool.write(samples)
            self.ctx.loop.add_audio(self.id, samples)
            if self.stop_at_pause:
                self._watch_for_pause()

    @property
    def fed_ms(self) -> int:
        return samples_to_ms(self.num_fed)

    async def send(self, event: Mapping[str, Any]) -> None:
        if not self.connected:
            return
        text = json.dumps(event, ensure_ascii=False)
        try:
            text.encode()
        except UnicodeEncodeError:  # a lone surrogate from the client's JSON: escape it
            text = json.dumps(event)
        try:
            await self.ws.send(text)
        except Disconnected:
            self.connected = False

    def live_pace(self, now: float) -> bool:
        """Whether the client sends audio no faster than real time (a microphone; not a file
        pushed ahead), give or take AHEAD_SLACK_S of its buffering."""
        if self.first_audio_at is None:
            return True
        return self.fed_ms / 1000 <= now - self.first_audio_at + AHEAD_SLACK_S

    def _observe(self, output: EngineOutput) -> None:
        """Time to first text, partial -> final latency of each committed word, and the lag
        at each final."""
        metrics, now = self.ctx.metrics, time.monotonic()
        if output.committed:
            committed_ms = output.committed[-1].end_ms
            lag_s = max(0, self.fed_ms - committed_ms) / 1000
            metrics.session_lag.observe(lag_s)
            # at a final (it commits the whole window: no tentative tail), of a real-time client
            # (a file pushed ahead lags by its own choice; agreement commits leave a tail)
            if not output.tentative and self.live_pace(now):
                self.ctx.loop.load.note_lag(time.perf_counter(), lag_s)
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

    def stored_ms(self) -> int:
        """Audio before this is transcribed and its text stored (its spool can go)."""
        return self.done_ms

    async def on_text(self, text: str) -> None: ...

    async def on_binary(self, data: bytes) -> None: ...

    async def on_turns(self, turns: list[VadEvent]) -> None:
        """Speech started / stopped events the engine found, for a session that asked
        (EngineLoop.set_turns)."""

    async def on_output(self, output: EngineOutput) -> None: ...

    async def on_input_end(self) -> None:
        """No more client audio: ingest what is still on its way (a container's decoder)."""

    def on_abort(self) -> None:
        """The session is dropped: stop what runs beside it."""

    async def on_resume(self, last_seq: int) -> None:
        """A new connection took over: tell it where the session is, send what it missed."""

    async def on_finished(self) -> None:
        """Everything is transcribed and sent; the socket is about to close."""

    def on_idle(self, idle_s: float) -> tuple[int, str]:
        """No message for `idle_s`: the close code and reason."""
        return CLOSE_POLICY, "idle timeout"

    async def send_error(self, code: str, message: str, **extra: Any) -> None:
        raise NotImplementedError

    async def send_warning(self, code: str, message: str, **extra: Any) -> None:
        """Something the client should know that is not an error (default: an error event)."""
        await self.send_error(code, message, **extra)
