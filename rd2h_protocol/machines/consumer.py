"""The Decode side's state machines, declared once as data.

Theory of operation
-------------------
A Decode TP rank owns destinations and pulls data into them. Three machines of its own
(plus the two completion machines of :mod:`rd2h_protocol.completion`) track that; every
rule that changes their state lives in the tables below, and
:mod:`rd2h_protocol.consumer` only resolves guards (counts, lookups; :data:`GUARDS` says
which method resolves each) and binds each named effect to the handler that performs it
(the table drives the action: see :mod:`rd2h_protocol.machines.declare`).

* **Decode request** (one per request this rank will receive KV for):
  ``allocated`` (destination blocks known) -> ``advertised`` (rendezvous posted) ->
  ``receiving`` (readiness accepted for it) -> ``done_on_rank`` | ``failed`` |
  ``aborted``; then, when vLLM finishes the request, ``released`` if no read can still
  write its blocks (quiescent) or ``release_pending`` until the last read in flight
  ends. Blocks are handed back to vLLM (``Releasable``) only on entering ``released``.
  Readiness for a request that is no longer waiting is *isolated*: left out of the read
  and reported alone, so nothing is ever written into the blocks of a request that is
  done, failed, aborted or being released. Every request the endpoint was given ends in
  exactly one terminal report (``RequestDone`` or ``RequestFailed``): that is what lets
  the cross-rank completion rule always finish. A request that fails (read failure,
  isolation, timeout, abort, release before its KV arrived) tells its v2 Prefill
  peers with ABORT so they stop publishing it.
* **Decode readiness** (one per READ_READY_BATCH received): ``received`` -> ``parked``
  (it names a request this rank does not know yet: the rendezvous outran the worker) ->
  ``received`` again when the requests arrive or the park bound runs out -> ``reading``
  (one batched read started) -> ``replied``. Every readiness gets exactly one reply,
  even when this rank has nothing to read, so no Prefill gate can wait forever.
* **Decode session** (one per Prefill session, ``p_session`` of MF_META; a peer identity
  without one is ``unbound``): the MF_META shape says v1 (no version: reply the raw
  ``b"ACK"``) or v2 (reply ``Ack`` with version and capabilities). A refused handshake
  (undecodable layout, compat mismatch) leaves the session ``refused``; its readiness is
  answered with a failure. Readiness from an ``unbound`` peer is answered with
  ``UNKNOWN_SESSION`` (a v2 Prefill re-handshakes and replays it once).

Inputs follow the naming of :mod:`rd2h_protocol.machines.declare`: ``LOCAL_*`` from our caller
or our own decisions, ``RECV_*`` from the peer, ``TIMER_*`` when a deadline passed.
"""

from __future__ import annotations

from typing import Final

from rd2h_protocol.completion import CONTRIBUTOR_COMPLETION, CROSS_RANK_COMPLETION
from rd2h_protocol.completion import GUARDS as COMPLETION_GUARDS
from rd2h_protocol.events import Releasable, Reply, RequestDone, RequestFailed, StartRead
from rd2h_protocol.machines.consumer_inputs import (
    RdAt,
    RdFailure,
    RdPark,
    ReqAt,
    ReqDoneSignal,
    ReqEnd,
    ReqReadiness,
    ReqRetry,
    SessAbort,
    SessHandshake,
    SessReadiness,
)
from rd2h_protocol.machines.declare import NO_EFFECT, Guard, Input, MachineSpec, check_guards, stay

#: Every guard the Decode tables name: what it says and the method that resolves it.
GUARDS: Final[dict[str, Guard]] = {
    "all_contributors_reported": Guard(
        "every contributor's final-layer done signal was counted",
        "ReadinessEffects.count_done (ContributorSet.complete)",
    ),
    "no_read_in_flight": Guard(
        "no read that writes the request's blocks is in flight (in_flight == 0)",
        "ReadinessEffects.count_done, ConsumerEndpoint.release, RequestEffects.release_quiescent",
    ),
    "no_parked_readiness_names_it": Guard(
        "no parked readiness names the request (its blocks are not all read yet)",
        "Parking.named_by_parked",
    ),
    "read_in_flight": Guard(
        "a read that writes the request's blocks is in flight (in_flight > 0)",
        "ConsumerEndpoint.release",
    ),
    "requests_unknown": Guard(
        "the readiness names requests this rank neither holds nor retired",
        "Serving.serve (allow_park)",
    ),
    "park_has_room": Guard(
        "the park has room: max_parked, max_parked_bytes(_per_session)",
        "Parking.park_has_room",
    ),
    "requests_known": Guard(
        "every request the parked readiness waited for arrived or retired",
        "Parking.resolve_waiting",
    ),
    "lease_leaves_half": Guard(
        "at least half of lease_ms is left since the readiness arrived (start_by)",
        "Serving.serve, ReadinessEffects.may_retry",
    ),
    "transient_error": Guard("the read's TransferError is transient", "ReadinessEffects.may_retry"),
    "error_not_lease_expired": Guard(
        "the read's error is not LEASE_EXPIRED", "ReadinessEffects.may_retry"
    ),
    "retries_left": Guard("max_read_retries not used up", "ReadinessEffects.may_retry"),
    "a_request_still_receiving": Guard(
        "a request of the read is still receiving", "ReadinessEffects.may_retry"
    ),
    **COMPLETION_GUARDS,
}


# -- Decode request ------------------------------------------------------------------------

REQ_ALLOCATED: Final = "allocated"
REQ_ADVERTISED: Final = "advertised"
REQ_RECEIVING: Final = "receiving"
REQ_DONE: Final = "done_on_rank"
REQ_FAILED: Final = "failed"
REQ_ABORTED: Final = "aborted"
REQ_RELEASE_PENDING: Final = "release_pending"
REQ_RELEASED: Final = "released"

# Each input's context type: rd2h_protocol.machines.consumer_inputs.
R_LOCAL_ADVERTISE: Final[Input[ReqAt]] = Input("LOCAL_ADVERTISE")
R_RECV_READINESS: Final[Input[ReqReadiness]] = Input("RECV_READINESS")
R_LOCAL_READ_OK: Final[Input[ReqAt]] = Input("LOCAL_READ_OK")
R_LOCAL_READ_RETRY: Final[Input[ReqRetry]] = Input("LOCAL_READ_RETRY")
R_RECV_DONE_SIGNAL: Final[Input[ReqDoneSignal]] = Input("RECV_DONE_SIGNAL")
R_LOCAL_ALL_DONE: Final[Input[ReqAt]] = Input("LOCAL_ALL_DONE")
R_LOCAL_FAIL: Final[Input[ReqEnd]] = Input("LOCAL_FAIL")
R_RECV_ABORT: Final[Input[ReqEnd]] = Input("RECV_ABORT")
R_LOCAL_ABORT: Final[Input[ReqEnd]] = Input("LOCAL_ABORT")
R_TIMER_LOAD_TIMEOUT: Final[Input[ReqEnd]] = Input("TIMER_LOAD_TIMEOUT")
R_LOCAL_RELEASE: Final[Input[ReqEnd]] = Input("LOCAL_RELEASE")
R_LOCAL_RELEASE_BUSY: Final[Input[ReqEnd]] = Input("LOCAL_RELEASE_BUSY")
R_LOCAL_QUIESCENT: Final[Input[ReqAt]] = Input("LOCAL_QUIESCENT")

# An entry that is not sound (named twice, another tp_ratio, a destination range that does
# not fit, source ids past the layout) is isolated at once and fails the request.
EFFECT_ACCEPT: Final = "accept"  # the readiness is read for this request (progress)
# Readiness for a request that stopped waiting leaves it out of the read and reports it
# alone, with why (one effect per state it stopped in).
EFFECT_ISOLATE_DONE: Final = "isolate_done"  # UNKNOWN_REQUEST: it completed already
EFFECT_ISOLATE_FAILED: Final = "isolate_failed"  # its own failure, again
EFFECT_ISOLATE_ABORTED: Final = "isolate_aborted"  # ABORTED
EFFECT_ISOLATE_RELEASED: Final = "isolate_released"  # ABORTED: released while a read ran
EFFECT_COUNT_DONE: Final = "count_done"  # count a contributor's final-layer done signal
EFFECT_READ_AGAIN: Final = "read_again"  # a retried read still writes its blocks
EFFECT_LEAVE_READ: Final = "leave_read"  # it stopped waiting: out of the retried read
EFFECT_PROGRESS: Final = "progress"  # a read for it succeeded: restart its load timer
EFFECT_REPORT_DONE: Final = "report_done"  # RequestDone
EFFECT_FAIL: Final = "fail"  # RequestFailed (load errors) + ABORT to its v2 peers
EFFECT_FAIL_RELEASE: Final = "fail_release"  # fail, then Releasable at once
EFFECT_FAIL_HOLD: Final = "fail_hold"  # fail; Releasable when the last read ends
EFFECT_RELEASE: Final = "release"  # Releasable: the blocks may be reused now

#: States in which the request still waits for KV (its load timer runs).
REQ_ACTIVE: Final = (REQ_ALLOCATED, REQ_ADVERTISED, REQ_RECEIVING)
#: Terminal on this rank but not yet released by vLLM.
REQ_ENDED: Final = (REQ_DONE, REQ_FAILED, REQ_ABORTED)
_GIVEN_UP: Final = (REQ_FAILED, REQ_ABORTED, REQ_RELEASE_PENDING)
_NOT_WAITING: Final = (*REQ_ENDED, REQ_RELEASE_PENDING)

DECODE_REQUEST: Final = MachineSpec(
    name="Decode request",
    doc="""
    One request this Decode rank receives KV for. It is done on this rank when every
    contributor reported its final layer after successful reads and no read for it is in
    flight; it fails on a failed or refused read, an isolated readiness, an ABORT from
    Prefill or a load timeout; it is released (its blocks handed back) only when no read
    can still write them.
    """,
    states=(
        REQ_ALLOCATED,
        REQ_ADVERTISED,
        REQ_RECEIVING,
        REQ_DONE,
        REQ_FAILED,
        REQ_ABORTED,
        REQ_RELEASE_PENDING,
        REQ_RELEASED,
    ),
    initial=REQ_ALLOCATED,
    guards=GUARDS,
    # A failed request's ABORT to its v2 peers goes out once per input (SendAbort, emitted
    # by the endpoint after the handlers ran).
    outputs={
        NO_EFFECT: (),
        EFFECT_ACCEPT: (),
        EFFECT_ISOLATE_DONE: (),
        EFFECT_ISOLATE_FAILED: (),
        EFFECT_ISOLATE_ABORTED: (),
        EFFECT_ISOLATE_RELEASED: (),
        EFFECT_PROGRESS: (),
        EFFECT_COUNT_DONE: (),
        EFFECT_READ_AGAIN: (),
        EFFECT_LEAVE_READ: (),
        EFFECT_REPORT_DONE: (RequestDone,),
        EFFECT_FAIL: (RequestFailed,),
        EFFECT_FAIL_RELEASE: (RequestFailed, Releasable),
        EFFECT_FAIL_HOLD: (RequestFailed,),
        EFFECT_RELEASE: (Releasable,),
    },
    terminal=frozenset({REQ_RELEASED}),
    # A readiness, and the end of its read, concern every request it names: those inputs
    # are fired for the whole message, one table lookup per run of requests in one state.
    batched=frozenset({R_RECV_READINESS, R_LOCAL_READ_OK, R_LOCAL_READ_RETRY}),
    transitions=(
        {"trigger": R_LOCAL_ADVERTISE, "source": REQ_ALLOCATED, "dest": REQ_ADVERTISED},
        {
            "trigger": R_RECV_READINESS,
            "source": list(REQ_ACTIVE),
            "dest": REQ_RECEIVING,
            "effect": EFFECT_ACCEPT,
        },
        # Never write into the blocks of a request that stopped waiting; tell why.
        *stay(R_RECV_READINESS, [REQ_DONE], EFFECT_ISOLATE_DONE),
        *stay(R_RECV_READINESS, [REQ_FAILED], EFFECT_ISOLATE_FAILED),
        *stay(R_RECV_READINESS, [REQ_ABORTED], EFFECT_ISOLATE_ABORTED),
        *stay(R_RECV_READINESS, [REQ_RELEASE_PENDING], EFFECT_ISOLATE_RELEASED),
        {
            "trigger": R_LOCAL_READ_OK,
            "source": REQ_RECEIVING,
            "dest": REQ_RECEIVING,
            "effect": EFFECT_PROGRESS,
        },
        # A read that was in flight when the request stopped waiting ends.
        *stay(R_LOCAL_READ_OK, _GIVEN_UP),
        # A retried read writes only the blocks of the requests still receiving.
        {
            "trigger": R_LOCAL_READ_RETRY,
            "source": REQ_RECEIVING,
            "dest": REQ_RECEIVING,
            "effect": EFFECT_READ_AGAIN,
        },
        *stay(R_LOCAL_READ_RETRY, _GIVEN_UP, EFFECT_LEAVE_READ),
        # A successful read's done signals count only for the requests still receiving.
        {
            "trigger": R_RECV_DONE_SIGNAL,
            "source": REQ_RECEIVING,
            "dest": REQ_RECEIVING,
            "effect": EFFECT_COUNT_DONE,
        },
        *stay(R_RECV_DONE_SIGNAL, _NOT_WAITING),
        {
            "trigger": R_LOCAL_ALL_DONE,
            "source": REQ_RECEIVING,
            "dest": REQ_DONE,
            "conditions": [
                "all_contributors_reported",
                "no_read_in_flight",
                "no_parked_readiness_names_it",
            ],
            "effect": EFFECT_REPORT_DONE,
        },
        # A request that stopped waiting does not complete (its report was made).
        *stay(
            R_LOCAL_ALL_DONE,
            _NOT_WAITING,
            conditions=[
                "all_contributors_reported",
                "no_read_in_flight",
                "no_parked_readiness_names_it",
            ],
        ),
        {
            "trigger": R_LOCAL_FAIL,
            "source": list(REQ_ACTIVE),
            "dest": REQ_FAILED,
            "effect": EFFECT_FAIL,
        },
        # The first reason to stop is the one reported; a late failure changes nothing.
        *stay(R_LOCAL_FAIL, _NOT_WAITING),
        {
            "trigger": R_RECV_ABORT,
            "source": list(REQ_ACTIVE),
            "dest": REQ_FAILED,
            "effect": EFFECT_FAIL,
        },
        *stay(R_RECV_ABORT, _NOT_WAITING),
        {
            "trigger": R_LOCAL_ABORT,
            "source": list(REQ_ACTIVE),
            "dest": REQ_ABORTED,
            "effect": EFFECT_FAIL,
        },
        *stay(R_LOCAL_ABORT, _NOT_WAITING),
        {
            "trigger": R_TIMER_LOAD_TIMEOUT,
            "source": list(REQ_ACTIVE),
            "dest": REQ_FAILED,
            "effect": EFFECT_FAIL,
        },
        # vLLM finished the request before its KV arrived (client abort): it ends as aborted.
        {
            "trigger": R_LOCAL_RELEASE,
            "source": list(REQ_ACTIVE),
            "dest": REQ_RELEASED,
            "conditions": "no_read_in_flight",
            "effect": EFFECT_FAIL_RELEASE,
        },
        {
            "trigger": R_LOCAL_RELEASE_BUSY,
            "source": REQ_RECEIVING,
            "dest": REQ_RELEASE_PENDING,
            "conditions": "read_in_flight",
            "effect": EFFECT_FAIL_HOLD,
        },
        {
            "trigger": R_LOCAL_RELEASE,
            "source": list(REQ_ENDED),
            "dest": REQ_RELEASED,
            "conditions": "no_read_in_flight",
            "effect": EFFECT_RELEASE,
        },
        # done_on_rank has no read in flight by its own guard. A read may still write the
        # blocks: release_pending is the hold (Releasable on LOCAL_QUIESCENT).
        {
            "trigger": R_LOCAL_RELEASE_BUSY,
            "source": [REQ_FAILED, REQ_ABORTED],
            "dest": REQ_RELEASE_PENDING,
            "conditions": "read_in_flight",
        },
        {
            "trigger": R_LOCAL_QUIESCENT,
            "source": REQ_RELEASE_PENDING,
            "dest": REQ_RELEASED,
            "conditions": "no_read_in_flight",
            "effect": EFFECT_RELEASE,
        },
    ),
)

# -- Decode readiness ----------------------------------------------------------------------

RD_RECEIVED: Final = "received"
RD_PARKED: Final = "parked"
RD_READING: Final = "reading"
RD_REPLIED: Final = "replied"

M_LOCAL_PARK: Final[Input[RdPark]] = Input("LOCAL_PARK")
M_LOCAL_UNPARK: Final[Input[RdAt]] = Input("LOCAL_UNPARK")
M_TIMER_PARK_EXPIRED: Final[Input[RdAt]] = Input("TIMER_PARK_EXPIRED")
M_LOCAL_START_READ: Final[Input[None]] = Input("LOCAL_START_READ")
M_LOCAL_NOTHING_TO_READ: Final[Input[None]] = Input("LOCAL_NOTHING_TO_READ")
M_LOCAL_REFUSE: Final[Input[RdFailure]] = Input("LOCAL_REFUSE")
M_LOCAL_READ_OK: Final[Input[None]] = Input("LOCAL_READ_OK")
M_LOCAL_READ_FAILED: Final[Input[RdFailure]] = Input("LOCAL_READ_FAILED")
M_LOCAL_READ_RETRY: Final[Input[None]] = Input("LOCAL_READ_RETRY")

EFFECT_PARK: Final = "park"
EFFECT_PROCESS: Final = "process"  # serve it now, its still-unknown requests isolated
EFFECT_START_READ: Final = "start_read"
EFFECT_REPLY_DONE: Final = "reply_done"
EFFECT_REPLY_FAILED: Final = "reply_failed"

DECODE_READINESS: Final = MachineSpec(
    name="Decode readiness",
    doc="""
    One READ_READY_BATCH received by this Decode rank. It gets exactly one reply: done
    (with the requests left out, for a v2 peer), or failed (the layer could not be served
    or the batched read failed). A readiness that names requests this rank does not know
    yet waits, bounded in count and time, for them to arrive.
    """,
    states=(RD_RECEIVED, RD_PARKED, RD_READING, RD_REPLIED),
    initial=RD_RECEIVED,
    guards=GUARDS,
    outputs={
        EFFECT_PARK: (),
        EFFECT_PROCESS: (),
        EFFECT_START_READ: (StartRead,),
        EFFECT_REPLY_DONE: (Reply,),
        EFFECT_REPLY_FAILED: (Reply,),
    },
    terminal=frozenset({RD_REPLIED}),
    transitions=(
        {
            "trigger": M_LOCAL_PARK,
            "source": RD_RECEIVED,
            "dest": RD_PARKED,
            "conditions": ["requests_unknown", "park_has_room"],
            "effect": EFFECT_PARK,
        },
        {
            "trigger": M_LOCAL_UNPARK,
            "source": RD_PARKED,
            "dest": RD_RECEIVED,
            "conditions": "requests_known",
            "effect": EFFECT_PROCESS,
        },
        {
            "trigger": M_TIMER_PARK_EXPIRED,
            "source": RD_PARKED,
            "dest": RD_RECEIVED,
            "effect": EFFECT_PROCESS,
        },
        {
            "trigger": M_LOCAL_START_READ,
            "source": RD_RECEIVED,
            "dest": RD_READING,
            "conditions": "lease_leaves_half",
            "effect": EFFECT_START_READ,
        },
        {
            "trigger": M_LOCAL_NOTHING_TO_READ,
            "source": RD_RECEIVED,
            "dest": RD_REPLIED,
            "effect": EFFECT_REPLY_DONE,
        },
        {
            "trigger": M_LOCAL_REFUSE,
            "source": RD_RECEIVED,
            "dest": RD_REPLIED,
            "effect": EFFECT_REPLY_FAILED,
        },
        {
            "trigger": M_LOCAL_READ_OK,
            "source": RD_READING,
            "dest": RD_REPLIED,
            "effect": EFFECT_REPLY_DONE,
        },
        {
            "trigger": M_LOCAL_READ_FAILED,
            "source": RD_READING,
            "dest": RD_REPLIED,
            "effect": EFFECT_REPLY_FAILED,
        },
        {
            "trigger": M_LOCAL_READ_RETRY,
            "source": RD_READING,
            "dest": RD_READING,
            "conditions": [
                "transient_error",
                "error_not_lease_expired",
                "retries_left",
                "lease_leaves_half",
                "a_request_still_receiving",
            ],
            "effect": EFFECT_START_READ,
        },
    ),
)

# -- Decode session ------------------------------------------------------------------------

SESSION_UNBOUND: Final = "unbound"
SESSION_V1: Final = "ready_v1"
SESSION_V2: Final = "ready_v2"
SESSION_REFUSED: Final = "refused"

S_RECV_MF_META_V1: Final[Input[SessHandshake]] = Input("RECV_MF_META_V1")
S_RECV_MF_META_V2: Final[Input[SessHandshake]] = Input("RECV_MF_META_V2")
S_RECV_MF_META_BAD_V1: Final[Input[SessHandshake]] = Input("RECV_MF_META_BAD_V1")
S_RECV_MF_META_BAD_V2: Final[Input[SessHandshake]] = Input("RECV_MF_META_BAD_V2")
S_RECV_READINESS: Final[Input[SessReadiness]] = Input("RECV_READINESS")
# A parked readiness is served, out of the park, only while its session is still ready.
S_LOCAL_UNPARKED: Final[Input[SessReadiness]] = Input("LOCAL_UNPARKED")
S_RECV_ABORT: Final[Input[SessAbort]] = Input("RECV_ABORT")

EFFECT_ACK_V1: Final = "ack_v1"
EFFECT_ACK_V2: Final = "ack_v2"
EFFECT_REFUSE_V1: Final = "refuse_v1"  # nothing can be said to a v1 peer: count it, no reply
EFFECT_REFUSE_V2: Final = "refuse_v2"  # Ack carrying error_code and error
EFFECT_SERVE: Final = "serve"  # serve the readiness (seq checks, then the layer)
EFFECT_SERVE_UNPARKED: Final = "serve_unparked"  # serve it, its unknown requests isolated
EFFECT_APPLY_ABORT: Final = "apply_abort"  # fail the named requests (park the unknown)
EFFECT_DROP: Final = "drop"  # an ABORT from a peer with no usable session: count it
EFFECT_REPLY_REFUSED: Final = "reply_refused"
EFFECT_REPLY_UNKNOWN_SESSION: Final = "reply_unknown_session"
EFFECT_REPLY_SESSION_GONE: Final = "reply_session_gone"  # forgotten while it was parked

_ALL_SESSION_STATES: Final = [SESSION_UNBOUND, SESSION_V1, SESSION_V2, SESSION_REFUSED]
SESSION_READY: Final = frozenset({SESSION_V1, SESSION_V2})

DECODE_SESSION: Final = MachineSpec(
    name="Decode session",
    doc="""
    One per Prefill session (MF_META's ``p_session``, one per Prefill rank process). The
    MF_META shape picks the version: no ``protocol_version`` is v1 (reply the raw
    ``b"ACK"``, use v1 reply shapes only), 2 is v2. A new MF_META (reconnect, new peer
    identity) replaces the previous handshake. Readiness from a peer identity bound to no
    session is answered ``UNKNOWN_SESSION``.
    """,
    states=tuple(_ALL_SESSION_STATES),
    initial=SESSION_UNBOUND,
    guards=GUARDS,
    outputs={
        EFFECT_ACK_V1: (Reply,),
        EFFECT_ACK_V2: (Reply,),
        EFFECT_REFUSE_V1: (),
        EFFECT_REFUSE_V2: (Reply,),
        EFFECT_SERVE: (Reply,),  # a repeated seq answered from memory
        EFFECT_SERVE_UNPARKED: (),
        EFFECT_REPLY_SESSION_GONE: (),
        EFFECT_APPLY_ABORT: (),
        EFFECT_DROP: (),
        EFFECT_REPLY_REFUSED: (),
        EFFECT_REPLY_UNKNOWN_SESSION: (),
    },
    transitions=(
        {
            "trigger": S_RECV_MF_META_V1,
            "source": _ALL_SESSION_STATES,
            "dest": SESSION_V1,
            "effect": EFFECT_ACK_V1,
        },
        {
            "trigger": S_RECV_MF_META_V2,
            "source": _ALL_SESSION_STATES,
            "dest": SESSION_V2,
            "effect": EFFECT_ACK_V2,
        },
        {
            "trigger": S_RECV_MF_META_BAD_V1,
            "source": _ALL_SESSION_STATES,
            "dest": SESSION_REFUSED,
            "effect": EFFECT_REFUSE_V1,
        },
        {
            "trigger": S_RECV_MF_META_BAD_V2,
            "source": _ALL_SESSION_STATES,
            "dest": SESSION_REFUSED,
            "effect": EFFECT_REFUSE_V2,
        },
        *stay(S_RECV_READINESS, [SESSION_V1, SESSION_V2], EFFECT_SERVE),
        *stay(S_RECV_READINESS, [SESSION_REFUSED], EFFECT_REPLY_REFUSED),
        *stay(S_RECV_READINESS, [SESSION_UNBOUND], EFFECT_REPLY_UNKNOWN_SESSION),
        # Out of the park: a new handshake may have been refused, or the session forgotten
        # (no record: unbound), while the readiness waited.
        *stay(S_LOCAL_UNPARKED, [SESSION_V1, SESSION_V2], EFFECT_SERVE_UNPARKED),
        *stay(S_LOCAL_UNPARKED, [SESSION_REFUSED], EFFECT_REPLY_REFUSED),
        *stay(S_LOCAL_UNPARKED, [SESSION_UNBOUND], EFFECT_REPLY_SESSION_GONE),
        *stay(S_RECV_ABORT, [SESSION_V1, SESSION_V2], EFFECT_APPLY_ABORT),
        *stay(S_RECV_ABORT, [SESSION_UNBOUND, SESSION_REFUSED], EFFECT_DROP),
    ),
)

#: Every machine of the Decode side, for the docs generator and the table tests.
CONSUMER_MACHINES: Final[tuple[MachineSpec, ...]] = (
    DECODE_REQUEST,
    DECODE_READINESS,
    DECODE_SESSION,
    CONTRIBUTOR_COMPLETION,
    CROSS_RANK_COMPLETION,
)
check_guards(CONSUMER_MACHINES, GUARDS)
