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
from tests.machine_checks import table_step, table_tests

test_table_agrees_with_machine_on_every_pair, test_declarations_are_well_formed = table_tests(
    CONSUMER_MACHINES
)


@given(st.data())
def test_random_walks_agree(data: st.DataObject) -> None:
    spec = data.draw(st.sampled_from(CONSUMER_MACHINES))
    machine = spec.build_machine()
    model = machine.models[0]
    state = spec.initial
    for _ in range(data.draw(st.integers(1, 30))):
        event = data.draw(st.sampled_from(spec.inputs))
        expected = table_step(spec, state, event)
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
