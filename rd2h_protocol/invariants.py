"""The safety and liveness properties the protocol guarantees, stated once.

The model-checking tests (:mod:`rd2h_protocol.testing`, :mod:`rd2h_protocol.explore`)
check them after every step; the docs generator prints them. Each :class:`Invariant`
says what it promises, what it assumes of the world, and where it does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class Invariant:
    """One property: ``name``, ``kind`` (safety, liveness, bound), the ``statement``, the
    ``assumptions`` it rests on, and the configurations where it ``does_not_hold``."""

    name: str
    kind: str
    statement: str
    assumptions: tuple[str, ...]
    does_not_hold: tuple[str, ...] = ()


INVARIANTS: Final[tuple[Invariant, ...]] = (
    Invariant(
        "S1",
        "safety",
        "A Prefill storage slot (main or indexer, identified by its base addresses) is open "
        "only if every readiness published against that storage has a terminal reply, or its "
        "lease expired AND either the abort was sent or the peer was declared dead: no Decode "
        "read can start after Prefill reuses the buffer. A peer that cannot receive an abort "
        "(v1) holds the gate until it replies or is declared dead.",
        (
            "a Decode never starts a read after it replied for that readiness, nor after "
            "it received an ABORT for its requests (v2) or half the lease passed since receipt",
            "replies are matched by seq toward v2 peers, by layer toward v1 peers",
            "the runtime declares a peer dead only once its connection is gone",
        ),
        (
            'v1_lease_expiry="reopen" toward a v1 Decode: the gate reopens at lease expiry '
            "while that peer may still be reading (v1's own behaviour, off by default)",
        ),
    ),
    Invariant(
        "S2",
        "safety",
        "A Decode request is done only if every contributor of every Decode rank delivered "
        "its final layer after successful reads; a request is never both done and failed.",
        (
            "a connection delivers in order (ZMQ over one TCP connection); a lost frame is "
            "never followed by a duplicate of it",
            "a v2 Prefill numbers its readiness consecutively per connection from the "
            "first_seq its MF_META announces, so a readiness lost on a live connection is a "
            "seq gap, and Decode fails every request of that session (READINESS_LOST)",
            "done signals count only after the read of their message succeeded",
        ),
        (
            "a v1 Prefill (no seq): a readiness lost on a live connection is invisible to "
            "Decode, which can complete a request with that layer missing; v1 peers are "
            "protected from everything else (layout, ranges, identity by name, leases on "
            "the Prefill side) but not from this",
            "a v2 Prefill of an earlier rd2h release (no first_seq): the same, for the "
            "first readiness after each handshake only",
        ),
    ),
    Invariant(
        "S3",
        "safety",
        "Decode destination blocks are released only when the request is quiescent: no read "
        "that may write them is in flight or can still start.",
        (
            "the runtime reports the end of every read it started (success, failure or "
            "timeout), and a read never writes after it was reported",
        ),
    ),
    Invariant(
        "L1",
        "liveness",
        "Once the network drains, time passes every lease and the runtime declares silent "
        "peers dead, every gate is open and every request is terminal, on both sides.",
        (
            "time advances and timers fire",
            "a peer that stops answering is eventually declared dead by the runtime",
        ),
        (
            "a v1 Decode that keeps its connection (libzmq answers heartbeats for it) but "
            "never replies holds every gate it was sent, with the default "
            'v1_lease_expiry="hold", for as long as it stays connected',
        ),
    ),
    Invariant(
        "B1",
        "bound",
        "After all requests end, no per-request state remains in any endpoint.",
        ("every request ends: done, failed, aborted or released on both sides",),
    ),
)
