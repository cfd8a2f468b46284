"""Evaluate: fidelity, WER and latency of Voxtide streaming vs offline, faster-whisper int8 as peer.

The set is the corpus of scripts/corpus.py (built at run time into data/corpus, or
data/corpus-quick with `--quick`): TTS voices (espeak-ng, flite, festival) and real recordings
under conditions (levels, noise, telephone band, 44.1 kHz stereo, long gaps, short pauses and
run-on speech, pauses inside sentences, a long session, abrupt ends, and the recordings of
the earlier evaluation set). Each clip goes through
- `stream`: a /v1/listen session on a server in this process, at the file's own sample rate
  (stereo downmixed by the client), real-time pace in 100 ms chunks (`--fast`: as fast as the
  socket takes it); final latency p50/p95 (a final's arrival minus when the audio up to the
  known end of the sentence it ends in was sent), time to first partial;
- `replay` (with `--replay`): streaming replayed in-process, the engine fed the 16 kHz audio in
  100 ms chunks and every step it has ready run before the next chunk, as if the model took
  no time: deterministic, so two settings compare without real time's run-to-run spread;
- `file`: the file over HTTP, as Deepgram's pre-recorded `POST /v1/listen` takes it (a
  background request of the same server's engine; 4 files at once), with its words' times;
- `offline`: Voxtide's `transcribe` (Whisper's long-form algorithm, 5 beams) on the file at
  16 kHz, with its word times (aligned from cross-attention, as streaming's);
- `fw-int8`: faster-whisper with CTranslate2 int8 on the same weights, at its defaults (5
  beams), with its word timestamps (skipped when faster-whisper is not installed).
Per condition and overall, for each system: WER (normalized text, pooled), streaming's WER
minus offline's with a 95% interval (a paired bootstrap over sentences: the spread that one
decode of a sentence against another gives the difference), the longest dropped
passage (the longest run of reference words that the alignment deletes, in seconds of speech,
timed from the known sentence onsets and ends; in brackets the longest run not found, misheard
words included), words placed inside gaps of 5 s or more (0.2 s cut off each gap edge),
sentence-onset error p50/p95 (|hypothesis start of a sentence's matched first word - its known
onset|); and for streaming the latencies: of each final (from the end of the sentence its last
word is in), and of each sentence (when the last of its words came in a final, from its end: a
final held for the next utterance shows here).

    scripts/dev.sh run python scripts/evaluate.py [--quick] [--parallel 8] [--fast] [--seeds 0 ...] \\
        [--conditions level-30 ...] [--skip stream file offline fw-int8] [--replay] \\
        [--prompt-tokens 40] [--json out.json] [--doc]
    scripts/dev.sh run python scripts/evaluate.py --rescore out.json [more.json[:offline,...] ...] [--doc]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.config import ServerConfig  # noqa: E402
from app.replay import percentile, result_end_ms, result_words, utterance_end_ms, with_client_query  # noqa: E402
from audio.container import load_audio  # noqa: E402
from audio.io import SAMPLE_RATE, float_to_pcm16  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine, EngineOutput  # noqa: E402
from engine.model import ModelBundle, load_bundle  # noqa: E402
from engine.model.loader import default_model_path  # noqa: E402
from engine.model.transcribe import transcribe  # noqa: E402
from scripts.corpus import (  # noqa: E402
    CONDITIONS,
    DEFAULT_DIR,
    START_WORDS,
    Score,
    load_index,
    paired_difference,
    score,
)
from scripts.corpus import summary as corpus_summary  # noqa: E402
from tests.server_client import running_server  # noqa: E402

SYSTEMS = ["stream", "replay", "file", "offline", "fw-int8"]
Words = list[tuple[float, float, str]]  # (start s, end s, text)


@dataclass
class Clip:
    name: str
    condition: str
    path: Path
    manifest: dict

    @property
    def seconds(self) -> float:
        return self.manifest["duration"]

    @property
    def speech_seconds(self) -> float:
        return sum(s["end"] - s["onset"] for s in self.manifest["sentences"])

    def mono16k(self) -> np.ndarray:
        return load_audio(self.path).numpy()


@dataclass
class Result:
    clip: Clip
    scores: dict[str, Score] = field(default_factory=dict)  # system -> score
    words: dict[str, Words] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # system -> compute (wall) seconds
    latencies: list[float] = field(default_factory=list)
    sentence_latencies: list[float] = field(default_factory=list)  # `sentence_latencies`
    first_partial_s: float | None = None
    errors: list[str] = field(default_factory=list)  # server Error codes

    def add(self, system: str, words: Words, seconds: float) -> None:
        self.words[system], self.seconds[system] = words, seconds
        self.scores[system] = score(self.clip.manifest, words)


def load_clips(folder: Path, quick: bool, seeds: list[int], rebuild: bool,
               conditions: list[str]) -> list[Clip]:
    index = load_index(folder, seeds, quick, rebuild, conditions or None)
    out = []
    for entry in index["clips"]:
        if conditions and entry["condition"] not in conditions:
            continue
        manifest = json.loads((folder / entry["manifest"]).read_text())
        out.append(Clip(entry["name"], entry["condition"], folder / manifest["file"], manifest))
    return out


# ---------------------------------------------------------------------------------------------
# The systems


async def admitted(url: str, retry_s: float = 1.0, give_up_s: float = 600.0) -> ClientConnection:
    """A session the server took (its Connected event read), trying again while it answers
    1013 (overloaded: its sessions lag; a client is to try again later)."""
    deadline = time.monotonic() + give_up_s
    while True:
        ws = await connect(url, max_size=None, ping_timeout=None)
        try:
            first = json.loads(await ws.recv())
        except ConnectionClosed as e:
            if e.rcvd is None or e.rcvd.code != 1013 or time.monotonic() > deadline:
                raise
            await asyncio.sleep(retry_s)
            continue
        assert first["type"] == "Connected", first
        return ws


async def stream_clip(base_url: str, result: Result, fast: bool, chunk_ms: int = 100) -> None:
    """One /v1/listen session at the file's rate; finals' words, latencies, first partial."""
    data, rate = sf.read(str(result.clip.path), dtype="float32", always_2d=True)
    pcm = float_to_pcm16(data.mean(axis=1))  # the client downmixes: /v1/listen takes mono
    step = rate * chunk_ms // 1000 * 2  # bytes
    sent_ms: list[int] = []  # audio ms sent ...
    sent_at: list[float] = []  # ... and when
    # latency from the known end of the sentence a final ends in, not from its last word's end
    ends_ms = sorted(round(s["end"] * 1000) for s in result.clip.manifest["sentences"])
    words: Words = []
    arrived: list[float] = []  # when each of `words` came
    query = f"?sample_rate={rate}&encoding=linear16"
    async with await admitted(with_client_query(base_url + query)) as ws:
        start = time.monotonic()

        async def read() -> None:
            async for raw in ws:
                m, now = json.loads(raw), time.monotonic()
                if m["type"] == "Error":
                    result.errors.append(m["code"])
                if m["type"] != "Results":
                    continue
                got = result_words(m)
                if result.first_partial_s is None and got:
                    result.first_partial_s = now - start
                if m["is_final"] and got:
                    words.extend((a / 1000, b / 1000, w) for a, b, w in got)
                    arrived.extend([now] * len(got))
                    i = bisect.bisect_left(sent_ms, utterance_end_ms(ends_ms, result_end_ms(m)))
                    if i < len(sent_at):
                        result.latencies.append(now - sent_at[i])

        reader = asyncio.create_task(read())
        for i in range(0, len(pcm), step):
            if not fast:
                await asyncio.sleep(max(0.0, start + i / 2 / rate - time.monotonic()))
            await ws.send(pcm[i : i + step])
            sent_ms.append(min(i + step, len(pcm)) * 1000 // (2 * rate))
            sent_at.append(time.monotonic())
        await ws.send(json.dumps({"type": "CloseStream"}))
        await reader
    result.add("stream", words, time.monotonic() - start)
    result.sentence_latencies = sentence_latencies(result.clip.manifest["sentences"], words, arrived,
                                                   sent_ms, sent_at)


def sentence_latencies(sentences: list[dict], words: Words, arrived: list[float], sent_ms: list[int],
                       sent_at: list[float]) -> list[float]:
    """Per sentence, when the last of its final words came (a final word's middle within it),
    from when the audio up to its end was sent. A final held for the next utterance counts
    here from the end of each sentence it holds; `latencies` count a final from the end of
    the sentence its last word is in."""
    out = []
    for s in sentences:
        came = [t for (a, b, _), t in zip(words, arrived, strict=True)
                if s["onset"] - 0.1 <= (a + b) / 2 <= s["end"] + 0.3]
        i = bisect.bisect_left(sent_ms, round(s["end"] * 1000))
        if came and i < len(sent_at):
            out.append(max(came) - sent_at[i])
    return out


async def stream_all(results: list[Result], parallel: int, fast: bool, config: EngineConfig,
                     model: ModelBundle) -> None:
    gate = asyncio.Semaphore(parallel)

    async def one(server_url: str, result: Result) -> None:
        async with gate:
            await stream_clip(server_url, result, fast)
        if result.errors:
            raise RuntimeError(f"{result.clip.name}: server errors {result.errors}")

    folder = Path(tempfile.mkdtemp(prefix="voxtide-eval-"))
    longest_first = sorted(results, key=lambda r: -r.clip.seconds)  # the long session sets the pace
    async with running_server(folder, config, model=model, max_sessions=max(16, parallel)) as server:
        base = f"ws://127.0.0.1:{server.port}/v1/listen"  # stream_clip adds the query
        await asyncio.gather(*(one(base, r) for r in longest_first))


def replay_steps(engine: Engine, samples: np.ndarray, chunk: int) -> Iterator[list[EngineOutput]]:
    """Stream `samples` into `engine` in `chunk`s, every ready step run before the next chunk,
    then finish the session -> each step's outputs."""
    engine.add_request("r")
    for i in range(0, len(samples), chunk):
        engine.add_audio("r", samples[i : i + chunk])
        while engine.has_work():
            yield engine.step()
    engine.finish("r")
    while engine.has_request("r"):
        yield engine.step()


def replay_clip(engine: Engine, samples: np.ndarray, chunk: int) -> Words:
    """Stream `samples` into `engine` (`replay_steps`) -> the words it committed."""
    return [(w.start_ms / 1000, w.end_ms / 1000, w.text)
            for outputs in replay_steps(engine, samples, chunk) for o in outputs for w in o.committed]


def replay_all(results: list[Result], config: EngineConfig, model: ModelBundle,
               chunk_ms: int = 100) -> None:
    """Each clip streamed into an `Engine` in this process: the decodes a session gets when
    compute keeps up, the same in every run."""
    for result in results:
        engine = Engine(model, replace(config, worker_process=False))
        samples = result.clip.mono16k()
        start = time.perf_counter()
        words = replay_clip(engine, samples, SAMPLE_RATE * chunk_ms // 1000)
        result.add("replay", words, time.perf_counter() - start)


def post_clip(url: str, result: Result) -> Words:
    """The clip's file as a client sends it to Deepgram's pre-recorded `POST /v1/listen`."""
    request = urllib.request.Request(url, data=result.clip.path.read_bytes(),
                                     headers={"Content-Type": "audio/wav"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        body = json.load(response)
    words = body["results"]["channels"][0]["alternatives"][0]["words"]
    return [(w["start"], w["end"], w["punctuated_word"]) for w in words]


async def files_all(results: list[Result], config: EngineConfig, model: ModelBundle) -> None:
    """Each clip as a file over HTTP (a background request of the engine), as many at once
    as the server takes (`ServerConfig.max_uploads`)."""
    gate = asyncio.Semaphore(ServerConfig.max_uploads)

    async def one(url: str, result: Result) -> None:
        async with gate:
            start = time.monotonic()
            words = await asyncio.to_thread(post_clip, url, result)
            result.add("file", words, time.monotonic() - start)

    folder = Path(tempfile.mkdtemp(prefix="voxtide-eval-"))
    async with running_server(folder, config, model=model) as server:
        url = f"http://127.0.0.1:{server.port}/v1/listen?punctuate=true"
        await asyncio.gather(*(one(url, r) for r in sorted(results, key=lambda r: -r.clip.seconds)))


def offline_all(results: list[Result], model: ModelBundle) -> None:
    transcribe(model, torch.from_numpy(results[0].clip.mono16k()[: SAMPLE_RATE * 3]))  # warm-up
    for result in results:
        samples = torch.from_numpy(result.clip.mono16k())
        start = time.perf_counter()
        segments = transcribe(model, samples).segments
        words = [(w.start_ms / 1000, w.end_ms / 1000, w.text) for s in segments for w in s.words]
        result.add("offline", words, time.perf_counter() - start)


def faster_whisper_all(results: list[Result], threads: int) -> bool:
    try:
        from faster_whisper import WhisperModel
    except ImportError:
        print("faster-whisper is not installed: no peer reference", file=sys.stderr)
        return False
    model = WhisperModel(str(default_model_path()), device="cpu", compute_type="int8",
                         cpu_threads=threads)

    def run(samples: np.ndarray) -> Words:
        segments, _ = model.transcribe(samples, language="en", beam_size=5, vad_filter=False,
                                       word_timestamps=True)
        return [(w.start, w.end, w.word) for s in segments for w in s.words or []]  # decodes here

    run(results[0].clip.mono16k()[: SAMPLE_RATE * 3])  # warm-up
    for result in results:
        samples = result.clip.mono16k()
        start = time.perf_counter()
        words = run(samples)
        result.add("fw-int8", words, time.perf_counter() - start)
    return True


# ---------------------------------------------------------------------------------------------
# Report


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(["\n".join(lines)] + ["| " + " | ".join(r) + " |" for r in rows])


def groups(results: list[Result]) -> list[tuple[str, list[Result]]]:
    by: dict[str, list[Result]] = {}
    for r in results:
        by.setdefault(r.clip.condition, []).append(r)
    return [*by.items(), ("all", results)]


def has_long_gaps(results: list[Result]) -> bool:
    return any(g["end"] - g["start"] >= 5.0 for r in results for g in r.clip.manifest["gaps"])


def per_system(results: list[Result], systems: list[str], cell) -> str:
    """One cell: `cell(scores of a system)` for each system, joined by ' / '."""
    return " / ".join(cell([r.scores[s] for r in results if s in r.scores]) for s in systems)


def start_wer(scores: list[Score]) -> str:
    """The WER of the sentences' first words (`Score.start_errors`)."""
    return f"{sum(x.start_errors for x in scores) / max(1, sum(x.start_words for x in scores)):.1%}"


def streaming(systems: list[str]) -> str | None:
    """The streaming system that the table sets against offline: real time, or the replay."""
    return next((s for s in ("stream", "replay") if s in systems), None)


def words_table(results: list[Result], systems: list[str]) -> str:
    joined = " / ".join(systems)
    live = streaming(systems)
    paired = live is not None and "offline" in systems
    header = ["condition", "clips", "audio min", "speech min", *(f"WER {s}" for s in systems),
              *([f"{live} - offline, points (95% interval)"] if paired else []),
              f"WER of sentences' first {START_WORDS} words ({joined})",
              f"longest drop s, in brackets of words not found ({joined})",
              f"words in gaps, inserted ones in brackets ({joined})"]
    rows = []
    for name, group in groups(results):
        wers = [sum(r.scores[s].errors for r in group) / max(1, sum(r.scores[s].words for r in group))
                for s in systems]
        wers_cells = [f"{w:.1%}" for w in wers]
        if paired:
            both = [r for r in group if live in r.scores and "offline" in r.scores]
            diff, low, high = paired_difference([r.scores[live] for r in both],
                                                [r.scores["offline"] for r in both])
            wers_cells.append(f"{100 * diff:+.1f} ({100 * low:+.1f} to {100 * high:+.1f})")
        starts = per_system(group, systems, start_wer)
        drop = per_system(group, systems, lambda sc: f"{max(x.drop_s for x in sc):.1f} "
                          f"({max(x.unmatched_s for x in sc):.1f})")
        gaps = per_system(group, systems, lambda sc: f"{sum(x.gap_words for x in sc)} "
                          f"({sum(x.gap_inserted for x in sc)})")
        rows.append([name, str(len(group)), f"{sum(r.clip.seconds for r in group) / 60:.1f}",
                     f"{sum(r.clip.speech_seconds for r in group) / 60:.1f}",
                     *wers_cells, starts, drop, gaps if has_long_gaps(group) else "-"])
    return markdown(header, rows)


def timing_table(results: list[Result], systems: list[str]) -> str:
    def onsets(scores: list[Score]) -> str:
        errors = [e for x in scores for e in x.onset_errors]
        return f"{percentile(errors, 0.5):.2f} / {percentile(errors, 0.95):.2f}"

    batch = [s for s in systems if s != "stream"]
    header = ["condition", *(f"onset error p50 / p95 s {s}" for s in systems)]
    if "stream" in systems:
        header += ["final p50 / p95 s", "sentence final p50 / p95 s", "1st partial s (median)"]
    header += [f"RTF {' / '.join(batch)}"] if batch else []
    rows = []
    for name, group in groups(results):
        row = [name, *(per_system(group, [s], onsets) for s in systems)]
        if "stream" in systems:
            latencies = [x for r in group for x in r.latencies]
            sentences = [x for r in group for x in r.sentence_latencies]
            firsts = [r.first_partial_s for r in group if r.first_partial_s is not None]
            row += [f"{percentile(latencies, 0.5):.2f} / {percentile(latencies, 0.95):.2f}",
                    f"{percentile(sentences, 0.5):.2f} / {percentile(sentences, 0.95):.2f}"
                    if sentences else "-",
                    f"{statistics.median(firsts):.2f}" if firsts else "-"]
        audio = sum(r.clip.seconds for r in group)
        row += [" / ".join(f"{sum(r.seconds[s] for r in group) / audio:.3f}" for s in batch)] if batch else []
        rows.append(row)
    return markdown(header, rows)


def report(results: list[Result], systems: list[str], settings: str) -> str:
    clips = {"clips": [{"condition": r.clip.condition, "duration": r.clip.seconds,
                        "speech": r.clip.speech_seconds} for r in results]}
    return (f"{settings}\n\nCorpus:\n\n```\n{corpus_summary(clips)}\n```\n\n"
            f"Words:\n\n{words_table(results, systems)}\n\n"
            f"Timing:\n\n{timing_table(results, systems)}\n")


BEGIN, END = "<!-- evaluate.py --doc: begin -->", "<!-- evaluate.py --doc: end -->"


def write_doc(path: Path, block: str) -> None:
    """Replace the text between the markers of `path` (create it if missing) with `block`."""
    text = path.read_text() if path.is_file() else f"# Voxtide evaluation\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n{block}{END}{rest.split(END, 1)[1]}")


def provenance(argv: list[str]) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "app", "audio", "engine"],
                           capture_output=True, text=True, cwd=ROOT).stdout.split()[1::2]
    return (f"{datetime.date.today()}, {cpu}, {torch.get_num_threads()} torch threads, commit {commit}"
            + (f" with uncommitted changes to {', '.join(dirty)}" if dirty else "")
            + f"; `{' '.join(['scripts/dev.sh run python scripts/evaluate.py', *argv])}`")


def to_json(results: list[Result]) -> list[dict]:
    return [{"clip": r.clip.name, "condition": r.clip.condition, "audio_s": r.clip.seconds,
             "scores": {s: vars(x) for s, x in r.scores.items()}, "seconds": r.seconds,
             "texts": {s: " ".join(w for _, _, w in words) for s, words in r.words.items()},
             "words": r.words, "latencies": r.latencies, "sentence_latencies": r.sentence_latencies,
             "first_partial_s": r.first_partial_s}
            for r in results]


def rescore(runs: list[str], results: list[Result]) -> list[str]:
    """Fill `results` from runs saved with `--json`, scored anew: the scorer may have changed
    since, and runs of one corpus, each of some systems, make one table (a replay, offline and
    faster-whisper run apart). A run is a path, or path:system,... for only those of its
    systems. -> the systems taken. A system taken from two runs is an error: which one the
    table shows would be a guess; so is a run of another corpus (no clip of it in this one)."""
    systems: set[str] = set()
    for run in runs:
        path, _, only = run.partition(":")
        saved = {entry["clip"]: entry for entry in json.loads(Path(path).read_text())}
        found = {s for entry in saved.values() for s in entry["words"]}
        wanted = set(only.split(",")) if only else found
        if wanted - found:
            raise ValueError(f"{path} has no {', '.join(sorted(wanted - found))}")
        if wanted & systems:
            twice = ", ".join(sorted(wanted & systems))
            raise ValueError(f"{path}: {twice} already taken from an earlier run "
                             f"(take others: {path}:system,...)")
        if not saved.keys() & {r.clip.name for r in results}:
            raise ValueError(f"{path}: none of its clips is in this corpus (pass the --corpus, --seeds "
                             f"and --conditions it was run on)")
        systems |= wanted
        for r in results:
            entry = saved.get(r.clip.name)
            if entry is None:
                continue
            for system in wanted & entry["words"].keys():
                r.add(system, [tuple(w) for w in entry["words"][system]], entry["seconds"][system])
            if "stream" in wanted:
                r.latencies, r.first_partial_s = entry["latencies"], entry["first_partial_s"]
                r.sentence_latencies = entry.get("sentence_latencies", [])  # (runs before it had none)
    return [s for s in SYSTEMS if s in systems]


def run_systems(args: argparse.Namespace, results: list[Result]) -> list[str]:
    systems = []
    model = load_bundle(device="cpu", bf16=False if args.no_bf16 else None, int8=args.int8)
    config = EngineConfig(pad_seconds=args.pad_seconds, endpoint_ms=args.endpoint_ms or None,
                          preview_pad_seconds=args.preview_pad_seconds or None,
                          prompt_tokens=args.prompt_tokens, beam_size=args.beam_size,
                          worker_process=True)  # as `voxtide serve`
    if "stream" not in args.skip:
        asyncio.run(stream_all(results, args.parallel, args.fast, config, model))
        systems.append("stream")
    if args.replay:
        replay_all(results, config, model)
        systems.append("replay")
    if "file" not in args.skip:
        asyncio.run(files_all(results, config, model))
        systems.append("file")
    if "offline" not in args.skip:
        offline_all(results, model)
        systems.append("offline")
    if "fw-int8" not in args.skip and faster_whisper_all(results, args.threads):
        systems.append("fw-int8")
    return systems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the quick corpus (a few minutes)")
    parser.add_argument("--corpus", type=Path, default=None, help="default: data/corpus(-quick)")
    parser.add_argument("--seeds", "--seed", type=int, nargs="+", default=[0],
                        help="these seeds' corpus (several: each clip once per seed, a row pools them)")
    parser.add_argument("--rebuild", action="store_true", help="build the corpus anew")
    parser.add_argument("--conditions", nargs="*", default=[], choices=CONDITIONS, metavar="CONDITION",
                        help="only these conditions (a corpus built anew holds only these; "
                             "default: every one the corpus holds)")
    parser.add_argument("--parallel", type=int, default=1, help="streaming sessions at once")
    parser.add_argument("--fast", action="store_true", help="stream as fast as possible")
    parser.add_argument("--pad-seconds", type=int, default=None)
    parser.add_argument("--preview-pad-seconds", type=int, default=EngineConfig.preview_pad_seconds,
                        help="0: partials decode the whole window")
    parser.add_argument("--endpoint-ms", type=int, default=EngineConfig.endpoint_ms, help="0: off")
    parser.add_argument("--prompt-tokens", type=int, default=EngineConfig.prompt_tokens)
    parser.add_argument("--beam-size", type=int, default=EngineConfig.beam_size,
                        help="streaming's beams for a decode committed whole (a final)")
    parser.add_argument("--replay", action="store_true",
                        help="also stream each clip into an in-process engine, as if compute took no time")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--int8", action=argparse.BooleanOptionalAction, default=None,
                        help="the encoder on int8 weights (default: on a CPU without native bf16)")
    parser.add_argument("--no-bf16", action="store_true",
                        help="no bfloat16 parts: float32, or int8 with --int8 (a CPU without native bf16)")
    parser.add_argument("--skip", nargs="*", default=[], choices=[s for s in SYSTEMS if s != "replay"])
    parser.add_argument("--json", default=None, help="write the figures and transcripts here")
    parser.add_argument("--doc", action="store_true", help="write the tables to docs/evaluation.md")
    parser.add_argument("--rescore", nargs="+", default=None, metavar="RUN",
                        help="run nothing: score the transcripts of runs saved with --json anew "
                             "(path, or path:system,... for some of its systems)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.corpus or DEFAULT_DIR.with_name("corpus-quick" if args.quick else "corpus")
    try:
        clips = load_clips(folder, args.quick, args.seeds, args.rebuild, args.conditions)
    except ValueError as e:  # a folder of another corpus
        parser.error(str(e))
    results = [Result(c) for c in clips]
    if args.rescore:
        try:
            systems = rescore(args.rescore, results)
        except ValueError as e:
            parser.error(str(e))
        results = [r for r in results if r.scores]
        settings = f"The transcripts of {', '.join(args.rescore)}, scored again: {provenance(sys.argv[1:])}."
    else:
        systems = run_systems(args, results)
        settings = (f"Streaming: {'fast' if args.fast else 'real time'}, {args.parallel} at once, 100 ms "
                    f"chunks, endpoint {args.endpoint_ms} ms, pad {args.pad_seconds}, preview pad "
                    f"{args.preview_pad_seconds}, prompt {args.prompt_tokens} tokens, {args.beam_size} beams "
                    f"for finals. Run: "
                    f"{provenance(sys.argv[1:])}.")
    text = report(results, systems, settings)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(results), indent=1))
    if args.doc:
        write_doc(ROOT / "docs" / "evaluation.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
