"""The storage-slot gate machine of the Prefill side, declared once as data.

See :mod:`rd2h_protocol.machines.producer` for the theory of operation; the names are
exported from there too.
"""

from __future__ import annotations

from typing import Final

from rd2h_protocol.events import GateOpened
from rd2h_protocol.machines.declare import NO_EFFECT, Input, MachineSpec, stay
from rd2h_protocol.machines.producer_guards import GUARDS

__all__ = [
    "EFFECT_REOPEN",
    "GATE_CLOSED",
    "GATE_EXPIRED",
    "GATE_OPEN",
    "G_LOCAL_ABORT_SENT",
    "G_LOCAL_LAST_ABORT_SENT",
    "G_LOCAL_LAST_PEER_DEAD",
    "G_LOCAL_LAST_RELEASE",
    "G_LOCAL_LAST_REOPEN_UNSAFE",
    "G_LOCAL_PEER_DEAD",
    "G_LOCAL_PUBLISH",
    "G_LOCAL_RELEASE",
    "G_LOCAL_REOPEN_UNSAFE",
    "G_RECV_LAST_REPLY",
    "G_RECV_REPLY",
    "G_TIMER_LEASE_EXPIRED",
    "STORAGE_GATE",
]

# -- storage-slot gate ---------------------------------------------------------------------

GATE_OPEN: Final = "open"
GATE_CLOSED: Final = "closed"
GATE_EXPIRED: Final = "expired"

# Each input carries the slot of the gate (the reopen effect reports it).
G_LOCAL_PUBLISH: Final[Input[int]] = Input("LOCAL_PUBLISH")
G_RECV_REPLY: Final[Input[int]] = Input("RECV_REPLY")
G_RECV_LAST_REPLY: Final[Input[int]] = Input("RECV_LAST_REPLY")
G_LOCAL_RELEASE: Final[Input[int]] = Input("LOCAL_RELEASE")
G_LOCAL_LAST_RELEASE: Final[Input[int]] = Input("LOCAL_LAST_RELEASE")
G_TIMER_LEASE_EXPIRED: Final[Input[int]] = Input("TIMER_LEASE_EXPIRED")
G_LOCAL_ABORT_SENT: Final[Input[int]] = Input("LOCAL_ABORT_SENT")
G_LOCAL_LAST_ABORT_SENT: Final[Input[int]] = Input("LOCAL_LAST_ABORT_SENT")
G_LOCAL_PEER_DEAD: Final[Input[int]] = Input("LOCAL_PEER_DEAD")
G_LOCAL_LAST_PEER_DEAD: Final[Input[int]] = Input("LOCAL_LAST_PEER_DEAD")
G_LOCAL_REOPEN_UNSAFE: Final[Input[int]] = Input("LOCAL_REOPEN_UNSAFE")
G_LOCAL_LAST_REOPEN_UNSAFE: Final[Input[int]] = Input("LOCAL_LAST_REOPEN_UNSAFE")

# Effects the endpoint performs (besides the state change itself). Closing needs none: the
# count of publications against the gate goes up with every publication, closed or not.
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
    guards=GUARDS,
    outputs={NO_EFFECT: (), EFFECT_REOPEN: (GateOpened,)},
    transitions=(
        {
            "trigger": G_LOCAL_PUBLISH,
            "source": GATE_OPEN,
            "dest": GATE_CLOSED,
        },
        # Several Decode endpoints are told about the same layer: one publication each.
        {"trigger": G_LOCAL_PUBLISH, "source": GATE_CLOSED, "dest": GATE_CLOSED},
        *stay(G_RECV_REPLY, [GATE_CLOSED, GATE_EXPIRED], conditions="others_outstanding"),
        {
            "trigger": G_RECV_LAST_REPLY,
            "source": [GATE_CLOSED, GATE_EXPIRED],
            "dest": GATE_OPEN,
            "conditions": "last_outstanding",
            "effect": EFFECT_REOPEN,
        },
        *stay(G_LOCAL_RELEASE, [GATE_CLOSED, GATE_EXPIRED], conditions="others_outstanding"),
        {
            "trigger": G_LOCAL_LAST_RELEASE,
            "source": [GATE_CLOSED, GATE_EXPIRED],
            "dest": GATE_OPEN,
            "conditions": "last_outstanding",
            "effect": EFFECT_REOPEN,
        },
        # A lease ran out: the publication still holds the gate until it ends in one of
        # the ways below (or by a reply). The count does not change here.
        {
            "trigger": G_TIMER_LEASE_EXPIRED,
            "source": [GATE_CLOSED, GATE_EXPIRED],
            "dest": GATE_EXPIRED,
        },
        # ... its ABORT went out (emitted as a Send before this input).
        *stay(G_LOCAL_ABORT_SENT, [GATE_EXPIRED], conditions="others_outstanding"),
        {
            "trigger": G_LOCAL_LAST_ABORT_SENT,
            "source": GATE_EXPIRED,
            "dest": GATE_OPEN,
            "conditions": "last_outstanding",
            "effect": EFFECT_REOPEN,
        },
        # ... its peer can never be told (v1) and the runtime declared it dead: both the
        # lease and the heartbeat have run out (the residual risk is in the endpoint docs).
        *stay(G_LOCAL_PEER_DEAD, [GATE_EXPIRED], conditions="others_outstanding"),
        {
            "trigger": G_LOCAL_LAST_PEER_DEAD,
            "source": GATE_EXPIRED,
            "dest": GATE_OPEN,
            "conditions": "last_outstanding",
            "effect": EFFECT_REOPEN,
        },
        # ... UNSAFE, only with v1_lease_expiry="reopen": nobody told the peer, which may
        # still be reading. Kept for deployments that prefer v1's liveness to safety.
        *stay(
            G_LOCAL_REOPEN_UNSAFE,
            [GATE_EXPIRED],
            conditions=["v1_lease_expiry_reopen", "others_outstanding"],
        ),
        {
            "trigger": G_LOCAL_LAST_REOPEN_UNSAFE,
            "source": GATE_EXPIRED,
            "dest": GATE_OPEN,
            "conditions": ["v1_lease_expiry_reopen", "last_outstanding"],
            "effect": EFFECT_REOPEN,
        },
    ),
)
