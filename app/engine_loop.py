"""The one task that drives the engine: applies session commands, steps, routes outputs.

Handlers never touch the engine: they queue commands here. Commands, scheduling and output
updates run on the event loop; only `Engine.execute` (the model) runs in a worker thread,
on a snapshot of the scheduled requests (with `EngineConfig.worker_process`, the server's
default, that thread only waits for the model's worker process), so the event loop keeps
serving sockets and applying commands while the model computes. Outputs go to the sink
each session registered.

The loop also knows each session's backlog: audio received but not yet looked at by the
model. Sessions use it to warn clients that push faster than the engine keeps up, and to
stop reading from their socket (TCP backpressure) while the backlog is over a bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.metrics import Metrics
from audio.vad import TurnSettings
from engine.engine import Engine, EngineOutput, StepInput
from engine.load import LoadMeter
from engine.model_runner import RunnerOutput
from engine.timeline import samples_to_seconds

log = logging.getLogger(__name__)

Sink = Callable[[EngineOutput], None]
IDLE_POLL_S = 0.05  # a ready request the scheduler could not place is retried this often
HEALTH_POLL_S = 1.0  # while idle, whether the model worker still runs is checked this often


@dataclass
class Route:
    """Where a session's outputs go, and how much audio it has sent the engine."""

    sink: Sink
    num_received: int = 0  # 16 kHz samples queued for the engine


class EngineLoop:
    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self.routes: dict[str, Route] = {}  # request id -> its route, while the session is open
        self.commands: list[tuple[str, str, Any]] = []  # (op, request id, audio or settings)
        self.wakeup = asyncio.Event()
        self.stepped = asyncio.Condition()  # notified after every step
        self.task: asyncio.Task | None = None
        self.load = LoadMeter()  # the share of time on live finals: what to shed, whom to admit

    # -------------------------------------------------------- called by session handlers

    def open(self, request_id: str, sink: Sink, background: bool = False) -> None:
        """A live session, or with `background` a pre-recorded file (Engine.add_request)."""
        self.routes[request_id] = Route(sink)
        self._queue("open_background" if background else "open", request_id)

    def add_audio(self, request_id: str, samples: np.ndarray) -> None:
        """(n,) float32 16 kHz samples."""
        route = self.routes.get(request_id)
        if samples.size and route is not None:
            route.num_received += samples.size
            self._queue("audio", request_id, samples)

    def flush(self, request_id: str) -> None:
        self._queue("flush", request_id)

    def set_endpoint(self, request_id: str, endpoint_ms: int) -> None:
        """The pause that ends the session's utterances from now on (Engine.set_endpoint)."""
        self._queue("endpoint", request_id, endpoint_ms)

    def set_turns(self, request_id: str, settings: TurnSettings | None) -> None:
        """The session's speech started / stopped events from now on come to its sink as
        outputs of their own (EngineOutput.turns); None: no more."""
        self._queue("turns", request_id, settings)

    def finish(self, request_id: str) -> None:
        self._queue("finish", request_id)

    def abort(self, request_id: str) -> None:
        self.routes.pop(request_id, None)
        self._queue("abort", request_id)

    def backlog_s(self, request_id: str) -> float:
        """Seconds of a session's audio received but not yet decoded (0 once it ended)."""
        route = self.routes.get(request_id)
        decoded = self.engine.decoded_samples(request_id)
        if route is None or decoded is None:
            return 0.0
        return samples_to_seconds(max(0, route.num_received - decoded))

    def quiet_ms(self, request_id: str) -> int:
        """How long the VAD has heard no speech at the end of the session's audio it heard."""
        return self.engine.quiet_ms(request_id)

    def max_backlog_s(self) -> float:
        return max((self.backlog_s(rid) for rid in self.routes), default=0.0)

    async def wait_backlog_below(self, request_id: str, seconds: float) -> None:
        """Return once the session's backlog is under `seconds` (or the session ended)."""
        async with self.stepped:
            await self.stepped.wait_for(lambda: self.backlog_s(request_id) < seconds)

    def _queue(self, op: str, request_id: str, payload: Any = None) -> None:
        self.commands.append((op, request_id, payload))
        self.wakeup.set()

    # -------------------------------------------------------- the loop

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name="engine-loop")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass

    async def run(self) -> None:
        """Apply commands, schedule, execute in a worker thread, route the outputs; repeat.

        A step is scheduled only once the previous one's outputs are applied, so it sees
        every final that fell due meanwhile. (Scheduling step N+1 while step N runs, as the
        engine allows, left such a final for step N+2: on the CPU, where a step is the
        whole machine's work for hundreds of ms, that cost more than the overlap saved.)
        The event loop keeps serving sockets while the model computes.
        """
        engine = self.engine
        while True:
            if not engine.healthy and not engine.restarting:  # the worker died between steps
                await asyncio.to_thread(engine.restart_runner)
                if not engine.healthy:  # it did not start: sessions wait (their audio queues)
                    self._apply_commands()
                    await asyncio.sleep(HEALTH_POLL_S)
                    continue
            self._apply_commands()
            engine.shed(self.load.update(time.perf_counter()), self.load.searching)
            step = engine.schedule()
            if step is not None:
                started = time.perf_counter()
                output = await self._execute(step)
                self._record(started, step, output)
                for result in engine.update_from_output(output):
                    self._route(result)
                async with self.stepped:
                    self.stepped.notify_all()
                continue
            self.wakeup.clear()
            if not self.commands:  # idle until a command; poll while the encoder budget blocks
                timeout = IDLE_POLL_S if engine.has_work() else HEALTH_POLL_S
                try:
                    await asyncio.wait_for(self.wakeup.wait(), timeout)
                except TimeoutError:
                    pass

    async def _execute(self, step: StepInput) -> RunnerOutput:
        """Run the step in a worker thread; meanwhile apply the commands that come in, and
        when one makes a final due while the step has partials only (or a background file's
        windows), give that step up (its sessions get their next partial later, the file its
        window, drafted from the tokens so far): a final waits for at most one decoder call,
        not for a batch of partials or a file's decode. In a step of finals, another session's
        final gives up their beam searches (they keep their greedy decodes) the same way."""
        engine = self.engine
        running = asyncio.ensure_future(asyncio.to_thread(engine.execute, step))
        finals = {w.request_id for w in step.scheduled.windows if w.live_final}
        while True:
            if self.commands:
                # (a session's own next final waits for this step's final anyway)
                touched = self._apply_commands() - finals
                if not engine.stop_partials.is_set() and engine.final_fell_due(touched):
                    engine.stop_partials.set()
            if running.done():
                return running.result()
            self.wakeup.clear()  # no command can come in between: this is the event loop
            woken = asyncio.ensure_future(self.wakeup.wait())
            await asyncio.wait({running, woken}, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()

    def _record(self, started: float, step: StepInput, output: RunnerOutput) -> None:
        now = time.perf_counter()
        self.load.record(started, now, (w.request_id for w in step.scheduled.windows if w.live_final))
        self.metrics.load.set(self.load.share(now))
        self.metrics.shedding.set(self.load.shedding)
        self.metrics.searching.set(self.load.searching and self.engine.config.beam_size > 1)
        self.metrics.step_time.observe(now - started)
        self.metrics.steps.inc()
        if output.num_fallbacks:
            self.metrics.fallbacks.inc(output.num_fallbacks)
        if output.num_encoded_items:
            self.metrics.encoder_batch.observe(output.num_encoded_items)
        if output.num_threads:
            self.metrics.model_threads.set(output.num_threads)

    def _apply_commands(self) -> set[str]:
        """Apply the queued commands, and send the turn events the audio brought -> the
        request ids they were for."""
        commands, self.commands = self.commands, []
        engine = self.engine
        for op, request_id, payload in commands:
            try:
                if op in ("open", "open_background"):
                    engine.add_request(request_id, background=op == "open_background")
                elif op == "abort":
                    engine.abort(request_id)
                elif not engine.has_request(request_id):
                    continue  # the request already ended (error); the session was told
                elif op == "audio":
                    engine.add_audio(request_id, payload)
                elif op == "turns":
                    engine.set_turns(request_id, payload)
                elif op == "endpoint":
                    engine.set_endpoint(request_id, payload)
                elif op == "flush":
                    engine.flush(request_id)
                elif op == "finish":
                    engine.finish(request_id)
            except Exception as e:  # a bad command ends its session, never the loop
                log.exception("engine command %s for %s failed", op, request_id)
                engine.abort(request_id)
                self._route(EngineOutput(request_id, [], [], finished=True,
                                         error=f"{type(e).__name__}: {e}"))
        if commands:
            for output in engine.take_turns():
                self._route(output)
        return {request_id for _, request_id, _ in commands}

    def _route(self, output: EngineOutput) -> None:
        route = self.routes.get(output.request_id)
        if output.finished:
            self.routes.pop(output.request_id, None)
        if route is None:
            return
        try:
            route.sink(output)
        except Exception:  # a broken sink must not stop the loop
            log.exception("delivering output of %s failed", output.request_id)
