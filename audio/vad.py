"""Energy voice-activity detection for turn detection (OpenAI Realtime `server_vad`).

Frames of 20 ms at 16 kHz are speech when their RMS level is above a threshold. Speech
starts at the first speech frame; it stops once `silence_ms` of non-speech follow it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FRAME_SAMPLES = 320  # 20 ms at 16 kHz


def level_db(samples: np.ndarray, axis: int | None = None) -> np.ndarray | float:
    """RMS level in dBFS of float samples (over `axis`, or all of them)."""
    power = np.mean(np.square(samples, dtype=np.float64), axis=axis)
    return 10.0 * np.log10(power + 1e-12)


def threshold_db(threshold: float) -> float:
    """OpenAI's `threshold` (0..1, default 0.5) -> an RMS level in dBFS (0.5 -> -45 dB)."""
    return -70.0 + 50.0 * min(max(threshold, 0.0), 1.0)


@dataclass
class VadEvent:
    kind: str  # "speech_started" or "speech_stopped"
    ms: int  # stream time of the event


class EnergyVad:
    def __init__(self, threshold: float = 0.5, silence_ms: int = 500):
        self.level_db = threshold_db(threshold)
        self.silence_frames = max(1, silence_ms // 20)
        self.pending = np.zeros(0, dtype=np.float32)
        self.num_frames = 0  # frames analysed
        self.in_speech = False
        self.quiet_frames = 0  # non-speech frames since the last speech frame

    def push(self, samples: np.ndarray) -> list[VadEvent]:
        """(n,) float32 16 kHz samples -> speech start/stop events they complete."""
        data = np.concatenate([self.pending, samples.astype(np.float32, copy=False)])
        n = data.size // FRAME_SAMPLES
        self.pending = data[n * FRAME_SAMPLES :]
        if n == 0:
            return []
        level = level_db(data[: n * FRAME_SAMPLES].reshape(n, FRAME_SAMPLES), axis=1)  # (n,) dBFS
        events = []
        for is_speech in level > self.level_db:
            if is_speech:
                if not self.in_speech:
                    self.in_speech = True
                    events.append(VadEvent("speech_started", self.num_frames * 20))
                self.quiet_frames = 0
            elif self.in_speech:
                self.quiet_frames += 1
                if self.quiet_frames >= self.silence_frames:
                    self.in_speech = False
                    end = (self.num_frames - self.quiet_frames + 1) * 20
                    events.append(VadEvent("speech_stopped", end))
            self.num_frames += 1
        return events
