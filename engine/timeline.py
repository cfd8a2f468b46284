"""Units of a session's timeline and the conversions between them. Torch-free.

- samples: 16 kHz audio samples, as the engine receives them;
- positions: encoder positions, 20 ms each (two 10 ms mel frames); a timestamp token is one;
- items: the audio items of the timeline, `ITEM_SAMPLES` (80 ms, 4 positions) by default;
- ms: session time in integer milliseconds, what clients see.

Conversions to ms and positions round down, so a time never points past the audio it names.
"""

from __future__ import annotations

SAMPLE_RATE = 16000  # Whisper's input rate (audio.io.SAMPLE_RATE)
SAMPLES_PER_POSITION = 320  # 20 ms
POSITIONS_PER_SECOND = SAMPLE_RATE // SAMPLES_PER_POSITION  # 50
TIME_PRECISION = 1 / POSITIONS_PER_SECOND  # 0.02 s: seconds per timestamp token
MAX_WINDOW_POSITIONS = 30 * POSITIONS_PER_SECOND  # 1500: Whisper's 30 s window


def ms_to_positions(ms: int) -> int:
    return ms * POSITIONS_PER_SECOND // 1000


def positions_to_ms(positions: int) -> int:
    return positions * 1000 // POSITIONS_PER_SECOND


def positions_to_seconds(positions: int) -> float:
    return positions / POSITIONS_PER_SECOND


def seconds_to_positions(seconds: float) -> int:
    return int(seconds * POSITIONS_PER_SECOND)


def seconds_to_ms(seconds: float) -> int:
    return round(seconds * 1000)


def samples_to_ms(samples: int, rate: int = SAMPLE_RATE) -> int:
    return samples * 1000 // rate


def ms_to_samples(ms: int, rate: int = SAMPLE_RATE) -> int:
    return ms * rate // 1000


def samples_to_seconds(samples: int, rate: int = SAMPLE_RATE) -> float:
    return samples / rate


def positions_to_samples(positions: int) -> int:
    return positions * SAMPLES_PER_POSITION


def item_positions(item_samples: int) -> int:
    """Positions one audio item covers (4 for 80 ms)."""
    if item_samples % SAMPLES_PER_POSITION:
        raise ValueError(f"item_samples must be a multiple of {SAMPLES_PER_POSITION} (20 ms), "
                         f"got {item_samples}")
    return item_samples // SAMPLES_PER_POSITION
