"""The safety and liveness properties the protocol guarantees, stated once, and checked.

The model checker (the hypothesis state machine of :mod:`rd2h_protocol.checker.stateful`
and the explorer of :mod:`rd2h_protocol.checker.explore`) checks them after every step;
the docs generator prints them. Each :class:`Invariant` says what it promises, what it
assumes of the world, and where it does not hold.

The ``check_*`` functions below are the checks of what the endpoints themselves hold
(each raises :class:`InvariantViolation` naming its invariant); the model world adds the
checks that need its memory model (a read that copies reused storage, a done request
whose destination blocks hold the wrong data) and calls these at every step.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from rd2h_protocol.completion import CrossRankCompletion
from rd2h_protocol.consumer import ConsumerEndpoint
from rd2h_protocol.machines.producer import GATE_OPEN
from rd2h_protocol.producer import ProducerEndpoint


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
        "lease expired AND either the abort was sent to a peer the lease bounds or the peer "
        "was declared dead: no Decode read can start after Prefill reuses the buffer. A peer "
        "that cannot receive an abort (v1), or whose reads no lease bounds (a v2 Decode "
        "without the lease capability), holds the gate until it replies or is declared dead. "
        "A request Prefill keeps for the Decode that will claim it (Prefill-first) is "
        "published once at most, to the first claim it accepts, and no read of its blocks "
        "can start once Prefill finished it (its blocks may then be freed).",
        (
            "a Decode never starts a read after it replied for that readiness, nor after "
            "it received an ABORT for its requests (v2) or half the lease passed since receipt",
            "replies are matched by seq toward v2 peers, by layer toward v1 peers",
            "the runtime declares a peer dead only once its connection is gone, or once it "
            "sent nothing at all for silent_peer_timeout_s while it held storage",
            "Prefill-first: the runtime leaves a kept request's blocks untouched until "
            "RequestFinished names it, and its layers live in storage of their own (a "
            "Prefill whose layers share storage refuses to keep a request)",
        ),
        (
            'v1_lease_expiry="reopen" toward a v1 Decode: the gate reopens at lease expiry '
            "while that peer may still be reading (v1's own behaviour, off by default)",
            "a Decode that cannot be told to stop (v1, or a v2 one without abort or lease) "
            "and sends nothing for silent_peer_timeout_s (by default one more lease, at "
            "least SILENT_FLOOR_S) after a lease ran out is declared dead and the storage "
            "it held reopens: if it was slow rather than dead, a read it starts after "
            "that reads reused storage. The price of L1: without it one such peer holds "
            "every storage it was sent for as long as libzmq keeps its connection, and "
            "stalls every other peer (silent_peer_timeout_s=None keeps S1 and gives up L1 "
            "instead)",
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
            "a v1 Prefill, or a Decode without the seq capability (no seq): a readiness lost "
            "on a live connection is invisible to Decode, which can complete a request with "
            "that layer missing; v1 peers are protected from everything else (layout, "
            "ranges, identity by name, leases on the Prefill side) but not from this",
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
        "peers dead, every gate is open and every request is terminal, on both sides. A "
        "request Prefill keeps for a Decode's claim (Prefill-first) ends too: read by the "
        "Decode whose claim it accepted, or finished unread (not ok) once its claim window "
        "ran out, when no claim came (the Decode never came, or its claim was lost).",
        (
            "time advances and timers fire",
            "a peer that stops answering is eventually declared dead by the runtime",
            "a Prefill that dies takes the requests it kept with it (their blocks are gone "
            "with its process); a Decode whose claim is refused fails its request, and one "
            "whose claim or answer never arrives fails it at its load timeout",
        ),
        (
            "with silent_peer_timeout_s=None, a v1 Decode that keeps its connection (libzmq "
            "answers heartbeats for it) but never replies holds every gate it was sent, "
            'with v1_lease_expiry="hold", for as long as it stays connected',
            "a readiness lost on a live connection toward a Decode whose storage waits for "
            "its reply (from a v1 Prefill, to a v1 Decode or a v2 one without the abort or "
            "the lease capability) is never answered: its storage stays held until the runtime "
            "declares the peer dead. A v2 Decode with the resend capability answers the one "
            "resend a held publication makes (it serves a seq it never got, or answers one "
            "lost in a gap with READINESS_LOST), so there it takes a second fault: that "
            "answer dropped, or the Decode dead",
        ),
    ),
    Invariant(
        "B1",
        "bound",
        "After all requests end, no per-request state remains in any endpoint.",
        ("every request ends: done, failed, aborted or released on both sides",),
    ),
)


#: Decode request states that are terminal on a rank (before vLLM releases them).
DECODE_ENDED: Final = frozenset({"done_on_rank", "failed", "aborted"})


class InvariantViolation(AssertionError):
    """An invariant of :data:`INVARIANTS` (or the model world's data check) broke.

    ``name`` is the invariant (S1, S2, S3, L1, B1), ``DATA`` for a read whose blocks
    landed in the wrong place, or ``CRASH`` (explorer) for an endpoint that raised;
    ``detail`` says what was seen.
    """

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"{name}: {detail}")
        self.name = name
        self.detail = detail

    def __reduce__(self) -> tuple[type[InvariantViolation], tuple[str, str]]:
        return type(self), (self.name, self.detail)  # results cross process boundaries


def check_storage_gates(session: str, producer: ProducerEndpoint) -> None:
    """S1 on one Prefill rank: a slot is open only while no publication against it is
    outstanding (the gate's own count, and every live publication's slots)."""
    gates = producer.gates()
    for slot, (state, outstanding) in gates.items():
        if state == GATE_OPEN and outstanding:
            raise InvariantViolation(
                "S1", f"{session} slot {slot} is open with {outstanding} publications outstanding"
            )
    for view in producer.publications().values():
        for slot in view.slots:
            if gates[slot][0] == GATE_OPEN:
                raise InvariantViolation(
                    "S1",
                    f"{session} slot {slot} is open while layer {view.layer_idx} toward "
                    f"{view.conn} is {view.state}",
                )


def check_read_may_start(
    reader: str, read_id: int, session: str, producer: ProducerEndpoint, layer: int
) -> None:
    """S1 for a read that Decode ``reader`` may still start: every storage slot of its
    layer on Prefill ``session`` is closed."""
    gates = producer.gates()
    for slot in producer.layer_slots(layer):
        if gates[slot][0] == GATE_OPEN:
            raise InvariantViolation(
                "S1",
                f"{session} slot {slot} is open while Decode {reader} may still start read "
                f"{read_id} of layer {layer}",
            )


def check_claim_answer(session: str, ext: str, before: str | None, accepted: bool) -> None:
    """S1 (Prefill-first): Prefill ``session`` accepts a claim of ``ext`` only while it keeps
    it unclaimed (kept request state ``before`` the claim was ``waiting``): a request is
    published once, to the first claim; a repeat, a second Decode, or a claim of a request
    it never kept or finished already is refused.

    Assumes the runtime hands each claim to the endpoint of the Prefill incarnation that
    received it, with the request's blocks as that incarnation kept them."""
    if accepted and before != "waiting":
        raise InvariantViolation(
            "S1",
            f"{session} accepted a claim of {ext} in kept state {before!r}: published "
            "again, or publishing blocks it no longer holds",
        )


def check_kept_read_may_start(
    reader: str, read_id: int, session: str, producer: ProducerEndpoint, kept: Iterable[str]
) -> None:
    """S1 (Prefill-first) for a read that Decode ``reader`` may still start: each request of
    ``kept`` (the Prefill-first requests it reads) is still a request of Prefill
    ``session``, which then holds its blocks; once Prefill finished it (read, aborted, or
    its claim window ran out) the runtime may free and reuse them.

    Assumes the runtime frees a kept request's blocks only once ``RequestFinished`` names
    it (and the gate check, :func:`check_read_may_start`, covers the storage itself)."""
    held = producer.requests()
    for ext in kept:
        if ext not in held:
            raise InvariantViolation(
                "S1",
                f"Decode {reader} may still start read {read_id} of kept request {ext} from "
                f"{session}, which finished it (its blocks may be freed)",
            )


def check_kept_settled(
    producers: Mapping[str, ProducerEndpoint], kept: Mapping[tuple[str, str], bool]
) -> None:
    """L1 (Prefill-first) once everything settled: no live Prefill incarnation keeps a
    request (claimed and read, or its claim window ran out), and every request one kept
    was finished there (``kept``: ``(session, ext) -> claimed`` of the requests kept and
    not finished yet, as the model world records them; a dead incarnation's are gone
    with it).

    Assumes time advances past every claim window (``ProducerConfig.claim_timeout_s``)."""
    for session, prod in producers.items():
        waiting = prod.kept()
        if waiting:
            raise InvariantViolation("L1", f"{session} still keeps {waiting}")
    for (session, ext), claimed in kept.items():
        if session in producers:
            what = "claimed" if claimed else "never claimed"
            raise InvariantViolation("L1", f"{session} kept {ext} ({what}) and never finished it")


def check_done_on_rank(where: str, ext: str, contributors: Collection[int], ratio: int) -> None:
    """S2 on one Decode rank: request ``ext`` is done only once every one of its ``ratio``
    contributors delivered its final layer with a successful read."""
    need = set(range(ratio))
    if set(contributors) != need:
        raise InvariantViolation(
            "S2",
            f"{ext} done on Decode {where} with final layers from contributors "
            f"{sorted(contributors)} of {sorted(need)}",
        )


def check_single_outcome(where: str, ext: str, before: str | None, outcome: str) -> None:
    """S2: a request reports one terminal outcome on a rank (never done and failed)."""
    if before is not None:
        raise InvariantViolation("S2", f"{ext} on Decode {where} reported {outcome} after {before}")


def check_release(where: str, ext: str, reads_writing: Iterable[int]) -> None:
    """S3: Decode releases ``ext``'s blocks only when no read that writes them is in flight."""
    for read_id in reads_writing:
        raise InvariantViolation(
            "S3",
            f"{ext} released on Decode {where} while read {read_id} that writes its blocks "
            "is in flight",
        )


def check_quiescent(
    producers: Mapping[str, ProducerEndpoint], consumers: Mapping[str, ConsumerEndpoint]
) -> None:
    """L1 once everything settled: every gate open, every request terminal, no deadline
    left, on both sides (keys name the endpoints in the message)."""
    for session, prod in producers.items():
        closed = {s: g for s, g in prod.gates().items() if g[0] != GATE_OPEN}
        if closed:
            raise InvariantViolation("L1", f"{session} gates still closed: {closed}")
        if prod.requests():
            raise InvariantViolation("L1", f"{session} requests not finished: {prod.requests()}")
        if prod.get_timer() is not None:
            raise InvariantViolation("L1", f"{session} still waits for a deadline")
    for where, cons in consumers.items():
        waiting = {x: s for x, s in cons.requests().items() if s not in DECODE_ENDED}
        if waiting:
            raise InvariantViolation("L1", f"Decode {where} requests not terminal: {waiting}")
        if cons.in_flight_reads() or cons.parked() or cons.get_timer() is not None:
            raise InvariantViolation("L1", f"Decode {where} is not quiet")


def check_idle(
    producers: Mapping[str, ProducerEndpoint],
    consumers: Mapping[str, ConsumerEndpoint],
    completions: Mapping[str, CrossRankCompletion],
) -> None:
    """B1 after every request ended and was released: no per-request state anywhere."""
    for session, prod in producers.items():
        if not prod.is_idle():
            raise InvariantViolation("B1", f"{session} keeps request state")
    for where, cons in consumers.items():
        if not cons.is_idle():
            raise InvariantViolation("B1", f"Decode {where} keeps request state: {cons.requests()}")
    for engine, comp in completions.items():
        if not comp.is_idle():
            raise InvariantViolation("B1", f"engine {engine} completion keeps {comp.pending()}")
