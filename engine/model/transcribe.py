"""Offline transcription of audio of any length: 30 s windows with timestamp-based seeking.

The algorithm is openai/whisper's transcribe(): decode a padded 30 s window, cut it into
segments at timestamp pairs, move the window to the last complete segment, retry with a
higher temperature when the output looks like a loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from audio.frames import ITEM_SAMPLES, amplitude, item_gain_floors
from audio.mel import FRAMES_PER_SECOND, HOP_LENGTH, N_FRAMES, N_SAMPLES, log_mel_spectrogram
from audio.vad import SpeechDetector, level_db
from engine.config import EngineConfig
from engine.model import ModelBundle
from engine.model.beam import BEAM_SIZE, decode_beam
from engine.model.decoding import (
    NO_SPEECH_THRESHOLD,
    DecodingOptions,
    DecodingResult,
    copies_prompt,
    decode_batch,
)
from engine.model.timing import align
from engine.speech_map import (
    LEAD_IN_MS,
    LONG_SILENCE_MS,
    SNAP_MS,
    UNHEARD_SPEECH_MS,
    SpeechMap,
)
from engine.timeline import SAMPLE_RATE, ms_to_samples, positions_to_seconds, seconds_to_ms
from engine.words import Segment, aligned_words, mark_segments, split_segments

TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
# when every temperature fails, a decode stopped at a repeat competes if what it read before
# the repeat spells at least this share of the longest decode's letters (`decode_with_fallback`)
LOOP_READ_SHARE = 0.5
INPUT_STRIDE = 2  # mel frames per encoder position (and per timestamp step)
VAD_THRESHOLD = EngineConfig.vad_threshold
TAIL_MS = 500  # a window that ends at a long silence keeps this much of it
# the VAD's speech is a steady sound's onset where the sound goes on this long after it, at
# most this much quieter (a word is louder than what follows it: silence, noise, a breath)
STEADY_MS = 1000
STEADY_DB = 3.0


@dataclass
class Transcript:
    text: str
    segments: list[Segment]
    duration: float  # seconds of audio

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "duration": round(self.duration, 3),
            "segments": [
                {"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text,
                 "words": [{"word": w.text, "start": w.start_ms / 1000, "end": w.end_ms / 1000}
                           for w in s.words]}
                for s in self.segments
            ],
        }


def decode_with_fallback(bundle: ModelBundle, features: torch.Tensor, prompt: list[int],
                         audio_seconds: float, temperatures: tuple[float, ...] = TEMPERATURES,
                         cross: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                         earlier: DecodingResult | None = None, speech_heard: bool = False,
                         beam_size: int = 1) -> DecodingResult:
    """Greedy first (or `beam_size` beams); on a loop, low log-probability or a budget
    overrun, sample hotter. A decode that copies one of the prompt's sentences is done again
    without the prompt.

    Whisper tries the temperatures one at a time and takes the first that passes. Here 0.2
    is tried alone too (a greedy decode that failed often passes at 0.2), and the rest are
    decoded together, one batch (`_decode_ladder`), the first that passes taken as before:
    a window that fails at 0.2 mostly fails them all, four decodes in a row that other
    sessions' finals wait for, and a batch of four costs the CPU about half of that.

    When every temperature fails, the likeliest decode that is no runaway (past its budget,
    or a text that compresses too well) is kept, as faster-whisper: one stopped at a repeat
    competes, its copies already dropped, if what it read before the repeat spells at least
    LOOP_READ_SHARE of the longest decode's letters. A loop that began at once reads nothing of
    the window, and its few tokens are likely ones ("No, no" over 8 s of speech, where T=0.8
    read the sentence). Whisper keeps the hottest, which on hard audio is sounds spelled as
    made-up words, and their times swallow the speech after them. The one kept is marked with
    the last temperature tried so its text is no prompt. `cross`:
    `cross_kv` of `features` if already computed (else computed once here); `earlier`: a
    decode of this window already made; `speech_heard`: the VAD heard speech in the window
    (DecodingOptions); `beam_size`: the beams of the greedy decode (`decode_beam`; 1: greedy)."""
    if cross is None:
        cross = bundle.model.decoder.cross_kv(features)
    tried = [earlier] if earlier is not None else []
    hot = tuple(t for t in temperatures if t > 0.0)
    greedy = tuple(t for t in temperatures if t == 0.0)
    for ladder in (greedy, hot[:1], hot[1:]):
        if not ladder:
            continue
        results, prompt = _decode_ladder(bundle, features, cross, prompt, ladder, audio_seconds, speech_heard,
                                         beam_size)
        for result in results:
            if result.is_silence or not result.needs_fallback:
                return result
            tried.append(result)
    whole = [r for r in tried if not r.ran_away] or tried
    longest = max(r.letters for r in whole)
    read = [r for r in whole if r.stop != "repetition" or r.letters >= LOOP_READ_SHARE * longest]
    best = max(read, key=lambda r: r.avg_logprob)
    return dataclasses.replace(best, temperature=tried[-1].temperature)


def _decode_ladder(bundle: ModelBundle, features: torch.Tensor,
                   cross: list[tuple[torch.Tensor, torch.Tensor]], prompt: list[int],
                   temperatures: tuple[float, ...], audio_seconds: float,
                   speech_heard: bool, beam_size: int = 1) -> tuple[list[DecodingResult], list[int]]:
    """One window (1, n_audio_ctx, n_state) decoded at each of `temperatures` as one batch
    -> (the decodes in temperature order, the prompt for hotter ones). The prompt is given
    up to 0.5, as Whisper gives it; from a decode that copies it, the decodes are done again
    without it (the ladders of `decode_with_fallback` give it to their first row only), and
    later ones have none. Each sampled row draws from its own seeded generator: the batch
    reads each temperature as it reads alone. A greedy row alone searches `beam_size` beams."""
    def rows(given: list[int], ladder: tuple[float, ...]) -> list[DecodingOptions]:
        return [DecodingOptions(prompt=given if t <= 0.5 else [], temperature=t, audio_seconds=audio_seconds,
                                speech_heard=speech_heard) for t in ladder]

    def run(options: list[DecodingOptions]) -> list[DecodingResult]:
        n = len(options)
        if beam_size > 1 and n == 1 and options[0].temperature == 0.0:
            return [decode_beam(bundle.model, bundle.tokenizer, features, cross, options[0], bundle.suppress,
                                beam_size)]
        return decode_batch(bundle.model, bundle.tokenizer, features.expand(n, *features.shape[1:]), options,
                            bundle.suppress, cross=cross)  # (the window's cross keys shared by its rows)

    options = rows(prompt, temperatures)
    results = run(options)
    copied = next((i for i, (o, r) in enumerate(zip(options, results, strict=True))
                   if o.prompt and copies_prompt(bundle.tokenizer, r.tokens, o.prompt)), None)
    if copied is None:
        return results, prompt
    redo = [j for j in range(copied, len(options)) if options[j].prompt]
    for j, again in zip(redo, run(rows([], tuple(temperatures[j] for j in redo))), strict=True):
        results[j] = again
    return results, []


def _add_words(bundle: ModelBundle, segments: list[Segment],
               cross: list[tuple[torch.Tensor, torch.Tensor]], offset: float, window_frames: int,
               speech: SpeechMap) -> None:
    """Give a window's segments their words, timed from the audio (the window's text aligned
    in one pass), their edges fitted to the speech the VAD heard (as streaming's; no word is
    dropped: a segment's words spell its text)."""
    text = [t for segment in segments for t in segment.tokens]
    if not text:
        return
    starts = align(bundle.model, bundle.tokenizer, bundle.alignment_heads, cross, [text],
                   [window_frames // INPUT_STRIDE])[0]
    words = aligned_words(bundle.tokenizer, text,
                          [offset + positions_to_seconds(p) for p in starts.tolist()])
    words = speech.fit(words, drop=False, floor_ms=seconds_to_ms(offset))
    mark_segments(words, segments)
    for word in words:
        segments[word.segment].words.append(word)


def _decode_window(bundle: ModelBundle, mel: torch.Tensor, seek: int, frames: int, history: list[int],
                   speech: SpeechMap, beam_size: int) -> tuple[DecodingResult, list[Segment], float]:
    """Decode mel frames [seek, seek + frames), the rest of the 30 s window silence ->
    (the decode, its segments with their words, the seconds it consumed: to its last
    timestamp, or to its last word's end where that is later, as Whisper seeks with word
    timestamps: a decoder that closed its last segment inside that segment's words would
    have the next window read them again)."""
    model, tokenizer = bundle.model, bundle.tokenizer
    offset, seconds = seek / FRAMES_PER_SECOND, frames / FRAMES_PER_SECOND
    chunk = mel[:, seek : seek + N_FRAMES].clone()  # (n_mels, 3000): the padding ends every mel
    chunk[:, frames:] = mel[:, -1:]  # silence, as the padding after the audio
    features = model.encoder(chunk[None].to(model.device, model.dtype))  # (1, 1500, n_state)
    cross = model.decoder.cross_kv(features)  # for every decode of the window and its words
    heard = speech.heard(seconds_to_ms(offset), seconds_to_ms(offset + seconds))
    result = decode_with_fallback(bundle, features, history, seconds, cross=cross, speech_heard=heard,
                                  beam_size=beam_size)
    if result.is_silence:
        return result, [], seconds
    new, consumed = split_segments(result.tokens, tokenizer.timestamp_begin, offset, seconds, tokenizer)
    _add_words(bundle, new, cross, offset, frames, speech)
    last = _last_word_end(new)
    if last is not None:
        consumed = max(consumed, last / 1000 - offset)
    return result, new, min(seconds, consumed)


def _last_word_end(segments: list[Segment]) -> int | None:
    """Where the last word of the segments ends (ms; None: they have no words)."""
    return max((s.words[-1].end_ms for s in segments if s.words), default=None)


def _mind_the_gap(bundle: ModelBundle, mel: torch.Tensor, seek: int, new: list[Segment], consumed: float,
                  history: list[int], speech: SpeechMap, beam_size: int) -> tuple[list[Segment], float]:
    """A window's segments and seconds consumed, without skipping speech: where the VAD heard
    seconds of speech between its words (the decoder jumped ahead to clearer speech, or
    stopped early and Whisper's seek would pass over the rest), keep the segments before
    that and go on from there; a window that skips speech at its start is decoded again
    with its audio cut at the first pause after seconds of the skipped speech. The next
    window starts before speech that begins after the last word kept (a late timestamp
    would cut off its onset)."""
    offset = seek / FRAMES_PER_SECOND
    words = [w for segment in new for w in segment.words]
    hole = speech.unheard(seconds_to_ms(offset), seconds_to_ms(offset + consumed), words, UNHEARD_SPEECH_MS)
    if hole is not None:
        kept = [s for s in new if s.words and s.words[-1].end_ms <= hole[0]]
        if kept:
            new, consumed = kept, kept[-1].words[-1].end_ms / 1000 - offset
        else:
            # the words after the skip are aligned stretched over it: cut at a pause instead
            cut = speech.skip_end(hole)
            cut = hole[1] if cut is None else cut
            frames = round(cut / 1000 * FRAMES_PER_SECOND) - seek
            if frames < round(consumed * FRAMES_PER_SECOND):  # speech after it to cut away
                result, new, consumed = _decode_window(bundle, mel, seek, frames, history, speech, beam_size)
                if result.is_silence:
                    return [], frames / FRAMES_PER_SECOND
    last = _last_word_end(new)
    if last is not None:
        resume = speech.resume_at(last, seconds_to_ms(offset + consumed))
        if resume is not None:
            consumed = resume / 1000 - offset
    return new, consumed


def _heard(segment: Segment, speech: SpeechMap) -> bool:
    """Whether the VAD heard speech at a segment's words: a segment of silence is Whisper's
    making (the prompt's last sentence again, a " Thank you."). Words of skipped speech
    aligned into the silence next to it are no longer kept (`_mind_the_gap`)."""
    if not segment.words:
        return True
    start, end = segment.words[0].start_ms - SNAP_MS, segment.words[-1].end_ms + SNAP_MS
    return speech.speech_ms(start, end) > 0


def _sound_onset(samples: np.ndarray, speech: SpeechMap, start_ms: int, end_ms: int) -> bool:
    """Whether the speech the VAD heard in [start_ms, end_ms) is only the onsets of steady
    sounds: each run goes on as loud for STEADY_MS after it. A hum or a tune starting is
    heard as a fraction of a second of speech, and the decoder reads it, with its prompt,
    as " you." or as the prompt's words again."""
    runs = speech.runs(start_ms, end_ms)
    for a, b in runs:
        run = samples[ms_to_samples(a) : ms_to_samples(b)]
        after = samples[ms_to_samples(b) : ms_to_samples(b + STEADY_MS)]
        if after.size < ms_to_samples(STEADY_MS) or level_db(after) < level_db(run) - STEADY_DB:
            return False
    return bool(runs)


def _no_speech(result: DecodingResult, samples: np.ndarray, speech: SpeechMap, seek: int,
               frames: int) -> bool:
    """Whisper's no-speech rule, or neither the decoder (a no-speech probability over 0.6,
    however sure its words) nor the VAD (under HEARD_SPEECH_MS, a sound's onset) heard speech."""
    if result.is_silence:
        return True
    if result.speech_heard or result.no_speech_prob <= NO_SPEECH_THRESHOLD:
        return False
    start = seconds_to_ms(seek / FRAMES_PER_SECOND)
    return _sound_onset(samples, speech, start, start + seconds_to_ms(frames / FRAMES_PER_SECOND))


def _window_frames(speech: SpeechMap, seek: int, content_frames: int) -> int:
    """The mel frames of the window from `seek`: 30 s, or up to a silence of LONG_SILENCE_MS
    after speech (and TAIL_MS into it). Across seconds of silence the decoder passes over a
    short utterance ("Yes.") or times it next to the speech after the silence."""
    frames = min(N_FRAMES, content_frames - seek)
    pause = speech.pause_after(seconds_to_ms(seek / FRAMES_PER_SECOND), 1, LONG_SILENCE_MS)
    if pause is None:
        return frames
    end = round((pause + TAIL_MS) / 1000 * FRAMES_PER_SECOND)
    return max(INPUT_STRIDE, min(frames, end - seek))


def _item_gains(gains: torch.Tensor, num_samples: int) -> torch.Tensor:
    """(items,) gains (log10 power) -> (num_samples,) each sample's amplitude factor."""
    amp = amplitude(gains).repeat_interleave(ITEM_SAMPLES)
    return torch.cat([amp, amp[-1:].expand(max(num_samples - amp.numel(), 0))])[:num_samples]


@torch.inference_mode()
def transcribe(bundle: ModelBundle, audio: torch.Tensor, beam_size: int = BEAM_SIZE) -> Transcript:
    """audio: (n,) float32 16 kHz mono -> Transcript with segment timestamps. `beam_size`:
    the beams of each window's greedy decode (`decode_beam`; 1: greedy)."""
    model = bundle.model
    duration = audio.shape[0] / SAMPLE_RATE
    audio = audio.float()
    samples = audio.numpy()
    probs = SpeechDetector().push(samples)
    speech = SpeechMap(VAD_THRESHOLD)
    speech.push(probs)
    # the gain and log-mel floor of each item, by streaming's rule (audio.frames.LogFloor)
    # without its bounds: with one voice at a normal level, Whisper's floor
    gains, floors = item_gain_floors(samples, probs, VAD_THRESHOLD, model.dims.n_mels, bounded=False)
    if gains.any():  # (speech at a usual level has none: no copy of the file)
        audio = audio * _item_gains(torch.from_numpy(gains), audio.shape[0])
    floors = torch.from_numpy(floors)
    mel = log_mel_spectrogram(audio, model.dims.n_mels, padding=N_SAMPLES,
                              floors=floors.repeat_interleave(ITEM_SAMPLES // HOP_LENGTH))
    content_frames = mel.shape[-1] - N_FRAMES
    segments: list[Segment] = []
    history: list[int] = []  # tokens of earlier windows with their timestamps, the prompt
    seek = 0
    while seek < content_frames:
        # a window starts shortly before speech that follows seconds of silence (the decoder
        # repeats its prompt or makes up words in them)
        at = seconds_to_ms(seek / FRAMES_PER_SECOND)
        onset = speech.next_speech(at)
        if onset is not None and onset - at >= LONG_SILENCE_MS:
            seek = round((onset - LEAD_IN_MS) / 1000 * FRAMES_PER_SECOND)
        window_frames = _window_frames(speech, seek, content_frames)
        result, new, consumed = _decode_window(bundle, mel, seek, window_frames, history, speech, beam_size)
        if _no_speech(result, samples, speech, seek, window_frames):
            seek += window_frames
            continue
        new, consumed = _mind_the_gap(bundle, mel, seek, new, consumed, history, speech, beam_size)
        for segment in new:
            start = max(segment.start, segments[-1].end if segments else 0.0)
            segment.start, segment.end = min(start, duration), min(max(segment.end, start), duration)
            if segment.text.strip() and _heard(segment, speech):
                segments.append(segment)
                history.extend(segment.prompt)
        if result.temperature > 0.5:
            history = []
        # move at least one timestamp step so a window never repeats
        seek += max(INPUT_STRIDE, min(window_frames, round(consumed * FRAMES_PER_SECOND)))
    text = "".join(s.text for s in segments).strip()
    return Transcript(text=text, segments=segments, duration=duration)
