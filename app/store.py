"""Finalized transcript segments, appended per session to `<data_dir>/<session_id>.jsonl`.

A line is written (and flushed to the OS) as soon as its text is final, before it is sent,
so a server crash loses no committed text. `fsync=True` also survives a machine crash.

A write that fails (a full disk, a directory gone read-only) loses nothing either: the
session's records stay in memory, in order, and are written again at its next record, at
`retry()` (the server calls it every few seconds) and when the session closes; the file is
cut back to its last whole line first, so it never holds half a record. Meanwhile `failure`
says why, and the server reports itself degraded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class TranscriptStore:
    def __init__(self, data_dir: str | Path, fsync: bool = False):
        self.dir = Path(data_dir)
        try:  # refuse to start on a folder that cannot be written
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".voxtide-write-test"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"the data dir {self.dir} is not writable ({e.strerror or e}); "
                             "give --data-dir a writable folder") from None
        self.fsync = fsync
        self.pending: dict[str, list[bytes]] = {}  # session -> lines not yet written, in order
        self.sizes: dict[str, int] = {}  # session -> bytes of whole lines in its file
        self.closed: set[str] = set()  # sessions ended with lines still pending
        self.failure: str | None = None  # why the last write failed; None once all are written
        self.num_failures = 0  # failed writes so far

    def path(self, session_id: str) -> Path:
        return self.dir / f"{session_id}.jsonl"

    def append(self, session_id: str, record: dict[str, Any]) -> bool:
        """Store a record -> whether it (and every earlier one) is written now; if not, it
        is kept and written later."""
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        self.pending.setdefault(session_id, []).append(line)
        return self._write(session_id)

    def _write(self, session_id: str) -> bool:
        lines = self.pending.get(session_id)
        if not lines:
            return True
        path = self.path(session_id)
        try:
            with open(path, "ab") as f:
                size = self.sizes.get(session_id)
                if size is not None and f.tell() != size:
                    f.truncate(size)  # half a line from a failed write
                f.write(b"".join(lines))
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
                self.sizes[session_id] = f.tell()
        except OSError as e:
            self.num_failures += 1
            self.failure = f"cannot write {path.name}: {e.strerror or e}"
            if session_id not in self.sizes and path.exists():
                self.sizes[session_id] = 0  # (a new file: all of it is ours to cut)
            return False
        del self.pending[session_id]
        if not self.pending:
            self.failure = None
        return True

    def retry(self) -> bool:
        """Write what is pending -> whether nothing is left."""
        for session_id in list(self.pending):
            if self._write(session_id) and session_id in self.closed:
                self._forget(session_id)
        return not self.pending

    def close(self, session_id: str) -> bool:
        """The session ended: write what is pending (or keep it for `retry`) -> whether its
        whole transcript is written."""
        if self._write(session_id):
            self._forget(session_id)
            return True
        self.closed.add(session_id)
        return False

    def _forget(self, session_id: str) -> None:
        self.sizes.pop(session_id, None)
        self.closed.discard(session_id)

    @property
    def num_pending(self) -> int:
        return sum(len(lines) for lines in self.pending.values())

    def covered_ms(self, session_id: str) -> int:
        """The end of the session's stored transcript, in its audio ms (0: none), for a
        recovery to go on from. A half-written last line (the server died in a write) is cut."""
        path = self.path(session_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) < len(data):
            with open(path, "r+b") as f:
                f.truncate(len(whole))
        end = 0
        for line in whole.splitlines():
            try:
                end = max(end, int(json.loads(line).get("end_ms", 0)))
            except (ValueError, TypeError, AttributeError):
                continue
        return end

    def read(self, session_id: str) -> list[dict[str, Any]]:
        path = self.path(session_id)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
