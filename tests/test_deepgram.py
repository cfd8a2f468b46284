"""/v1/listen against Deepgram's own client: the official `deepgram-sdk`, unchanged, and its
message models as the schema every server message must pass, strictly."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pydantic
import pytest
import torch
from deepgram import DeepgramClient
from deepgram.environment import DeepgramClientEnvironment
from deepgram.listen.v1.types import (
    ListenV1Error,
    ListenV1Metadata,
    ListenV1Results,
    ListenV1SpeechStarted,
    ListenV1UtteranceEnd,
)
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from app.replay import result_words, transcript
from audio.io import float_to_pcm16
from tests.helpers import encode
from tests.server_client import g711, pcm16_at, receive_all, resample_to, running_server, wait_until
from tests.test_server import clip, error_rate

MODELS = {"Results": ListenV1Results, "Metadata": ListenV1Metadata, "UtteranceEnd": ListenV1UtteranceEnd,
          "SpeechStarted": ListenV1SpeechStarted, "Error": ListenV1Error}
GAP_S = 2.5  # silence between the two utterances


def two_utterances() -> tuple[torch.Tensor, torch.Tensor, str, str]:
    (first, first_ref), (second, second_ref) = clip("0930"), clip("0890")
    return first, torch.cat([torch.zeros(int(GAP_S * 16000)), second]), first_ref, second_ref


def strictly(message: dict) -> pydantic.BaseModel:
    """The message as the SDK's model of its type, validated strictly (no coercion, every
    required field present)."""
    return MODELS[message["type"]].model_validate(message, strict=True)


def sdk_session(port: int, key: str, first: bytes, second: bytes) -> list:
    """The official SDK's sync client, as its README shows it: connect, send audio, Finalize,
    more audio, CloseStream, and read every message it parses."""
    base = f"127.0.0.1:{port}"
    environment = DeepgramClientEnvironment(base=f"http://{base}", production=f"ws://{base}",
                                            agent=f"ws://{base}", agent_rest=f"http://{base}")
    client = DeepgramClient(api_key=key, environment=environment)
    received: list = []
    with client.listen.v1.connect(model="nova-3", encoding="linear16", sample_rate=16000,
                                  interim_results=True, punctuate=True, utterance_end_ms=1000,
                                  vad_events=True) as socket:
        reader = threading.Thread(target=lambda: received.extend(socket))
        reader.start()
        for pcm in (first, second):
            for i in range(0, len(pcm), 3200):  # 100 ms frames
                socket.send_media(pcm[i : i + 3200])
            if pcm is first:
                socket.send_finalize()
                socket.send_keep_alive()
        socket.send_close_stream()
        reader.join(120)
    return received


async def test_the_official_deepgram_sdk_reads_every_message(tmp_path):
    first, second, first_ref, second_ref = two_utterances()
    async with running_server(tmp_path, api_key="s3cret") as server:
        received = await asyncio.to_thread(sdk_session, server.port, "s3cret", pcm16_at(first, 16000),
                                           pcm16_at(second, 16000))
    kinds = [type(m).__name__ for m in received]
    assert None not in received and kinds[-1] == "ListenV1Metadata", kinds  # no message it cannot read
    results = [m for m in received if isinstance(m, ListenV1Results)]
    finals = [m for m in results if m.is_final]
    finalized = [i for i, m in enumerate(finals) if m.from_finalize]
    assert len(finalized) == 1  # exactly the final that completes the Finalize
    before = " ".join(m.channel.alternatives[0].transcript for m in finals[: finalized[0] + 1])
    after = " ".join(m.channel.alternatives[0].transcript for m in finals[finalized[0] + 1 :])
    assert error_rate(first_ref, before) <= 0.15 and error_rate(second_ref, after) <= 0.15, (before, after)
    assert before[0].isupper() and before.rstrip()[-1] in ".!?"  # punctuate=true
    first_s, total_s = len(first) / 16000, (len(first) + len(second)) / 16000
    started = [m.timestamp for m in received if isinstance(m, ListenV1SpeechStarted)]
    assert len(started) >= 2 and started[0] < 1.0, started
    assert any(abs(t - (first_s + GAP_S + 0.4)) < 0.6 for t in started), (started, first_s)  # 2nd onset
    ends = [m.last_word_end for m in received if isinstance(m, ListenV1UtteranceEnd)]
    assert ends and first_s - 1.0 < ends[0] <= first_s, ends  # after the first utterance's last word
    assert received[-1].duration == total_s and received[-1].channels == 1


async def test_listen_messages_pass_the_sdk_models_strictly(tmp_path):
    first, second, *_ = two_utterances()
    pcm = pcm16_at(torch.cat([first, second]), 16000)
    query = "?encoding=linear16&sample_rate=16000&interim_results=true&utterance_end_ms=1000&vad_events=true"
    async with running_server(tmp_path) as server:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/listen{query}") as ws:
            for i in range(0, len(pcm), 3200):
                await ws.send(pcm[i : i + 3200])
            await ws.send(json.dumps({"type": "Finalize"}))
            await ws.send(json.dumps({"type": "Dance"}))
            await ws.send(json.dumps({"type": "CloseStream"}))
            messages = await receive_all(ws)
    assert ws.close_code == 1000
    parsed = [strictly(m) for m in messages]  # raises on any field missing or mistyped
    assert {type(p).__name__ for p in parsed} >= {"ListenV1Results", "ListenV1Metadata", "ListenV1Error",
                                                   "ListenV1UtteranceEnd", "ListenV1SpeechStarted"}
    results = [m for m in messages if m["type"] == "Results"]
    assert all(m["channel_index"] == [0, 1] and m["metadata"]["request_id"] == messages[-1]["request_id"]
               for m in results)
    finals = [m for m in results if m["is_final"]]
    assert [m["start"] for m in finals[1:]] == [round(m["start"] + m["duration"], 3) for m in finals[:-1]]
    # defaults as Deepgram's: no punctuation, words in lowercase, no punctuated_word
    words = [w for m in finals for w in m["channel"]["alternatives"][0]["words"]]
    assert words and all("punctuated_word" not in w and w["word"] == w["word"].lower() for w in words)
    assert not any(c in transcript(m) for m in finals for c in ".,?!")


async def test_endpointing_sets_the_sessions_pause_never_under_the_servers(tmp_path):
    async with running_server(tmp_path) as server:
        streams = server.loop.engine.streams
        for query, items in (("endpointing=1000", 13), ("endpointing=10", 3), ("endpointing=false", 3)):
            async with connect(f"ws://127.0.0.1:{server.port}/v1/listen?voxtide_events=true&{query}") as ws:
                session_id = json.loads(await ws.recv())["session_id"]
                await ws.send(bytes(3200))
                # (80 ms items; the commands reach the engine on its loop's next step)
                await wait_until(lambda sid=session_id, n=items: sid in streams
                                 and streams[sid].pauses.endpoint_items == n, 30)
        with pytest.raises(InvalidStatus) as info:
            async with connect(f"ws://127.0.0.1:{server.port}/v1/listen?endpointing=20000"):
                pass
        assert info.value.response.status_code == 400 and b"endpointing" in info.value.response.body


async def test_deepgram_defaults_auth_and_subprotocol(tmp_path):
    samples, reference = clip("0920")
    pcm = pcm16_at(samples, 16000)
    async with running_server(tmp_path, api_key="s3cret") as server:
        base = f"ws://127.0.0.1:{server.port}/v1/listen"
        with pytest.raises(InvalidStatus) as info:
            async with connect(base, additional_headers={"Authorization": "Token wrong"}):
                pass
        assert info.value.response.status_code == 401
        assert json.loads(info.value.response.body)["err_code"] == "INVALID_AUTH"
        # a browser's key: the subprotocols ["token", KEY], "token" echoed back
        async with connect(base, subprotocols=["token", "s3cret"]) as ws:
            assert ws.subprotocol == "token"
            await ws.send(pcm)
            await ws.send(json.dumps({"type": "CloseStream"}))
            messages = await receive_all(ws)
    # no Connected, no interim results: only what a Deepgram client asked for
    assert [m["type"] for m in messages] == ["Results"] * (len(messages) - 1) + ["Metadata"]
    assert all(m["is_final"] for m in messages[:-1])
    assert error_rate(reference, " ".join(transcript(m) for m in messages[:-1])) <= 0.15


@pytest.mark.parametrize("encoding,rate,channels", [("mulaw", 8000, 1), ("alaw", 8000, 1),
                                                    ("linear16", 44100, 2)])
async def test_listen_encodings_and_channels(tmp_path, encoding, rate, channels):
    samples, reference = clip("0930")
    at_rate = torch.clamp(resample_to(samples, rate, 16000), -1, 1).numpy()
    if encoding == "linear16":  # two channels: the voice on the left, a quieter copy on the right
        frames = np.stack([at_rate, 0.5 * at_rate], axis=1)
        payload = float_to_pcm16(frames)  # interleaved: a frame's samples in a row
    else:
        payload = g711(at_rate, encoding)
    query = f"?encoding={encoding}&sample_rate={rate}&channels={channels}"
    async with running_server(tmp_path) as server:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/listen{query}") as ws:
            step = rate // 10 * channels * (2 if encoding == "linear16" else 1)
            for i in range(0, len(payload), step):
                await ws.send(payload[i : i + step])
            await ws.send(json.dumps({"type": "CloseStream"}))
            messages = await receive_all(ws)
    text = " ".join(transcript(m) for m in messages if m["type"] == "Results")
    assert error_rate(reference, text) <= 0.15, text
    metadata = messages[-1]
    assert metadata["duration"] == pytest.approx(len(at_rate) / rate) and metadata["channels"] == channels
    assert all(0 <= w[0] <= len(at_rate) * 1000 / rate for m in messages if m["type"] == "Results"
               for w in result_words(m))



@pytest.mark.parametrize("query, fmt, codec, rate", [
    ("", "webm", "libopus", 48000),  # a browser's MediaRecorder: no encoding, a webm stream
    ("?encoding=opus", "ogg", "libopus", 48000),  # Deepgram's opus: Ogg Opus
    ("?interim_results=true", "wav", "pcm_s16le", 22050),  # a wav with its header, streamed
])
async def test_listen_streams_containers_decoded_as_they_arrive(tmp_path, query, fmt, codec, rate):
    first, second, first_ref, second_ref = two_utterances()
    data = encode(torch.cat([first, second]), fmt, codec, rate)
    async with running_server(tmp_path) as server:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/listen{query}") as ws:
            for i in range(0, len(data), 1000):
                await ws.send(data[i : i + 1000])
            await ws.send(json.dumps({"type": "CloseStream"}))
            messages = await receive_all(ws)
    text = " ".join(transcript(m) for m in messages if m["type"] == "Results" and m["is_final"])
    assert error_rate(f"{first_ref} {second_ref}", text) <= 0.15, text
    assert messages[-1]["duration"] == pytest.approx((len(first) + len(second)) / 16000, abs=0.03)
    started = [w[0] for m in messages if m["type"] == "Results" and m["is_final"] for w in result_words(m)]
    assert started == sorted(started) and started[-1] < messages[-1]["duration"] * 1000


async def test_a_broken_container_stream_gets_an_error_and_the_session_ends_cleanly(tmp_path):
    async with running_server(tmp_path) as server:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/listen") as ws:
            await ws.send(b"OggS" + bytes(range(256)) * 40)  # an ogg page header, then garbage
            await asyncio.sleep(0.5)
            await ws.send(b"\x00" * 4000)
            await ws.send(json.dumps({"type": "CloseStream"}))
            messages = await receive_all(ws)
        assert server.engine.num_requests == 0
    errors = [m for m in messages if m["type"] == "Error"]
    assert len(errors) == 1 and errors[0]["code"] == "invalid_audio", messages
    assert messages[-1]["type"] == "Metadata" and ws.close_code == 1000
