"""Disconnect storms and memory: rounds of N /v1/listen sessions that drop mid-stream (no
close frame), with the process RSS after each round once the server has drained them.

A leak shows as RSS growing round after round; the first round raises RSS once (the
allocator keeps its high-water mark, the encoder cache fills), later rounds should not. The
RSS after malloc_trim shows how much of the rise is freed memory glibc had kept.

    scripts/dev.sh run python scripts/storm.py [--rounds 5] [--sessions 100]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from websockets.asyncio.client import connect  # noqa: E402

from app.server import Server  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from scripts.soak import rss_mb  # noqa: E402
from tests.helpers import ARCTIC_IDS, concatenated, librivox_path  # noqa: E402
from tests.server_client import pcm16_at, running_server, url  # noqa: E402

CHUNK = 3200  # bytes: 100 ms of 16 kHz PCM16


def trimmed_rss_mb() -> float:
    """RSS after asking glibc to hand its free heap pages back to the OS (malloc_trim)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the figure is the plain RSS
    return rss_mb()


async def drained(server: Server) -> None:
    while server.sessions or server.engine.num_requests:
        await asyncio.sleep(0.1)


async def storm(url: str, pcm: bytes, num: int, size: int) -> None:
    sockets = await asyncio.gather(*(connect(url) for _ in range(num)))
    for ws in sockets:
        await ws.recv()  # Connected
    for k, ws in enumerate(sockets):
        start = k * CHUNK * 7 % (len(pcm) - size) // CHUNK * CHUNK
        for i in range(start, start + size, CHUNK):
            await ws.send(pcm[i : i + CHUNK])
    await asyncio.sleep(0.5)  # mid-stream
    for ws in sockets:
        ws.transport.abort()


async def main_async(rounds: int, num: int) -> list[float]:
    samples, _ = concatenated([librivox_path(c) for c in ARCTIC_IDS], gap_seconds=0.5)
    pcm = pcm16_at(samples, 16000)
    folder = Path(tempfile.mkdtemp(prefix="voxtide-storm-"))
    async with running_server(folder, EngineConfig(pad_seconds=5), max_sessions=num,
                              resume_grace_s=0.2) as server:
        return await rounds_on(server, pcm, rounds, num)


async def rounds_on(server: Server, pcm: bytes, rounds: int, num: int) -> list[float]:
    engine, listen = server.engine, url(server, "/v1/listen")
    await storm(listen, pcm, 2, 16 * CHUNK)  # warm-up: the model's first steps
    await drained(server)
    gc.collect()
    sizes = [rss_mb()]
    trimmed = [trimmed_rss_mb()]
    print(f"baseline (after a 2-session warm-up): {sizes[0]:.1f} MB ({trimmed[0]:.1f} MB trimmed)",
          flush=True)
    for r in range(rounds):
        await storm(listen, pcm, num, 16 * CHUNK)
        await drained(server)
        gc.collect()
        sizes.append(rss_mb())
        trimmed.append(trimmed_rss_mb())
        print(f"after round {r + 1} ({num} dropped sessions): {sizes[-1]:.1f} MB "
              f"({trimmed[-1]:.1f} MB trimmed), encoder cache "
              f"{len(engine.scheduler.encoder_cache.cached)} entries, "
              f"{len(engine.runner.encoder_cache)} tensors, processor cache "
              f"{engine.runner.processor_cache.num_bytes / 2**20:.1f} MB", flush=True)
    print(f"trimmed RSS last round / baseline: {trimmed[-1] / trimmed[0]:.3f}")
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=100)
    args = parser.parse_args()
    sizes = asyncio.run(main_async(args.rounds, args.sessions))
    print(f"RSS last round / first round: {sizes[-1] / sizes[1]:.3f}; "
          f"last round / baseline: {sizes[-1] / sizes[0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
