"""Evaluate: WER and latency of Voxtide streaming vs offline, with faster-whisper int8 as peer.

The set: the pocketsphinx-testdata recordings (the five Sense and Sensibility passages once,
then repeated in different orders into longer sessions; the card-game phrases) and espeak-ng
passages. Each
recording goes through
- `stream`: a /v1/listen session on a server in this process, at real-time pace in 100 ms
  chunks (`--fast`: as fast as the socket takes it); WER of the finals, final latency
  p50/p95 (a final's arrival minus when the audio up to its end was sent), time to first
  partial;
- `offline`: Voxtide's `transcribe` (Whisper's long-form algorithm), WER and RTF;
- `fw-int8`: faster-whisper with CTranslate2 int8 on the same weights, greedy, RTF and WER
  on the same machine (skipped when faster-whisper is not installed).
WER is on normalized text (case, punctuation, numbers) and pooled over the set.

    scripts/dev.sh run python scripts/evaluate.py [--parallel 1] [--fast] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.replay import percentile, replay_session  # noqa: E402
from app.server import Server  # noqa: E402
from audio.io import SAMPLE_RATE, load_audio  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.loader import default_model_path  # noqa: E402
from engine.model.transcribe import transcribe  # noqa: E402
from scripts.wer import word_errors  # noqa: E402
from tests.helpers import ARCTIC_IDS, CARDS, bundle, concatenated, librivox_path  # noqa: E402
from tests.server_client import running_server, url  # noqa: E402

# Passages for espeak-ng (written for this set; plain words, no numbers or names to spell).
PASSAGES = {
    "espeak-harbour": (
        "The harbour was quiet in the early morning. A few boats rocked gently against the "
        "wooden pier, and the smell of salt and tar hung in the cold air. An old fisherman "
        "sat on an upturned crate, mending a net with slow and careful hands. He had done "
        "this work for most of his life, and he did not need to look at the knots any more."),
    "espeak-library": (
        "The library opens at nine and closes at six on weekdays. Visitors may borrow up to "
        "five books at a time, and each loan lasts three weeks. Please return books to the "
        "desk near the main entrance. Quiet study rooms can be booked at the front counter, "
        "and the reading room on the second floor is open to everyone."),
    "espeak-weather": (
        "Tomorrow will start cloudy with a chance of light rain in the north. By the "
        "afternoon the clouds should clear from the west, and temperatures will rise to "
        "around twenty degrees. The wind will be light, turning stronger near the coast in "
        "the evening. The weekend looks dry and bright across most of the country."),
}


@dataclass
class Recording:
    name: str
    samples: np.ndarray  # (n,) float32 16 kHz
    reference: str

    @property
    def seconds(self) -> float:
        return self.samples.size / SAMPLE_RATE


@dataclass
class Row:
    recording: Recording
    errors: dict[str, tuple[int, int]] = field(default_factory=dict)  # system -> (errors, words)
    seconds: dict[str, float] = field(default_factory=dict)  # system -> compute (wall) seconds
    latencies: list[float] = field(default_factory=list)
    first_partial_s: float | None = None
    texts: dict[str, str] = field(default_factory=dict)  # system -> transcript


def espeak(text: str, folder: Path, name: str) -> np.ndarray:
    path = folder / f"{name}.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(path), text], check=True)
    return load_audio(path).numpy()


def recordings() -> list[Recording]:
    paths = [librivox_path(c) for c in ARCTIC_IDS]
    samples, reference = concatenated(paths, gap_seconds=0.8)
    out = [Recording("austen-once", samples.numpy(), reference)]  # each passage once
    for i, order in enumerate(([0, 1, 2, 3, 4, 4, 3, 2, 1, 0, 2, 0, 4, 1, 3],
                               [3, 1, 4, 0, 2, 1, 3, 0, 4, 2])):
        samples, reference = concatenated([paths[j] for j in order], gap_seconds=0.8)
        out.append(Recording(f"austen-{i + 1}", samples.numpy(), reference))
    samples, reference = concatenated(sorted(CARDS.glob("*.wav")), gap_seconds=1.0)
    out.append(Recording("cards", samples.numpy(), reference))
    with tempfile.TemporaryDirectory() as folder:
        for name, text in PASSAGES.items():
            out.append(Recording(name, espeak(text, Path(folder), name), text))
    return out


async def stream_all(rows: list[Row], parallel: int, fast: bool, config: EngineConfig) -> None:
    gate = asyncio.Semaphore(parallel)

    async def one(server: Server, row: Row) -> None:
        async with gate:
            report = await replay_session(url(server, "/v1/listen"), row.recording.name,
                                          row.recording.samples, chunk_ms=100, fast=fast)
        if report.errors:
            raise RuntimeError(f"{row.recording.name}: server errors {report.errors}")
        row.errors["stream"] = word_errors(row.recording.reference, report.text)
        row.texts["stream"] = report.text
        row.seconds["stream"] = report.wall_seconds
        row.latencies, row.first_partial_s = report.final_latencies, report.first_partial_s

    folder = Path(tempfile.mkdtemp(prefix="voxtide-eval-"))
    async with running_server(folder, config, max_sessions=max(16, parallel)) as server:
        await asyncio.gather(*(one(server, row) for row in rows))


def offline_all(rows: list[Row]) -> None:
    model = bundle()  # the streaming server's model too
    transcribe(model, torch.from_numpy(rows[0].recording.samples[: SAMPLE_RATE * 3]))  # warm-up
    for row in rows:
        start = time.perf_counter()
        text = transcribe(model, torch.from_numpy(row.recording.samples)).text
        row.seconds["offline"] = time.perf_counter() - start
        row.errors["offline"] = word_errors(row.recording.reference, text)
        row.texts["offline"] = text


def faster_whisper_all(rows: list[Row], threads: int) -> bool:
    try:
        from faster_whisper import WhisperModel
    except ImportError:
        print("faster-whisper is not installed: no peer reference", file=sys.stderr)
        return False
    model = WhisperModel(str(default_model_path()), device="cpu", compute_type="int8",
                         cpu_threads=threads)

    def run(samples: np.ndarray) -> str:
        segments, _ = model.transcribe(samples, language="en", beam_size=1, vad_filter=False)
        return " ".join(s.text for s in segments)  # a generator: decoding happens here

    run(rows[0].recording.samples[: SAMPLE_RATE * 3])  # warm-up
    for row in rows:
        start = time.perf_counter()
        text = run(row.recording.samples)
        row.seconds["fw-int8"] = time.perf_counter() - start
        row.errors["fw-int8"] = word_errors(row.recording.reference, text)
        row.texts["fw-int8"] = text
    return True


def pooled(rows: list[Row], system: str) -> float:
    errors = sum(r.errors[system][0] for r in rows if system in r.errors)
    words = sum(r.errors[system][1] for r in rows if system in r.errors)
    return errors / max(words, 1)


def table(rows: list[Row], systems: list[str]) -> str:
    head = f"{'recording':<16} {'audio s':>7}" + "".join(f" {'WER ' + s:>13}" for s in systems)
    head += f" {'final p50':>9} {'p95':>6} {'1st partial':>11}" + "".join(
        f" {'RTF ' + s:>12}" for s in systems if s != "stream")
    lines = [head]

    def fmt_rtf(seconds: float | None, audio: float) -> str:
        return f" {seconds / audio:12.3f}" if seconds is not None else f" {'-':>12}"

    for row in rows:
        rec = row.recording
        line = f"{rec.name:<16} {rec.seconds:7.1f}"
        for s in systems:
            e, n = row.errors.get(s, (0, 0))
            line += f" {e / max(n, 1):13.1%}" if s in row.errors else f" {'-':>13}"
        first = f"{row.first_partial_s:.2f}" if row.first_partial_s is not None else "-"
        line += (f" {percentile(row.latencies, 0.5):9.2f} {percentile(row.latencies, 0.95):6.2f}"
                 f" {first:>11}")
        line += "".join(fmt_rtf(row.seconds.get(s), rec.seconds) for s in systems if s != "stream")
        lines.append(line)
    total = sum(r.recording.seconds for r in rows)
    latencies = [x for r in rows for x in r.latencies]
    line = f"{'ALL (pooled)':<16} {total:7.1f}" + "".join(f" {pooled(rows, s):13.1%}" for s in systems)
    line += f" {percentile(latencies, 0.5):9.2f} {percentile(latencies, 0.95):6.2f} {'':>11}"
    for s in systems:
        if s != "stream":
            spent = [r.seconds[s] for r in rows if s in r.seconds]
            line += fmt_rtf(sum(spent), total) if spent else f" {'-':>12}"
    lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--parallel", type=int, default=1, help="streaming sessions at once")
    parser.add_argument("--fast", action="store_true", help="stream as fast as possible")
    parser.add_argument("--pad-seconds", type=int, default=None)
    parser.add_argument("--preview-pad-seconds", type=int, default=EngineConfig.preview_pad_seconds,
                        help="0: partials decode the whole window")
    parser.add_argument("--endpoint-ms", type=int, default=EngineConfig.endpoint_ms, help="0: off")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=["stream", "offline", "fw-int8"])
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [Row(r) for r in recordings()]
    systems = []
    if "stream" not in args.skip:
        config = EngineConfig(pad_seconds=args.pad_seconds, endpoint_ms=args.endpoint_ms or None,
                              preview_pad_seconds=args.preview_pad_seconds or None,
                              worker_process=True)  # as `voxtide serve`
        asyncio.run(stream_all(rows, args.parallel, args.fast, config))
        systems.append("stream")
    if "offline" not in args.skip:
        offline_all(rows)
        systems.append("offline")
    if "fw-int8" not in args.skip and faster_whisper_all(rows, args.threads):
        systems.append("fw-int8")
    mode = "fast" if args.fast else "real time"
    print(f"streaming: {mode}, {args.parallel} at once, 100 ms chunks, endpoint {args.endpoint_ms} ms, "
          f"pad {args.pad_seconds}, preview pad {args.preview_pad_seconds}; {args.threads} threads")
    print(table(rows, systems))
    if args.json:
        Path(args.json).write_text(json.dumps([{
            "recording": r.recording.name, "audio_s": round(r.recording.seconds, 2),
            "errors": r.errors, "seconds": r.seconds, "latencies": r.latencies,
            "first_partial_s": r.first_partial_s, "reference": r.recording.reference,
            "texts": r.texts} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
