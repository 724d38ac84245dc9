"""What goes into and comes out of the two endpoints, as typed values.

A runtime drives :class:`~rd2h_protocol.ProducerEndpoint` (one per Prefill TP rank) and
:class:`~rd2h_protocol.ConsumerEndpoint` (one per Decode TP rank) the same way: call an
input method with ``now`` (monotonic seconds), then execute every output of the returned
list, in order. This module is the vocabulary of that exchange; every name here is also
exported from :mod:`rd2h_protocol`.

Inputs that need more than a name and a time are values too: :class:`Chunk` (the blocks
a Prefill request contributes to one engine step). After an input, call ``get_timer()``
and arrange a ``handle_timer(now)`` call for the deadline it returns.

Prefill endpoint outputs (:data:`ProducerOutput`):

* :class:`Connect` -- open a DEALER to a Decode endpoint, before the first
  :class:`Send` on that connection; :class:`Disconnect` -- close it for good;
* :class:`Send` -- encode the message and send it on the connection;
* :class:`GateOpened` -- a storage slot may be written again: wake the compute path;
* :class:`RequestFinished` -- the request is over, its source blocks may be freed;
* :class:`LayerReplied` -- a layer's reply arrived (a measurement, for metrics);
* :class:`ClaimAnswered` -- answer a Decode's claim of a kept request (Prefill-first).

Decode endpoint outputs (:data:`ConsumerOutput`):

* :class:`Reply` and :class:`SendAbort` -- send to a Prefill peer (a ROUTER identity);
* :class:`StartRead` -- execute a read plan, then report it with ``read_finished``;
* :class:`RequestDone` / :class:`RequestFailed` -- this rank's verdict on a request;
* :class:`Releasable` -- no read can write the request's blocks any more: free them.

:class:`ConnectionView` is what either endpoint says about one peer: the protocol and
capabilities negotiated with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

from rd2h_protocol.errors import ErrorCode, TransferError
from rd2h_protocol.plan import ReadPlan
from rd2h_protocol.wire.messages import Abort, Message

__all__ = [
    "Chunk",
    "ClaimAnswered",
    "Connect",
    "ConnectionView",
    "ConsumerOutput",
    "Disconnect",
    "GateOpened",
    "LayerReplied",
    "ProducerOutput",
    "Releasable",
    "Reply",
    "RequestDone",
    "RequestFailed",
    "RequestFinished",
    "Send",
    "SendAbort",
    "StartRead",
]


# -- inputs --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """The blocks one Prefill request contributes to the current engine step.

    ``main_start`` / ``indexer_start`` are the LOGICAL offsets of these blocks in Decode's
    destination block list (0 for a request's first chunk). ``final`` marks the request's
    last chunk: its done id goes out with the step's last layer.
    """

    ext_req_id: str
    main_block_ids: Sequence[int]
    indexer_block_ids: Sequence[int] = ()
    main_start: int = 0
    indexer_start: int = 0
    final: bool


# -- Prefill endpoint outputs --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connect:
    """Open the control connection ``conn`` (a DEALER to ``host:port``) before using it."""

    conn: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Disconnect:
    """Close the control connection ``conn`` for good (its peer was declared dead, for
    ``reason``); a later :class:`Connect` opens a new one, so that nothing of the old one
    arrives late."""

    conn: str
    reason: str


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` on connection ``conn`` (encode it with :func:`rd2h_protocol.encode`)."""

    conn: str
    msg: Message


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """The request is over: its source blocks may go back to the allocator.

    ``ok`` is True when every layer of every chunk was read (``code`` None); otherwise
    ``code`` and ``message`` give the first reason it stopped. A failed request may still
    be read by a peer that could not be told (a held lease, see
    :mod:`rd2h_protocol.producer`); the storage gates, not the request, keep the compute
    path from overwriting that.
    """

    ext_req_id: str
    ok: bool
    code: ErrorCode | None
    message: str


@dataclass(frozen=True, slots=True)
class GateOpened:
    """Storage slot ``slot`` may be overwritten again (wake the compute path)."""

    slot: int


@dataclass(frozen=True, slots=True)
class LayerReplied:
    """A publication got its terminal reply: how long Decode took, measured on our clock.

    ``round_trip_s`` runs from the readiness going out (``now`` of the call that emitted its
    Send) to the reply being fed in; ``ok`` is False for a read_failed reply.
    """

    conn: str
    layer_idx: int
    round_trip_s: float
    ok: bool


@dataclass(frozen=True, slots=True)
class ClaimAnswered:
    """The answer to a Decode's claim of kept request ``ext_req_id`` (Prefill-first).

    ``ok``: its layers are being published to that Decode; otherwise ``code`` and
    ``message`` say why not (unknown or no longer kept, claimed already, a Decode this
    Prefill cannot serve), and the Decode fails its request.
    """

    ext_req_id: str
    ok: bool
    code: ErrorCode | None
    message: str


ProducerOutput: TypeAlias = (
    Connect | Disconnect | Send | RequestFinished | GateOpened | LayerReplied | ClaimAnswered
)


# -- Decode endpoint outputs ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``msg`` to the Prefill peer ``peer`` (a ZMQ ROUTER identity)."""

    peer: bytes
    msg: Message


@dataclass(frozen=True, slots=True)
class SendAbort:
    """Tell the v2 Prefill peer ``peer`` to stop publishing ``msg.ext_ids``."""

    peer: bytes
    msg: Abort


@dataclass(frozen=True, slots=True)
class StartRead:
    """Execute ``plan`` (one batched read) and report it with ``read_finished(plan.read_id)``.

    ``start_by`` (monotonic seconds, ``None`` without a lease): a read that cannot START
    by then must not start; ask :meth:`may_start`, and report one that may not with
    :meth:`not_started`.

    ``finish_by`` (monotonic seconds, ``None`` without a lease, i.e. from a v1 peer): the
    readiness's receipt plus its whole lease. From then on Prefill may reuse the storage
    the read takes its bytes from, so a read still running is worthless: the runtime must
    bound the read's own deadline by it. (Prefill's lease started when it sent the
    message, a little before the receipt; the half-lease ``start_by`` and a read timeout
    below half the lease are what keep a read clear of it. ``finish_by`` caps a read
    timeout configured too long for the lease.)
    """

    plan: ReadPlan
    start_by: float | None = None
    finish_by: float | None = None

    def may_start(self, now: float) -> bool:
        """Whether the read may still start at ``now``."""
        return self.start_by is None or now <= self.start_by

    def not_started(self, now: float) -> TransferError:
        """The error to report for a read whose ``start_by`` passed before it started."""
        late = 0.0 if self.start_by is None else now - self.start_by
        return TransferError(
            f"read {self.plan.read_id} not started: its start_by passed {late:.3f} s ago",
            code=ErrorCode.LEASE_EXPIRED,
        )


@dataclass(frozen=True, slots=True)
class RequestDone:
    """The request is done on this rank (every contributor, successful reads)."""

    ext_req_id: str


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """The request failed on this rank: its destination blocks hold no valid KV.

    Both block lists are reported as vLLM load errors once the cross-rank rule finishes
    the request.
    """

    ext_req_id: str
    code: ErrorCode
    message: str
    main_block_ids: tuple[int, ...]
    indexer_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Releasable:
    """No read can write the request's blocks any more and vLLM released it: free them."""

    ext_req_id: str


ConsumerOutput: TypeAlias = Reply | SendAbort | StartRead | RequestDone | RequestFailed | Releasable


# -- views ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConnectionView:
    """What was negotiated with one peer.

    ``protocol`` is ``"v2"`` or ``"v1"`` once the handshake decided it, ``None`` before
    (or after a refusal); ``capabilities`` are the v2 capabilities both sides hold (empty
    for v1). ``state`` is the handshake (Prefill) or session (Decode) machine's state.
    """

    name: str
    state: str
    protocol: Literal["v1", "v2"] | None
    capabilities: frozenset[str]

    @classmethod
    def of(
        cls, name: str, state: str, capabilities: frozenset[str], *, v2_state: str, v1_state: str
    ) -> ConnectionView:
        """The view of a peer whose machine is in ``state``: v2 (with its capabilities) in
        ``v2_state``, v1 in ``v1_state``, undecided otherwise."""
        if state == v2_state:
            return cls(name, state, "v2", capabilities)
        return cls(name, state, "v1" if state == v1_state else None, frozenset())
