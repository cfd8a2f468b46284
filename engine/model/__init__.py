"""Whisper in plain PyTorch, its weight loaders, tokenizer and decoding."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.model.loader import CheckpointError, default_model_path, load_model
from engine.model.timing import default_heads
from engine.model.tokenizer import Tokenizer
from engine.model.whisper import ModelDimensions, Whisper

__all__ = ["CheckpointError", "ModelBundle", "ModelDimensions", "Tokenizer", "Whisper", "load_bundle"]


@dataclass
class ModelBundle:
    """A loaded model with what decoding needs beside it."""

    model: Whisper
    tokenizer: Tokenizer
    suppress: list[int]  # non-speech token ids never sampled
    model_id: str  # part of every audio item's content hash
    name: str = "whisper"  # shown to clients: "whisper-tiny.en" for the bundled model
    # (layer, head) of the cross-attention heads that follow the audio: word timing
    alignment_heads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.model.device


def _config_value(folder: Path, keys: tuple[str, str]) -> list | None:
    """A list from the checkpoint's config.json (CTranslate2) or generation_config.json (HF)."""
    for name, key in zip(("config.json", "generation_config.json"), keys, strict=True):
        file = folder / name
        if file.is_file():
            value = json.loads(file.read_text()).get(key)
            if value:
                return value
    return None


def _suppress_ids(folder: Path, tokenizer: Tokenizer) -> list[int]:
    ids = _config_value(folder, ("suppress_ids", "suppress_tokens"))
    if ids:
        return [int(i) for i in ids]
    if not tokenizer.multilingual:  # English vocabularies share ids: use the bundled list
        return _suppress_ids(default_model_path(), tokenizer)
    return []


def _alignment_heads(folder: Path, dims: ModelDimensions) -> list[tuple[int, int]]:
    heads = _config_value(folder, ("alignment_heads", "alignment_heads"))
    if heads and all(0 <= layer < dims.n_text_layer and 0 <= head < dims.n_text_head
                     for layer, head in heads):
        return [(int(layer), int(head)) for layer, head in heads]
    return default_heads(dims.n_text_layer, dims.n_text_head)


def load_bundle(path: str | Path | None = None, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None, bf16: bool | None = None,
                int8: bool | None = None) -> ModelBundle:
    """Load model, tokenizer and suppress list from a checkpoint (default: bundled tiny.en).
    `dtype`, `bf16` and `int8` as in `load_model`."""
    resolved = Path(path) if path is not None else default_model_path()
    model = load_model(resolved, device=device, dtype=dtype, bf16=bf16, int8=int8)
    tokenizer = Tokenizer.for_model(resolved, model.dims.n_vocab)
    folder = resolved if resolved.is_dir() else resolved.parent
    model_id = hashlib.blake2b(f"{resolved.resolve()}:{model.dims}".encode(), digest_size=8).hexdigest()
    name = "whisper-tiny.en" if path is None else (resolved.name if resolved.is_dir() else resolved.stem)
    return ModelBundle(model, tokenizer, _suppress_ids(folder, tokenizer), model_id, name,
                       _alignment_heads(folder, model.dims))
