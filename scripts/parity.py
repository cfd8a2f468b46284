"""Parity of a reduced-precision model against float32 on the same device.

For each test recording (pocketsphinx-testdata: the five Sense and Sensibility passages, the
cards, and all of them joined as one long file), both models transcribe offline; printed:
the encoder's relative error against float32 (‖out − ref‖ / ‖ref‖), whether the transcripts
are the same, each one's WER against the reference, and how far the word start times move.
On CUDA the server runs float16 (engine.model.loader.load_model), so that is the default.

    scripts/dev.sh run python scripts/parity.py [--device cuda] [--dtype float16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from audio.mel import log_mel_spectrogram  # noqa: E402
from engine.model import ModelBundle, load_bundle  # noqa: E402
from engine.model.transcribe import transcribe  # noqa: E402
from scripts.wer import word_errors  # noqa: E402
from tests.helpers import ARCTIC_IDS, audio, concatenated, librivox_path, transcripts  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def recordings() -> list[tuple[str, torch.Tensor, str]]:
    """-> (name, 16 kHz mono audio, reference text) of every recording and of all joined."""
    out = [(path.stem.rsplit("-", 1)[-1], audio(path), text) for path, text in sorted(transcripts().items())]
    joined, text = concatenated([librivox_path(c) for c in ARCTIC_IDS] + [p for p in transcripts()
                                if p.parent.name == "cards"], gap_seconds=1.0)
    return [*out, ("all joined", joined, text)]


def encoder_error(a: ModelBundle, b: ModelBundle, samples: torch.Tensor) -> float:
    """Relative error of b's encoder output against a's on the first 30 s window."""
    mel = log_mel_spectrogram(samples.float(), a.model.dims.n_mels, padding=480_000)[:, :3000]
    with torch.no_grad():
        ref = a.model.encoder(mel[None].to(a.device, a.model.dtype)).double()
        out = b.model.encoder(mel[None].to(b.device, b.model.dtype)).double()
    return float((out - ref).norm() / ref.norm())


def starts_ms(result) -> list[tuple[str, int]]:
    return [(w.text.strip().lower(), w.start_ms) for s in result.segments for w in s.words]


def compare(exact: ModelBundle, reduced: ModelBundle) -> list[dict]:
    rows = []
    for name, samples, reference in recordings():
        a, b = transcribe(exact, samples), transcribe(reduced, samples)
        ea, n = word_errors(reference, a.text)
        eb, _ = word_errors(reference, b.text)
        wa, wb = starts_ms(a), starts_ms(b)
        moves = [abs(x[1] - y[1]) for x, y in zip(wa, wb, strict=False) if x[0] == y[0]]
        rows.append({"recording": name, "seconds": round(samples.shape[0] / 16000, 1),
                     "encoder_rel_error": encoder_error(exact, reduced, samples),
                     "same_text": a.text == b.text, "wer_fp32": ea / n, "wer_reduced": eb / n,
                     "words": n, "start_moved_ms_max": max(moves, default=0),
                     "start_moved_ms_p50": float(np.median(moves)) if moves else 0.0})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    exact = load_bundle(device=args.device, dtype=torch.float32, bf16=False)
    exact.model.set_projection_dtype(None)
    reduced = load_bundle(device=args.device, dtype=DTYPES[args.dtype])
    rows = compare(exact, reduced)
    print(f"{args.dtype} against float32 on {args.device}")
    print(f"{'recording':>14} {'s':>6} {'enc err':>8} {'same':>5} {'WER32':>6} {'WERred':>6} "
          f"{'start moved p50/max ms':>22}")
    for r in rows:
        print(f"{r['recording']:>14} {r['seconds']:6.1f} {r['encoder_rel_error']:8.1e} "
              f"{'yes' if r['same_text'] else 'no':>5} {r['wer_fp32']:6.1%} {r['wer_reduced']:6.1%} "
              f"{r['start_moved_ms_p50']:>13.0f} / {r['start_moved_ms_max']:.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
