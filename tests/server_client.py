"""Test clients for a real Voxtide server: start one on port 0, speak both protocols."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from app.config import ServerConfig
from app.replay import transcript, with_client_query
from app.server import Server
from app.session import Session
from audio.io import G711, float_to_pcm16
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model import ModelBundle
from tests.helpers import bundle


@asynccontextmanager
async def running_server(tmp_path: Path, engine_config: EngineConfig | None = None, *,
                         model: ModelBundle | None = None, **config: Any):
    """A server on port 0 in this event loop (model: the tests' bundle() unless given)."""
    server = Server(Engine(model or bundle(), engine_config),
                    ServerConfig(port=0, data_dir=tmp_path / "data", **config))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def drop_server_side(server: Server, session: Session) -> None:
    """Cut a session's TCP connection on the server side, with no close frame (run this on
    the server's event loop)."""
    session.ws.kill()


async def wait_until(condition, seconds: float = 300.0) -> None:
    """Poll `condition()` every 0.1 s; fail after `seconds`."""
    for _ in range(int(seconds * 10)):
        if condition():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("timed out waiting for the server")


def url(server: Server, path: str) -> str:
    """The server's URL of `path`; a new /v1/listen session asks what Voxtide's own clients
    ask (interim results, punctuation, Voxtide's events: see app.replay.CLIENT_QUERY)."""
    if path.startswith("/v1/listen") and "resume_token=" not in path:
        path = with_client_query(path)
    return f"ws://127.0.0.1:{server.port}{path}"


def pcm16_at(samples: torch.Tensor, rate: int) -> bytes:
    """16 kHz float samples -> PCM16 bytes at `rate`."""
    if rate != 16000:
        samples = torch.clamp(resample_to(samples, rate, 16000), -1, 1)
    return float_to_pcm16(samples)


def g711(samples: np.ndarray, law: str) -> bytes:
    """Float samples -> G.711 bytes: the nearest code of the law's decoding table."""
    table = G711[law].numpy()
    order = np.argsort(table)
    k = np.clip(np.searchsorted(table[order], samples), 1, 255)
    nearer = np.where(samples - table[order][k - 1] < table[order][k] - samples, k - 1, k)
    return order[nearer].astype(np.uint8).tobytes()


def resample_to(samples: torch.Tensor, new: int, orig: int) -> torch.Tensor:
    import torchaudio.functional as AF

    return AF.resample(samples, orig, new)


async def receive_all(ws: ClientConnection, timeout: float = 120.0,
                      into: list[dict] | None = None) -> list[dict]:
    """JSON messages until the server closes the connection (also appended to `into`)."""
    messages = [] if into is None else into
    try:
        while True:
            messages.append(json.loads(await asyncio.wait_for(ws.recv(), timeout)))
    except ConnectionClosed:
        return messages


async def listen(server: Server, samples: torch.Tensor, rate: int = 16000, encoding: str = "linear16",
                 chunk_ms: int = 100, query: str = "", partial_after_s: float | None = None
                 ) -> tuple[list[dict], ClientConnection]:
    """Stream a recording over /v1/listen as fast as possible, CloseStream, read to the close.

    With `partial_after_s`, wait for a partial once that much audio is sent (pushed at once
    and closed, a recording gets finals only: a final that falls due stops the partials).
    """
    if encoding == "float32":
        data = (samples if rate == 16000 else resample_to(samples, rate, 16000)).numpy().astype("<f4")
        payload, width = data.tobytes(), 4
    else:
        payload, width = pcm16_at(samples, rate), 2
    step = rate * chunk_ms // 1000 * width
    pause_at = len(payload) + 1 if partial_after_s is None else int(partial_after_s * rate) * width
    messages: list[dict] = []
    async with connect(url(server, f"/v1/listen?sample_rate={rate}&encoding={encoding}{query}"),
                       max_size=None) as ws:
        reader = asyncio.create_task(receive_all(ws, into=messages))
        for i in range(0, len(payload), step):
            if i <= pause_at < i + step:
                await wait_until(lambda: any(m["type"] == "Results" and not m["is_final"]
                                             and transcript(m) for m in messages))
            await ws.send(payload[i : i + step])
        await ws.send(json.dumps({"type": "CloseStream"}))
        await reader
    return messages, ws


def finals_text(messages: list[dict]) -> str:
    return " ".join(transcript(m) for m in messages
                    if m["type"] == "Results" and m["is_final"] and transcript(m))


async def realtime_append(ws: ClientConnection, samples: torch.Tensor, rate: int = 24000,
                          chunk_ms: int = 100) -> None:
    pcm = pcm16_at(samples, rate)
    step = rate * chunk_ms // 1000 * 2
    for i in range(0, len(pcm), step):
        audio = base64.b64encode(pcm[i : i + step]).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))


async def next_event(ws: ClientConnection, kind: str, timeout: float = 60.0,
                     seen: list[dict] | None = None) -> dict:
    """Read events until one of type `kind` (the others go to `seen`)."""
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if event["type"] == kind:
            return event
        if seen is not None:
            seen.append(event)



class ThreadedServer:
    """A server on its own event loop in a thread, for synchronous clients (hypothesis)."""

    def __init__(self, tmp_path: Path, engine_config: EngineConfig | None = None, **config: Any):
        self.loop = asyncio.new_event_loop()
        self.server = Server(Engine(bundle(), engine_config),
                             ServerConfig(port=0, data_dir=tmp_path / "data", **config))
        self.thread = threading.Thread(target=self.loop.run_forever, name="server", daemon=True)

    def call(self, coroutine: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def url(self, path: str) -> str:
        return url(self.server, path)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        self.call(self.server.start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
