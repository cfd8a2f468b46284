"""Server settings, with the defaults `voxtide serve` uses, and the loader of settings from a
TOML file and the environment (for ServerConfig and the engine's EngineConfig alike)."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
ENV_PREFIX = "VOXTIDE_"  # VOXTIDE_<FIELD NAME>, e.g. VOXTIDE_ENDPOINT_MS=300


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
    max_uploads: int = 4  # files transcribed over HTTP at once; more get 429
    max_upload_bytes: int = 512 << 20  # larger uploads get 413
    max_upload_s: float = 4 * 3600.0  # longer audio in an upload gets 400
    metrics_auth: bool = False  # /metrics needs the API key too
    data_dir: Path = Path("voxtide-data")  # per-session JSONL transcripts and the audio spool
    fsync: bool = False  # fsync transcript lines and the spool (survives a machine crash)
    drain_s: float = 25.0  # at shutdown, sessions get this long to finish; the rest is spooled
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
        if self.max_uploads < 0 or self.max_upload_bytes < 1024 or self.max_upload_s <= 0:
            raise ValueError("need max_uploads >= 0, max_upload_bytes >= 1024 and max_upload_s > 0")
        if self.drain_s < 0:
            raise ValueError(f"drain_s must be >= 0, got {self.drain_s}")
        if self.resume_grace_s < 0:
            raise ValueError(f"resume_grace_s must be >= 0, got {self.resume_grace_s}")
        self.data_dir = Path(self.data_dir)
        self.web_dir = Path(self.web_dir)


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """A setting from a TOML file or the environment, as the field's type."""
    args = get_args(hint)
    optional = type(None) in args
    base = next((t for t in args if t is not type(None)), hint) if args else hint
    if isinstance(value, str) and base is not str:
        text = value.strip().lower()
        if optional and text in ("", "none", "off"):
            return None
        if base is bool:
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
        else:
            try:
                return base(value.strip())
            except ValueError:
                pass
        raise ValueError(f"setting {name} must be {getattr(base, '__name__', base)}, got {value!r}")
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ValueError(f"setting {name} must be {getattr(base, '__name__', base)}, got {value!r}")
    return value


def _fields(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def load_settings(path: str | Path | None, environ: Mapping[str, str],
                  classes: dict[str, type]) -> dict[str, dict[str, Any]]:
    """Settings for each dataclass in `classes` (TOML table name -> class), from a TOML file
    (one table per class) and then VOXTIDE_<FIELD> environment variables, which win.
    -> table name -> {field: value}. Unknown tables or fields in the file are errors."""
    out: dict[str, dict[str, Any]] = {table: {} for table in classes}
    known = {table: _fields(cls) for table, cls in classes.items()}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"cannot read the config file {path}: {e}") from e
        for table, values in data.items():
            if table not in classes or not isinstance(values, dict):
                raise ValueError(f"{path}: unknown table [{table}]; the tables are "
                                 + ", ".join(f"[{t}]" for t in classes))
            for name, value in values.items():
                if name not in known[table]:
                    raise ValueError(f"{path}: unknown setting {name!r} in [{table}]; see "
                                     f"docs/architecture.md (Tuning) for the settings")
                out[table][name] = _coerce(name, known[table][name], value)
    for table, hints in known.items():
        for name, hint in hints.items():
            value = environ.get(ENV_PREFIX + name.upper())
            if value is not None:
                out[table][name] = _coerce(ENV_PREFIX + name.upper(), hint, value)
    return out
