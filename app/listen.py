"""`/v1/listen`: binary PCM frames in, JSON results out.

Query parameters: `sample_rate` (8000-48000, default 16000), `encoding` (`linear16` /
`pcm16`, default, or `float32`), `channels` (1). Binary messages carry audio; text messages
are controls: {"type": "KeepAlive"}, {"type": "Finalize"} (commit everything so far, keep
the stream open) and {"type": "CloseStream"} (commit everything, send the last results,
close with 1000).

Server messages:
- {"type": "Connected", "session_id", "resume_token", "sample_rate", "encoding", "model"}
  first;
- {"type": "Results", "seq", "text", "is_final", "start_ms", "end_ms", "words"}: a final
  result holds newly committed words and is never revised; a partial result is the current
  tentative tail and replaces the previous partial. `from_finalize` marks the final that
  completes a Finalize (it may be empty);
- {"type": "Error", "code", "message"}: the session stays usable unless it is closed;
- {"type": "Warning", "code": "rate_limited", "message", "backlog_ms"}: the server is
  behind this session's audio (results are late; nothing is dropped);
- {"type": "Metadata", "session_id", "duration_ms", "num_finals"} before the close.

Resume: when the connection drops without a close frame, the session waits
`resume_grace_s` (30 s) while its audio is still transcribed. Reconnecting to
`/v1/listen?resume_token=<token>&last_seq=<seq of the last message received>` takes it
over: the server answers Connected with `"resumed": true` and `audio_received_samples`
(samples at the session's rate it has accepted: send the audio from there on), re-sends
the finals after `last_seq`, then the current partial, and the stream goes on.
"""

from __future__ import annotations

from collections import deque
from typing import Any
from urllib.parse import parse_qsl

from websockets.asyncio.server import ServerConnection

from app.session import ServerContext, Session, query_rate, text_of, words_json
from audio.io import AudioError, pcm_to_float
from engine.engine import EngineOutput
from engine.timeline import samples_to_ms
from engine.words import Word

ENCODINGS = {"linear16": "pcm16", "pcm16": "pcm16", "float32": "float32"}
REPLAY_FINALS = 1000  # finals kept for a resume to re-send


def parse_listen_query(query: str) -> dict[str, Any]:
    """Query string -> {"rate", "encoding"} or {"resume_token", "last_seq"}; ValueError with
    the fix for bad values."""
    params = dict(parse_qsl(query))
    if "resume_token" in params:
        try:
            last_seq = int(params.get("last_seq", "0"))
        except ValueError:
            last_seq = -1
        if last_seq < 0:
            raise ValueError(f"last_seq must be an integer >= 0, got {params.get('last_seq')!r}")
        return {"resume_token": params["resume_token"], "last_seq": last_seq}
    rate = query_rate(params, 16000)
    encoding = params.get("encoding", "linear16").lower()
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding {encoding!r} is not supported; use linear16 or float32")
    if params.get("channels", "1") != "1":
        raise ValueError("only mono audio is supported; send channels=1")
    return {"rate": rate, "encoding": ENCODINGS[encoding]}


class ListenSession(Session):
    protocol = "listen"
    resumable = True

    def __init__(self, ws: ServerConnection, ctx: ServerContext, rate: int, encoding: str):
        super().__init__(ws, ctx, rate)
        self.encoding = encoding
        self.seq = 0
        self.num_finals = 0
        self.finalize_pending = False
        self.partial = ""  # text of the last partial sent
        self.partial_words: list[Word] = []
        self.finals: deque[dict[str, Any]] = deque(maxlen=REPLAY_FINALS)  # for a resume
        self.evicted_seq = 0  # the newest final no longer in `finals`

    def _connected(self) -> dict[str, Any]:
        return {"type": "Connected", "session_id": self.id, "resume_token": self.resume_token,
                "sample_rate": self.resampler.rate, "encoding": self.encoding,
                "model": self.ctx.model_name}

    async def on_open(self) -> None:
        await self.send(self._connected())

    async def on_resume(self, last_seq: int) -> None:
        missed = [f for f in self.finals if f["seq"] > last_seq]
        if self.evicted_seq > last_seq:
            await self.send_error("resume_gap", f"finals up to seq {self.evicted_seq} are no longer "
                                  "kept for a resume; they are in the server's transcript store")
        await self.send({**self._connected(), "resumed": True, "last_seq": self.seq,
                         "audio_received_samples": self.num_received,
                         "audio_received_ms": samples_to_ms(self.num_received, self.resampler.rate)})
        for final in missed:
            await self.send(final)
        if self.partial:
            await self.send(self._result(self.partial_words, False))

    async def on_binary(self, data: bytes) -> None:
        try:
            samples = pcm_to_float(data, self.encoding)
        except AudioError as e:
            await self.send_error("invalid_audio", str(e))
            return
        self.ingest(samples)

    async def on_text(self, text: str) -> None:
        message = self.parse_json(text)
        if isinstance(message, str):
            await self.send_error("invalid_json", message)
            return
        kind = message.get("type")
        if kind == "KeepAlive":
            return
        if kind == "Finalize":
            self.finalize_pending = True
            self.ctx.loop.flush(self.id)
        elif kind == "CloseStream":
            self.closing = True
        else:
            await self.send_error("unknown_message",
                                  f"unknown message type {kind!r}; use KeepAlive, Finalize or CloseStream")

    async def on_output(self, output: EngineOutput) -> None:
        from_finalize = output.flushed and self.finalize_pending
        if output.committed or from_finalize:
            result = self._result(output.committed, True)
            if from_finalize:
                result["from_finalize"] = True
                self.finalize_pending = False
            if output.committed:
                self.num_finals += 1
                self.ctx.store.append(self.id, result)
            if len(self.finals) == REPLAY_FINALS:
                self.evicted_seq = self.finals[0]["seq"]
            self.finals.append(result)
            await self.send(result)
        text = text_of(output.tentative)
        if text != self.partial or (output.committed and text):
            self.partial, self.partial_words = text, output.tentative
            await self.send(self._result(output.tentative, False))

    def _result(self, words: list[Word], is_final: bool) -> dict[str, Any]:
        self.seq += 1
        start = words[0].start_ms if words else self.fed_ms
        end = words[-1].end_ms if words else self.fed_ms
        return {"type": "Results", "seq": self.seq, "text": text_of(words), "is_final": is_final,
                "start_ms": start, "end_ms": end, "words": words_json(words)}

    async def on_finished(self) -> None:
        await self.send({"type": "Metadata", "session_id": self.id, "duration_ms": self.fed_ms,
                         "num_finals": self.num_finals})

    async def send_error(self, code: str, message: str, **extra: Any) -> None:
        self.ctx.metrics.client_errors.inc(code=code)
        await self.send({"type": "Error", "code": code, "message": message, **extra})

    async def send_warning(self, code: str, message: str, **extra: Any) -> None:
        await self.send({"type": "Warning", "code": code, "message": message, **extra})
