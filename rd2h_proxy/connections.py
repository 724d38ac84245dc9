"""Client connections of the proxy: how many may be open, and how long a request head may take.

aiohttp's server bounds neither: a client that opens connections and sends its request
head a byte at a time (slowloris) holds a file descriptor per connection for as long as it
likes. :class:`ConnectionGuard` sits between asyncio and aiohttp's per-connection protocol
(:class:`aiohttp.web.RequestHandler`), wrapping each in a :class:`_GuardedConnection` that

* refuses a connection beyond ``max_connections`` at once: a canned 503 answer, then close;
* closes a connection whose request head is not complete ``header_timeout_s`` after it was
  accepted or, on a kept-alive connection, after the first byte of the next request. The
  application reports each complete head with :meth:`ConnectionGuard.request_started` (the
  proxy's middleware: aiohttp runs it only once it has parsed a head) and the end of its
  handling with :meth:`ConnectionGuard.request_finished`; until the next byte arrives a
  kept-alive connection is idle, which aiohttp's ``keepalive_timeout`` bounds.

The request body has its own deadline, kept by the handlers that read it
(:attr:`~rd2h_proxy.config.ProxyConfig.body_timeout_s`).

Serve an application through :class:`GuardedSite` (instead of ``web.TCPSite``) for the
guard to see its connections; without it the middleware's reports find no connection and
do nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import msgspec
from aiohttp import web

from rd2h_proxy.config import http_base

log = logging.getLogger("rd2h.proxy")

#: At most one warning about refused connections in this many seconds (an attack would
#: otherwise flood the log; the counters on /stats hold the totals).
_WARN_EVERY_S = 10.0


@dataclass
class ConnectionStats:
    """Counters of the client connections (served on /healthcheck and /stats)."""

    open: int = 0  # admitted and not yet closed
    refused: int = 0  # beyond max_connections
    header_timeouts: int = 0  # closed for an incomplete request head


class ConnectionGuard:
    """The connection cap and the header deadline of one server (see the module docstring)."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.stats = ConnectionStats()
        self._connections: dict[web.RequestHandler, _GuardedConnection] = {}
        self._warned_at = float("-inf")
        error = {
            "error": {
                "message": f"the proxy already holds {max_connections} client connections; "
                "retry later",
                "type": "overloaded",
                "code": 503,
            }
        }
        body = msgspec.json.encode(error)
        self.refusal = (
            b"HTTP/1.1 503 Service Unavailable\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n"
            b"Retry-After: 1\r\n"
            b"Connection: close\r\n\r\n" % len(body)
        ) + body

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """What to hand ``loop.create_server``: aiohttp's protocols, each guarded."""
        return functools.partial(_GuardedConnection, self, server)

    def request_started(self, handler: web.RequestHandler) -> None:
        """A request head on this connection is complete: stop its header deadline."""
        connection = self._connections.get(handler)
        if connection is not None:
            connection.busy = True
            connection.cancel_deadline()

    def request_finished(self, handler: web.RequestHandler) -> None:
        """The request is handled; the next byte on this connection starts a new head."""
        connection = self._connections.get(handler)
        if connection is not None:
            connection.busy = False

    def _admit(self, handler: web.RequestHandler, connection: _GuardedConnection) -> bool:
        """Count a new connection in (False: refuse it, the cap is reached)."""
        if self.stats.open >= self.max_connections:
            self.stats.refused += 1
            now = asyncio.get_running_loop().time()
            if now - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = now
                log.warning(
                    "refusing client connections: %d open (--max-connections); %d refused so far",
                    self.stats.open,
                    self.stats.refused,
                )
            return False
        self.stats.open += 1
        self._connections[handler] = connection
        return True

    def _release(self, handler: web.RequestHandler) -> None:
        self.stats.open -= 1
        del self._connections[handler]


class _GuardedConnection(asyncio.Protocol):
    """One client connection: admission, header deadline, then aiohttp's protocol."""

    def __init__(self, guard: ConnectionGuard, server: web.Server) -> None:
        self._guard = guard
        self._server = server
        self._inner: web.RequestHandler | None = None  # None: refused (or not yet made)
        self._deadline: asyncio.TimerHandle | None = None
        self._peer: object = None
        self.busy = False  # a request head is complete and its handler has not returned

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        inner = self._server()  # aiohttp's protocol for this connection (cheap to make)
        if not self._guard._admit(inner, self):
            cast(asyncio.Transport, transport).write(self._guard.refusal)
            transport.close()  # flushes the answer, then closes
            return
        self._inner = inner
        self._peer = transport.get_extra_info("peername")
        self._arm()
        inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return  # refused: its transport is closing
        if not self.busy and self._deadline is None:
            self._arm()  # the first byte of the next request on a kept-alive connection
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            self._inner.eof_received()
        return None  # close the transport, as aiohttp's protocol does

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_deadline()
        inner = self._inner
        if inner is None:
            return
        self._guard._release(inner)
        inner.connection_lost(exc)

    def cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self._guard.header_timeout_s, self._expired)

    def _expired(self) -> None:
        self._deadline = None
        if self.busy or self._inner is None:
            return
        self._guard.stats.header_timeouts += 1
        log.debug(
            "client %s: no complete request head within %g s; closing",
            self._peer,
            self._guard.header_timeout_s,
        )
        self._inner.force_close()


class GuardedSite(web.BaseSite):
    """Like ``web.TCPSite`` (or ``web.SockSite`` with ``sock``), through a guard."""

    __slots__ = ("_guard", "_host", "_port", "_sock")

    def __init__(
        self,
        runner: web.BaseRunner,
        guard: ConnectionGuard,
        *,
        host: str | None = None,
        port: int = 0,
        sock: socket.socket | None = None,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._guard = guard
        self._host = host
        self._port = port
        self._sock = sock

    @property
    def name(self) -> str:
        if self._sock is not None:
            host, port = self._sock.getsockname()[:2]
            return http_base(str(host), int(port))
        return http_base(self._host or "0.0.0.0", self._port)

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # BaseSite refuses a runner that is not set up
        factory = self._guard.protocol_factory(server)
        loop = asyncio.get_running_loop()
        if self._sock is not None:
            self._server = await loop.create_server(factory, sock=self._sock, backlog=self._backlog)
        else:
            self._server = await loop.create_server(
                factory, self._host, self._port, backlog=self._backlog
            )
