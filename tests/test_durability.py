"""Accepted audio is durable: the spool, recovery after a crash, the drain at SIGTERM, the
model worker's end with its server (the worker's restart: test_server.py)."""

import asyncio
import errno
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from websockets.asyncio.client import ClientConnection, connect

from app import spool as spool_module
from app.replay import transcript
from app.spool import Spool
from audio.io import float_to_pcm16
from scripts.chaos import ServerProcess, overlaps, passage, process_alive, store_words
from scripts.wer import wer
from tests.helpers import audio, concatenated, librivox_path, transcripts
from tests.server_client import (
    finals_text,
    listen,
    next_event,
    realtime_append,
    receive_all,
    running_server,
    wait_until,
)
from tests.test_server import http_get
from tests.test_transcribe import GOLDEN, READINGS, SEARCHED


def test_the_spool_keeps_audio_until_its_transcript_is_stored(tmp_path, monkeypatch):
    monkeypatch.setattr(spool_module, "SEGMENT_SAMPLES", 1600)  # 0.1 s segments
    spool = Spool(tmp_path)
    with pytest.raises(ValueError, match="another voxtide server"):
        Spool(tmp_path)  # one server per data dir
    rng = np.random.default_rng(0)
    samples = rng.uniform(-0.5, 0.5, 8000).astype(np.float32)  # 0.5 s
    session = spool.open("sess_a", "listen")
    for piece in np.array_split(samples, 7):
        session.write(piece)
    [left] = spool.leftovers()
    assert (left.session_id, left.protocol, left.num_samples()) == ("sess_a", "listen", 8000)
    back = np.concatenate(list(left.read(0, 1000)))
    assert np.abs(back - samples).max() < 1 / 16000  # PCM16
    assert np.allclose(np.concatenate(list(left.read(4000, 1000))), back[4000:])
    session.release(250)  # 0.25 s stored: segments 0 and 1 (0.0-0.2 s) can go, not 0.2-0.3
    assert left.first_sample() == 3200
    session.release(10_000)  # never the segment still written
    assert left.first_sample() == 6400 and left.num_samples() == 8000
    session.remove()
    assert spool.leftovers() == []
    spool.close()
    Spool(tmp_path).close()  # the data dir is free again


def test_a_spool_that_cannot_write_says_so_and_the_session_goes_on(tmp_path, monkeypatch):
    spool = Spool(tmp_path)
    session = spool.open("sess_b", "listen")
    session.write(np.zeros(1600, np.float32))

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_module.os, "write", full)
    session.write(np.zeros(1600, np.float32))
    assert "No space left" in session.failure and spool.failure == session.failure
    assert spool.num_failures == 1
    monkeypatch.undo()
    session.write(np.zeros(1600, np.float32))  # a gap would shift the timeline: no more writes
    assert spool.leftovers()[0].num_samples() == 1600
    spool.open("sess_c", "listen").write(np.zeros(1600, np.float32))
    assert spool.failure is None  # the disk takes files again


async def test_recovery_transcribes_what_no_final_covers_into_the_store(tmp_path):
    """A server died with a session's audio spooled and its first clip's final stored (the
    file ends in half a line): the next start transcribes the rest into the session's store
    file, after the stored final, and deletes the spool."""
    first, second = librivox_path("0890"), librivox_path("0920")
    samples, _ = concatenated([first, second], gap_seconds=1.0)
    first_end_ms = audio(first).numel() // 16
    data = tmp_path / "data"
    spool = Spool(data)
    spool.open("sess_dead", "listen").write(samples.numpy())
    spool.close()
    stored = {"seq": 1, "text": GOLDEN["0890"], "start_ms": 500, "end_ms": first_end_ms - 300, "words": []}
    (data / "sess_dead.jsonl").write_text(json.dumps(stored) + "\n" + '{"seq": 2, "te')
    async with running_server(tmp_path) as server:
        await wait_until(lambda: server.recovery.done(), 300)
        assert not (data / "spool" / "sess_dead").exists()
        metrics = server.metrics.render().decode()
    records = [json.loads(line) for line in (data / "sess_dead.jsonl").read_text().splitlines()]
    assert records[0] == stored
    recovered = records[1:]
    assert recovered and all(r["recovered"] for r in recovered)
    assert recovered[0]["start_ms"] >= first_end_ms - 300
    assert " ".join(r["text"] for r in recovered) == GOLDEN["0920"]
    assert "voxtide_recovered_audio_seconds_total" in metrics


def _spooled_samples(data_dir: Path, session_id: str) -> int:
    return sum(p.stat().st_size for p in (data_dir / "spool" / session_id).glob("*.pcm")) // 2


async def _stream_all(url: str, pcm: bytes) -> tuple[str, list[dict], asyncio.Task, ClientConnection]:
    """Open a session, send all of `pcm` at once -> its id, its messages (filled by a reader
    task), the task that ends when the server closes it, and the connection."""
    ws = await connect(f"{url}/v1/listen?encoding=linear16&sample_rate=16000&voxtide_events=true",
                       max_size=None)
    messages: list[dict] = []
    reader = asyncio.create_task(receive_all(ws, timeout=600, into=messages))
    await wait_until(lambda: bool(messages))
    for i in range(0, len(pcm), 32000):
        await ws.send(pcm[i : i + 32000])
    return messages[0]["session_id"], messages, reader, ws


async def test_sigterm_drains_kill_9_loses_nothing_and_the_next_start_recovers_all(tmp_path):
    """SIGTERM: /healthz says draining, new sessions get 1013, the session gets what was done
    and a 1001 close, the server exits 0 after --drain seconds. kill -9: the model worker
    exits within a second or two. Each next start transcribes the spooled rest: the store
    holds each passage once, as a whole."""
    data = tmp_path / "data"
    server = ServerProcess(data, args=("--drain", "1"))
    a, b = passage(0, 2), passage(2, 1)  # 58 s and 29 s
    server.start()
    sid_a, messages, reader, ws_a = await _stream_all(server.url, float_to_pcm16(a))
    await wait_until(lambda: _spooled_samples(data, sid_a) >= a.size, 60)  # accepted, all of it
    server.process.send_signal(15)
    signalled = time.monotonic()
    await wait_until(lambda: server.health()[1].get("status") == "draining", 10)
    assert server.health()[0] == 503
    async with connect(f"{server.url}/v1/listen") as ws:
        await receive_all(ws)
    assert ws.close_code == 1013 and "shutting down" in ws.close_reason
    await reader
    assert server.process.wait(60) == 0 and time.monotonic() - signalled < 30
    assert ws_a.close_code == 1001 and ws_a.close_reason == "server shutting down"

    server.start()  # recovers a's rest, while b streams
    sid_b, messages, reader, _ = await _stream_all(server.url, float_to_pcm16(b))
    await wait_until(lambda: any(m["type"] == "Results" and m["is_final"] for m in messages), 120)
    await wait_until(lambda: _spooled_samples(data, sid_b) >= b.size, 60)
    worker = server.worker_pid()
    exited_after = server.kill()
    assert worker is not None and not process_alive(worker) and exited_after < 2.5
    await reader

    server.start()
    await wait_until(lambda: not server.spooled_sessions(), 300)
    assert server.terminate() == 0
    for sid, clip_audio, index in ((sid_a, a, 0), (sid_b, b, 2)):
        words = store_words(data, sid)
        assert overlaps(words) == 0
        text = " ".join(w["word"] for w in words)
        assert wer(_reference(index, clip_audio.size), text) < 0.08, text


def _reference(index: int, num_samples: int) -> str:
    from tests.helpers import ARCTIC_IDS

    paths = [librivox_path(c) for c in ARCTIC_IDS]
    paths = paths[index:] + paths[:index]
    loops = round(num_samples / sum(audio(p).numel() + 12800 for p in paths))
    return " ".join(transcripts()[p] for p in paths * loops)


async def test_a_realtime_turn_keeps_its_audio_spooled_until_it_is_completed(tmp_path, monkeypatch):
    """/v1/realtime stores a turn's words only when the turn is completed: until then its
    audio stays in the spool, however far the engine has committed; after, it goes."""
    monkeypatch.setattr(spool_module, "SEGMENT_SAMPLES", 16000)  # 1 s segments
    samples = torch.from_numpy(passage(0, 1))  # 29 s: the engine's window is cut past 15 s
    async with running_server(tmp_path) as server:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/realtime") as ws:
            await next_event(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
            await next_event(ws, "session.updated")
            await realtime_append(ws, samples)
            [session] = server.sessions.values()
            await wait_until(lambda: session.done_ms > 5000, 50)  # words before it are final
            assert session.stored_ms() == 0 and not server.store.read(session.id)
            assert session.spool.kept[0] == 0  # every second of the open turn is on disk
            assert session.spool.kept[0] == 0  # the first second is still on disk
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            done = await next_event(ws, "conversation.item.input_audio_transcription.completed", 120)
            await asyncio.sleep(0.5)
            assert done["transcript"] and session.stored_ms() > 5000
            # what is stored is deleted
            assert all(start + 16000 > session.stored_ms() * 16 for start in session.spool.kept)
            assert server.store.read(session.id)[0]["text"] == done["transcript"]


async def test_a_drain_ends_a_session_at_its_next_pause_and_says_where(tmp_path):
    """At shutdown a session reads on to its next pause (no word cut in two between this
    server and the next), then tells the client how much audio it took."""
    first, second = audio(librivox_path("0890")), audio(librivox_path("0920"))
    gap = 8000  # 0.5 s of silence
    async with running_server(tmp_path, drain_s=8.0) as server:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/listen?encoding=linear16"
                           "&sample_rate=16000&voxtide_events=true") as ws:
            messages: list[dict] = []
            reader = asyncio.create_task(receive_all(ws, into=messages))
            await ws.send(float_to_pcm16(first[:-1600].numpy()))  # all but its last 0.1 s
            await wait_until(lambda: server.sessions and next(iter(server.sessions.values())).num_received
                             == first.numel() - 1600)
            drain = asyncio.create_task(server.drain())
            rest = np.concatenate([first[-1600:].numpy(), np.zeros(gap, np.float32), second.numpy()])
            for i in range(0, rest.size, 1600):  # 100 ms messages, 5x real time
                try:
                    await ws.send(float_to_pcm16(rest[i : i + 1600]))
                except Exception:
                    break
                await asyncio.sleep(0.02)
            await reader
            await drain
    [said] = [m for m in messages if m.get("code") == "server_shutting_down"]
    taken = said["audio_received_samples"]
    assert first.numel() < taken <= first.numel() + gap  # inside the pause
    assert ws.close_code == 1001
    text = " ".join(transcript(m) for m in messages if m["type"] == "Results" and m["is_final"])
    assert min(wer(reading, text) for reading in READINGS["0890"]) < 0.1, text


async def test_a_full_disk_under_the_spool_degrades_health_and_loses_no_text(tmp_path, monkeypatch):
    """The spool cannot write (a full disk): the session is transcribed all the same, /healthz
    says degraded with the reason, the failure is counted."""
    samples = audio(librivox_path("0890"))

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    async with running_server(tmp_path) as server:
        monkeypatch.setattr(spool_module.os, "write", full)
        messages, _ = await listen(server, samples)
        status, _, body = await http_get(server, "/healthz")
        metrics = server.metrics.render().decode()
    assert finals_text(messages) == SEARCHED["0890"]
    health = json.loads(body)
    assert status == 503 and health["status"] == "degraded" and "audio spool" in health["reason"]
    assert "voxtide_spool_failures_total 1.0" in metrics
