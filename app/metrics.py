"""The server's Prometheus metrics, through prometheus-client.

The server owns one `Metrics` with a registry of its own (two servers in one process, as in
the tests, do not mix); sessions and the engine loop update it on the event loop. Counters
the engine keeps itself (cache lookups) are read at scrape time and exposed as counters;
values of the moment (open sessions, the largest lag) are gauges. No label takes a
per-session value: the number of series stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)  # seconds
LAG_BUCKETS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0)  # seconds
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # items per encoder call
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _CounterFunction(Collector):
    """A counter whose value something else keeps (read when scraped)."""

    def __init__(self, name: str, help: str, fn: Callable[[], float]):
        self.name, self.help, self.fn = name, help, fn

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.help, value=self.fn())


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.sessions_total = Counter("voxtide_sessions", "Sessions opened, by protocol",
                                      ["protocol"], registry=r)
        self.sessions_rejected = Counter("voxtide_sessions_rejected", "Connections refused, by reason",
                                         ["reason"], registry=r)
        self.sessions_resumed = Counter("voxtide_sessions_resumed",
                                        "Sessions taken over by a new connection (resume token)",
                                        ["protocol"], registry=r)
        self.rate_limited = Counter("voxtide_rate_limited",
                                    "rate_limited warnings sent (a session's backlog over max_lag, "
                                    "or partials shed for load)",
                                    ["protocol"], registry=r)
        self.audio_seconds = Counter("voxtide_audio_seconds", "Audio received by sessions (s)",
                                     registry=r)
        self.uploads = Counter("voxtide_uploads", "Files transcribed over HTTP, by endpoint and outcome",
                               ["endpoint", "outcome"], registry=r)
        self.upload_audio_seconds = Counter("voxtide_upload_audio_seconds",
                                            "Audio of files transcribed over HTTP (s)", registry=r)
        self.store_failures = Counter("voxtide_store_failures",
                                      "Finals the transcript store could not write when they came "
                                      "(kept and written later)", registry=r)
        self.recovered_audio_seconds = Counter("voxtide_recovered_audio_seconds",
                                               "Spooled audio a previous run left, transcribed at start (s)",
                                               registry=r)
        self.client_errors = Counter("voxtide_client_errors", "Error events sent to clients, by code",
                                     ["code"], registry=r)
        self.first_partial = Histogram("voxtide_time_to_first_partial_seconds",
                                       "First audio received -> first text sent, per session",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.final_latency = Histogram("voxtide_partial_to_final_seconds",
                                       "A word first shown as partial -> committed as final",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.session_lag = Histogram("voxtide_session_lag_seconds",
                                     "A session's audio received - audio committed, at each final",
                                     buckets=LAG_BUCKETS, registry=r)
        self.step_time = Histogram("voxtide_engine_step_seconds", "Engine step wall time",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.encoder_batch = Histogram("voxtide_encoder_batch_items",
                                       "Audio items per batched encoder call", buckets=BATCH_BUCKETS,
                                       registry=r)
        self.steps = Counter("voxtide_engine_steps", "Engine steps run", registry=r)
        self.model_threads = Gauge("voxtide_model_threads", "Torch threads of the model worker "
                                   "(fewer while other programs keep cores busy)", registry=r)
        self.load = Gauge("voxtide_engine_load", "Share of the last 20 s the model spent on "
                          "steps with a live final (engine/load.py)", registry=r)
        self.shedding = Gauge("voxtide_engine_shedding", "1 while partials come less often for load",
                              registry=r)
        self.searching = Gauge("voxtide_engine_searching", "1 while the load leaves headroom for "
                               "live finals' beam searches (beam_size over 1)", registry=r)
        self.fallbacks = Counter("voxtide_decode_fallbacks",
                                 "Windows re-decoded at a higher temperature (loops, low confidence)",
                                 registry=r)

    def gauge(self, name: str, help: str, fn: Callable[[], float]) -> None:
        """A value of the moment, read when scraped."""
        Gauge(name, help, registry=self.registry).set_function(fn)

    def counter_function(self, name: str, help: str, fn: Callable[[], float]) -> None:
        """A count kept elsewhere (it only grows), read when scraped."""
        self.registry.register(_CounterFunction(name, help, fn))

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 if it has none yet), e.g. value("voxtide_steps_total")."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
