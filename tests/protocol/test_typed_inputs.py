"""Typed inputs (issue 25 item 3): a machine whose inputs carry one context value binds
handlers of one shape, ``(endpoint, record, ctx)``, and ``Input(name)`` is the name itself
at run time (the tables' keys stay plain strings)."""

from __future__ import annotations

import inspect

import pytest

from rd2h_protocol.consumer import ConsumerEndpoint
from rd2h_protocol.machines.declare import NO_EFFECT, BoundMachine, Input, no_effect
from rd2h_protocol.machines.producer import P_SEND_READINESS
from rd2h_protocol.producer.handshakes import ConnectionEffects
from rd2h_protocol.producer.kept import KeptEffects
from rd2h_protocol.producer.publications import GateEffects, PublicationEffects
from rd2h_protocol.producer.requests import RequestEffects


def test_input_is_its_name_at_run_time() -> None:
    assert type(P_SEND_READINESS) is str
    assert Input("X") == "X" and type(Input("X")) is str


#: Every endpoint machine: each takes typed inputs.
TYPED: tuple[BoundMachine, ...] = (
    PublicationEffects.TABLE,
    ConnectionEffects.TABLE,
    RequestEffects.TABLE,
    KeptEffects.TABLE,
    GateEffects.TABLE,
    ConsumerEndpoint.REQUEST,
    ConsumerEndpoint.READINESS,
    ConsumerEndpoint.SESSION,
)


@pytest.mark.parametrize("bound", TYPED, ids=lambda b: b.spec.name)
def test_handlers_take_one_context_value(bound: BoundMachine) -> None:
    for effect, handler in bound.handlers.items():
        if effect == NO_EFFECT or handler is no_effect:
            continue
        params = list(inspect.signature(handler).parameters.values())
        assert len(params) == 3, (effect, params)
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params), (effect, params)
