"""Server settings, with the defaults `voxtide serve` uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

WEB_DIR = Path(__file__).resolve().parent.parent / "web"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    api_key: str | None = None  # required from clients when set
    max_sessions: int = 16  # concurrent websocket sessions; more are closed with 1013
    max_message_bytes: int = 1 << 20  # larger websocket messages are closed with 1009
    idle_timeout_s: float = 60.0  # no message for this long ends the session
    max_lag_s: float = 15.0  # backlog that earns a rate_limited warning; refuse new sessions
    # while most sessions are over it
    max_backlog_s: float = 120.0  # stop reading a session's socket while it is this far behind
    resume_grace_s: float = 30.0  # a dropped /v1/listen session waits this long for a resume
    data_dir: Path = Path("voxtide-data")  # per-session JSONL transcripts
    fsync: bool = False  # fsync every transcript line (survives a machine crash)
    web_dir: Path = field(default=WEB_DIR)  # static files (allowlisted names only)

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {self.max_sessions}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be at least 1024, got {self.max_message_bytes}")
        if self.idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive, got {self.idle_timeout_s}")
        if not 0 < self.max_lag_s <= self.max_backlog_s:
            raise ValueError(f"need 0 < max_lag_s <= max_backlog_s, got {self.max_lag_s} and "
                             f"{self.max_backlog_s}")
        if self.resume_grace_s < 0:
            raise ValueError(f"resume_grace_s must be >= 0, got {self.resume_grace_s}")
        self.data_dir = Path(self.data_dir)
        self.web_dir = Path(self.web_dir)
