"""The `voxtide` command: serve, transcribe, replay."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from app.config import ENV_PREFIX, ServerConfig, load_settings
from engine.config import EngineConfig
from engine.model.beam import BEAM_SIZE, check_beam_size

SERVE_FLAGS = ("host", "port", "api_key", "max_sessions", "idle_timeout_s", "data_dir", "drain_s")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint file or folder (default: bundled Whisper tiny.en)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def _load(args: argparse.Namespace, int8: bool | None = None):
    import logging

    from engine.model import load_bundle
    from engine.model.loader import precision

    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_bundle(args.model, device=args.device, int8=int8)
    logging.getLogger("voxtide").info("model %s: %s", bundle.name, precision(bundle.model))
    return bundle


def cmd_transcribe(args: argparse.Namespace) -> int:
    from audio import load_audio
    from engine.model.transcribe import transcribe

    check_beam_size(args.beam_size, "--beam-size")
    bundle = _load(args, args.int8)
    status = 0
    for path in args.files:
        try:
            audio = load_audio(path)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 1
            continue
        start = time.perf_counter()
        result = transcribe(bundle, audio, args.beam_size)
        elapsed = time.perf_counter() - start
        if args.json:
            out = {"file": str(path), **result.to_dict(), "compute_seconds": round(elapsed, 3)}
            print(json.dumps(out, ensure_ascii=False))
        else:
            for s in result.segments:
                print(f"[{s.start:8.2f} -> {s.end:8.2f}] {s.text.strip()}")
    return status


def serve_configs(args: argparse.Namespace, environ: dict[str, str]) -> tuple[ServerConfig, EngineConfig]:
    """The server's and the engine's settings: the flags given, over VOXTIDE_<NAME>
    variables, over the --config file, over the defaults. The model runs in a worker process
    unless a setting says worker_process = false."""
    settings = load_settings(args.config, environ, {"server": ServerConfig, "engine": EngineConfig})
    flags = {name: getattr(args, name) for name in SERVE_FLAGS if getattr(args, name) is not None}
    server = ServerConfig(**{**settings["server"], **flags})
    engine = EngineConfig(**{"worker_process": True, **settings["engine"]})
    return server, engine


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os

    from app.server import Server
    from engine.engine import Engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # not a line per request
    config, engine_config = serve_configs(args, dict(os.environ))
    server = Server(Engine(_load(args, engine_config.int8), engine_config), config)
    try:
        asyncio.run(server.serve_forever())
    except KeyboardInterrupt:
        pass
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from app.replay import replay, summary

    reports = asyncio.run(replay(args.url.rstrip("/") + "/v1/listen", [Path(f) for f in args.files],
                                 args.sessions, args.chunk_ms, args.fast, args.loop_seconds,
                                 args.api_key, args.stagger))
    print(summary(reports))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for r in reports:
            (out / f"{r.name}.txt").write_text(r.text + "\n", encoding="utf-8")
    return 1 if any(r.errors for r in reports) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voxtide", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "serve", help="run the server (/v1/listen, /v1/realtime, the web page)",
        description="Run the server. Expert tuning (engine and limits) comes from --config "
                    f"FILE or {ENV_PREFIX}<NAME> variables: see docs/architecture.md (Tuning).")
    p.add_argument("--host", default=None, help=f"address to listen on (default: {ServerConfig.host})")
    p.add_argument("--port", type=int, default=None,
                   help=f"port; 0 picks a free one (default: {ServerConfig.port})")
    p.add_argument("--api-key", default=None,
                   help=f"require this key from clients (default: none; or {ENV_PREFIX}API_KEY)")
    p.add_argument("--max-sessions", type=int, default=None,
                   help=f"concurrent sessions; more are refused (default: {ServerConfig.max_sessions})")
    p.add_argument("--idle-timeout", dest="idle_timeout_s", type=float, default=None,
                   help=f"seconds without a client message that end a session "
                        f"(default: {ServerConfig.idle_timeout_s:g})")
    p.add_argument("--data-dir", default=None,
                   help=f"folder of the per-session JSONL transcripts and the audio spool "
                        f"(default: {ServerConfig.data_dir})")
    p.add_argument("--drain", dest="drain_s", type=float, default=None,
                   help=f"seconds sessions get to finish at SIGTERM; what is left is transcribed "
                        f"from the spool at the next start (default: {ServerConfig.drain_s:g})")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file of expert settings: tables [server] and [engine]")
    _add_model_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("replay", help="stream files to a server as concurrent sessions; measure")
    p.add_argument("files", nargs="+", help="audio files (sessions take them in turn)")
    p.add_argument("--url", default="ws://127.0.0.1:8000")
    p.add_argument("--sessions", type=int, default=1)
    p.add_argument("--fast", action="store_true", help="send as fast as possible, not real time")
    p.add_argument("--loop-seconds", type=float, default=None, help="loop each file to this length")
    p.add_argument("--chunk-ms", type=int, default=100)
    p.add_argument("--stagger", type=float, default=0.0, help="seconds between session starts")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", default=None, help="folder for per-session transcripts")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("transcribe", help="transcribe audio files offline")
    p.add_argument("files", nargs="+", help="wav/flac/ogg files, any rate and channel count")
    p.add_argument("--json", action="store_true", help="one JSON object per file")
    p.add_argument("--beam-size", type=int, default=BEAM_SIZE,
                   help=f"beams of each window's decode (default: {BEAM_SIZE}; 1: greedy)")
    p.add_argument("--int8", action=argparse.BooleanOptionalAction, default=None,
                   help="the encoder's linear layers on int8 weights (CPU; default: where the "
                        "CPU has no native bf16)")
    _add_model_args(p)
    p.set_defaults(func=cmd_transcribe)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # config and checkpoint errors carry an actionable message
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
