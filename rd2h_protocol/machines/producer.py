"""The Prefill side's state machines, declared once as data.

The layer publication and Prefill request tables live here; the storage-slot gate's in
:mod:`~rd2h_protocol.machines.producer_gate`, the kept request's in
:mod:`~rd2h_protocol.machines.kept`, the connection handshake's in
:mod:`~rd2h_protocol.machines.handshake` and the guards in
:mod:`~rd2h_protocol.machines.producer_guards`, every name re-exported from here.

Theory of operation
-------------------
A Prefill TP rank exposes its KV cache and tells each Decode endpoint, layer by layer,
which blocks are ready (a *publication*: one READ_READY_BATCH for one layer, one step and
one connection). Four kinds of machine track that, and every rule that changes their
state lives in the tables below; :mod:`rd2h_protocol.producer` only resolves guards
(counts, versions; :data:`GUARDS` says which method resolves each) and binds each named
effect to the handler that performs it (the table drives the action).

* **storage-slot gate** (one per physical storage, main and indexer apart): it closes
  when a layer that lives in the storage is published and opens again only when every
  publication against it has ended: a terminal reply (done, failed, or done with isolated
  request failures), a local release (the readiness never left: handshake timeout or
  refusal, or its lease ran out before it was sent), or a lease that ran out AND whose
  ABORT went out (or, for a peer that can never be told, whose peer the runtime declared
  dead). ``expired`` is the state between "a lease ran out" and "reopened": every way out
  of it that has no reply names the extra condition it needs, so the order
  abort -> reopen is part of the declaration. Nothing may be published into a slot that
  is not open: the runtime waits on :meth:`ProducerEndpoint.can_overwrite` before it
  writes.
* **layer publication**: queued (waiting for the connection's handshake) -> published ->
  replied | failed | expired. A reply counts once: replies correlate by ``seq`` (v2) or by
  layer (v1: the oldest publication of that layer on that connection). A reply that
  finds a publication already terminal changes nothing and is counted as duplicate (it
  had its reply) or stale (it ended without one); the table says which. UNKNOWN_SESSION
  (the Decode lost our handshake) re-queues the publication for ONE replay after a new
  handshake, and with it every other publication still out under that handshake (their
  own replies may be lost), in the order they went out; a second one fails it. A lease
  that runs out when no ABORT that frees the storage can go out (a v1 peer, one without
  ``abort`` or ``lease``) leaves the publication ``held``: its requests are failed and
  reported, its gates stay closed until a reply or the peer's declared death (its
  silence past ``silent_peer_timeout_s``). A peer declared dead while the lease still runs
  leaves it ``orphaned``: requests failed at once, gates closed until the lease ends.
* **Prefill request**: registered -> sending (chunks) -> final_scheduled -> final_sent
  (its done id went out with the last cache-bearing layer) -> complete once every
  publication that named it has ended well. A failure (a failed read, an isolated failure,
  an expired lease, a failed handshake, a lost connection) or an abort (ours or the
  Decode's) stops its publishing at once; it then drains (waits for the publications
  already out, or until they are held) and ends failed or aborted. A request is finished
  (``RequestFinished``) only when drained; from then on the storage gates alone keep the
  compute path from overwriting what a Decode may still read.
* **connection handshake**: idle -> handshaking (MF_META sent; readiness queued for this
  connection only) -> ready_v1 | ready_v2 | refused. A handshake that times out fails the
  queued readiness locally and returns to idle, so its gates reopen. UNKNOWN_SESSION on a
  v2 connection sends MF_META again. A refused connection is tried again (fresh MF_META)
  by the first publication after a backoff that doubles per refusal. The runtime's
  heartbeat declaring the endpoint dead returns it to idle from any state.

Inputs follow the naming of :mod:`rd2h_protocol.machines.declare`: ``LOCAL_*`` from our caller,
``RECV_*`` from the peer, ``SEND_*`` when we put something on the wire, ``TIMER_*`` when a
deadline passed. Guards are resolved by the endpoint before the lookup; the
``conditions`` name them for the diagrams.
"""

from __future__ import annotations

from typing import Final

from rd2h_protocol.events import Disconnect, LayerReplied, RequestFinished, Send
from rd2h_protocol.machines.declare import NO_EFFECT, Input, MachineSpec, check_guards, stay
from rd2h_protocol.machines.handshake import *  # noqa: F403 (re-exported: one namespace)
from rd2h_protocol.machines.handshake import CONNECTION_HANDSHAKE, EFFECT_RELEASE, EFFECT_SEND
from rd2h_protocol.machines.kept import *  # noqa: F403
from rd2h_protocol.machines.kept import KEPT_REQUEST
from rd2h_protocol.machines.producer_gate import *  # noqa: F403
from rd2h_protocol.machines.producer_gate import STORAGE_GATE
from rd2h_protocol.machines.producer_guards import GUARDS
from rd2h_protocol.machines.producer_inputs import (
    PubAt,
    PubExpiry,
    PubLost,
    PubRelease,
    PubReply,
    ReqAbort,
    ReqChunk,
    ReqFailure,
    ReqPeerAbort,
)

# -- layer publication ---------------------------------------------------------------------

PUB_QUEUED: Final = "queued"
PUB_PUBLISHED: Final = "published"
PUB_REQUEUED: Final = "requeued"
PUB_REPLAYED: Final = "replayed"
PUB_REPLIED: Final = "replied"
PUB_FAILED: Final = "failed"
PUB_EXPIRED: Final = "expired"
PUB_RELEASED: Final = "released"
PUB_HELD: Final = "held"
PUB_ORPHANED: Final = "orphaned"

# Each input says the context its firing carries (BoundMachine.apply checks it).
P_SEND_READINESS: Final[Input[PubAt]] = Input("SEND_READINESS")
P_RECV_DONE: Final[Input[PubReply]] = Input("RECV_DONE")
P_RECV_FAILED: Final[Input[PubReply]] = Input("RECV_FAILED")
P_RECV_UNKNOWN_SESSION: Final[Input[PubReply]] = Input("RECV_UNKNOWN_SESSION")
P_LOCAL_RELEASE: Final[Input[PubRelease]] = Input("LOCAL_RELEASE")
P_TIMER_LEASE_EXPIRED: Final[Input[PubExpiry]] = Input("TIMER_LEASE_EXPIRED")
P_TIMER_LEASE_EXPIRED_UNTOLD: Final[Input[PubExpiry]] = Input("TIMER_LEASE_EXPIRED_UNTOLD")
P_TIMER_LEASE_EXPIRED_UNSAFE: Final[Input[PubExpiry]] = Input("TIMER_LEASE_EXPIRED_UNSAFE")
P_LOCAL_CONNECTION_LOST: Final[Input[PubLost]] = Input("LOCAL_CONNECTION_LOST")
P_LOCAL_RESEND: Final[Input[PubAt]] = Input("LOCAL_RESEND")
P_LOCAL_LEASE_LAPSED: Final[Input[PubAt]] = Input("LOCAL_LEASE_LAPSED")
P_TIMER_DUE: Final[Input[PubAt]] = Input("TIMER_DUE")
P_LOCAL_RESEND_LAPSED: Final[Input[PubAt]] = Input("LOCAL_RESEND_LAPSED")

EFFECT_RESEND: Final = "resend"
EFFECT_DONE: Final = "done"
EFFECT_FAIL: Final = "fail"
EFFECT_REQUEUE: Final = "requeue"
EFFECT_EXPIRE_ABORT: Final = "expire_abort"
EFFECT_EXPIRE_UNSENT: Final = "expire_unsent"
EFFECT_EXPIRE_UNTOLD: Final = "expire_untold"
EFFECT_HOLD: Final = "hold"
EFFECT_ORPHAN: Final = "orphan"
EFFECT_RELEASE_HELD: Final = "release_held"
EFFECT_COUNT_DUPLICATE: Final = "count_duplicate"
EFFECT_COUNT_STALE: Final = "count_stale"
EFFECT_REPLAY: Final = "replay"  # send, counted as a replay
EFFECT_LEASE_RAN_OUT: Final = "lease_ran_out"  # resolve the lease guards, fire TIMER_LEASE_*
EFFECT_CHECK_SILENCE: Final = "check_silence"
EFFECT_ORPHAN_LEASE_RAN_OUT: Final = "orphan_lease_ran_out"

_PUB_SENT: Final = [PUB_PUBLISHED, PUB_REPLAYED]
_PUB_WAITING: Final = [PUB_QUEUED, PUB_REQUEUED]
# Ended for its requests, still holding its gates (see the module docstring).
_PUB_HOLDING: Final = [PUB_HELD, PUB_ORPHANED]
_PUB_REPLIES: Final[tuple[str, ...]] = (P_RECV_DONE, P_RECV_FAILED, P_RECV_UNKNOWN_SESSION)

LAYER_PUBLICATION: Final = MachineSpec(
    name="layer publication",
    doc="""
    One READ_READY_BATCH for one (layer, step, Decode endpoint). Ends exactly once:
    replied, failed, expired (lease ran out and its ABORT went out, or its peer was
    declared dead) or released (never left because the handshake failed). Held and
    orphaned publications have failed their requests already but still hold their
    storage. Late replies are counted, never applied twice.
    """,
    states=(
        PUB_QUEUED,
        PUB_PUBLISHED,
        PUB_REQUEUED,
        PUB_REPLAYED,
        PUB_HELD,
        PUB_ORPHANED,
        PUB_REPLIED,
        PUB_FAILED,
        PUB_EXPIRED,
        PUB_RELEASED,
    ),
    initial=PUB_QUEUED,
    guards=GUARDS,
    outputs={
        NO_EFFECT: (),
        EFFECT_SEND: (Send,),
        EFFECT_RESEND: (Send,),
        EFFECT_DONE: (LayerReplied,),
        EFFECT_FAIL: (LayerReplied,),
        EFFECT_REQUEUE: (),
        EFFECT_RELEASE: (),
        EFFECT_EXPIRE_ABORT: (Send,),  # the ABORT
        EFFECT_EXPIRE_UNSENT: (),
        EFFECT_EXPIRE_UNTOLD: (),
        EFFECT_HOLD: (Send,),  # the ABORT, where one can go out
        EFFECT_ORPHAN: (),
        EFFECT_RELEASE_HELD: (),
        EFFECT_COUNT_DUPLICATE: (),
        EFFECT_COUNT_STALE: (),
        EFFECT_REPLAY: (Send,),
        EFFECT_LEASE_RAN_OUT: (),
        # The peer is declared dead: the Disconnect, then the ABORT for its orphans.
        EFFECT_CHECK_SILENCE: (Disconnect, Send),
        EFFECT_ORPHAN_LEASE_RAN_OUT: (),
    },
    terminal=frozenset({PUB_REPLIED, PUB_FAILED, PUB_EXPIRED, PUB_RELEASED}),
    transitions=(
        {
            "trigger": P_SEND_READINESS,
            "source": PUB_QUEUED,
            "dest": PUB_PUBLISHED,
            "conditions": ["connection_ready", "lease_ms_left"],
            "effect": EFFECT_SEND,
        },
        {
            "trigger": P_SEND_READINESS,
            "source": PUB_REQUEUED,
            "dest": PUB_REPLAYED,
            "conditions": ["connection_ready", "lease_ms_left"],
            "effect": EFFECT_REPLAY,
        },
        {"trigger": P_RECV_DONE, "source": _PUB_SENT, "dest": PUB_REPLIED, "effect": EFFECT_DONE},
        {
            "trigger": P_RECV_FAILED,
            "source": _PUB_SENT,
            "dest": PUB_FAILED,
            "effect": EFFECT_FAIL,
        },
        # The Decode lost our handshake: it read nothing. Replay once after a new one.
        {
            "trigger": P_RECV_UNKNOWN_SESSION,
            "source": PUB_PUBLISHED,
            "dest": PUB_REQUEUED,
            "effect": EFFECT_REQUEUE,
        },
        {
            "trigger": P_RECV_UNKNOWN_SESSION,
            "source": PUB_REPLAYED,
            "dest": PUB_FAILED,
            "effect": EFFECT_FAIL,
        },
        {
            "trigger": P_LOCAL_RELEASE,
            "source": _PUB_WAITING,
            "dest": PUB_RELEASED,
            "effect": EFFECT_RELEASE,
        },
        {
            "trigger": P_TIMER_LEASE_EXPIRED,
            "source": _PUB_SENT,
            "dest": PUB_EXPIRED,
            "conditions": ["peer_has_lease", "abort_goes_out_now_or_all_told"],
            "effect": EFFECT_EXPIRE_ABORT,
        },
        # No ABORT can go out now: a peer that cannot be told (v1), or one whose ABORT waits
        # for the handshake that is running. Requests fail now; the gates stay closed.
        {
            "trigger": P_TIMER_LEASE_EXPIRED_UNTOLD,
            "source": _PUB_SENT,
            "dest": PUB_HELD,
            "conditions": ["abort_cannot_go_out_now", "peer_takes_abort_or_v1_hold"],
            "effect": EFFECT_HOLD,
        },
        # UNSAFE (v1_lease_expiry="reopen"): v1's behaviour, reopen without telling the peer.
        {
            "trigger": P_TIMER_LEASE_EXPIRED_UNSAFE,
            "source": _PUB_SENT,
            "dest": PUB_EXPIRED,
            "conditions": ["peer_cannot_be_told", "v1_lease_expiry_reopen"],
            "effect": EFFECT_EXPIRE_UNTOLD,
        },
        # The runtime's heartbeat declared the peer dead. Still within its lease: fail the
        # requests now (ABORT best effort) but hold the gates until the lease ends too.
        {
            "trigger": P_LOCAL_CONNECTION_LOST,
            "source": _PUB_SENT,
            "dest": PUB_ORPHANED,
            "effect": EFFECT_ORPHAN,
        },
        {
            "trigger": P_LOCAL_CONNECTION_LOST,
            "source": PUB_HELD,
            "dest": PUB_EXPIRED,
            "conditions": "lease_expired",
            "effect": EFFECT_RELEASE_HELD,
        },
        *stay(P_LOCAL_CONNECTION_LOST, [PUB_ORPHANED]),
        # Sent again under the same seq, to a peer that answers a repeated seq from memory
        # (and reads only one it never got): every unanswered one when the connection
        # broke and came back before the heartbeat grace ran out (the same peer: ZMQ
        # reconnected), since the readiness or its reply may have gone down with it; and a
        # held one when it is held, to ask for the reply that alone frees its storage
        # (the readiness may have been lost). A live one only while its lease lasts: past
        # it, the lease timer reopens the storage, and the peer could still start the read.
        *stay(P_LOCAL_RESEND, _PUB_SENT, EFFECT_RESEND, conditions=["peer_resend", "lease_left"]),
        *stay(P_LOCAL_RESEND, [PUB_HELD], EFFECT_RESEND, conditions="peer_resend"),
        # ... the same when none of its lease is left (toward a peer the lease bounds): a
        # held one is resent all the same, a live or orphaned one is not.
        *stay(
            P_LOCAL_RESEND_LAPSED,
            [*_PUB_SENT, PUB_ORPHANED],
            conditions=["peer_resend", "no_lease_left"],
        ),
        *stay(P_LOCAL_RESEND_LAPSED, [PUB_HELD], EFFECT_RESEND, conditions="peer_resend"),
        # Its deadline passed. Waiting or sent: its lease ran out, and the effect resolves
        # the lease guards into one of the TIMER_LEASE_EXPIRED inputs. Held: the deadline
        # is its peer's silence bound (silent_peer_timeout_s), the lease ran out already.
        # Orphaned: the lease ran out too, after its peer's death (TIMER_LEASE_EXPIRED, once
        # its gates are told).
        *stay(P_TIMER_DUE, [*_PUB_WAITING, *_PUB_SENT], EFFECT_LEASE_RAN_OUT),
        *stay(P_TIMER_DUE, [PUB_HELD], EFFECT_CHECK_SILENCE, conditions="silence_bound"),
        *stay(P_TIMER_DUE, [PUB_ORPHANED], EFFECT_ORPHAN_LEASE_RAN_OUT),
        {
            "trigger": P_TIMER_LEASE_EXPIRED,
            "source": PUB_ORPHANED,
            "dest": PUB_EXPIRED,
            "conditions": "peer_dead",
            "effect": EFFECT_RELEASE_HELD,
        },
        # A reply ends a held or orphaned publication like any other: Decode is done with it.
        {
            "trigger": P_RECV_DONE,
            "source": _PUB_HOLDING,
            "dest": PUB_REPLIED,
            "effect": EFFECT_RELEASE_HELD,
        },
        {
            "trigger": P_RECV_FAILED,
            "source": _PUB_HOLDING,
            "dest": PUB_FAILED,
            "effect": EFFECT_RELEASE_HELD,
        },
        {
            "trigger": P_RECV_UNKNOWN_SESSION,
            "source": _PUB_HOLDING,
            "dest": PUB_FAILED,
            "effect": EFFECT_RELEASE_HELD,
        },
        # Never sent (or refused unread): nothing can be reading it, no ABORT needed.
        {
            "trigger": P_TIMER_LEASE_EXPIRED,
            "source": _PUB_WAITING,
            "dest": PUB_EXPIRED,
            "effect": EFFECT_EXPIRE_UNSENT,
        },
        # The handshake it waited for ended after its lease (its timer not handled yet): it
        # is expired, not sent, since it would carry lease_ms 0 and the Decode could start
        # reading it while our lease timer, already due, reopens its storage.
        {
            "trigger": P_LOCAL_LEASE_LAPSED,
            "source": _PUB_WAITING,
            "dest": PUB_EXPIRED,
            "conditions": ["connection_ready", "no_lease_ms_left"],
            "effect": EFFECT_EXPIRE_UNSENT,
        },
        # A reply for a seq superseded by a replay: the Decode answered it already.
        *(
            decl
            for trigger in _PUB_REPLIES
            for decl in stay(
                trigger, [PUB_REQUEUED, PUB_REPLIED, PUB_FAILED], effect=EFFECT_COUNT_DUPLICATE
            )
        ),
        *(
            decl
            for trigger in _PUB_REPLIES
            for decl in stay(trigger, [PUB_EXPIRED, PUB_RELEASED], effect=EFFECT_COUNT_STALE)
        ),
    ),
)

# -- Prefill request -----------------------------------------------------------------------

REQ_REGISTERED: Final = "registered"
REQ_SENDING: Final = "sending"
REQ_FINAL_SCHEDULED: Final = "final_scheduled"
REQ_FINAL_SENT: Final = "final_sent"
REQ_FAILING: Final = "failing"
REQ_ABORTING: Final = "aborting"
REQ_COMPLETE: Final = "complete"
REQ_FAILED: Final = "failed"
REQ_ABORTED: Final = "aborted"

R_LOCAL_CHUNK: Final[Input[ReqChunk]] = Input("LOCAL_CHUNK")
R_LOCAL_FINAL_CHUNK: Final[Input[ReqChunk]] = Input("LOCAL_FINAL_CHUNK")
R_SEND_DONE: Final[Input[None]] = Input("SEND_DONE")
R_RECV_FAILURE: Final[Input[ReqFailure]] = Input("RECV_FAILURE")
R_LOCAL_FAILURE: Final[Input[ReqFailure]] = Input("LOCAL_FAILURE")
R_LOCAL_ABORT: Final[Input[ReqAbort]] = Input("LOCAL_ABORT")
R_RECV_ABORT: Final[Input[ReqPeerAbort]] = Input("RECV_ABORT")
R_LOCAL_DRAINED: Final[Input[None]] = Input("LOCAL_DRAINED")
R_LOCAL_CLAIMED: Final[Input[ReqChunk]] = Input("LOCAL_CLAIMED")

EFFECT_SCHEDULE: Final = "schedule"
EFFECT_IGNORE: Final = "ignore"
EFFECT_RECORD_FAILURE: Final = "record_failure"
EFFECT_SEND_ABORT: Final = "send_abort"
EFFECT_STOP: Final = "stop"
EFFECT_FINISH: Final = "finish"
EFFECT_SCHEDULE_CLAIMED: Final = "schedule_claimed"

#: Request states in which its blocks are still published.
REQ_PUBLISHING: Final = frozenset({REQ_SENDING, REQ_FINAL_SCHEDULED})
_REQ_LIVE: Final = [REQ_REGISTERED, REQ_SENDING, REQ_FINAL_SCHEDULED, REQ_FINAL_SENT]
_REQ_ENDING: Final = [REQ_FAILING, REQ_ABORTING]

PREFILL_REQUEST: Final = MachineSpec(
    name="Prefill request",
    doc="""
    One request this Prefill rank publishes to its Decode endpoint. It finishes only
    after every publication that named it has ended, so its source blocks are free to
    reuse the moment RequestFinished is emitted.
    """,
    states=(
        REQ_REGISTERED,
        REQ_SENDING,
        REQ_FINAL_SCHEDULED,
        REQ_FINAL_SENT,
        REQ_FAILING,
        REQ_ABORTING,
        REQ_COMPLETE,
        REQ_FAILED,
        REQ_ABORTED,
    ),
    initial=REQ_REGISTERED,
    guards=GUARDS,
    # Our ABORT goes out once per connection, from the caller (send_abort collects it).
    outputs={
        NO_EFFECT: (),
        EFFECT_SCHEDULE: (),
        EFFECT_SCHEDULE_CLAIMED: (),
        EFFECT_IGNORE: (),
        EFFECT_RECORD_FAILURE: (),
        EFFECT_SEND_ABORT: (),
        EFFECT_STOP: (),
        EFFECT_FINISH: (RequestFinished,),
    },
    terminal=frozenset({REQ_COMPLETE, REQ_FAILED, REQ_ABORTED}),
    transitions=(
        {
            "trigger": R_LOCAL_CHUNK,
            "source": [REQ_REGISTERED, REQ_SENDING],
            "dest": REQ_SENDING,
            "effect": EFFECT_SCHEDULE,
        },
        {
            "trigger": R_LOCAL_FINAL_CHUNK,
            "source": [REQ_REGISTERED, REQ_SENDING],
            "dest": REQ_FINAL_SCHEDULED,
            "effect": EFFECT_SCHEDULE,
        },
        # Prefill-first: a kept request claimed by its Decode is registered and its whole
        # KV scheduled at once, outside any compute step (it was computed already).
        {
            "trigger": R_LOCAL_CLAIMED,
            "source": REQ_REGISTERED,
            "dest": REQ_FINAL_SCHEDULED,
            "effect": EFFECT_SCHEDULE_CLAIMED,
        },
        # The scheduler does not know we stopped; its chunks for an ending request are moot.
        *stay(R_LOCAL_CHUNK, _REQ_ENDING, effect=EFFECT_IGNORE),
        *stay(R_LOCAL_FINAL_CHUNK, _REQ_ENDING, effect=EFFECT_IGNORE),
        {
            "trigger": R_SEND_DONE,
            "source": REQ_FINAL_SCHEDULED,
            "dest": REQ_FINAL_SENT,
            "conditions": "last_layer",
        },
        {
            "trigger": R_RECV_FAILURE,
            "source": _REQ_LIVE,
            "dest": REQ_FAILING,
            "effect": EFFECT_RECORD_FAILURE,
        },
        {
            "trigger": R_LOCAL_FAILURE,
            "source": _REQ_LIVE,
            "dest": REQ_FAILING,
            "effect": EFFECT_RECORD_FAILURE,
        },
        # The first reason to stop is the one reported.
        *stay(R_RECV_FAILURE, _REQ_ENDING),
        *stay(R_LOCAL_FAILURE, _REQ_ENDING),
        {
            "trigger": R_LOCAL_ABORT,
            "source": _REQ_LIVE,
            "dest": REQ_ABORTING,
            "effect": EFFECT_SEND_ABORT,
        },
        *stay(R_LOCAL_ABORT, _REQ_ENDING),
        {
            "trigger": R_RECV_ABORT,
            "source": _REQ_LIVE,
            "dest": REQ_ABORTING,
            "effect": EFFECT_STOP,
        },
        *stay(R_RECV_ABORT, _REQ_ENDING),
        {
            "trigger": R_LOCAL_DRAINED,
            "source": REQ_FINAL_SENT,
            "dest": REQ_COMPLETE,
            "conditions": "none_outstanding",
            "effect": EFFECT_FINISH,
        },
        {
            "trigger": R_LOCAL_DRAINED,
            "source": REQ_FAILING,
            "dest": REQ_FAILED,
            "conditions": "none_outstanding",
            "effect": EFFECT_FINISH,
        },
        {
            "trigger": R_LOCAL_DRAINED,
            "source": REQ_ABORTING,
            "dest": REQ_ABORTED,
            "conditions": "none_outstanding",
            "effect": EFFECT_FINISH,
        },
    ),
)

#: Every Prefill-side machine, for the docs generator and the table/Machine agreement test.
PRODUCER_MACHINES: Final[tuple[MachineSpec, ...]] = (
    STORAGE_GATE,
    LAYER_PUBLICATION,
    PREFILL_REQUEST,
    KEPT_REQUEST,
    CONNECTION_HANDSHAKE,
)
check_guards(PRODUCER_MACHINES, GUARDS)
