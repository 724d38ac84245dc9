"""The Prefill side's state machines, declared once as data.

Theory of operation
-------------------
A Prefill TP rank exposes its KV cache and tells each Decode endpoint, layer by layer,
which blocks are ready (a *publication*: one READ_READY_BATCH for one layer, one step and
one connection). Four kinds of machine track that, and every rule that changes their
state lives in the tables below; :mod:`rd2h_protocol.producer` only resolves guards
(counts, versions) and performs the named effects.

* **storage-slot gate** (one per physical storage, main and indexer apart): it closes
  when a layer that lives in the storage is published and opens again only when every
  publication against it has ended: a terminal reply (done, failed, or done with isolated
  request failures), a local release (the readiness never left: handshake timeout or
  refusal), or a lease that ran out AND whose abort was sent. ``expired`` is the state
  between "a lease ran out, its ABORT is queued" and "reopened", so the order abort ->
  reopen is part of the declaration. Nothing may be published into a slot that is not
  open: the runtime waits on :meth:`ProducerEndpoint.can_overwrite` before it writes.
* **layer publication**: queued (waiting for the connection's handshake) -> published ->
  replied | failed | expired. A reply counts once: replies correlate by ``seq`` (v2) or by
  layer (v1: the oldest publication of that layer on that connection). A reply that
  finds a publication already terminal changes nothing and is counted as duplicate (it
  had its reply) or stale (it ended without one); the table says which. UNKNOWN_SESSION
  (the Decode lost our handshake) re-queues the publication for ONE replay after a new
  handshake; a second one fails it.
* **Prefill request**: registered -> sending (chunks) -> final_scheduled -> final_sent
  (its done id went out with the last cache-bearing layer) -> complete once every
  publication that named it has ended well. A failure (a failed read, an isolated failure,
  an expired lease, a failed handshake) or an abort (ours or the Decode's) stops its
  publishing at once; it then drains (waits for the publications already out) and ends
  failed or aborted. A request is finished (``RequestFinished``) only when drained, so the
  runtime never frees source blocks a Decode read may still touch.
* **connection handshake**: idle -> handshaking (MF_META sent; readiness queued for this
  connection only) -> ready_v1 | ready_v2 | refused. A handshake that times out fails the
  queued readiness locally and returns to idle, so its gates reopen. UNKNOWN_SESSION on a
  v2 connection sends MF_META again.

Inputs follow the naming of :mod:`rd2h_protocol._machine`: ``LOCAL_*`` from our caller,
``RECV_*`` from the peer, ``SEND_*`` when we put something on the wire, ``TIMER_*`` when a
deadline passed. Guards are resolved by the endpoint before the lookup; the
``conditions`` name them for the diagrams.
"""

from __future__ import annotations

from typing import Final

from rd2h_protocol._machine import MachineSpec, TransitionDecl


def _stay(
    trigger: str,
    sources: list[str],
    *,
    effect: str | None = None,
    conditions: str | None = None,
) -> tuple[TransitionDecl, ...]:
    """Self-transitions: ``trigger`` keeps each of ``sources`` in its state."""
    out: list[TransitionDecl] = []
    for source in sources:
        decl: TransitionDecl = {"trigger": trigger, "source": source, "dest": source}
        if effect is not None:
            decl["effect"] = effect
        if conditions is not None:
            decl["conditions"] = conditions
        out.append(decl)
    return tuple(out)


# -- storage-slot gate ---------------------------------------------------------------------

GATE_OPEN: Final = "open"
GATE_CLOSED: Final = "closed"
GATE_EXPIRED: Final = "expired"

G_LOCAL_PUBLISH: Final = "LOCAL_PUBLISH"
G_RECV_REPLY: Final = "RECV_REPLY"
G_RECV_LAST_REPLY: Final = "RECV_LAST_REPLY"
G_LOCAL_RELEASE: Final = "LOCAL_RELEASE"
G_LOCAL_LAST_RELEASE: Final = "LOCAL_LAST_RELEASE"
G_TIMER_LEASE_EXPIRED: Final = "TIMER_LEASE_EXPIRED"
G_LOCAL_ABORT_SENT: Final = "LOCAL_ABORT_SENT"

# Effects the endpoint performs (besides the state change itself).
EFFECT_CLOSE: Final = "close"
EFFECT_REOPEN: Final = "reopen"

STORAGE_GATE: Final = MachineSpec(
    name="storage-slot gate",
    doc="""
    One per physical Prefill storage (a distinct tuple of main, or of indexer+scale, base
    addresses). Closed while any publication against the storage may still be read;
    the compute path may overwrite the storage only while the gate is open.
    """,
    states=(GATE_OPEN, GATE_CLOSED, GATE_EXPIRED),
    initial=GATE_OPEN,
    transitions=(
        {
            "trigger": G_LOCAL_PUBLISH,
            "source": GATE_OPEN,
            "dest": GATE_CLOSED,
            "effect": EFFECT_CLOSE,
        },
        # Several Decode endpoints are told about the same layer: one publication each.
        {"trigger": G_LOCAL_PUBLISH, "source": GATE_CLOSED, "dest": GATE_CLOSED},
        *_stay(G_RECV_REPLY, [GATE_CLOSED, GATE_EXPIRED], conditions="others_outstanding"),
        {
            "trigger": G_RECV_LAST_REPLY,
            "source": [GATE_CLOSED, GATE_EXPIRED],
            "dest": GATE_OPEN,
            "conditions": "last_outstanding",
            "effect": EFFECT_REOPEN,
        },
        *_stay(G_LOCAL_RELEASE, [GATE_CLOSED, GATE_EXPIRED], conditions="others_outstanding"),
        {
            "trigger": G_LOCAL_LAST_RELEASE,
            "source": [GATE_CLOSED, GATE_EXPIRED],
            "dest": GATE_OPEN,
            "conditions": "last_outstanding",
            "effect": EFFECT_REOPEN,
        },
        # The publication's ABORT is queued before this input: the gate only counts it.
        {
            "trigger": G_TIMER_LEASE_EXPIRED,
            "source": [GATE_CLOSED, GATE_EXPIRED],
            "dest": GATE_EXPIRED,
        },
        {
            "trigger": G_LOCAL_ABORT_SENT,
            "source": GATE_EXPIRED,
            "dest": GATE_OPEN,
            "conditions": "none_outstanding",
            "effect": EFFECT_REOPEN,
        },
    ),
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

P_SEND_READINESS: Final = "SEND_READINESS"
P_RECV_DONE: Final = "RECV_DONE"
P_RECV_FAILED: Final = "RECV_FAILED"
P_RECV_UNKNOWN_SESSION: Final = "RECV_UNKNOWN_SESSION"
P_LOCAL_RELEASE: Final = "LOCAL_RELEASE"
P_TIMER_LEASE_EXPIRED: Final = "TIMER_LEASE_EXPIRED"

EFFECT_SEND: Final = "send"
EFFECT_DONE: Final = "done"
EFFECT_FAIL: Final = "fail"
EFFECT_REQUEUE: Final = "requeue"
EFFECT_RELEASE: Final = "release"
EFFECT_EXPIRE_ABORT: Final = "expire_abort"
EFFECT_EXPIRE_UNSENT: Final = "expire_unsent"
EFFECT_COUNT_DUPLICATE: Final = "count_duplicate"
EFFECT_COUNT_STALE: Final = "count_stale"

_PUB_SENT: Final = [PUB_PUBLISHED, PUB_REPLAYED]
_PUB_WAITING: Final = [PUB_QUEUED, PUB_REQUEUED]
_PUB_REPLIES: Final = (P_RECV_DONE, P_RECV_FAILED, P_RECV_UNKNOWN_SESSION)

LAYER_PUBLICATION: Final = MachineSpec(
    name="layer publication",
    doc="""
    One READ_READY_BATCH for one (layer, step, Decode endpoint). Ends exactly once:
    replied, failed, expired (lease ran out; ABORT sent to a v2 peer) or released (never
    left because the handshake failed). Late replies are counted, never applied twice.
    """,
    states=(
        PUB_QUEUED,
        PUB_PUBLISHED,
        PUB_REQUEUED,
        PUB_REPLAYED,
        PUB_REPLIED,
        PUB_FAILED,
        PUB_EXPIRED,
        PUB_RELEASED,
    ),
    initial=PUB_QUEUED,
    terminal=frozenset({PUB_REPLIED, PUB_FAILED, PUB_EXPIRED, PUB_RELEASED}),
    transitions=(
        {
            "trigger": P_SEND_READINESS,
            "source": PUB_QUEUED,
            "dest": PUB_PUBLISHED,
            "conditions": "connection_ready",
            "effect": EFFECT_SEND,
        },
        {
            "trigger": P_SEND_READINESS,
            "source": PUB_REQUEUED,
            "dest": PUB_REPLAYED,
            "conditions": "connection_ready",
            "effect": EFFECT_SEND,
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
            "effect": EFFECT_EXPIRE_ABORT,
        },
        # Never sent (or refused unread): nothing can be reading it, no ABORT needed.
        {
            "trigger": P_TIMER_LEASE_EXPIRED,
            "source": _PUB_WAITING,
            "dest": PUB_EXPIRED,
            "effect": EFFECT_EXPIRE_UNSENT,
        },
        # A reply for a seq superseded by a replay: the Decode answered it already.
        *(
            decl
            for trigger in _PUB_REPLIES
            for decl in _stay(
                trigger, [PUB_REQUEUED, PUB_REPLIED, PUB_FAILED], effect=EFFECT_COUNT_DUPLICATE
            )
        ),
        *(
            decl
            for trigger in _PUB_REPLIES
            for decl in _stay(trigger, [PUB_EXPIRED, PUB_RELEASED], effect=EFFECT_COUNT_STALE)
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

R_LOCAL_CHUNK: Final = "LOCAL_CHUNK"
R_LOCAL_FINAL_CHUNK: Final = "LOCAL_FINAL_CHUNK"
R_SEND_DONE: Final = "SEND_DONE"
R_RECV_FAILURE: Final = "RECV_FAILURE"
R_LOCAL_FAILURE: Final = "LOCAL_FAILURE"
R_LOCAL_ABORT: Final = "LOCAL_ABORT"
R_RECV_ABORT: Final = "RECV_ABORT"
R_LOCAL_DRAINED: Final = "LOCAL_DRAINED"

EFFECT_SCHEDULE: Final = "schedule"
EFFECT_IGNORE: Final = "ignore"
EFFECT_RECORD_FAILURE: Final = "record_failure"
EFFECT_SEND_ABORT: Final = "send_abort"
EFFECT_STOP: Final = "stop"
EFFECT_FINISH: Final = "finish"

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
        # The scheduler does not know we stopped; its chunks for an ending request are moot.
        *_stay(R_LOCAL_CHUNK, _REQ_ENDING, effect=EFFECT_IGNORE),
        *_stay(R_LOCAL_FINAL_CHUNK, _REQ_ENDING, effect=EFFECT_IGNORE),
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
        *_stay(R_RECV_FAILURE, _REQ_ENDING),
        *_stay(R_LOCAL_FAILURE, _REQ_ENDING),
        {
            "trigger": R_LOCAL_ABORT,
            "source": _REQ_LIVE,
            "dest": REQ_ABORTING,
            "effect": EFFECT_SEND_ABORT,
        },
        *_stay(R_LOCAL_ABORT, _REQ_ENDING),
        {
            "trigger": R_RECV_ABORT,
            "source": _REQ_LIVE,
            "dest": REQ_ABORTING,
            "effect": EFFECT_STOP,
        },
        *_stay(R_RECV_ABORT, _REQ_ENDING),
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

# -- connection handshake ------------------------------------------------------------------

CONN_IDLE: Final = "idle"
CONN_HANDSHAKING: Final = "handshaking"
CONN_READY_V1: Final = "ready_v1"
CONN_READY_V2: Final = "ready_v2"
CONN_REFUSED: Final = "refused"

C_LOCAL_PUBLISH: Final = "LOCAL_PUBLISH"
C_RECV_ACK_V1: Final = "RECV_ACK_V1"
C_RECV_ACK_V2: Final = "RECV_ACK_V2"
C_RECV_ACK_REFUSED: Final = "RECV_ACK_REFUSED"
C_TIMER_HANDSHAKE_EXPIRED: Final = "TIMER_HANDSHAKE_EXPIRED"
C_RECV_UNKNOWN_SESSION: Final = "RECV_UNKNOWN_SESSION"

EFFECT_SEND_META: Final = "send_meta"
EFFECT_QUEUE: Final = "queue"
EFFECT_FLUSH: Final = "flush"
EFFECT_FAIL_QUEUED: Final = "fail_queued"

#: Connection states in which readiness goes out at once.
CONN_READY: Final = frozenset({CONN_READY_V1, CONN_READY_V2})

CONNECTION_HANDSHAKE: Final = MachineSpec(
    name="connection handshake",
    doc="""
    One per Decode rank endpoint ("host:port"). MF_META goes out before the first
    readiness; readiness published meanwhile waits in this connection's queue only, so a
    slow or dead endpoint never stalls the others. A handshake that times out releases
    its queue (the gates reopen) and the next publication starts a new one.
    """,
    states=(CONN_IDLE, CONN_HANDSHAKING, CONN_READY_V1, CONN_READY_V2, CONN_REFUSED),
    initial=CONN_IDLE,
    transitions=(
        {
            "trigger": C_LOCAL_PUBLISH,
            "source": CONN_IDLE,
            "dest": CONN_HANDSHAKING,
            "effect": EFFECT_SEND_META,
        },
        {
            "trigger": C_LOCAL_PUBLISH,
            "source": CONN_HANDSHAKING,
            "dest": CONN_HANDSHAKING,
            "effect": EFFECT_QUEUE,
        },
        *_stay(C_LOCAL_PUBLISH, [CONN_READY_V1, CONN_READY_V2], effect=EFFECT_SEND),
        # The peer refused our layout or version: nothing will be read, fail at once.
        {
            "trigger": C_LOCAL_PUBLISH,
            "source": CONN_REFUSED,
            "dest": CONN_REFUSED,
            "effect": EFFECT_RELEASE,
        },
        {
            "trigger": C_RECV_ACK_V1,
            "source": CONN_HANDSHAKING,
            "dest": CONN_READY_V1,
            "effect": EFFECT_FLUSH,
        },
        {
            "trigger": C_RECV_ACK_V2,
            "source": CONN_HANDSHAKING,
            "dest": CONN_READY_V2,
            "effect": EFFECT_FLUSH,
        },
        {
            "trigger": C_RECV_ACK_REFUSED,
            "source": CONN_HANDSHAKING,
            "dest": CONN_REFUSED,
            "effect": EFFECT_FAIL_QUEUED,
        },
        {
            "trigger": C_TIMER_HANDSHAKE_EXPIRED,
            "source": CONN_HANDSHAKING,
            "dest": CONN_IDLE,
            "effect": EFFECT_FAIL_QUEUED,
        },
        {
            "trigger": C_RECV_UNKNOWN_SESSION,
            "source": CONN_READY_V2,
            "dest": CONN_HANDSHAKING,
            "conditions": "peer_reconnects",
            "effect": EFFECT_SEND_META,
        },
        # Further UNKNOWN_SESSION replies while the new handshake runs join its queue.
        {
            "trigger": C_RECV_UNKNOWN_SESSION,
            "source": CONN_HANDSHAKING,
            "dest": CONN_HANDSHAKING,
            "effect": EFFECT_QUEUE,
        },
    ),
)

#: Every Prefill-side machine, for the docs generator and the table/Machine agreement test.
PRODUCER_MACHINES: Final[tuple[MachineSpec, ...]] = (
    STORAGE_GATE,
    LAYER_PUBLICATION,
    PREFILL_REQUEST,
    CONNECTION_HANDSHAKE,
)
