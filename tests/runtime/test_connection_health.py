"""The Decode connection health machine: its table, and a Prefill worker firing it."""

from __future__ import annotations

import time
import typing

import pytest
from worker_pair import HOST, RecordingBackend, closing, prefill_worker

from rd2h_protocol.machines import NO_EFFECT
from rd2h_protocol.producer import DecodeTarget, RequestFinished
from rd2h_runtime import prefill
from rd2h_runtime.connection_health import (
    DECODE_CONNECTION_HEALTH,
    H_LOCAL_CONNECT_FAILED,
    H_RECV_BREAK_UNWATCHED,
    H_RECV_CONNECTED,
    H_RECV_DISCONNECTED,
    H_RECV_HANDSHAKE_FAILED,
    H_TIMER_GRACE_OVER,
    HEALTH_BROKEN,
    HEALTH_LOST,
    HEALTH_UP,
    RUNTIME_MACHINES,
)
from rd2h_runtime.control import ConnectionEvent, ControlOptions
from rd2h_runtime.control._common import ConnectionKind
from tests.machine_checks import record, table_tests

pytestmark = pytest.mark.timeout(30)

GRACE_S = 0.3


test_table_agrees_with_machine_on_every_pair, test_declarations_are_well_formed = table_tests(
    RUNTIME_MACHINES
)


def test_every_monitor_event_kind_has_a_row_in_every_state() -> None:
    kinds = set(typing.get_args(ConnectionKind))
    assert set(prefill.HEALTH_INPUTS) == kinds
    for event in [*prefill.HEALTH_INPUTS.values(), H_RECV_BREAK_UNWATCHED, H_TIMER_GRACE_OVER]:
        for state in DECODE_CONNECTION_HEALTH.states:
            DECODE_CONNECTION_HEALTH.step(state, event)  # never raises
    # Breaks of a connection nobody watches change nothing.
    for state in DECODE_CONNECTION_HEALTH.states:
        assert DECODE_CONNECTION_HEALTH.step(state, H_RECV_BREAK_UNWATCHED) == (NO_EFFECT, state)


def test_a_break_resumes_within_the_grace_and_is_lost_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rec = record(monkeypatch, prefill, "_HEALTH")
    worker = prefill_worker(
        RecordingBackend(role="prefill"), 16, ControlOptions(reconnect_grace_s=GRACE_S)
    )
    port = 1  # nothing listens: the events below are the monitor's, fed as its thread does
    conn = f"{HOST}:{port}"

    def event(kind: ConnectionKind, name: str = conn) -> None:
        worker._on_event(ConnectionEvent(name, kind, f"tcp://{name}"))

    def health(name: str = conn) -> str:
        with worker._lock:
            return worker._health[name].state

    with closing(worker):
        worker.add_request("r", DecodeTarget(HOST, port, 1))  # the endpoint knows conn now
        event("connected")
        assert health() == HEALTH_UP and worker.metrics.reconnects == 0
        event("disconnected")
        event("handshake_failed")  # the grace runs from the first break
        assert health() == HEALTH_BROKEN and worker.metrics.disconnects == 2
        event("connected")
        assert health() == HEALTH_UP and worker.metrics.reconnects == 1
        assert worker.stats.connections_lost == 0
        broke = time.monotonic()
        event("disconnected")
        # The worker's own timer ends the grace.
        deadline = broke + 10 * GRACE_S
        while worker.stats.connections_lost == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.stats.connections_lost == 1
        assert time.monotonic() - broke >= GRACE_S
        assert health() == HEALTH_LOST
        event("connect_failed", "10.0.0.1:9")  # no endpoint of ours: counted only
        assert health("10.0.0.1:9") == HEALTH_UP and worker.metrics.disconnects == 4
        event("connect_failed")  # a fresh DEALER that cannot be created: lost at once
        assert worker.stats.connections_lost == 2 and not worker.errors
    assert rec.inputs() == [
        H_RECV_CONNECTED,
        H_RECV_DISCONNECTED,
        H_RECV_HANDSHAKE_FAILED,
        H_RECV_CONNECTED,
        H_RECV_DISCONNECTED,
        H_TIMER_GRACE_OVER,
        H_RECV_BREAK_UNWATCHED,
        H_LOCAL_CONNECT_FAILED,
    ]


def test_a_break_past_the_grace_fires_the_lose_handler_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # connected -> broken -> the grace timer -> lost, fired through the bound handlers with
    # a clock of our own (the lock held throughout, so the worker's timer cannot interleave).
    rec = record(monkeypatch, prefill, "_HEALTH")
    worker = prefill_worker(
        RecordingBackend(role="prefill"), 16, ControlOptions(reconnect_grace_s=GRACE_S)
    )
    conn = f"{HOST}:1"
    lost: list[str] = []
    connection_lost = worker._connection_lost

    def spy(name: str, reason: str, now: float) -> list[RequestFinished]:
        lost.append(reason)
        return connection_lost(name, reason, now)

    monkeypatch.setattr(worker, "_connection_lost", spy)

    def event(kind: ConnectionKind, now: float) -> None:
        worker._connection_event(ConnectionEvent(conn, kind, f"tcp://{conn}"), now)

    with closing(worker):
        worker.add_request("r", DecodeTarget(HOST, 1, 1))
        with worker._lock:
            t0 = time.monotonic()
            event("connected", t0)
            event("disconnected", t0)
            health = worker._health[conn]
            assert (health.state, health.broke_at) == (HEALTH_BROKEN, t0)  # start_grace ran
            worker._grace_over(t0 + GRACE_S / 2)
            assert health.state == HEALTH_BROKEN and lost == []
            worker._grace_over(t0 + GRACE_S)
            assert health.state == HEALTH_LOST
            worker._grace_over(t0 + 2 * GRACE_S)  # a lost connection has no grace left
            event("connect_failed", t0 + 3 * GRACE_S)  # its fresh DEALER cannot be made
        assert worker.stats.connections_lost == 2 and worker.metrics.reconnects == 0
    assert lost == [
        f"broken and not back within {GRACE_S:.1f} s",
        f"cannot be opened (tcp://{conn})",
    ]
    assert rec.inputs() == [
        H_RECV_CONNECTED,
        H_RECV_DISCONNECTED,
        H_TIMER_GRACE_OVER,
        H_LOCAL_CONNECT_FAILED,
    ]
