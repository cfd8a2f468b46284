"""The `voxtide` command: serve, transcribe, replay, bench."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voxtide", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

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
