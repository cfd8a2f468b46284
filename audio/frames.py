"""Cutting a session's PCM stream into fixed audio items with the context their features need.

An item of 1280 samples (80 ms) maps to 8 mel frames and 4 encoder positions. Its conv-stem
output depends on mel frames 8k-2 .. 8k+8, i.e. on samples [1280k - 520, 1280k + 1480): 520
samples of look-back and 200 of look-ahead. With that context, the per-item computation
equals the computation over a whole window.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from audio.mel import DYNAMIC_RANGE, HOP_LENGTH, N_FFT, log_mel_power, loudest_levels, normalize_log_mel
from audio.vad import item_speech

ITEM_SAMPLES = 1280  # 80 ms
CONTEXT_BEFORE = 2 * HOP_LENGTH + N_FFT // 2  # 520: two mel frames + half an FFT window
CONTEXT_AFTER = N_FFT // 2  # 200: half an FFT window past the last mel frame
STREAM_LOG_FLOOR = -7.0  # a usual level's clamp floor (log10 power): the padding of a window with no item
LOWEST_LOG_FLOOR = -11.0  # the streaming clamp floor's lower bound; see below
FLOOR_STEP = 0.25  # floors are rounded to this: few distinct item hashes
PAUSE_ITEMS = 4  # 320 ms without speech end an utterance (see LogFloor)
UTTERANCE_MARGIN = 1.0  # 10 dB (log10 power): an utterance this much under the session's loudest
# log10 mel power, speech's loudest level: at a usual level (-23 dBFS RMS), and 10 dB under it
USUAL_LEVEL = 1.0
QUIET_LEVEL = 0.0  # speech under this is brought up to it; speech over it is left as it came
FAINT_LEVEL = -0.5  # speech under this (15 dB under a usual level) is brought up to USUAL_LEVEL
MAX_GAIN = 3.6  # 36 dB (log10 power): the most quiet speech is brought up
GAIN_ATTACK = 0.25  # 2.5 dB: the most the gain rises from one item to the next
GAIN_HOLD_ITEMS = 6  # 480 ms: an utterance's speech before the gain may rise


class AudioFramer:
    """Accumulates PCM and emits (items, context) once each item's look-ahead has arrived."""

    def __init__(self, item_samples: int = ITEM_SAMPLES):
        if item_samples % (2 * HOP_LENGTH):
            raise ValueError(f"item_samples must be a multiple of {2 * HOP_LENGTH} (20 ms)")
        self.item_samples = item_samples
        self.context = item_samples + CONTEXT_BEFORE + CONTEXT_AFTER
        self.buffer = np.zeros(CONTEXT_BEFORE, dtype=np.float32)  # silence before the start
        self.buffer_start = -CONTEXT_BEFORE  # absolute sample index of buffer[0]
        self.num_samples = 0  # samples on the timeline: received + padding
        self.num_items = 0  # items emitted
        self.num_padded = 0  # silence samples flush() inserted to complete items

    def push(self, samples: np.ndarray) -> list[np.ndarray]:
        """Add (n,) float32 samples -> contexts (self.context,) of the items now complete."""
        if samples.size:
            self.buffer = np.concatenate([self.buffer, samples.astype(np.float32, copy=False)])
            self.num_samples += samples.size
        return self._emit(self.num_samples)

    def flush(self) -> list[np.ndarray]:
        """Emit every pending item now, padding the last partial one with silence.

        The padding becomes part of the timeline (`num_padded` counts it), so audio pushed
        afterwards continues after it and items stay aligned.
        """
        remainder = -self.num_samples % self.item_samples
        end = self.num_samples + remainder
        need = end + CONTEXT_AFTER - (self.buffer_start + self.buffer.size)
        if need > 0:
            self.buffer = np.concatenate([self.buffer, np.zeros(need, dtype=np.float32)])
        out = self._emit(end, final=True)
        self.buffer = self.buffer[: end - self.buffer_start]  # later audio starts at `end`
        self.num_samples = end
        self.num_padded += remainder
        return out

    def _emit(self, available: int, final: bool = False) -> list[np.ndarray]:
        out = []
        while True:
            start = self.num_items * self.item_samples
            end = start + self.item_samples
            if end > available or (not final and end + CONTEXT_AFTER > available):
                break
            lo = start - CONTEXT_BEFORE - self.buffer_start
            out.append(self.buffer[lo : lo + self.context].copy())
            self.num_items += 1
        drop = self.num_items * self.item_samples - CONTEXT_BEFORE - self.buffer_start
        if drop > 0:
            self.buffer = self.buffer[drop:]
            self.buffer_start += drop
        return out


class LogFloor:
    """A session's log-mel gain and clamp floor, item by item.

    Whisper reads quiet speech worse than the same speech at a usual level: its features
    are absolute log power, learned from speech at usual levels (docs/evaluation.md, Quiet
    speech brought up). So an item whose floor counts from a level under `FAINT_LEVEL` has
    its audio brought up by the gain that puts that level near `USUAL_LEVEL`, and one under
    `QUIET_LEVEL` (but not under `FAINT_LEVEL`) near `QUIET_LEVEL` (`gain`: never over it, at
    most `MAX_GAIN`, none before the first speech: noise alone is not brought up), and its
    floor is counted in that audio. Speech within 10 dB of the usual level is left as it came
    (brought up, a real recording 10 dB under the others read a word otherwise). The model
    reads a quiet microphone as a usual one; the VAD, the speech tracking and the levels read
    the audio as it came.

    Whisper clamps the log-mel at the loudest bin of its 30 s input minus 80 dB. Streaming
    counts from the loudest level speech could hold (`loudest_levels`: held 40 ms, over 75
    Hz; the item itself included): the session's so far, or, where the current utterance is
    more than `UTTERANCE_MARGIN` quieter, the utterance's (plus that margin). A voice far
    from the microphone after a near one, or after a loud tone, then keeps its own range
    (counted from the loudest sound of the session, the floor would clip its quiet bins
    away). A pause holds the last utterance's floor (silence is not drawn deeper than the
    speech around it). Silence before the session's first speech counts from at least
    `QUIET_LEVEL`, the quietest level speech is left at: counted from the silence itself, a
    file's leading digital silence showed 30 dB darker than Whisper shows silence beside
    speech, and the first window read otherwise (a long file's prompts carry it on). The
    floor is causal and each item's features depend on its samples, its gain and its floor
    alone (all in its hash). Speech at a usual level (loudest bins near 1), and speech brought
    up to `USUAL_LEVEL`, give -7; speech brought up to `QUIET_LEVEL` -8; louder speech (a hot
    microphone's, its loudest bins up to 2.5) counts from its own level, as Whisper's does: held
    at -7, it showed the model up to 15 dB more of its quiet range than Whisper does, and read
    worse. Bounded below only, at -11."""

    def __init__(self, n_mels: int = 80):
        self.n_mels = n_mels
        self.loudest = -np.inf  # the session's, log10 mel power
        self.utterance: float | None = None  # the current or last utterance's (None: no speech yet)
        self.quiet_items = 0  # items without speech since the last speech: PAUSE_ITEMS end it
        self.last_gain = 0.0  # the last item's gain, log10 power
        self.utterance_items = 0  # items of speech in the current or last utterance
        self.utterances = 0  # utterances begun

    def push(self, level: float, speech: bool) -> tuple[float, float]:
        """The next item's loudest level (`item_levels`) and whether the VAD heard speech in
        it -> (its gain, log10 power: `brought_up`; its floor)."""
        gain, level = self.step(level, speech)
        floor = round((level - DYNAMIC_RANGE) / FLOOR_STEP) * FLOOR_STEP
        return gain, max(floor, LOWEST_LOG_FLOOR)

    def step(self, level: float, speech: bool) -> tuple[float, float]:
        """As `push` -> (its gain; the level its floor counts from, brought up by the gain,
        unbounded)."""
        level = self.next_level(level, speech)
        gain = self.gain(level)
        return gain, level + gain

    def gain(self, level: float) -> float:
        """The next item's gain, its floor counting from `level`: none where that is
        `QUIET_LEVEL` or over; under it, up to `QUIET_LEVEL`, and under `FAINT_LEVEL` up to
        `USUAL_LEVEL`, and not over it, once the session has speech, in the floors' steps (few
        distinct item hashes). (Brought only up to `QUIET_LEVEL`, the same speech 20 or 30 dB
        down read up to 6 points worse than at 0 dB; brought up to `USUAL_LEVEL` from under
        `QUIET_LEVEL`, a real recording whose level rises through it over its first words
        heard them 10 dB over the rest: docs/evaluation.md, Quiet speech brought up to a usual
        level.) It falls at once. It rises by `GAIN_ATTACK` an item at most, and only once the
        utterance has been heard for `GAIN_HOLD_ITEMS`: the level is causal, counted from an
        utterance's first items before its loudest, and each quiet onset after speech at a
        usual level would be brought up far over the speech around it. In the session's first
        utterance it rises at once as far as `QUIET_LEVEL`: nothing was heard at another gain
        before it, and heard fading in (its onset as it came, the rest rising) a quiet
        session's first words are lost; the onset of speech at a usual level, its level under
        `FAINT_LEVEL` for its first items, is brought up no further than `QUIET_LEVEL`."""
        quiet = self.utterance is not None and level < QUIET_LEVEL
        aim = USUAL_LEVEL if level < FAINT_LEVEL else QUIET_LEVEL
        target = _steps(aim - level) if quiet else 0.0
        rise = GAIN_ATTACK if self.utterance_items >= GAIN_HOLD_ITEMS else 0.0
        gain = self.last_gain + rise
        if self.utterances == 1 and quiet:
            gain = max(gain, _steps(QUIET_LEVEL - level))
        self.last_gain = min(target, gain)
        return self.last_gain

    def next_level(self, level: float, speech: bool) -> float:
        """The next item's loudest level and whether the VAD heard speech in it -> the level
        its floor counts from (log10 mel power), unbounded."""
        self.loudest = max(self.loudest, level)
        if speech:
            if self.utterance is None or self.quiet_items >= PAUSE_ITEMS:
                self.utterance, self.utterance_items = level, 0  # a new utterance
                self.utterances += 1
            self.quiet_items = 0
            self.utterance_items += 1
        else:
            self.quiet_items += 1
        if self.utterance is None:
            return max(self.loudest, QUIET_LEVEL)
        if self.quiet_items < PAUSE_ITEMS:
            self.utterance = max(self.utterance, level)
        return min(self.loudest, self.utterance + UTTERANCE_MARGIN)


def _steps(gain: float) -> float:
    """A gain (log10 power, not negative) -> the floors' steps it holds, at most `MAX_GAIN`."""
    return math.floor(min(gain, MAX_GAIN) / FLOOR_STEP) * FLOOR_STEP


def item_gain_floors(samples: np.ndarray, probs: np.ndarray, threshold: float, n_mels: int = 80,
                     bounded: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(n,) float32 samples of a whole input and the VAD's (chunks,) probabilities of them ->
    (items,) gains and (items,) floors that streaming gives their items (`LogFloor`; the last
    one padded with silence, as a flush pads it); not `bounded`, the floors are the levels
    they count from, brought up by the gain, less 80 dB, neither rounded nor bounded below,
    as Whisper's floor is."""
    speech = item_speech(probs, -(-samples.size // ITEM_SAMPLES), ITEM_SAMPLES, threshold)
    framer, log_floor = AudioFramer(), LogFloor(n_mels)
    gains: list[float] = []
    floors: list[float] = []

    def add(contexts: list[np.ndarray]) -> None:
        for level in item_levels(contexts, n_mels) if contexts else []:
            is_speech = speech[len(floors)]
            if bounded:
                gain, floor = log_floor.push(level, is_speech)
            else:
                gain, level = log_floor.step(level, is_speech)
                floor = level - DYNAMIC_RANGE
            gains.append(gain)
            floors.append(floor)

    piece = 128 * ITEM_SAMPLES  # seconds at a time: an hour's contexts at once are gigabytes
    for at in range(0, samples.size, piece):
        add(framer.push(samples[at : at + piece]))
    add(framer.flush())
    return np.asarray(gains, dtype=np.float32), np.asarray(floors, dtype=np.float32)


def amplitude(gain: float | torch.Tensor) -> float | torch.Tensor:
    """A gain in log10 power (a float, or a tensor of them) -> the factor on the samples."""
    return 10.0 ** (gain / 2)


def brought_up(context: np.ndarray, gain: float) -> np.ndarray:
    """An item's PCM context as the model hears it, brought up by its gain (`LogFloor`)."""
    return context * np.float32(amplitude(gain)) if gain else context


def item_levels(contexts: list[np.ndarray], n_mels: int = 80) -> list[float]:
    """N items' PCM contexts -> the loudest level of each (`loudest_levels`), for `LogFloor`:
    one log-mel over all of them (the items every stream completed in a round of audio; one
    log-mel per item would keep a server's event loop busy with hundreds of streams)."""
    log_spec = log_mel_power(torch.from_numpy(np.stack(contexts)), n_mels, center=False)  # (N, n_mels, T)
    return loudest_levels(log_spec).tolist()


def item_log_mel(contexts: torch.Tensor, n_mels: int = 80,
                 floors: torch.Tensor | float = STREAM_LOG_FLOOR) -> torch.Tensor:
    """(N, context) samples, (N,) floors -> (N, n_mels, frames + 3) normalized log-mel with
    stem context (the floors from `LogFloor`)."""
    log_spec = log_mel_power(contexts, n_mels, center=False)
    if isinstance(floors, torch.Tensor):
        floors = floors.to(log_spec.dtype)[:, None, None]
    return normalize_log_mel(log_spec, floors)
