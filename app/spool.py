"""Each session's received audio on disk before the engine sees it, until the store has it.

A session's 16 kHz audio goes to `<data_dir>/spool/<session_id>/` as raw PCM16 segment files
named by their first sample, written straight to the OS (no Python buffer) before the audio
is queued for the engine: a server that dies (kill -9, out of memory, a crash) leaves every
accepted sample no final covers on disk, and the next start transcribes it into the store
(app/recovery.py). Segments wholly behind what the session has transcribed and stored are
deleted as the session goes on, so a session's spool holds its backlog plus at most one
segment; a session that ends with its transcript stored removes its folder.

fsync: without `fsync` the spool survives the server process dying, not the machine; with
it, each segment is fsynced at most every `FSYNC_INTERVAL_S` and when it is full, so a
machine crash loses at most that much audio.

A write that fails (a full disk) stops that session's spool: the audio is still transcribed,
but a crash from then on would lose what came after; `failure` says why.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from audio.io import SAMPLE_RATE, float_to_pcm16, pcm_to_float

log = logging.getLogger(__name__)

SEGMENT_SAMPLES = 60 * SAMPLE_RATE  # a segment file: 60 s, 1.9 MB
FSYNC_INTERVAL_S = 1.0
META = "session.json"
LOCK = ".lock"


class SessionSpool:
    """One session's spool folder: append audio, delete what is done."""

    def __init__(self, folder: Path, owner: Spool):
        self.folder = folder
        self.owner = owner
        self.fsync = owner.fsync
        self.num_samples = 0  # 16 kHz samples written
        self.segment_start = 0  # first sample of the open segment
        self.kept: deque[int] = deque()  # first samples of the closed segments still on disk
        self.file: int | None = None  # the open segment's descriptor
        self.synced_at = time.monotonic()
        self.failure: str | None = None  # why writing stopped

    def write(self, samples: np.ndarray) -> None:
        """Append (n,) float32 16 kHz samples (the session's timeline, in order)."""
        if self.failure is not None or not samples.size:
            return
        try:
            while samples.size:
                if self.file is None or self.num_samples - self.segment_start >= SEGMENT_SAMPLES:
                    self._next_segment()
                room = SEGMENT_SAMPLES - (self.num_samples - self.segment_start)
                piece, samples = samples[:room], samples[room:]
                data = float_to_pcm16(piece)
                assert self.file is not None
                written = os.write(self.file, data)
                if written != len(data):
                    raise OSError(28, "short write (disk full?)")
                self.num_samples += piece.size
            if self.fsync and time.monotonic() - self.synced_at >= FSYNC_INTERVAL_S:
                self._sync()
        except OSError as e:
            self.fail(e)
            self.close()

    def fail(self, error: OSError) -> None:
        """Writing failed: this session is not spooled from here on; its owner says so."""
        self.failure = self.owner.failure = f"cannot write {self.folder.name}: {error.strerror or error}"
        self.owner.num_failures += 1
        log.error("spool: %s; the rest of this session is not spooled", self.failure)

    def _next_segment(self) -> None:
        if self.file is not None:
            self.kept.append(self.segment_start)
        self._close_file()
        self.segment_start = self.num_samples
        path = self.folder / f"{self.segment_start:012d}.pcm"
        self.file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.owner.failure = None  # the disk takes files again

    def _sync(self) -> None:
        if self.file is not None:
            os.fsync(self.file)
        self.synced_at = time.monotonic()

    def _close_file(self) -> None:
        if self.file is not None:
            try:
                if self.fsync:
                    self._sync()
            finally:
                os.close(self.file)
                self.file = None

    def release(self, done_ms: int) -> None:
        """The session's transcript before `done_ms` is stored: delete the segments that
        end before it (never the open one)."""
        done = done_ms * SAMPLE_RATE // 1000
        while self.kept and self.kept[0] + SEGMENT_SAMPLES <= done:
            (self.folder / f"{self.kept.popleft():012d}.pcm").unlink(missing_ok=True)

    def close(self) -> None:
        """Stop writing; the files stay (the server stops with this session unfinished)."""
        try:
            self._close_file()
        except OSError:
            pass

    def remove(self) -> None:
        """The session ended and its transcript is stored: delete its folder."""
        self.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def segments(folder: Path) -> list[tuple[int, Path]]:
    """A spool folder's segment files, (first sample, path), in order."""
    found = []
    for path in folder.glob("*.pcm"):
        if path.stem.isdigit():
            found.append((int(path.stem), path))
    return sorted(found)


@dataclass
class Leftover:
    """A session's spool that no run finished: a server died or stopped with it open."""

    session_id: str
    folder: Path
    protocol: str

    def num_samples(self) -> int:
        found = segments(self.folder)
        if not found:
            return 0
        start, path = found[-1]
        return start + path.stat().st_size // 2

    def first_sample(self) -> int:
        found = segments(self.folder)
        return found[0][0] if found else 0

    def read(self, start: int, piece_samples: int) -> Iterator[np.ndarray]:
        """(n,) float32 pieces of the spooled audio from sample `start` on (or from the
        first spooled sample, if later). A gap between segments (one deleted) ends it."""
        position = None
        for first, path in segments(self.folder):
            raw = path.read_bytes()
            data = pcm_to_float(raw[: len(raw) // 2 * 2]).numpy()  # (a write cut in a sample)
            if position is not None and first != position:
                log.warning("spool %s: a gap at sample %d; recovering up to it", self.session_id, position)
                return
            position = first + data.size
            skip = max(0, start - first)
            for lo in range(skip, data.size, piece_samples):
                yield data[lo : lo + piece_samples]

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class Spool:
    """The spool folder of a data dir: one subfolder per session. One server at a time uses
    a data dir (a second one would take the first one's sessions for leftovers)."""

    def __init__(self, data_dir: Path, fsync: bool = False):
        self.dir = Path(data_dir) / "spool"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lock: int | None = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.close()
            raise ValueError(f"another voxtide server uses the data dir {data_dir}; give each "
                             "server its own --data-dir") from None
        self.fsync = fsync
        self.failure: str | None = None  # why the last session spool stopped; None once one works
        self.num_failures = 0

    def open(self, session_id: str, protocol: str) -> SessionSpool:
        """A new session's spool (one that writes nothing if its folder cannot be made)."""
        folder = self.dir / session_id
        spool = SessionSpool(folder, self)
        try:
            folder.mkdir()
            (folder / META).write_text(json.dumps({"session_id": session_id, "protocol": protocol,
                                                   "created": int(time.time())}))
        except OSError as e:
            spool.fail(e)
        return spool

    def close(self) -> None:
        """Let another server use the data dir."""
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None

    def leftovers(self) -> list[Leftover]:
        """The spools of sessions no run finished, oldest first."""
        found = []
        for folder in sorted(self.dir.iterdir(), key=lambda p: p.stat().st_mtime):
            if not folder.is_dir():
                continue
            try:
                meta = json.loads((folder / META).read_text())
            except (OSError, ValueError):
                meta = {}
            found.append(Leftover(folder.name, folder, str(meta.get("protocol", "unknown"))))
        return found
