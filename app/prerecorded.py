"""`POST /v1/listen`: Deepgram's pre-recorded transcription, through the engine.

The request body is the audio file (any container ffmpeg reads), or headerless PCM when the
query gives `encoding` (linear16, linear32, mulaw, alaw, float32) with `sample_rate` and
`channels`. A JSON body ({"url": ...}) is refused: this server fetches nothing. Query
parameters (Deepgram's names): `punctuate` / `smart_format` (default false: lowercase words
without punctuation), `utterances` (the transcript split at sentences and pauses),
`model` and `language` (accepted; the running model answers). The answer is Deepgram's
response: `metadata` {transaction_key, request_id, sha256, created, duration, channels,
models, model_info} and `results.channels[0].alternatives[0]` {transcript, confidence,
words[{word, start, end, confidence, punctuated_word}]}, plus `results.utterances`.
Errors are Deepgram's body {"err_code", "err_msg", "request_id"}.
"""

from __future__ import annotations

import hashlib
import io
import uuid
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app import deepgram_events as events
from app import formats
from app.listen import (
    CONTAINER,
    ENCODINGS,
    MAX_CHANNELS,
    alternative,
    check_channels_and_language,
    flag,
    int_param,
    model_metadata,
)
from app.session import ServerContext, query_rate
from app.upload import (
    ClientGone,
    UploadError,
    UploadSlot,
    admit_upload,
    probe_upload,
    transcribe_upload,
    until_disconnected,
)
from audio.container import RawFormat
from audio.io import AudioError


def deepgram_error(status: HTTPStatus, message: str, request_id: str) -> JSONResponse:
    body = {"err_code": status.phrase, "err_msg": message, "request_id": request_id}
    return JSONResponse(body, status.value, headers={"Cache-Control": "no-store"})


def _options(query: str, multilingual: bool) -> dict[str, Any]:
    """The query -> {punctuate, utterances, raw}; ValueError with the fix."""
    params = dict(parse_qsl(query))
    check_channels_and_language(params, multilingual)
    if "callback" in params:
        raise ValueError("callback is not supported; the transcript is the response")
    raw = None
    encoding = params.get("encoding", "").lower()
    if encoding and ENCODINGS.get(encoding) != CONTAINER:  # headerless PCM
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding {encoding!r} is not supported; use linear16, linear32, "
                             "mulaw, alaw or float32, or send a file with a header (wav, ...)")
        if "sample_rate" not in params:
            raise ValueError("headerless audio (encoding=...) needs sample_rate")
        raw = RawFormat(ENCODINGS[encoding], query_rate(params, 16000),
                        int_param(params, "channels", 1, MAX_CHANNELS) or 1)
    return {"punctuate": flag(params, "punctuate") or flag(params, "smart_format"),
            "utterances": flag(params, "utterances"), "raw": raw}


async def listen_file(ctx: ServerContext, request: Request) -> Response:
    request_id = str(uuid.uuid4())
    refusal = admit_upload(ctx, request)
    if refusal is not None:
        return deepgram_error(*refusal, request_id)
    try:
        options = _options(request.url.query, ctx.multilingual)
    except ValueError as e:
        return deepgram_error(HTTPStatus.BAD_REQUEST, str(e), request_id)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json":
        return deepgram_error(HTTPStatus.BAD_REQUEST, "this server fetches no URL: send the audio "
                              "itself as the request body", request_id)
    body = await request.body()
    slot = UploadSlot(ctx, "listen")  # (the body is in memory: nothing to close)
    try:
        source = io.BytesIO(body)
        await probe_upload(source, options["raw"])
        result = await until_disconnected(ctx, request, transcribe_upload(ctx, source, raw=options["raw"]))
        slot.outcome = "ok"
    except AudioError as e:
        return deepgram_error(HTTPStatus.BAD_REQUEST, str(e), request_id)
    except UploadError as e:
        return deepgram_error(e.status, str(e), request_id)
    except ClientGone:
        slot.outcome = "client_gone"
        return Response(status_code=499)
    finally:
        await slot.release()
    model = model_metadata(ctx.model_name)
    metadata = events.PrerecordedMetadata(
        transaction_key="deprecated", request_id=request_id, sha256=hashlib.sha256(body).hexdigest(),
        created=datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        duration=round(result.duration_s, 3), channels=1, models=[model["uuid"]],
        model_info={model["uuid"]: model["info"]})
    results = events.PrerecordedResults(
        channels=[events.Channel(alternatives=[alternative(result.words, options["punctuate"])])])
    if options["utterances"]:
        results["utterances"] = [_utterance(s, options["punctuate"])
                                 for s in formats.segments(result.words)]
    return JSONResponse(events.PrerecordedResponse(metadata=metadata, results=results))


def _utterance(segment: formats.Segment, punctuate: bool) -> events.Utterance:
    alt = alternative(segment.words, punctuate)
    return events.Utterance(start=segment.start, end=segment.end, confidence=alt["confidence"],
                            channel=0, transcript=alt["transcript"], words=alt["words"],
                            id=str(uuid.uuid4()))
