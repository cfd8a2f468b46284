"""The engine API: add_request / add_audio / flush / finish / abort / step. No I/O.

A caller (the server's engine loop, a test, a replay) feeds 16 kHz float32 audio and calls
step(); each step schedules windows, runs the model runner once, applies the commit policy
and returns what changed per session.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from audio.frames import ITEM_SAMPLES, STREAM_LOG_FLOOR, AudioFramer
from engine.model import ModelBundle
from engine.model_runner import ModelRunner, RunnerOutput, WindowResult
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
from engine.scheduler import MAX_WINDOW_POSITIONS, Scheduler, SchedulerConfig

TRIM_AFTER_POSITIONS = 15 * POSITIONS_PER_SECOND  # cut the window at a commit once over 15 s
FORCE_KEEP_POSITIONS = 5 * POSITIONS_PER_SECOND  # near 30 s, force-commit all but the last 5 s


def ms_to_position(ms: int) -> int:
    return ms * POSITIONS_PER_SECOND // 1000


def position_to_ms(position: int) -> int:
    return position * 1000 // POSITIONS_PER_SECOND


@dataclass
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    item_samples: int = ITEM_SAMPLES  # 80 ms audio items
    processor_cache_bytes: int = 64 << 20


@dataclass
class EngineOutput:
    request_id: str
    committed: list[Word]  # newly committed words (final, never rewritten)
    tentative: list[Word]  # current tentative tail (replaces the previous one)
    finished: bool = False  # the request is done; no more outputs
    flushed: bool = False  # everything received so far is committed
    error: str | None = None


@dataclass
class StepStats:
    num_windows: int = 0
    num_encoder_calls: int = 0
    num_encoded_items: int = 0


class Engine:
    def __init__(self, bundle: ModelBundle, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.bundle = bundle
        self.scheduler = Scheduler(self.config.scheduler)
        self.processor_cache = ProcessorCache(self.config.processor_cache_bytes)
        self.runner = ModelRunner(bundle, self.processor_cache)
        self.item_positions = self.config.item_samples // SAMPLES_PER_POSITION  # 4 for 80 ms
        self.framers: dict[str, AudioFramer] = {}
        self.policies: dict[str, LocalAgreement] = {}
        self.last_stats = StepStats()
        params = f"{bundle.model_id}:{self.config.item_samples}:{STREAM_LOG_FLOOR}"
        self._hash_key = hashlib.blake2b(params.encode(), digest_size=16).digest()

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str) -> None:
        self.scheduler.add_request(Request(request_id))
        self.framers[request_id] = AudioFramer(self.config.item_samples)
        self.policies[request_id] = LocalAgreement()

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

    def _add_items(self, request: Request, contexts: list[np.ndarray]) -> None:
        for context in contexts:
            digest = hashlib.blake2b(context.tobytes(), key=self._hash_key, digest_size=16)
            offset = request.num_positions
            request.mm_features.append(
                MMFeature(digest.hexdigest(), PlaceholderRange(offset, self.item_positions), context))

    def flush(self, request_id: str) -> None:
        """Decode and commit everything received so far (the session stays open)."""
        request = self._request(request_id)
        self._add_items(request, self.framers[request_id].flush())
        request.flush_requested = True

    def finish(self, request_id: str) -> None:
        """No more audio: the next steps commit everything and end the request."""
        request = self._request(request_id)
        if not request.input_finished:
            self._add_items(request, self.framers[request_id].flush())
            request.input_finished = True

    def abort(self, request_id: str) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            request.status = RequestStatus.ABORTED
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id)
        self.framers.pop(request_id, None)
        self.policies.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    @property
    def num_requests(self) -> int:
        return len(self.scheduler.requests)

    def committed_ms(self, request_id: str) -> int:
        policy = self.policies.get(request_id)
        return policy.committed_end_ms if policy is not None else 0

    # ------------------------------------------------------------------ step

    def step(self) -> list[EngineOutput]:
        scheduled = self.scheduler.schedule()
        requests = self.scheduler.requests
        prompts = {}
        for window in scheduled.windows:
            request = requests[window.request_id]
            request.output_token_ids.append(-1)  # one hypothesis pending per scheduled window
            prompts[window.request_id] = self.policies[window.request_id].prompt_tokens()
        runner_output = self.runner.execute(scheduled, requests, prompts)
        return self.update_from_output(runner_output)

    def update_from_output(self, output: RunnerOutput) -> list[EngineOutput]:
        self.last_stats = StepStats(output.num_windows, output.num_encoder_calls,
                                    output.num_encoded_items)
        outputs = []
        for result in output.results:
            request = self.scheduler.requests.get(result.request_id)
            if request is None:  # aborted while the step ran
                continue
            fill_placeholders(request.output_token_ids, [len(result.words)])
            if result.error is not None:
                request.status, request.error = RequestStatus.ERROR, result.error
                self._drop(result.request_id)
                outputs.append(EngineOutput(result.request_id, [], [], finished=True,
                                            error=result.error))
                continue
            outputs.append(self._apply(request, result))
        return outputs

    def _apply(self, request: Request, result: WindowResult) -> EngineOutput:
        policy = self.policies[request.request_id]
        end = request.num_decoded_positions
        if result.final:
            update = policy.flush(result.words)
            self._cut(request, end)
            request.flush_requested = False
            done = request.input_finished and request.window_start >= request.num_positions
            if done:
                request.status = RequestStatus.FINISHED
                self._drop(request.request_id)
            return EngineOutput(request.request_id, update.committed, [], finished=done,
                                flushed=True)
        update = policy.update(result.words)
        length = end - request.window_start
        if length >= MAX_WINDOW_POSITIONS - self.config.scheduler.decode_interval:
            # the window is nearly 30 s: commit all but the last seconds
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
        return EngineOutput(request.request_id, update.committed, update.tentative)

    def _cut(self, request: Request, position: int) -> None:
        self.scheduler.advance_window(request, self._item_floor(request, position))
        policy = self.policies[request.request_id]
        policy.cut_window(position_to_ms(request.window_start))

    def _item_floor(self, request: Request, position: int) -> int:
        """Round a position down to an item boundary, never behind the window start."""
        size = self.item_positions
        return max(request.window_start, min(position, request.num_positions) // size * size)

    def has_work(self) -> bool:
        return any(self.scheduler.is_ready(r) for r in self.scheduler.requests.values())
