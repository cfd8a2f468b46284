"""`/v1/listen`: Deepgram's live transcription protocol, field for field.

Query parameters (Deepgram's names): `encoding` (linear16, linear32, mulaw, alaw, float32:
headerless PCM; opus or flac: Ogg Opus or FLAC; none: a container if the first message starts
like one (webm from a browser's MediaRecorder, ogg, wav, flac, mp3), else linear16),
`sample_rate` (8000-48000, default 16000; a container's own rate wins), `channels`
(interleaved channels are mixed down to one), `interim_results` (default false), `punctuate`
/ `smart_format` (default false: lowercase words without punctuation, as Deepgram's),
`utterance_end_ms`, `vad_events`, `endpointing` (0-10000 ms: a pause this long ends an
utterance and its final, where longer than the server's `endpoint_ms`; `false` and shorter
ones leave the server's; a longer one suits a talker who stops mid-sentence), `model` and
`language` (accepted; the running model answers). Booleans are `true` / `false`.

Client messages: binary audio frames; {"type": "KeepAlive"}; {"type": "Finalize"} (commit
everything so far, keep the stream open; the final that completes it has `from_finalize`);
{"type": "CloseStream"} (commit everything, send the last results and Metadata, close 1000).

Server messages (Deepgram's types, so an unchanged Deepgram client reads every one):
- Results: `channel.alternatives[0].{transcript, confidence, words[{word, start, end,
  confidence, punctuated_word}]}`, `start`, `duration` (seconds), `is_final`, `speech_final`,
  `from_finalize`, `channel_index`, `metadata`; plus `seq` (for a resume). A final holds
  newly committed words and is never revised; finals cover the stream end to end. A partial
  (interim) is the current tentative tail and replaces the previous one.
- UtteranceEnd (`utterance_end_ms`): a gap that long after the last final word.
- SpeechStarted (`vad_events=true`): the VAD heard speech begin (`timestamp`, seconds).
- Metadata: after CloseStream or an idle timeout, before the close.
- Error {"variant", "code", "description"}: the session stays usable unless it is closed.

Voxtide's own events, only with `voxtide_events=true` (the web page and our clients):
Connected {"session_id", "resume_token", ...} first, and Warning {"code": "rate_limited",
"description", "backlog_ms"} while the server is behind this session's audio.

Resume: when the connection drops without a close frame, the session waits
`resume_grace_s` (30 s) while its audio is still transcribed. Reconnecting to
`/v1/listen?resume_token=<token>&last_seq=<seq of the last message received>` takes it
over: the server answers Connected with `"resumed": true` and `audio_received_samples`
(samples at the session's rate it has accepted: send the audio from there on), re-sends
the finals after `last_seq`, then the current partial, and the stream goes on.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

import numpy as np
import torch

from app import deepgram_events as events
from app.connection import CLOSE_INTERNAL, Connection
from app.session import ServerContext, Session, clip_text, query_rate, text_of, words_json
from audio.container import StreamDecoder, is_container
from audio.io import AudioError, pcm_to_float
from audio.vad import TurnSettings, VadEvent
from engine.engine import EngineOutput
from engine.timeline import samples_to_ms
from engine.words import Word

ENCODINGS = {"linear16": "pcm16", "pcm16": "pcm16", "linear32": "linear32", "float32": "float32",
             "mulaw": "mulaw", "alaw": "alaw", "opus": "container", "flac": "container"}
CONTAINER, SNIFF = "container", "sniff"  # decoded by PyAV; a container or linear16, by its start
MAX_CHANNELS = 8
MAX_ENDPOINTING_MS = 10_000  # as the server's endpoint_ms
REPLAY_FINALS = 1000  # finals kept for a resume to re-send
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")
ENGLISH = ("en", "en-us", "en-gb", "en-au", "en-in", "en-nz")


@dataclass(frozen=True)
class ListenOptions:
    rate: int = 16000
    encoding: str = SNIFF  # an audio.io PCM encoding, CONTAINER, or SNIFF (no encoding given)
    channels: int = 1
    interim_results: bool = False
    punctuate: bool = False
    utterance_end_ms: int | None = None
    endpoint_ms: int | None = None  # `endpointing`: the session's own pause (Stream.set_endpoint)
    vad_events: bool = False
    voxtide_events: bool = False


def flag(params: dict[str, str], name: str) -> bool:
    value = params.get(name, "false").lower()
    if value not in TRUE + FALSE:
        raise ValueError(f"{name} must be true or false, got {params[name]!r}")
    return value in TRUE


def int_param(params: dict[str, str], name: str, low: int, high: int) -> int | None:
    if name not in params:
        return None
    try:
        value = int(params[name])
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}-{high}, got {params[name]!r}")
    return value


def check_channels_and_language(params: dict[str, str], multilingual: bool) -> None:
    """What live and pre-recorded requests refuse alike: multichannel, a language the model
    does not speak. ValueError with the fix."""
    if flag(params, "multichannel"):
        raise ValueError("multichannel=true is not supported; channels are mixed down to one")
    language = params.get("language", "en").lower()
    if not multilingual and language not in ENGLISH:
        raise ValueError(f"language {language!r} is not supported by this English-only model; use en")


def parse_listen_query(query: str, multilingual: bool = False) -> ListenOptions | dict[str, Any]:
    """Query string -> ListenOptions, or {"resume_token", "last_seq"}; ValueError with the
    fix for bad values."""
    params = dict(parse_qsl(query))
    if "resume_token" in params:
        return {"resume_token": params["resume_token"],
                "last_seq": int_param(params, "last_seq", 0, 1 << 62) or 0}
    encoding = params.get("encoding", SNIFF).lower()
    if encoding not in ENCODINGS and encoding != SNIFF:
        raise ValueError(f"encoding {encoding!r} is not supported; use linear16, linear32, mulaw, "
                         "alaw, float32, opus or flac, or none for containerized audio")
    check_channels_and_language(params, multilingual)
    endpoint_ms = None
    if params.get("endpointing", "10").lower() not in FALSE:
        endpoint_ms = int_param(params, "endpointing", 0, MAX_ENDPOINTING_MS)
    return ListenOptions(
        rate=query_rate(params, 16000), encoding=ENCODINGS.get(encoding, SNIFF),
        channels=int_param(params, "channels", 1, MAX_CHANNELS) or 1,
        interim_results=flag(params, "interim_results"),
        punctuate=flag(params, "punctuate") or flag(params, "smart_format"),
        utterance_end_ms=int_param(params, "utterance_end_ms", 1000, 60_000), endpoint_ms=endpoint_ms,
        vad_events=flag(params, "vad_events"), voxtide_events=flag(params, "voxtide_events"))


def plain_word(word: Word) -> str:
    """A word as Deepgram writes it without punctuation: lowercase, no punctuation around it
    ("cold-hearted" and "don't" keep theirs inside)."""
    return re.sub(r"^[^\w']+|[^\w']+$", "", word.text.strip().lower())


def deepgram_words(words: list[Word], punctuate: bool) -> list[events.DeepgramWord]:
    """Deepgram's words: lowercase without punctuation, and `punctuated_word` as decoded."""
    out = []
    for w in words:
        if plain := plain_word(w):
            word = events.DeepgramWord(word=plain, start=w.start_ms / 1000, end=w.end_ms / 1000,
                                       confidence=round(w.probability or 0.0, 4))
            if punctuate:
                word["punctuated_word"] = w.text.strip()
            out.append(word)
    return out


def alternative(words: list[Word], punctuate: bool) -> events.Alternative:
    """The one alternative of a result: its transcript, confidence (the words' mean) and words."""
    items = deepgram_words(words, punctuate)
    transcript = text_of(words) if punctuate else " ".join(w["word"] for w in items)
    confidence = sum(w["confidence"] for w in items) / len(items) if items else 0.0
    return events.Alternative(transcript=transcript, confidence=round(confidence, 4), words=items)


def model_metadata(model_name: str) -> dict[str, Any]:
    """Deepgram's model block: a stable uuid for the running model."""
    model_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"voxtide:{model_name}"))
    return {"uuid": model_uuid, "info": {"name": model_name, "version": "voxtide", "arch": "whisper"}}


class ListenSession(Session):
    protocol = "listen"
    resumable = True

    def __init__(self, ws: Connection, ctx: ServerContext, options: ListenOptions):
        super().__init__(ws, ctx, options.rate)
        self.options = options
        self.created = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        model = model_metadata(ctx.model_name)
        self.model_uuid, self.model_info = model["uuid"], model["info"]
        self.seq = 0
        self.num_finals = 0
        self.finalize_pending = False  # a Finalize not yet completed by a final
        self.final_end_ms = 0  # where the next final starts: finals cover the stream end to end
        self.partial = ""  # text of the last partial sent
        self.partial_words: list[Word] = []
        self.finals: deque[dict[str, Any]] = deque(maxlen=REPLAY_FINALS)  # for a resume
        self.evicted_seq = 0  # the newest final no longer in `finals`
        self.last_word_end_ms: int | None = None  # of the last final word, until UtteranceEnd
        self.encoding = options.encoding  # SNIFF until the first audio message says
        self.decoder: StreamDecoder | None = None  # a container's, from its first message on
        self.decode_error: str | None = None  # the decoder's, reported once
        self.controls: dict[str, Callable[[], Awaitable[None]]] = {
            "KeepAlive": self._keep_alive, "Finalize": self._finalize, "CloseStream": self._close_stream}

    def _connected(self) -> events.Connected:
        return events.Connected(type="Connected", session_id=self.id, resume_token=self.resume_token,
                                sample_rate=self.resampler.rate, encoding=self.encoding,
                                model=self.ctx.model_name)

    async def on_open(self) -> None:
        if self.options.endpoint_ms:
            self.ctx.loop.set_endpoint(self.id, self.options.endpoint_ms)
        if self.options.vad_events:
            self.ctx.loop.set_turns(self.id, TurnSettings())
        if self.options.voxtide_events:
            await self.send(self._connected())

    async def on_resume(self, last_seq: int) -> None:
        missed = [f for f in self.finals if f["seq"] > last_seq]
        if self.evicted_seq > last_seq:
            await self.send_error("resume_gap", f"finals up to seq {self.evicted_seq} are no longer "
                                  "kept for a resume; they are in the server's transcript store")
        resumed = self._connected()
        resumed.update(resumed=True, last_seq=self.seq, audio_received_samples=self.num_received,
                       audio_received_ms=samples_to_ms(self.num_received, self.resampler.rate))
        await self.send(resumed)
        for final in missed:
            await self.send(final)
        if self.partial and self.options.interim_results:
            await self.send(self._result(self.partial_words, False))

    # ------------------------------------------------------------------ client messages

    async def on_binary(self, data: bytes) -> None:
        if self.encoding == SNIFF:
            self.encoding = CONTAINER if is_container(data) else "pcm16"
        if self.encoding == CONTAINER:
            self._decode(data)
        else:
            try:
                samples = pcm_to_float(data, self.encoding, self.options.channels)
            except AudioError as e:
                await self.send_error("invalid_audio", str(e), variant="DataError")
                return
            self.ingest(samples)
        await self._after_audio()

    async def _after_audio(self) -> None:
        if self.decode_error is not None:
            await self.send_error("invalid_audio", self.decode_error, variant="DataError")
            self.decode_error = ""  # once
        await self._utterance_end()

    def _decode(self, data: bytes) -> None:
        """Feed a container's bytes to its decoder (started by the first ones); the audio
        comes back on the event loop as it is decoded."""
        if self.decoder is None:
            loop = asyncio.get_running_loop()
            self.decoder = StreamDecoder(
                lambda samples, rate: loop.call_soon_threadsafe(self._decoded, samples, rate),
                lambda message: loop.call_soon_threadsafe(setattr, self, "decode_error", message))
            if self.resume_token is not None:  # a container cannot be taken up mid-stream
                self.ctx.resumable.pop(self.resume_token, None)
                self.resume_token = None
        self.decoder.feed(data)

    def _decoded(self, samples: np.ndarray, rate: int) -> None:
        if not self.ended:
            self.ingest(torch.from_numpy(samples), rate)

    async def on_input_end(self) -> None:
        if self.decoder is not None:
            self.decoder.close()
            # the decoder's last calls are queued on the event loop before this wakes up
            await asyncio.to_thread(self.decoder.thread.join)
            await self._after_audio()

    def on_abort(self) -> None:
        if self.decoder is not None:
            self.decoder.close()

    async def on_turns(self, turns: list[VadEvent]) -> None:
        for e in turns:
            if e.kind == "speech_started":
                await self.send(events.SpeechStarted(type="SpeechStarted", channel=[0],
                                                     timestamp=e.ms / 1000))

    async def on_text(self, text: str) -> None:
        message = self.parse_json(text)
        if isinstance(message, str):
            await self.send_error("invalid_json", message, variant="SchemaError")
            return
        control = self.controls.get(message.get("type"))  # type: ignore[arg-type]
        if control is None:
            await self.send_error("unknown_message", "unknown message type; use KeepAlive, Finalize or "
                                  "CloseStream", variant="SchemaError")
            return
        await control()

    async def _keep_alive(self) -> None:
        pass

    async def _finalize(self) -> None:
        self.finalize_pending = True
        self.ctx.loop.flush(self.id)

    async def _close_stream(self) -> None:
        self.closing = True

    # ------------------------------------------------------------------ engine outputs

    async def on_output(self, output: EngineOutput) -> None:
        # the engine ends a flush's final at the flush: it completes every Finalize before it
        from_finalize = output.flushed and self.finalize_pending
        if output.committed or from_finalize:
            end_ms = max(output.flushed_ms or 0, output.committed[-1].end_ms if output.committed else 0)
            if from_finalize:
                self.finalize_pending = False
            await self._final(output.committed, end_ms, not output.tentative, from_finalize)
        text = text_of(output.tentative)
        if text != self.partial or (output.committed and text):
            self.partial, self.partial_words = text, output.tentative
            if self.options.interim_results:
                await self.send(self._result(output.tentative, False))
        await self._utterance_end()

    async def _final(self, words: list[Word], end_ms: int, speech_final: bool,
                     from_finalize: bool = False) -> None:
        result = self._result(words, True, end_ms, speech_final=speech_final, from_finalize=from_finalize)
        self.final_end_ms = max(self.final_end_ms, end_ms)
        if words:
            self.num_finals += 1
            self.last_word_end_ms = words[-1].end_ms
            await self.store({"seq": result["seq"], "text": text_of(words),
                              "start_ms": words[0].start_ms, "end_ms": words[-1].end_ms,
                              "words": words_json(words)})
        if len(self.finals) == REPLAY_FINALS:
            self.evicted_seq = self.finals[0]["seq"]
        self.finals.append(result)
        await self.send(result)

    async def _utterance_end(self) -> None:
        """Deepgram's UtteranceEnd: `utterance_end_ms` of decoded audio with no word after the
        last final word."""
        gap, last = self.options.utterance_end_ms, self.last_word_end_ms
        if gap is None or last is None or self.partial:
            return
        decoded = self.ctx.loop.engine.decoded_samples(self.id)
        if decoded is not None and samples_to_ms(decoded) - last >= gap:
            self.last_word_end_ms = None
            await self.send(events.UtteranceEnd(type="UtteranceEnd", channel=[0, 1],
                                                last_word_end=last / 1000))

    def _result(self, words: list[Word], is_final: bool, end_ms: int | None = None, *,
                speech_final: bool = False, from_finalize: bool = False) -> events.Results:
        self.seq += 1
        start = self.final_end_ms
        end = max(start, end_ms if end_ms is not None else (words[-1].end_ms if words else start))
        punctuate = self.options.punctuate
        return events.Results(
            type="Results", channel_index=[0, 1], duration=(end - start) / 1000, start=start / 1000,
            is_final=is_final, speech_final=speech_final, from_finalize=from_finalize,
            channel=events.Channel(alternatives=[alternative(words, punctuate)]),
            metadata=events.ResultMetadata(request_id=self.id, model_info=self.model_info,
                                           model_uuid=self.model_uuid),
            seq=self.seq)

    async def on_finished(self) -> None:
        await self.send(events.Metadata(
            type="Metadata", transaction_key="deprecated", request_id=self.id, sha256="incomplete",
            created=self.created, duration=self.num_received / self.resampler.rate,
            channels=self.options.channels, models=[self.model_uuid],
            model_info={self.model_uuid: self.model_info}, num_finals=self.num_finals))

    def on_idle(self, idle_s: float) -> tuple[int, str]:
        return CLOSE_INTERNAL, f"NET-0001: no audio or message for {idle_s:g} s"

    async def send_error(self, code: str, message: str, **extra: Any) -> None:
        self.ctx.metrics.client_errors.labels(code).inc()
        variant = extra.pop("variant", "ServerError" if code == "engine_error" else "ClientError")
        await self.send({**events.Error(type="Error", variant=variant, code=code,
                                        description=clip_text(message, 300)), **extra})

    async def send_warning(self, code: str, message: str, **extra: Any) -> None:
        if self.options.voxtide_events:
            await self.send({**events.Warning(type="Warning", code=code, description=message), **extra})
