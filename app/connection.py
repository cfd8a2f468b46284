"""One websocket as the sessions see it: messages in, JSON text out, a close; and the close
codes every protocol uses.

The ASGI server (uvicorn) owns the socket; `Connection` wraps Starlette's WebSocket so that
sessions get one exception for every way a connection ends, and know whether it dropped
(no close frame from the client) or was closed. Every send and close has a deadline: a
client that stops reading fills the socket's buffers, and a send then waits for it forever
(uvicorn waits until the socket is writable again). Past the deadline the connection is cut
(`kill`, from the server, which owns the transport) and counts as dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008  # idle timeout, expired resume token
CLOSE_TOO_BIG = 1009  # a message over max_message_bytes (closed by uvicorn)
CLOSE_INTERNAL = 1011  # the engine failed this session
CLOSE_TRY_AGAIN_LATER = 1013  # at capacity or overloaded


class Disconnected(Exception):
    """The connection ended; `dropped` when the client went away without a close frame."""

    def __init__(self, code: int, dropped: bool):
        super().__init__(f"connection closed ({code})")
        self.code = code
        self.dropped = dropped


class Connection:
    def __init__(self, ws: WebSocket, send_timeout_s: float = 60.0,
                 kill: Callable[[], None] | None = None):
        """`kill` cuts the connection's transport at once (no close frame)."""
        self.ws = ws
        self.client = ws.client  # (host, port) of the peer
        self.closed_by_server = False
        self.send_timeout_s = send_timeout_s
        self.kill = kill or (lambda: None)

    async def recv(self) -> bytes | str:
        """The next message; Disconnected when the connection is over."""
        if self.ws.client_state == WebSocketState.DISCONNECTED:
            raise Disconnected(CLOSE_NORMAL, dropped=False)
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            code = message.get("code", CLOSE_NORMAL)
            clean = self.closed_by_server or code in (CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_TOO_BIG)
            raise Disconnected(code, dropped=not clean)
        data = message.get("bytes")
        return data if data is not None else message.get("text") or ""

    async def send(self, text: str) -> None:
        """Send one text message; Disconnected when the connection is gone."""
        if self.ws.application_state != WebSocketState.CONNECTED:
            raise Disconnected(CLOSE_NORMAL, dropped=False)
        try:
            await asyncio.wait_for(self.ws.send_text(text), self.send_timeout_s)
        except TimeoutError:
            self.kill()  # the client stopped reading
            raise Disconnected(1006, dropped=True) from None
        except (WebSocketDisconnect, OSError, RuntimeError) as e:
            raise Disconnected(getattr(e, "code", 1006), dropped=True) from e

    async def close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        if self.ws.application_state != WebSocketState.CONNECTED:
            return
        self.closed_by_server = True
        try:
            await asyncio.wait_for(self.ws.close(code, reason.encode()[:123].decode(errors="ignore")),
                                   self.send_timeout_s)  # (123 bytes: the limit of a close reason)
        except TimeoutError:
            self.kill()
        except (WebSocketDisconnect, OSError, RuntimeError):
            pass

    def abort(self) -> None:
        """Give up on a connection that may be half-open: its reader ends now."""
        asyncio.get_running_loop().create_task(self.close(CLOSE_GOING_AWAY, "taken over by a resume"))
