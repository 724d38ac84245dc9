"""The Prefill worker's view of one Decode connection's health, declared once as data.

Theory of operation
-------------------
ZMQ reconnects a DEALER by itself, and its socket monitor reports what happens to the
connection (:data:`~rd2h_runtime.control.ConnectionKind`). A
:class:`~rd2h_runtime.prefill.PrefillWorker` turns those reports into one **Decode
connection health** machine per Decode endpoint:

* ``up``: nothing wrong is known (the DEALER may still be connecting);
* ``broken``: the connection broke (``disconnected``, ``handshake_failed``) and has
  ``reconnect_grace_s`` to come back; a ``connected`` within the grace resumes it (the
  endpoint's ``connection_resumed``: what was in flight is sent again);
* ``lost``: the grace ran out, or the DEALER could not even be created
  (``connect_failed``): the endpoint's ``connection_lost`` fails what was out on it and
  the DEALER is replaced; the endpoint's own silent-peer rule (its ``Disconnect``
  output) leads here too. The next DEALER starts over: ``lost`` takes every input ``up``
  does.

A break is acted on only when the connection is *watched*: the worker declares dead
peers (``declare_dead_on_disconnect``) and the endpoint opened that connection. A break
of a connection nobody watches is the explicit ``RECV_BREAK_UNWATCHED`` self-transition:
it is counted and changes nothing. Every monitor event kind has a row in every state, so
no kind can fail requests by falling through a default branch.

The worker resolves the guard (watched or not) and keeps the grace deadline; each named
effect is bound to the worker's handler for it (log lines, metrics, the endpoint calls,
the grace timer), and firing the bound machine runs it. Every rule that changes a
connection's health is in the table below.
"""

from __future__ import annotations

from typing import Final

from rd2h_protocol.machines import MachineSpec, TransitionDecl, stay

HEALTH_UP: Final = "up"
HEALTH_BROKEN: Final = "broken"
HEALTH_LOST: Final = "lost"

H_RECV_CONNECTED: Final = "RECV_CONNECTED"
H_RECV_DISCONNECTED: Final = "RECV_DISCONNECTED"
H_RECV_HANDSHAKE_FAILED: Final = "RECV_HANDSHAKE_FAILED"
H_LOCAL_CONNECT_FAILED: Final = "LOCAL_CONNECT_FAILED"
H_RECV_BREAK_UNWATCHED: Final = "RECV_BREAK_UNWATCHED"
H_TIMER_GRACE_OVER: Final = "TIMER_GRACE_OVER"
H_LOCAL_DECLARED_DEAD: Final = "LOCAL_DECLARED_DEAD"

EFFECT_START_GRACE: Final = "start_grace"  # log, note the deadline, arm the timer
EFFECT_RESUME: Final = "resume"  # count a reconnect, log, endpoint.connection_resumed
EFFECT_LOSE: Final = "lose"  # log, replace the DEALER, endpoint.connection_lost

_NOT_BROKEN: Final = [HEALTH_UP, HEALTH_LOST]
_ALL: Final = [HEALTH_UP, HEALTH_BROKEN, HEALTH_LOST]


def _break(trigger: str) -> tuple[TransitionDecl, ...]:
    """A watched connection broke: the grace starts, from the first break only."""
    first: TransitionDecl = {
        "trigger": trigger,
        "source": _NOT_BROKEN,
        "dest": HEALTH_BROKEN,
        "conditions": "watched",
        "effect": EFFECT_START_GRACE,
    }
    return (first, *stay(trigger, [HEALTH_BROKEN], conditions="watched"))


DECODE_CONNECTION_HEALTH: Final = MachineSpec(
    name="Decode connection health",
    doc="""
    One Decode endpoint's connection as a Prefill worker watches it. A break gets
    ``reconnect_grace_s`` to come back (then what was in flight is sent again); past the
    grace, or when the DEALER cannot be created, the connection is lost: the endpoint
    fails what was out on it and the DEALER is replaced.
    """,
    states=tuple(_ALL),
    initial=HEALTH_UP,
    transitions=(
        {
            "trigger": H_RECV_CONNECTED,
            "source": HEALTH_BROKEN,
            "dest": HEALTH_UP,
            "effect": EFFECT_RESUME,
        },
        # A first connection, or a fresh DEALER after a loss: nothing was in flight.
        {"trigger": H_RECV_CONNECTED, "source": _NOT_BROKEN, "dest": HEALTH_UP},
        *_break(H_RECV_DISCONNECTED),
        *_break(H_RECV_HANDSHAKE_FAILED),
        {
            "trigger": H_LOCAL_CONNECT_FAILED,
            "source": _ALL,
            "dest": HEALTH_LOST,
            "conditions": "watched",
            "effect": EFFECT_LOSE,
        },
        *stay(H_RECV_BREAK_UNWATCHED, _ALL, conditions="unwatched"),
        {
            "trigger": H_TIMER_GRACE_OVER,
            "source": HEALTH_BROKEN,
            "dest": HEALTH_LOST,
            "effect": EFFECT_LOSE,
        },
        *stay(H_TIMER_GRACE_OVER, _NOT_BROKEN),
        # The endpoint declared the peer dead itself; the worker replaced the DEALER.
        {"trigger": H_LOCAL_DECLARED_DEAD, "source": _ALL, "dest": HEALTH_LOST},
    ),
)

#: Every machine of the runtime, for the docs generator and the table tests.
RUNTIME_MACHINES: Final[tuple[MachineSpec, ...]] = (DECODE_CONNECTION_HEALTH,)

__all__ = [
    "DECODE_CONNECTION_HEALTH",
    "EFFECT_LOSE",
    "EFFECT_RESUME",
    "EFFECT_START_GRACE",
    "HEALTH_BROKEN",
    "HEALTH_LOST",
    "HEALTH_UP",
    "H_LOCAL_CONNECT_FAILED",
    "H_LOCAL_DECLARED_DEAD",
    "H_RECV_BREAK_UNWATCHED",
    "H_RECV_CONNECTED",
    "H_RECV_DISCONNECTED",
    "H_RECV_HANDSHAKE_FAILED",
    "H_TIMER_GRACE_OVER",
    "RUNTIME_MACHINES",
]
