"""The websocket server: routes, limits, and the engine loop, on one port.

HTTP (answered in `process_request`, before any websocket handshake): GET /healthz,
GET /metrics (Prometheus text), and the allowlisted files of web/. Websocket: /v1/listen
and /v1/realtime, behind the optional API key (`Authorization: Bearer <key>`, or
`?api_key=<key>` for browsers, which cannot set headers). Beyond `max_sessions`, or while
the server is overloaded (most sessions more than `max_lag_s` behind), a connection is
accepted and closed with 1013 (try again later) and a reason; messages over
`max_message_bytes` close the connection with 1009 (done by the websockets library). A
/v1/listen connection with a `resume_token` takes over its dropped session (404 for an
unknown or expired token) and does not count as a new session.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import mimetypes
import signal
from collections.abc import Awaitable
from http import HTTPStatus
from urllib.parse import parse_qsl, urlsplit

from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from app.config import ServerConfig
from app.engine_loop import EngineLoop
from app.listen import ListenSession, parse_listen_query
from app.metrics import Metrics
from app.realtime import OPENAI_RATE, RealtimeSession
from app.session import ServerContext, Session, query_rate
from app.store import TranscriptStore
from engine.engine import Engine

log = logging.getLogger(__name__)

STATIC_FILES = {  # URL path -> file in web/; nothing else is served from disk
    "/": "index.html", "/index.html": "index.html", "/app.js": "app.js",
    "/worklet.js": "worklet.js", "/resampler.js": "resampler.js", "/style.css": "style.css",
    "/sample.wav": "sample.wav",
}
WS_PATHS = ("/v1/listen", "/v1/realtime")
CLOSE_POLICY_VIOLATION = 1008
CLOSE_TRY_AGAIN_LATER = 1013


def _response(status: HTTPStatus, body: bytes, content_type: str) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store")])
    return Response(status.value, status.phrase, headers, body)


def _text(status: HTTPStatus, text: str) -> Response:
    return _response(status, text.encode(), "text/plain; charset=utf-8")


class Server:
    def __init__(self, engine: Engine, config: ServerConfig | None = None):
        self.config = config or ServerConfig()
        self.engine = engine
        self.metrics = Metrics()
        self.loop = EngineLoop(engine, self.metrics)
        self.store = TranscriptStore(self.config.data_dir, self.config.fsync)
        self.ctx = ServerContext(self.config, self.loop, self.metrics, self.store,
                                 engine.bundle.name, engine.bundle.tokenizer.multilingual)
        self.sessions: dict[str, Session] = {}
        self.ws_server: WsServer | None = None
        self._add_gauges()

    def _add_gauges(self) -> None:
        m, engine = self.metrics, self.engine
        m.gauge("voxtide_sessions_active", "Open websocket sessions", lambda: len(self.sessions))
        m.gauge("voxtide_engine_requests", "Requests in the engine (open or draining)",
                lambda: engine.num_requests)
        m.gauge("voxtide_session_lag_seconds", "Audio received - audio committed, per session",
                lambda: {(("session", s.id),): self._lag(s) for s in self.sessions.values()})
        m.gauge("voxtide_session_lag_max_seconds", "The largest session lag",
                lambda: max((self._lag(s) for s in self.sessions.values()), default=0.0))
        m.gauge("voxtide_session_backlog_max_seconds",
                "The largest backlog: audio received but not yet decoded", self.loop.max_backlog_s)
        m.gauge("voxtide_sessions_awaiting_resume", "Dropped sessions waiting for a resume",
                lambda: sum(not s.connected and not s.finishing for s in self.ctx.resumable.values()))
        cache = engine.scheduler.encoder_cache
        m.gauge("voxtide_encoder_cache_queries", "Encoder cache lookups", lambda: cache.num_queries)
        m.gauge("voxtide_encoder_cache_hits", "Encoder cache lookups that hit", lambda: cache.num_hits)
        m.gauge("voxtide_encoder_cache_entries", "Item hashes in the encoder cache",
                lambda: len(cache.cached))
        m.gauge("voxtide_processor_cache_queries", "Processor cache lookups",
                lambda: engine.processor_counts[0])
        m.gauge("voxtide_processor_cache_hits", "Processor cache lookups that hit",
                lambda: engine.processor_counts[1])

    def _lag(self, session: Session) -> float:
        return max(0, session.fed_ms - self.engine.committed_ms(session.id)) / 1000

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.loop.start()
        self.ws_server = await serve(
            self.handle, self.config.host, self.config.port,
            process_request=self.process_request,
            select_subprotocol=lambda _conn, offered: "realtime" if "realtime" in offered else None,
            max_size=self.config.max_message_bytes,
            # No permessage-deflate: PCM audio does not compress, and deflate costs CPU on
            # every frame (about 15% of the event loop's time with 8 sessions) and a
            # compressor per connection
            compression=None,
            # Pings keep NAT paths open, but no pong deadline: while a session's backlog is at
            # max_backlog_s the server stops reading its socket, so the client's pong waits
            # behind its audio. Dead clients end by the idle timeout or a failed write.
            ping_interval=20, ping_timeout=None,
        )

    @property
    def port(self) -> int:
        assert self.ws_server is not None, "start() first"
        return self.ws_server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.ws_server is not None:
            self.ws_server.close()
            await self.ws_server.wait_closed()
        await self.loop.stop()
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
            log.info("SIGTERM: stopping")
        finally:
            if handled:  # (removing one never added raises where there are no signals)
                loop.remove_signal_handler(signal.SIGTERM)
            await self.stop()

    # ------------------------------------------------------------------ HTTP

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        url = urlsplit(request.path)
        if url.path in WS_PATHS:
            if not self._authorized(request, url.query):
                return _text(HTTPStatus.UNAUTHORIZED, "missing or wrong API key: send "
                             "'Authorization: Bearer <key>' or ?api_key=<key>\n")
            try:
                if url.path == "/v1/listen":
                    params = parse_listen_query(url.query)
                    if "resume_token" in params and self._resumable(params["resume_token"]) is None:
                        return _text(HTTPStatus.NOT_FOUND, "unknown or expired resume_token\n")
                else:
                    query_rate(dict(parse_qsl(url.query)), OPENAI_RATE)
            except ValueError as e:
                return _text(HTTPStatus.BAD_REQUEST, f"{e}\n")
            return None  # on to the websocket handshake
        if url.path == "/healthz":
            healthy = self.engine.healthy
            body = {"status": "ok" if healthy else "model worker exited", "model": self.ctx.model_name,
                    "sessions": len(self.sessions), "device": str(self.engine.bundle.device)}
            return _response(HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE,
                             json.dumps(body).encode(), "application/json")
        if url.path == "/metrics":
            return _response(HTTPStatus.OK, self.metrics.render().encode(),
                             "text/plain; version=0.0.4; charset=utf-8")
        name = STATIC_FILES.get(url.path)
        path = self.config.web_dir / name if name else None
        if path is None or not path.is_file():
            return _text(HTTPStatus.NOT_FOUND, f"not found: {url.path}\n")
        content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if content_type == "text/javascript":
            content_type = "application/javascript"
        return _response(HTTPStatus.OK, path.read_bytes(), content_type)

    def _authorized(self, request: Request, query: str) -> bool:
        key = self.config.api_key
        if not key:
            return True
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else None
        given = given or dict(parse_qsl(query)).get("api_key", "")
        return hmac.compare_digest(given.encode(), key.encode())

    # ------------------------------------------------------------------ websocket

    def _resumable(self, token: str) -> Session | None:
        session = self.ctx.resumable.get(token)
        return session if session is not None and not session.finishing else None

    def overloaded(self) -> bool:
        """Most open sessions are more than max_lag_s behind: a new one would only add lag."""
        behind = sum(self.loop.backlog_s(s.id) > self.config.max_lag_s for s in self.sessions.values())
        return behind > 0 and 2 * behind >= len(self.sessions)

    async def handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        url = urlsplit(ws.request.path)
        params = parse_listen_query(url.query) if url.path == "/v1/listen" else {}
        if "resume_token" in params:
            await self._resume(ws, params["resume_token"], params["last_seq"])
            return
        refusal = None
        if len(self.sessions) >= self.config.max_sessions:
            refusal = "max_sessions", f"server at capacity ({self.config.max_sessions} sessions)"
        elif self.overloaded():
            refusal = "overloaded", f"server overloaded (sessions over {self.config.max_lag_s:g} s behind)"
        if refusal is not None:
            self.metrics.sessions_rejected.inc(reason=refusal[0])
            await ws.close(CLOSE_TRY_AGAIN_LATER, f"{refusal[1]}; try again later")
            return
        if url.path == "/v1/listen":
            session: Session = ListenSession(ws, self.ctx, params["rate"], params["encoding"])
        else:
            session = RealtimeSession(ws, self.ctx, query_rate(dict(parse_qsl(url.query)), OPENAI_RATE))
        self.sessions[session.id] = session
        await self._run(session, ws, session.run())

    async def _resume(self, ws: ServerConnection, token: str, last_seq: int) -> None:
        session = self._resumable(token)
        if session is None:  # expired between the handshake and now
            await ws.close(CLOSE_POLICY_VIOLATION, "unknown or expired resume_token")
            return
        await self._run(session, ws, session.resume(ws, last_seq))

    async def _run(self, session: Session, ws: ServerConnection, serving: Awaitable[None]) -> None:
        """Serve one connection of a session; forget the session once it ended."""
        try:
            await serving
        except Exception:
            log.exception("session %s failed", session.id)
            session.abort()
            await ws.close(1011, "internal error")
        finally:
            if session.ended:
                self.sessions.pop(session.id, None)
