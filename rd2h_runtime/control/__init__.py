"""The ZMQ control plane: Decode's ROUTER server and Prefill's DEALER client.

Theory of operation
-------------------
This package moves bytes frames with the v1 framing and nothing else: it never decodes a
message and knows nothing of the protocol endpoints. A binding layer feeds the events it
delivers (:class:`PeerFrame` / :class:`ConnFrame`, :class:`TimerDue`,
:class:`ConnectionEvent`, :class:`PeerSendFailed`) into the sans-IO endpoints and executes
their outputs with ``send`` and ``set_timer``.

Each socket set (:class:`DecodeControlServer`, :class:`PrefillControlClient`) owns one I/O
thread and, unless given one, one ZMQ context. Only that thread touches its sockets; it
blocks in a poller whose timeout is the earlier of the armed timer and ``idle_poll_s``, so
an idle set costs nothing and a timer fires on time. Other threads queue frames (bounded:
:class:`QueueFull` when full) and wake the loop through an inproc PAIR. Sends are
non-blocking everywhere, so one slow or dead peer never stalls another, and replies keep
flowing while data reads run on the binding's workers. ZMQ heartbeats detect peers that
vanished; ZMQ_MAXMSGSIZE refuses oversized frames before they reach Python.

The Decode server, which any Prefill may reach, also holds each peer's received frames to
byte budgets and runs its handler on a dispatcher thread that serves peers fairly (see
:mod:`rd2h_runtime.control._inbox`), so one peer's flood neither grows the process without
bound nor holds up the others.
"""

from rd2h_runtime.control._common import (
    BindError,
    ClientEvent,
    ConnectionEvent,
    ConnFrame,
    ControlClosed,
    ControlError,
    ControlOptions,
    ControlStats,
    PeerFrame,
    PeerSendFailed,
    QueueFull,
    ServerEvent,
    TimerDue,
    parse_conn,
    tcp_url,
)
from rd2h_runtime.control.client import PrefillControlClient
from rd2h_runtime.control.server import DecodeControlServer

__all__ = [
    "BindError",
    "ClientEvent",
    "ConnFrame",
    "ConnectionEvent",
    "ControlClosed",
    "ControlError",
    "ControlOptions",
    "ControlStats",
    "DecodeControlServer",
    "PeerFrame",
    "PeerSendFailed",
    "PrefillControlClient",
    "QueueFull",
    "ServerEvent",
    "TimerDue",
    "parse_conn",
    "tcp_url",
]
