"""The Prefill endpoint's records: one per instance of a machine in
:mod:`rd2h_protocol.machines.producer`.

A :class:`Gate` per storage slot, a :class:`Conn` per Decode endpoint (its handshake),
a :class:`Request` per Prefill request, a :class:`Pub` per layer publication and a
:class:`Kept` per request kept for the Decode that will claim it (Prefill-first). Each
record's ``state`` is the state of its machine; only the tables change it. They are
public to this package, the model checker (which snapshots them field by field,
:mod:`rd2h_protocol.checker`) and tests; not to the runtime, which reads the endpoint's
views.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.machines.producer import CONN_IDLE, GATE_OPEN, KEPT_WAITING, PUB_QUEUED
from rd2h_protocol.topology import Contributor
from rd2h_protocol.wire.messages import ReadReq


@dataclass(slots=True, eq=False)
class Gate:
    state: str = GATE_OPEN
    outstanding: int = 0


@dataclass(slots=True, eq=False)
class Conn:
    name: str
    host: str
    port: int
    d_tp: int
    contributor: Contributor
    state: str = CONN_IDLE
    connected: bool = False
    caps: frozenset[str] = frozenset()
    next_seq: int = 0
    sent: dict[int, Pub] = field(default_factory=dict)  # seq -> publication, send order
    queue: list[Pub] = field(default_factory=list)  # waiting for the handshake
    pending_aborts: list[str] = field(default_factory=list)  # waiting for the handshake
    history: OrderedDict[int, tuple[int, str]] = field(default_factory=OrderedDict)
    handshake_token: int = -1
    refusals: int = 0  # consecutive refused handshakes
    retry_at: float = 0.0  # a refused connection is tried again from then on
    refusal: str = ""  # why the peer refused, for the requests failed meanwhile
    reconnect: bool = False  # declared dead: the next handshake starts with a Connect
    last_heard: float = float("-inf")  # now of the last frame from it (silent peers)


@dataclass(slots=True, eq=False)
class Request:
    ext_id: str
    conn: Conn
    state: str
    outstanding: int = 0  # live publications that name this request
    chunk: ReadReq | None = None  # this step's blocks
    aborted_toward_peer: bool = False  # an ABORT naming it was emitted (not just queued)
    code: ErrorCode = ErrorCode.UNKNOWN
    message: str = ""


@dataclass(slots=True, eq=False)
class Pub:
    uid: int
    conn: Conn
    layer_idx: int
    slots: tuple[int, ...]
    read_reqs: list[ReadReq]
    done_ids: list[str]
    requests: tuple[Request, ...]
    deadline: float
    state: str = PUB_QUEUED
    seq: int | None = None  # key in conn.sent while on the wire
    sent_at: float = 0.0  # now of the last Send of its readiness
    held_at: float = 0.0  # now when it was held (silent peers)


@dataclass(slots=True, eq=False)
class Kept:
    ext_id: str
    uid: int  # its claim window's timer
    deadline: float  # the claim window ends
    state: str = KEPT_WAITING
    claimed_by: str = ""  # the connection of the Decode that claimed it
