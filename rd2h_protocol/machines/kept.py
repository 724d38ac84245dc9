"""The kept request (Prefill-first) machine of the Prefill side, declared once as data.

See :mod:`rd2h_protocol.machines.producer` for the theory of operation; the names are
exported from there too.
"""

from __future__ import annotations

from typing import Final

from rd2h_protocol.events import ClaimAnswered, RequestFinished
from rd2h_protocol.machines.declare import NO_EFFECT, Input, MachineSpec, stay
from rd2h_protocol.machines.producer_guards import GUARDS
from rd2h_protocol.machines.producer_inputs import ClaimAt

__all__ = [
    "EFFECT_PUBLISH_KEPT",
    "EFFECT_REFUSE_CLAIM",
    "EFFECT_RELEASE_UNCLAIMED",
    "KEPT_CLAIMED",
    "KEPT_DELIVERED",
    "KEPT_REQUEST",
    "KEPT_UNCLAIMED",
    "KEPT_WAITING",
    "K_LOCAL_FINISHED",
    "K_RECV_CLAIM",
    "K_RECV_CLAIM_UNUSABLE",
    "K_TIMER_CLAIM_EXPIRED",
]

# -- kept request (Prefill-first) -----------------------------------------------------------

KEPT_WAITING: Final = "waiting"
KEPT_CLAIMED: Final = "claimed"
KEPT_DELIVERED: Final = "delivered"
KEPT_UNCLAIMED: Final = "unclaimed"

K_RECV_CLAIM: Final[Input[ClaimAt]] = Input("RECV_CLAIM")
K_RECV_CLAIM_UNUSABLE: Final[Input[ClaimAt]] = Input("RECV_CLAIM_UNUSABLE")
K_LOCAL_FINISHED: Final[Input[None]] = Input("LOCAL_FINISHED")
K_TIMER_CLAIM_EXPIRED: Final[Input[None]] = Input("TIMER_CLAIM_EXPIRED")

EFFECT_PUBLISH_KEPT: Final = "publish_kept"
EFFECT_REFUSE_CLAIM: Final = "refuse_claim"
EFFECT_RELEASE_UNCLAIMED: Final = "release_unclaimed"

KEPT_REQUEST: Final = MachineSpec(
    name="kept request",
    doc="""
    Prefill-first flow (a standard router sends Prefill the prompt before Decode
    exists for it): a request whose prompt Prefill computed with no Decode named. Its
    whole KV stays in its own blocks (a Prefill that reuses shared layer buffers refuses
    to keep one) until ONE Decode claims it, or until the claim window runs out and
    its blocks are freed unread. The claim registers a Prefill request toward that
    Decode and publishes its layers (those a step under way has not written yet at
    that step's end); a second claim is refused.
    """,
    states=(KEPT_WAITING, KEPT_CLAIMED, KEPT_DELIVERED, KEPT_UNCLAIMED),
    initial=KEPT_WAITING,
    guards=GUARDS,
    outputs={
        NO_EFFECT: (),
        EFFECT_PUBLISH_KEPT: (ClaimAnswered,),
        EFFECT_REFUSE_CLAIM: (ClaimAnswered,),
        EFFECT_RELEASE_UNCLAIMED: (RequestFinished,),
    },
    terminal=frozenset({KEPT_DELIVERED, KEPT_UNCLAIMED}),
    transitions=(
        {
            "trigger": K_RECV_CLAIM,
            "source": KEPT_WAITING,
            "dest": KEPT_CLAIMED,
            "conditions": "claim_usable",
            "effect": EFFECT_PUBLISH_KEPT,
        },
        # A Decode this Prefill cannot serve is refused; another may still claim it.
        *stay(
            K_RECV_CLAIM_UNUSABLE,
            [KEPT_WAITING],
            effect=EFFECT_REFUSE_CLAIM,
            conditions="claim_unusable",
        ),
        # Claimed once: a repeat (or a second Decode) is refused, never published twice.
        *stay(K_RECV_CLAIM, [KEPT_CLAIMED], effect=EFFECT_REFUSE_CLAIM),
        *stay(K_RECV_CLAIM_UNUSABLE, [KEPT_CLAIMED], effect=EFFECT_REFUSE_CLAIM),
        {"trigger": K_LOCAL_FINISHED, "source": KEPT_CLAIMED, "dest": KEPT_DELIVERED},
        {
            "trigger": K_TIMER_CLAIM_EXPIRED,
            "source": KEPT_WAITING,
            "dest": KEPT_UNCLAIMED,
            "effect": EFFECT_RELEASE_UNCLAIMED,
        },
    ),
)
