"""The device worker: batched encoder across sessions, per-session gather, decoding.

Per step: one batched conv-stem call for every new audio item of every session (deduped by
content hash), one batched transformer call over all scheduled windows, then one batched
greedy decode of all windows (prompts left-padded, finished rows leave the batch). Host
arrays enter through torch.from_numpy; nothing is copied back from the device but the
decoded token ids.

On the CPU a step that may be given up for a final (partials, previews, files) runs its
windows in batches of at most one 30 s window's positions instead: there a batch costs the
sum of its windows' passes, and a final that falls due waits for the batch in flight, so it
waits for about one window's pass, not for a dozen previews.

The runner sees a step only as a `ModelInput`: per window its items' hashes and embedding
ranges, its prompt and draft, and the PCM of the items it has not computed yet. That is all
it needs, and it pickles, so the runner can live in a worker process (engine/worker.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from audio.frames import STREAM_LOG_FLOOR, item_log_mel
from audio.mel import SILENCE_LOG_POWER, normalize_log_mel
from engine.commit import SHORT_READING
from engine.model import ModelBundle
from engine.model.beam import decode_beam
from engine.model.decoding import (
    DecodingCancelled,
    DecodingOptions,
    DecodingResult,
    copies_prompt,
    decode_batch,
)
from engine.model.timing import align
from engine.model.transcribe import TEMPERATURES, decode_with_fallback
from engine.processor_cache import ProcessorCache
from engine.scheduler import ScheduledWindow
from engine.stem_store import StemStore
from engine.timeline import MAX_WINDOW_POSITIONS, POSITIONS_PER_SECOND, positions_to_seconds, seconds_to_ms
from engine.words import Word, add_probabilities, window_words

log = logging.getLogger(__name__)


@dataclass
class WindowInput:
    """What the runner needs of one scheduled window."""

    window: ScheduledWindow
    pieces: list[tuple[str, int, int]]  # per item in the window: (hash, first, end embedding)
    prompt: list[int] = field(default_factory=list)  # committed tokens before the window
    draft: list[int] = field(default_factory=list)  # the tokens its decode is likely to give
    forced: int = 0  # the draft's first tokens taken as given (DecodingOptions.forced)
    # its decode may commit words: they are timed from the audio (else a segment's time is
    # spread over its words, enough for the tentative tail)
    timed: bool = True
    speech_heard: bool = False  # the VAD heard speech in its audio past the committed words
    # the beams of its decode at temperature 0, if committed whole or by agreement (decode_beam)
    beam_size: int = 1

    @property
    def request_id(self) -> str:
        return self.window.request_id


@dataclass
class ModelInput:
    """One step as the runner sees it (a snapshot: the engine's requests may change meanwhile)."""

    windows: list[WindowInput] = field(default_factory=list)
    # hash -> (item PCM context, its log-mel floor)
    new_items: dict[str, tuple[np.ndarray, float]] = field(default_factory=dict)
    freed_mm_hashes: list[str] = field(default_factory=list)  # evicted: drop their tensors


@dataclass
class WindowResult:
    request_id: str
    words: list[Word]  # hypothesis over the window, absolute times
    final: bool
    preview: bool = False  # the window was a preview (only the audio since the last final)
    silence: bool = False
    error: str | None = None
    complete_ms: int | None = None  # the words are whole segments up to here (Whisper's seek)
    temperature: float = 0.0  # of the decode kept (above 0: a fallback)
    tokens: list[int] = field(default_factory=list)  # the decoded text and timestamp tokens
    # a partial given up for a final that fell due: no words; `tokens` are those decoded so far
    cancelled: bool = False
    # Whisper's fallback rule fails the decode kept (DecodingResult.needs_fallback: a loop, or
    # a mean log-probability under -1)
    failed: bool = False
    # its words' times are from the audio (`WindowInput.timed`, the alignment ran), not its
    # segments' times spread by characters
    timed: bool = True
    # the decoder's log-probability of the kept sentence's closing mark, given as context,
    # hearing the speech after it (DecodingResult.given_logprob); None: nothing given
    given_logprob: float | None = None


@dataclass
class RunnerOutput:
    results: list[WindowResult] = field(default_factory=list)
    num_encoder_calls: int = 0  # batched conv-stem calls (0 or 1 per step)
    num_encoded_items: int = 0  # unique items computed in that call
    num_windows: int = 0  # windows in the batched transformer calls (one per padded length)
    num_fallbacks: int = 0  # windows re-decoded at higher temperatures
    processor_counts: tuple[int, int] = (0, 0)  # the runner's processor cache: (queries, hits)
    num_threads: int = 0  # torch threads the worker process ran it with (engine/cpu_share.py)


class ModelRunner:
    def __init__(self, bundle: ModelBundle, processor_cache: ProcessorCache | None = None,
                 pad_seconds: int | None = None, preview_pad_seconds: int | None = None):
        """`processor_cache`: the runner's own, where features processed elsewhere are
        injected (`inject`); None: a new one of the default size."""
        self.bundle = bundle
        self.pad_seconds = pad_seconds  # None: every window padded to 30 s (Whisper's input)
        self.preview_pad_seconds = preview_pad_seconds  # the same for preview windows
        self.model = bundle.model
        self.device = bundle.device
        self.dtype = self.model.dtype
        self.processor_cache = processor_cache or ProcessorCache()
        self.encoder_cache = StemStore()  # hash -> (positions, n_state); "pad <floor>" too
        self.floors: dict[str, float] = {}  # hash -> the item's log-mel floor
        self.stop_event = threading.Event()  # set to give up the step of partials in flight

    @property
    def alive(self) -> bool:
        return True  # (a RunnerProcess's worker can exit)

    def close(self) -> None:
        """Nothing to stop in this process (a RunnerProcess stops its worker)."""

    def padded_length(self, num_positions: int, preview: bool = False) -> int:
        """Encoder length for a batch whose longest window has `num_positions`: 30 s, or with
        `pad_seconds` (for previews `preview_pad_seconds`) set, the window rounded up to a
        multiple of it (faster, see docs/performance.md)."""
        seconds = self.preview_pad_seconds if preview else self.pad_seconds
        if seconds is None:
            return MAX_WINDOW_POSITIONS
        unit = seconds * POSITIONS_PER_SECOND  # seconds are whole
        return min(MAX_WINDOW_POSITIONS, max(unit, -(-num_positions // unit) * unit))

    def pad(self, floor: float = STREAM_LOG_FLOOR) -> torch.Tensor:
        """(n_state,) stem output of the padding after a window whose items have this floor."""
        return self.encoder_cache.get(self._pad_key(floor))[0]

    @torch.inference_mode()
    def _pad_key(self, floor: float) -> str:
        """The store's key of the padding after items of this floor (its first row), stored
        on first use. Whisper pads with digital silence: its log power, clamped to the floor.
        Under quiet speech the floor lies below silence, so the padding is silence, not the
        floor."""
        key = f"pad {floor}"
        if key not in self.encoder_cache:
            silence = torch.full((1, self.model.dims.n_mels, 11), SILENCE_LOG_POWER)
            self.encoder_cache.put([key], self._stem(normalize_log_mel(silence, floor)), pinned=True)
        return key

    def _stem(self, mel: torch.Tensor) -> torch.Tensor:
        """(N, n_mels, 8m + 3) item mel with context -> (N, 4m, n_state)."""
        return self.model.encoder.stem(mel.to(self.device, self.dtype), padding=0)

    def inject(self, hashes: list[str], features: list[torch.Tensor]) -> None:
        """Add item features processed elsewhere (log-mel with context, as item_log_mel
        gives), so that the items of those content hashes skip their processing."""
        self.processor_cache.inject(hashes, features)

    @torch.inference_mode()
    def encode_items(self, inp: ModelInput) -> tuple[int, int]:
        """Compute the stem for all new items of all sessions in one call -> (calls, items)."""
        for mm_hash in inp.freed_mm_hashes:
            self.encoder_cache.pop(mm_hash)
            self.floors.pop(mm_hash, None)
        hashes = [h for h in inp.new_items if h not in self.encoder_cache]
        if not hashes:
            return 0, 0
        for h in hashes:
            if inp.new_items[h] is not None:  # (None: processed elsewhere, injected)
                self.floors[h] = inp.new_items[h][1]
        mels: list[torch.Tensor | None] = [self.processor_cache.get(h) for h in hashes]
        missing = [i for i, m in enumerate(mels) if m is None]
        if missing:
            contexts = np.stack([inp.new_items[hashes[i]][0] for i in missing])  # (M, context samples)
            floors = torch.tensor([self.floors[hashes[i]] for i in missing])  # (M,)
            computed = item_log_mel(torch.from_numpy(contexts).to(self.device), self.model.dims.n_mels,
                                    floors.to(self.device))  # on the model's device
            for j, i in enumerate(missing):
                mels[i] = computed[j]
                self.processor_cache.put(hashes[i], computed[j])
        mels = [m.to(self.device) for m in mels]  # (injected ones were made on the CPU)
        self.encoder_cache.put(hashes, self._stem(torch.stack(mels)))  # (N, positions per item, n_state)
        return 1, len(hashes)

    def gather(self, windows: list[WindowInput], length: int = MAX_WINDOW_POSITIONS) -> torch.Tensor:
        """Embeddings of the windows' positions, each padded to `length` (30 s) ->
        (B, length, n_state)."""
        pads = [self._pad_key(self.floors.get(w.pieces[-1][0], STREAM_LOG_FLOOR) if w.pieces
                              else STREAM_LOG_FLOOR) for w in windows]
        return self.encoder_cache.gather([w.pieces for w in windows], pads, length)

    @torch.inference_mode()
    def execute(self, inp: ModelInput, stop: Callable[[], bool] | None = None) -> RunnerOutput:
        """Encode the new items, run the transformer over every window, decode them: windows
        and previews each as one batch (their padded lengths differ; on the CPU, a step that
        may be given up in batches of one 30 s window's positions). A window's draft (its
        previous decode) is verified instead of generated token by token.

        A step of partials (and background windows) only is given up once `stop()` says so
        (asked before each transformer and decoder call): the windows whose decode had not
        finished are then `cancelled`, with the tokens decoded so far. The new items are encoded all the same
        (the encoder cache counts on them). In a step with live finals, `stop()` gives up only
        their beam searches (they keep their greedy decodes)."""
        calls, items = self.encode_items(inp)
        cache = self.processor_cache
        result = RunnerOutput(num_encoder_calls=calls, num_encoded_items=items,
                              num_windows=len(inp.windows),
                              processor_counts=(cache.num_queries, cache.num_hits))
        search_stop = stop
        if any(w.window.live_final for w in inp.windows):
            stop = None  # a step with live finals runs to its end (but for their searches)
        return self._run_windows(inp.windows, result, stop, search_stop)

    def _run_windows(self, inputs: list[WindowInput], result: RunnerOutput,
                     stop: Callable[[], bool] | None,
                     search_stop: Callable[[], bool] | None = None) -> RunnerOutput:
        groups: dict[bool, list[WindowInput]] = {}
        for w in inputs:
            window = w.window
            if window.window_end > window.window_start and window.speech:
                groups.setdefault(window.preview, []).append(w)
            else:  # a flush or finish with no new audio, or no speech in it: nothing to decode
                result.results.append(WindowResult(window.request_id, [], window.final, silence=True))
        batches = []
        for preview, windows in groups.items():
            length = self.padded_length(max(w.window.window_end - w.window.window_start
                                            for w in windows), preview)
            size = len(windows)
            if stop is not None and self.device.type == "cpu":
                size = max(1, MAX_WINDOW_POSITIONS // length)
            batches += [(preview, length, windows[i : i + size]) for i in range(0, len(windows), size)]
        cancelled = False
        for preview, length, windows in batches:
            if cancelled or (stop is not None and stop()):
                cancelled = True
                result.results += [WindowResult(w.request_id, [], False, preview, cancelled=True)
                                   for w in windows]
                continue
            x = self.gather(windows, length)  # (B, length, n_state)
            features = self.model.encoder.transformer(x)  # (B, length, n_state)
            decoded = self.decode_windows(windows, features, stop, search_stop)
            result.results += decoded
            result.num_fallbacks += sum(r.temperature > 0 for r in decoded)
            cancelled = any(r.cancelled for r in decoded)
        return result

    def decode_windows(self, inputs: list[WindowInput], features: torch.Tensor,
                       stop: Callable[[], bool] | None = None,
                       search_stop: Callable[[], bool] | None = None) -> list[WindowResult]:
        """Decode all windows as one batch; if that fails, each alone, so a fault stays with
        its own session. Given up (`stop`): the windows decoded by then keep their results,
        the others are `cancelled` with their tokens so far. A search given up (`search_stop`)
        leaves its window the greedy decode."""
        windows = [w.window for w in inputs]
        options = [self._options(w) for w in inputs]
        tokenizer, suppress = self.bundle.tokenizer, self.bundle.suppress
        cross = self.model.decoder.cross_kv(features)  # for decoding and word timing
        try:
            decoded = decode_batch(self.model, tokenizer, features, options, suppress, stop, cross)
        except DecodingCancelled as e:
            # (a decode committed whole that needs another is decoded again in the next step)
            again = [w.window.commits_whole and (d is None or d.needs_fallback or w.beam_size > 1)
                     for w, d in zip(inputs, e.results, strict=True)]
            done = [None if a else d for a, d in zip(again, e.results, strict=True)]
            starts = self.align(inputs, cross, done)
            return [self._window_result(window, d, s) if d is not None
                    else WindowResult(window.request_id, [], False, window.preview, cancelled=True,
                                      tokens=prefix)
                    for window, d, s, prefix in zip(windows, done, starts, e.prefixes, strict=True)]
        except Exception:
            log.exception("batched decoding failed; decoding the %d windows one by one", len(windows))
            decoded = []
            for b, (window, opts) in enumerate(zip(windows, options, strict=True)):
                try:
                    decoded.append(decode_batch(self.model, tokenizer, features[b : b + 1], [opts],
                                                suppress)[0])
                except Exception as e:  # one session's failure must not stop the others
                    log.exception("decoding %s failed", window.request_id)
                    decoded.append(e)
        kept: list[DecodingResult | Exception] = []
        for b, (w, opts, d) in enumerate(zip(inputs, options, decoded, strict=True)):
            if isinstance(d, DecodingResult) and not d.is_silence and (w.window.commits_whole or w.timed):
                row = features[b : b + 1], [(k[b : b + 1], v[b : b + 1]) for k, v in cross]
                decode = self._decode_whole if w.window.commits_whole else self._decode_agreed
                try:
                    d = decode(w.beam_size, opts, d, *row, search_stop)
                except Exception as e:  # failed below, for this session alone
                    d = e
            kept.append(d)
        starts = self.align(inputs, cross,
                            [d if isinstance(d, DecodingResult) else None for d in kept])
        results = []
        for window, d, s in zip(windows, kept, starts, strict=True):
            try:
                if isinstance(d, Exception):
                    raise d
                results.append(self._window_result(window, d, s))
            except Exception as e:  # one session's failure must not stop the others
                log.exception("decoding %s failed", window.request_id)
                results.append(_failed(window, e))
        return results

    def align(self, inputs: list[WindowInput], cross: list[tuple[torch.Tensor, torch.Tensor]],
              decoded: list[DecodingResult | None]) -> list[list[float] | None]:
        """Per window, where each decoded text token starts, in seconds from the window's
        start, and where the text ends (None: not `timed`, or no text). All in one pass."""
        ts_begin = self.bundle.tokenizer.timestamp_begin
        windows = [w.window for w in inputs]
        texts = [[t for t in d.tokens if t < ts_begin]
                 if d is not None and not d.is_silence and w.timed else []
                 for w, d in zip(inputs, decoded, strict=True)]
        rows = [b for b, text in enumerate(texts) if text]
        starts: list[list[float] | None] = [None] * len(decoded)
        if not rows:
            return starts
        lengths = [windows[b].window_end - windows[b].window_start for b in rows]
        try:
            found = align(self.model, self.bundle.tokenizer, self.bundle.alignment_heads,
                          [(k[rows], v[rows]) for k, v in cross], [texts[b] for b in rows], lengths)
        except Exception:  # timing is not worth a session: its segments give the times
            log.exception("word alignment failed; words take their segments' times")
            return starts
        for b, positions in zip(rows, found, strict=True):
            starts[b] = [positions_to_seconds(p) for p in positions.tolist()]
        return starts

    def _decode_whole(self, beam_size: int, options: DecodingOptions, greedy: DecodingResult,
                      features: torch.Tensor, cross: list[tuple[torch.Tensor, torch.Tensor]],
                      stop: Callable[[], bool] | None = None) -> DecodingResult:
        """A window's decode that is committed as is (no agreement check), from its greedy
        decode (the draft verified: cheap, and it tells silence): searched with `beam_size`
        beams, unless `stop` gives the search up (another live final fell due: the greedy
        decode stays); then, as offline Whisper, decoded again at rising temperatures where it
        loops, skips or overruns its budget, and without the prompt where it copies one of the
        prompt's sentences. features: (1, n_audio_ctx, n_state); cross: its `cross_kv`."""
        bundle = self.bundle
        decoded = greedy
        if beam_size > 1:
            try:
                decoded = decode_beam(self.model, bundle.tokenizer, features, cross, options,
                                      bundle.suppress, beam_size, stop)
            except DecodingCancelled:
                beam_size = 1
        copied = copies_prompt(bundle.tokenizer, decoded.tokens, options.prompt)
        if decoded.needs_fallback or copied:
            prompt, temperatures = ([], TEMPERATURES) if copied else (options.prompt, TEMPERATURES[1:])
            decoded = decode_with_fallback(bundle, features, prompt, options.audio_seconds,
                                           temperatures, cross, earlier=None if copied else decoded,
                                           speech_heard=options.speech_heard, beam_size=beam_size)
        # (a search and a fallback are given nothing: the odds are the greedy decode's)
        return replace(decoded, given_logprob=greedy.given_logprob)

    def _decode_agreed(self, beam_size: int, options: DecodingOptions, greedy: DecodingResult,
                       features: torch.Tensor, cross: list[tuple[torch.Tensor, torch.Tensor]],
                       stop: Callable[[], bool] | None = None) -> DecodingResult:
        """A partial's decode whose words agreement may commit (an utterance that ran past
        `agree_after_ms` with no pause to end it), searched with `beam_size` beams as a final
        is: agreement commits what two searched readings share, as a final commits a searched
        one (the words greedy readings agreed on read about 7 points worse than offline's:
        docs/evaluation.md, Searched partials). The greedy decode stays where the search is given up or
        fails Whisper's fallback rule (a failed decode counts for nothing in agreement, and a
        partial is not sampled hotter), or passes over speech the greedy decode read: it starts
        reading over a second later, or spells under SHORT_READING of its letters (in run-on
        speech five beams read a window from "The rainforest", 5 s in, its first words stretched
        over the speech the greedy decode read, decode after decode, until the full window
        committed them and lost 3.8 s). features: (1, n_audio_ctx, n_state); cross: its `cross_kv`."""
        if beam_size <= 1 or greedy.needs_fallback:
            return greedy
        try:
            searched = decode_beam(self.model, self.bundle.tokenizer, features, cross, options,
                                   self.bundle.suppress, beam_size, stop)
        except DecodingCancelled:
            return greedy
        begin = self.bundle.tokenizer.timestamp_begin
        late = _first_time(searched, begin) > _first_time(greedy, begin) + POSITIONS_PER_SECOND
        if searched.needs_fallback or late or searched.letters < SHORT_READING * greedy.letters:
            return greedy
        return replace(searched, given_logprob=greedy.given_logprob)

    @staticmethod
    def _options(w: WindowInput) -> DecodingOptions:
        seconds = positions_to_seconds(w.window.window_end - w.window.window_start)
        return DecodingOptions(prompt=w.prompt, audio_seconds=seconds, draft=w.draft,
                               forced=w.forced, speech_heard=w.speech_heard)

    def _window_result(self, window: ScheduledWindow, decoded: DecodingResult,
                       starts: list[float] | None = None) -> WindowResult:
        """Decoded tokens (and where each text token starts) -> timed words in session time."""
        if decoded.is_silence or not decoded.tokens:
            return WindowResult(window.request_id, [], window.final, window.preview, silence=True)
        words, complete = window_words(self.bundle.tokenizer, decoded.tokens,
                                       positions_to_seconds(window.window_start),
                                       positions_to_seconds(window.window_end - window.window_start),
                                       starts)
        add_probabilities(words, decoded.tokens, decoded.token_logprobs,
                          self.bundle.tokenizer.timestamp_begin)
        return WindowResult(window.request_id, words, window.final, window.preview,
                            complete_ms=seconds_to_ms(complete), temperature=decoded.temperature,
                            tokens=decoded.tokens, failed=decoded.needs_fallback, timed=starts is not None,
                            given_logprob=decoded.given_logprob)


def _first_time(decoded: DecodingResult, timestamp_begin: int) -> int:
    """Where a decode's reading starts: its first timestamp (positions from the window's start)."""
    return next((t - timestamp_begin for t in decoded.tokens if t >= timestamp_begin), 0)


def _failed(window: ScheduledWindow, e: Exception) -> WindowResult:
    return WindowResult(window.request_id, [], window.final, error=f"{type(e).__name__}: {e}")
