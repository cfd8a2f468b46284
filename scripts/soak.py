"""Soak: one long /v1/listen session (a recording looped to hours) replayed as fast as the
server takes it, with the server in this process so its state can be read as it runs.

Every minute of session audio it records the mean engine step time, the RSS of the server
and of its model worker, the items on the session timeline and the live ones (encoder input
still held), and the encoder-cache entries; at the end it prints the last-minute /
first-minute ratios (goal <= 1.2), the step-time ratio of the last tenth's mean over the first
tenth's, and the WER scored loop by loop (each final word goes to the loop its midpoint falls in).

    scripts/dev.sh run python scripts/soak.py [--hours 2] [--pad-seconds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.replay import replay_session  # noqa: E402
from app.server import Server  # noqa: E402
from audio.frames import ITEM_SAMPLES  # noqa: E402
from audio.io import SAMPLE_RATE  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from scripts.wer import word_errors  # noqa: E402
from tests.helpers import concatenated, librivox_path, transcripts  # noqa: E402
from tests.server_client import running_server, url  # noqa: E402


def rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker_rss_mb(engine: Engine) -> float:
    """RSS of the model's worker process (NaN when the model runs in this one)."""
    process = getattr(engine.runner, "process", None)
    return rss_mb(process.pid) if process is not None else float("nan")


def loop_audio() -> tuple[np.ndarray, str]:
    """The arctic passage, padded to whole 80 ms items so every loop has the same items."""
    folder = librivox_path("0890").parent
    paths = sorted(p for p in transcripts() if p.parent == folder)
    samples, reference = concatenated(paths, gap_seconds=0.5)
    samples = samples.numpy()
    pad = -samples.size % ITEM_SAMPLES
    return np.concatenate([samples, np.zeros(pad, np.float32)]), reference


def loop_errors(words: list[tuple[int, int, str]], reference: str, loop_ms: int,
                loops: int) -> tuple[int, int]:
    """Word errors summed over loops: one alignment per loop, not one over hours of words."""
    texts: list[list[str]] = [[] for _ in range(loops)]
    for start_ms, end_ms, text in words:
        texts[min(loops - 1, (start_ms + end_ms) // 2 // loop_ms)].append(text)
    total_errors = total_words = 0
    for parts in texts:
        errors, words = word_errors(reference, " ".join(parts))
        total_errors, total_words = total_errors + errors, total_words + words
    return total_errors, total_words


async def soak(hours: float, pad_seconds: int | None, chunk_ms: int) -> dict:
    base, reference = loop_audio()
    loops = int(hours * 3600 * SAMPLE_RATE) // base.size + 1
    samples = np.tile(base, loops)
    folder = Path(tempfile.mkdtemp(prefix="voxtide-soak-"))
    config = EngineConfig(pad_seconds=pad_seconds, worker_process=True)  # as `voxtide serve` runs
    async with running_server(folder, config, idle_timeout_s=3600) as server:
        return await soak_with(server, base, reference, loops, samples, pad_seconds, chunk_ms)


async def soak_with(server: Server, base: np.ndarray, reference: str, loops: int, samples: np.ndarray,
                    pad_seconds: int | None, chunk_ms: int) -> dict:
    engine = server.engine
    rows: list[dict] = []
    metrics = server.metrics

    def steps() -> tuple[float, float, float]:  # step seconds summed, steps, fallbacks
        return (metrics.value("voxtide_engine_step_seconds_sum"),
                metrics.value("voxtide_engine_step_seconds_count"),
                metrics.value("voxtide_decode_fallbacks_total"))

    async def sample() -> None:
        last_sum, last_count, last_fallbacks, started = 0.0, 0, 0.0, time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            streams = list(engine.streams.values())
            if not streams:
                continue
            request = streams[0].request
            minute = request.num_decoded_positions // (50 * 60)
            if minute <= len(rows):
                continue
            step_sum, step_count, fallbacks = steps()
            count = step_count - last_count
            rows.append({
                "audio_min": minute, "wall_s": round(time.monotonic() - started, 1),
                "steps": int(count),
                "fallbacks": int(fallbacks - last_fallbacks),
                "step_ms": round(1000 * (step_sum - last_sum) / count, 1) if count else None,
                "rss_mb": round(rss_mb(), 1),
                "worker_rss_mb": round(worker_rss_mb(engine), 1),
                "spool_mb": round(sum(f.stat().st_size for f in server.spool.dir.glob("*/*.pcm")) / 1e6, 1),
                "items": len(request.mm_features),
                "live_items": request.num_encoded_items - request.num_freed_items,
                "cache_entries": len(engine.scheduler.encoder_cache.cached),
            })
            last_sum, last_count, last_fallbacks = step_sum, step_count, fallbacks
            r = rows[-1]
            print(f"min {minute:4d}  wall {r['wall_s']:7.1f} s  step {r['step_ms']} ms  "
                  f"fallbacks {r['fallbacks']}  "
                  f"rss {r['rss_mb']} MB  worker {r['worker_rss_mb']} MB  spool {r['spool_mb']} MB  "
                  f"items {r['items']}  "
                  f"live {r['live_items']}", flush=True)

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    report = await replay_session(url(server, "/v1/listen"), "soak", samples, chunk_ms=chunk_ms, fast=True)
    wall = time.monotonic() - started
    sampler.cancel()
    errors, words = loop_errors(report.words, reference, base.size * 1000 // SAMPLE_RATE, loops)
    if len(rows) < 3:
        raise SystemExit("too short to compare minutes; use --hours 0.05 or more")
    first, last = rows[1], rows[-1]  # minute 0 includes the model's warm-up
    span = max(1, len(rows) // 10)  # means over the first and last tenth (machines are noisy)
    head, tail = rows[1 : 1 + span], rows[-span:]
    # a step that re-decodes a window at higher temperatures costs several decodes: compare
    # the minutes without one too (the fallbacks depend on the text, not on session length)
    clean_head = [r["step_ms"] for r in head if r["fallbacks"] == 0]
    clean_tail = [r["step_ms"] for r in tail if r["fallbacks"] == 0]
    return {
        "audio_hours": round(samples.size / SAMPLE_RATE / 3600, 3), "wall_s": round(wall, 1),
        "rtf": round(wall / (samples.size / SAMPLE_RATE), 4), "wer": round(errors / words, 4),
        "errors": report.errors, "pad_seconds": pad_seconds,
        "step_ratio": round(last["step_ms"] / first["step_ms"], 3),
        "step_ratio_tenths": round(mean(r["step_ms"] for r in tail) / mean(r["step_ms"] for r in head), 3),
        "step_ratio_tenths_no_fallback": round(mean(clean_tail) / mean(clean_head), 3)
        if clean_head and clean_tail else None,
        "fallbacks_first_last_tenth": [sum(r["fallbacks"] for r in head), sum(r["fallbacks"] for r in tail)],
        "rss_ratio": round(last["rss_mb"] / first["rss_mb"], 3),
        "worker_rss_ratio": round(last["worker_rss_mb"] / first["worker_rss_mb"], 3),
        "live_items_ratio": round(last["live_items"] / max(1, first["live_items"]), 3),
        "rows": rows, "text": report.text, "words": report.words,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--pad-seconds", type=int, default=None)
    parser.add_argument("--chunk-ms", type=int, default=1000)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    result = asyncio.run(soak(args.hours, args.pad_seconds, args.chunk_ms))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k not in ("rows", "text", "words")}
    print(json.dumps(summary))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
