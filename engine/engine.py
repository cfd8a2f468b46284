"""The engine API: add_request / add_audio / flush / finish / abort / step. No I/O.

A caller (the server's engine loop, a test, a replay) feeds 16 kHz float32 audio and calls
step(); each step schedules windows, runs the model runner once, applies the commit policy
and returns what changed per session.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from audio.frames import CONTEXT_BEFORE, ITEM_SAMPLES, STREAM_LOG_FLOOR, AudioFramer
from audio.io import SAMPLE_RATE
from audio.vad import level_db
from engine.mm_window import window_pieces
from engine.model import ModelBundle
from engine.model.decoding import shift_timestamps
from engine.model_runner import ModelInput, ModelRunner, RunnerOutput, WindowInput, WindowResult
from engine.policy import LocalAgreement, PolicyUpdate, Word
from engine.processor_cache import ProcessorCache
from engine.request import (
    POSITIONS_PER_SECOND,
    SAMPLES_PER_POSITION,
    MMFeature,
    PlaceholderRange,
    Request,
    RequestStatus,
    fill_placeholders,
)
from engine.scheduler import MAX_WINDOW_POSITIONS, Scheduler, SchedulerConfig, SchedulerOutput
from engine.worker import RunnerProcess, can_share

log = logging.getLogger(__name__)

TRIM_AFTER_POSITIONS = 15 * POSITIONS_PER_SECOND  # cut the window at a commit once over 15 s
FORCE_KEEP_POSITIONS = 5 * POSITIONS_PER_SECOND  # near 30 s, force-commit all but the last 5 s
CPU_MAX_FINALS = 2  # final windows per step on the CPU (EngineConfig.max_finals)


def ms_to_position(ms: int) -> int:
    return ms * POSITIONS_PER_SECOND // 1000


def position_to_ms(position: int) -> int:
    return position * 1000 // POSITIONS_PER_SECOND


@dataclass
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    item_samples: int = ITEM_SAMPLES  # 80 ms audio items
    processor_cache_bytes: int = 64 << 20
    pad_seconds: int | None = None  # None: windows padded to 30 s; else to a multiple of this
    endpoint_ms: int | None = 250  # silence after speech that commits the window whole (None: off)
    speech_db: float = -45.0  # an item whose RMS level (dBFS) is above this is speech
    agree_after_ms: int = 8000  # with endpointing: agreement commits only past this much audio
    # with endpointing, a partial that cannot commit (under agree_after_ms of audio since the
    # last final) decodes only that audio, padded to a multiple of this: a preview, shown and
    # never committed. None: partials decode the whole window, padded as finals are.
    preview_pad_seconds: int | None = 10
    # final windows per step; None: 2 on the CPU, where batching does not make the encoder
    # cheaper per window and a final would wait for the others, else SchedulerConfig's
    max_finals: int | None = None
    # run the model in a worker process (engine/worker.py), out of the caller's interpreter
    # lock: what the server does. False: in the calling process (tests, scripts).
    worker_process: bool = False


@dataclass
class EngineOutput:
    request_id: str
    committed: list[Word]  # newly committed words (final, never rewritten)
    tentative: list[Word]  # current tentative tail (replaces the previous one)
    finished: bool = False  # the request is done; no more outputs
    flushed_ms: int | None = None  # set when a flush completed: all audio before it is committed
    error: str | None = None

    @property
    def flushed(self) -> bool:
        return self.flushed_ms is not None


@dataclass
class StepInput:
    scheduled: SchedulerOutput
    model_input: ModelInput  # what the runner reads: a snapshot taken when scheduled


@dataclass
class StepStats:
    num_windows: int = 0
    num_encoder_calls: int = 0
    num_encoded_items: int = 0
    num_fallbacks: int = 0


class Engine:
    def __init__(self, bundle: ModelBundle, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.bundle = bundle
        self.processor_cache = ProcessorCache(self.config.processor_cache_bytes)
        for name in ("pad_seconds", "preview_pad_seconds"):
            seconds = getattr(self.config, name)
            if seconds is not None and not 1 <= seconds <= 30:
                raise ValueError(f"{name} must be 1-30 seconds (or None), got {seconds}")
        if self.config.endpoint_ms is not None and not 80 <= self.config.endpoint_ms <= 10_000:
            raise ValueError(f"endpoint_ms must be 80-10000 (or None: off), got {self.config.endpoint_ms}")
        if self.config.scheduler.max_partials < 1:
            raise ValueError(f"max_partials must be at least 1 (partial windows per step), "
                             f"got {self.config.scheduler.max_partials}")
        previews = self.config.endpoint_ms is not None and self.config.preview_pad_seconds is not None
        max_finals = self.config.max_finals
        if max_finals is None:
            max_finals = self.config.scheduler.max_finals
        if max_finals is None and bundle.device.type == "cpu":
            max_finals = CPU_MAX_FINALS
        if max_finals is not None and max_finals < 1:
            raise ValueError(f"max_finals must be at least 1 (final windows per step), got {max_finals}")
        self.scheduler = Scheduler(replace(
            self.config.scheduler, max_finals=max_finals,
            preview_positions=ms_to_position(self.config.agree_after_ms) if previews else 0))
        self.runner: ModelRunner | RunnerProcess
        worker_process = self.config.worker_process
        if worker_process and not can_share(bundle):
            log.warning("the model's weights do not fit in /dev/shm to share with a worker "
                        "process (in a container, raise --shm-size): the model runs in a "
                        "thread of this process, which is slower under load")
            worker_process = False
        if worker_process:
            self.runner = RunnerProcess(bundle, self.config.pad_seconds,
                                        self.config.preview_pad_seconds,
                                        self.config.processor_cache_bytes)
        else:
            self.runner = ModelRunner(bundle, self.processor_cache, self.config.pad_seconds,
                                      self.config.preview_pad_seconds)
        self.item_positions = self.config.item_samples // SAMPLES_PER_POSITION  # 4 for 80 ms
        self.framers: dict[str, AudioFramer] = {}
        self.policies: dict[str, LocalAgreement] = {}
        # silence flush() inserted into a session's timeline: timeline ms where each padding
        # ends, and the total padding up to there, to report times in received-audio ms
        self.pad_ends: dict[str, list[int]] = {}
        self.pad_totals: dict[str, list[int]] = {}
        self.last_stats = StepStats()
        # set (from any thread) to give up the partials-only step in flight: a final fell due
        self.stop_partials = (self.runner.stop_event if isinstance(self.runner, RunnerProcess)
                              else threading.Event())
        # finals numbered (Request.due_number) when the last step was scheduled: in a step of
        # partials only, those could not be placed (a full encoder cache); see final_fell_due
        self.num_due_at_schedule = 0
        params = f"{bundle.model_id}:{self.config.item_samples}:{STREAM_LOG_FLOOR}"
        self._hash_key = hashlib.blake2b(params.encode(), digest_size=16).digest()

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str) -> None:
        self.scheduler.add_request(Request(request_id))
        self.framers[request_id] = AudioFramer(self.config.item_samples)
        self.policies[request_id] = LocalAgreement()
        self.pad_ends[request_id], self.pad_totals[request_id] = [], []

    def _request(self, request_id: str) -> Request:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown or finished request {request_id!r}")
        return request

    def add_audio(self, request_id: str, samples: np.ndarray) -> None:
        """Append (n,) float32 16 kHz samples to a session."""
        request = self._request(request_id)
        if request.input_finished:
            raise ValueError(f"request {request_id!r} is finished; no more audio")
        self._add_items(request, self.framers[request_id].push(np.asarray(samples, np.float32)))
        self.scheduler.note_final_due(request)  # a pause in it: the final's place in line

    def _add_items(self, request: Request, contexts: list[np.ndarray]) -> None:
        for context in contexts:
            digest = hashlib.blake2b(context.tobytes(), key=self._hash_key, digest_size=16)
            offset = request.num_positions
            request.mm_features.append(
                MMFeature(digest.hexdigest(), PlaceholderRange(offset, self.item_positions), context))
            self._track_speech(request, context)

    def _track_speech(self, request: Request, context: np.ndarray) -> None:
        """After an item: note where speech last was (the scheduler decodes no silence), and
        mark an endpoint once `endpoint_ms` of silence follow speech (since the last endpoint).
        The window that reaches it ends there and is final: committed whole, one decode of a
        complete utterance with no agreement to wait for."""
        core = context[CONTEXT_BEFORE : CONTEXT_BEFORE + self.config.item_samples]
        end = request.num_positions
        if level_db(core) > self.config.speech_db:
            request.last_speech_end = end
        elif self.config.endpoint_ms is None:
            return
        elif (request.last_speech_end > max(request.last_endpoint, request.window_start)
              and end - request.last_speech_end >= ms_to_position(self.config.endpoint_ms)):
            request.endpoints.append(end)
            request.last_endpoint = end

    def flush(self, request_id: str) -> None:
        """Decode and commit everything received so far; the session stays open.

        An output with `flushed_ms` set tells when it is done.
        """
        request = self._request(request_id)
        if request.input_finished:
            return  # finishing commits everything anyway
        self._flush_framer(request)
        request.flush_position = max(request.num_positions, 1)
        self.scheduler.note_final_due(request)

    def finish(self, request_id: str) -> None:
        """No more audio: the next steps commit everything and end the request."""
        request = self._request(request_id)
        if not request.input_finished:
            self._flush_framer(request)
            request.input_finished = True
            self.scheduler.note_final_due(request)

    def _flush_framer(self, request: Request) -> None:
        framer = self.framers[request.request_id]
        padded = framer.num_padded
        self._add_items(request, framer.flush())
        if framer.num_padded > padded:
            self.pad_ends[request.request_id].append(framer.num_samples * 1000 // SAMPLE_RATE)
            self.pad_totals[request.request_id].append(framer.num_padded * 1000 // SAMPLE_RATE)

    def audio_ms(self, request_id: str, timeline_ms: int) -> int:
        """Session timeline ms -> ms of received audio (flush padding removed)."""
        ends = self.pad_ends.get(request_id)
        if not ends:
            return timeline_ms
        totals = self.pad_totals[request_id]
        i = bisect.bisect_right(ends, timeline_ms)  # paddings 0..i-1 end before timeline_ms
        before = totals[i - 1] if i else 0
        if i < len(ends):  # inside padding i: clamp to its start
            timeline_ms = min(timeline_ms, ends[i] - (totals[i] - before))
        return timeline_ms - before

    def _audio_words(self, request_id: str, words: list[Word]) -> list[Word]:
        if not self.pad_ends.get(request_id):
            return words
        f = self.audio_ms
        return [Word(w.text, f(request_id, w.start_ms), f(request_id, w.end_ms), w.tokens)
                for w in words]

    def abort(self, request_id: str) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            request.status = RequestStatus.ABORTED
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id)
        self.framers.pop(request_id, None)
        self.policies.pop(request_id, None)
        self.pad_ends.pop(request_id, None)
        self.pad_totals.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    @property
    def num_requests(self) -> int:
        return len(self.scheduler.requests)

    def committed_ms(self, request_id: str) -> int:
        """End of the committed text in received-audio ms (0 for unknown requests)."""
        policy = self.policies.get(request_id)
        return self.audio_ms(request_id, policy.committed_end_ms) if policy is not None else 0

    # ------------------------------------------------------------------ step

    def step(self) -> list[EngineOutput]:
        """Schedule, execute and update in one go (what a synchronous caller wants)."""
        step = self.schedule()
        if step is None:
            self.last_stats = StepStats()  # nothing ran
            return []
        return self.update_from_output(self.execute(step))

    def schedule(self) -> StepInput | None:
        """Pick this step's windows; None when there is nothing to do.

        Each scheduled request gets a -1 placeholder that update_from_output fills; until then
        the scheduler skips it, so the next step can be scheduled while this one executes.
        """
        self.stop_partials.clear()
        scheduled = self.scheduler.schedule()
        self.num_due_at_schedule = self.scheduler.num_due
        if not (scheduled.windows or scheduled.encoder_inputs or scheduled.freed_mm_hashes):
            return None
        requests = self.scheduler.requests
        inp = ModelInput(freed_mm_hashes=scheduled.freed_mm_hashes)
        for request_id, indices in scheduled.encoder_inputs.items():
            features = requests[request_id].mm_features
            for i in indices:
                inp.new_items.setdefault(features[i].identifier, features[i].data)
        for window in scheduled.windows:
            request = requests[window.request_id]
            request.output_token_ids.append(-1)  # one hypothesis pending per scheduled window
            items = request.mm_features[window.item_lo : window.item_hi]  # found by the scheduler
            pieces = window_pieces(items, window.window_start, window.window_end)
            prompt = self.policies[window.request_id].prompt_tokens(in_window=not window.preview)
            draft = self._draft(request, window.window_start, window.preview)
            inp.windows.append(WindowInput(window, pieces, prompt, draft))
        return StepInput(scheduled, inp)

    def _draft(self, request: Request, start: int, preview: bool) -> list[int]:
        """The tokens a decode of the window from `start` is likely to give: the last decode
        from there (its timestamps line up), followed, for a window that starts before the
        last final's end, by the newer preview of the audio since then, its timestamps moved
        to this window's. Verified by the decoder, so a wrong guess costs time, not text."""
        end, tokens = request.drafts.get(start, (start, []))
        if preview or request.preview_start <= start:
            return tokens
        preview_end, preview_tokens = request.drafts.get(request.preview_start, (0, []))
        if preview_end <= end:
            return tokens  # no preview since that decode
        return tokens + shift_timestamps(preview_tokens, request.preview_start - start,
                                         self.bundle.tokenizer.timestamp_begin)

    def execute(self, step: StepInput) -> RunnerOutput:
        """Run the model for a scheduled step. Safe in a worker thread while the caller adds
        audio, flushes, aborts or schedules on its own thread: it reads only the step's
        snapshot, and the scheduler never hands out a request that is in flight."""
        try:
            return self.runner.execute(step.model_input, self.stop_partials.is_set)
        except Exception as e:  # a fault outside one window's decode: fail this step's sessions
            log.exception("model runner step failed")
            error = f"{type(e).__name__}: {e}"
            return RunnerOutput([WindowResult(w.request_id, [], w.final, error=error)
                                 for w in step.scheduled.windows])

    def update_from_output(self, output: RunnerOutput) -> list[EngineOutput]:
        self.last_stats = StepStats(output.num_windows, output.num_encoder_calls,
                                    output.num_encoded_items, output.num_fallbacks)
        if output.processor_counts is not None:  # the worker's cache: keep the counters in step
            self.processor_cache.num_queries, self.processor_cache.num_hits = output.processor_counts
        outputs = []
        for result in output.results:
            request = self.scheduler.requests.get(result.request_id)
            if request is None:  # aborted while the step ran
                continue
            fill_placeholders(request.output_token_ids, [len(result.words)])
            if result.cancelled:  # a partial given up for a final: the next one shows the text
                self._keep_prefix(request, result)
                continue
            if result.error is not None:
                request.status, request.error = RequestStatus.ERROR, result.error
                self._drop(result.request_id)
                outputs.append(EngineOutput(result.request_id, [], [], finished=True,
                                            error=result.error))
                continue
            outputs.append(self._apply(request, result))
        return outputs

    @staticmethod
    def _keep_prefix(request: Request, result: WindowResult) -> None:
        """The tokens a given-up partial had decoded are the start of its window's greedy
        decode: where longer than that window's draft, they are its new draft (they cover
        newer audio: under load the draft of a final late in a burst missed its last words)."""
        start = request.preview_start if result.preview else request.window_start
        _, tokens = request.drafts.get(start, (start, []))
        if len(result.tokens) > len(tokens):
            request.drafts[start] = (request.num_decoded_positions, result.tokens)

    def _apply(self, request: Request, result: WindowResult) -> EngineOutput:
        policy = self.policies[request.request_id]
        start = request.preview_start if result.preview else request.window_start
        request.drafts[start] = (request.num_decoded_positions, result.tokens)
        if result.temperature > 0.5:
            policy.reset_prompt()  # as Whisper: text that needed a hot decode is no prompt
        end = request.num_decoded_positions
        rid = request.request_id
        if result.final:
            flushed = (request.input_finished and end == request.num_positions) or (
                0 < request.flush_position <= end)
            update = policy.flush(result.words)
            if flushed or end - request.window_start > TRIM_AFTER_POSITIONS:
                self._cut(request, end)
            # else a pause ended the utterance: it stays in the window as context for the
            # next one (a short window alone decodes worse); its words are committed
            while request.endpoints and request.endpoints[0] <= end:
                request.endpoints.popleft()
            if request.flush_position <= end:
                request.flush_position = 0
            request.preview_start = end
            self._prune_drafts(request)
            done = request.input_finished and request.window_start >= request.num_positions
            flushed_ms = self.audio_ms(rid, position_to_ms(end)) if flushed else None
            committed = self._audio_words(rid, update.committed)
            if done:
                request.status = RequestStatus.FINISHED
                self._drop(rid)
            return EngineOutput(rid, committed, [], finished=done, flushed_ms=flushed_ms)
        if result.preview:
            # only the audio past the committed words: the tentative tail to show. The policy
            # does not see it (no agreement, and a final that finds nothing new does not
            # commit it): a short window alone decodes worse, Whisper's " you" on a breath
            return EngineOutput(rid, [], self._audio_words(rid, result.words))
        # with endpointing, pauses commit; agreement commits only long unbroken speech
        agree_after = self.config.agree_after_ms if self.config.endpoint_ms is not None else 0
        pending_ms = position_to_ms(end) - policy.committed_end_ms
        update = policy.update(result.words, commit=pending_ms > agree_after)
        length = end - request.window_start
        if length >= MAX_WINDOW_POSITIONS - self.config.scheduler.decode_interval:
            # the window is nearly 30 s (a backlog, or no agreement for long): commit its
            # whole segments and go on from the last one's end timestamp, as offline
            # Whisper seeks; without one, commit all but the last seconds
            complete = ms_to_position(result.complete_ms or 0)
            if not result.silence and request.window_start < complete <= end:
                whole = policy.flush(result.words)
                update = PolicyUpdate(update.committed + whole.committed, [])
                boundary = complete
            else:
                forced = policy.force_commit_until(position_to_ms(end - FORCE_KEEP_POSITIONS))
                update = PolicyUpdate(update.committed + forced.committed, forced.tentative)
                boundary = ms_to_position(policy.committed_end_ms)
                if boundary <= request.window_start or result.silence:
                    boundary = end - FORCE_KEEP_POSITIONS
            self._cut(request, boundary)
        elif length > TRIM_AFTER_POSITIONS or (result.silence and length > FORCE_KEEP_POSITIONS):
            if result.silence:
                boundary = end - FORCE_KEEP_POSITIONS
            else:
                boundary = ms_to_position(policy.committed_end_ms)
            if boundary > request.window_start:
                self._cut(request, boundary)
        return EngineOutput(rid, self._audio_words(rid, update.committed),
                            self._audio_words(rid, update.tentative))

    def _cut(self, request: Request, position: int) -> None:
        self.scheduler.advance_window(request, self._item_floor(request, position))
        policy = self.policies[request.request_id]
        policy.cut_window(position_to_ms(request.window_start))
        request.preview_start = max(request.preview_start, request.window_start)  # committed before
        self._prune_drafts(request)

    @staticmethod
    def _prune_drafts(request: Request) -> None:
        """Keep the drafts of windows that can still be decoded: the window's and the preview's."""
        for start in [s for s in request.drafts if s not in (request.window_start, request.preview_start)]:
            del request.drafts[start]

    def _item_floor(self, request: Request, position: int) -> int:
        """Round a position down to an item boundary, never behind the window start."""
        size = self.item_positions
        return max(request.window_start, min(position, request.num_positions) // size * size)

    def final_fell_due(self, request_ids: Iterable[str]) -> bool:
        """Whether one of these sessions now waits for a final decode (a pause, a flush, its
        end) that was not due when the last step was scheduled. A final due then and left out
        of a step of partials could not be placed; giving up partials for it would starve
        them and leave it where it was."""
        requests = self.scheduler.requests
        return any(rid in requests and (requests[rid].due_number or 0) > self.num_due_at_schedule
                   for rid in request_ids)

    def has_work(self) -> bool:
        """Whether a request is ready to be scheduled (not counting those in flight)."""
        return any(self.scheduler.is_ready(r) for r in self.scheduler.requests.values())

    @property
    def healthy(self) -> bool:
        """False once the worker process the model runs in has exited."""
        return not isinstance(self.runner, RunnerProcess) or self.runner.alive

    def close(self) -> None:
        """Stop the worker process, if the model runs in one (the engine is unusable after)."""
        if isinstance(self.runner, RunnerProcess):
            self.runner.close()
