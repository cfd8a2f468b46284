"""The one task that drives the engine: applies session commands, steps, routes outputs.

Handlers never touch the engine: they queue commands here. Commands are applied on the
event loop between steps, and each step runs in a worker thread, so the event loop keeps
serving sockets while the model computes and the engine is never used by two threads at
once. Outputs go to the sink each session registered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np

from app.metrics import Metrics
from engine.engine import Engine, EngineOutput

log = logging.getLogger(__name__)

Sink = Callable[[EngineOutput], None]


class EngineLoop:
    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self.sinks: dict[str, Sink] = {}
        self.commands: list[tuple[str, str, np.ndarray | None]] = []  # (op, request id, audio)
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.stepping = False

    # -------------------------------------------------------- called by session handlers

    def open(self, request_id: str, sink: Sink) -> None:
        self.sinks[request_id] = sink
        self._queue("open", request_id)

    def add_audio(self, request_id: str, samples: np.ndarray) -> None:
        """(n,) float32 16 kHz samples."""
        if samples.size:
            self._queue("audio", request_id, samples)

    def flush(self, request_id: str) -> None:
        self._queue("flush", request_id)

    def finish(self, request_id: str) -> None:
        self._queue("finish", request_id)

    def abort(self, request_id: str) -> None:
        self.sinks.pop(request_id, None)
        self._queue("abort", request_id)

    def _queue(self, op: str, request_id: str, samples: np.ndarray | None = None) -> None:
        self.commands.append((op, request_id, samples))
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
        while True:
            self._apply_commands()
            if not self.engine.has_work():
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            start = time.perf_counter()
            self.stepping = True
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            finally:
                self.stepping = False
            self.metrics.step_time.observe(time.perf_counter() - start)
            self.metrics.steps.inc()
            stats = self.engine.last_stats
            if stats.num_encoded_items:
                self.metrics.encoder_batch.observe(stats.num_encoded_items)
            for output in outputs:
                self._route(output)

    def _apply_commands(self) -> None:
        commands, self.commands = self.commands, []
        engine = self.engine
        for op, request_id, samples in commands:
            try:
                if op == "open":
                    engine.add_request(request_id)
                elif op == "abort":
                    engine.abort(request_id)
                elif not engine.has_request(request_id):
                    continue  # the request already ended (error); the session was told
                elif op == "audio":
                    engine.add_audio(request_id, samples)
                elif op == "flush":
                    engine.flush(request_id)
                elif op == "finish":
                    engine.finish(request_id)
            except Exception as e:  # a bad command ends its session, never the loop
                log.exception("engine command %s for %s failed", op, request_id)
                engine.abort(request_id)
                self._route(EngineOutput(request_id, [], [], finished=True,
                                         error=f"{type(e).__name__}: {e}"))

    def _route(self, output: EngineOutput) -> None:
        sink = self.sinks.get(output.request_id)
        if output.finished:
            self.sinks.pop(output.request_id, None)
        if sink is None:
            return
        try:
            sink(output)
        except Exception:  # a broken sink must not stop the loop
            log.exception("delivering output of %s failed", output.request_id)
