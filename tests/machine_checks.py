"""Checks every MachineSpec gets: its table is its transitions.Machine, and it is well formed.

Each test module of machines (the protocol's and the bindings') takes its two table tests
from :func:`table_tests`; :func:`machine_step` / :func:`table_step` answer for one pair;
the bindings check that their code fires the machines with :func:`record`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from transitions.core import MachineError

from rd2h_protocol.errors import LocalProtocolError
from rd2h_protocol.machines import BoundMachine, MachineSpec


def pairs(machines: Sequence[MachineSpec]) -> Any:
    """``pytest.param(spec, state, event)`` for every pair of every machine."""
    return [
        pytest.param(spec, state, event, id=f"{spec.name}:{state}:{event}")
        for spec in machines
        for state, event in itertools.product(spec.states, spec.inputs)
    ]


def machine_step(spec: MachineSpec, state: str, event: str) -> str | None:
    """The ``transitions.Machine``'s answer: the next state, or None when it refuses."""
    machine = spec.build_machine()
    model = machine.models[0]
    machine.set_state(state)
    try:
        model.trigger(event)
    except MachineError:
        return None
    return str(model.state)


def table_step(spec: MachineSpec, state: str, event: str) -> str | None:
    """The table's answer: the next state, or None when it refuses."""
    try:
        return spec.step(state, event)[1]
    except LocalProtocolError:
        return None


def check_pair(spec: MachineSpec, state: str, event: str) -> None:
    """The table and the ``transitions.Machine`` agree on ``(state, event)``; a pair the
    table lacks raises LocalProtocolError naming the machine, state and input."""
    expected = machine_step(spec, state, event)
    if expected is None:
        with pytest.raises(LocalProtocolError, match=f"{spec.name}: input {event} .* {state}"):
            spec.step(state, event)
    else:
        assert spec.step(state, event)[1] == expected


def table_tests(machines: Sequence[MachineSpec]) -> tuple[Callable[..., None], ...]:
    """The two table tests of ``machines``, to bind to ``test_*`` names of a module."""

    @pytest.mark.parametrize(("spec", "state", "event"), pairs(machines))
    def test_table_agrees_with_machine_on_every_pair(
        spec: MachineSpec, state: str, event: str
    ) -> None:
        check_pair(spec, state, event)

    @pytest.mark.parametrize("spec", machines, ids=lambda m: m.name)
    def test_declarations_are_well_formed(spec: MachineSpec) -> None:
        check_well_formed(spec)

    return test_table_agrees_with_machine_on_every_pair, test_declarations_are_well_formed


def check_well_formed(spec: MachineSpec) -> None:
    """Every state is reachable, terminal states are sinks, inputs say their origin."""
    seen = {spec.initial}
    frontier = [spec.initial]
    while frontier:
        state = frontier.pop()
        for (source, _), (_, dest) in spec.table.items():
            if source == state and dest not in seen:
                seen.add(dest)
                frontier.append(dest)
    assert seen == set(spec.states)
    for (source, _), (_, dest) in spec.table.items():
        if source in spec.terminal:
            assert dest == source
    assert all(i.split("_")[0] in {"LOCAL", "RECV", "SEND", "TIMER"} for i in spec.inputs)
    with pytest.raises(LocalProtocolError):
        spec.step(spec.initial, "RECV_UNDECLARED")


class Recording:
    """Stands in for a BoundMachine (monkeypatched where the code under test looks it up)
    and records every (state, input) the code fires it with, before it fires."""

    def __init__(self, bound: BoundMachine) -> None:
        self.bound = bound
        self.steps: list[tuple[str, str]] = []

    def fire(self, owner: Any, rec: Any, event: str, *args: Any, **kwargs: Any) -> Any:
        self.steps.append((rec.state, event))
        return self.bound.fire(owner, rec, event, *args, **kwargs)

    def inputs(self) -> list[str]:
        return [event for _, event in self.steps]


def record(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> Recording:
    """Replace ``module.name`` (a BoundMachine) with a :class:`Recording` of it."""
    rec = Recording(getattr(module, name))
    monkeypatch.setattr(module, name, rec)
    return rec
