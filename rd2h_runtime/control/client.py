"""Prefill side: one ZMQ DEALER per Decode endpoint, all run by one I/O thread."""

from __future__ import annotations

import collections
import secrets
from collections.abc import Callable

import zmq

from rd2h_protocol.errors import ErrorCode, LocalProtocolError
from rd2h_runtime.control._common import (
    ClientEvent,
    ConnectionEvent,
    ConnFrame,
    ControlError,
    ControlOptions,
    QueueFull,
    TimerDue,
    is_ipv6,
    parse_conn,
    tcp_url,
)
from rd2h_runtime.control._loop import IOLoop, log
from rd2h_runtime.control._sockets import has_input


class _Conn:
    """One Decode endpoint. ``outbox`` and ``closed`` are guarded by the client's lock;
    ``sock``, ``mon`` and ``blocked`` belong to the I/O thread."""

    __slots__ = ("blocked", "closed", "host", "mon", "name", "outbox", "port", "sock")

    def __init__(self, name: str, host: str, port: int) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.outbox: collections.deque[bytes] = collections.deque()
        self.closed = False
        self.sock: zmq.Socket[bytes] | None = None
        self.mon: zmq.Socket[bytes] | None = None
        self.blocked = False  # ZMQ refused a frame: wait for POLLOUT


class PrefillControlClient(IOLoop[ClientEvent]):
    """The DEALERs a Prefill TP rank uses to reach Decode endpoints (v1 framing).

    Each Decode endpoint ``conn`` ("host:port") gets its own DEALER on first use (``send``
    or ``connect``): LINGER 0, a random routing id of its own. ZMQ reconnects a broken
    connection by itself and the id stays, so the Decode ROUTER (ZMQ_ROUTER_HANDOVER) routes
    replies to frames of the old connection over the new one. A message goes out as ONE
    frame; incoming frames must be ``[b"", payload]`` (empty frames dropped, exactly one
    left), delivered as :class:`ConnFrame`; anything else is counted in ``stats.malformed_frames``.

    Threading: every public method is safe from any thread. All DEALERs live on one I/O
    thread that polls them together and runs ``handler`` (if given; it must be quick).
    ``send`` never blocks: each endpoint has its own bounded queue in front of ZMQ, which
    the loop drains with non-blocking sends, so a slow or dead endpoint only fills its own
    queue; once ``outgoing_capacity`` frames wait for it, ``send`` raises :class:`QueueFull`.

    As in v1 (ZMQ_IMMEDIATE off), frames for an endpoint not reached yet wait in ZMQ's queue
    and in ours, and go out when it comes up, possibly much later; a binding that must not
    deliver stale frames reacts to :class:`ConnectionEvent` with ``disconnect()``, which
    drops them and gives the next connection a new routing id.
    """

    def __init__(
        self,
        *,
        handler: Callable[[ClientEvent], None] | None = None,
        options: ControlOptions | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        name: str = "prefill",
    ) -> None:
        super().__init__(handler=handler, options=options, context=context)
        self._name = name
        # Guarded by _lock: the endpoint table, pending socket commands, endpoints to flush.
        self._conns: dict[str, _Conn] = {}
        self._commands: collections.deque[tuple[bool, _Conn]] = collections.deque()
        self._dirty: dict[_Conn, None] = {}
        # I/O thread only.
        self._by_sock: dict[zmq.Socket[bytes], _Conn] = {}
        self._by_mon: dict[zmq.Socket[bytes], _Conn] = {}

    def connect(self, conn: str) -> None:
        """Open the DEALER for ``conn`` now instead of on first ``send``. Thread-safe.

        ConfigError for a malformed "host:port"; ControlError beyond ``max_connections``.
        """
        host, port = parse_conn(conn)
        with self._lock:
            self._check_running()
            if conn not in self._conns:
                self._open_locked(conn, host, port)
                self._wake_if_needed()

    def disconnect(self, conn: str) -> int:
        """Close ``conn``'s DEALER and drop its queued frames; returns how many were dropped.

        Thread-safe; a later ``send`` to ``conn`` opens a fresh DEALER (a new routing id, so
        the Decode side sees a new peer). Unknown ``conn``: returns 0.
        """
        with self._lock:
            c = self._conns.pop(conn, None)
            if c is None:
                return 0
            dropped = len(c.outbox)
            c.outbox.clear()
            c.closed = True
            self._stats.dropped_outgoing += dropped
            self._dirty.pop(c, None)
            self._commands.append((False, c))
            self._wake_if_needed()
            return dropped

    def send(self, conn: str, payload: bytes) -> None:
        """Queue one frame for the Decode endpoint ``conn``, opening it on first use.

        Thread-safe, never blocks. Raises :class:`QueueFull` when ``outgoing_capacity``
        frames already wait for ``conn`` (slow, dead or unreachable endpoint),
        :class:`ControlClosed` when not running, ConfigError for a malformed ``conn``,
        :class:`LocalProtocolError` (code TOO_LARGE) for a payload over ``max_frame_bytes``.
        """
        limit = self._options.max_frame_bytes
        if len(payload) > limit:
            raise LocalProtocolError(
                f"frame of {len(payload)} bytes for {conn} exceeds max_frame_bytes {limit}",
                ErrorCode.TOO_LARGE,
            )
        with self._lock:
            self._check_running()
            c = self._conns.get(conn)
            if c is None:
                host, port = parse_conn(conn)
                c = self._open_locked(conn, host, port)
            if len(c.outbox) >= self._options.outgoing_capacity:
                self._stats.queue_full += 1
                raise QueueFull(f"Decode endpoint {conn}", self._options.outgoing_capacity)
            c.outbox.append(payload)
            self._dirty[c] = None
            self._wake_if_needed()

    def connections(self) -> list[str]:
        """The Decode endpoints currently open (or being opened). Thread-safe."""
        with self._lock:
            return list(self._conns)

    def pending(self, conn: str) -> int:
        """Frames queued for ``conn`` that ZMQ has not taken yet (0 if unknown). Thread-safe."""
        with self._lock:
            c = self._conns.get(conn)
            return len(c.outbox) if c is not None else 0

    # --- helpers (under _lock) ----------------------------------------------------------------

    def _open_locked(self, conn: str, host: str, port: int) -> _Conn:
        limit = self._options.max_connections
        if len(self._conns) >= limit:
            raise ControlError(
                f"{self._describe()}: {limit} Decode endpoints open (max_connections); "
                f"disconnect() one before opening {conn}"
            )
        c = _Conn(conn, host, port)
        self._conns[conn] = c
        self._commands.append((True, c))
        return c

    def _wake_if_needed(self) -> None:
        if not self._on_io_thread():  # the loop runs its commands and flush after the handler
            self._wake_locked()

    # --- hooks (I/O thread) -------------------------------------------------------------------

    def _describe(self) -> str:
        return f"Prefill control client {self._name!r}"

    def _thread_name(self) -> str:
        return f"rd2h-control-dealers-{self._name}"

    def _timer_event(self, now: float) -> ClientEvent:
        return TimerDue(now)

    def _setup(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        pass  # DEALERs are opened on demand by _process_commands

    def _teardown(self) -> None:
        for c in list(self._by_sock.values()):
            self._close_socket(c)
        with self._lock:
            for c in self._conns.values():
                self._stats.dropped_outgoing += len(c.outbox)
                c.outbox.clear()
                c.closed = True
            self._conns.clear()
            self._commands.clear()
            self._dirty.clear()

    def _process_commands(self) -> None:
        with self._lock:
            if not self._commands:
                return
            commands = list(self._commands)
            self._commands.clear()
        for is_open, c in commands:
            if is_open:
                self._open_socket(c)
            else:
                self._close_socket(c)

    def _open_socket(self, c: _Conn) -> None:
        url = tcp_url(c.host, c.port)
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        mon: zmq.Socket[bytes] | None = None
        try:
            self._configure(sock)
            o = self._options
            sock.setsockopt(zmq.RECONNECT_IVL, max(1, round(o.reconnect_ivl_s * 1000)))
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, round(o.reconnect_ivl_max_s * 1000)))
            sock.setsockopt(zmq.ROUTING_ID, b"rd2h-" + secrets.token_hex(8).encode())
            if is_ipv6(c.host):
                sock.setsockopt(zmq.IPV6, 1)
            mon = self._monitor(sock)
            sock.connect(url)
        except zmq.ZMQError as exc:
            self._close_monitored(sock, mon)
            log.warning("%s: cannot connect to %s: %s", self._describe(), url, exc)
            with self._lock:
                if self._conns.get(c.name) is c:
                    del self._conns[c.name]
                self._stats.dropped_outgoing += len(c.outbox)
                c.outbox.clear()
                c.closed = True
                self._dirty.pop(c, None)
            self._deliver(ConnectionEvent(c.name, "connect_failed", f"{url}: {exc}"))
            return
        c.sock, c.mon = sock, mon
        self._by_sock[sock] = c
        if mon is not None:
            self._by_mon[mon] = c
        self._set_want(sock, zmq.POLLIN)
        with self._lock:
            if c.outbox:  # frames queued before the socket existed
                self._dirty[c] = None

    def _close_socket(self, c: _Conn) -> None:
        sock, mon = c.sock, c.mon
        if sock is None:
            return
        c.sock = c.mon = None
        self._by_sock.pop(sock, None)
        if mon is not None:
            self._by_mon.pop(mon, None)
        self._close_monitored(sock, mon)

    def _on_ready(self, sock: zmq.Socket[bytes], events: int) -> None:
        c = self._by_sock.get(sock)
        if c is not None:
            if events & zmq.POLLIN:
                self._read_dealer(c, sock)
            if events & zmq.POLLOUT and c.sock is sock:
                with self._lock:
                    self._flush_conn_locked(c)
            return
        c = self._by_mon.get(sock)
        if c is not None:
            for kind, address in self._read_monitor(sock):
                self._deliver(ConnectionEvent(c.name, kind, address))

    def _read_dealer(self, c: _Conn, sock: zmq.Socket[bytes]) -> None:
        for n in range(self._read_budget()):
            if c.closed:
                return  # the handler disconnected this endpoint meanwhile
            if n and not has_input(sock):
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            body = [f for f in frames if f]
            if len(body) != 1:
                self._stats.malformed_frames += 1
                continue
            self._stats.frames_in += 1
            self._deliver(ConnFrame(c.name, body[0]))

    def _flush(self) -> None:
        # The handler may have opened or closed endpoints during this turn (it runs on this
        # thread, so it did not wake us): apply that before sending.
        self._process_commands()
        with self._lock:
            if not self._dirty:
                return
            dirty = list(self._dirty)
            self._dirty.clear()
            for c in dirty:
                self._flush_conn_locked(c)

    def _flush_conn_locked(self, c: _Conn) -> None:
        """Hand ``c``'s queued frames to ZMQ until it refuses one. Call with _lock held.

        Sending under the lock keeps ``disconnect()``'s drop count exact; NOBLOCK sends
        only copy into ZMQ's queue, so the lock is held for microseconds per frame.
        """
        sock = c.sock
        if sock is None or c.closed:
            return
        while c.outbox:
            try:
                sock.send(c.outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                if not c.blocked:
                    c.blocked = True
                    self._set_want(sock, zmq.POLLIN | zmq.POLLOUT)
                return
            c.outbox.popleft()
            self._stats.frames_out += 1
        if c.blocked:
            c.blocked = False
            self._set_want(sock, zmq.POLLIN)
