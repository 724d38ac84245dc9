"""The proxy's per-request state machine, declared once as data.

Theory of operation
-------------------
A client request (the *parent*) goes through one **Proxy request** machine:
``waiting`` (some children have not posted their rendezvous yet) -> ``dispatching`` (the
post completing the set started the one Prefill dispatch) -> ``dispatched`` (Prefill
answered success), or ``failed`` (the rendezvous did not arrive in time, or the dispatch
failed). The first failure wins: a later one changes nothing. A post for a failed parent,
or for one whose client exchange is over, is refused (410).
:class:`~rd2h_proxy.registry.Registry` resolves the guards (whether a post completes the
set, whether the client is still there) and binds each named effect to its handler; this
module holds every rule that changes a parent's phase.

Whether the client exchange is still open and whether a dispatch task still runs are not
phases: they decide only when the parent is removed (see the registry).

Inputs follow the naming of :mod:`rd2h_protocol.machines.declare`: ``RECV_*`` from Decode or
Prefill, ``TIMER_*`` when a deadline passed.
"""

from __future__ import annotations

from typing import Final

from rd2h_protocol.machines import MachineSpec, stay

PHASE_WAITING: Final = "waiting"
PHASE_DISPATCHING: Final = "dispatching"
PHASE_DISPATCHED: Final = "dispatched"
PHASE_FAILED: Final = "failed"

P_RECV_POST: Final = "RECV_POST"
P_RECV_LAST_POST: Final = "RECV_LAST_POST"
P_RECV_POST_CLIENT_GONE: Final = "RECV_POST_CLIENT_GONE"
P_TIMER_RENDEZVOUS_EXPIRED: Final = "TIMER_RENDEZVOUS_EXPIRED"
P_RECV_DISPATCH_OK: Final = "RECV_DISPATCH_OK"
P_RECV_DISPATCH_FAILED: Final = "RECV_DISPATCH_FAILED"

EFFECT_RECORD: Final = "record"  # keep the child's rendezvous params
EFFECT_DISPATCH: Final = "dispatch"  # record it and start the one Prefill dispatch
EFFECT_REFUSE: Final = "refuse"  # 410: the parent is over
EFFECT_FAIL: Final = "fail"  # keep the failure, wake the client handler

PROXY_REQUEST: Final = MachineSpec(
    name="Proxy request",
    doc="""
    One client request (parent) of the proxy. It is dispatched to Prefill exactly once,
    by the rendezvous post that completes its set of children; it fails once, on the
    first of a rendezvous timeout or a failed dispatch. Posts for a failed parent, or for
    one whose client has gone, are refused.
    """,
    states=(PHASE_WAITING, PHASE_DISPATCHING, PHASE_DISPATCHED, PHASE_FAILED),
    initial=PHASE_WAITING,
    terminal=frozenset({PHASE_DISPATCHED, PHASE_FAILED}),
    transitions=(
        *stay(P_RECV_POST, [PHASE_WAITING], EFFECT_RECORD, conditions="children_missing"),
        {
            "trigger": P_RECV_LAST_POST,
            "source": PHASE_WAITING,
            "dest": PHASE_DISPATCHING,
            "conditions": "completes_the_set",
            "effect": EFFECT_DISPATCH,
        },
        *stay(P_RECV_POST, [PHASE_FAILED], EFFECT_REFUSE),
        *stay(P_RECV_LAST_POST, [PHASE_FAILED], EFFECT_REFUSE),
        # A parent whose client has gone takes no post (once the dispatch started, every
        # child has posted: a new post there is a bug, not a 410).
        *stay(
            P_RECV_POST_CLIENT_GONE,
            [PHASE_WAITING, PHASE_FAILED],
            EFFECT_REFUSE,
            conditions="client_gone",
        ),
        {
            "trigger": P_TIMER_RENDEZVOUS_EXPIRED,
            "source": PHASE_WAITING,
            "dest": PHASE_FAILED,
            "effect": EFFECT_FAIL,
        },
        # The timer is cancelled when the set completes; one that fires anyway is late.
        *stay(P_TIMER_RENDEZVOUS_EXPIRED, [PHASE_DISPATCHING, PHASE_DISPATCHED, PHASE_FAILED]),
        {"trigger": P_RECV_DISPATCH_OK, "source": PHASE_DISPATCHING, "dest": PHASE_DISPATCHED},
        {
            "trigger": P_RECV_DISPATCH_FAILED,
            "source": PHASE_DISPATCHING,
            "dest": PHASE_FAILED,
            "effect": EFFECT_FAIL,
        },
        # The first failure wins.
        *stay(P_RECV_DISPATCH_OK, [PHASE_FAILED]),
        *stay(P_RECV_DISPATCH_FAILED, [PHASE_FAILED]),
    ),
)

#: Every machine of the proxy, for the docs generator and the table tests.
PROXY_MACHINES: Final[tuple[MachineSpec, ...]] = (PROXY_REQUEST,)

__all__ = [
    "EFFECT_DISPATCH",
    "EFFECT_FAIL",
    "EFFECT_RECORD",
    "EFFECT_REFUSE",
    "PHASE_DISPATCHED",
    "PHASE_DISPATCHING",
    "PHASE_FAILED",
    "PHASE_WAITING",
    "PROXY_MACHINES",
    "PROXY_REQUEST",
    "P_RECV_DISPATCH_FAILED",
    "P_RECV_DISPATCH_OK",
    "P_RECV_LAST_POST",
    "P_RECV_POST",
    "P_RECV_POST_CLIENT_GONE",
    "P_TIMER_RENDEZVOUS_EXPIRED",
]
