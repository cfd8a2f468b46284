"""The model runner in a worker process, as vLLM runs its engine core apart from the server.

In a thread, the model runner shares one interpreter lock with the server's event loop and
the engine's Python. A decode is hundreds of small torch calls, each giving the lock up and
taking it back, and each time it may wait for the event loop: with 8 sessions on 2 CPU
cores, the same steps took 40-60% longer in the server than alone (docs/performance.md). In a process of
its own the runner has an interpreter to itself.

`RunnerProcess` has the runner's `execute(ModelInput, stop)`. The worker gets each step's
ModelInput through a pipe and sends back the RunnerOutput. The model's weights are shared
with it, not copied (torch.multiprocessing: shared memory on the CPU, CUDA IPC on a GPU).
Giving up a step of partials, or the beam searches of a step of finals, goes through an
event both processes see (`stop_event`, which the engine uses as its `stop_partials`). If the
worker dies, the step in flight raises WorkerError; the engine starts a new worker
(`restart`) and schedules the step's windows again. A worker whose server died (kill -9)
exits within `PARENT_POLL_S`: the pipe's end tells it only once it is waiting for a step.

The worker takes this process's torch threads with it: while one runs, this process's own
torch work (the VAD, a few small ops a chunk) runs on one thread. At two threads here too, each
of its small ops would wake a second thread that spins on a core the worker computes on, and
the worker's steps, split over both cores, would wait for it: finals fall tens of seconds
behind (docs/performance.md). The threads come back when the last worker of the process is
closed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

from engine.cpu_share import CpuShare
from engine.model import ModelBundle
from engine.model.loader import use_planless_attention
from engine.model_runner import ModelInput, ModelRunner, RunnerOutput
from engine.processor_cache import ProcessorCache

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
KEEP_FREED_BYTES = 1 << 30  # free memory the worker's heap keeps at its top
START_TIMEOUT_S = 300.0  # the worker imports torch and maps the shared weights
STOP_TIMEOUT_S = 10.0
PARENT_POLL_S = 0.5


class WorkerError(RuntimeError):
    """The model worker process did not start, or exited."""


def shared_bytes(bundle: ModelBundle) -> int:
    """Bytes of the model's CPU tensors that sharing with a worker moves to /dev/shm."""
    model = bundle.model
    tensors = [*model.parameters(), *model.buffers(), model.decoder.projection]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if t is not None and t.device.type == "cpu" and not t.is_shared()}
    return sum(storages.values())


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm, where shared CPU tensors live (None: no such place to ask)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def can_share(bundle: ModelBundle) -> bool:
    """Whether the model's weights fit in /dev/shm (a container's default is 64 MB; writing
    past it kills the process with SIGBUS instead of raising)."""
    free = shm_free_bytes()
    return free is None or shared_bytes(bundle) * 1.1 < free


def _serve(conn: Connection, stop_event: Any, bundle: ModelBundle, pad_seconds: int | None,
           preview_pad_seconds: int | None, processor_cache_bytes: int, num_threads: int) -> None:
    """The worker's loop: a ModelInput in, its RunnerOutput (or exception) out; an Inject in,
    None out; until it gets None or the engine's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server, which stops us
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    keep_freed_memory()
    torch.set_num_threads(num_threads)
    use_planless_attention(bundle.model.device)
    share = CpuShare(num_threads, [os.getpid(), os.getppid()])
    runner = ModelRunner(bundle, ProcessorCache(processor_cache_bytes), pad_seconds, preview_pad_seconds)
    conn.send("ready")
    while True:
        try:
            inp = conn.recv()
        except EOFError:  # the engine's process is gone
            return
        if inp is None:
            return
        try:
            if isinstance(inp, Inject):
                runner.inject(inp.hashes, inp.features)
                conn.send(None)
            else:
                threads = share.update()
                if threads != torch.get_num_threads():
                    log.warning("model worker: %d torch threads (other programs use %.1f of %d cores)",
                                threads, share.others, share.num_cpus)
                    torch.set_num_threads(threads)
                output = runner.execute(inp, stop_event.is_set)
                output.num_threads = threads
                conn.send(output)
        except Exception as e:  # the engine fails this step's sessions with it
            try:
                conn.send(e)
            except Exception:  # it does not pickle
                conn.send(RuntimeError(f"{type(e).__name__}: {e}"))


def keep_freed_memory() -> bool:
    """Have glibc keep the memory a step frees for the next step -> whether it took it.
    A step allocates the same big buffers again and again (a batch's activations, tens of
    MB each). By default glibc maps each block over its threshold (at most 32 MB) afresh and
    unmaps it when freed, and hands a freed heap top back to the system: every step faults
    in and zeroes again the pages it just gave back. Served from a heap that keeps up to
    KEEP_FREED_BYTES free, the worker stays at its peak instead. Another C library has no
    mallopt: nothing changes there."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES)) and bool(mallopt(M_MMAP_MAX, 0))


def _exit_with_parent(parent: int) -> None:
    """End this process soon after its server died, even in the middle of a step."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


@dataclass
class Inject:
    """Features processed elsewhere, for the worker's processor cache (ModelRunner.inject)."""

    hashes: list[str]
    features: list[torch.Tensor]


class _LentThreads:
    """This process's torch threads while workers compute on its cores: one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.workers = 0
        self.threads = 0  # the process's threads before the first worker took them

    def take(self) -> int:
        """For a new worker -> the threads it runs with (this process keeps one)."""
        with self._lock:
            if self.workers == 0:
                self.threads = torch.get_num_threads()
                torch.set_num_threads(1)
            self.workers += 1
            return self.threads

    def give_back(self) -> None:
        with self._lock:
            self.workers -= 1
            if self.workers == 0:
                torch.set_num_threads(self.threads)


_lent = _LentThreads()


class RunnerProcess:
    """A ModelRunner in a worker process; one step at a time. The worker runs with this
    process's torch threads, and this process keeps one until `close()`."""

    def __init__(self, bundle: ModelBundle, pad_seconds: int | None = None,
                 preview_pad_seconds: int | None = None, processor_cache_bytes: int = 64 << 20):
        self.closed = False  # by close(): no restart then
        self._mp = mp.get_context("spawn")
        self.stop_event = self._mp.Event()
        self._lock = threading.Lock()  # a step's send and its reply belong together
        self.num_threads = _lent.take()
        self._args = (self.stop_event, bundle, pad_seconds, preview_pad_seconds,
                      processor_cache_bytes, self.num_threads)
        try:
            self._start()
        except BaseException:
            _lent.give_back()
            raise

    def _start(self) -> None:
        self._conn, child = self._mp.Pipe()
        self.process = self._mp.Process(target=_serve, name="voxtide-model", daemon=True,
                                        args=(child, *self._args))
        self.process.start()
        child.close()  # the worker holds the other end once started: its exit ends our recv()
        if not self._wait_ready():
            self._conn.close()
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)
            raise WorkerError(f"the model worker process did not start "
                              f"(exit code {self.process.exitcode})")

    def restart(self) -> None:
        """Start a new worker in place of one that died (its encoder and processor caches
        are gone with it). WorkerError if it does not start."""
        with self._lock:
            if self.closed:
                raise WorkerError("the model worker process was stopped")
            self._conn.close()
            if self.process.is_alive():
                self.process.kill()
            self.process.join(STOP_TIMEOUT_S)
            self.stop_event.clear()
            self._start()

    def _wait_ready(self) -> bool:
        """Wait for the worker's "ready", or its exit (a worker that dies while starting may
        never have taken its end of the pipe, so the pipe alone would not tell)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._conn.poll(0.5):
                try:
                    return self._conn.recv() == "ready"
                except EOFError:
                    return False
            if not self.process.is_alive():
                return False
        return False

    @property
    def alive(self) -> bool:
        return self.process.is_alive() and not self._conn.closed

    def execute(self, inp: ModelInput, stop: Callable[[], bool] | None = None) -> RunnerOutput:
        """Run one step in the worker. A step of partials (a step of finals' searches) is given
        up when `stop_event` is set (the engine's `stop_partials`); `stop` itself cannot cross
        to the worker."""
        return self._call(inp)

    def inject(self, hashes: list[str], features: list[torch.Tensor]) -> None:
        """Add features processed elsewhere to the worker's processor cache."""
        self._call(Inject(hashes, features))

    def _call(self, message: Any) -> Any:
        """Send a message to the worker and return its reply (raise what it raised)."""
        with self._lock:
            if self._conn.closed:
                raise WorkerError("the model worker process was stopped")
            try:
                self._conn.send(message)
                reply = self._conn.recv()
            except (EOFError, OSError) as e:
                self.process.join(1.0)
                raise WorkerError(f"the model worker process exited "
                                  f"(exit code {self.process.exitcode})") from e
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        """Ask the worker to exit; terminate it if it does not."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            _lent.give_back()
            if not self._conn.closed:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
                self._conn.close()
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.warning("the model worker process did not exit; terminating it")
            self.process.terminate()
            self.process.join()
