"""Fuzzing both protocols (hypothesis) against a real server on the real model.

Random, truncated and oversized JSON, binary in the JSON protocol and text in the binary one,
bad base64, NaN/inf float32 frames, zero-length frames, absurd query parameters. Every
example must get only well-formed events and a clean close (or a 400 before the upgrade);
afterwards the server has logged no error, has drained every session and still transcribes.

CI runs a fixed, derandomized set; `HYPOTHESIS_PROFILE=fuzz` searches longer at random.
"""

import base64
import json
import logging
import math
import os
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from app.replay import transcript
from engine.config import EngineConfig
from tests.server_client import ThreadedServer, pcm16_at
from tests.test_server import clip, error_rate

settings.register_profile("ci", max_examples=40, derandomize=True, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("fuzz", max_examples=1000, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

MAX_MESSAGE = 4096
LISTEN_TYPES = {"Connected", "Results", "Error", "Warning", "Metadata", "UtteranceEnd", "SpeechStarted"}
LISTEN_ERRORS = {"invalid_json", "invalid_audio", "unknown_message"}
REALTIME_TYPES = {"session.created", "session.updated", "transcription_session.updated", "error",
                  "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                  "input_audio_buffer.committed", "input_audio_buffer.cleared",
                  "conversation.item.input_audio_transcription.delta",
                  "conversation.item.input_audio_transcription.completed"}
REALTIME_ERRORS = {"invalid_json", "invalid_message", "unknown_event", "invalid_value",
                   "invalid_base64", "invalid_audio", "input_audio_buffer_commit_empty"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
oversized = st.integers(MAX_MESSAGE + 1, 3 * MAX_MESSAGE).map(lambda n: b"\x01" * n)
float_frames = st.lists(st.floats(width=32) | st.sampled_from([math.nan, math.inf, -math.inf, 1e30]),
                        max_size=400).map(lambda xs: struct.pack(f"<{len(xs)}f", *xs))
junk_text = st.one_of(
    st.text(max_size=200),  # mostly not JSON
    json_values.map(json.dumps),  # JSON, mostly not an object
    st.dictionaries(st.sampled_from(["type", "event_id", "audio", "session"]), json_values,
                    max_size=3).map(lambda d: json.dumps(d)[: len(json.dumps(d)) // 2]),  # truncated
)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    errors: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR and record.name.split(".")[0] in ("app", "engine"):
                errors.append(record)

    handler = Collect()
    logging.getLogger().addHandler(handler)
    with ThreadedServer(tmp_path_factory.mktemp("fuzz"), EngineConfig(pad_seconds=5),
                        max_message_bytes=MAX_MESSAGE, idle_timeout_s=30) as server:
        server.errors = errors
        yield server
    logging.getLogger().removeHandler(handler)


def receive_until_closed(ws, timeout: float = 60.0) -> list[dict]:
    messages = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            messages.append(json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic()))))
    except ConnectionClosed:
        return messages


def assert_server_healthy(server: ThreadedServer) -> None:
    """No error logged, every session drained, and a real recording still transcribed."""
    deadline = time.monotonic() + 300
    while server.server.sessions and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not server.server.sessions
    assert server.server.loop.task is not None and not server.server.loop.task.done()
    samples, reference = clip("0920")
    pcm = pcm16_at(samples, 16000)
    with connect(server.url("/v1/listen"), max_size=None) as ws:
        for i in range(0, len(pcm), 3200):
            ws.send(pcm[i : i + 3200])
        ws.send(json.dumps({"type": "CloseStream"}))
        messages = receive_until_closed(ws, 120)
    text = " ".join(transcript(m) for m in messages if m["type"] == "Results" and m["is_final"])
    assert error_rate(reference, text) <= 0.15, text
    assert not server.errors, [r.getMessage() for r in server.errors]


def test_listen_protocol_survives_fuzzing(fuzz_server):
    queries = st.one_of(
        st.just(""),
        st.integers(-10**12, 10**12).map(lambda r: f"sample_rate={r}"),
        st.sampled_from(["encoding=float32", "encoding=mulaw", "encoding=opus", "channels=2", "channels=0",
                         "sample_rate=abc", "sample_rate=8000", "sample_rate=44100&encoding=float32",
                         "sample_rate=1e9", "interim_results=maybe", "utterance_end_ms=1000&vad_events=true",
                         "multichannel=true", "language=fr", "endpointing=false"]),
    )
    messages = st.lists(st.one_of(
        st.binary(max_size=2000),  # random PCM16, odd lengths and zero-length frames included
        float_frames,  # NaN/inf/huge float32 frames
        junk_text,
        st.sampled_from([json.dumps({"type": "KeepAlive"}), json.dumps({"type": "Finalize"})]),
        oversized,
    ), max_size=8)

    @settings(settings.get_profile(PROFILE))
    @given(query=queries, messages=messages)
    def run(query: str, messages: list) -> None:
        sent_oversized = False
        try:
            with connect(fuzz_server.url(f"/v1/listen?{query}"), max_size=None, open_timeout=30) as ws:
                try:
                    for message in messages:
                        ws.send(message)
                        if len(message) > MAX_MESSAGE:
                            sent_oversized = True
                            break
                    if not sent_oversized:
                        ws.send(json.dumps({"type": "CloseStream"}))
                except ConnectionClosed:
                    pass
                received = receive_until_closed(ws)
        except InvalidStatus as e:
            assert e.response.status_code == 400 and e.response.body, query
            return
        except ConnectionClosed:  # closing after the server closed with 1009
            pass
        assert ws.close_code == (1009 if sent_oversized else 1000), (ws.close_code, ws.close_reason)
        assert received and received[0]["type"] == "Connected"
        assert {m["type"] for m in received} <= LISTEN_TYPES
        for m in received:
            if m["type"] == "Error":
                assert m["code"] in LISTEN_ERRORS and m["description"], m
        if not sent_oversized:
            assert received[-1]["type"] == "Metadata"

    run()
    assert_server_healthy(fuzz_server)


def test_realtime_protocol_survives_fuzzing(fuzz_server):
    audio = st.one_of(
        st.binary(max_size=1500).map(lambda b: base64.b64encode(b).decode()),  # odd lengths too
        st.text(max_size=40),  # mostly bad base64
        json_values,  # not a string
    )
    events = st.lists(st.one_of(
        audio.map(lambda a: json.dumps({"type": "input_audio_buffer.append", "audio": a})),
        st.sampled_from([json.dumps({"type": t}) for t in
                         ("input_audio_buffer.commit", "input_audio_buffer.clear")]),
        st.fixed_dictionaries({"type": st.sampled_from(["session.update", "transcription_session.update"]),
                               "session": json_values | st.dictionaries(
                                   st.sampled_from(["audio", "turn_detection", "input_audio_format",
                                                    "input_audio_transcription", "type"]),
                                   json_values, max_size=3)}).map(json.dumps),
        junk_text,
        st.binary(max_size=500),  # binary is not part of this protocol
        oversized.map(lambda b: b.decode()),
    ), max_size=8)

    @settings(settings.get_profile(PROFILE))
    @given(query=st.sampled_from(["", "sample_rate=16000", "sample_rate=0", "sample_rate=x"]),
           events=events)
    def run(query: str, events: list) -> None:
        sent_oversized = False
        received: list[dict] = []
        try:
            with connect(fuzz_server.url(f"/v1/realtime?{query}"), max_size=None, open_timeout=30) as ws:
                for event in events:
                    ws.send(event)
                    if len(event) > MAX_MESSAGE:
                        sent_oversized = True
                        break
                if sent_oversized:
                    received = receive_until_closed(ws)
                else:  # a marker: everything before it has been answered
                    ws.send(json.dumps({"type": "fuzz.end", "event_id": "fuzz-end"}))
                    while not (received and received[-1].get("error", {}).get("event_id") == "fuzz-end"):
                        received.append(json.loads(ws.recv(timeout=60)))
        except InvalidStatus as e:
            assert e.response.status_code == 400 and e.response.body, query
            return
        except ConnectionClosed:  # sending or closing after the server closed with 1009
            pass
        if sent_oversized:
            assert ws.close_code == 1009
        assert received and received[0]["type"] == "session.created"
        assert {m["type"] for m in received} <= REALTIME_TYPES
        for m in received:
            if m["type"] == "error":
                assert m["error"]["code"] in REALTIME_ERRORS | {"unknown_event"} and m["error"]["message"], m

    run()
    assert_server_healthy(fuzz_server)
