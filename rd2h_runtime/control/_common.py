"""Values shared by both control-plane sockets: options, events, errors, counters, queues."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Generic, Literal, TypeVar

from rd2h_protocol.errors import ConfigError, ProtocolError
from rd2h_protocol.wire.messages import MAX_FRAME_BYTES

# Bytes charged per queued inbound frame beyond its payload (the objects that carry it).
FRAME_OVERHEAD: Final = 256

# ZMQ_HEARTBEAT_TTL travels in deciseconds in a 16-bit field: 6553.5 s is its ceiling.
_MAX_HEARTBEAT_TTL_S: Final = 6553.5


@dataclass(frozen=True)
class ControlOptions:
    """Tuning of one control-plane socket set. Times are seconds, sizes are counts or bytes.

    - ``heartbeat_ivl_s`` / ``heartbeat_timeout_s`` / ``heartbeat_ttl_s``: ZMTP heartbeats
      (ZMQ_HEARTBEAT_IVL / TIMEOUT / TTL) on every control connection, so a peer that vanished
      without closing its TCP connection is detected and the connection dropped. A process
      that dies closes its connections at once; the heartbeat only has to find a silent host,
      so its timeout is generous: a peer stalled by a loaded machine is not a dead one.
    - ``reconnect_grace_s``: how long a binding waits for a broken connection to come back
      (ZMQ reconnects on its own) before it treats the peer as gone.
    - ``max_frame_bytes``: ZMQ_MAXMSGSIZE; a peer sending a larger frame is disconnected by
      ZMQ before any byte of it reaches Python. ``send()`` refuses larger payloads too. The
      default is the wire's own limit (``rd2h_protocol.wire.messages.MAX_FRAME_BYTES``): no
      legal frame is larger.
    - ``peer_inbound_bytes`` / ``inbound_bytes`` (Decode server): what one Prefill peer, and
      all peers together, may have received but not yet handled, in bytes (each frame counts
      its length plus a small fixed overhead). A frame over either budget is dropped on
      arrival, counted in ``ControlStats.dropped_over_budget`` and logged once per peer. The
      per-peer budget must hold at least one frame of ``max_frame_bytes``. Left out, they
      are 1.5x and 16x ``max_frame_bytes``: a peer may have one largest frame in service
      and half as much waiting. With ZMQ's own queue (``peer_queued_frames``, plus the
      frame it is reading) a peer sending the largest frames makes the process hold at
      most ``peer_inbound_bytes + (peer_queued_frames + 1) * max_frame_bytes``: 56 MiB
      with ``peer_queued_frames=1``.
    - ``peer_backlog_s`` (Decode server with a handler): a peer's received frames may add up to
      at most this much handler time, estimated from the time its recent frames took per
      byte; beyond it its frames are dropped and counted like those over a byte budget.
    - ``sndhwm`` / ``rcvhwm``: ZMQ's own per-connection queues.
    - ``peer_queued_frames`` (Decode server): ZMQ's receive queue per Prefill connection
      (the ROUTER's RCVHWM, in place of ``rcvhwm``). ZMQ bounds it in frames, not bytes, and
      allocates each frame whole once its header arrives, so a peer sending frames of
      ``max_frame_bytes`` can make ZMQ hold this many of them, plus the one it is reading,
      before the I/O thread files them against the byte budgets. When it is full ZMQ stops
      reading that one connection (TCP back-pressure), it drops nothing. The default, 1,
      bounds a hostile peer's frames in bytes (``peer_inbound_bytes + 2 * max_frame_bytes``
      in all). Its price: while the I/O thread is stalled with a frame queued, ZMQ reads
      nothing more of that connection, heartbeats included, so a stall longer than
      ``heartbeat_timeout_s`` drops the connection; ZMQ reconnects and Prefill resends what
      was unanswered, so nothing is lost (tests/runtime/test_decode_io_stall.py). A larger
      value keeps such a connection through the stall, and lets a peer queue that many
      frames of any size.
    - ``outgoing_capacity``: our queue in front of the socket (the server's one queue, the
      client's queue per Decode endpoint); ``send()`` raises :class:`QueueFull` beyond it.
    - ``incoming_capacity``: the event queue used when no handler is given; when it is full the
      I/O thread stops reading (back-pressure into ZMQ's queues) until ``recv()`` makes room.
    - ``max_connections``: how many Decode endpoints one client may hold at once.
    - ``idle_poll_s``: the longest the I/O thread blocks in one poll when no timer is armed.
    - ``recv_batch``: frames read from one socket per loop turn (fairness between sockets).
    - ``reconnect_ivl_s`` / ``reconnect_ivl_max_s``: ZMQ's reconnect back-off (client).
    - ``startup_timeout_s`` / ``close_timeout_s``: bounds on ``start()`` and ``close()``.
    - ``monitor``: surface connection events (:class:`ConnectionEvent`) through a ZMQ monitor.
    """

    heartbeat_ivl_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    heartbeat_ttl_s: float = 20.0
    reconnect_grace_s: float = 5.0
    max_frame_bytes: int = MAX_FRAME_BYTES
    # None: derived from max_frame_bytes (1.5x and 16x) when the options are built.
    peer_inbound_bytes: int = None  # type: ignore[assignment]
    inbound_bytes: int = None  # type: ignore[assignment]
    peer_backlog_s: float = 2.0
    sndhwm: int = 10_000
    rcvhwm: int = 10_000
    peer_queued_frames: int = 1
    outgoing_capacity: int = 10_000
    incoming_capacity: int = 10_000
    max_connections: int = 1024
    idle_poll_s: float = 1.0
    recv_batch: int = 256
    reconnect_ivl_s: float = 0.1
    reconnect_ivl_max_s: float = 2.0
    startup_timeout_s: float = 5.0
    close_timeout_s: float = 5.0
    monitor: bool = True

    def __post_init__(self) -> None:
        # Budgets left out follow max_frame_bytes, so raising that one alone stays valid.
        if self.peer_inbound_bytes is None:
            object.__setattr__(
                self, "peer_inbound_bytes", 3 * (self.max_frame_bytes + FRAME_OVERHEAD) // 2
            )
        if self.inbound_bytes is None:
            object.__setattr__(self, "inbound_bytes", 16 * (self.max_frame_bytes + FRAME_OVERHEAD))
        positive = {
            "heartbeat_ivl_s": self.heartbeat_ivl_s,
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
            "heartbeat_ttl_s": self.heartbeat_ttl_s,
            "reconnect_grace_s": self.reconnect_grace_s,
            "max_frame_bytes": self.max_frame_bytes,
            "peer_inbound_bytes": self.peer_inbound_bytes,
            "inbound_bytes": self.inbound_bytes,
            "peer_backlog_s": self.peer_backlog_s,
            "sndhwm": self.sndhwm,
            "rcvhwm": self.rcvhwm,
            "peer_queued_frames": self.peer_queued_frames,
            "outgoing_capacity": self.outgoing_capacity,
            "incoming_capacity": self.incoming_capacity,
            "max_connections": self.max_connections,
            "idle_poll_s": self.idle_poll_s,
            "recv_batch": self.recv_batch,
            "reconnect_ivl_s": self.reconnect_ivl_s,
            "reconnect_ivl_max_s": self.reconnect_ivl_max_s,
            "startup_timeout_s": self.startup_timeout_s,
            "close_timeout_s": self.close_timeout_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"ControlOptions.{name} must be > 0, got {value!r}")
        # A heartbeat timeout at or below the interval would drop healthy connections.
        if self.heartbeat_timeout_s <= self.heartbeat_ivl_s:
            raise ConfigError(
                "ControlOptions.heartbeat_timeout_s must exceed heartbeat_ivl_s, got "
                f"timeout {self.heartbeat_timeout_s!r} <= interval {self.heartbeat_ivl_s!r}"
            )
        if self.heartbeat_ttl_s > _MAX_HEARTBEAT_TTL_S:
            raise ConfigError(
                f"ControlOptions.heartbeat_ttl_s must be <= {_MAX_HEARTBEAT_TTL_S}, "
                f"got {self.heartbeat_ttl_s!r}"
            )
        # A legal frame that fits no budget could never be delivered.
        floor = self.max_frame_bytes + FRAME_OVERHEAD
        for name, value in (
            ("peer_inbound_bytes", self.peer_inbound_bytes),
            ("inbound_bytes", self.inbound_bytes),
        ):
            if value < floor:
                raise ConfigError(
                    f"ControlOptions.{name} must hold one frame of max_frame_bytes "
                    f"({self.max_frame_bytes} + {FRAME_OVERHEAD} bytes), got {value!r}"
                )
        if self.reconnect_ivl_max_s < self.reconnect_ivl_s:
            raise ConfigError(
                "ControlOptions.reconnect_ivl_max_s must be >= reconnect_ivl_s, got "
                f"{self.reconnect_ivl_max_s!r} < {self.reconnect_ivl_s!r}"
            )


# --- errors ---------------------------------------------------------------------------------


class ControlError(ProtocolError):
    """A control-plane transport failure (socket, thread or queue), not a protocol violation."""


class BindError(ControlError):
    """The Decode ROUTER could not bind; names the host, the port and the cause."""

    def __init__(self, host: str, port: int, cause: BaseException) -> None:
        super().__init__(
            f"cannot bind the Decode control ROUTER on host {host!r} port {port}: {cause}"
        )
        self.host = host
        self.port = port
        self.cause = cause


class QueueFull(ControlError):
    """An outgoing queue is at capacity. Transient: the peer is slow, dead or unreachable."""

    def __init__(self, what: str, capacity: int) -> None:
        super().__init__(f"{what}: outgoing queue full ({capacity} frames waiting)")
        self.what = what
        self.capacity = capacity


class ControlClosed(ControlError):
    """The socket set is not running (never started, closed, or its I/O thread failed)."""


# --- events delivered to the binding --------------------------------------------------------

PeerT = TypeVar("PeerT")

ConnectionKind = Literal["connected", "disconnected", "handshake_failed", "connect_failed"]


@dataclass(frozen=True, slots=True)
class PeerFrame:
    """Server side: one valid frame from a Prefill peer (``peer`` is its ZMQ routing id).

    ``payload`` is a memoryview of ZMQ's buffer for a large frame (not copied), else bytes.
    """

    peer: bytes
    payload: bytes | memoryview


@dataclass(frozen=True, slots=True)
class ConnFrame:
    """Client side: one valid frame from the Decode endpoint ``conn`` ("host:port")."""

    conn: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class PeerSendFailed:
    """Server side: a reply could not be handed to ZMQ and was dropped.

    ``reason`` is "unreachable" (no connection with that routing id any more: the peer left)
    or "queue_full" (the peer's ZMQ queue is at its high-water mark: it stopped reading).
    """

    peer: bytes
    payload: bytes
    reason: Literal["unreachable", "queue_full"]


@dataclass(frozen=True, slots=True)
class ConnectionEvent(Generic[PeerT]):
    """A connection came up or went down (from a ZMQ socket monitor).

    ``conn`` is the Decode endpoint on the client side. On the server it is None: ZMQ does not
    tell which routing id a TCP connection carries; ``address`` is the bound endpoint there.
    "connected" means the ZMTP handshake succeeded; "disconnected" covers peer close, network
    loss and heartbeat timeout; "connect_failed" means the client could not create the socket.
    """

    conn: PeerT
    kind: ConnectionKind
    address: str


@dataclass(frozen=True, slots=True)
class TimerDue:
    """The deadline armed with ``set_timer`` has passed; ``now`` is ``time.monotonic()``."""

    now: float


ServerEvent = PeerFrame | PeerSendFailed | ConnectionEvent[None] | TimerDue
ClientEvent = ConnFrame | ConnectionEvent[str] | TimerDue


@dataclass
class ControlStats:
    """Counters of one socket set (a snapshot is returned by ``stats``)."""

    frames_in: int = 0  # valid frames delivered
    frames_out: int = 0  # frames handed to ZMQ
    malformed_frames: int = 0  # wrong frame count once empty frames are dropped
    send_failures: int = 0  # server: replies ZMQ refused (see PeerSendFailed)
    queue_full: int = 0  # send() calls refused with QueueFull
    dropped_outgoing: int = 0  # client: queued frames discarded by disconnect() or close()
    dropped_events: int = 0  # events lost because the incoming queue was full
    dropped_over_budget: int = 0  # server: frames refused on arrival, peer/total byte budget
    dropped_over_budget_bytes: int = 0  # their payload bytes
    peers_over_budget: int = 0  # server: peers that had a frame refused (each logged once)
    handler_errors: int = 0  # exceptions raised by the handler (logged, never fatal)
    connected: int = 0
    disconnected: int = 0
    timers_fired: int = 0


# --- host/port helpers ----------------------------------------------------------------------


def parse_conn(conn: str) -> tuple[str, int]:
    """Split a "host:port" (or "[v6-host]:port") connection name; ConfigError if malformed."""
    host, sep, port_text = conn.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit():
        raise ConfigError(f"connection name must be 'host:port', got {conn!r}")
    port = int(port_text)
    if not 0 < port <= 65535:
        raise ConfigError(f"port of {conn!r} must lie in [1, 65535], got {port}")
    return host, port


def tcp_url(host: str, port: int | str) -> str:
    """The ZMQ endpoint for ``host``/``port``; IPv6 literals get brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def is_ipv6(host: str) -> bool:
    """True for an IPv6 literal (ZMQ needs ZMQ_IPV6 set to use it)."""
    return ":" in host


# --- the bounded event queue used when no handler is given ----------------------------------

E = TypeVar("E")


def wait_for_items(
    cond: threading.Condition,
    ready: Callable[[], bool],
    closed: Callable[[], bool],
    timeout: float | None,
) -> bool:
    """Wait on ``cond`` (held) until ``ready()``: True then; False after ``timeout`` seconds
    (None: forever). Raises :class:`ControlClosed` once ``closed()`` and not ready: a
    closed queue is drained before it refuses."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ready():
        if closed():
            raise ControlClosed("the control socket set is closed")
        if deadline is None:
            cond.wait()
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            cond.wait(left)
    return True


class EventQueue(Generic[E]):
    """A bounded FIFO between the I/O thread (producer) and binding threads (consumers).

    Thread-safe. ``on_room`` is called (outside the lock) when ``get`` takes an item from a
    full queue, so the I/O thread, which stops reading while the queue is full, resumes.
    """

    def __init__(self, capacity: int, on_room: Callable[[], None]) -> None:
        self._items: collections.deque[E] = collections.deque()
        self._capacity = capacity
        self._on_room = on_room
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

    def room(self) -> int:
        """Free slots now (only the I/O thread adds, so this only grows until it adds)."""
        with self._cond:
            return self._capacity - len(self._items)

    def put(self, item: E) -> bool:
        """Append unless full; False means the item was not queued."""
        with self._cond:
            if len(self._items) >= self._capacity:
                return False
            self._items.append(item)
            self._cond.notify()
            return True

    def get(self, timeout: float | None) -> E | None:
        """Next item, waiting up to ``timeout`` seconds (None: forever); None on timeout.

        Raises :class:`ControlClosed` once the queue is closed and empty.
        """
        with self._cond:
            if not wait_for_items(
                self._cond, lambda: bool(self._items), lambda: self._closed, timeout
            ):
                return None
            was_full = len(self._items) >= self._capacity
            item = self._items.popleft()
        if was_full:
            self._on_room()
        return item

    def close(self) -> None:
        """Wake every waiter; later ``get`` calls drain what is left, then raise."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
