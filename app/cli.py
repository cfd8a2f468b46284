"""The `voxtide` command: serve, transcribe, replay, bench."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine.engine import EngineConfig
from engine.scheduler import SchedulerConfig


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint file or folder (default: bundled Whisper tiny.en)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def _load(args: argparse.Namespace):
    from engine.model import load_bundle

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_bundle(args.model, device=args.device)


def cmd_transcribe(args: argparse.Namespace) -> int:
    from audio import load_audio
    from engine.model.transcribe import transcribe

    bundle = _load(args)
    status = 0
    for path in args.files:
        try:
            audio = load_audio(path)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 1
            continue
        start = time.perf_counter()
        result = transcribe(bundle, audio)
        elapsed = time.perf_counter() - start
        if args.json:
            out = {"file": str(path), **result.to_dict(), "compute_seconds": round(elapsed, 3)}
            print(json.dumps(out, ensure_ascii=False))
        else:
            for s in result.segments:
                print(f"[{s.start:8.2f} -> {s.end:8.2f}] {s.text.strip()}")
    return status


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os

    from app.config import ServerConfig
    from app.server import Server
    from engine.engine import Engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # not a line per request
    config = ServerConfig(host=args.host, port=args.port,
                          api_key=args.api_key or os.environ.get("VOXTIDE_API_KEY") or None,
                          max_sessions=args.max_sessions, max_message_bytes=args.max_message_bytes,
                          idle_timeout_s=args.idle_timeout, data_dir=args.data_dir, fsync=args.fsync,
                          max_lag_s=args.max_lag, max_backlog_s=args.max_backlog,
                          resume_grace_s=args.resume_grace)
    engine_config = EngineConfig(scheduler=SchedulerConfig(max_partials=args.max_partials),
                                 pad_seconds=args.pad_seconds, endpoint_ms=args.endpoint_ms or None,
                                 preview_pad_seconds=args.preview_pad_seconds or None,
                                 max_finals=args.max_finals, worker_process=args.worker == "process")
    server = Server(Engine(_load(args), engine_config), config)
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

    p = sub.add_parser("serve", help="run the websocket server (/v1/listen, /v1/realtime)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help="require this key (or set VOXTIDE_API_KEY)")
    p.add_argument("--max-sessions", type=int, default=16)
    p.add_argument("--max-message-bytes", type=int, default=1 << 20)
    p.add_argument("--idle-timeout", type=float, default=60.0, help="seconds without a message")
    p.add_argument("--data-dir", default="voxtide-data", help="per-session JSONL transcripts")
    p.add_argument("--fsync", action="store_true", help="fsync each transcript line")
    p.add_argument("--max-lag", type=float, default=15.0,
                   help="seconds of backlog that earn a rate_limited warning (and refuse new "
                        "sessions while most sessions are over it)")
    p.add_argument("--max-backlog", type=float, default=120.0,
                   help="stop reading a session's socket while it is this many seconds behind")
    p.add_argument("--resume-grace", type=float, default=30.0,
                   help="seconds a dropped /v1/listen session waits for a resume (0: none)")
    p.add_argument("--pad-seconds", type=int, default=None,
                   help="pad encoder windows to a multiple of this (faster, slightly higher WER; "
                        "default: 30 s windows)")
    p.add_argument("--endpoint-ms", type=int, default=250,
                   help="a pause this long after speech commits the utterance at once (0: off)")
    p.add_argument("--preview-pad-seconds", type=int, default=EngineConfig.preview_pad_seconds,
                   help="partials that cannot commit yet decode only the audio since the last "
                        "final, padded to a multiple of this (0: the whole window, as finals)")
    p.add_argument("--max-partials", type=int, default=SchedulerConfig.max_partials,
                   help="partial (tentative) windows decoded per step (none in a step with finals)")
    p.add_argument("--max-finals", type=int, default=None,
                   help="final windows decoded per step (default: 2 on the CPU, where a batch "
                        "of windows costs the sum of their encoder passes; 16 on a GPU)")
    p.add_argument("--worker", choices=("process", "thread"), default="process",
                   help="run the model in a worker process (default), or in a thread of the "
                        "server's process, where it shares the interpreter lock")
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
