"""Weight loaders: parity with CTranslate2, openai-whisper and Hugging Face transformers."""

import json
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch

from audio.mel import N_FRAMES, N_SAMPLES, log_mel_spectrogram
from engine.model import CheckpointError, load_bundle
from engine.model.decoding import DecodingOptions, decode, decode_batch, resync_draft
from engine.model.loader import cpu_has_bf16, default_model_path, load_model, load_state, openai_to_hf
from engine.words import shift_timestamps
from scripts.wer import normalize, word_errors
from tests.helpers import ARCTIC_IDS, audio, bundle, exact_bundle, librivox_path, transcripts

PARITY_CLIPS = ["0870", "0890", "0930"]


def window_mel(clip: str) -> torch.Tensor:
    """(1, 80, 3000) padded 30 s log-mel of a recording."""
    return log_mel_spectrogram(audio(librivox_path(clip)), padding=N_SAMPLES)[None, :, :N_FRAMES]


def greedy(model, mel: torch.Tensor, prompt: list[int], steps: int = 60) -> list[int]:
    """Plain greedy decoding with no logit rules, to compare raw models."""
    with torch.inference_mode():
        xa = model.encoder(mel.to(model.device, model.dtype))
        cache = model.decoder.new_cache()
        logits = model.decoder(torch.tensor([prompt], device=model.device), xa, cache)
        out: list[int] = []
        for _ in range(steps):
            token = int(logits[0, -1].argmax())
            if token == 50256:
                break
            out.append(token)
            logits = model.decoder(torch.tensor([[token]], device=model.device), None, cache)
    return out


@pytest.mark.parametrize("clip", PARITY_CLIPS)
def test_ctranslate2_loader_gives_same_greedy_tokens_as_ctranslate2(clip):
    ctranslate2 = pytest.importorskip("ctranslate2")
    prompt = [50257, 50362]
    reference = ctranslate2.models.Whisper(str(default_model_path()), device="cpu",
                                           compute_type="float32")
    mel = window_mel(clip)
    result = reference.generate(ctranslate2.StorageView.from_array(mel.numpy().copy()), [prompt],
                                beam_size=1, suppress_blank=False, suppress_tokens=[],
                                max_length=100)
    expected = result[0].sequences_ids[0]
    ours = greedy(exact_bundle().model, mel, prompt)
    assert len(expected) > 5
    assert ours == expected


def test_openai_checkpoint_round_trip_matches_openai_whisper(tmp_path):
    whisper_model = pytest.importorskip("whisper.model")
    dims, state = load_state(default_model_path())
    tensors = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()}
    path = tmp_path / "tiny.en.pt"
    torch.save({"dims": dims.__dict__, "model_state_dict": tensors}, path)

    reference = whisper_model.Whisper(whisper_model.ModelDimensions(**dims.__dict__))
    reference.load_state_dict(tensors)
    reference.eval()
    ours = load_model(path, device="cpu", bf16=False)
    ours.set_projection_dtype(None)  # compare in full fp32
    mel = window_mel("0880")
    tokens = torch.tensor([[50257, 50362, 679, 373]])
    with torch.inference_mode():
        expected = reference(mel, tokens)
        got = ours(mel, tokens)
    assert (expected - got).abs().max().item() < 1e-3
    assert greedy(ours, mel, [50257, 50362]) == greedy(exact_bundle().model, mel, [50257, 50362])


def test_huggingface_safetensors_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    dims, state = load_state(default_model_path())
    tensors = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()}
    hf_state = openai_to_hf(tensors)
    hf_state["proj_out.weight"] = hf_state["model.decoder.embed_tokens.weight"]
    config = transformers.WhisperConfig(
        vocab_size=dims.n_vocab, num_mel_bins=dims.n_mels, d_model=dims.n_audio_state,
        encoder_layers=dims.n_audio_layer, decoder_layers=dims.n_text_layer,
        encoder_attention_heads=dims.n_audio_head, decoder_attention_heads=dims.n_text_head,
        encoder_ffn_dim=4 * dims.n_audio_state, decoder_ffn_dim=4 * dims.n_text_state,
        max_source_positions=dims.n_audio_ctx, max_target_positions=dims.n_text_ctx,
    )
    config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hf_state.items() if k != "proj_out.weight"},
              str(tmp_path / "model.safetensors"))

    reference = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path).eval()
    ours = load_model(tmp_path, device="cpu", bf16=False)
    ours.set_projection_dtype(None)
    mel = window_mel("0930")
    tokens = torch.tensor([[50257, 50362, 679]])
    with torch.inference_mode():
        expected = reference(input_features=mel, decoder_input_ids=tokens).logits
        got = ours(mel, tokens)
    assert (expected - got).abs().max().item() < 1e-3
    # the bundle finds the English tokenizer for a folder without one
    assert load_bundle(tmp_path, device="cpu").tokenizer.eot == 50256


def test_missing_corrupt_and_unknown_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no model.bin"):
        load_model(tmp_path)
    truncated = tmp_path / "model.bin"
    truncated.write_bytes(default_model_path().joinpath("model.bin").read_bytes()[:100_000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(truncated)
    other = tmp_path / "other" / "model.bin"
    other.parent.mkdir()
    name = b"TransformerSpec\x00"
    other.write_bytes(struct.pack("<IH", 6, len(name)) + name + struct.pack("<II", 1, 0))
    with pytest.raises(CheckpointError, match="not Whisper"):
        load_model(other)
    bad_pt = tmp_path / "bad.pt"
    bad_pt.write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="openai-whisper"):
        load_model(bad_pt)
    onnx = tmp_path / "weights.onnx"
    onnx.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unknown checkpoint kind"):
        load_model(onnx)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(hf)
    (hf / "config.json").write_text(json.dumps({"d_model": 4}))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(hf)


@pytest.mark.parametrize("clip", ARCTIC_IDS)
def test_16_bit_parts_keep_greedy_words(clip):
    """The server's model decodes the same words as float32 throughout: on the CPU, bf16
    encoder blocks and projection where the CPU has them, else int8 encoder layers and an
    fp16 projection; on CUDA, float16. bf16 may move a comma (0890 gets "selfish, is")."""
    mel = window_mel(clip)
    fast, exact = bundle(), exact_bundle()
    on_cpu = fast.device.type == "cpu"
    assert fast.model.decoder.projection is not None or not on_cpu
    if on_cpu:
        assert fast.model.encoder_int8 != cpu_has_bf16()
    if on_cpu and cpu_has_bf16():
        assert fast.model.encoder.blocks[0].mlp[0].weight.dtype == torch.bfloat16
    expected = exact.tokenizer.decode(greedy(exact.model, mel, [50257, 50362]))
    got = fast.tokenizer.decode(greedy(fast.model, mel, [50257, 50362]))
    assert len(expected.split()) >= 7
    assert normalize(got) == normalize(expected)


def test_a_bf16_projection_decides_as_float32():
    """The bfloat16 projection copy (the CPU's fast path) finds the tokens near the best and
    computes those, and the timestamps, again in float32: greedy choices and the timestamp
    rule see float32 logits. (Rounded to bfloat16, the logits sent a 2.5-minute file astray.)"""
    model = load_bundle(device="cpu", bf16=False).model
    model.set_projection_dtype(None)
    mel = window_mel("0890")
    prompt = [50257, 50362]
    tokens = torch.tensor([prompt + greedy(model, mel, prompt)])
    with torch.inference_mode():
        hidden = model.decoder.hidden(tokens, model.encoder(mel), model.decoder.new_cache())[0]
        exact = model.decoder.logits(hidden, 50257, 50363)  # (T, vocab)
        model.set_projection_dtype(torch.bfloat16)
        fast = model.decoder.logits(hidden, 50257, 50363)
    assert tokens.shape[1] > 10
    text = slice(0, 50257)  # the text tokens and end-of-text (the specials are never chosen)
    assert torch.equal(fast[:, text].argmax(-1), exact[:, text].argmax(-1))
    near = exact[:, text] >= exact[:, text].amax(-1, keepdim=True) - 0.3
    assert (fast[:, text] - exact[:, text])[near].abs().max().item() < 1e-4
    ts = 50363
    assert (fast[:, ts:] - exact[:, ts:]).abs().max().item() < 1e-4
    assert (fast - exact).abs().max().item() > 1e-3  # the rest is bfloat16's: the copy is used


def test_an_fp16_projection_serves_a_few_rows_and_float32_more():
    """Without native bf16 the projection copy is float16, whose CPU matmul costs about a
    matrix-vector product per row: a few rows (a token per window) take the copy, more rows
    (a draft checked at once) the float32 projection, which then decides exactly."""
    from engine.model.whisper import FP16_MAX_ROWS

    model = load_bundle(device="cpu", bf16=False).model
    assert model.decoder.projection is not None and model.decoder.projection.dtype == torch.float16
    mel = window_mel("0890")
    prompt = [50257, 50362]
    tokens = torch.tensor([prompt + greedy(model, mel, prompt)])
    with torch.inference_mode():
        hidden = model.decoder.hidden(tokens, model.encoder(mel), model.decoder.new_cache())[0]
        exact = hidden @ model.decoder.token_embedding.weight.T  # (T, vocab)
        many = model.decoder.logits(hidden)
        few = model.decoder.logits(hidden[:FP16_MAX_ROWS])
    assert hidden.shape[0] > FP16_MAX_ROWS
    assert torch.equal(many, exact)
    assert 0 < (few - exact[:FP16_MAX_ROWS]).abs().max().item() < 0.05
    assert torch.equal(few.argmax(-1), exact[:FP16_MAX_ROWS].argmax(-1))


def three_windows() -> tuple[torch.Tensor, list[int], list[DecodingOptions]]:
    """Encoder features of three real windows, a real prompt, and options with prompts of
    different lengths (the batch is left-padded)."""
    b = bundle()
    with torch.inference_mode():
        mels = torch.cat([window_mel(c) for c in ("0870", "0890", "0920", "0930")])
        mels = mels.to(b.device, b.model.dtype)
        features = b.model.encoder(mels[[0, 1, 3]])
        prompt = decode(b.model, b.tokenizer, b.model.encoder(mels[2:3]),
                        DecodingOptions(timestamps=False), b.suppress).tokens
    options = [DecodingOptions(prompt=prompt, audio_seconds=7.1),
               DecodingOptions(audio_seconds=5.3),  # no prompt: 1 + len(prompt) shorter
               DecodingOptions(prompt=prompt[:5], audio_seconds=3.3)]
    return features, prompt, options


@pytest.mark.parametrize("rows, queries", [(5, 1), (3, 20), (16, 5)])
def test_keys_of_batch_one_are_every_rows_as_a_copy_per_row_would_be(rows, queries):
    """A window's beams share its cross keys (batch 1): attention reads them for all the rows'
    queries at once, as it reads a copy per row (also where the rows' queries together pass
    FEW_QUERIES, and the kernel changes)."""
    b = exact_bundle()
    attention = b.model.decoder.blocks[0].cross_attn
    torch.manual_seed(0)
    d = b.model.dims.n_text_state
    q = torch.randn(rows, queries, d)
    with torch.inference_mode():
        xa = torch.randn(1, 1500, d)
        k, v = attention.heads(attention.key(xa)), attention.heads(attention.value(xa))  # (1, H, 1500, D/H)
        shared = attention(q, k, v)
        copied = attention(q, k.repeat(rows, 1, 1, 1), v.repeat(rows, 1, 1, 1))
    assert shared.shape == copied.shape == (rows, queries, d)
    assert torch.allclose(shared, copied, atol=1e-5)


def test_batched_decoding_equals_decoding_each_window_alone():
    b = bundle()
    features, prompt, options = three_windows()
    batched = decode_batch(b.model, b.tokenizer, features, options, b.suppress)
    for row, (opts, result) in enumerate(zip(options, batched, strict=True)):
        alone = decode(b.model, b.tokenizer, features[row : row + 1], opts, b.suppress)
        assert result.tokens == alone.tokens
        assert result.stop == alone.stop == "eot"
        assert abs(result.avg_logprob - alone.avg_logprob) < 1e-3
        # (in float16 the batch's kernels round otherwise than one row's)
        assert abs(result.no_speech_prob - alone.no_speech_prob) < (1e-4 if b.model.dtype == torch.float32
                                                                     else 1e-3)
    assert b.tokenizer.decode(prompt).strip().startswith("Had he")  # a real, long prompt


def logprob_tolerance(model) -> float:
    """How far a drafted decode's average log-probability may be from greedy's: in float16
    the draft's tokens, scored in one pass, round otherwise than one at a time."""
    return 1e-3 if model.dtype == torch.float32 else 5e-3


def drafted_decode(monkeypatch, features, options, drafts, forced: int = 0) -> tuple[list, list[int]]:
    """decode_batch with each row's draft (its first `forced` tokens given) -> its results and
    the decoder calls it made."""
    b = bundle()
    calls = []
    hidden = b.model.decoder.hidden
    monkeypatch.setattr(b.model.decoder, "hidden", lambda *a, **k: calls.append(1) or hidden(*a, **k))
    results = decode_batch(b.model, b.tokenizer, features,
                           [DecodingOptions(prompt=o.prompt, audio_seconds=o.audio_seconds, draft=d,
                                            forced=forced)
                            for o, d in zip(options, drafts, strict=True)], b.suppress)
    return results, calls


def test_draft_tokens_give_the_greedy_result_in_fewer_decoder_steps(monkeypatch):
    b = bundle()
    features, _, options = three_windows()
    plain = decode_batch(b.model, b.tokenizer, features, options, b.suppress)
    exact, wrong = plain[0].tokens, list(plain[1].tokens)
    wrong[6] = wrong[5]  # greedy disagrees at token 6: its keys go, the draft waits to resume
    drafts = [exact, wrong, exact[:12]]  # right, wrong in the middle, another window's tokens
    drafted, calls = drafted_decode(monkeypatch, features, options, drafts)
    for result, expected in zip(drafted, plain, strict=True):
        assert result.tokens == expected.tokens and result.stop == expected.stop
        assert abs(result.avg_logprob - expected.avg_logprob) < logprob_tolerance(b.model)
        assert abs(result.no_speech_prob - expected.no_speech_prob) < 1e-4
    longest = max(len(r.tokens) for r in plain)
    assert longest > 20
    # without drafts: one call per token of the longest row; row 1 needs len - 6 more steps
    assert len(calls) <= len(plain[1].tokens) - 6 + 2


def test_a_draft_whose_timestamps_are_off_is_realigned_and_still_saves_the_steps(monkeypatch):
    """The preview of new audio, moved into a longer window, has its segments a few positions
    off: greedy rejects the first such timestamp, the rest of the draft moves with it."""
    b = bundle()
    features, _, options = three_windows()
    plain = decode_batch(b.model, b.tokenizer, features, options, b.suppress)
    ts = b.tokenizer.timestamp_begin
    drafts = []
    for result in plain:
        stamps = [i for i, t in enumerate(result.tokens) if t >= ts]
        assert len(stamps) >= 2  # a start and an end timestamp at least
        cut = stamps[1]  # the first segment's end and all after it: 3 positions (60 ms) late
        drafts.append(result.tokens[:cut] + shift_timestamps(result.tokens[cut:], 3, ts))
    assert all(d != r.tokens for d, r in zip(drafts, plain, strict=True))
    drafted, calls = drafted_decode(monkeypatch, features, options, drafts)
    for result, expected in zip(drafted, plain, strict=True):
        assert result.tokens == expected.tokens and result.stop == expected.stop
        assert abs(result.avg_logprob - expected.avg_logprob) < logprob_tolerance(b.model)
    # the draft call, the call from the moved timestamp on, the one that finds eot
    assert len(calls) <= 3 < max(len(r.tokens) for r in plain)


def test_shift_timestamps_moves_only_timestamps_and_stops_outside_the_range():
    ts = 1000
    assert shift_timestamps([ts, 5, 6, ts + 10], 20, ts) == [ts + 20, 5, 6, ts + 30]
    assert shift_timestamps([ts + 2, 5, ts + 1495], 10, ts) == [ts + 12, 5]  # past 30.00 s
    assert shift_timestamps([ts + 2, 5, ts + 1], -2, ts) == [ts, 5]  # before 0.00 s
    assert resync_draft([ts + 4, 7, ts + 9], ts + 5, ts) == [7, ts + 10]  # a moved timestamp
    assert resync_draft([9, 7, 8], 7, ts) == [8]  # the draft had a token too many
    assert resync_draft([9, ts + 9, 7, 8], 7, ts) == [8]  # ... or a segment break
    assert resync_draft([9, 7, 8], 6, ts) is None  # out of step: wait
    assert resync_draft([9, 7, 8], 9, ts) == [7, 8]  # greedy inserted a token: in step again
    assert resync_draft([1, 2, 3, 4, 5], 5, ts) is None  # too far ahead to trust


def test_int8_layers_sum_exactly_on_every_cpu():
    """An int8 layer's sums are exact on every x86 CPU: its weights stay within +-64, so the
    16-bit pair sums of the AVX2 kernels (u8 x s8, no VNNI) cannot saturate. Inputs and
    weights at the extremes of their ranges, on a grid the quantizer keeps exactly: the
    output is the float product of the quantized weights, on CI hosts without VNNI too (with
    ONEDNN_MAX_CPU_ISA=AVX2, weights of +-127 gave 17.9 where 143.4 is right)."""
    from engine.model.whisper import INT8_WEIGHT_MAX, Int8Linear

    torch.manual_seed(0)
    weight = torch.full((48, 256), 0.5)  # each channel's largest: quantized to +-64
    weight[1::2] *= -1
    weight[:, ::5] = torch.rand(48, 52) * 0.5
    linear = torch.nn.Linear(256, 48).requires_grad_(False)
    linear.weight.copy_(weight)
    linear.bias.copy_(torch.linspace(-1, 1, 48))
    layer = Int8Linear(linear)
    step = 0.01
    x = torch.full((8, 256), 127 * step)  # u8 255 with the zero point at 128
    x[:, 0], x[1::2, 1:] = -128 * step, -128 * step  # the input's minimum: u8 0
    quantized_weight = layer.weight.double() * layer.scale[:, None]
    expected = x.double() @ quantized_weight.T + linear.bias.double()
    assert layer.weight.abs().max() == INT8_WEIGHT_MAX
    error = (layer(x).double() - expected).abs().max()
    assert error < 1e-3, float(error)


def test_the_encoder_runs_int8_by_default_where_the_cpu_has_no_native_bf16(monkeypatch):
    """The CPU decides the encoder's precision at load time: bf16 blocks where bf16 is
    native, int8 layers where it is not (faster there than float32 at the same WER); an
    explicit `int8` or `bf16=False` wins, and `bf16=False` alone is all float32."""
    from engine.model import loader

    def encoder(**kwargs) -> str:
        model = load_model(device="cpu", **kwargs)
        return loader.precision(model).split(" (")[0]

    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: False)
    assert encoder() == "encoder int8"
    assert encoder(int8=False) == encoder(bf16=False) == "encoder float32"
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: True)
    assert encoder() == "encoder bfloat16"
    assert encoder(int8=True) == "encoder int8"
    assert encoder(bf16=False) == "encoder float32"


def test_an_int8_encoder_is_close_to_float32_and_transcribes_the_same_words():
    """`int8=True` runs every linear layer of the encoder on int8 weights (torch's dynamic
    quantization, no AVX512 needed), the MLPs' second ones with their input's largest
    channels in float32: its output stays close to float32's, much closer than without those
    channels, and it reads the arctic clips with at most one word error more."""
    from engine.model.loader import precision
    from engine.model.transcribe import transcribe
    from engine.model.whisper import MLP_OUTLIERS, Int8Linear, Linear

    int8 = load_bundle(device="cpu", int8=True)
    assert int8.model.encoder_int8 and not exact_bundle().model.encoder_int8
    for block in int8.model.encoder.blocks:
        attn = block.attn
        layers = [attn.query, attn.key, attn.value, attn.out, block.mlp[0], block.mlp[2]]
        assert all(isinstance(layer, Int8Linear) for layer in layers)
        assert [layer.outliers for layer in layers] == [0, 0, 0, 0, 0, MLP_OUTLIERS]
    assert precision(int8.model).startswith("encoder int8 (")
    plain = load_bundle(device="cpu", bf16=False, int8=False).model  # no float32 channels
    for block in plain.encoder.blocks:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, Linear):
                    setattr(parent, name, Int8Linear(child))
    mel = window_mel("0880")
    with torch.inference_mode():
        exact, fast = exact_bundle().model.encoder(mel), int8.model.encoder(mel)
        error, error_plain = ((out - exact).norm() / exact.norm() for out in (fast, plain.encoder(mel)))
    cosine = torch.nn.functional.cosine_similarity(exact.flatten(), fast.flatten(), dim=0)
    assert cosine > 0.995, float(cosine)
    assert error < 0.8 * error_plain, (float(error), float(error_plain))
    errors = {"fp32": 0, "int8": 0}
    for clip in ARCTIC_IDS:
        path = librivox_path(clip)
        for name, model in (("fp32", exact_bundle()), ("int8", int8)):
            errors[name] += word_errors(transcripts()[path], transcribe(model, audio(path)).text)[0]
    assert errors["int8"] <= errors["fp32"] + 1, errors  # of the 71 words


def test_a_drafts_forced_tokens_are_taken_as_given_and_the_rest_read_after_them(monkeypatch):
    """A window that keeps a committed sentence as context reads its text as given (Whisper's
    prefix): the forced tokens open the result even where greedy reads the audio otherwise,
    at every temperature, weigh nothing in its score, and what follows is greedy's reading
    after them (verified as a draft, it is read back unchanged)."""
    b = bundle()
    features, _, options = three_windows()
    plain = decode_batch(b.model, b.tokenizer, features, options, b.suppress)
    ts = b.tokenizer.timestamp_begin
    row = plain[0].tokens
    k = 9  # its first timestamp and 8 text tokens
    texts = [i for i in range(k) if row[i] < ts]
    assert row[0] >= ts and len(texts) == 8 and k < len(row) - 3
    own = decode_batch(b.model, b.tokenizer, features[:1],
                       [replace(options[0], draft=row, forced=k)], b.suppress)[0]
    assert own.tokens == row  # greedy's own first segment: the same reading
    assert own.token_logprobs[:k] == [0.0] * k
    chosen = plain[0].token_logprobs[k:]
    assert abs(own.avg_logprob - sum(chosen) / (len(chosen) + 1)) < logprob_tolerance(b.model)
    other = list(row[:k])
    other[texts[1]] = other[texts[0]]  # a word greedy would not read there
    forced = decode_batch(b.model, b.tokenizer, features[:1],
                          [replace(options[0], draft=other, forced=k)], b.suppress)[0]
    verified = decode_batch(b.model, b.tokenizer, features[:1],
                            [replace(options[0], draft=other)], b.suppress)[0]
    assert forced.tokens[:k] == other and verified.tokens == row
    assert len(forced.tokens) > k + 3 and forced.stop == "eot"
    again, calls = drafted_decode(monkeypatch, features[:1], options[:1], [forced.tokens], forced=k)
    assert again[0].tokens == forced.tokens and len(calls) <= 2
    hot = decode_batch(b.model, b.tokenizer, features[:1],
                       [replace(options[0], draft=other, forced=k, temperature=0.6, seed=3)], b.suppress)[0]
    assert hot.tokens[:k] == other and len(hot.tokens) > k
    assert plain[0].given_logprob is None and abs(hot.given_logprob - forced.given_logprob) < 1e-4


def test_a_decode_tells_how_likely_the_given_texts_last_token_is_hearing_the_window():
    """The decoder's log-probability of the given text's last token, where it is fed, hearing
    the whole window (`given_logprob`): the token greedy read there is likely, another one
    unlikely; in a batch, each row's is its own, as alone (a row given nothing has none)."""
    b = bundle()
    features, _, options = three_windows()
    plain = decode_batch(b.model, b.tokenizer, features, options, b.suppress)
    row = plain[0].tokens
    k = 9
    last = max(i for i in range(k) if row[i] < b.tokenizer.eot)
    own = decode_batch(b.model, b.tokenizer, features[:1], [replace(options[0], draft=row, forced=k)],
                       b.suppress)[0]
    assert -1.0 < own.given_logprob <= 0.0
    assert abs(own.given_logprob - plain[0].token_logprobs[last]) < 0.05  # (greedy's is under the rules)
    other = list(row[:k])
    other[last] = next(t for t in row[:k] if t < b.tokenizer.eot)  # the first word, said again
    assert other[last] != row[last]
    odd = decode_batch(b.model, b.tokenizer, features[:1], [replace(options[0], draft=other, forced=k)],
                       b.suppress)[0]
    assert odd.given_logprob < own.given_logprob - 5
    both = decode_batch(b.model, b.tokenizer, features[:2],
                        [replace(options[0], draft=other, forced=k), options[1]], b.suppress)
    assert abs(both[0].given_logprob - odd.given_logprob) < 1e-2 and both[1].given_logprob is None
