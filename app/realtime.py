"""`/v1/realtime`: the OpenAI Realtime API's transcription events.

Client events: session.update / transcription_session.update (audio format, turn
detection), input_audio_buffer.append {audio: base64 pcm16}, input_audio_buffer.commit,
input_audio_buffer.clear. Server events: session.created, session.updated /
transcription_session.updated, input_audio_buffer.speech_started / speech_stopped /
committed / cleared, conversation.item.input_audio_transcription.delta / completed, error.

Audio is pcm16 mono at 24 kHz as OpenAI's, or at the rate given in
`session.audio.input.format.rate` (any of 8000-48000) or the `sample_rate` query parameter,
or G.711 at 8 kHz (`audio/pcmu`, `audio/pcma`; beta `g711_ulaw`, `g711_alaw`). The session
reports the running model, whatever model was asked for.
Each turn (the audio between two commits) is one conversation item. With turn detection
(`server_vad`, the default) a turn is committed after `silence_duration_ms` of silence;
with `turn_detection: null` the client commits. In OpenAI's order, each item is announced
once its turn is committed (input_audio_buffer.committed, then conversation.item.added, or
in the beta API, chosen by the `OpenAI-Beta: realtime=v1` header or a
transcription_session.update, conversation.item.created); its deltas follow (the text the
engine committed before that is held back and sent as the first delta), then `completed`
with the whole transcript and `usage` once the engine has committed all audio up to the
turn's end, then (GA) conversation.item.done.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

from app import realtime_events as events
from app.connection import Connection
from app.session import ServerContext, Session, clip_text, new_id, text_of, words_json
from audio.io import AudioError, check_stream_rate, pcm_to_float
from audio.stream import StreamResampler
from audio.vad import TurnSettings, VadEvent
from engine.engine import EngineOutput
from engine.words import Word

OPENAI_RATE = 24000
G711_RATE = 8000
# audio format -> PCM encoding: GA's format types and beta's input_audio_format names
FORMATS = {"audio/pcm": "pcm16", "audio/pcmu": "mulaw", "audio/pcma": "alaw"}
BETA_FORMATS = {"pcm16": "pcm16", "g711_ulaw": "mulaw", "g711_alaw": "alaw"}
MIN_COMMIT_MS = 100  # OpenAI refuses to commit less than 100 ms of audio
DEFAULT_TURN_DETECTION = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                          "silence_duration_ms": 500}


@dataclass
class Item:
    """One turn: audio [start_ms, end_ms) of the session, and its text so far."""

    id: str
    start_ms: int
    end_ms: int | None = None  # set when committed
    words: list[Word] = field(default_factory=list)
    announced: bool = False  # committed and created: its deltas go out
    previous_id: str | None = None  # the item before it in the conversation
    num_sent: int = 0  # words sent in deltas


class RealtimeSession(Session):
    protocol = "realtime"

    def __init__(self, ws: Connection, ctx: ServerContext, rate: int = OPENAI_RATE, beta: bool = False):
        super().__init__(ws, ctx, rate)
        self.beta = beta  # the beta API's event names
        self.transcription: dict[str, Any] = {"model": ctx.model_name, "prompt": "", "language": "en"}
        self.encoding = "pcm16"  # of the appended audio: pcm16, or G.711 mulaw / alaw at 8 kHz
        self.turn_detection: dict[str, Any] | None = dict(DEFAULT_TURN_DETECTION)
        self.items: list[Item] = []  # open items (not completed), oldest first
        self.current: Item | None = None  # the item audio is being appended to
        self.last_item_id: str | None = None  # the last committed item
        self.cleared: list[tuple[int, int]] = []  # [start, end) ms whose text is dropped
        self.event_counter = 0

    # ------------------------------------------------------------------ events out

    async def emit(self, event: events.ServerEvent) -> None:
        """Send an event with its event_id."""
        self.event_counter += 1
        await self.send({"event_id": f"event_{self.id[5:17]}{self.event_counter:06d}", **event})

    async def send_error(self, code: str, message: str, **extra: Any) -> None:
        self.ctx.metrics.client_errors.labels(code).inc()
        server_side = code in ("engine_error", "rate_limited", "internal_error", "server_shutting_down")
        event_id = extra.get("event_id")
        error = events.ErrorDetail(type="server_error" if server_side else "invalid_request_error",
                                   code=code, message=clip_text(message, 300), param=extra.get("param"),
                                   event_id=clip_text(event_id, 64) if isinstance(event_id, str) else None)
        await self.emit(events.ErrorEvent(type="error", error=error))

    def session_object(self) -> dict[str, Any]:
        """The session, in the GA shape (`audio.input`) and the beta fields beside it."""
        rate = self.resampler.rate
        fmt: dict[str, Any] = {"type": next(k for k, v in FORMATS.items() if v == self.encoding)}
        if self.encoding == "pcm16":
            fmt["rate"] = rate
        session = {
            "id": self.id, "object": "realtime.transcription_session", "type": "transcription",
            "audio": {"input": {"format": fmt, "transcription": dict(self.transcription),
                                "turn_detection": self.turn_detection, "noise_reduction": None}},
            "input_audio_format": next(k for k, v in BETA_FORMATS.items() if v == self.encoding),
            "input_audio_sample_rate": rate,
            "input_audio_transcription": dict(self.transcription),
            "turn_detection": self.turn_detection, "include": [],
        }
        if self.beta:  # the beta schema names only OpenAI's models ("whisper-1" is Whisper's)
            # and always has a client secret; a websocket session has none to give
            session["input_audio_transcription"]["model"] = "whisper-1"
            session["client_secret"] = {"value": "", "expires_at": 0}
        return session

    async def on_open(self) -> None:
        self.ctx.loop.set_turns(self.id, self._turn_settings())
        await self.emit(events.SessionEvent(type="session.created", session=self.session_object()))

    # ------------------------------------------------------------------ events in

    async def on_binary(self, data: bytes) -> None:
        await self.send_error("invalid_message", "binary messages are not part of this protocol; "
                              "send input_audio_buffer.append with base64 pcm16 audio")

    async def on_text(self, text: str) -> None:
        event = self.parse_json(text)
        if isinstance(event, str):
            await self.send_error("invalid_json", event)
            return
        kind, event_id = event.get("type"), event.get("event_id")
        handler = {
            "session.update": self._update,
            "transcription_session.update": self._update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit_event,
            "input_audio_buffer.clear": self._clear,
        }.get(kind) if isinstance(kind, str) else None
        if handler is None:
            await self.send_error("unknown_event", f"unknown or unsupported event type {kind!r}",
                                  event_id=event_id, param="type")
            return
        await handler(event)

    async def _update(self, event: dict[str, Any]) -> None:
        session = event.get("session")
        if not isinstance(session, dict):
            await self.send_error("invalid_value", "session must be an object",
                                  event_id=event.get("event_id"), param="session")
            return
        try:  # validate everything before changing anything
            audio = session.get("audio") or {}
            audio_in = audio.get("input") or {}
            if not isinstance(audio_in, dict):
                raise ValueError("session.audio.input must be an object")
            encoding, rate = self._format(session, audio_in)
            transcription = audio_in.get("transcription", session.get("input_audio_transcription"))
            if transcription is not None and not isinstance(transcription, dict):
                raise ValueError("transcription settings must be an object")
            language = (transcription or {}).get("language") or "en"
            if language != "en" and not self.ctx.multilingual:
                raise ValueError(f"language {language!r} is not supported by {self.ctx.model_name}; "
                                 "use en")
            turn_detection = self._turn_detection(audio_in, session)
        except (ValueError, AttributeError, TypeError, OverflowError) as e:
            await self.send_error("invalid_value", str(e), event_id=event.get("event_id"),
                                  param="session")
            return
        if rate != self.resampler.rate:
            self._feed(self.resampler.flush())
            self.resampler = StreamResampler(rate)
        self.encoding = encoding
        if transcription:  # the model is the one running, whatever was asked for
            self.transcription.update({k: v for k, v in transcription.items() if k in ("prompt", "language")})
        if turn_detection != "unchanged":
            self.turn_detection = turn_detection
            self.ctx.loop.set_turns(self.id, self._turn_settings())
        beta_update = event["type"] == "transcription_session.update"
        self.beta = self.beta or beta_update
        await self.emit(events.SessionEvent(
            type="transcription_session.updated" if beta_update else "session.updated",
            session=self.session_object()))

    @staticmethod
    def _turn_detection(audio_in: dict[str, Any], session: dict[str, Any]) -> Any:
        """The new turn detection settings (None: off), or "unchanged"."""
        for source in (audio_in, session):
            if "turn_detection" not in source:
                continue
            td = source["turn_detection"]
            if td is None:
                return None
            if not isinstance(td, dict):
                raise ValueError("turn_detection must be an object or null")
            merged = {**DEFAULT_TURN_DETECTION, **td}
            if merged["type"] not in ("server_vad", "semantic_vad"):
                raise ValueError(f"turn_detection type {merged['type']!r} is not supported; use server_vad")
            threshold, silence = float(merged["threshold"]), int(merged["silence_duration_ms"])
            if not 0.0 <= threshold <= 1.0 or not 0 <= silence <= 10_000:
                raise ValueError("turn_detection needs threshold in 0-1 and silence_duration_ms in 0-10000")
            return merged
        return "unchanged"

    def _format(self, session: dict[str, Any], audio_in: dict[str, Any]) -> tuple[str, int]:
        """The input audio's (PCM encoding, rate) after an update."""
        fmt = audio_in.get("format", session.get("input_audio_format"))
        if fmt is None:
            return self.encoding, self.resampler.rate
        if isinstance(fmt, str):  # beta
            if fmt not in BETA_FORMATS:
                raise ValueError(f"input_audio_format {fmt!r} is not supported; use "
                                 + ", ".join(BETA_FORMATS))
            if BETA_FORMATS[fmt] != "pcm16":
                return BETA_FORMATS[fmt], G711_RATE
            return "pcm16", check_stream_rate(int(session.get("input_audio_sample_rate", OPENAI_RATE)))
        kind = fmt.get("type", "audio/pcm")
        if kind not in FORMATS:
            raise ValueError(f"audio format {kind!r} is not supported; use " + ", ".join(FORMATS))
        if FORMATS[kind] != "pcm16":
            return FORMATS[kind], G711_RATE
        rate = fmt.get("rate", OPENAI_RATE)
        if not isinstance(rate, int) or isinstance(rate, bool):
            raise ValueError(f"format.rate must be an integer, got {rate!r}")
        return "pcm16", check_stream_rate(rate)

    def _turn_settings(self) -> TurnSettings | None:
        td = self.turn_detection
        if td is None:
            return None
        return TurnSettings(float(td.get("threshold", 0.5)), int(td.get("silence_duration_ms", 500)))

    async def _append(self, event: dict[str, Any]) -> None:
        audio = event.get("audio")
        event_id = event.get("event_id")
        if not isinstance(audio, str):
            await self.send_error("invalid_value", "audio must be a base64 string",
                                  event_id=event_id, param="audio")
            return
        try:
            data = base64.b64decode(audio, validate=True)
            samples = pcm_to_float(data, self.encoding)
        except (binascii.Error, ValueError) as e:
            code = "invalid_audio" if isinstance(e, AudioError) else "invalid_base64"
            await self.send_error(code, f"audio could not be decoded: {e}", event_id=event_id,
                                  param="audio")
            return
        if samples.numel() and self.current is None:
            self.current = Item(new_id("item"), self.fed_ms)
            self.items.append(self.current)
        self.ingest(samples)

    async def on_turns(self, turns: list[VadEvent]) -> None:
        if self.turn_detection is None:
            return  # turned off after these were found
        for e in turns:
            if e.kind == "speech_started":
                if self.current is None:
                    self.current = Item(new_id("item"), e.ms)
                    self.items.append(self.current)
                await self.emit(events.SpeechStarted(type="input_audio_buffer.speech_started",
                                                     audio_start_ms=e.ms, item_id=self.current.id))
            elif self.current is not None:
                await self.emit(events.SpeechStopped(type="input_audio_buffer.speech_stopped",
                                                     audio_end_ms=e.ms, item_id=self.current.id))
                await self._commit()

    async def _commit_event(self, event: dict[str, Any]) -> None:
        item = self.current
        if item is None or self.fed_ms - item.start_ms < MIN_COMMIT_MS:
            await self.send_error("input_audio_buffer_commit_empty",
                                  f"buffer too small to commit: at least {MIN_COMMIT_MS} ms of audio "
                                  "must be appended since the last commit",
                                  event_id=event.get("event_id"))
            return
        await self._commit()

    async def _commit(self) -> None:
        item = self.current
        assert item is not None
        item.end_ms = self.fed_ms
        self.current = None
        await self._announce(item)
        self.ctx.loop.flush(self.id)

    async def _announce(self, item: Item) -> None:
        """The turn is committed: say so, create its item, then send the text held for it."""
        item.previous_id, self.last_item_id = self.last_item_id, item.id
        await self.emit(events.Committed(type="input_audio_buffer.committed",
                                         previous_item_id=item.previous_id, item_id=item.id))
        await self.emit(events.ItemEvent(
            type="conversation.item.created" if self.beta else "conversation.item.added",
            previous_item_id=item.previous_id, item=events.item(item.id, None)))
        item.announced = True
        await self._delta(item)

    async def _delta(self, item: Item) -> None:
        """The item's words not sent yet, as one delta (the first one without its lead space)."""
        if item.num_sent < len(item.words):
            delta = "".join(w.text for w in item.words[item.num_sent :])
            if not item.num_sent:
                delta = delta.lstrip()
            item.num_sent = len(item.words)
            await self.emit(events.TranscriptionDelta(
                type="conversation.item.input_audio_transcription.delta", item_id=item.id,
                content_index=0, delta=delta))

    async def _clear(self, event: dict[str, Any]) -> None:
        item = self.current
        if item is not None:  # its audio is already in the engine: drop its text instead
            if self.cleared and self.cleared[-1][1] >= item.start_ms:  # right after the last one
                self.cleared[-1] = (self.cleared[-1][0], self.fed_ms)
            else:
                self.cleared.append((item.start_ms, self.fed_ms))
            self.items.remove(item)
            self.current = None
        await self.emit(events.Cleared(type="input_audio_buffer.cleared"))

    # ------------------------------------------------------------------ engine outputs

    def _item_for(self, word: Word) -> Item | None:
        for start, end in self.cleared:
            if start <= word.start_ms < end:
                return None
        for item in self.items:
            if item.end_ms is None or word.start_ms < item.end_ms:
                return item
        # a word past every committed turn with no open turn: audio after the last commit
        self.current = Item(new_id("item"), word.start_ms)
        self.items.append(self.current)
        return self.current

    async def on_output(self, output: EngineOutput) -> None:
        for word in output.committed:
            item = self._item_for(word)
            if item is not None:
                item.words.append(word)
        # words come in time order: ranges behind the last one, or behind where the engine
        # is done, are done with (clears with no words between them cannot pile up)
        last = max(output.done_ms, output.committed[-1].start_ms if output.committed else 0)
        if self.cleared and self.cleared[0][1] <= last:
            self.cleared = [r for r in self.cleared if r[1] > last]
        for item in list(self.items):
            if item.announced:
                await self._delta(item)
            if output.flushed and item.end_ms is not None and item.end_ms <= output.flushed_ms:
                await self._complete(item)
            elif output.finished and (item.words or item.end_ms is not None):
                if not item.announced:  # the session ended inside a turn: it ends the turn
                    item.end_ms = self.fed_ms
                    if item is self.current:
                        self.current = None
                    await self._announce(item)
                await self._complete(item)

    def stored_ms(self) -> int:
        """Turns not completed yet are not stored: their audio stays spooled."""
        return min([self.done_ms, *(item.start_ms for item in self.items)])

    async def _complete(self, item: Item) -> None:
        self.items.remove(item)
        transcript = text_of(item.words)
        assert item.end_ms is not None
        await self.store({"item_id": item.id, "text": transcript, "start_ms": item.start_ms,
                          "end_ms": item.end_ms, "words": words_json(item.words)})
        usage = events.Usage(type="duration", seconds=round((item.end_ms - item.start_ms) / 1000, 3))
        await self.emit(events.TranscriptionCompleted(
            type="conversation.item.input_audio_transcription.completed", item_id=item.id,
            content_index=0, transcript=transcript, usage=usage))
        if not self.beta:
            await self.emit(events.ItemEvent(type="conversation.item.done",
                                             previous_item_id=item.previous_id,
                                             item=events.item(item.id, transcript)))

