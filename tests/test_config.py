"""Settings: `voxtide serve` flags, expert tuning from a TOML file and the environment."""

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

from app.cli import main, serve_configs
from app.config import ServerConfig
from engine.config import EngineConfig


def serve_args(**flags) -> argparse.Namespace:
    names = ("host", "port", "api_key", "max_sessions", "idle_timeout_s", "data_dir", "drain_s", "config")
    return argparse.Namespace(**{name: flags.get(name) for name in names})


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path):
    config = tmp_path / "voxtide.toml"
    config.write_text('[server]\nmax_sessions = 4\nmax_lag_s = 5\nfsync = true\n'
                      '[engine]\nendpoint_ms = 400\npad_seconds = 10\nmax_finals = 3\n')
    env = {"VOXTIDE_ENDPOINT_MS": "300", "VOXTIDE_MAX_SESSIONS": "6", "VOXTIDE_PAD_SECONDS": "none",
           "VOXTIDE_INT8": "1", "VOXTIDE_VENV_ROOT": "/elsewhere"}  # not a setting: ignored
    server, engine = serve_configs(serve_args(config=str(config), max_sessions=8), env)
    assert server.max_sessions == 8  # the flag
    assert server.max_lag_s == 5.0 and server.fsync is True  # the file
    assert engine.endpoint_ms == 300 and engine.pad_seconds is None and engine.int8  # the environment
    assert engine.max_finals == 3 and engine.worker_process is True  # the file; serve's default
    server, engine = serve_configs(serve_args(), {})
    assert server == ServerConfig()
    assert engine == EngineConfig(worker_process=True)


@pytest.mark.parametrize("text, message", [
    ("[engine]\nendpoint = 300\n", "unknown setting 'endpoint'"),
    ("[model]\nname = 'x'\n", r"unknown table \[model\]"),
    ("[engine]\nendpoint_ms = 'soon'\n", "endpoint_ms must be int"),
    ("[engine]\nendpoint_ms = 5\n", "endpoint_ms must be 80-10000"),
    ("[server]\nmax_sessions = 0\n", "max_sessions must be at least 1"),
    ("[engine]\nprompt_tokens = 300\n", "prompt_tokens must be 0-223"),
    ("[engine\n", "cannot read the config file"),
])
def test_bad_settings_are_refused_with_the_fix(tmp_path, text, message):
    config = tmp_path / "voxtide.toml"
    config.write_text(text)
    with pytest.raises(ValueError, match=message):
        serve_configs(serve_args(config=str(config)), {})


def test_bad_environment_values_name_the_variable():
    with pytest.raises(ValueError, match="VOXTIDE_FSYNC must be bool"):
        serve_configs(serve_args(), {"VOXTIDE_FSYNC": "maybe"})
    with pytest.raises(ValueError, match="VOXTIDE_MAX_LAG_S must be float"):
        serve_configs(serve_args(), {"VOXTIDE_MAX_LAG_S": "lots"})


def test_serve_help_shows_a_few_user_flags_with_their_defaults():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = out.getvalue()
    flags = set(re.findall(r"^\s+(--[a-z-]+)", text, re.M)) - {"--help"}
    assert len(flags) <= 11, flags
    assert {"--host", "--port", "--api-key", "--config", "--model"} <= flags
    assert "default: 8000" in text and "default: 16" in text
    assert "docs/architecture.md" in text


def test_every_setting_is_documented():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    for cls in (ServerConfig, EngineConfig):
        for name in cls.__dataclass_fields__:
            assert f"`{name}`" in doc, name
