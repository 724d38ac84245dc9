"""ZMQ socket helpers of the control plane's I/O thread: the options every control socket
gets, its connection monitor's events, and cheap input checks and draining.

Apart from :mod:`rd2h_runtime.control._loop` because they act on one socket given its
options and counters, whatever loop owns it; the loop keeps the thread, the polling and
the event delivery. I/O thread only, as every socket use.
"""

from __future__ import annotations

import struct
from typing import Final, cast

import zmq

from rd2h_runtime.control._common import ConnectionKind, ControlOptions, ControlStats

__all__ = [
    "MONITOR_EVENTS",
    "MONITOR_KINDS",
    "configure",
    "drain",
    "has_input",
    "ms",
    "read_monitor",
]

#: The monitor events a control socket's monitor reports, and what each surfaces as.
MONITOR_EVENTS: Final = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
MONITOR_KINDS: Final[dict[int, ConnectionKind]] = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "connected",
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_failed",
}


def ms(seconds: float) -> int:
    """``seconds`` as the whole milliseconds ZMQ options take, at least 1."""
    return max(1, round(seconds * 1000))


def has_input(sock: zmq.Socket[bytes]) -> bool:
    """Whether ``sock`` holds a message to receive now (I/O thread).

    Asked before every receive but the first of a poll's turn: a NOBLOCK receive that finds
    nothing raises ``zmq.Again``, which costs pyzmq more than this check (an exception raised and
    caught), and every turn would end with one.
    """
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def drain(sock: zmq.Socket[bytes]) -> None:
    """Receive and drop whatever ``sock`` holds now (the waker's wake-ups)."""
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        if not has_input(sock):
            return


def configure(sock: zmq.Socket[bytes], options: ControlOptions) -> None:
    """Options every control socket gets: no linger, heartbeats, size and queue bounds."""
    o = options
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ms(o.heartbeat_ivl_s))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms(o.heartbeat_timeout_s))
    sock.setsockopt(zmq.HEARTBEAT_TTL, ms(o.heartbeat_ttl_s))
    sock.setsockopt(zmq.MAXMSGSIZE, o.max_frame_bytes)
    sock.setsockopt(zmq.SNDHWM, o.sndhwm)
    sock.setsockopt(zmq.RCVHWM, o.rcvhwm)


def read_monitor(
    mon: zmq.Socket[bytes], budget: int, stats: ControlStats
) -> list[tuple[ConnectionKind, str]]:
    """Drain up to ``budget`` monitor events, keeping the ones we surface (and counting
    connections and disconnections in ``stats``)."""
    out: list[tuple[ConnectionKind, str]] = []
    for n in range(budget):
        if n and not has_input(mon):
            break
        try:
            frames = mon.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        if len(frames) != 2 or len(frames[0]) != 6:
            continue
        (event_id,) = struct.unpack("=H", frames[0][:2])
        kind = MONITOR_KINDS.get(event_id)
        if kind is None:
            continue
        if kind == "connected":
            stats.connected += 1
        elif kind == "disconnected":
            stats.disconnected += 1
        out.append((kind, frames[1].decode("utf-8", "replace")))
    return out
