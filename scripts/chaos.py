"""Chaos: kill -9 the server at random moments under N live sessions, restart it, and check
that the transcript store holds every second of audio once.

Each of N clients streams a passage (the Sense and Sensibility recordings, a rotation per
client, `--loops` times) at `--speed` x real time over /v1/listen to a `voxtide serve`
process. First an uninterrupted run gives the reference transcripts. Then the chaos run: in
each of `--rounds` rounds the server is killed (SIGKILL: no drain, no cleanup) after a
random 4-16 s; the clients' connections drop, the server restarts on the same data dir
(recovering what the dead one left in its spool), and each client goes on in a new session
from where it was. After the last round the clients finish and the server is stopped with
SIGTERM. Each client's store records (its sessions' JSONL files, times shifted by where each
session started in the passage) are compared with the uninterrupted run's: word errors,
split into missing (gaps) and extra (duplicates) words, and records that overlap in time.
Audio a client sent that the dying server had not read yet is lost with it (it was never
accepted): that, and words cut at a kill, are the boundary effects.

`--fault term` sends SIGTERM instead (an 8 s drain: each session's input ends at its next
pause, within 2 s; it gets what was done and a 1001);
`--fault worker` kills the model worker instead, and the server goes on with its sessions.
Also measured: how long the model worker outlives its killed server, the SIGTERM exit time,
the worker's restart time, and the seconds of audio recovered from the spool.

    scripts/dev.sh run python scripts/chaos.py [--sessions 8] [--rounds 5] [--seed 1] \
        [--fault kill] [--speed 1] [--loops 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from audio.io import float_to_pcm16  # noqa: E402
from scripts.wer import normalize  # noqa: E402

CHUNK_MS = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`voxtide serve` in a process of its own, on a fixed port and data dir."""

    def __init__(self, data_dir: Path, port: int | None = None, args: tuple[str, ...] = ()):
        self.data_dir, self.port, self.args = Path(data_dir), port or free_port(), args
        self.process: subprocess.Popen | None = None
        self.log = self.data_dir.parent / f"{self.data_dir.name}-server.log"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        """Start it and wait until /healthz answers 200."""
        log = open(self.log, "a")  # noqa: SIM115 (the child writes to it)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--port", str(self.port), "--data-dir",
             str(self.data_dir), *self.args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}); see {self.log}")
            if self.health()[0] == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the server did not get healthy in {timeout:g} s; see {self.log}")

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except OSError:
            return 0, {}

    def worker_pid(self) -> int | None:
        assert self.process is not None
        # (a restarted worker is the child of the thread that started it)
        for path in Path(f"/proc/{self.process.pid}/task").glob("*/children"):
            for pid in path.read_text().split():
                if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():
                    return int(pid)
        return None

    def kill(self, timeout: float = 30.0) -> float | None:
        """SIGKILL the server (not its worker) -> seconds until the worker exited (None: it
        had none)."""
        assert self.process is not None
        worker = self.worker_pid()
        self.process.kill()
        self.process.wait()
        if worker is None:
            return None
        killed = time.monotonic()
        while process_alive(worker) and time.monotonic() - killed < timeout:
            time.sleep(0.02)
        return time.monotonic() - killed

    def terminate(self, timeout: float = 120.0) -> int:
        """SIGTERM -> its exit code."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def spooled_sessions(self) -> list[str]:
        spool = self.data_dir / "spool"
        return sorted(p.name for p in spool.iterdir() if p.is_dir()) if spool.exists() else []


def process_alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def store_words(data_dir: Path, session_id: str) -> list[dict]:
    """A session's stored words ({"word", "start_ms", "end_ms"}), record by record."""
    path = Path(data_dir) / f"{session_id}.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [w for r in records for w in r.get("words", [])]


@dataclass
class Client:
    """One speaker: streams its passage over as many sessions as it takes."""

    pcm: bytes  # 16 kHz PCM16
    speed: float
    sent: int = 0  # bytes of the passage sent so far
    sessions: list[tuple[str, int]] = field(default_factory=list)  # (session id, first byte)
    done: bool = False
    accepted: int | None = None  # where the server said it stopped reading (shutting down)

    async def stream(self, url: str) -> None:
        """Stream from where it is until the passage ends (CloseStream) or the connection
        drops."""
        step = 16000 * 2 * CHUNK_MS // 1000
        try:
            async with connect(f"{url}/v1/listen?encoding=linear16&sample_rate=16000&voxtide_events=true",
                               max_size=None, open_timeout=30) as ws:
                hello = json.loads(await ws.recv())
                self.sessions.append((hello["session_id"], self.sent))
                started, start_byte = time.monotonic(), self.sent
                self.accepted = None
                reader = asyncio.create_task(self._read(ws, start_byte))
                while self.sent < len(self.pcm) and self.accepted is None:
                    chunk = self.pcm[self.sent : self.sent + step]
                    await ws.send(chunk)
                    self.sent += len(chunk)
                    due = started + (self.sent - start_byte) / 32000 / self.speed
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                if self.accepted is not None:  # the server stopped reading: read to its close,
                    await reader  # then go on from what it took
                    self.sent = self.accepted
                    return
                await ws.send(json.dumps({"type": "CloseStream"}))
                await reader
                self.done = True
        except (ConnectionClosed, OSError):
            pass

    async def _read(self, ws, start_byte: int) -> None:
        """Read the session's messages until it ends; when the server says it stopped reading
        (shutting down), note the passage byte the next session starts from (`accepted`)."""
        try:
            async for raw in ws:
                message = json.loads(raw)
                if message.get("code") == "server_shutting_down":
                    self.accepted = start_byte + message["audio_received_samples"] * 2
        except ConnectionClosed:
            pass

    def words(self, data_dir: Path) -> list[dict]:
        """The passage's stored words over all its sessions, in passage time."""
        out = []
        for session_id, first_byte in self.sessions:
            offset_ms = first_byte // 32
            out += [{**w, "start_ms": w["start_ms"] + offset_ms, "end_ms": w["end_ms"] + offset_ms}
                    for w in store_words(data_dir, session_id)]
        return out


def passage(index: int, loops: int) -> np.ndarray:
    """Client `index`'s audio: the five recordings from the index-th on, `loops` times."""
    from tests.helpers import ARCTIC_IDS, concatenated, librivox_path

    paths = [librivox_path(c) for c in ARCTIC_IDS]
    paths = paths[index % 5 :] + paths[: index % 5]
    samples, _ = concatenated(paths * loops, gap_seconds=0.8)
    return samples.numpy()


def align_counts(ref: list[str], hyp: list[str]) -> tuple[int, int, int]:
    """Word alignment -> (substituted, missing, extra)."""
    n, m = len(ref), len(hyp)
    cost = np.zeros((n + 1, m + 1), dtype=np.int32)
    cost[:, 0], cost[0, :] = np.arange(n + 1), np.arange(m + 1)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            cost[i, j] = min(cost[i - 1, j - 1] + (ref[i - 1] != hyp[j - 1]), cost[i - 1, j] + 1,
                             cost[i, j - 1] + 1)
    i, j, sub, miss, extra = n, m, 0, 0, 0
    while i or j:
        if i and j and cost[i, j] == cost[i - 1, j - 1] + (ref[i - 1] != hyp[j - 1]):
            sub += ref[i - 1] != hyp[j - 1]
            i, j = i - 1, j - 1
        elif i and cost[i, j] == cost[i - 1, j] + 1:
            miss, i = miss + 1, i - 1
        else:
            extra, j = extra + 1, j - 1
    return sub, miss, extra


def overlaps(words: list[dict], tolerance_ms: int = 200) -> int:
    """Words that start before the previous word ended (by more than `tolerance_ms`): a
    stretch of audio stored twice."""
    return sum(b["start_ms"] < a["end_ms"] - tolerance_ms for a, b in zip(words, words[1:], strict=False))


async def run_clients(clients: list[Client], url: str) -> None:
    """Stream every unfinished client until all are done or their connections dropped."""
    await asyncio.gather(*(c.stream(url) for c in clients if not c.done))


async def fault_round(clients: list[Client], server: ServerProcess, seconds: float, fault: str) -> dict:
    """Stream for `seconds`, then SIGKILL the server ("kill") or SIGTERM it ("term": a drain)
    -> what was seen. The clients' connections end with it."""
    tasks = [asyncio.create_task(c.stream(server.url)) for c in clients if not c.done]
    await asyncio.sleep(seconds)
    seen: dict = {}
    if fault == "kill":
        seen["worker_exit_s"] = await asyncio.to_thread(server.kill)
    else:
        started = time.monotonic()
        seen["exit_code"] = await asyncio.to_thread(server.terminate)
        seen["term_s"] = time.monotonic() - started
    await asyncio.gather(*tasks)
    seen["spooled_sessions"] = len(server.spooled_sessions())
    return seen


async def worker_rounds(clients: list[Client], server: ServerProcess, pauses: list[float]) -> list[dict]:
    """The clients stream through every round; after each pause the model worker is killed
    and the server starts a new one -> each round's restart time."""
    tasks = [asyncio.create_task(c.stream(server.url)) for c in clients if not c.done]
    seen = []
    for pause in pauses:
        await asyncio.sleep(pause)
        worker = server.worker_pid()
        assert worker is not None
        os.kill(worker, signal.SIGKILL)
        started = time.monotonic()
        while server.worker_pid() in (None, worker) or server.health()[0] != 200:
            await asyncio.sleep(0.05)
        seen.append({"restart_s": time.monotonic() - started})
    await asyncio.gather(*tasks)
    return seen


async def wait_recovered(server: ServerProcess, timeout: float = 600.0) -> None:
    """Until the spool is empty: recovery and the last sessions are done."""
    deadline = time.monotonic() + timeout
    while server.spooled_sessions() and time.monotonic() < deadline:
        await asyncio.sleep(0.5)


def uninterrupted(clients: list[Client], data_dir: Path, args: tuple[str, ...]) -> list[list[dict]]:
    server = ServerProcess(data_dir, args=args)
    server.start()
    asyncio.run(run_clients(clients, server.url))
    server.terminate()
    return [c.words(data_dir) for c in clients]


def chaos(clients: list[Client], data_dir: Path, rounds: int, rng: random.Random, fault: str,
          args: tuple[str, ...]) -> dict:
    server = ServerProcess(data_dir, args=args)
    server.start()
    pauses = [rng.uniform(4.0, 16.0) for _ in range(rounds)]
    if fault == "worker":
        seen = asyncio.run(worker_rounds(clients, server, pauses))
    else:
        seen = []
        for pause in pauses:
            seen.append(asyncio.run(fault_round(clients, server, pause, fault)))
            server.start()
    asyncio.run(run_clients(clients, server.url))
    asyncio.run(wait_recovered(server))
    left = server.spooled_sessions()
    code = server.terminate()
    recovered = [float(m.group(1)) for m in re.finditer(r"recovered \S+: ([\d.]+) s of audio",
                                                        server.log.read_text())]
    return {"rounds_seen": seen, "recovered_sessions": len(recovered),
            "recovered_audio_s": round(sum(recovered), 1), "spool_left": left, "exit_code": code}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--speed", type=float, default=1.0, help="x real time")
    parser.add_argument("--loops", type=int, default=2, help="times each client's passage is repeated")
    parser.add_argument("--fault", choices=("kill", "term", "worker"), default="kill",
                        help="kill -9 the server, SIGTERM it (drain 8 s), or kill -9 its model worker")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    audio = [float_to_pcm16(passage(i, args.loops)) for i in range(args.sessions)]
    server_args = ("--max-sessions", str(max(16, args.sessions)))
    with tempfile.TemporaryDirectory() as tmp:
        base = [Client(pcm, args.speed) for pcm in audio]
        reference = uninterrupted(base, Path(tmp) / "reference", server_args)
        clients = [Client(pcm, args.speed) for pcm in audio]
        fault_args = ("--drain", "8") if args.fault == "term" else ()
        report = chaos(clients, Path(tmp) / "chaos", args.rounds, rng, args.fault,
                       server_args + fault_args)
        rows = []
        for i, (client, ref) in enumerate(zip(clients, reference, strict=True)):
            words = client.words(Path(tmp) / "chaos")
            hyp = normalize(" ".join(w["word"] for w in words))
            sub, miss, extra = align_counts(normalize(" ".join(w["word"] for w in ref)), hyp)
            rows.append({"client": i, "sessions": len(client.sessions), "reference_words": len(ref),
                         "words": len(words), "substituted": sub, "missing": miss, "extra": extra,
                         "overlapping": overlaps(words), "audio_s": len(client.pcm) / 32000,
                         "text": " ".join(hyp), "uninterrupted": " ".join(w["word"] for w in ref),
                         "session_starts_s": [first // 32000 for _, first in client.sessions]})
    n = sum(r["reference_words"] for r in rows)
    summary = {
        "sessions": args.sessions, "rounds": args.rounds, "fault": args.fault, "seed": args.seed,
        "speed": args.speed,
        "reference_words": n, "missing": sum(r["missing"] for r in rows),
        "extra": sum(r["extra"] for r in rows), "substituted": sum(r["substituted"] for r in rows),
        "overlapping": sum(r["overlapping"] for r in rows),
        "wer_vs_uninterrupted": sum(r["substituted"] + r["missing"] + r["extra"] for r in rows) / max(n, 1),
        **report, "clients": rows,
    }
    for r in rows:
        print(f"client {r['client']}: {r['sessions']} sessions, {r['words']}/{r['reference_words']} words, "
              f"{r['missing']} missing, {r['extra']} extra, {r['substituted']} substituted, "
              f"{r['overlapping']} overlapping")
    seen = report["rounds_seen"]
    facts = {key: max(r[key] for r in seen) for key in ("worker_exit_s", "term_s", "restart_s")
             if seen and key in seen[0] and seen[0][key] is not None}
    print(f"{args.rounds} x {args.fault} under {args.sessions} sessions: WER vs uninterrupted "
          f"{summary['wer_vs_uninterrupted']:.1%} ({summary['missing']} missing, {summary['extra']} extra, "
          f"{summary['substituted']} substituted of {n}); overlapping words {summary['overlapping']}; "
          + "".join(f"max {key} {value:.2f}; " for key, value in facts.items())
          + f"recovered {report['recovered_audio_s']} s in {report['recovered_sessions']} sessions; "
          f"spool left {len(report['spool_left'])}; last exit code {report['exit_code']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    ok = (not report["spool_left"] and report["exit_code"] == 0 and facts.get("worker_exit_s", 0) < 2.0
          and all(r.get("exit_code", 0) == 0 for r in seen))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
