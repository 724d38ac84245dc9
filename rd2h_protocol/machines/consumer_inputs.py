"""The context each input of the Decode side's machines carries (:class:`~.declare.Input`
types); an input that carries nothing is an ``Input[None]``.

One value per firing instead of padded positional arguments: every handler an input
reaches takes ``(effects, record, ctx)`` (a batched input's: ``(effects, run, ctx)``)
and reads the fields it needs; a handler reached by several inputs takes the base they
share. The classes are plain slotted dataclasses, treated as immutable: a caller may pass
one value for a run of firings (a readiness's requests share one :class:`ReqReadiness`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.plan import RequestRead
from rd2h_protocol.wire.layout import LayerLayout
from rd2h_protocol.wire.messages import Abort, MfMeta, ReadReq

if TYPE_CHECKING:
    from rd2h_protocol.consumer.records import ReadinessRecord, RequestRecord
    from rd2h_protocol.consumer.serving import ShareRule

__all__ = [
    "RdAt",
    "RdFailure",
    "RdPark",
    "ReqAt",
    "ReqDoneSignal",
    "ReqEnd",
    "ReqReadiness",
    "ReqRetry",
    "SessAbort",
    "SessHandshake",
    "SessReadiness",
]


# -- Decode request ------------------------------------------------------------------------


@dataclass(slots=True)
class ReqAt:
    """``LOCAL_ADVERTISE``, ``LOCAL_READ_OK`` (batched), ``LOCAL_ALL_DONE``,
    ``LOCAL_QUIESCENT``, and the base of the inputs that may end the request: when."""

    now: float


@dataclass(slots=True)
class ReqEnd(ReqAt):
    """``LOCAL_FAIL``, ``RECV_ABORT``, ``LOCAL_ABORT``, ``TIMER_LOAD_TIMEOUT``,
    ``LOCAL_RELEASE``, ``LOCAL_RELEASE_BUSY``: why the request fails (if it still waits),
    and the session not to send ABORT to (the one that sent it; None: none)."""

    code: ErrorCode
    text: str
    exclude: str | None = None


@dataclass(slots=True)
class ReqDoneSignal:
    """``RECV_DONE_SIGNAL``: the contributor whose final-layer done signal a successful
    read carried."""

    member: int


@dataclass(slots=True)
class ReqReadiness:
    """``RECV_READINESS`` (batched): the readiness, each request's entry (none for a done
    id alone), the requests it names twice, how it is shared, the session's kept shares
    (None: not its kept entries), when, and the reads collected for its plan."""

    rd: ReadinessRecord
    entry_of: Mapping[str, ReadReq]
    twice: set[str]
    rule: ShareRule
    shares: dict[str, tuple[ReadReq, RequestRecord, object, RequestRead]] | None
    now: float
    reads: list[RequestRead]


@dataclass(slots=True)
class ReqRetry:
    """``LOCAL_READ_RETRY`` (batched): where the read's requests are sorted, those read
    again and those that leave the read (the caller settles these after the batch)."""

    keep: list[RequestRecord]
    gone: list[RequestRecord]


# -- Decode readiness ----------------------------------------------------------------------


@dataclass(slots=True)
class RdPark:
    """``LOCAL_PARK``: its entries packed (None: they stay decoded) and the request ids it
    waits for."""

    packed: bytes | None
    missing: Iterable[str]


@dataclass(slots=True)
class RdAt:
    """``LOCAL_UNPARK``, ``TIMER_PARK_EXPIRED``: when it leaves the park."""

    now: float


@dataclass(slots=True)
class RdFailure:
    """``LOCAL_REFUSE``, ``LOCAL_READ_FAILED``: the failure its reply carries."""

    code: ErrorCode
    text: str


# -- Decode session ------------------------------------------------------------------------


@dataclass(slots=True)
class SessHandshake:
    """``RECV_MF_META_V1`` / ``_V2`` / ``_BAD_V1`` / ``_BAD_V2``: the peer, its MF_META,
    the layouts decoded from it, and why it is refused (None: it is not)."""

    peer: bytes
    msg: MfMeta
    layers: dict[str, LayerLayout]
    refusal: tuple[ErrorCode, str] | None


@dataclass(slots=True)
class SessReadiness:
    """``RECV_READINESS``, ``LOCAL_UNPARKED``: the readiness (received, or out of the
    park) and when."""

    rd: ReadinessRecord
    now: float


@dataclass(slots=True)
class SessAbort:
    """``RECV_ABORT``: the ABORT and when."""

    msg: Abort
    now: float
