"""Finalized transcript segments, appended per session to `<data_dir>/<session_id>.jsonl`.

A line is written (and flushed to the OS) as soon as its text is final, before it is sent,
so a server crash loses no committed text. `fsync=True` also survives a machine crash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO


class TranscriptStore:
    def __init__(self, data_dir: str | Path, fsync: bool = False):
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.files: dict[str, TextIO] = {}

    def path(self, session_id: str) -> Path:
        return self.dir / f"{session_id}.jsonl"

    def append(self, session_id: str, record: dict[str, Any]) -> None:
        f = self.files.get(session_id)
        if f is None:
            f = self.files[session_id] = open(self.path(session_id), "a", encoding="utf-8")
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())

    def close(self, session_id: str) -> None:
        f = self.files.pop(session_id, None)
        if f is not None:
            f.close()

    def read(self, session_id: str) -> list[dict[str, Any]]:
        path = self.path(session_id)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
