"""The engine API: add_request / add_audio / flush / finish / abort / step. No I/O.

A caller (the server's engine loop, a test, a replay) feeds 16 kHz float32 audio and calls
step(); each step schedules windows (schedule), runs the model runner once (execute) and
applies each result to its session's stream (update_from_output), returning what changed
per session. One `Stream` (engine/stream.py) owns each session's state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from audio.vad import TurnSettings, detect
from engine.config import EngineConfig
from engine.mm_window import window_pieces
from engine.model import ModelBundle
from engine.model_runner import ModelInput, ModelRunner, RunnerOutput, WindowInput, WindowResult
from engine.processor_cache import ProcessorCache
from engine.request import RequestStatus, fill_placeholders
from engine.scheduler import Scheduler, SchedulerOutput
from engine.stream import EngineOutput, Stream, hash_key, hear
from engine.timeline import positions_to_ms
from engine.worker import RunnerProcess, WorkerError, can_share

__all__ = ["Engine", "EngineOutput", "StepInput", "StepStats"]

log = logging.getLogger(__name__)

# the worker died in this many steps with none done between: the step's input may be what
# kills it, so its sessions fail instead of being retried forever
MAX_DEATHS_IN_A_ROW = 3
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # after failed starts, before the next try


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
        self.config = config = config or EngineConfig()
        self.bundle = bundle
        self.scheduler = Scheduler(config.scheduler_config(bundle.device.type))
        self.runner = self._start_runner()
        self.streams: dict[str, Stream] = {}  # request id -> the session's state
        self.turn_streams: dict[str, Stream] = {}  # the sessions that asked for turn events
        self.last_stats = StepStats()
        self.processor_counts = (0, 0)  # the runner's processor cache: (queries, hits)
        # set (from any thread) to give up the partials-only step in flight, or the beam
        # searches of a step of finals: a final fell due
        self.stop_partials = self.runner.stop_event
        # finals numbered (Request.due_number) when the last step was scheduled: in a step of
        # partials only, those could not be placed (a full encoder cache); see final_fell_due
        self.num_due_at_schedule = 0
        self.searching = True  # finals are searched with `config.beam_size` beams (`shed`)
        self._hash_key = hash_key(bundle.model_id, config.item_samples)
        self.restarting = False  # a new model worker is starting
        self.deaths_in_a_row = 0  # steps the worker died in since one was done
        self.failed_starts = 0  # restarts in a row whose worker did not start
        self.next_restart_at = 0.0  # (monotonic) no restart is tried before
        self.num_restarts = 0
        self.runner_reset = False  # a new worker runs: the encoder cache bookkeeping is stale

    def _start_runner(self) -> ModelRunner | RunnerProcess:
        config, bundle = self.config, self.bundle
        cache_bytes = config.processor_cache_mb << 20
        worker_process = config.worker_process
        if worker_process and not can_share(bundle):
            log.warning("the model's weights do not fit in /dev/shm to share with a worker "
                        "process (in a container, raise --shm-size): the model runs in a "
                        "thread of this process, which is slower under load")
            worker_process = False
        if worker_process:
            return RunnerProcess(bundle, config.pad_seconds, config.preview_pad_seconds, cache_bytes)
        return ModelRunner(bundle, ProcessorCache(cache_bytes), config.pad_seconds,
                           config.preview_pad_seconds)

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, background: bool = False) -> None:
        """A new session; `background` for a pre-recorded file, which live sessions never
        wait behind (see Scheduler.schedule)."""
        if request_id in self.streams:
            raise ValueError(f"request {request_id!r} already exists")
        tokenizer = self.bundle.tokenizer
        stream = Stream(request_id, self.config, self._hash_key, tokenizer.timestamp_begin,
                        self.bundle.model.dims.n_mels, background, tokenizer.full_stop)
        self.streams[request_id] = stream
        self.scheduler.add_request(stream.request)

    def stream(self, request_id: str) -> Stream:
        stream = self.streams.get(request_id)
        if stream is None:
            raise KeyError(f"unknown or finished request {request_id!r}")
        return stream

    def add_audio(self, request_id: str, samples: np.ndarray) -> None:
        """Append (n,) float32 16 kHz samples to a session."""
        stream = self.stream(request_id)
        stream.add_audio(samples)
        self.scheduler.note_final_due(stream.request)  # a pause in it: the final's place in line

    def flush(self, request_id: str) -> None:
        """Decode and commit everything received so far; the session stays open.

        An output with `flushed_ms` set tells when it is done.
        """
        stream = self.stream(request_id)
        stream.flush()
        self.scheduler.note_final_due(stream.request)

    def finish(self, request_id: str) -> None:
        """No more audio: the next steps commit everything and end the request."""
        stream = self.stream(request_id)
        stream.finish()
        self.scheduler.note_final_due(stream.request)

    def set_endpoint(self, request_id: str, endpoint_ms: int) -> None:
        """The pause that ends the session's utterances from now on (Stream.set_endpoint)."""
        self.stream(request_id).set_endpoint(endpoint_ms)

    def set_turns(self, request_id: str, settings: TurnSettings | None) -> None:
        """Find the session's speech started / stopped events from now on (None: stop);
        `take_turns` hands them out."""
        stream = self.stream(request_id)
        stream.set_turns(settings)
        if settings is not None:
            self.turn_streams[request_id] = stream
        else:
            self.turn_streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.request.status = RequestStatus.ABORTED
            self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        self.turn_streams.pop(request_id, None)
        self.scheduler.finish_request(self.streams.pop(request_id).request)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.streams

    @property
    def num_requests(self) -> int:
        return len(self.streams)

    def committed_ms(self, request_id: str) -> int:
        """End of the committed text in received-audio ms (0 for unknown requests)."""
        stream = self.streams.get(request_id)
        return stream.committed_ms if stream is not None else 0

    def shed(self, shedding: bool, searching: bool = True) -> None:
        """Whether partials come less often, and whether finals are searched with beams, from
        the next schedule on (engine/load.py)."""
        self.scheduler.shedding = shedding
        self.searching = searching

    def decoded_samples(self, request_id: str) -> int | None:
        """16 kHz samples of the session the engine has looked at: decoded, or heard as
        silence since the last decode (None: unknown request)."""
        stream = self.streams.get(request_id)
        return None if stream is None else stream.looked_at_samples

    def inject(self, hashes: list[str], features: list[torch.Tensor]) -> None:
        """Add item features processed elsewhere to the runner's processor cache (in the
        worker process, where there is one): items of those content hashes skip processing."""
        self.runner.inject(hashes, features)

    def hear(self) -> None:
        """Run the VAD over the audio every stream got since the last call, the streams in one
        batch. Whatever reads where speech is (scheduling, the commit step, a final falling
        due) calls this first, so a stream's speech is always tracked up to its audio."""
        streams = [s for s in self.streams.values() if s.unheard]
        if streams:
            hear(streams, detect([s.vad for s in streams], [s.take_unheard() for s in streams]))

    def take_turns(self) -> list[EngineOutput]:
        """Hear the audio received so far -> for each session that asked for them and has
        new ones, an output with its speech started / stopped events only."""
        self.hear()
        outputs = []
        for stream in self.turn_streams.values():
            if stream.turn_events:
                outputs.append(EngineOutput(stream.request_id, [], [], turns=stream.turn_events))
                stream.turn_events = []
        return outputs

    def quiet_ms(self, request_id: str) -> int:
        """How long the VAD has heard no speech at the end of the audio it heard of the
        session (0 for unknown requests)."""
        stream = self.streams.get(request_id)
        return stream.speech.quiet_ms if stream is not None else 0

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
        if self.runner_reset:
            self._forget_encoded()
        self.hear()
        for stream in self.streams.values():
            stream.skip_silence()
        scheduled = self.scheduler.schedule(s.request for s in self.streams.values())
        self.num_due_at_schedule = self.scheduler.num_due
        if not (scheduled.windows or scheduled.encoder_inputs or scheduled.freed_mm_hashes):
            return None
        # a final's search is spent from headroom, and no other session's final waits for it:
        # none left out of the step, none in it (the step's finals are searched one by one)
        alone = sum(w.live_final for w in scheduled.windows) <= 1
        beam_size = self.config.beam_size if self.searching and alone and not self.finals_waiting() else 1
        # a partial whose words agreement may commit is searched too, as the one such window of
        # its step: several would be searched one after another, and finals due wait for the step
        commits = {w.request_id: self.streams[w.request_id].may_commit(w) for w in scheduled.windows}
        agreeing = sum(commits[w.request_id] and not w.commits_whole for w in scheduled.windows)
        inp = ModelInput(freed_mm_hashes=scheduled.freed_mm_hashes)
        for request_id, indices in scheduled.encoder_inputs.items():
            features = self.streams[request_id].request.mm_features
            for i in indices:
                inp.new_items.setdefault(features[i].identifier, features[i].data)
        for window in scheduled.windows:
            stream = self.streams[window.request_id]
            request = stream.request
            request.output_token_ids.append(-1)  # one hypothesis pending per scheduled window
            items = request.mm_features[window.item_lo : window.item_hi]  # found by the scheduler
            pieces = window_pieces(items, window.window_start, window.window_end)
            # a preview, or a final's second reading (Stream.doubt), starts at the last final's
            # end: the committed words before it are its prompt (those partials committed past
            # it, in an utterance too long to wait for its pause, it reads again)
            past = window.preview or window.window_start != request.window_start
            since = positions_to_ms(window.window_start) if past else None
            prompt = stream.policy.prompt_tokens(self.config.prompt_tokens, since,
                                                 timestamp_begin=stream.timestamp_begin)
            draft = stream.draft(window.window_start, window.preview)
            inp.windows.append(WindowInput(window, pieces, prompt, draft,
                                           stream.forced(window.window_start, window.preview),
                                           commits[window.request_id], stream.heard_speech(window),
                                           beam_size if window.commits_whole or agreeing <= 1 else 1))
        return StepInput(scheduled, inp)

    def execute(self, step: StepInput) -> RunnerOutput:
        """Run the model for a scheduled step. Safe in a worker thread while the caller adds
        audio, flushes, aborts or schedules on its own thread: it reads only the step's
        snapshot, and the scheduler never hands out a request that is in flight."""
        try:
            output = self.runner.execute(step.model_input, self.stop_partials.is_set)
            self.deaths_in_a_row = 0
            return output
        except WorkerError as e:
            log.error("model step failed: %s", e)
            self.deaths_in_a_row += 1
            restarted = self.restart_runner()
            if restarted and self.deaths_in_a_row < MAX_DEATHS_IN_A_ROW:  # scheduled again
                return RunnerOutput([WindowResult(w.request_id, [], w.final, w.preview, cancelled=True)
                                     for w in step.scheduled.windows])
            if restarted:
                log.error("the model worker died in %d steps in a row: failing the sessions of the "
                          "last one", self.deaths_in_a_row)
            self.deaths_in_a_row = 0
            error = f"{type(e).__name__}: {e}"
            return RunnerOutput([WindowResult(w.request_id, [], w.final, error=error)
                                 for w in step.scheduled.windows])
        except Exception as e:  # a fault outside one window's decode: fail this step's sessions
            log.exception("model runner step failed")
            error = f"{type(e).__name__}: {e}"
            return RunnerOutput([WindowResult(w.request_id, [], w.final, error=error)
                                 for w in step.scheduled.windows])

    def update_from_output(self, output: RunnerOutput) -> list[EngineOutput]:
        """The commit step: apply each window's result to its stream."""
        self.hear()
        self.last_stats = StepStats(output.num_windows, output.num_encoder_calls,
                                    output.num_encoded_items, output.num_fallbacks)
        self.processor_counts = output.processor_counts
        outputs = []
        for result in output.results:
            stream = self.streams.get(result.request_id)
            if stream is None:  # aborted while the step ran
                continue
            fill_placeholders(stream.request.output_token_ids, [len(result.words)])
            if result.cancelled:  # a partial given up for a final: the next one shows the text
                stream.keep_prefix(result.tokens, result.preview)
                continue
            if result.error is not None:
                out = stream.fail(result.error)
            else:
                out = stream.apply(result)
                self.scheduler.free_behind_window(stream.request)
            if out.finished:
                self._drop(result.request_id)
            outputs.append(out)
        return outputs

    def final_fell_due(self, request_ids: Iterable[str]) -> bool:
        """Whether one of these sessions now waits for a final decode (a pause, a flush, its
        end) that was not due when the last step was scheduled. A final due then and left out
        of a step of partials could not be placed; giving up partials for it would starve
        them and leave it where it was."""
        self.hear()
        streams = self.streams
        return any(rid in streams and not streams[rid].request.background
                   and (streams[rid].request.due_number or 0) > self.num_due_at_schedule
                   for rid in request_ids)

    def finals_waiting(self) -> bool:
        """Whether a live session's final is due and not scheduled (left out of the last
        step, or behind a window of its own in flight)."""
        return any(s.request.due_number is not None and not s.request.background
                   for s in self.streams.values())

    def has_work(self) -> bool:
        """Whether a request is ready to be scheduled (not counting those in flight)."""
        self.hear()
        return any(self.scheduler.is_ready(s.request) for s in self.streams.values())

    def restart_runner(self) -> bool:
        """Start the model worker again after it died (from any thread) -> whether one runs.
        A worker that does not start is tried again after a growing pause (RESTART_BACKOFF_S)."""
        if not isinstance(self.runner, RunnerProcess) or time.monotonic() < self.next_restart_at:
            return False
        self.restarting = True
        try:
            self.runner.restart()
        except WorkerError as e:
            pause = RESTART_BACKOFF_S[min(self.failed_starts, len(RESTART_BACKOFF_S) - 1)]
            self.failed_starts += 1
            self.next_restart_at = time.monotonic() + pause
            log.error("the model worker did not start again (%s); next try in %g s", e, pause)
            return False
        finally:
            self.restarting = False
        self.failed_starts = 0
        self.num_restarts += 1
        self.runner_reset = True
        log.warning("the model worker process died and was started again")
        return True

    def _forget_encoded(self) -> None:
        """A new worker has no encoded items: the next step encodes again what requests use."""
        self.runner_reset = False
        self.scheduler.reset_encoder_cache(s.request for s in self.streams.values())

    @property
    def healthy(self) -> bool:
        """False while the worker process the model runs in is dead or restarting."""
        return self.runner.alive and not self.restarting

    def close(self) -> None:
        """Stop the worker process, if the model runs in one (the engine is unusable after)."""
        self.runner.close()
