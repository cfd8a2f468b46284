"""Engine benchmarks, printed as ratios measured in one run.

    scripts/dev.sh run python scripts/bench_engine.py

1. schedule() + gather per step for a session of 45,000 items (an hour) vs 100 items, with
   the same window size (goal <= 1.2x: no per-step work grows with the session).
2. Encoder (conv-stem) calls per step with 8 sessions (goal 1).
3. Step time with 1 vs 8 sessions, real model.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from audio.mel import N_FRAMES, N_SAMPLES, log_mel_spectrogram
from engine.model.decoding import DecodingOptions, decode, decode_batch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.engine import Engine  # noqa: E402
from engine.mm_window import window_pieces  # noqa: E402
from engine.model import load_bundle  # noqa: E402
from engine.model_runner import WindowInput  # noqa: E402
from engine.request import MMFeature, PlaceholderRange, Request  # noqa: E402
from tests.helpers import ARCTIC_IDS, concatenated, librivox_path  # noqa: E402

WINDOW_ITEMS = 250  # a 20 s window
NEW_ITEMS = 13  # ~1 s of new audio per step


def schedule_gather_seconds(engine: Engine, num_items: int, steps: int = 300) -> float:
    """Mean seconds of schedule() + gather() per step for one session of num_items items."""
    scheduler, runner = engine.scheduler, engine.runner
    rid = f"long-{num_items}"
    request = Request(rid)
    d = engine.bundle.model.dims.n_audio_state
    embed = torch.zeros(4, d)
    for i in range(num_items):
        request.mm_features.append(MMFeature(f"{rid}-{i}", PlaceholderRange(4 * i, 4)))
    scheduler.add_request(request)
    requests = [request]
    # steady state: everything before the window was encoded and freed
    request.window_start = 4 * max(0, num_items - WINDOW_ITEMS)
    request.num_decoded_positions = request.num_positions
    first = num_items - min(num_items, WINDOW_ITEMS)
    request.num_freed_items = first
    request.num_encoded_items = first
    total, num_windows = 0.0, 0
    for _ in range(steps):
        for _ in range(NEW_ITEMS):
            i = request.num_items
            request.mm_features.append(MMFeature(f"{rid}-{i}", PlaceholderRange(4 * i, 4)))
        request.last_speech_end = request.num_positions  # speech: the scheduler decodes only that
        start = time.perf_counter()
        out = scheduler.schedule(requests)
        for idx in out.encoder_inputs.get(rid, []):
            runner.encoder_cache[request.mm_features[idx].identifier] = embed
        num_windows += len(out.windows)
        for window in out.windows:
            items = request.mm_features[window.item_lo : window.item_hi]
            pieces = window_pieces(items, window.window_start, window.window_end)
            runner.gather(WindowInput(window, pieces))
            # keep the window length steady: commit as far as the new audio (the cut of
            # the commit step: Stream._cut)
            request.window_start = max(request.window_start, window.window_end - 4 * WINDOW_ITEMS)
            scheduler.free_behind_window(request)
        total += time.perf_counter() - start
    scheduler.finish_request(request)
    runner.encoder_cache.clear()
    assert num_windows == steps, f"{num_windows} windows in {steps} steps: nothing was measured"
    return total / steps


def main() -> None:
    torch.set_num_threads(2)
    bundle = load_bundle(device="cpu")
    engine = Engine(bundle)
    small = schedule_gather_seconds(engine, 100)
    large = schedule_gather_seconds(engine, 45_000)
    small = schedule_gather_seconds(engine, 100)  # again, warm
    print(f"schedule+gather per step: 100 items {small * 1e3:.3f} ms, "
          f"45,000 items {large * 1e3:.3f} ms, ratio {large / small:.2f} (goal <= 1.2)")

    samples, _ = concatenated([librivox_path(c) for c in ARCTIC_IDS])
    x = samples.numpy()
    per_session = 16000 * 2
    for n in (1, 8):
        engine = Engine(bundle)
        for s in range(n):
            engine.add_request(f"s{s}")
            engine.add_audio(f"s{s}", x[s * 8000 : s * 8000 + per_session])  # distinct audio
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        stats = engine.last_stats
        print(f"{n} session(s): step {elapsed:.2f} s, windows {stats.num_windows}, "
              f"encoder calls {stats.num_encoder_calls}, items encoded {stats.num_encoded_items}")
        if n == 1:
            one = elapsed
    print(f"step time 8 sessions / 1 session: {elapsed / one:.2f} (8.0 = no batching gain)")
    decode_batching(bundle, x)


def decode_batching(bundle, x: np.ndarray) -> None:
    """Where a step's time goes with 8 sessions: the padded 30 s transformer vs decoding, and
    decoding the 8 windows as one batch vs one by one (same tokens)."""
    model, tok = bundle.model, bundle.tokenizer
    mels = torch.stack([log_mel_spectrogram(torch.from_numpy(x[s * 8000 : s * 8000 + 32000]),
                                            padding=N_SAMPLES)[:, :N_FRAMES] for s in range(8)])
    with torch.inference_mode():
        start = time.perf_counter()
        features = model.encoder(mels)  # (8, 1500, n_state)
        encode = time.perf_counter() - start
    options = [DecodingOptions(audio_seconds=2.0) for _ in range(8)]
    start = time.perf_counter()
    batched = decode_batch(model, tok, features, options, bundle.suppress)
    together = time.perf_counter() - start
    start = time.perf_counter()
    alone = [decode(model, tok, features[i : i + 1], options[i], bundle.suppress) for i in range(8)]
    one_by_one = time.perf_counter() - start
    same = all(a.tokens == b.tokens for a, b in zip(alone, batched, strict=True))
    print(f"8 windows: encoder (padded 30 s) {encode:.2f} s; decode batched {together:.2f} s vs "
          f"one by one {one_by_one:.2f} s, ratio {together / one_by_one:.2f} (same tokens: {same})")


if __name__ == "__main__":
    np.random.seed(0)
    main()
