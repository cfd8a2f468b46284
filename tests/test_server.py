"""The websocket server on the real model: both protocols, limits, errors, metrics."""

import asyncio
import base64
import json
import math
import re
import signal
import socket
import subprocess
import sys
import time
import typing
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from app.replay import result_words, transcript
from audio.frames import item_log_mel
from engine.config import EngineConfig
from engine.model.transcribe import transcribe
from engine.stream import hash_key, item_hash
from engine.worker import WorkerError
from scripts.wer import word_errors
from tests.helpers import audio, bundle, fail_decodes, heard_items, librivox_path, transcripts
from tests.server_client import (
    finals_text,
    g711,
    listen,
    next_event,
    pcm16_at,
    realtime_append,
    receive_all,
    resample_to,
    running_server,
    url,
    wait_until,
)
from tests.test_transcribe import READINGS, SEARCHED

ROOT = Path(__file__).resolve().parent.parent


def clip(name: str) -> tuple[torch.Tensor, str]:
    path = librivox_path(name)
    return audio(path), transcripts()[path]


def error_rate(reference: str, text: str) -> float:
    errors, n = word_errors(reference, text)
    return errors / n


async def http_get(server, path: str) -> tuple[int, str, bytes]:
    """GET from a worker thread (the server runs on this test's event loop)."""
    return await asyncio.to_thread(_http_get, server, path)


def _http_get(server, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


async def test_listen_streams_a_recording_and_stores_its_finals(tmp_path):
    samples, _ = clip("0890")
    async with running_server(tmp_path) as server:
        messages, ws = await listen(server, samples, partial_after_s=2.5)
    assert ws.close_code == 1000
    assert messages[0]["type"] == "Connected"
    session_id = messages[0]["session_id"]
    metadata = messages[-1]
    assert metadata["type"] == "Metadata" and metadata["request_id"] == session_id
    assert metadata["duration"] == 5.3 and metadata["channels"] == 1
    assert metadata["model_info"][metadata["models"][0]]["name"] == server.ctx.model_name
    results = [m for m in messages if m["type"] == "Results"]
    assert [m["seq"] for m in results] == list(range(1, len(results) + 1))
    assert any(not m["is_final"] for m in results)  # partials came before the finals
    # what the model says with 5 beams, word for word: an idle server searches its finals
    assert finals_text(messages) == SEARCHED["0890"]
    finals = [m for m in results if m["is_final"] and transcript(m)]
    # finals cover the stream end to end, each from where the last one ended
    ends = [0.0] + [round(m["start"] + m["duration"], 3) for m in finals]
    assert [round(m["start"], 3) for m in finals] == ends[:-1]
    words = [w for m in finals for w in m["channel"]["alternatives"][0]["words"]]
    starts = [w["start"] for w in words]
    assert starts == sorted(starts) and 0 <= starts[0] and starts[-1] < 5.3
    assert all(0 < w["confidence"] <= 1 and w["word"] == w["word"].lower() for w in words)
    assert " ".join(w["punctuated_word"] for w in words) == SEARCHED["0890"]
    # every final was written to the session's JSONL file, in order
    stored = server.store.read(session_id)
    assert [r["text"] for r in stored] == [transcript(m) for m in finals]
    assert [r["seq"] for r in stored] == [m["seq"] for m in finals]


async def test_listen_float32_at_44100_is_resampled(tmp_path):
    samples, reference = clip("0930")
    async with running_server(tmp_path) as server:
        messages, _ = await listen(server, samples, rate=44100, encoding="float32", chunk_ms=40)
    assert error_rate(reference, finals_text(messages)) <= 0.15, finals_text(messages)


async def test_listen_finalize_commits_and_keeps_the_stream_open(tmp_path):
    first, first_ref = clip("0930")
    second, second_ref = clip("0890")
    async with running_server(tmp_path) as server:
        async with connect(url(server, "/v1/listen")) as ws:
            await ws.send(pcm16_at(first, 16000))
            await ws.send(json.dumps({"type": "Finalize"}))
            seen = []
            while True:
                m = json.loads(await asyncio.wait_for(ws.recv(), 60))
                seen.append(m)
                if m.get("from_finalize"):
                    break
            first_text = finals_text(seen)
            assert error_rate(first_ref, first_text) <= 0.15, first_text
            await ws.send(pcm16_at(second, 16000))
            await ws.send(json.dumps({"type": "KeepAlive"}))
            await ws.send(json.dumps({"type": "CloseStream"}))
            rest = await receive_all(ws)
    assert error_rate(second_ref, finals_text(rest)) <= 0.15, finals_text(rest)
    # after Finalize, timestamps are still in received-audio time (the padding is not counted)
    words = [w for m in rest if m["type"] == "Results" and m["is_final"] for w in result_words(m)]
    first_ms = len(first) * 1000 // 16000
    assert first_ms - 100 <= words[0][0] <= first_ms + 1000
    assert rest[-1]["duration"] == (len(first) + len(second)) / 16000


async def test_two_concurrent_sessions_do_not_mix_text(tmp_path):
    a, ref_a = clip("0920")
    b, ref_b = clip("0870")
    async with running_server(tmp_path) as server:
        (ma, _), (mb, _) = await asyncio.gather(listen(server, a), listen(server, b))
    text_a, text_b = finals_text(ma), finals_text(mb)
    assert error_rate(ref_a, text_a) <= 0.15, text_a
    assert error_rate(ref_b, text_b) <= 0.15, text_b
    assert "married" in text_a.lower() and "married" not in text_b.lower()


async def test_realtime_openai_client_with_manual_commits(tmp_path):
    (first, ref_1), (second, ref_2) = clip("0930"), clip("0890")
    async with running_server(tmp_path) as server:
        async with connect(url(server, "/v1/realtime?intent=transcription"),
                           additional_headers={"OpenAI-Beta": "realtime=v1"}) as ws:
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created"
            assert created["session"]["input_audio_format"] == "pcm16"
            await ws.send(json.dumps({"type": "transcription_session.update", "session": {
                "input_audio_format": "pcm16",
                "input_audio_transcription": {"model": "gpt-4o-transcribe", "language": "en"},
                "turn_detection": None}}))
            updated = await next_event(ws, "transcription_session.updated")
            assert updated["session"]["turn_detection"] is None
            events: list[dict] = []
            committed = []
            for samples in (first, second):
                await realtime_append(ws, samples)
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                committed.append(await next_event(ws, "input_audio_buffer.committed", seen=events))
            completed = [await next_event(ws, "conversation.item.input_audio_transcription.completed",
                                          seen=events)]
            completed.append(await next_event(
                ws, "conversation.item.input_audio_transcription.completed", seen=events))
    assert committed[0]["previous_item_id"] is None
    assert committed[1]["previous_item_id"] == committed[0]["item_id"]
    assert [c["item_id"] for c in completed] == [c["item_id"] for c in committed]
    for event, reference in zip(completed, (ref_1, ref_2), strict=True):
        assert error_rate(reference, event["transcript"]) <= 0.15, event["transcript"]
        deltas = [e["delta"] for e in events
                  if e["type"].endswith(".delta") and e["item_id"] == event["item_id"]]
        assert "".join(deltas).strip() == event["transcript"]
    assert len({e["event_id"] for e in events}) == len(events)


async def test_realtime_g711_browser_key_and_the_running_model(tmp_path):
    samples, reference = clip("0930")
    mulaw = g711(torch.clamp(resample_to(samples, 8000, 16000), -1, 1).numpy(), "mulaw")
    async with running_server(tmp_path, api_key="s3cret") as server:
        # a browser's key: a subprotocol beside "realtime", which is answered
        async with connect(url(server, "/v1/realtime"),
                           subprotocols=["realtime", "openai-insecure-api-key.s3cret"]) as ws:
            assert ws.subprotocol == "realtime"
            await next_event(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription",
                "audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None,
                                    "transcription": {"model": "gpt-4o-transcribe"}}}}}))
            updated = (await next_event(ws, "session.updated"))["session"]
            assert updated["audio"]["input"]["format"] == {"type": "audio/pcmu"}
            assert updated["input_audio_format"] == "g711_ulaw"
            assert updated["audio"]["input"]["transcription"]["model"] == server.ctx.model_name
            for i in range(0, len(mulaw), 800):  # 100 ms of 8 kHz G.711
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(mulaw[i : i + 800]).decode()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            done = await next_event(ws, "conversation.item.input_audio_transcription.completed")
    assert error_rate(reference, done["transcript"]) <= 0.15, done["transcript"]


async def test_realtime_server_vad_commits_each_turn(tmp_path):
    """Each turn is committed and transcribed as offline Whisper transcribes it or as it was
    said (0880 alone is "He was not an old-sposed young man." offline; in float16 a window
    padded otherwise reads "ill-disposed")."""
    (first, said_1), (second, said_2) = clip("0930"), clip("0880")
    ref_1, ref_2 = (transcribe(bundle(), x).text for x in (first, second))
    gap = torch.zeros(16000)
    stream = torch.cat([gap, first, gap, second, gap])
    async with running_server(tmp_path) as server:
        async with connect(url(server, "/v1/realtime")) as ws:
            await next_event(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}))
            updated = await next_event(ws, "session.updated")
            assert updated["session"]["audio"]["input"]["format"]["rate"] == 16000
            assert updated["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
            await realtime_append(ws, stream, rate=16000)
            events: list[dict] = []
            done = [await next_event(ws, "conversation.item.input_audio_transcription.completed",
                                     seen=events) for _ in range(2)]
    kinds = [e["type"] for e in events if e["type"].startswith("input_audio_buffer.")]
    assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                     "input_audio_buffer.committed"] * 2
    # the engine's VAD places them in the audio sent (the first commit padded its timeline)
    started = [e["audio_start_ms"] for e in events if e["type"].endswith("speech_started")]
    stopped = [e["audio_end_ms"] for e in events if e["type"].endswith("speech_stopped")]
    start_2 = 1000 + first.numel() // 16 + 1000
    assert 1000 <= started[0] < 1600 and start_2 <= started[1] < start_2 + 600, started
    assert start_2 - 1000 - 600 < stopped[0] < start_2 - 500 < start_2 + 1000 - 600 < stopped[1], stopped
    for turn, refs in zip(done, ((ref_1, said_1), (ref_2, said_2)), strict=True):
        assert min(error_rate(ref, turn["transcript"]) for ref in refs) <= 0.15, turn["transcript"]


async def test_bad_input_gets_error_events_and_sessions_keep_working(tmp_path):
    samples, reference = clip("0930")
    async with running_server(tmp_path) as server:
        bystander = asyncio.create_task(listen(server, clip("0890")[0]))
        async with connect(url(server, "/v1/listen?encoding=float32")) as ws:
            await ws.recv()  # Connected
            bad = ["{not json", json.dumps([1, 2]), json.dumps({"type": "Dance"}), b"\x00" * 7,
                   torch.tensor([0.1, math.nan]).numpy().tobytes(), b""]
            for message in bad:
                await ws.send(message)
            codes = [json.loads(await ws.recv())["code"] for _ in range(5)]
            assert codes == ["invalid_json", "invalid_json", "unknown_message", "invalid_audio",
                             "invalid_audio"]
            await ws.send(samples.numpy().astype("<f4").tobytes())
            await ws.send(json.dumps({"type": "CloseStream"}))
            rest = await receive_all(ws)
        assert error_rate(reference, finals_text(rest)) <= 0.15
        assert ws.close_code == 1000
        async with connect(url(server, "/v1/realtime")) as ws:
            await next_event(ws, "session.created")
            odd = base64.b64encode(b"\x01\x02\x03").decode()
            bad = ["[", json.dumps({"type": "input_audio_buffer.append", "audio": "@@not base64@@"}),
                   json.dumps({"type": "input_audio_buffer.append", "audio": odd}),
                   json.dumps({"type": "input_audio_buffer.append", "audio": 5}),
                   json.dumps({"type": "response.create", "event_id": "e1"}),
                   json.dumps({"type": "input_audio_buffer.commit"}),
                   json.dumps({"type": "session.update", "session": {"input_audio_format": "g729"}}),
                   json.dumps({"type": "session.update", "session": {"audio": {"input": {
                       "format": {"type": "audio/pcm", "rate": 1000000}}}}}),
                   json.dumps({"type": "session.update", "session": {"input_audio_transcription": {
                       "language": "fr"}}}),
                   json.dumps({"type": "session.update", "session": {"audio": {"input": "x"}}}),
                   json.dumps({"type": "session.update", "session": {"turn_detection": 3}}),
                   json.dumps({"type": "session.update", "session": {"turn_detection": {
                       "threshold": "loud"}}}),
                   b"\x00\x01"]
            for message in bad:
                await ws.send(message)
            errors = [json.loads(await ws.recv()) for _ in bad]
            assert [e["type"] for e in errors] == ["error"] * len(bad)
            assert [e["error"]["code"] for e in errors] == [
                "invalid_json", "invalid_base64", "invalid_audio", "invalid_value", "unknown_event",
                "input_audio_buffer_commit_empty", "invalid_value", "invalid_value", "invalid_value",
                "invalid_value", "invalid_value", "invalid_value", "invalid_message"]
            assert errors[4]["error"]["event_id"] == "e1"
            await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
            await next_event(ws, "session.updated")
            await realtime_append(ws, samples)
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            done = await next_event(ws, "conversation.item.input_audio_transcription.completed")
            assert error_rate(reference, done["transcript"]) <= 0.15
        messages, _ = await bystander
        assert error_rate(clip("0890")[1], finals_text(messages)) <= 0.15
        assert not [m for m in messages if m["type"] == "Error"]


async def test_limits_key_sessions_message_size_idle(tmp_path):
    async with running_server(tmp_path, api_key="s3cret", max_sessions=1, max_message_bytes=4096,
                              idle_timeout_s=1.0) as server:
        with pytest.raises(InvalidStatus) as info:
            async with connect(url(server, "/v1/listen")):
                pass
        assert info.value.response.status_code == 401
        with pytest.raises(InvalidStatus):
            async with connect(url(server, "/v1/listen?api_key=wrong")):
                pass
        with pytest.raises(InvalidStatus) as info:
            async with connect(url(server, "/v1/listen?sample_rate=100&api_key=s3cret")):
                pass
        assert info.value.response.status_code == 400
        assert b"out of range" in info.value.response.body
        async with connect(url(server, "/v1/listen"),
                           additional_headers={"Authorization": "Bearer s3cret"}) as first:
            await first.recv()  # Connected
            # the client offered permessage-deflate; audio does not compress, so no extension
            assert "Sec-WebSocket-Extensions" not in first.response.headers
            async with connect(url(server, "/v1/realtime?api_key=s3cret")) as second:
                with pytest.raises(ConnectionClosed):
                    await second.recv()
                assert second.close_code == 1013
                assert "capacity" in second.close_reason
            await first.send(b"\x00" * 8192)  # over max_message_bytes
            with pytest.raises(ConnectionClosed):
                while True:
                    await first.recv()
            assert first.close_code == 1009
        await asyncio.sleep(0.2)
        async with connect(url(server, "/v1/listen?api_key=s3cret")) as idle:
            messages = await receive_all(idle, timeout=10)
        assert [m["type"] for m in messages] == ["Connected", "Error", "Metadata"]
        assert messages[1]["code"] == "idle_timeout"
        assert idle.close_code == 1011 and idle.close_reason.startswith("NET-0001")  # Deepgram's


async def test_the_openai_sdk_lists_the_running_model(tmp_path):
    async with running_server(tmp_path, api_key="s3cret") as server:
        base = f"http://127.0.0.1:{server.port}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key="s3cret", max_retries=0) as client:
            models = [m async for m in client.models.list()]
            assert [m.id for m in models] == [server.ctx.model_name] and models[0].object == "model"
        async with openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()


async def test_http_routes_health_metrics_static(tmp_path):
    samples, _ = clip("0930")
    async with running_server(tmp_path) as server:
        await listen(server, samples)
        status, kind, body = await http_get(server, "/healthz")
        assert status == 200 and kind == "application/json"
        assert json.loads(body)["model"] == "whisper-tiny.en"
        status, kind, body = await http_get(server, "/metrics")
        assert status == 200 and kind.startswith("text/plain")
        families = list(text_string_to_metric_families(body.decode()))  # Prometheus' own parser
        kinds = {f.name: f.type for f in families}
        values = {s.name + "".join(f'{{{k}="{v}"}}' for k, v in sorted(s.labels.items())): s.value
                  for f in families for s in f.samples}
        assert all(name.startswith("voxtide_") for name in kinds)
        assert not any("session" in s.labels for f in families for s in f.samples)  # bounded series
        for name in ("voxtide_encoder_cache_queries", "voxtide_processor_cache_hits", "voxtide_sessions",
                     "voxtide_engine_steps"):
            assert kinds[name] == "counter", name
        assert kinds["voxtide_session_lag_seconds"] == "histogram"
        assert values['voxtide_sessions_total{protocol="listen"}'] == 1
        assert abs(values["voxtide_audio_seconds_total"] - len(samples) / 16000) < 0.01
        assert values["voxtide_engine_steps_total"] >= 1
        assert values["voxtide_engine_step_seconds_count"] == values["voxtide_engine_steps_total"]
        assert values["voxtide_time_to_first_partial_seconds_count"] == 1
        assert values["voxtide_partial_to_final_seconds_count"] >= 1
        assert values["voxtide_session_lag_seconds_count"] >= 1
        assert values['voxtide_engine_step_seconds_bucket{le="+Inf"}'] >= 1
        assert values["voxtide_encoder_cache_queries_total"] >= len(samples) // 1280
        assert values["voxtide_processor_cache_queries_total"] >= 1
        assert values["voxtide_sessions_active"] == 0
        status, kind, body = await http_get(server, "/sample.wav")
        assert status == 200 and body == (server.config.web_dir / "sample.wav").read_bytes()
        for path in ("/../pyproject.toml", "/web/sample.wav", "/etc/passwd", "/nope"):
            assert (await http_get(server, path))[0] == 404


async def test_dropped_connection_still_stores_the_transcript(tmp_path):
    samples, reference = clip("0920")
    async with running_server(tmp_path, resume_grace_s=0.5) as server:
        ws = await connect(url(server, "/v1/listen"))
        session_id = json.loads(await ws.recv())["session_id"]
        await ws.send(pcm16_at(samples, 16000))
        await asyncio.sleep(0.3)
        ws.transport.abort()  # no close frame
        await wait_until(lambda: not server.sessions and not server.engine.num_requests, 60)
        text = " ".join(r["text"] for r in server.store.read(session_id))
    assert error_rate(reference, text) <= 0.15, text


async def test_engine_failure_ends_only_that_session(tmp_path, monkeypatch):
    samples, _ = clip("0890")
    async with running_server(tmp_path) as server:
        async with connect(url(server, "/v1/listen")) as ws:
            session_id = json.loads(await ws.recv())["session_id"]
            fail_decodes(monkeypatch, server.engine.runner, {session_id})
            healthy = asyncio.create_task(listen(server, samples))
            await ws.send(pcm16_at(samples, 16000))
            await ws.send(json.dumps({"type": "CloseStream"}))  # its final is due at once
            messages = await receive_all(ws)
        assert messages[-1]["type"] == "Error" and messages[-1]["code"] == "engine_error"
        assert ws.close_code == 1011
        others, _ = await healthy
        assert finals_text(others) in READINGS["0890"]
        assert server.engine.num_requests == 0


async def test_the_model_worker_process_serves_and_is_restarted_when_it_dies(tmp_path, monkeypatch):
    """`voxtide serve` runs the model in a worker process: the same words as offline; features
    injected through the engine reach the processor cache in the worker, and its hits show in
    /metrics. If the worker dies in the middle of a session, a new one starts and the session
    goes on to the same words. A worker that dies in steps in a row fails the last one's
    sessions; one that does not start again is retried, and meanwhile /healthz says 503 and
    new sessions get 1013."""
    samples, _ = clip("0890")
    async with running_server(tmp_path, EngineConfig(worker_process=True)) as server:
        engine = server.engine
        # the clip's items, processed outside the server (as a client sending log-mel would)
        contexts, floors = heard_items(samples.numpy())  # (as the stream brings them up)
        key = hash_key(engine.bundle.model_id, engine.config.item_samples)
        hashes = [item_hash(c, f, key) for c, f in zip(contexts, floors, strict=True)]
        engine.inject(hashes, list(item_log_mel(torch.from_numpy(np.stack(contexts)), 80,
                                                torch.tensor(floors))))
        messages, _ = await listen(server, samples, encoding="float32")  # the same samples
        assert finals_text(messages) in READINGS["0890"]
        assert (await http_get(server, "/healthz"))[0] == 200
        metrics = (await http_get(server, "/metrics"))[2].decode()
        hits = re.search(r"^voxtide_processor_cache_hits_total (\S+)", metrics, re.M)
        assert hits and float(hits.group(1)) >= len(set(hashes)) > 50, metrics

        worker = engine.runner.process
        await wait_until(lambda: not server.overloaded(), 60)  # a cold model's first steps lag
        received, ws = await _listen_killing_the_worker(server, samples)
        assert engine.runner.process is not worker and engine.num_restarts == 1
        assert finals_text(received) in READINGS["0890"] and received[-1]["type"] == "Metadata"
        metrics = (await http_get(server, "/metrics"))[2].decode()
        assert re.search(r"^voxtide_worker_restarts_total 1.0$", metrics, re.M), metrics

        monkeypatch.setattr("engine.engine.MAX_DEATHS_IN_A_ROW", 1)  # as if it died in a row
        # the finals that waited for the new worker lagged: new sessions wait for room (engine/load.py)
        await wait_until(lambda: not server.overloaded(), 60)
        received, ws = await _listen_killing_the_worker(server, samples)
        assert received[-1]["type"] == "Error" and received[-1]["code"] == "engine_error"
        assert "WorkerError" in received[-1]["description"] and ws.close_code == 1011
        assert engine.num_restarts == 2 and (await http_get(server, "/healthz"))[0] == 200

        start = engine.runner._start
        monkeypatch.setattr(engine.runner, "_start", lambda: (_ for _ in ()).throw(WorkerError("no")))
        engine.runner.process.kill()
        await wait_until(lambda: engine.failed_starts > 0, 30)
        status, _, body = await http_get(server, "/healthz")
        assert status == 503 and json.loads(body)["status"] == "model worker exited"
        async with connect(url(server, "/v1/listen")) as ws:  # no new sessions meanwhile
            await receive_all(ws)
        assert ws.close_code == 1013 and "restarting" in ws.close_reason
        monkeypatch.setattr(engine.runner, "_start", start)
        await wait_until(lambda: engine.healthy and not server.overloaded(), 60)  # tried again after a pause
        messages, _ = await listen(server, samples)
        assert finals_text(messages) in READINGS["0890"]


async def _listen_killing_the_worker(server, samples: torch.Tensor) -> tuple[list[dict], typing.Any]:
    """Stream half a clip, kill the model worker once a result came, stream the rest, close."""
    pcm = pcm16_at(samples, 16000)
    half = len(pcm) // 4 * 2
    received: list[dict] = []
    async with connect(url(server, "/v1/listen?encoding=linear16&sample_rate=16000")) as ws:
        reader = asyncio.create_task(receive_all(ws, into=received))
        await ws.send(pcm[:half])
        await wait_until(lambda: any(m["type"] == "Results" and transcript(m) for m in received))
        server.engine.runner.process.kill()
        try:
            await ws.send(pcm[half:])
            await ws.send(json.dumps({"type": "CloseStream"}))
        except ConnectionClosed:
            pass
        await reader
    return received, ws


def test_voxtide_serve_runs_the_model_in_a_worker_and_stops_cleanly_on_sigterm(tmp_path):
    """The main command: `voxtide serve` starts its model worker, answers /healthz, and on
    SIGTERM (docker stop, systemd) stops cleanly and exits 0, its worker with it. (Ctrl-C
    does the same; it is not sent here, as a shell running tests in the background leaves
    SIGINT ignored in its children.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port),
                               "--data-dir", str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        health = None
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                    health = json.loads(r.read())
                break
            except OSError:
                time.sleep(0.5)
        assert health is not None and health["status"] == "ok", server.poll()
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
        workers = [c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(workers) == 1
        server.send_signal(signal.SIGTERM)
        output, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0 and "SIGTERM: shutting down" in output, output
    assert "Traceback" not in output, output
    assert not Path(f"/proc/{workers[0]}").exists() or \
        Path(f"/proc/{workers[0]}/stat").read_text().split()[2] == "Z"  # exited (or not yet reaped)


async def test_realtime_clear_drops_the_uncommitted_audio(tmp_path):
    (dropped, _), (kept, reference) = clip("0920"), clip("0930")
    async with running_server(tmp_path) as server:
        async with connect(url(server, "/v1/realtime")) as ws:
            await next_event(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
            await next_event(ws, "session.updated")
            await realtime_append(ws, dropped)
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            await next_event(ws, "input_audio_buffer.cleared")
            [session] = server.sessions.values()
            for _ in range(20):  # appends and clears with no words between: one range
                await realtime_append(ws, torch.zeros(1600))
                await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
                await next_event(ws, "input_audio_buffer.cleared")
            assert len(session.cleared) == 1
            await realtime_append(ws, kept)
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            events: list[dict] = []
            done = await next_event(ws, "conversation.item.input_audio_transcription.completed",
                                    seen=events)
    assert error_rate(reference, done["transcript"]) <= 0.15, done["transcript"]
    deltas = "".join(e["delta"] for e in events if e["type"].endswith(".delta"))
    assert "married" not in deltas.lower() and "married" not in done["transcript"].lower()


@pytest.mark.parametrize("beta", [False, True])
async def test_the_openai_realtime_client_reads_every_event_strictly(tmp_path, beta):
    """The official openai SDK's realtime client (GA, and beta with its header), every server
    event validated strictly against the SDK's own models, in OpenAI's order per item:
    committed, added (beta: created), deltas, completed with usage, (GA) done."""
    from openai.types.beta.realtime import RealtimeServerEvent as BetaEvent
    from openai.types.realtime import RealtimeServerEvent

    models = {typing.get_args(m.model_fields["type"].annotation)[0]: m
              for m in typing.get_args(typing.get_args(BetaEvent if beta else RealtimeServerEvent)[0])}
    (first, ref_1), (second, ref_2) = clip("0930"), clip("0890")
    async with running_server(tmp_path) as server:
        client = openai.AsyncOpenAI(api_key="any", base_url=f"http://127.0.0.1:{server.port}/v1",
                                    websocket_base_url=f"ws://127.0.0.1:{server.port}/v1")
        realtime = client.beta.realtime if beta else client.realtime
        async with realtime.connect(model="gpt-realtime", extra_query={"intent": "transcription"}) as conn:
            if beta:
                await conn.send({"type": "transcription_session.update", "session": {
                    "input_audio_format": "pcm16", "turn_detection": None}})
            else:
                await conn.session.update(session={"type": "transcription", "audio": {"input": {
                    "format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None}}})
            for samples in (first, second):
                pcm = pcm16_at(samples, 24000)
                for i in range(0, len(pcm), 4800):
                    await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + 4800]).decode())
                await conn.input_audio_buffer.commit()
            events = []
            last = "conversation.item." + ("input_audio_transcription.completed" if beta else "done")
            while sum(e["type"] == last for e in events) < 2:
                event = json.loads(await asyncio.wait_for(conn.recv_bytes(), 60))
                models[event["type"]].model_validate(event, strict=True)
                events.append(event)
    created = "conversation.item.created" if beta else "conversation.item.added"
    assert [e["type"] for e in events[:2]] == [
        "session.created", "transcription_session.updated" if beta else "session.updated"]
    items = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
    for item_id, reference in zip(items, (ref_1, ref_2), strict=True):
        mine = [e["type"] for e in events
                if e.get("item_id") == item_id or e.get("item", {}).get("id") == item_id]
        deltas = [e["delta"] for e in events if e["type"].endswith(".delta") and e["item_id"] == item_id]
        assert mine == ["input_audio_buffer.committed", created,
                        *["conversation.item.input_audio_transcription.delta"] * len(deltas),
                        "conversation.item.input_audio_transcription.completed",
                        *([] if beta else ["conversation.item.done"])], mine
        done = next(e for e in events if e["type"].endswith(".completed") and e["item_id"] == item_id)
        assert "".join(deltas) == done["transcript"] and error_rate(reference, done["transcript"]) <= 0.15
        assert done["usage"]["type"] == "duration" and done["usage"]["seconds"] > 1


async def test_hostile_json_gets_bounded_error_events_and_no_traceback(tmp_path, caplog):
    """Nesting too deep for the parser, numbers out of range, a lone UTF-16 surrogate and a
    500 KB `type`: each gets a short error event; the session goes on; nothing is logged as
    a server error."""
    hostile = ["[" * 200_000 + "]" * 200_000,
               json.dumps({"type": "session.update", "session": {"turn_detection": {
                   "type": "server_vad", "silence_duration_ms": 1}}}).replace("1}}}", "1e400}}}"),
               '{"type": "NaN", "x": NaN}',
               '{"type": "input_audio_buffer.\\ud800", "event_id": "\\udfff"}',
               json.dumps({"type": "x" * 500_000, "event_id": "y" * 500_000})]
    async with running_server(tmp_path) as server:
        for path in ("/v1/realtime", "/v1/listen?encoding=linear16"):
            async with connect(url(server, path), max_size=None) as ws:
                if path == "/v1/realtime":
                    await next_event(ws, "session.created")
                else:
                    assert json.loads(await ws.recv())["type"] == "Connected"
                errors = []
                for message in hostile:
                    await ws.send(message)
                    event = json.loads(await asyncio.wait_for(ws.recv(), 30))
                    errors.append(event)
                await ws.send(json.dumps({"type": "input_audio_buffer.commit" if "realtime" in path
                                          else "KeepAlive"}))
                if path == "/v1/realtime":  # still serving: an empty commit is refused as usual
                    refused = await next_event(ws, "error")
                    assert refused["error"]["code"] == "input_audio_buffer_commit_empty"
            codes = [e["error"]["code"] if "error" in e else e["code"] for e in errors]
            assert codes[:3] == ["invalid_json"] * 3 and "internal_error" not in codes, codes
            assert all(len(json.dumps(e)) < 1500 for e in errors), [len(json.dumps(e)) for e in errors]
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.records


def _raw_http(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


async def test_http_methods_head_and_pipelining(tmp_path):
    """Only GET (and HEAD, without a body) on the read-only routes; pipelined requests are
    each answered in turn."""
    async with running_server(tmp_path) as server:
        ask = lambda request: asyncio.to_thread(_raw_http, server.port, request)  # noqa: E731
        for method, path in (("POST", "/healthz"), ("DELETE", "/metrics"), ("PUT", "/v1/models")):
            out = await ask(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                            "Connection: close\r\n\r\n".encode())
            assert out.startswith(b"HTTP/1.1 405 "), out[:80]
        head = await ask(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")  # no body
        two = await ask(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert two.count(b"HTTP/1.1 200 ") == 2 and two.count(b'"status": "ok"') == 2
