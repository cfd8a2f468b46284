"""Whisper's byte-level BPE vocabulary, read from a Hugging Face tokenizer.json.

Decoding only: the engine feeds token ids back as prompts and never needs to encode text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from engine.model.loader import CheckpointError, default_model_path


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


NUM_TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|>
BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}


@dataclass
class Tokenizer:
    id_to_token: list[str]
    special: dict[str, int]  # "<|endoftext|>" -> 50256, ...
    multilingual: bool

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            vocab: dict[str, int] = data["model"]["vocab"]
            added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{path}: not a readable tokenizer.json ({e})") from e
        size = max([*vocab.values(), *added.values()]) + 1
        id_to_token = [""] * size
        for token, i in {**vocab, **added}.items():
            id_to_token[i] = token
        # English-only files list the language tokens too: the model's vocab size decides
        return cls(id_to_token, added, multilingual=len(id_to_token) > 50363)

    @classmethod
    def for_model(cls, model_path: str | Path | None, n_vocab: int) -> Tokenizer:
        """tokenizer.json beside the checkpoint, else the bundled English one if it fits."""
        candidates = []
        if model_path is not None:
            p = Path(model_path)
            candidates.append((p if p.is_dir() else p.parent) / "tokenizer.json")
        candidates.append(default_model_path() / "tokenizer.json")
        for file in candidates:
            if file.is_file():
                tokenizer = cls.from_file(file)
                tokenizer.multilingual = n_vocab >= 51865
                if tokenizer.timestamp_begin + NUM_TIMESTAMPS == n_vocab:
                    return tokenizer
        raise CheckpointError(
            f"no tokenizer.json with {n_vocab} tokens found beside {model_path}; "
            "put the model's tokenizer.json next to the checkpoint"
        )

    def token(self, name: str) -> int:
        return self.special[name]

    @cached_property
    def eot(self) -> int:
        return self.special["<|endoftext|>"]

    @cached_property
    def sot(self) -> int:
        return self.special["<|startoftranscript|>"]

    @cached_property
    def sot_prev(self) -> int:
        return self.special["<|startofprev|>"]

    @cached_property
    def no_timestamps(self) -> int:
        return self.special["<|notimestamps|>"]

    @cached_property
    def no_speech(self) -> int:
        return self.special.get("<|nospeech|>", self.special.get("<|nocaptions|>", -1))

    @cached_property
    def full_stop(self) -> int:
        return self.id_to_token.index(".")

    @cached_property
    def timestamp_begin(self) -> int:
        return self.special["<|0.00|>"] if "<|0.00|>" in self.special else self.no_timestamps + 1

    def sot_sequence(self, language: str = "en") -> list[int]:
        if not self.multilingual:
            return [self.sot]
        return [self.sot, self.special[f"<|{language}|>"], self.special["<|transcribe|>"]]

    def decode_bytes(self, tokens: list[int]) -> bytes:
        text = "".join(self.id_to_token[t] for t in tokens if t < self.eot)
        return bytes(BYTE_DECODER[c] for c in text)

    def decode(self, tokens: list[int]) -> str:
        """Text tokens -> text; special and timestamp tokens are dropped."""
        return self.decode_bytes(tokens).decode("utf-8", errors="replace")
