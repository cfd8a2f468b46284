"""Whisper encoder-decoder in plain PyTorch.

Follows openai/whisper's model.py, with two changes that a serving engine needs:
- the kv-cache is explicit (a `DecoderCache` passed in and returned), no forward hooks;
- the encoder is split into a position-independent conv stem (`AudioEncoder.stem`, whose
  per-frame outputs the engine caches per audio item) and the transformer over a window
  (`AudioEncoder.transformer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Up to this many queries (decoding) cross-attention is two matmuls and a softmax: the CPU
# SDPA kernel is slower there (8 rows over 1500 keys: 2.2 vs 2.0 ms for one query, 14.1 vs
# 11.2 ms for 40 in fp32; 5x slower for one bf16 query).
FEW_QUERIES = 64
# bfloat16 logits are off by about 0.1 at most: the tokens within this of the best are the
# ones a float32 projection could rank first
BF16_LOGIT_MARGIN = 0.5
# Without native fp16 arithmetic torch's CPU float16 matmul costs about the same per row as a
# matrix-vector product, where float32's GEMM reads the projection once for all rows: past
# this many rows the float32 projection is the faster one (docs/performance.md)
FP16_MAX_ROWS = 6
# int8 weights stay within this (Int8Linear): exact sums on AVX2 as with VNNI
INT8_WEIGHT_MAX = 64
# the channels of the MLPs' hidden state (a GELU's output) computed in float32 per int8 call
MLP_OUTLIERS = 8

# int8 layers (Whisper.set_encoder_int8) run on oneDNN's kernels, which ONEDNN_MAX_CPU_ISA
# limits like the rest of oneDNN (docs/performance.md measures an AVX2 host that way). Set on
# import, before a worker process unpickles the layers (unpickling packs them for the engine).
if "onednn" in torch.backends.quantized.supported_engines:
    torch.backends.quantized.engine = "onednn"


@dataclass(frozen=True)
class ModelDimensions:
    n_mels: int  # 80
    n_audio_ctx: int  # 1500 encoder positions = 30 s
    n_audio_state: int  # 384 for tiny
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int  # 51864 English-only, 51865+ multilingual
    n_text_ctx: int  # 448
    n_text_state: int
    n_text_head: int
    n_text_layer: int


class LayerNorm(nn.LayerNorm):
    """Normalizes in float32 whatever the dtype of the input and of the weights."""

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).type(x.dtype)


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class Int8Linear(nn.Module):
    """A linear layer on int8 weights whose input is quantized per call to 8 bits: torch's
    dynamic quantization on oneDNN's kernels, which need AVX2 only.

    The weights are symmetric per output channel within +-64, not +-127: without VNNI, x86
    int8 kernels add pairs of u8 x s8 products in 16 bits (vpmaddubsw), where 255 * 64 * 2
    fits and 255 * 127 * 2 saturates. So the input keeps all 8 bits (no `reduce_range`) and
    every CPU computes the same sums. `outliers`: this many of the input's largest channels
    (per call) are computed in float32 and zeroed in the input, which the layer therefore
    consumes: one scale for the whole input leaves the other channels a few steps when a
    handful are far larger than the rest, as a GELU's output has (docs/evaluation.md).

    It holds plain tensors, shared with a worker process like the other weights, and packs
    them for the kernels on first use in the process that runs it (packed weights do not
    pickle)."""

    def __init__(self, linear: nn.Linear, outliers: int = 0):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / INT8_WEIGHT_MAX  # (out,)
        quantized = torch.round(weight / scale[:, None]).clamp(-INT8_WEIGHT_MAX, INT8_WEIGHT_MAX)
        self.register_buffer("weight", quantized.to(torch.int8))
        self.register_buffer("scale", scale.double())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.outliers = outliers
        # (in, out): the float32 rows of the outlier channels, gathered per call
        self.register_buffer("exact", weight.T.contiguous() if outliers else None)
        self.packed: Any = None

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None:
            zero = torch.zeros_like(self.scale, dtype=torch.long)
            weight = torch._make_per_channel_quantized_tensor(self.weight, self.scale, zero, 0)
            self.packed = torch.ops.quantized.linear_prepack(weight, self.bias)
        shape = x.shape
        x = x.float().reshape(-1, shape[-1])  # (rows, in)
        exact = None
        if self.outliers:
            channels = x.abs().amax(dim=0).topk(self.outliers).indices  # (outliers,)
            exact = x[:, channels] @ self.exact[channels]  # (rows, out)
            x.index_fill_(1, channels, 0.0)
        y = torch.ops.quantized.linear_dynamic(x, self.packed, False)
        if exact is not None:
            y += exact
        return y.reshape(*shape[:-1], -1)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "packed": None}


class Conv1d(nn.Conv1d):
    def _conv_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None,
                      padding: int | None = None) -> Tensor:
        """As nn.Conv1d in x's dtype; `padding` overrides the module's."""
        bias = None if bias is None else bias.to(x.dtype)
        if padding is None:
            return super()._conv_forward(x, weight.to(x.dtype), bias)
        return F.conv1d(x, weight.to(x.dtype), bias, self.stride, padding, self.dilation, self.groups)


def sinusoids(length: int, channels: int, max_timescale: float = 10000) -> Tensor:
    """Sinusoidal positional embeddings, as openai/whisper."""
    assert channels % 2 == 0
    log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


@dataclass
class LayerCache:
    """Keys and values of one decoder layer, split into heads: (batch, n_head, time, d_head),
    contiguous, so attention reads them as they are (no per-token copy)."""

    self_k: Tensor | None = None
    self_v: Tensor | None = None
    cross_k: Tensor | None = None
    cross_v: Tensor | None = None


@dataclass
class DecoderCache:
    """The explicit kv-cache of a decoding batch."""

    layers: list[LayerCache] = field(default_factory=list)
    num_tokens: int = 0  # tokens already in the self-attention cache (= next position)
    # Left-padded batches of prompts of different lengths: which cached keys are real tokens,
    # (B, num_tokens) bool, and each row's number of real tokens (its next position), (B,).
    key_mask: Tensor | None = None
    row_lengths: Tensor | None = None

    def select(self, rows: Tensor) -> None:
        """Keep only the given batch rows (for finished sequences or beam reordering); cross
        keys of batch 1 are every row's and stay."""
        for layer in self.layers:
            for name in ("self_k", "self_v", "cross_k", "cross_v"):
                value = getattr(layer, name)
                if value is not None and not (name.startswith("cross") and value.shape[0] == 1):
                    setattr(layer, name, value[rows])
        if self.key_mask is not None:
            self.key_mask = self.key_mask[rows]
        if self.row_lengths is not None:
            self.row_lengths = self.row_lengths[rows]

    def drop_keys(self, row: int, start: int, num_tokens: int) -> None:
        """Row `row` forgets its cached keys from index `start` on (draft tokens that greedy
        decoding rejected); `num_tokens` is its number of real tokens, its next position."""
        assert self.key_mask is not None and self.row_lengths is not None
        self.key_mask[row, start:] = False
        self.row_lengths[row] = num_tokens


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = Linear(n_state, n_state)
        self.key = Linear(n_state, n_state, bias=False)
        self.value = Linear(n_state, n_state)
        self.out = Linear(n_state, n_state)

    def heads(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (B, H, T, D/H), contiguous."""
        b, t, d = x.shape
        return x.view(b, t, self.n_head, d // self.n_head).transpose(1, 2).contiguous()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                mask: Tensor | None = None, qk: list[Tensor] | None = None) -> Tensor:
        """q: (B, Tq, D), k/v: (B, H, Tk, D/H) split by `heads` -> (B, Tq, D). Projections
        are done by the caller.

        `mask` (B, 1, Tq, Tk) bool, True where a query may attend, replaces the causal mask.
        `qk`: a list the scaled attention logits (B, H, Tq, Tk) are appended to (unmasked
        attention only; for word timing). Keys of batch 1 (with B > 1, unmasked) are shared
        by every row.
        """
        b, tq, d = q.shape
        if k.shape[0] == 1 < b and not causal and mask is None and qk is None:
            # keys shared by every row (a window's beams): the rows' queries as one row's, so
            # the keys are read once, not copied per row
            return self.forward(q.reshape(1, b * tq, d), k, v).view(b, tq, d)
        h = self.n_head
        q = q.view(b, tq, h, d // h).transpose(1, 2)  # (B, H, Tq, D/H)
        # causal with a cache: query i sits at position (Tk - Tq + i) and may see keys <= it
        if mask is None and causal and tq > 1:
            tk = k.shape[2]
            mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        if mask is None and not causal and (tq <= FEW_QUERIES or qk is not None):
            w = (q * (d // h) ** -0.5) @ k.transpose(-1, -2)  # (B, H, Tq, Tk)
            if qk is not None:
                qk.append(w)
            out = w.float().softmax(-1).to(v.dtype) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(out.transpose(1, 2).reshape(b, tq, d))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, cross_attention: bool = False):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = LayerNorm(n_state)
        self.cross_attn = MultiHeadAttention(n_state, n_head) if cross_attention else None
        self.cross_attn_ln = LayerNorm(n_state) if cross_attention else None
        n_mlp = n_state * 4
        self.mlp = nn.Sequential(Linear(n_state, n_mlp), nn.GELU(), Linear(n_mlp, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def forward(self, x: Tensor, xa: Tensor | None = None, cache: LayerCache | None = None,
                mask: Tensor | None = None, qk: list[Tensor] | None = None) -> Tensor:
        """`qk`: a list the cross-attention logits (B, H, T, n_audio_ctx) are appended to."""
        attn = self.attn
        h = self.attn_ln(x)
        k, v = attn.heads(attn.key(h)), attn.heads(attn.value(h))  # (B, H, T, D/H)
        if cache is not None:
            if cache.self_k is not None:
                k = torch.cat([cache.self_k, k], dim=2)
                v = torch.cat([cache.self_v, v], dim=2)
            cache.self_k, cache.self_v = k, v
        x = x + attn(attn.query(h), k, v, causal=cache is not None or xa is not None, mask=mask)

        if self.cross_attn is not None:
            assert xa is not None or (cache is not None and cache.cross_k is not None)
            cross = self.cross_attn
            if cache is not None and cache.cross_k is not None:
                ck, cv = cache.cross_k, cache.cross_v
            else:
                ck, cv = cross.heads(cross.key(xa)), cross.heads(cross.value(xa))
                if cache is not None:
                    cache.cross_k, cache.cross_v = ck, cv
            x = x + cross(cross.query(self.cross_attn_ln(x)), ck, cv, qk=qk)

        return x + self.mlp(self.mlp_ln(x))


class AudioEncoder(nn.Module):
    def __init__(self, n_mels: int, n_ctx: int, n_state: int, n_head: int, n_layer: int):
        super().__init__()
        self.conv1 = Conv1d(n_mels, n_state, kernel_size=3, padding=1)
        self.conv2 = Conv1d(n_state, n_state, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(n_ctx, n_state))
        self.blocks = nn.ModuleList(ResidualAttentionBlock(n_state, n_head) for _ in range(n_layer))
        self.ln_post = LayerNorm(n_state)

    def stem(self, mel: Tensor, padding: int = 1) -> Tensor:
        """mel: (B, n_mels, T) -> (B, T // 2, n_state): the position-independent conv stem.

        padding=0 for mel that carries its own context instead of the zero padding at the
        edges: an audio item's (B, n_mels, 8m + 3) mel -> (B, 4m, n_state) (audio/frames.py).
        """
        x = F.gelu(self.conv1._conv_forward(mel, self.conv1.weight, self.conv1.bias, padding))
        x = F.gelu(self.conv2._conv_forward(x, self.conv2.weight, self.conv2.bias, padding))
        return x.permute(0, 2, 1)

    def transformer(self, x: Tensor) -> Tensor:
        """x: (B, T, n_state) stem output of a window starting at position 0 -> (B, T, n_state).

        The blocks run in their own dtype (bf16 after `Whisper.set_encoder_dtype`); the
        output has the dtype of `x`.
        """
        dtype = x.dtype
        x = (x + self.positional_embedding[: x.shape[1]]).to(self.blocks[0].mlp_ln.weight.dtype)
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x).to(dtype)

    def forward(self, mel: Tensor) -> Tensor:
        """mel: (B, n_mels, 2 * n_ctx) -> (B, n_ctx, n_state)."""
        return self.transformer(self.stem(mel))


class TextDecoder(nn.Module):
    def __init__(self, n_vocab: int, n_ctx: int, n_state: int, n_head: int, n_layer: int):
        super().__init__()
        self.token_embedding = nn.Embedding(n_vocab, n_state)
        self.positional_embedding = nn.Parameter(torch.empty(n_ctx, n_state))
        self.blocks = nn.ModuleList(
            ResidualAttentionBlock(n_state, n_head, cross_attention=True) for _ in range(n_layer)
        )
        self.ln = LayerNorm(n_state)
        # A copy of the tied output projection in a cheaper dtype (see `set_projection_dtype`).
        self.projection: Tensor | None = None

    def new_cache(self, cross: list[tuple[Tensor, Tensor]] | None = None) -> DecoderCache:
        """`cross`: the cross-attention keys and values (`cross_kv`) if already computed."""
        if cross is None:
            return DecoderCache(layers=[LayerCache() for _ in self.blocks])
        return DecoderCache(layers=[LayerCache(cross_k=k, cross_v=v) for k, v in cross])

    def cross_kv(self, xa: Tensor) -> list[tuple[Tensor, Tensor]]:
        """xa: (B, n_audio_ctx, n_audio_state) -> per layer the cross-attention keys and values,
        each (B, n_head, n_audio_ctx, d_head): computed once for a step's decode and alignment."""
        return [(b.cross_attn.heads(b.cross_attn.key(xa)), b.cross_attn.heads(b.cross_attn.value(xa)))
                for b in self.blocks]

    @staticmethod
    def _row_positions(tokens: Tensor, cache: DecoderCache | None,
                       valid: Tensor | None) -> tuple[Tensor, Tensor]:
        """Per-row positions (B, T) and the attention mask (B, 1, T, keys) of a padded batch."""
        b, n = tokens.shape
        if valid is None:
            valid = torch.ones(b, n, dtype=torch.bool, device=tokens.device)
        before = 0
        if cache is not None and cache.row_lengths is not None:
            before = cache.row_lengths[:, None]  # (B, 1)
        positions = (before + valid.cumsum(-1) - 1).clamp(min=0)  # (B, T); padding -> 0
        keys = valid
        if cache is not None:
            if cache.key_mask is not None:
                keys = torch.cat([cache.key_mask, valid], dim=1)
            cache.key_mask = keys
            cache.row_lengths = positions[:, -1] + valid[:, -1].long()
        num_keys = keys.shape[1]
        causal = torch.ones(n, num_keys, dtype=torch.bool, device=tokens.device).tril(num_keys - n)
        mask = causal & keys[:, None, :]  # (B, T, keys)
        # a padding query sees only itself, so no row of the softmax is empty (NaN)
        mask[:, torch.arange(n), torch.arange(num_keys - n, num_keys)] = True
        return positions, mask[:, None]

    def forward(self, tokens: Tensor, xa: Tensor | None, cache: DecoderCache | None = None,
                valid: Tensor | None = None, num_logits: int | None = None) -> Tensor:
        """tokens: (B, T) new tokens; xa: (B, n_audio_ctx, n_audio_state) -> logits
        (B, num_logits or T, vocab) of the last `num_logits` positions (default: all)."""
        x = self.hidden(tokens, xa, cache, valid)
        if num_logits is not None:
            x = x[:, x.shape[1] - num_logits :]  # the projection is the costly part: skip the prompt
        return self.logits(x)

    def hidden(self, tokens: Tensor, xa: Tensor | None, cache: DecoderCache | None = None,
               valid: Tensor | None = None) -> Tensor:
        """tokens: (B, T) new tokens -> (B, T, n_text_state) normalized final states.

        With a cache, `xa` is only read on the first call (cross keys/values are kept).
        `valid` (B, T) bool marks real tokens in a padded call: each row's tokens then take
        the row's next positions (0, 1, ... on the first call) and nothing attends to the
        padding.
        """
        offset = cache.num_tokens if cache is not None else 0
        n = tokens.shape[-1]
        mask = None
        if valid is not None or (cache is not None and cache.row_lengths is not None):
            positions, mask = self._row_positions(tokens, cache, valid)
            x = self.token_embedding(tokens) + self.positional_embedding[positions]
        else:
            x = self.token_embedding(tokens) + self.positional_embedding[offset : offset + n]
        if xa is not None:
            x = x.to(xa.dtype)
        for i, block in enumerate(self.blocks):
            x = block(x, xa, cache.layers[i] if cache is not None else None, mask)
        if cache is not None:
            cache.num_tokens += n
        return self.ln(x)

    def cross_attention(self, tokens: Tensor, cross: list[tuple[Tensor, Tensor]],
                        heads: list[tuple[int, int]]) -> Tensor:
        """tokens: (B, T) whole sequences; cross: `cross_kv` of their audio -> the scaled
        cross-attention logits of the given (layer, head) pairs, (B, len(heads), T, n_audio_ctx).
        Runs the blocks up to the last layer named (causal self-attention)."""
        cache = self.new_cache(cross)
        x = self.token_embedding(tokens) + self.positional_embedding[: tokens.shape[1]]
        x = x.to(cross[0][0].dtype)
        wanted: dict[int, list[int]] = {}
        for layer, head in heads:
            wanted.setdefault(layer, []).append(head)
        kept: dict[int, Tensor] = {}
        for i, block in enumerate(self.blocks[: max(wanted) + 1]):
            qk: list[Tensor] = []
            x = block(x, None, cache.layers[i], None, qk)
            if i in wanted:
                kept[i] = qk[0][:, wanted[i]]  # only these heads: the rest is large and unused
        return torch.cat([kept[layer][:, [wanted[layer].index(head)]] for layer, head in heads], dim=1)

    def logits(self, x: Tensor, text_tokens: int | None = None,
               timestamp_begin: int | None = None) -> Tensor:
        """(..., n_text_state) final states -> (..., vocab) float32 logits. `text_tokens`: how
        many of the vocabulary's first tokens are text (up to and with end-of-text);
        `timestamp_begin`: the first timestamp token (the rest of the vocabulary).

        With a bfloat16 projection, the logits that decide are computed again in float32:
        bfloat16 keeps 8 bits (steps of 0.125 at 20), enough to find the text tokens near the
        best but not to choose among them, nor to weigh text against the timestamps (whose
        logits are all recomputed). Rounded logits sent a 2.5-minute file astray."""
        weight = self.projection if self.projection is not None else self.token_embedding.weight
        rows = x.numel() // x.shape[-1]
        if weight.dtype == torch.float16 and x.device.type == "cpu" and rows > FP16_MAX_ROWS:
            weight = self.token_embedding.weight
        rough = x.to(weight.dtype) @ weight.T
        logits = rough.float()
        if weight.dtype != torch.bfloat16 or text_tokens is None or timestamp_begin is None:
            return logits
        exact = self.token_embedding.weight  # (vocab, d) float32
        shape = logits.shape
        x, logits = x.reshape(-1, x.shape[-1]).to(exact.dtype), logits.reshape(-1, shape[-1])
        logits[:, timestamp_begin:] = x @ exact[timestamp_begin:].T
        text = rough.reshape(-1, shape[-1])[:, :text_tokens]
        rows, cols = (text >= text.amax(-1, keepdim=True) - BF16_LOGIT_MARGIN).nonzero(as_tuple=True)
        logits[rows, cols] = (x[rows] * exact[cols]).sum(-1)
        return logits.reshape(shape)


class Whisper(nn.Module):
    def __init__(self, dims: ModelDimensions):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(
            dims.n_mels, dims.n_audio_ctx, dims.n_audio_state, dims.n_audio_head, dims.n_audio_layer
        )
        self.decoder = TextDecoder(
            dims.n_vocab, dims.n_text_ctx, dims.n_text_state, dims.n_text_head, dims.n_text_layer
        )

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv1.weight.dtype

    @property
    def is_multilingual(self) -> bool:
        return self.dims.n_vocab >= 51865

    def set_projection_dtype(self, dtype: torch.dtype | None) -> None:
        """Use a copy of the tied output projection in `dtype` (None: the embedding itself).

        On the CPU the 51864 x n_state projection dominates the per-token cost; a 16-bit copy
        halves the bytes read per token.
        """
        weight = self.decoder.token_embedding.weight
        self.decoder.projection = None if dtype is None else weight.detach().to(dtype)

    def set_encoder_dtype(self, dtype: torch.dtype) -> None:
        """Run the encoder's transformer blocks in `dtype` (the conv stem, the final layer
        norm and everything the decoder reads stay in the model dtype). Converts the block
        weights in place: going back to float32 does not restore the lost bits."""
        self.encoder.blocks.to(dtype)

    def set_encoder_int8(self) -> None:
        """Run the linear layers of the encoder's transformer blocks on int8 weights
        (`Int8Linear`); attention products, layer norms and the rest stay float32. Replaces
        the layers in place.

        The second MLP layer's input, a GELU's output, has a few channels far larger than the
        rest (hundreds, where most stay under ten): those layers compute their
        `MLP_OUTLIERS` largest channels in float32 (docs/evaluation.md, The int8 encoder).
        """
        for block in self.encoder.blocks:
            for parent in (block.attn, block.mlp):
                for name, child in list(parent.named_children()):
                    if isinstance(child, Linear):
                        outliers = MLP_OUTLIERS if child is block.mlp[2] else 0
                        setattr(parent, name, Int8Linear(child, outliers))

    @property
    def encoder_int8(self) -> bool:
        return isinstance(self.encoder.blocks[0].mlp[0], Int8Linear)

    def forward(self, mel: Tensor, tokens: Tensor) -> Tensor:
        return self.decoder(tokens, self.encoder(mel))
