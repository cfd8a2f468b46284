"""Prometheus text-format metrics: counters, gauges and histograms, no client library.

The server owns one `Metrics`; sessions and the engine loop update it on the event loop,
and /metrics renders it (plus values read at render time, like per-session lag).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)  # seconds
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # items per encoder call


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    kind = "counter"

    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def samples(self) -> Iterable[str]:
        for key, value in self.values.items():
            yield f"{self.name}{_labels(dict(key))} {_number(value)}"


class Gauge:
    """A value read when /metrics renders: `fn` returns {labels tuple: value} or one float."""

    kind = "gauge"

    def __init__(self, name: str, help: str, fn: Callable[[], float | dict]):
        self.name, self.help, self.fn = name, help, fn

    def samples(self) -> Iterable[str]:
        value = self.fn()
        items = value.items() if isinstance(value, dict) else [((), value)]
        for key, v in items:
            yield f"{self.name}{_labels(dict(key))} {_number(v)}"


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help = name, help
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: above the largest bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self) -> Iterable[str]:
        cumulative = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            cumulative += n
            yield f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}'
        yield f"{self.name}_sum {_number(self.sum)}"
        yield f"{self.name}_count {self.count}"


class Metrics:
    def __init__(self) -> None:
        self.families: list[Counter | Gauge | Histogram] = []
        self.sessions_total = self.counter("voxtide_sessions_total", "Sessions opened, by protocol")
        self.sessions_rejected = self.counter("voxtide_sessions_rejected_total",
                                              "Connections refused, by reason")
        self.sessions_resumed = self.counter("voxtide_sessions_resumed_total",
                                             "Sessions taken over by a new connection (resume token)")
        self.rate_limited = self.counter("voxtide_rate_limited_total",
                                         "rate_limited warnings sent (a session's backlog over max_lag)")
        self.audio_seconds = self.counter("voxtide_audio_seconds_total", "Audio received (16 kHz s)")
        self.client_errors = self.counter("voxtide_client_errors_total",
                                          "Error events sent to clients, by code")
        self.first_partial = self.histogram("voxtide_time_to_first_partial_seconds",
                                            "First audio received -> first text sent, per session")
        self.final_latency = self.histogram("voxtide_partial_to_final_seconds",
                                            "A word first shown as partial -> committed as final")
        self.step_time = self.histogram("voxtide_engine_step_seconds", "Engine step wall time")
        self.encoder_batch = self.histogram("voxtide_encoder_batch_items",
                                            "Audio items per batched encoder call", BATCH_BUCKETS)
        self.steps = self.counter("voxtide_engine_steps_total", "Engine steps run")
        self.fallbacks = self.counter("voxtide_decode_fallbacks_total",
                                      "Windows re-decoded at a higher temperature (loops, low confidence)")

    def counter(self, name: str, help: str) -> Counter:
        metric = Counter(name, help)
        self.families.append(metric)
        return metric

    def histogram(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        metric = Histogram(name, help, buckets)
        self.families.append(metric)
        return metric

    def gauge(self, name: str, help: str, fn: Callable[[], float | dict]) -> Gauge:
        metric = Gauge(name, help, fn)
        self.families.append(metric)
        return metric

    def render(self) -> str:
        lines = []
        for metric in self.families:
            lines.append(f"# HELP {metric.name} {metric.help}")
            lines.append(f"# TYPE {metric.name} {metric.kind}")
            lines.extend(metric.samples())
        return "\n".join(lines) + "\n"
