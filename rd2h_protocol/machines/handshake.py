"""The connection handshake machine of the Prefill side, declared once as data.

See :mod:`rd2h_protocol.machines.producer` for the theory of operation; the names are
exported from there too (the publication table shares ``EFFECT_SEND`` and ``EFFECT_RELEASE``
with this one).
"""

from __future__ import annotations

from typing import Final

from rd2h_protocol.events import Connect, Send
from rd2h_protocol.machines.declare import NO_EFFECT, Input, MachineSpec, stay
from rd2h_protocol.machines.producer_guards import GUARDS
from rd2h_protocol.machines.producer_inputs import ConnAbort, ConnAck, ConnAt, ConnEnd

__all__ = [
    "CONNECTION_HANDSHAKE",
    "CONN_HANDSHAKING",
    "CONN_IDLE",
    "CONN_READY",
    "CONN_READY_V1",
    "CONN_READY_V2",
    "CONN_REFUSED",
    "C_LOCAL_ABORT",
    "C_LOCAL_ABORT_UNTOLD",
    "C_LOCAL_CONNECTION_LOST",
    "C_LOCAL_PUBLISH",
    "C_LOCAL_PUBLISH_BACKOFF",
    "C_RECV_ACK_REFUSED",
    "C_RECV_ACK_V1",
    "C_RECV_ACK_V2",
    "C_RECV_UNKNOWN_SESSION",
    "C_TIMER_HANDSHAKE_EXPIRED",
    "EFFECT_COUNT_STRAY_ACK",
    "EFFECT_EMIT_ABORT",
    "EFFECT_FAIL_QUEUED",
    "EFFECT_FLUSH",
    "EFFECT_QUEUE",
    "EFFECT_QUEUE_ABORT",
    "EFFECT_REFUSED",
    "EFFECT_RELEASE",
    "EFFECT_RESET",
    "EFFECT_RETRY",
    "EFFECT_SEND",
    "EFFECT_SEND_META",
]

EFFECT_SEND: Final = "send"
EFFECT_RELEASE: Final = "release"

# -- connection handshake ------------------------------------------------------------------

CONN_IDLE: Final = "idle"
CONN_HANDSHAKING: Final = "handshaking"
CONN_READY_V1: Final = "ready_v1"
CONN_READY_V2: Final = "ready_v2"
CONN_REFUSED: Final = "refused"

# Each input says the context its firing carries (BoundMachine.apply checks it).
C_LOCAL_PUBLISH: Final[Input[ConnAt]] = Input("LOCAL_PUBLISH")
C_RECV_ACK_V1: Final[Input[ConnAck]] = Input("RECV_ACK_V1")
C_RECV_ACK_V2: Final[Input[ConnAck]] = Input("RECV_ACK_V2")
C_RECV_ACK_REFUSED: Final[Input[ConnAck]] = Input("RECV_ACK_REFUSED")
C_TIMER_HANDSHAKE_EXPIRED: Final[Input[ConnEnd]] = Input("TIMER_HANDSHAKE_EXPIRED")
C_RECV_UNKNOWN_SESSION: Final[Input[ConnAt]] = Input("RECV_UNKNOWN_SESSION")
C_LOCAL_PUBLISH_BACKOFF: Final[Input[ConnAt]] = Input("LOCAL_PUBLISH_BACKOFF")
C_LOCAL_CONNECTION_LOST: Final[Input[ConnEnd]] = Input("LOCAL_CONNECTION_LOST")
C_LOCAL_ABORT: Final[Input[ConnAbort]] = Input("LOCAL_ABORT")
C_LOCAL_ABORT_UNTOLD: Final[Input[ConnAbort]] = Input("LOCAL_ABORT_UNTOLD")

EFFECT_SEND_META: Final = "send_meta"
EFFECT_QUEUE: Final = "queue"
EFFECT_FLUSH: Final = "flush"
EFFECT_FAIL_QUEUED: Final = "fail_queued"
EFFECT_REFUSED: Final = "refused"  # record the refusal and its backoff, then fail_queued
EFFECT_RESET: Final = "reset"
EFFECT_RETRY: Final = "retry"  # send_meta, counted as a retry
EFFECT_EMIT_ABORT: Final = "emit_abort"
EFFECT_QUEUE_ABORT: Final = "queue_abort"
EFFECT_COUNT_STRAY_ACK: Final = "count_stray_ack"  # an ACK with no handshake waiting for it

#: Connection states in which readiness goes out at once.
CONN_READY: Final = frozenset({CONN_READY_V1, CONN_READY_V2})

CONNECTION_HANDSHAKE: Final = MachineSpec(
    name="connection handshake",
    doc="""
    One per Decode rank endpoint ("host:port"). MF_META goes out before the first
    readiness; readiness published meanwhile waits in this connection's queue only, so a
    slow or dead endpoint never stalls the others. A handshake that times out releases
    its queue (the gates reopen) and the next publication starts a new one. A refusal is
    retried by the first publication after a doubling backoff; until then publications
    fail at once. The runtime declaring the endpoint dead resets it to idle.
    """,
    states=(CONN_IDLE, CONN_HANDSHAKING, CONN_READY_V1, CONN_READY_V2, CONN_REFUSED),
    initial=CONN_IDLE,
    guards=GUARDS,
    # flush, fail_queued and refused end a handshake: the ABORTs held publications waited
    # for go out then (Send).
    outputs={
        NO_EFFECT: (),
        EFFECT_SEND_META: (Connect, Send),
        EFFECT_RETRY: (Connect, Send),
        EFFECT_QUEUE: (),
        EFFECT_SEND: (),
        EFFECT_RELEASE: (),
        EFFECT_FLUSH: (Send,),
        EFFECT_REFUSED: (Send,),
        EFFECT_FAIL_QUEUED: (Send,),
        EFFECT_RESET: (),
        EFFECT_COUNT_STRAY_ACK: (),
        EFFECT_EMIT_ABORT: (Send,),
        EFFECT_QUEUE_ABORT: (),
    },
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
        *stay(C_LOCAL_PUBLISH, [CONN_READY_V1, CONN_READY_V2], effect=EFFECT_SEND),
        # The peer refused our layout or version: nothing will be read, fail at once
        # while its backoff runs (retry_at is in the future only in this state).
        {
            "trigger": C_LOCAL_PUBLISH_BACKOFF,
            "source": CONN_REFUSED,
            "dest": CONN_REFUSED,
            "conditions": "backoff_running",
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
            "effect": EFFECT_REFUSED,
        },
        # An ACK that answers no handshake in progress (a duplicate, or one that came after
        # the handshake timed out) changes nothing: it is counted.
        *(
            decl
            for ack in (C_RECV_ACK_V1, C_RECV_ACK_V2, C_RECV_ACK_REFUSED)
            for decl in stay(
                ack,
                [CONN_IDLE, CONN_READY_V1, CONN_READY_V2, CONN_REFUSED],
                effect=EFFECT_COUNT_STRAY_ACK,
            )
        ),
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
        # The other publications out under the lost handshake take the same reply
        # (PublicationEffects.on_reply): each joins the new handshake's queue.
        {
            "trigger": C_RECV_UNKNOWN_SESSION,
            "source": CONN_HANDSHAKING,
            "dest": CONN_HANDSHAKING,
            "effect": EFFECT_QUEUE,
        },
        # The refusal's backoff has passed: a new publication tries a fresh MF_META.
        {
            "trigger": C_LOCAL_PUBLISH,
            "source": CONN_REFUSED,
            "dest": CONN_HANDSHAKING,
            "conditions": "backoff_elapsed",
            "effect": EFFECT_RETRY,
        },
        # Our ABORT (protocol v2 only): out at once to a ready peer that takes it, queued
        # while a handshake runs (it goes out when the handshake ends, if the peer takes it
        # then), and otherwise nobody can be told.
        *stay(C_LOCAL_ABORT, [CONN_READY_V2], EFFECT_EMIT_ABORT, conditions="peer_takes_abort"),
        *stay(
            C_LOCAL_ABORT, [CONN_IDLE, CONN_READY_V1, CONN_REFUSED], conditions="peer_takes_abort"
        ),
        *stay(
            C_LOCAL_ABORT_UNTOLD,
            [CONN_IDLE, CONN_READY_V1, CONN_READY_V2, CONN_REFUSED],
            conditions="peer_lacks_abort",
        ),
        *stay(C_LOCAL_ABORT, [CONN_HANDSHAKING], EFFECT_QUEUE_ABORT, conditions="v2_endpoint"),
        *stay(
            C_LOCAL_ABORT_UNTOLD, [CONN_HANDSHAKING], EFFECT_QUEUE_ABORT, conditions="v2_endpoint"
        ),
        # The runtime's heartbeat declared the endpoint dead: forget the handshake (the
        # peer that comes back is a new process) and fail what waited for it.
        {
            "trigger": C_LOCAL_CONNECTION_LOST,
            "source": [CONN_IDLE, CONN_HANDSHAKING, CONN_READY_V1, CONN_READY_V2, CONN_REFUSED],
            "dest": CONN_IDLE,
            "effect": EFFECT_RESET,
        },
    ),
)
