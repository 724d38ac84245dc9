"""The proxy's request-phase machine: its table, and the proxy firing it."""

from __future__ import annotations

import pytest
from proxy_harness import async_test, cluster

from rd2h_proxy import registry
from rd2h_proxy.payloads import COMPLETIONS
from rd2h_proxy.phases import (
    P_RECV_DISPATCH_FAILED,
    P_RECV_DISPATCH_OK,
    P_RECV_LAST_POST,
    P_RECV_POST,
    P_RECV_POST_CLIENT_GONE,
    P_TIMER_RENDEZVOUS_EXPIRED,
    PHASE_DISPATCHED,
    PHASE_DISPATCHING,
    PHASE_FAILED,
    PHASE_WAITING,
    PROXY_MACHINES,
    PROXY_REQUEST,
)
from rd2h_proxy.registry import Outcome, Registry, RendezvousRefused
from tests.machine_checks import Recording, record, table_tests

test_table_agrees_with_machine_on_every_pair, test_declarations_are_well_formed = table_tests(
    PROXY_MACHINES
)


def test_a_post_after_the_dispatch_started_is_refused_by_the_table() -> None:
    # Every child has posted by then: a new post cannot be, so it is a bug, not a 410.
    for state in (PHASE_DISPATCHING, PHASE_DISPATCHED):
        for event in (P_RECV_POST, P_RECV_LAST_POST, P_RECV_POST_CLIENT_GONE):
            assert (state, event) not in PROXY_REQUEST.table


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Recording:
    return record(monkeypatch, registry, "_PROXY_REQUEST")


def _phase_after(rec: Recording) -> str:
    """The phase the parent was left in by the last recorded step."""
    return PROXY_REQUEST.step(*rec.steps[-1])[1]


def test_a_post_for_a_parent_whose_client_has_gone_is_refused_by_a_row(
    recording: Recording,
) -> None:
    reg = Registry()
    parent = reg.open("p", COMPLETIONS, {}, {}, ("c0", "c1"), 0.0)
    parent.client_open = False  # the client handler has ended (the parent stays registered)
    with pytest.raises(RendezvousRefused, match="client request has ended") as info:
        reg.record("c0", {"a": 0})
    assert info.value.status == 410 and parent.posted == {}
    assert recording.steps == [(PHASE_WAITING, P_RECV_POST_CLIENT_GONE)]
    assert parent.state == PHASE_WAITING


def test_the_registry_fires_its_machine_through_the_handlers(recording: Recording) -> None:
    reg = Registry()
    parent = reg.open("p", COMPLETIONS, {}, {}, ("c0", "c1"), 0.0)
    assert reg.record("c0", {"a": 0}) == (parent, Outcome.RECORDED)  # record
    assert reg.record("c1", {"a": 1}) == (parent, Outcome.READY)  # dispatch
    assert parent.posted == {"c0": {"a": 0}, "c1": {"a": 1}} and parent.dispatch_running
    assert reg.fail(parent, P_RECV_DISPATCH_FAILED, 502, "boom")  # fail
    assert not reg.fail(parent, P_TIMER_RENDEZVOUS_EXPIRED, 504, "late")  # none
    reg.dispatch_succeeded(parent)  # none: the first failure won
    assert parent.failure == (502, "boom") and parent.state == PHASE_FAILED
    # refuse: a post for a failed parent.
    other = reg.open("q", COMPLETIONS, {}, {}, ("d0", "d1"), 0.0)
    reg.fail(other, P_TIMER_RENDEZVOUS_EXPIRED, 504, "late")
    with pytest.raises(RendezvousRefused, match="over: late") as info:
        reg.record("d0", {})
    assert info.value.status == 410 and other.posted == {}
    assert recording.steps == [
        (PHASE_WAITING, P_RECV_POST),
        (PHASE_WAITING, P_RECV_LAST_POST),
        (PHASE_DISPATCHING, P_RECV_DISPATCH_FAILED),
        (PHASE_FAILED, P_TIMER_RENDEZVOUS_EXPIRED),
        (PHASE_FAILED, P_RECV_DISPATCH_OK),
        (PHASE_WAITING, P_TIMER_RENDEZVOUS_EXPIRED),
        (PHASE_FAILED, P_RECV_POST),
    ]


@async_test
async def test_a_served_request_steps_waiting_dispatching_dispatched(recording: Recording) -> None:
    async with cluster() as c:
        status, body = await c.complete(COMPLETIONS, {"prompt": ["a", "b"]}, "ok")
        assert status == 200, body
        await c.wait_idle()
    assert recording.steps == [
        (PHASE_WAITING, P_RECV_POST),
        (PHASE_WAITING, P_RECV_LAST_POST),
        (PHASE_DISPATCHING, P_RECV_DISPATCH_OK),
    ]
    assert _phase_after(recording) == PHASE_DISPATCHED


@async_test
async def test_a_failed_dispatch_steps_the_parent_to_failed(recording: Recording) -> None:
    async with cluster() as c:
        c.prefill_status = 500
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, "boom")
        assert status == 502, body
        await c.wait_idle()
    assert recording.steps == [
        (PHASE_WAITING, P_RECV_LAST_POST),
        (PHASE_DISPATCHING, P_RECV_DISPATCH_FAILED),
    ]
    assert _phase_after(recording) == PHASE_FAILED


@async_test
async def test_a_missing_rendezvous_steps_the_parent_to_failed(recording: Recording) -> None:
    async with cluster(rendezvous_timeout_s=0.3) as c:
        c.decode_posts = False
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, "late")
        assert status == 504, body
        await c.wait_idle()
    assert recording.steps == [(PHASE_WAITING, P_TIMER_RENDEZVOUS_EXPIRED)]
    assert _phase_after(recording) == PHASE_FAILED
