"""The context each input of the Prefill side's machines carries (:class:`~.declare.Input`
types); an input that carries nothing is an ``Input[None]``, a storage gate's input the
slot (``Input[int]``).

One value per firing instead of padded positional arguments: every handler an input
reaches takes ``(effects, record, ctx)`` and reads the fields it needs; a handler
reached by several inputs takes the base they share. Outputs are not part of a context:
every handler appends them to the shared state's ``out`` list, which the endpoint's
input method hands back. The classes are plain slotted
dataclasses (a frozen one costs ~0.8 us to build, a slotted one ~0.1 us), treated as
immutable: a caller may pass one value for a run of firings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.events import Chunk
from rd2h_protocol.wire.messages import Abort, Ack, FailedRequest, ReadFailed

if TYPE_CHECKING:
    from rd2h_protocol.machines.declare import Input
    from rd2h_protocol.producer.records import Conn, Pub

__all__ = [
    "ClaimAt",
    "ConnAbort",
    "ConnAck",
    "ConnAt",
    "ConnEnd",
    "PubAt",
    "PubEnd",
    "PubExpiry",
    "PubLost",
    "PubRelease",
    "PubReply",
    "ReqAbort",
    "ReqChunk",
    "ReqFailure",
    "ReqPeerAbort",
]


@dataclass(slots=True)
class PubAt:
    """``SEND_READINESS``, ``LOCAL_RESEND`` (and ``_LAPSED``), ``LOCAL_LEASE_LAPSED``,
    ``TIMER_DUE``: when."""

    now: float


@dataclass(slots=True)
class PubEnd(PubAt):
    """The base of every input that may end the publication: the storage gate inputs
    that count it off its gates (``one`` while others are outstanding there, ``last`` for
    the last one)."""

    one: Input[int]
    last: Input[int]


@dataclass(slots=True)
class PubReply(PubEnd):
    """``RECV_DONE``, ``RECV_FAILED``, ``RECV_UNKNOWN_SESSION``: the reply's input, the
    requests it failed alone (done) and the failure (failed)."""

    event: Input[PubReply]
    failed: list[FailedRequest] | None
    read_failed: ReadFailed | None


@dataclass(slots=True)
class PubRelease(PubEnd):
    """``LOCAL_RELEASE``: it never left; why its requests fail."""

    code: ErrorCode
    message: str


@dataclass(slots=True)
class PubLost(PubEnd):
    """``LOCAL_CONNECTION_LOST``: the publications orphaned by it are collected here."""

    orphans: list[Pub]


@dataclass(slots=True)
class PubExpiry(PubEnd):
    """``TIMER_LEASE_EXPIRED`` (and its ``_UNTOLD`` / ``_UNSAFE`` forms): the ids of its
    requests not told yet; ``one`` / ``last`` count an orphaned one off its gates (its
    peer is dead; the other rows' handlers name their own gate inputs)."""

    ids: list[str]


# -- connection handshake ------------------------------------------------------------------


@dataclass(slots=True)
class ConnAt:
    """``LOCAL_PUBLISH`` (and ``_BACKOFF``), ``RECV_UNKNOWN_SESSION``: when, and the
    publication that waits for the connection (None when no publication is at stake;
    ``LOCAL_PUBLISH`` always names one)."""

    now: float
    pub: Pub | None


@dataclass(slots=True)
class ConnAck(ConnAt):
    """``RECV_ACK_V1``, ``RECV_ACK_V2``, ``RECV_ACK_REFUSED``: the peer's answer."""

    ack: Ack


@dataclass(slots=True)
class ConnAbort:
    """``LOCAL_ABORT`` (and ``_UNTOLD``): the ids our ABORT names, and why."""

    ext_ids: list[str]
    reason: str


@dataclass(slots=True)
class ConnEnd(ConnAt):
    """``TIMER_HANDSHAKE_EXPIRED``, ``LOCAL_CONNECTION_LOST``: why what waited fails."""

    message: str


# -- Prefill request -----------------------------------------------------------------------


@dataclass(slots=True)
class ReqChunk:
    """``LOCAL_CHUNK``, ``LOCAL_FINAL_CHUNK``, ``LOCAL_CLAIMED``: the step's chunk and its
    block ids (checked, as lists)."""

    chunk: Chunk
    main: list[int]
    indexer: list[int]


@dataclass(slots=True)
class ReqFailure:
    """``RECV_FAILURE``, ``LOCAL_FAILURE``: why it stops (the first reason is kept)."""

    code: ErrorCode
    message: str


@dataclass(slots=True)
class ReqAbort:
    """``LOCAL_ABORT``: our reason, and the ids to tell each connection, collected."""

    reason: str
    by_conn: dict[str, list[str]]


@dataclass(slots=True)
class ReqPeerAbort:
    """``RECV_ABORT``: the Decode's ABORT and the connection it came on."""

    conn: Conn
    msg: Abort


# -- kept request --------------------------------------------------------------------------


@dataclass(slots=True)
class ClaimAt:
    """``RECV_CLAIM``, ``RECV_CLAIM_UNUSABLE``: the claiming connection (None when its
    target is refused), the claim's chunk, why it is unusable ("" when usable), and when."""

    conn: Conn | None
    chunk: Chunk
    problem: str
    now: float
