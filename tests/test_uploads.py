"""Pre-recorded files over HTTP on the real model: OpenAI's POST /v1/audio/transcriptions and
Deepgram's POST /v1/listen, driven by the official SDKs unchanged and checked against
their typed models; containers, raw PCM, errors, and files beside live sessions."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re

import httpx
import numpy as np
import openai
import pytest
import torch
from deepgram import DeepgramClient
from deepgram.core.api_error import ApiError
from deepgram.environment import DeepgramClientEnvironment
from deepgram.types import ListenV1Response
from openai.types.audio import (
    Transcription,
    TranscriptionTextDeltaEvent,
    TranscriptionTextDoneEvent,
    TranscriptionVerbose,
)

from app.replay import transcript
from tests.helpers import encode
from tests.server_client import g711, pcm16_at, running_server, wait_until
from tests.server_client import listen as listen_live
from tests.test_server import clip, error_rate

KEY = "upload-key"
GAP_S = 2.5


def two_utterances() -> tuple[torch.Tensor, float, str]:
    """Two recordings with a pause -> (audio, where the second one starts in s, reference)."""
    (first, first_ref), (second, second_ref) = clip("0930"), clip("0890")
    audio = torch.cat([first, torch.zeros(int(GAP_S * 16000)), second])
    return audio, first.numel() / 16000 + GAP_S, f"{first_ref} {second_ref}"


def openai_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)


def deepgram_client(server) -> DeepgramClient:
    base = f"127.0.0.1:{server.port}"
    environment = DeepgramClientEnvironment(base=f"http://{base}", production=f"ws://{base}",
                                            agent=f"ws://{base}", agent_rest=f"http://{base}")
    return DeepgramClient(api_key=KEY, environment=environment)


async def test_openai_sdk_transcribes_a_file_in_every_response_format(tmp_path):
    audio, second_start, reference = two_utterances()
    mp3 = encode(audio, "mp3", "libmp3lame")
    file = ("speech.mp3", mp3, "audio/mpeg")
    async with running_server(tmp_path, api_key=KEY) as server, openai_client(server) as client:
        create = client.audio.transcriptions.create
        raw = await client.audio.transcriptions.with_raw_response.create(model="whisper-1", file=file)
        result = Transcription.model_validate(json.loads(raw.text), strict=True)
        assert error_rate(reference, result.text) < 0.2, result.text
        assert result.usage is not None and result.usage.seconds == math.ceil(audio.numel() / 16000)

        text = await create(model="whisper-1", file=file, response_format="text")
        assert text.strip() == result.text  # each upload runs alone: the same decode

        raw = await client.audio.transcriptions.with_raw_response.create(
            model="whisper-1", file=file, response_format="verbose_json",
            timestamp_granularities=["word", "segment"])
        verbose = TranscriptionVerbose.model_validate(json.loads(raw.text), strict=True)
        assert verbose.text == result.text and verbose.language == "english"
        assert abs(verbose.duration - audio.numel() / 16000) < 0.05
        words, segments = verbose.words or [], verbose.segments or []
        assert " ".join(w.word for w in words) == result.text
        assert all(a.start <= a.end <= b.start for a, b in zip(words, words[1:], strict=False))
        assert len(segments) == 2 and "".join(s.text for s in segments).strip() == result.text
        assert segments[1].id == 1 and segments[1].tokens
        # times come from the audio: the second utterance starts after the pause
        assert abs(segments[1].start - second_start) < 0.4, (segments[1].start, second_start)
        assert segments[0].end < second_start - GAP_S + 0.5

        only_words = await create(model="whisper-1", file=file, response_format="verbose_json",
                                  timestamp_granularities=["word"])
        assert only_words.segments is None and [w.word for w in only_words.words or []] == [
            w.word for w in words]

        srt = await create(model="whisper-1", file=file, response_format="srt")
        blocks = srt.strip().split("\n\n")
        assert len(blocks) == 2
        for i, (block, segment) in enumerate(zip(blocks, segments, strict=True), 1):
            number, times, body = block.split("\n")
            assert number == str(i) and body == segment.text.strip()
            assert re.fullmatch(r"\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}", times)
        vtt = await create(model="whisper-1", file=file, response_format="vtt")
        assert vtt.startswith("WEBVTT\n") and vtt.count(" --> ") == 2 and "." in vtt.split(" --> ")[0]

        events = [e async for e in await create(model="whisper-1", file=file, stream=True)]
        *deltas, done = events
        assert deltas and all(TranscriptionTextDeltaEvent.model_validate(e.to_dict(), strict=True)
                              for e in deltas)
        done = TranscriptionTextDoneEvent.model_validate(done.to_dict(), strict=True)
        assert "".join(e.delta for e in deltas) == done.text == result.text
        assert done.usage is not None and done.usage.output_tokens > 0


FORMATS = [  # container, codec, rate, channels
    ("flac", "flac", 16000, 1), ("ogg", "libopus", 48000, 2), ("webm", "libopus", 48000, 1),
    ("mp4", "aac", 22050, 1), ("wav", "pcm_s16le", 44100, 2)]


async def test_deepgram_sdk_transcribes_containers_and_raw_pcm(tmp_path):
    audio, second_start, reference = two_utterances()
    async with running_server(tmp_path, api_key=KEY) as server:
        client = deepgram_client(server)
        wav = encode(audio, "wav", "pcm_s16le")
        result = await asyncio.to_thread(client.listen.v1.media.transcribe_file, request=wav,
                                         model="nova-3", punctuate=True, utterances=True)
        async with httpx.AsyncClient(timeout=60) as http:  # the same request, for its raw body
            raw = await http.post(f"http://127.0.0.1:{server.port}/v1/listen?punctuate=true&utterances=true",
                                  content=wav, headers={"Authorization": f"Token {KEY}"})
        # the SDK's model of the response validates it (lax: `created` is an ISO string on the wire)
        assert ListenV1Response.model_validate(raw.json()).results.channels[0].alternatives[0].transcript
        metadata, alternative = result.metadata, result.results.channels[0].alternatives[0]
        assert metadata.sha256 == hashlib.sha256(wav).hexdigest() and metadata.channels == 1
        assert abs(metadata.duration - audio.numel() / 16000) < 0.01
        assert list(metadata.model_info) == metadata.models
        assert error_rate(reference, alternative.transcript) < 0.2, alternative.transcript
        words = alternative.words or []
        assert all(w.word == re.sub(r"^[^\w']+|[^\w']+$", "", w.punctuated_word.lower()) for w in words)
        assert 0 < alternative.confidence <= 1 and all(0 < w.confidence <= 1 for w in words)
        utterances = result.results.utterances or []
        assert len(utterances) == 2 and abs(utterances[1].start - second_start) < 0.4
        assert " ".join(u.transcript for u in utterances) == alternative.transcript

        plain = await asyncio.to_thread(client.listen.v1.media.transcribe_file, request=wav)
        plain_text = plain.results.channels[0].alternatives[0].transcript
        assert plain_text == plain_text.lower() and not re.search(r"[.,?!]", plain_text)
        assert plain.results.utterances is None

        for fmt, codec, rate, channels in FORMATS:
            data = encode(audio, fmt, codec, rate, channels)
            got = await asyncio.to_thread(client.listen.v1.media.transcribe_file, request=data)
            text = got.results.channels[0].alternatives[0].transcript
            assert error_rate(reference, text) < 0.2, (fmt, codec, text)
            assert abs(got.metadata.duration - audio.numel() / 16000) < 0.1, (fmt, got.metadata.duration)

        for encoding, data in (("linear16", pcm16_at(audio, 8000)),
                               ("mulaw", g711(pcm16_to_float(pcm16_at(audio, 8000)), "mulaw"))):
            rate = {"additional_query_parameters": {"sample_rate": 8000}}
            got = await asyncio.to_thread(client.listen.v1.media.transcribe_file, request=data,
                                          encoding=encoding, request_options=rate)
            text = got.results.channels[0].alternatives[0].transcript
            assert error_rate(reference, text) < 0.25, (encoding, text)

        with pytest.raises(ApiError) as refused:
            await asyncio.to_thread(client.listen.v1.media.transcribe_url, url="http://example.com/a.wav")
        assert refused.value.status_code == 400 and "fetches no URL" in refused.value.body["err_msg"]


def pcm16_to_float(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768


async def test_bad_uploads_get_clear_4xx_answers(tmp_path):
    audio, _, _ = two_utterances()
    wav = encode(audio[:16000], "wav", "pcm_s16le")
    async with running_server(tmp_path, api_key=KEY, max_upload_bytes=200_000) as server:
        base = f"http://127.0.0.1:{server.port}"
        auth = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            async def transcribe(files=None, data=None, headers=auth):
                return await http.post("/v1/audio/transcriptions", files=files, data=data, headers=headers)

            r = await transcribe({"file": ("a.wav", wav)}, headers={})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await transcribe({"file": ("a.txt", b"not audio at all" * 100)})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_audio"
            assert "cannot read this audio" in r.json()["error"]["message"]
            r = await transcribe({"file": ("a.wav", wav)}, {"response_format": "xml"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
            r = await transcribe({"file": ("a.wav", wav)}, {"timestamp_granularities[]": "word"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "timestamp_granularities"
            r = await transcribe({"file": ("a.wav", wav)}, {"language": "fr"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "language"
            r = await transcribe(data={"model": "whisper-1"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "file"
            r = await transcribe({"file": ("a.wav", wav + bytes(200_000))})
            assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
            r = await http.get("/v1/audio/transcriptions", headers=auth)
            assert r.status_code == 405

            for query, body, problem in (("multichannel=true", wav, "multichannel"),
                                         ("encoding=speex&sample_rate=16000", wav, "speex"),
                                         ("encoding=linear16", wav, "sample_rate"),
                                         ("", b"\x00" * 5000, "cannot read this audio")):
                r = await http.post(f"/v1/listen?{query}", content=body, headers=auth)
                assert r.status_code == 400 and problem in r.json()["err_msg"], (query, r.text)
                assert set(r.json()) == {"err_code", "err_msg", "request_id"}
            r = await http.post("/v1/listen", content=wav, headers={"Authorization": "Token nope"})
            assert r.status_code == 401
            assert server.ctx.uploads == 0 and server.engine.num_requests == 0
    async with running_server(tmp_path, max_uploads=0) as server:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            r = await http.post("/v1/listen", content=wav)
            assert r.status_code == 429 and "try again later" in r.json()["err_msg"]


async def test_a_client_that_leaves_mid_stream_ends_its_files_request(tmp_path):
    audio, _, _ = two_utterances()
    long = torch.cat([audio] * 6)  # about a minute
    async with running_server(tmp_path) as server:
        url = f"http://127.0.0.1:{server.port}/v1/audio/transcriptions"
        async with httpx.AsyncClient(timeout=120) as http:
            files = {"file": ("long.flac", encode(long, "flac", "flac"))}
            async with http.stream("POST", url, files=files, data={"stream": "true"}) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        assert json.loads(line[6:])["type"] == "transcript.text.delta"
                        break  # gone after the first delta, long before the end
        await wait_until(lambda: server.engine.num_requests == 0 and server.ctx.uploads == 0, 60)
        assert server.metrics.value("voxtide_uploads_total", endpoint="openai", outcome="error") == 1


async def test_a_live_session_and_a_file_share_the_engine(tmp_path):
    audio, _, reference = two_utterances()
    long = torch.cat([audio] * 4)
    async with running_server(tmp_path) as server, openai_client(server) as client:
        upload = asyncio.create_task(client.audio.transcriptions.create(
            model="whisper-1", file=("long.flac", encode(long, "flac", "flac"))))
        await wait_until(lambda: server.engine.num_requests == 1)
        messages, _ = await listen_live(server, audio)
        live = " ".join(transcript(m) for m in messages if m["type"] == "Results" and m["is_final"])
        assert error_rate(reference, live) < 0.2, live
        result = await upload
        assert error_rate(" ".join([reference] * 4), result.text) < 0.2, result.text
