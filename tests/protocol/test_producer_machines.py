"""The Prefill machine declarations: the hot-path table and the transitions Machine agree.

Each machine is declared once (``rd2h_protocol.machines.producer``); the endpoint runs the
derived dict table, the docs and these tests build a ``transitions.Machine`` from the
same declaration. They must agree on every (state, input) pair, allowed or not.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transitions import MachineError

from rd2h_protocol.errors import LocalProtocolError, RemoteProtocolError
from rd2h_protocol.machines.declare import MachineSpec
from rd2h_protocol.machines.producer import (
    CONNECTION_HANDSHAKE,
    KEPT_REQUEST,
    LAYER_PUBLICATION,
    PREFILL_REQUEST,
    STORAGE_GATE,
)
from rd2h_protocol.producer import PRODUCER_MACHINES
from tests.machine_checks import machine_step, table_step, table_tests

MACHINES = {m.name: m for m in PRODUCER_MACHINES}
PAIRS = [(m.name, s, i) for m in PRODUCER_MACHINES for s in m.states for i in m.inputs]

test_table_agrees_with_machine_on_every_pair, test_declarations_are_well_formed = table_tests(
    PRODUCER_MACHINES
)


def test_every_producer_machine_is_listed() -> None:
    assert PRODUCER_MACHINES == (
        STORAGE_GATE,
        LAYER_PUBLICATION,
        PREFILL_REQUEST,
        KEPT_REQUEST,
        CONNECTION_HANDSHAKE,
    )
    assert len(MACHINES) == len(PRODUCER_MACHINES)


@given(st.sampled_from(PAIRS))
def test_table_and_machine_agree_on_drawn_pairs(pair: tuple[str, str, str]) -> None:
    name, state, event = pair
    spec = MACHINES[name]
    assert table_step(spec, state, event) == machine_step(spec, state, event)


@given(st.data())
def test_walks_agree(data: st.DataObject) -> None:
    """A random walk of inputs (refused ones included) keeps both in the same state."""
    spec = data.draw(st.sampled_from(PRODUCER_MACHINES))
    machine = spec.build_machine()
    model = machine.models[0]
    state = spec.initial
    for event in data.draw(st.lists(st.sampled_from(spec.inputs), max_size=30)):
        expected = table_step(spec, state, event)
        try:
            model.trigger(event)
            got: str | None = str(model.state)
        except MachineError:
            got = None
        assert got == expected
        if expected is not None:
            state = expected
        assert model.state == state


@pytest.mark.parametrize("spec", PRODUCER_MACHINES, ids=lambda m: m.name)
def test_a_table_miss_raises_the_named_error(spec: MachineSpec) -> None:
    misses = [(s, i) for s in spec.states for i in spec.inputs if (s, i) not in spec.table]
    assert misses  # every machine refuses something
    state, event = misses[0]
    with pytest.raises(LocalProtocolError, match=f"{event} is not allowed in state {state}"):
        spec.step(state, event)
    with pytest.raises(RemoteProtocolError):
        spec.step(state, event, RemoteProtocolError)
    with pytest.raises(LocalProtocolError):
        spec.step(state, "NO_SUCH_INPUT")


def test_request_terminal_states_have_no_transitions() -> None:
    # A finished request is forgotten at once: nothing may address its terminal state.
    assert not [key for key in PREFILL_REQUEST.table if key[0] in PREFILL_REQUEST.terminal]


def test_late_replies_are_counted_by_the_table() -> None:
    for state in ("replied", "failed", "requeued"):
        for event in ("RECV_DONE", "RECV_FAILED", "RECV_UNKNOWN_SESSION"):
            assert LAYER_PUBLICATION.step(state, event) == ("count_duplicate", state)
    for state in ("expired", "released"):
        for event in ("RECV_DONE", "RECV_FAILED", "RECV_UNKNOWN_SESSION"):
            assert LAYER_PUBLICATION.step(state, event) == ("count_stale", state)


def test_gate_reopens_after_expiry_only_through_the_abort() -> None:
    assert STORAGE_GATE.step("closed", "TIMER_LEASE_EXPIRED") == ("none", "expired")
    assert STORAGE_GATE.step("expired", "LOCAL_LAST_ABORT_SENT") == ("reopen", "open")
    assert STORAGE_GATE.step("expired", "LOCAL_ABORT_SENT") == ("none", "expired")
    with pytest.raises(LocalProtocolError):
        STORAGE_GATE.step("closed", "LOCAL_LAST_ABORT_SENT")
    with pytest.raises(LocalProtocolError):
        STORAGE_GATE.step("expired", "LOCAL_PUBLISH")  # no reuse before it reopened


def test_gate_opens_without_a_reply_or_abort_only_after_the_lease_ran_out() -> None:
    # S1: every reply-less, abort-less way out needs the lease to have expired first.
    for event in ("LOCAL_LAST_PEER_DEAD", "LOCAL_LAST_REOPEN_UNSAFE", "LOCAL_LAST_ABORT_SENT"):
        assert STORAGE_GATE.step("expired", event) == ("reopen", "open")
        with pytest.raises(LocalProtocolError):
            STORAGE_GATE.step("closed", event)


def test_held_and_orphaned_publications_end_only_by_reply_or_death_and_lease() -> None:
    for state in ("held", "orphaned"):
        for event, dest in (
            ("RECV_DONE", "replied"),
            ("RECV_FAILED", "failed"),
            ("RECV_UNKNOWN_SESSION", "failed"),
        ):
            assert LAYER_PUBLICATION.step(state, event) == ("release_held", dest)
    assert LAYER_PUBLICATION.step("held", "LOCAL_CONNECTION_LOST") == ("release_held", "expired")
    assert LAYER_PUBLICATION.step("orphaned", "TIMER_LEASE_EXPIRED") == ("release_held", "expired")
    assert LAYER_PUBLICATION.step("orphaned", "LOCAL_CONNECTION_LOST") == ("none", "orphaned")
    for event in ("TIMER_LEASE_EXPIRED", "SEND_READINESS"):
        with pytest.raises(LocalProtocolError):
            LAYER_PUBLICATION.step("held", event)  # its lease ran out already, never resent


def test_connection_handshake_retries_and_resets() -> None:
    # (retry: send_meta, counted as a retry)
    assert CONNECTION_HANDSHAKE.step("refused", "LOCAL_PUBLISH") == ("retry", "handshaking")
    assert CONNECTION_HANDSHAKE.step("refused", "LOCAL_PUBLISH_BACKOFF") == ("release", "refused")
    for state in CONNECTION_HANDSHAKE.states:
        assert CONNECTION_HANDSHAKE.step(state, "LOCAL_CONNECTION_LOST") == ("reset", "idle")
