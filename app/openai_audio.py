"""`POST /v1/audio/transcriptions`: OpenAI's transcription endpoint, through the engine.

A multipart form, as the openai SDK sends it: `file` (required; any container ffmpeg reads),
`model` (any name; the running model answers), `language` (en for an English-only model),
`prompt` and `temperature` (accepted; the engine decodes with its own prompt and fallback
temperatures), `response_format` json (default) / text / srt / vtt / verbose_json,
`timestamp_granularities[]` segment (default) and/or word (verbose_json only), and
`stream` true: server-sent events `transcript.text.delta` as text is committed, then
`transcript.text.done`. Errors are OpenAI's body {"error": {message, type, param, code}}.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from starlette.background import BackgroundTask
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from app import formats
from app.session import ServerContext, text_of
from app.upload import (
    ClientGone,
    UploadError,
    UploadResult,
    UploadSlot,
    admit_upload,
    probe_upload,
    transcribe_upload,
    until_disconnected,
)
from audio.io import AudioError
from engine.timeline import POSITIONS_PER_SECOND
from engine.words import Word

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")
ENGLISH = ("en", "english")
MAX_FIELDS = 32


def openai_error(status: HTTPStatus, code: str, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return JSONResponse(body, status.value, headers={"Cache-Control": "no-store"})


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


def _options(form: Any, multilingual: bool) -> dict[str, Any]:
    """The form's fields -> options; BadRequest naming the field at fault."""
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise BadRequest("the form has no `file` part: send the audio as a file", "file", "missing_file")
    response_format = str(form.get("response_format") or "json")
    if response_format not in RESPONSE_FORMATS:
        raise BadRequest(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got "
                         f"{response_format!r}", "response_format")
    granularities = [str(g) for g in form.getlist("timestamp_granularities[]")
                     + form.getlist("timestamp_granularities")]
    for g in granularities:
        if g not in GRANULARITIES:
            raise BadRequest(f"timestamp_granularities must be segment or word, got {g!r}",
                             "timestamp_granularities")
    if granularities and response_format != "verbose_json":
        raise BadRequest("timestamp_granularities needs response_format verbose_json",
                         "timestamp_granularities")
    language = str(form.get("language") or "en").lower()
    if not multilingual and language not in ENGLISH:
        raise BadRequest(f"language {language!r} is not supported by this English-only model; use en",
                         "language", "unsupported_language")
    temperature = form.get("temperature")
    if temperature is not None:
        try:
            float(str(temperature))
        except ValueError:
            raise BadRequest(f"temperature must be a number, got {temperature!r}", "temperature") from None
    stream = str(form.get("stream") or "false").lower()
    if stream not in ("true", "false"):
        raise BadRequest(f"stream must be true or false, got {stream!r}", "stream")
    return {"file": upload, "response_format": response_format, "stream": stream == "true",
            "granularities": granularities or ["segment"]}


async def transcriptions(ctx: ServerContext, request: Request) -> Response:
    refusal = admit_upload(ctx, request)
    if refusal is not None:
        status, message = refusal
        return openai_error(status, status.phrase.lower().replace(" ", "_"), message)
    try:
        form = await request.form(max_files=1, max_fields=MAX_FIELDS)
    except HTTPException as e:  # a malformed multipart body
        return openai_error(HTTPStatus.BAD_REQUEST, "invalid_multipart", f"bad form: {e.detail}")
    slot: UploadSlot | None = UploadSlot(ctx, "openai", form.close)
    try:
        options = _options(form, ctx.multilingual)
        source = options["file"].file
        await probe_upload(source)
        if options["stream"]:  # the slot goes with the response, which reads the file
            streamed, slot = slot, None
            return StreamingResponse(_events(ctx, source, streamed), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-store"},
                                     background=BackgroundTask(streamed.release))
        result = await until_disconnected(ctx, request, transcribe_upload(ctx, source))
        slot.outcome = "ok"
        return _response(result, options["response_format"], options["granularities"])
    except BadRequest as e:
        return openai_error(HTTPStatus.BAD_REQUEST, e.code, str(e), e.param)
    except AudioError as e:
        return openai_error(HTTPStatus.BAD_REQUEST, "invalid_audio", str(e), "file")
    except UploadError as e:
        return openai_error(e.status, "server_error", str(e))
    except ClientGone:
        if slot is not None:
            slot.outcome = "client_gone"
        return Response(status_code=499)
    finally:
        if slot is not None:
            await slot.release()


def _usage(result: UploadResult) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(result.duration_s)}


def _response(result: UploadResult, response_format: str, granularities: list[str]) -> Response:
    text = text_of(result.words)
    if response_format == "json":
        return JSONResponse({"text": text, "usage": _usage(result)})
    segments = formats.segments(result.words)
    if response_format == "text":
        return PlainTextResponse(text + "\n")
    if response_format == "srt":
        return PlainTextResponse(formats.srt(segments))
    if response_format == "vtt":
        return PlainTextResponse(formats.vtt(segments), media_type="text/vtt")
    body: dict[str, Any] = {"task": "transcribe", "language": "english",
                            "duration": round(result.duration_s, 3), "text": text}
    if "segment" in granularities:
        body["segments"] = [_segment_json(i, s) for i, s in enumerate(segments)]
    if "word" in granularities:
        body["words"] = [{"word": w.text.strip(), "start": w.start_ms / 1000, "end": w.end_ms / 1000}
                         for w in result.words]
    body["usage"] = _usage(result)
    return JSONResponse(body)


def _segment_json(i: int, s: formats.Segment) -> dict[str, Any]:
    return {"id": i, "seek": round(s.start * 100), "start": s.start, "end": s.end, "text": " " + s.text,
            "tokens": s.tokens, "temperature": 0.0, "avg_logprob": round(s.avg_logprob, 4),
            "compression_ratio": round(s.compression_ratio, 4), "no_speech_prob": 0.0}


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


async def _events(ctx: ServerContext, source: Any, slot: UploadSlot) -> AsyncIterator[bytes]:
    """transcript.text.delta per batch of committed words, then transcript.text.done (or an
    error event, which the openai SDK raises as APIError)."""
    deltas: asyncio.Queue[list[Word] | None] = asyncio.Queue()

    async def on_words(words: list[Word]) -> None:
        deltas.put_nowait(words)

    async def run() -> UploadResult:
        try:
            return await transcribe_upload(ctx, source, on_words)
        finally:
            deltas.put_nowait(None)

    task = asyncio.create_task(run())
    words: list[Word] = []
    try:
        while (batch := await deltas.get()) is not None:
            delta = "".join(w.text for w in batch)
            yield _sse({"type": "transcript.text.delta", "delta": delta.lstrip() if not words else delta})
            words += batch
        try:
            result = await task
        except (AudioError, UploadError) as e:
            kind, code = (("invalid_request_error", "invalid_audio") if isinstance(e, AudioError)
                          else ("server_error", "server_error"))
            yield _sse({"error": {"message": str(e), "type": kind, "param": None, "code": code}})
            return
        audio_tokens = math.ceil(result.duration_s * POSITIONS_PER_SECOND)
        output_tokens = sum(len(w.tokens) for w in words)
        usage = {"type": "tokens", "input_tokens": audio_tokens, "output_tokens": output_tokens,
                 "total_tokens": audio_tokens + output_tokens,
                 "input_token_details": {"audio_tokens": audio_tokens, "text_tokens": 0}}
        yield _sse({"type": "transcript.text.done", "text": text_of(words), "usage": usage})
        slot.outcome = "ok"
    finally:
        task.cancel()  # (the client went away: the file's request is aborted)
