"""Token times from the audio: dynamic time warping over cross-attention.

Some of the decoder's cross-attention heads follow the audio as the text goes on (the
alignment heads, published with each checkpoint). With the decoded text forced through the
decoder, their attention forms a (tokens, encoder positions) map; the monotonic path of most
attention through it gives each token the position where it starts. This is the method of
openai/whisper's timing.py, batched over the windows of a step.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.model.tokenizer import Tokenizer
from engine.model.whisper import Whisper

MEDIAN_FILTER_WIDTH = 7  # positions: smooths the attention along time before the path search


def default_heads(n_layer: int, n_head: int) -> list[tuple[int, int]]:
    """Every head of the upper half of the decoder: openai/whisper's choice where a
    checkpoint names no alignment heads."""
    return [(layer, head) for layer in range(n_layer // 2, n_layer) for head in range(n_head)]


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cost: (N, M) -> (rows, cols): the path from (0, 0) to (N-1, M-1) of least total cost
    whose steps go one row down, one column right, or both.

    Row by row: total[i, j] = cost[i, j] + min(best[j], total[i, j-1]), with best[j] the
    cheaper of the diagonal and vertical moves. Unrolled, total[i, j] = S[j] + the running
    minimum over k <= j of (best[k] - S[k-1]), S the prefix sums of the row's cost: one
    cumulative minimum per row instead of a loop over columns.
    """
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    total[0, 0] = 0.0
    trace = np.zeros((n + 1, m + 1), np.int8)  # 0: diagonal, 1: from above, 2: from the left
    for i in range(1, n + 1):
        diagonal, above = total[i - 1, :-1], total[i - 1, 1:]  # (M,) for columns 1..M
        best = np.minimum(diagonal, above)
        prefix = np.concatenate(([0.0], np.cumsum(cost[i - 1], dtype=np.float64)))  # (M + 1,)
        own = best - prefix[:-1]
        run = np.minimum.accumulate(own)
        total[i, 1:] = prefix[1:] + run
        trace[i, 1:] = np.where(own > run, 2, np.where(diagonal <= above, 0, 1))
    rows, cols = [], []
    i, j = n, m
    while i > 0 and j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        move = trace[i, j]
        i, j = (i - 1, j - 1) if move == 0 else (i - 1, j) if move == 1 else (i, j - 1)
    return np.array(rows[::-1]), np.array(cols[::-1])


def median_filter(x: Tensor, width: int) -> Tensor:
    """x: (H, T, P) -> the running median of `width` (odd) along P, edges reflected."""
    half = width // 2
    if x.shape[-1] <= half:
        return x
    padded = F.pad(x, (half, half), mode="reflect")
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., half]


def token_starts(logits: Tensor, num_text: int) -> np.ndarray:
    """logits: (heads, T, P) cross-attention logits of the alignment heads over a forced
    sequence [sot..., no_timestamps, text (num_text), eot] and the window's P positions ->
    (num_text + 1,) the position where each text token starts, and last where the text ends.

    The rows that predict the text tokens (from no_timestamps to the last text token) are
    kept; each head's weights are standardized over the tokens (a head's overall liking for
    a position is not timing), the heads averaged, and the average smoothed over time (one
    filter, not one per head as openai/whisper: a tenth of the cost, the same onsets on the
    evaluation corpus)."""
    first = logits.shape[1] - num_text - 2  # the no_timestamps row
    weights = logits.float().softmax(dim=-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = ((weights - mean) / std.clamp_min(1e-8))[:, first : first + num_text + 1]
    matrix = median_filter(weights.mean(dim=0, keepdim=True), MEDIAN_FILTER_WIDTH)[0]  # (N + 1, P)
    rows, cols = dtw(-matrix.double().cpu().numpy())
    return cols[np.searchsorted(rows, np.arange(num_text + 1))].astype(np.float64)


@torch.inference_mode()
def align(model: Whisper, tokenizer: Tokenizer, heads: list[tuple[int, int]],
          cross: list[tuple[Tensor, Tensor]], texts: list[list[int]],
          num_positions: list[int]) -> list[np.ndarray]:
    """cross: the decoder's cross-attention keys and values of B windows (`cross_kv`, as
    decoding used them); per window its decoded text tokens (no timestamps) and its number of
    real positions -> per window (len(text) + 1,) the encoder position (from the window's
    start) where each text token starts, and last where its text ends. One decoder pass over
    all windows (right-padded: causal attention keeps the padding out of the real rows)."""
    prefix = [*tokenizer.sot_sequence(), tokenizer.no_timestamps]
    rows = [prefix + text + [tokenizer.eot] for text in texts]
    width = max(len(row) for row in rows)
    tokens = torch.full((len(rows), width), tokenizer.eot, dtype=torch.long)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(row)
    logits = model.decoder.cross_attention(tokens.to(cross[0][0].device), cross, heads)
    return [token_starts(logits[b, :, : len(row), : num_positions[b]], len(texts[b]))
            for b, row in enumerate(rows)]
