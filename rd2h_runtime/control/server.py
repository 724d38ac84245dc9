"""Decode side: one ZMQ ROUTER per Decode TP rank, run by one I/O thread."""

from __future__ import annotations

import collections
import errno
import logging
import threading
from collections.abc import Callable
from typing import Literal

import zmq

from rd2h_protocol.errors import ConfigError, ErrorCode, LocalProtocolError
from rd2h_runtime.control._common import (
    BindError,
    ConnectionEvent,
    ControlError,
    ControlOptions,
    PeerFrame,
    PeerSendFailed,
    QueueFull,
    ServerEvent,
    TimerDue,
    is_ipv6,
    tcp_url,
)
from rd2h_runtime.control._loop import IOLoop
from rd2h_runtime.control._sockets import has_input

log = logging.getLogger("rd2h_runtime.control")

# Frames up to this size are copied into bytes (cheap, and ZMQ's buffer is freed at once);
# larger ones are delivered as a memoryview of ZMQ's buffer.
_COPY_BELOW = 64 << 10


class DecodeControlServer(IOLoop[ServerEvent]):
    """The ROUTER a Decode TP rank binds on ``tcp://host:port`` (v1 framing).

    Incoming ``[identity, *frames]``: empty frames after the identity are dropped and exactly
    one must remain, which is delivered as :class:`PeerFrame`; anything else is counted in
    ``stats.malformed_frames`` and ignored. Replies go out as ``[identity, b"", payload]``.

    Hostile peers: no frame over ``max_frame_bytes`` reaches Python (ZMQ_MAXMSGSIZE drops
    the connection). Every frame is read out of ZMQ at once and held against its peer's byte
    budget (``peer_inbound_bytes``) and the global one (``inbound_bytes``) until the handler
    (or ``recv``) is done with it; a frame over either is dropped, counted in
    ``stats.dropped_over_budget`` and logged once per peer. Events are delivered fairly: the
    peer that used the least handler time goes next (one frame at a time), so a peer that
    floods waits behind the others instead of holding them up.

    Threading: ``start``, ``send``, ``set_timer``, ``recv``, ``stats`` and ``close`` are safe
    from any thread. The socket lives on one I/O thread; ``handler`` (if given) runs on a
    second thread, the dispatcher, one event at a time, in a per-peer FIFO order. It must
    return quickly: post reads to a worker, but for a read bounded like the handling of one
    frame (the Decode worker reads small plans itself on backends that read on the calling
    thread); its time is charged to its peer like the rest of the handler's. ``send``
    never blocks: it queues (bounded) and wakes the loop.
    A reply ZMQ cannot take (peer gone, or its queue at the high-water mark) is dropped,
    counted and reported as :class:`PeerSendFailed`.

    ``port=0`` binds an ephemeral port; read it back from ``port`` after ``start()``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        handler: Callable[[ServerEvent], None] | None = None,
        options: ControlOptions | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if not host:
            raise ConfigError("Decode control host must be an address or name, got ''")
        if not 0 <= port <= 65535:
            raise ConfigError(f"Decode control port must lie in [0, 65535], got {port}")
        super().__init__(handler=handler, options=options, context=context, fair=True)
        self._host = host
        self._port = port
        self._outbox: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self._router: zmq.Socket[bytes] | None = None
        self._mon: zmq.Socket[bytes] | None = None

    @property
    def host(self) -> str:
        """The host this server binds on."""
        return self._host

    @property
    def port(self) -> int:
        """The bound port (the requested one until ``start()`` resolved port 0)."""
        return self._port

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` of the bound ROUTER."""
        return tcp_url(self._host, self._port)

    def send(self, peer: bytes, payload: bytes) -> None:
        """Queue ``payload`` for the Prefill peer with routing id ``peer``. Thread-safe.

        Raises :class:`QueueFull` when ``outgoing_capacity`` frames are already waiting for
        the I/O thread, :class:`ControlClosed` when not running, and
        :class:`LocalProtocolError` (code TOO_LARGE) for a payload over ``max_frame_bytes``.
        """
        limit = self._options.max_frame_bytes
        if len(payload) > limit:
            raise LocalProtocolError(
                f"reply of {len(payload)} bytes exceeds max_frame_bytes {limit}",
                ErrorCode.TOO_LARGE,
            )
        with self._lock:
            self._check_running()
            if len(self._outbox) >= self._options.outgoing_capacity:
                self._stats.queue_full += 1
                raise QueueFull(f"{self._describe()} replies", self._options.outgoing_capacity)
            self._outbox.append((peer, payload))
            if not self._on_io_thread():  # on the I/O thread, the loop flushes after the handler
                self._wake_locked()

    # --- hooks --------------------------------------------------------------------------------

    def _describe(self) -> str:
        return f"Decode control server {self._host}:{self._port}"

    def _thread_name(self) -> str:
        return f"rd2h-control-router-{self._host}:{self._port}"

    def _startup_failure(self, exc: BaseException) -> ControlError:
        if isinstance(exc, zmq.ZMQError):
            return BindError(self._host, self._port, exc)
        return ControlError(
            f"Decode control server on host {self._host!r} port {self._port} cannot start: {exc}"
        )

    def _timer_event(self, now: float) -> ServerEvent:
        return TimerDue(now)

    def _setup(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        router = ctx.socket(zmq.ROUTER)
        self._router = router
        self._configure(router)
        router.setsockopt(zmq.RCVHWM, self._options.peer_queued_frames)
        # Unknown routing ids and full peer queues raise instead of silently dropping, so a
        # lost reply is counted and reported.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A Prefill DEALER that reconnects (after a heartbeat timeout, say) keeps its routing
        # id; the new connection takes it over even before the old one's end is noticed.
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if is_ipv6(self._host):
            router.setsockopt(zmq.IPV6, 1)
        router.bind(tcp_url(self._host, self._port if self._port else "*"))
        if not self._port:
            bound = router.getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(bound, bytes)
            self._port = int(bound.decode().rpartition(":")[2])
            threading.current_thread().name = self._thread_name()  # show the real port
        self._set_want(router, zmq.POLLIN)
        self._mon = self._monitor(router)

    def _teardown(self) -> None:
        if self._router is not None:
            self._close_monitored(self._router, self._mon)
            self._router = self._mon = None
        with self._lock:
            self._outbox.clear()

    def _on_ready(self, sock: zmq.Socket[bytes], events: int) -> None:
        if sock is self._router:
            self._read_router(sock)
        elif sock is self._mon:
            for kind, address in self._read_monitor(sock):
                self._deliver(ConnectionEvent(None, kind, address))

    def _read_router(self, router: zmq.Socket[bytes]) -> None:
        for n in range(self._read_budget()):
            if n and not has_input(router):
                return
            try:
                # Without copying: a frame dropped over budget is never copied into Python.
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            body = [f for f in frames[1:] if len(f)]
            if len(body) != 1:
                self._stats.malformed_frames += 1
                continue
            peer, frame = frames[0].bytes, body[0]
            del frames, body  # a frame dropped below is freed before the next one is read
            size = len(frame)
            # Only this thread adds, so a frame admitted now is still admitted once copied.
            if self._admits(peer, size):
                self._stats.frames_in += 1
                # A large frame is handed on as a view of ZMQ's own buffer: copying it would
                # hold it twice while the next one arrives.
                payload = frame.buffer if size > _COPY_BELOW else frame.bytes
                self._deliver_from(peer, PeerFrame(peer, payload), size)
            del frame

    def _flush(self) -> None:
        router = self._router
        if router is None:
            return
        with self._lock:
            if not self._outbox:
                return
            batch, self._outbox = self._outbox, collections.deque()
        for peer, payload in batch:
            try:
                router.send_multipart([peer, b"", payload], zmq.NOBLOCK)
            except zmq.Again:
                self._send_failed(peer, payload, "queue_full")
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    log.warning("%s: reply to %r failed: %s", self._describe(), peer, exc)
                self._send_failed(peer, payload, "unreachable")
            else:
                self._stats.frames_out += 1

    def _send_failed(
        self, peer: bytes, payload: bytes, reason: Literal["unreachable", "queue_full"]
    ) -> None:
        self._stats.send_failures += 1
        self._deliver(PeerSendFailed(peer, payload, reason))
