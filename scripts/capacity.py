"""Capacity: how many concurrent real-time /v1/listen sessions this machine serves.

For each N, N sessions stream the same passage (the five Sense and Sensibility recordings
with 0.8 s pauses, 29 s) at real-time pace in 100 ms chunks, starting 0.3 s apart (`--stagger`), to a
server in this process. All N reach each pause within 0.3 N s, so N finals fall due at
once: the worst case. With `--rotate`, session i speaks the five recordings starting from
the (i mod 5)-th, so pauses fall at different times, as for independent speakers.
Printed per N: final latency p50/p95 over all sessions (a final's arrival minus when the
audio up to the end of its recording was sent: a fixed point, whatever times the server
gives the words), the largest lag, the pooled WER, the engine's largest load (the share of
the last 20 s spent on steps with a live final, engine/load.py) and the share of the run it
shed partials (they come 3 times less often). An N given more than once
(`--sessions 8 8 8`) is run that often, and its p95 range and median are printed too: the
host's speed drifts from run to run. `--repeat N` has each session speak the passage N times:
its prompts (the committed words before a window) then grow to their full length, as in a long
session, which a 29 s run understates (docs/performance.md).
The goal on 2 CPU cores: N >= 8 with p95 < 1.5 s. With `--upload-seconds S`, a file of S s
(the passage looped) is sent to POST /v1/audio/transcriptions as the sessions start, to see
what a long upload costs live sessions (it is a background request: their finals never wait
for it); its audio seconds per wall second are printed. `--vad-events` has the sessions ask
for Deepgram's SpeechStarted events (`vad_events=true`: the engine's turn events).

    scripts/dev.sh run python scripts/capacity.py [--sessions 1 2 4 8] [--pad-seconds 10] \
        [--preview-pad-seconds 0] [--endpoint-ms 400] [--rotate] [--max-batch 4] [--max-finals 1] \
        [--beam-size 1] [--worker thread] [--device cuda] [--upload-seconds 600] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf
import torch
from websockets.exceptions import ConnectionClosed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.replay import percentile, replay_session  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model import ModelBundle, load_bundle  # noqa: E402
from engine.model.loader import precision  # noqa: E402
from scripts.wer import word_errors  # noqa: E402
from tests.helpers import ARCTIC_IDS, concatenated, librivox_path  # noqa: E402
from tests.server_client import running_server, url  # noqa: E402


def passages(rotate: int, repeat: int = 1) -> tuple[np.ndarray, str, list[int]]:
    """The five recordings with 0.8 s pauses, starting from the `rotate`-th, `repeat` times
    -> (audio, its text, the end of each recording in ms: the reference of final latencies)."""
    paths = [librivox_path(c) for c in ARCTIC_IDS]
    paths = (paths[rotate:] + paths[:rotate]) * repeat
    samples, reference = concatenated(paths, gap_seconds=0.8)
    ends, t = [], 0
    for path in paths:
        info = sf.info(str(path))
        t += info.frames * 1000 // info.samplerate
        ends.append(t)
        t += 800
    return samples.numpy(), reference, ends


async def upload(port: int, seconds: float) -> float:
    """Transcribe `seconds` of the passage, looped, over HTTP -> audio seconds per wall second."""
    samples = passages(0)[0]
    looped = np.tile(samples, int(np.ceil(seconds * 16000 / samples.size)))[: int(seconds * 16000)]
    wav = io.BytesIO()
    sf.write(wav, looped, 16000, format="WAV", subtype="PCM_16")
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=None) as http:
        response = await http.post(f"http://127.0.0.1:{port}/v1/audio/transcriptions",
                                   files={"file": ("upload.wav", wav.getvalue())})
    response.raise_for_status()
    return seconds / (time.perf_counter() - started)


async def run(n: int, config: EngineConfig, rotate: bool, model: ModelBundle, upload_s: float,
              stagger_s: float, repeat: int = 1, vad_events: bool = False) -> dict:
    query = "?vad_events=true" if vad_events else ""
    folder = Path(tempfile.mkdtemp(prefix="voxtide-capacity-"))
    audio = [passages(i % len(ARCTIC_IDS) if rotate else 0, repeat) for i in range(n)]
    async with running_server(folder, config, model=model, max_sessions=max(16, n)) as server:

        async def one(i: int):
            await asyncio.sleep(stagger_s * i)
            try:
                return await replay_session(url(server, "/v1/listen" + query), f"s{i}", audio[i][0],
                                            chunk_ms=100, speech_ends_ms=audio[i][2])
            except ConnectionClosed as e:  # refused (1013: the server is at capacity or overloaded)
                if e.rcvd is None or e.rcvd.code != 1013:
                    raise
                return None

        async def watch_load():  # the engine's load (engine/load.py), twice a second
            while True:
                loads.append((server.loop.load.share(time.perf_counter()), server.loop.load.shedding))
                await asyncio.sleep(0.5)

        loads: list[tuple[float, bool]] = []  # (load, shedding)
        watcher = asyncio.create_task(watch_load())
        file = asyncio.create_task(upload(server.port, upload_s)) if upload_s else None
        served = await asyncio.gather(*(one(i) for i in range(n)))
        speed = await file if file is not None else None
        watcher.cancel()
    reports = [r for r in served if r is not None]
    audio = [a for a, r in zip(audio, served, strict=True) if r is not None]
    latencies = [x for r in reports for x in r.final_latencies]
    errors = words = 0
    for r, (_, reference, _) in zip(reports, audio, strict=True):
        e, w = word_errors(reference, r.text)
        errors, words = errors + e, words + w
    return {"sessions": n, "refused": n - len(reports), "p50": round(percentile(latencies, 0.5), 2),
            "p95": round(percentile(latencies, 0.95), 2),
            "max_lag": round(max(r.max_lag_s for r in reports), 2),
            "wer": round(errors / words, 4), "server_errors": sum(len(r.errors) for r in reports),
            "upload_speed": round(speed, 1) if speed is not None else None,
            "max_load": round(max(share for share, _ in loads), 2),
            "shedding": round(sum(shedding for _, shedding in loads) / len(loads), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--pad-seconds", type=int, default=None)
    parser.add_argument("--preview-pad-seconds", type=int, default=EngineConfig.preview_pad_seconds,
                        help="0: partials decode the whole window")
    parser.add_argument("--endpoint-ms", type=int, default=EngineConfig.endpoint_ms)
    parser.add_argument("--max-batch", type=int, default=EngineConfig.max_num_seqs)
    parser.add_argument("--max-partials", type=int, default=EngineConfig.max_partials)
    parser.add_argument("--max-finals", type=int, default=None, help="default: the engine's")
    parser.add_argument("--decode-interval-ms", type=int, default=EngineConfig.decode_interval_ms,
                        help="new audio between two decodes of a session")
    parser.add_argument("--agree-after-ms", type=int, default=EngineConfig.agree_after_ms)
    parser.add_argument("--beam-size", type=int, default=EngineConfig.beam_size,
                        help="beams of a decode committed whole (a final)")
    parser.add_argument("--rotate", action="store_true",
                        help="session i starts at the (i mod 5)-th recording: pauses spread out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=("process", "thread"), default="process",
                        help="where the model runs (`voxtide serve`: a process)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the model's device)")
    parser.add_argument("--int8", action=argparse.BooleanOptionalAction, default=None,
                        help="the encoder on int8 weights (default: on a CPU without native bf16)")
    parser.add_argument("--no-bf16", action="store_true",
                        help="no bfloat16 parts: float32, or int8 with --int8 (a CPU without native bf16)")
    parser.add_argument("--upload-seconds", type=float, default=0.0,
                        help="also transcribe a file this long over HTTP as the sessions start")
    parser.add_argument("--stagger", type=float, default=0.3,
                        help="seconds between two sessions' starts (those the server refuses are counted)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="each session speaks the passage this many times (a longer run)")
    parser.add_argument("--vad-events", action="store_true",
                        help="sessions ask for Deepgram's SpeechStarted events (vad_events=true)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_bundle(device=args.device, bf16=False if args.no_bf16 else None, int8=args.int8)
    print(f"model: {precision(model.model)}")
    samples, _, _ = passages(0, args.repeat)
    config = EngineConfig(max_num_seqs=args.max_batch, max_partials=args.max_partials,
                          decode_interval_ms=args.decode_interval_ms, pad_seconds=args.pad_seconds,
                          endpoint_ms=args.endpoint_ms or None,
                          preview_pad_seconds=args.preview_pad_seconds or None,
                          agree_after_ms=args.agree_after_ms, max_finals=args.max_finals,
                          beam_size=args.beam_size, worker_process=args.worker == "process")
    print(f"pad_seconds {args.pad_seconds}, preview pad {args.preview_pad_seconds}, endpoint_ms "
          f"{args.endpoint_ms}, max batch {args.max_batch}, max finals {args.max_finals or 'default'}, "
          f"{args.beam_size} beams, decode interval "
          f"{args.decode_interval_ms} ms, agree after {args.agree_after_ms} ms, {args.threads} threads, "
          f"model in a {args.worker} on {model.device} ({model.model.dtype}), "
          f"{samples.shape[0] / 16000:.1f} s per session"
          + (", rotated" if args.rotate else ", all in step")
          + (f", a {args.upload_seconds:g} s upload beside them" if args.upload_seconds else "")
          + (", vad_events" if args.vad_events else ""))
    print(f"{'sessions':>8} {'p50 s':>6} {'p95 s':>6} {'max lag':>7} {'WER':>6} {'load':>5} {'shed':>5}")
    rows = []
    for n in args.sessions:
        row = asyncio.run(run(n, config, args.rotate, model, args.upload_seconds, args.stagger,
                              args.repeat, args.vad_events))
        rows.append(row)
        print(f"{n:8d} {row['p50']:6.2f} {row['p95']:6.2f} {row['max_lag']:7.2f} {row['wer']:6.1%}"
              f" {row['max_load']:5.2f} {row['shedding']:5.0%}"
              + (f"  refused {row['refused']}" if row["refused"] else "")
              + (f"  server errors {row['server_errors']}" if row["server_errors"] else "")
              + (f"  upload {row['upload_speed']}x real time" if row["upload_speed"] else ""), flush=True)
    for n in sorted({n for n in args.sessions if args.sessions.count(n) > 1}):
        p95 = sorted(row["p95"] for row in rows if row["sessions"] == n)  # the host is noisy
        print(f"{n} sessions, {len(p95)} runs: p95 {p95[0]:.2f}-{p95[-1]:.2f} s, "
              f"median {float(np.median(p95)):.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
