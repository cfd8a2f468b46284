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


def dtw(costs: list[Tensor]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per cost matrix (N, M) -> (rows, cols): the path from (0, 0) to (N-1, M-1) of least
    total cost whose steps go one row down, one column right, or both. All matrices in one
    pass on their device, padded to the largest (a cell's total depends only on the cells
    above and to its left, so padding below and to the right changes nothing).

    Row by row: total[i, j] = cost[i, j] + min(best[j], total[i, j-1]), with best[j] the
    cheaper of the diagonal and vertical moves. Unrolled, total[i, j] = S[j] + the running
    minimum over k <= j of (best[k] - S[k-1]), S the prefix sums of the row's cost: one
    cumulative minimum per row instead of a loop over columns.
    """
    n, m = max(c.shape[0] for c in costs), max(c.shape[1] for c in costs)
    cost = costs[0].new_zeros(len(costs), n, m, dtype=torch.float64)  # (B, N, M)
    for b, c in enumerate(costs):
        cost[b, : c.shape[0], : c.shape[1]] = c
    total = torch.full((len(costs), n + 1, m + 1), torch.inf, dtype=torch.float64, device=cost.device)
    total[:, 0, 0] = 0.0
    trace = torch.zeros(len(costs), n + 1, m + 1, dtype=torch.int8, device=cost.device)
    prefix = F.pad(cost.cumsum(dim=-1), (1, 0))  # (B, N, M + 1)
    for i in range(1, n + 1):  # 0: diagonal, 1: from above, 2: from the left
        diagonal, above = total[:, i - 1, :-1], total[:, i - 1, 1:]  # (B, M) for columns 1..M
        best = torch.minimum(diagonal, above)
        own = best - prefix[:, i - 1, :-1]
        run = own.cummin(dim=-1).values
        total[:, i, 1:] = prefix[:, i - 1, 1:] + run
        trace[:, i, 1:] = torch.where(own > run, 2, (diagonal > above).to(torch.int8))
    traces = trace.cpu().numpy()
    return [_backtrack(traces[b, : c.shape[0] + 1, : c.shape[1] + 1]) for b, c in enumerate(costs)]


def _backtrack(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N + 1, M + 1) moves -> the path (rows, cols) ending at (N-1, M-1), a row at a time:
    in row i the path goes left to the last column not reached from the left."""
    n, m = trace.shape[0] - 1, trace.shape[1] - 1
    columns = np.arange(m + 1)
    entry = np.maximum.accumulate(np.where(trace != 2, columns, 0), axis=1)  # (N + 1, M + 1)
    rows, cols = [], []
    i, j = n, m
    while i > 0 and j > 0:
        first = int(entry[i, j])
        low = max(first, 1)
        cols.append(np.arange(j - 1, low - 2, -1))
        rows.append(np.full(j - low + 1, i - 1))
        if first == 0:  # left all the way to column 0: no cell before it
            break
        i, j = (i - 1, first - 1) if trace[i, first] == 0 else (i - 1, first)
    return np.concatenate(rows)[::-1], np.concatenate(cols)[::-1]


def median_filter(x: Tensor, width: int) -> Tensor:
    """x: (H, T, P) -> the running median of `width` (odd) along P, edges reflected."""
    half = width // 2
    if x.shape[-1] <= half:
        return x
    padded = F.pad(x, (half, half), mode="reflect")
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., half]


def token_cost(logits: Tensor, num_text: int) -> Tensor:
    """logits: (heads, T, P) cross-attention logits of the alignment heads over a forced
    sequence [sot..., no_timestamps, text (num_text), eot] and the window's P positions ->
    (num_text + 1, P) the cost of each text token (and the text's end) at each position:
    the path of least cost through it (`dtw`) gives where each starts.

    The rows that predict the text tokens (from no_timestamps to the last text token) are
    kept; each head's weights are standardized over the tokens (a head's overall liking for
    a position is not timing), the heads averaged, and the average smoothed over time (one
    filter, not one per head as openai/whisper: a tenth of the cost, the same onsets on the
    evaluation corpus)."""
    first = logits.shape[1] - num_text - 2  # the no_timestamps row
    weights = logits.float().softmax(dim=-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = ((weights - mean) / std.clamp_min(1e-8))[:, first : first + num_text + 1]
    return -median_filter(weights.mean(dim=0, keepdim=True), MEDIAN_FILTER_WIDTH)[0]  # (N + 1, P)


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
    costs = [token_cost(logits[b, :, : len(row), : num_positions[b]], len(texts[b]))
             for b, row in enumerate(rows)]
    return [cols[np.searchsorted(path_rows, np.arange(len(text) + 1))].astype(np.float64)
            for (path_rows, cols), text in zip(dtw(costs), texts, strict=True)]
