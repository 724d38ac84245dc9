"""Each Decode-side MachineSpec table agrees with its transitions.Machine on every pair."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transitions.core import MachineError

from rd2h_protocol.consumer import CONSUMER_MACHINES
from rd2h_protocol.errors import LocalProtocolError, RemoteProtocolError
from rd2h_protocol.machines.declare import MachineSpec

PAIRS = [
    (machine, state, event)
    for machine in CONSUMER_MACHINES
    for state, event in itertools.product(machine.states, machine.inputs)
]


def _machine_step(spec: MachineSpec, state: str, event: str) -> str | None:
    """The state the transitions.Machine reaches, or None when it refuses the trigger."""
    machine = spec.build_machine()
    model = machine.models[0]
    machine.set_state(state)
    try:
        getattr(model, event)()
    except MachineError:
        return None
    return str(model.state)


def _table_step(spec: MachineSpec, state: str, event: str) -> str | None:
    try:
        return spec.step(state, event)[1]
    except LocalProtocolError:
        return None


@pytest.mark.parametrize(
    ("spec", "state", "event"),
    PAIRS,
    ids=[f"{m.name}:{s}:{e}" for m, s, e in PAIRS],
)
def test_table_agrees_with_machine_on_every_pair(spec: MachineSpec, state: str, event: str) -> None:
    assert _table_step(spec, state, event) == _machine_step(spec, state, event)


@given(st.data())
def test_random_walks_agree(data: st.DataObject) -> None:
    spec = data.draw(st.sampled_from(CONSUMER_MACHINES))
    machine = spec.build_machine()
    model = machine.models[0]
    state = spec.initial
    for _ in range(data.draw(st.integers(1, 30))):
        event = data.draw(st.sampled_from(spec.inputs))
        expected = _table_step(spec, state, event)
        if expected is None:
            with pytest.raises(MachineError):
                getattr(model, event)()
            continue
        getattr(model, event)()
        state = expected
        assert model.state == state


@pytest.mark.parametrize("spec", CONSUMER_MACHINES, ids=[m.name for m in CONSUMER_MACHINES])
def test_table_miss_raises_the_named_error(spec: MachineSpec) -> None:
    missing = [
        (s, e) for s, e in itertools.product(spec.states, spec.inputs) if (s, e) not in spec.table
    ]
    # A machine whose table is total still refuses an input it does not declare.
    state, event = missing[0] if missing else (spec.initial, "RECV_UNDECLARED")
    with pytest.raises(LocalProtocolError, match=event):
        spec.step(state, event)
    with pytest.raises(RemoteProtocolError, match=state):
        spec.step(state, event, RemoteProtocolError)


@pytest.mark.parametrize("spec", CONSUMER_MACHINES, ids=[m.name for m in CONSUMER_MACHINES])
def test_every_state_is_reachable_and_terminal_states_are_sinks(spec: MachineSpec) -> None:
    reached = {spec.initial}
    frontier = [spec.initial]
    while frontier:
        state = frontier.pop()
        for (source, _event), (_effect, dest) in spec.table.items():
            if source == state and dest not in reached:
                reached.add(dest)
                frontier.append(dest)
    assert reached == set(spec.states)
    for (source, _event), (_effect, dest) in spec.table.items():
        if source in spec.terminal:
            assert dest == source
