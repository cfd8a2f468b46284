"""Streaming ingest: resampling a PCM stream chunk by chunk to 16 kHz, with no seams.

Resampling each network frame on its own would zero-pad both of its ends and click at every
frame boundary. StreamResampler works in blocks of `orig` input samples -> `new` output
samples and keeps whole blocks of context on each side, so its output equals resampling the
whole stream at once. It holds back the last block and its right context (at most 40 ms, at
22.05 and 44.1 kHz; 1 ms at 24 and 48 kHz) until the samples after them arrive.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torchaudio.functional as AF

from audio.io import SAMPLE_RATE, check_stream_rate

LOWPASS_FILTER_WIDTH = 6  # torchaudio's default
ROLLOFF = 0.99  # torchaudio's default


class StreamResampler:
    """Push (n,) float32 chunks at `rate`; get 16 kHz chunks equal to whole-signal resampling."""

    def __init__(self, rate: int):
        self.rate = check_stream_rate(rate)
        g = math.gcd(rate, SAMPLE_RATE)
        self.orig, self.new = rate // g, SAMPLE_RATE // g  # one block: orig in -> new out
        # an output block reads `width` input samples each side of its input block
        width = math.ceil(LOWPASS_FILTER_WIDTH * self.orig / (min(self.orig, self.new) * ROLLOFF))
        self.context = math.ceil(width / self.orig) * self.orig  # whole blocks of context
        self.buffer = np.zeros(self.context, dtype=np.float32)  # silence before the start
        self.buffer_start = -self.context  # absolute input index of buffer[0]
        self.num_input = 0  # samples pushed
        self.num_blocks = 0  # input blocks already resampled
        self.num_output = 0  # samples returned

    def push(self, samples: np.ndarray) -> np.ndarray:
        """(n,) float32 at `rate` -> the 16 kHz samples now complete."""
        if self.orig == self.new:
            self.num_input += samples.size
            self.num_output += samples.size
            return samples
        if samples.size:
            self.buffer = np.concatenate([self.buffer, samples.astype(np.float32, copy=False)])
            self.num_input += samples.size
        return self._emit((self.num_input - self.context) // self.orig)

    def flush(self) -> np.ndarray:
        """End of the stream: the remaining output, as if the input ended with silence."""
        if self.orig == self.new:
            return np.zeros(0, dtype=np.float32)
        num_blocks = -(-self.num_input // self.orig)
        pad = num_blocks * self.orig + self.context - (self.buffer_start + self.buffer.size)
        self.buffer = np.concatenate([self.buffer, np.zeros(max(pad, 0), dtype=np.float32)])
        out = self._emit(num_blocks)
        total = -(-self.new * self.num_input // self.orig)  # ceil, as torchaudio's length
        keep = out.size - (self.num_output - total)
        self.num_output = total
        return out[:keep]

    def _emit(self, last_block: int) -> np.ndarray:
        num = last_block - self.num_blocks
        if num <= 0:
            return np.zeros(0, dtype=np.float32)
        lo = self.num_blocks * self.orig - self.context - self.buffer_start
        hi = last_block * self.orig + self.context - self.buffer_start
        segment = torch.from_numpy(self.buffer[lo:hi])
        out = AF.resample(segment, self.orig, self.new)  # torchaudio pads the ends with zeros
        skip = self.context // self.orig * self.new  # the output of the left context
        out = out[skip : skip + num * self.new].numpy()
        self.num_blocks = last_block
        self.num_output += out.size
        drop = self.num_blocks * self.orig - self.context - self.buffer_start
        self.buffer = self.buffer[drop:]
        self.buffer_start += drop
        return out
