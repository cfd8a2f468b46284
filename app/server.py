"""The server: routes, limits, and the engine loop, on one port (uvicorn + Starlette).

HTTP: GET /healthz, GET /metrics (Prometheus text; behind the API key with `metrics_auth`),
GET /v1/models (OpenAI's list), POST /v1/audio/transcriptions (OpenAI's) and POST
/v1/listen (Deepgram's pre-recorded), the last three behind the API key; and the
allowlisted files of web/.
Websocket: /v1/listen and /v1/realtime, behind the optional API key, given as
`Authorization: Bearer <key>` or `Token <key>`, `?api_key=<key>`, or by browsers (which
cannot set headers) as a subprotocol: Deepgram's ["token", <key>] or OpenAI's
"openai-insecure-api-key.<key>". A refused handshake gets an HTTP status and a text body.
Beyond `max_sessions`, or while the server is overloaded (another session's finals would
make the others wait: engine/load.py; or most sessions are more than `max_lag_s` behind), a
connection is accepted and closed with 1013 (try again later) and a reason; messages over
`max_message_bytes` close the connection with 1009 (done by uvicorn).
A /v1/listen connection with a `resume_token` takes over its dropped session (404 for an
unknown or expired token) and does not count as a new session.

Shutdown (SIGTERM, Ctrl-C, `stop()`) drains: /healthz answers 503 "draining", new sessions
get 1013 and files 503, every session's input ends (what it sent is transcribed and sent, then
it closes with 1001) and files go on, for up to `drain_s`; what is unfinished then is
left in the spool (app/spool.py), which the next start transcribes into the store.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import mimetypes
import signal
import time
import uuid
from collections.abc import Awaitable
from http import HTTPStatus
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from app.config import ServerConfig
from app.connection import CLOSE_GOING_AWAY, CLOSE_POLICY, CLOSE_TRY_AGAIN_LATER, Connection
from app.engine_loop import EngineLoop
from app.listen import ListenOptions, ListenSession, parse_listen_query
from app.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from app.metrics import Metrics
from app.openai_audio import openai_error, transcriptions
from app.prerecorded import deepgram_error, listen_file
from app.realtime import OPENAI_RATE, RealtimeSession
from app.recovery import recover
from app.session import ServerContext, Session, query_rate
from app.spool import Spool
from app.store import TranscriptStore
from app.upload import DISCONNECT_POLL_S
from engine.engine import Engine

log = logging.getLogger(__name__)

STATIC_FILES = {  # URL path -> file in web/; nothing else is served from disk
    "/": "index.html", "/index.html": "index.html", "/app.js": "app.js",
    "/worklet.js": "worklet.js", "/resampler.js": "resampler.js", "/style.css": "style.css",
    "/sample.wav": "sample.wav",
}
OPENAI_KEY_PROTOCOL = "openai-insecure-api-key."  # the browser's way to send an OpenAI key
STORE_RETRY_S = 5.0  # how often the transcript store tries again to write what it could not
PAUSE_WAIT_S = 2.0  # at shutdown, a session's input ends at its next pause, or after this


class _DenialFilter(logging.Filter):
    """uvicorn's websockets-sansio logs a handshake refused with an HTTP status (ASGI's
    websocket.http.response) as an application error; it is not one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "returned without completing handshake" not in record.getMessage()


logging.getLogger("uvicorn.error").addFilter(_DenialFilter())


def _text(status: HTTPStatus, text: str) -> Response:
    return PlainTextResponse(text, status.value, headers={"Cache-Control": "no-store"})


def _given_key(conn: HTTPConnection) -> str:
    """The API key the client sent, in any of the accepted places ("" if none)."""
    header = conn.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() in ("bearer", "token") and value.strip():
        return value.strip()
    protocols = _subprotocols(conn)
    for i, name in enumerate(protocols):
        if name.startswith(OPENAI_KEY_PROTOCOL):
            return name[len(OPENAI_KEY_PROTOCOL):]
        if name == "token" and i + 1 < len(protocols):
            return protocols[i + 1]
    return conn.query_params.get("api_key", "")


def _subprotocols(conn: HTTPConnection) -> list[str]:
    return list(conn.scope.get("subprotocols", []))


def _subprotocol(conn: HTTPConnection) -> str | None:
    """The subprotocol to accept: OpenAI's "realtime" or Deepgram's "token"."""
    offered = _subprotocols(conn)
    return next((name for name in ("realtime", "token") if name in offered), None)


class Server:
    def __init__(self, engine: Engine, config: ServerConfig | None = None):
        self.config = config or ServerConfig()
        self.engine = engine
        self.metrics = Metrics()
        self.loop = EngineLoop(engine, self.metrics)
        self.store = TranscriptStore(self.config.data_dir, self.config.fsync)
        self.spool = Spool(self.config.data_dir, self.config.fsync)
        self.ctx = ServerContext(self.config, self.loop, self.metrics, self.store, self.spool,
                                 engine.bundle.name, engine.bundle.tokenizer.multilingual)
        self.sessions: dict[str, Session] = {}
        self.http: uvicorn.Server | None = None
        self.store_task: asyncio.Task | None = None
        self.recovery: asyncio.Task | None = None  # of what a previous run left in the spool
        self.started_at = int(time.time())
        self._add_gauges()

    def _add_gauges(self) -> None:
        m, engine = self.metrics, self.engine
        m.gauge("voxtide_sessions_active", "Open websocket sessions", lambda: len(self.sessions))
        m.gauge("voxtide_engine_requests", "Requests in the engine (sessions, draining sessions, files)",
                lambda: engine.num_requests)
        m.gauge("voxtide_session_lag_max_seconds", "The largest session lag now",
                lambda: max((self._lag(s) for s in self.sessions.values()), default=0.0))
        m.gauge("voxtide_session_backlog_max_seconds",
                "The largest backlog now: audio received but not yet decoded", self.loop.max_backlog_s)
        m.gauge("voxtide_store_pending_records", "Finals waiting for the transcript store to write them",
                lambda: self.store.num_pending)
        m.gauge("voxtide_sessions_awaiting_resume", "Dropped sessions waiting for a resume",
                lambda: sum(not s.connected and not s.finishing for s in self.ctx.resumable.values()))
        cache = engine.scheduler.encoder_cache
        m.counter_function("voxtide_encoder_cache_queries", "Encoder cache lookups",
                           lambda: cache.num_queries)
        m.counter_function("voxtide_encoder_cache_hits", "Encoder cache lookups that hit",
                           lambda: cache.num_hits)
        m.gauge("voxtide_encoder_cache_entries", "Item hashes in the encoder cache",
                lambda: len(cache.cached))
        m.counter_function("voxtide_processor_cache_queries", "Processor cache lookups",
                           lambda: engine.processor_counts[0])
        m.counter_function("voxtide_processor_cache_hits", "Processor cache lookups that hit",
                           lambda: engine.processor_counts[1])
        m.counter_function("voxtide_spool_failures", "Session audio spools that could not be written "
                           "(a full disk): a crash would lose that audio", lambda: self.spool.num_failures)
        m.counter_function("voxtide_worker_restarts", "Times the model worker process died and was "
                           "started again", lambda: engine.num_restarts)

    def _lag(self, session: Session) -> float:
        return max(0, session.fed_ms - self.engine.committed_ms(session.id)) / 1000

    # ------------------------------------------------------------------ lifecycle

    def _app(self) -> Starlette:
        routes: list[Route | WebSocketRoute] = [
            Route("/healthz", self.healthz),
            Route("/metrics", self.metrics_page),
            Route("/v1/models", self.models),
            Route("/v1/audio/transcriptions", self.transcriptions, methods=["POST"]),
            Route("/v1/listen", self.listen_file, methods=["POST"]),
            WebSocketRoute("/v1/listen", self.listen),
            WebSocketRoute("/v1/realtime", self.realtime),
        ]
        routes += [Route(path, self.static) for path in STATIC_FILES]
        return Starlette(routes=routes)

    async def _retry_store(self) -> None:
        """Write what the transcript store could not, every few seconds (a disk that filled
        up and was freed)."""
        while True:
            await asyncio.sleep(STORE_RETRY_S)
            if self.store.pending:
                self.store.retry()

    async def start(self) -> None:
        self.loop.start()
        self.store_task = asyncio.create_task(self._retry_store(), name="store-retry")
        leftovers = self.spool.leftovers()  # (before any session of this run has a spool)
        self.recovery = asyncio.create_task(recover(self.ctx, leftovers), name="recovery")
        config = uvicorn.Config(
            self._app(), self.config.host, self.config.port, ws="websockets-sansio",
            ws_max_size=self.config.max_message_bytes,
            # No permessage-deflate: PCM audio does not compress, and deflate costs CPU on
            # every frame and a compressor per connection
            ws_per_message_deflate=False,
            # Pings keep NAT paths open, but no pong deadline: while a session's backlog is at
            # max_backlog_s the server stops reading its socket, so the client's pong waits
            # behind its audio. Dead clients end by the idle timeout or a failed write.
            ws_ping_interval=20, ws_ping_timeout=None,
            lifespan="off", log_config=None, access_log=False)
        config.load()
        self.http = uvicorn.Server(config)
        self.http.lifespan = config.lifespan_class(config)
        await self.http.startup()
        if not self.http.started:
            await self.loop.stop()
            raise OSError(f"cannot listen on {self.config.host}:{self.config.port}")

    @property
    def port(self) -> int:
        assert self.http is not None, "start() first"
        return self.http.servers[0].sockets[0].getsockname()[1]

    async def drain(self) -> None:
        """Take no new sessions or files; end every session's input at its next pause (at
        most PAUSE_WAIT_S, a quarter of the drain) and tell the client where (each then
        transcribes and sends what it received, and closes 1001); wait for them and the
        files in progress, at most `drain_s`."""
        self.ctx.draining = True
        pause_wait = min(PAUSE_WAIT_S, self.config.drain_s / 4)
        for session in list(self.sessions.values()):
            session.stop_input(CLOSE_GOING_AWAY, "server shutting down", pause_wait)
        deadline = time.monotonic() + self.config.drain_s
        while (self.sessions or self.ctx.uploads) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        """Drain, then stop: what is still unfinished stays in the spool for the next start."""
        if self.http is not None:
            log.info("draining %d sessions and %d files for up to %g s", len(self.sessions),
                     self.ctx.uploads, self.config.drain_s)
            await self.drain()
            if self.sessions or self.ctx.uploads:
                log.warning("%d sessions and %d files unfinished; their audio is spooled for the next "
                            "start", len(self.sessions), self.ctx.uploads)
            self.ctx.stopping = True
            for session in list(self.sessions.values()):  # (their spools stay)
                session.abort()
                if session.connected:
                    await session.ws.close(CLOSE_GOING_AWAY, "server shutting down")
            deadline = time.monotonic() + 2 * DISCONNECT_POLL_S
            while self.ctx.uploads and time.monotonic() < deadline:  # they answer 503
                await asyncio.sleep(0.05)
            for task in list(self.http.server_state.tasks):  # anything still running
                task.cancel()
            await self.http.shutdown()
        for task in (self.recovery, self.store_task):
            if task is not None:
                task.cancel()
        await self.loop.stop()
        if not self.store.retry():
            log.error("transcript store: %d finals could not be written (%s)", self.store.num_pending,
                      self.store.failure)
        self.spool.close()
        self.engine.close()

    async def serve_forever(self) -> None:
        """Serve until cancelled (Ctrl-C) or sent SIGTERM (docker stop, systemd), then stop
        cleanly: sessions closed, the model's worker process ended."""
        await self.start()
        log.info("voxtide listening on http://%s:%d", self.config.host, self.port)
        loop = asyncio.get_running_loop()
        terminated = asyncio.Event()
        try:
            loop.add_signal_handler(signal.SIGTERM, terminated.set)
            handled = True
        except (NotImplementedError, RuntimeError):  # no signals here (another OS or thread)
            handled = False
        try:
            await terminated.wait()
            log.info("SIGTERM: shutting down")
        finally:
            if handled:  # (removing one never added raises where there are no signals)
                loop.remove_signal_handler(signal.SIGTERM)
            await self.stop()

    # ------------------------------------------------------------------ HTTP

    async def healthz(self, request: Request) -> Response:
        """200 "ok", or 503 with why not: "draining", the model worker "restarting" or
        "exited", or "degraded" (the store or the spool cannot write: a "reason")."""
        engine = self.engine
        failures = [f"transcript store: {self.store.failure}" if self.store.failure else "",
                    f"audio spool: {self.spool.failure}" if self.spool.failure else ""]
        reason = "; ".join(f for f in failures if f)
        state = ("draining" if self.ctx.draining else "restarting" if engine.restarting
                 else "model worker exited" if not engine.healthy else "degraded" if reason else "ok")
        body = {"status": state, "model": self.ctx.model_name,
                "sessions": len(self.sessions), "device": str(engine.bundle.device)}
        if reason:
            body["reason"] = reason
        status = HTTPStatus.OK if state == "ok" else HTTPStatus.SERVICE_UNAVAILABLE
        return Response(json.dumps(body), status.value, media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    async def metrics_page(self, request: Request) -> Response:
        if self.config.metrics_auth and not self._authorized(request):
            return _text(HTTPStatus.UNAUTHORIZED, "missing or wrong API key\n")
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE,
                        headers={"Cache-Control": "no-store"})

    async def models(self, request: Request) -> Response:
        """OpenAI's model list: the one running model (behind the API key, as OpenAI's)."""
        if not self._authorized(request):
            return openai_error(HTTPStatus.UNAUTHORIZED, "invalid_api_key", "missing or wrong API key")
        model = {"id": self.ctx.model_name, "object": "model", "created": self.started_at,
                 "owned_by": "voxtide"}
        return JSONResponse({"object": "list", "data": [model]})

    async def transcriptions(self, request: Request) -> Response:
        """OpenAI's POST /v1/audio/transcriptions (app/openai_audio.py)."""
        if not self._authorized(request):
            return openai_error(HTTPStatus.UNAUTHORIZED, "invalid_api_key", "missing or wrong API key")
        return await transcriptions(self.ctx, request)

    async def listen_file(self, request: Request) -> Response:
        """Deepgram's pre-recorded POST /v1/listen (app/prerecorded.py)."""
        if not self._authorized(request):
            return deepgram_error(HTTPStatus.UNAUTHORIZED, "missing or wrong API key",
                                  str(uuid.uuid4()))
        return await listen_file(self.ctx, request)

    async def static(self, request: Request) -> Response:
        name = STATIC_FILES[request.url.path]
        path = self.config.web_dir / name
        if not path.is_file():
            return _text(HTTPStatus.NOT_FOUND, f"not found: {request.url.path}\n")
        content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if content_type == "text/javascript":
            content_type = "application/javascript"
        return Response(path.read_bytes(), media_type=content_type, headers={"Cache-Control": "no-store"})

    def _authorized(self, conn: HTTPConnection) -> bool:
        key = self.config.api_key
        return not key or hmac.compare_digest(_given_key(conn).encode(), key.encode())

    # ------------------------------------------------------------------ websocket

    def _resumable(self, token: str) -> Session | None:
        session = self.ctx.resumable.get(token)
        return session if session is not None and not session.finishing else None

    def overloaded(self) -> bool:
        """A new session would make the others wait (engine/load.py: they lag at their
        commits already, or the model's time on live finals would grow over what keeps their
        latency), or most open sessions are more than max_lag_s behind."""
        opened = {s.id: s.opened_at for s in self.sessions.values()}
        if not self.loop.load.admits(time.perf_counter(), opened):
            return True
        behind = sum(self.loop.backlog_s(s.id) > self.config.max_lag_s for s in self.sessions.values())
        return behind > 0 and 2 * behind >= len(self.sessions)

    def _refusal(self) -> tuple[str, str] | None:
        if self.ctx.draining:
            return "draining", "server shutting down"
        if not self.engine.healthy:
            return "worker", "the model worker is restarting"
        if len(self.sessions) >= self.config.max_sessions:
            return "max_sessions", f"server at capacity ({self.config.max_sessions} sessions)"
        if self.overloaded():
            return "overloaded", "server overloaded (no room for another session's finals)"
        return None

    async def _handshake(self, ws: WebSocket, check: Any, protocol: str) -> Any:
        """Authorize and validate (`check()` -> parameters; ValueError if bad, LookupError if
        unknown), then accept. -> the parameters, or None when the handshake was refused with
        an HTTP status and the protocol's error body."""
        if not self._authorized(ws):
            refusal = (HTTPStatus.UNAUTHORIZED, "INVALID_AUTH", "missing or wrong API key: send "
                       "'Authorization: Bearer <key>' or 'Token <key>', or ?api_key=<key>")
        else:
            try:
                params = check()
            except LookupError as e:
                refusal = (HTTPStatus.NOT_FOUND, "NOT_FOUND", str(e.args[0]))
            except ValueError as e:
                refusal = (HTTPStatus.BAD_REQUEST, "Bad Request", str(e))
            else:
                await ws.accept(subprotocol=_subprotocol(ws))
                return params
        status, code, message = refusal
        if protocol == "listen":  # Deepgram's error body
            response = JSONResponse({"err_code": code, "err_msg": message, "request_id": str(uuid.uuid4())},
                                    status.value, headers={"Cache-Control": "no-store"})
        else:
            response = openai_error(status, code, message)
        await ws.send_denial_response(response)
        return None

    async def listen(self, ws: WebSocket) -> None:
        def check() -> ListenOptions | dict[str, Any]:
            params = parse_listen_query(ws.url.query, self.ctx.multilingual)
            if isinstance(params, dict) and self._resumable(params["resume_token"]) is None:
                raise LookupError("unknown or expired resume_token")
            return params

        params = await self._handshake(ws, check, "listen")
        if params is None:
            return
        conn = self._connection(ws)
        if isinstance(params, dict):
            await self._resume(conn, params["resume_token"], params["last_seq"])
        elif await self._admit(conn):
            await self._run(ListenSession(conn, self.ctx, params), conn)

    async def realtime(self, ws: WebSocket) -> None:
        rate = await self._handshake(ws, lambda: query_rate(dict(ws.query_params), OPENAI_RATE), "realtime")
        if rate is None:
            return
        conn = self._connection(ws)
        beta = "realtime=v1" in ws.headers.get("openai-beta", "")  # the beta API's events
        if await self._admit(conn):
            await self._run(RealtimeSession(conn, self.ctx, rate, beta), conn)

    def _connection(self, ws: WebSocket) -> Connection:
        """The session's connection: sends wait at most the idle timeout for a client that
        does not read, then its transport is cut."""
        peer = tuple(ws.client or ())

        def kill() -> None:
            # uvicorn keeps its connections' protocols here; ASGI has no way to cut one
            for protocol in list(self.http.server_state.connections if self.http else ()):
                if getattr(protocol, "client", None) == peer:
                    protocol.transport.abort()

        return Connection(ws, self.config.idle_timeout_s, kill)

    async def _admit(self, conn: Connection) -> bool:
        """A new session, unless at capacity or overloaded (then closed with 1013)."""
        refusal = self._refusal()
        if refusal is None:
            return True
        self.metrics.sessions_rejected.labels(refusal[0]).inc()
        await conn.close(CLOSE_TRY_AGAIN_LATER, f"{refusal[1]}; try again later")
        return False

    async def _resume(self, conn: Connection, token: str, last_seq: int) -> None:
        session = self._resumable(token)
        if session is None:  # expired between the handshake and now
            await conn.close(CLOSE_POLICY, "unknown or expired resume_token")
            return
        await self._serve(session, conn, session.resume(conn, last_seq))

    async def _run(self, session: Session, conn: Connection) -> None:
        self.sessions[session.id] = session
        await self._serve(session, conn, session.run())

    async def _serve(self, session: Session, conn: Connection, serving: Awaitable[None]) -> None:
        """Serve one connection of a session; forget the session once it ended."""
        try:
            await serving
        except Exception:
            log.exception("session %s failed", session.id)
            session.abort()
            await conn.close(1011, "internal error")
        finally:
            if session.ended:
                self.sessions.pop(session.id, None)
