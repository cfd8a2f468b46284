"""Trace the decodes of one file streamed into an in-process engine, as `evaluate.py --replay`
streams it: every final's and partial's window between two times, with its prompt, its
reading (timestamps relative to the window's start) and the words each step committed.

    scripts/dev.sh run python scripts/trace_decodes.py FILE --from 74 --to 89 [--previews] [--threads 1]

Where a row of `evaluate.py` reads worse than offline, this shows which decode committed the
words and what it was given: the window (a second reading starts at the last final's end and
is given nothing), the beams, the kept sentence taken as given (`forced`), the temperature
kept and whether Whisper's fallback rule failed it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from audio.container import load_audio  # noqa: E402
from audio.io import SAMPLE_RATE  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine, EngineOutput  # noqa: E402
from engine.model import load_bundle  # noqa: E402
from engine.model.tokenizer import Tokenizer  # noqa: E402
from engine.model_runner import ModelInput, RunnerOutput  # noqa: E402
from engine.timeline import positions_to_ms  # noqa: E402
from scripts.evaluate import replay_steps  # noqa: E402


def spelled(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """Text and timestamp tokens -> the text with each timestamp as <seconds>."""
    out = []
    for t in tokens:
        if t >= tokenizer.timestamp_begin:
            out.append(f"<{positions_to_ms(t - tokenizer.timestamp_begin) / 1000:.2f}>")
        elif t < tokenizer.eot:
            out.append(tokenizer.decode([t]))
    return "".join(out)


def traced(engine: Engine, tokenizer: Tokenizer, lo_ms: int, hi_ms: int, previews: bool) -> None:
    """Have `engine`'s runner print each window it decodes that overlaps [lo_ms, hi_ms)."""
    execute = engine.runner.execute

    def run(inp: ModelInput, stop: Callable[[], bool] | None = None) -> RunnerOutput:
        out = execute(inp, stop)
        results = {r.request_id: r for r in out.results}  # (a request has one window a step)
        for w in inp.windows:
            window, r = w.window, results[w.request_id]
            start, end = positions_to_ms(window.window_start), positions_to_ms(window.window_end)
            if end < lo_ms or start >= hi_ms or (window.preview and not previews):
                continue
            kind = "final" if window.final else "preview" if window.preview else "partial"
            print(f"--- {kind} {start / 1000:.2f}-{end / 1000:.2f} s: {w.beam_size} beams, "
                  f"{w.forced} tokens given, temperature {r.temperature}"
                  + (", failed" if r.failed else "") + (", cancelled" if r.cancelled else ""))
            print(f"    prompt: {spelled(tokenizer, w.prompt)}")
            print(f"    read:   {spelled(tokenizer, r.tokens)}")
        return out

    engine.runner.execute = run


def committed(outputs: list[EngineOutput], lo_ms: int, hi_ms: int) -> None:
    """Print the words the outputs commit that lie in [lo_ms, hi_ms)."""
    for o in outputs:
        words = [w for w in o.committed if lo_ms <= w.end_ms and w.start_ms < hi_ms]
        if words:
            print(f"    committed from {words[0].start_ms / 1000:.2f} s: {''.join(w.text for w in words)}")


def replay(engine: Engine, samples: np.ndarray, chunk: int, lo_ms: int, hi_ms: int) -> None:
    """Stream (n,) 16 kHz samples into `engine` in `chunk`s, every ready step run before the
    next (`evaluate.py --replay`), up to 10 s past `hi_ms` (the span's finals fall due), and
    print the words committed in [lo_ms, hi_ms)."""
    end = (hi_ms + 10_000) * SAMPLE_RATE // 1000
    chunks = -(-end // chunk)  # those that start before `end`, each sent whole
    for outputs in replay_steps(engine, samples[: chunks * chunk], chunk):
        committed(outputs, lo_ms, hi_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--from", dest="lo", type=float, default=0.0, help="seconds")
    parser.add_argument("--to", dest="hi", type=float, default=float("inf"), help="seconds")
    parser.add_argument("--previews", action="store_true", help="show previews too")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (evaluate.py --replay: 1)")
    parser.add_argument("--chunk-ms", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bundle = load_bundle(device="cpu")
    engine = Engine(bundle, EngineConfig())  # (in this process: the runner is wrapped)
    lo_ms, hi_ms = int(args.lo * 1000), int(min(args.hi, 1e9) * 1000)
    traced(engine, bundle.tokenizer, lo_ms, hi_ms, args.previews)
    replay(engine, load_audio(args.file).numpy(), SAMPLE_RATE * args.chunk_ms // 1000, lo_ms, hi_ms)


if __name__ == "__main__":
    main()
