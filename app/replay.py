"""Replay client: stream audio files over /v1/listen as N concurrent sessions and measure.

Real-time pace (default) sends each chunk when its audio would have been spoken; `fast`
sends as fast as the socket takes it. `loop_seconds` repeats a file to build long sessions.
Per session: time to first partial, final latency (a final result's arrival minus the time
the audio up to its end was sent), the largest lag (audio sent - audio finalized), RTF.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from websockets.asyncio.client import connect

from audio.container import load_audio
from audio.io import SAMPLE_RATE, float_to_pcm16

END_SLACK_MS = 500  # a final's last word may end this much after its utterance's known end
# what Voxtide's own clients ask of /v1/listen beyond Deepgram's defaults
CLIENT_QUERY = "interim_results=true&punctuate=true&voxtide_events=true"


def with_client_query(url: str) -> str:
    return url + ("&" if "?" in url else "?") + CLIENT_QUERY


def transcript(result: dict) -> str:
    """A Deepgram Results message's text."""
    return result["channel"]["alternatives"][0]["transcript"]


def result_words(result: dict) -> list[tuple[int, int, str]]:
    """A Results message's words as (start_ms, end_ms, word as written)."""
    return [(round(w["start"] * 1000), round(w["end"] * 1000), w.get("punctuated_word", w["word"]))
            for w in result["channel"]["alternatives"][0]["words"]]


def result_end_ms(result: dict) -> int:
    return round((result["start"] + result["duration"]) * 1000)


def utterance_end_ms(ends_ms: list[int], end_ms: int) -> int:
    """The known end (of the sorted `ends_ms`) of the utterance a final ending at `end_ms`
    ends in: the first at most END_SLACK_MS before it (the last one past them all)."""
    k = bisect.bisect_left(ends_ms, end_ms - END_SLACK_MS)
    return ends_ms[min(k, len(ends_ms) - 1)]


@dataclass
class SessionReport:
    name: str
    audio_seconds: float
    wall_seconds: float = 0.0
    first_partial_s: float | None = None
    final_latencies: list[float] = field(default_factory=list)
    max_lag_s: float = 0.0
    text: str = ""
    finals: list[str] = field(default_factory=list)
    words: list[tuple[int, int, str]] = field(default_factory=list)  # final (start_ms, end_ms, word)
    errors: list[str] = field(default_factory=list)

    @property
    def rtf(self) -> float:
        return self.wall_seconds / self.audio_seconds if self.audio_seconds else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def looped(samples: np.ndarray, seconds: float | None) -> np.ndarray:
    if not seconds:
        return samples
    n = int(seconds * SAMPLE_RATE)
    return np.resize(samples, n)  # repeats the file


async def replay_session(url: str, name: str, samples: np.ndarray, chunk_ms: int = 100,
                         fast: bool = False, headers: dict[str, str] | None = None,
                         speech_ends_ms: list[int] | None = None) -> SessionReport:
    """Stream `samples` and read the results. A final's latency is counted from the sending
    of the audio up to its last word's end; with `speech_ends_ms` (the known ends of the
    utterances, sorted), up to the end of the utterance it ends in (the first end at most
    END_SLACK_MS before its last word's): then the figure does not depend on how the
    server times that word."""
    pcm = float_to_pcm16(samples)
    step = SAMPLE_RATE * chunk_ms // 1000 * 2
    report = SessionReport(name, samples.size / SAMPLE_RATE)
    sent_ms: list[int] = []  # audio ms sent ...
    sent_at: list[float] = []  # ... and when
    # no pong deadline: a server pacing this session (backpressure) reads our pong late
    async with connect(with_client_query(url), additional_headers=headers or {}, max_size=None,
                       ping_timeout=None) as ws:
        start = time.monotonic()

        async def read() -> None:
            async for raw in ws:
                m = json.loads(raw)
                now = time.monotonic()
                if m["type"] == "Error":
                    report.errors.append(m["code"])
                if m["type"] != "Results":
                    continue
                words = result_words(m)
                if report.first_partial_s is None and words:
                    report.first_partial_s = now - start
                if m["is_final"] and words:
                    report.finals.append(transcript(m))
                    report.words.extend(words)
                    end = result_end_ms(m)
                    if speech_ends_ms:
                        end = utterance_end_ms(speech_ends_ms, end)
                    i = bisect.bisect_left(sent_ms, end)
                    if i < len(sent_at):
                        report.final_latencies.append(now - sent_at[i])
                    sent_now = sent_ms[-1] if sent_ms else 0
                    report.max_lag_s = max(report.max_lag_s, (sent_now - result_end_ms(m)) / 1000)

        reader = asyncio.create_task(read())
        # a refused session's close ends the reader too, when the send below raises it first
        reader.add_done_callback(lambda task: task.cancelled() or task.exception())
        for i in range(0, len(pcm), step):
            if not fast:
                await asyncio.sleep(max(0.0, start + i / 2 / SAMPLE_RATE - time.monotonic()))
            await ws.send(pcm[i : i + step])
            sent_ms.append((i + step) * 1000 // (2 * SAMPLE_RATE))
            sent_at.append(time.monotonic())
        await ws.send(json.dumps({"type": "CloseStream"}))
        await reader
        report.wall_seconds = time.monotonic() - start
    report.text = " ".join(report.finals)
    return report


async def replay(url: str, files: list[Path], num_sessions: int, chunk_ms: int = 100,
                 fast: bool = False, loop_seconds: float | None = None,
                 api_key: str | None = None, stagger_s: float = 0.0) -> list[SessionReport]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    audio = [looped(load_audio(f).numpy(), loop_seconds) for f in files]

    async def one(i: int) -> SessionReport:
        await asyncio.sleep(i * stagger_s)
        return await replay_session(url, f"s{i:03d}-{Path(files[i % len(files)]).stem}",
                                    audio[i % len(audio)], chunk_ms, fast, headers)

    return list(await asyncio.gather(*(one(i) for i in range(num_sessions))))


def summary(reports: list[SessionReport]) -> str:
    latencies = [x for r in reports for x in r.final_latencies]
    firsts = [r.first_partial_s for r in reports if r.first_partial_s is not None]
    lines = [f"{'session':<40} {'audio s':>8} {'RTF':>6} {'1st partial':>11} {'final p50':>9} "
             f"{'p95':>6} {'max lag':>7}"]
    for r in reports:
        first = f"{r.first_partial_s:.2f}" if r.first_partial_s is not None else "-"
        lines.append(f"{r.name:<40} {r.audio_seconds:8.1f} {r.rtf:6.2f} {first:>11} "
                     f"{percentile(r.final_latencies, 0.5):9.2f} "
                     f"{percentile(r.final_latencies, 0.95):6.2f} {r.max_lag_s:7.2f}")
    lines.append(f"ALL {len(reports)} sessions: final latency p50 {percentile(latencies, 0.5):.2f} s, "
                 f"p95 {percentile(latencies, 0.95):.2f} s; time to first partial mean "
                 f"{statistics.fmean(firsts) if firsts else float('nan'):.2f} s; max lag "
                 f"{max((r.max_lag_s for r in reports), default=0):.2f} s; errors "
                 f"{sum(len(r.errors) for r in reports)}")
    return "\n".join(lines)
