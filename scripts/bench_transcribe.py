"""Real-time factor of `voxtide transcribe` vs CTranslate2 (int8 and float32) on the same audio.

    scripts/dev.sh run python scripts/bench_transcribe.py [--repeat 3]

CTranslate2 decodes the same padded 30 s log-mel windows greedily with timestamps (fixed
windows, no seeking), so its figure is a lower bound on a full faster-whisper pipeline.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from audio.mel import N_FRAMES, N_SAMPLES, log_mel_spectrogram  # noqa: E402
from engine.model import load_bundle  # noqa: E402
from engine.model.loader import default_model_path  # noqa: E402
from engine.model.transcribe import transcribe  # noqa: E402
from scripts.wer import word_errors  # noqa: E402
from tests.helpers import ARCTIC_IDS, concatenated, librivox_path  # noqa: E402


def ct2_transcribe(model, tokenizer, samples: torch.Tensor) -> str:
    mel = log_mel_spectrogram(samples, padding=N_SAMPLES)
    content = mel.shape[-1] - N_FRAMES
    import ctranslate2

    windows = [mel[:, s : s + N_FRAMES].numpy().copy() for s in range(0, content, N_FRAMES)]
    texts = []
    for w in windows:
        result = model.generate(ctranslate2.StorageView.from_array(w[None]), [[50257]],
                                beam_size=1, max_length=224)
        texts.append(tokenizer.decode(result[0].sequences_ids[0]))
    return "".join(texts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="copies of the arctic set")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    samples, reference = concatenated([librivox_path(c) for c in ARCTIC_IDS] * args.repeat)
    seconds = samples.shape[0] / 16000
    bundle = load_bundle(device="cpu")
    transcribe(bundle, samples[: 16000 * 5])  # warm-up

    rows = []
    start = time.perf_counter()
    ours = transcribe(bundle, samples)
    rows.append(("voxtide (torch fp32, fp16 projection)", time.perf_counter() - start, ours.text))
    try:
        import ctranslate2
    except ImportError:
        ctranslate2 = None
    if ctranslate2 is not None:
        for compute in ("int8", "float32"):
            model = ctranslate2.models.Whisper(str(default_model_path()), device="cpu",
                                               compute_type=compute, intra_threads=args.threads)
            ct2_transcribe(model, bundle.tokenizer, samples[: 16000 * 5])
            start = time.perf_counter()
            text = ct2_transcribe(model, bundle.tokenizer, samples)
            rows.append((f"ctranslate2 {compute}", time.perf_counter() - start, text))

    print(f"audio: {seconds:.1f} s, {args.threads} threads")
    print(f"{'engine':40s} {'seconds':>8s} {'RTF':>7s} {'WER':>6s} {'RTF/ours':>9s}")
    base = rows[0][1]
    for name, elapsed, text in rows:
        errors, words = word_errors(reference, text)
        print(f"{name:40s} {elapsed:8.2f} {elapsed / seconds:7.3f} {errors / words:6.1%} "
              f"{elapsed / base:9.2f}")


if __name__ == "__main__":
    main()
