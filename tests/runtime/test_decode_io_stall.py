"""A Decode whose control I/O thread stalls while ZMQ may queue only one frame per peer.

With ``peer_queued_frames=1`` (the byte-bounded queue) ZMQ stops reading a Prefill's
connection while one of its frames waits for the Python I/O thread, heartbeats included.
A stall of that thread longer than the heartbeat timeout therefore drops the connection,
where a deep queue would have kept it. The protocol must make that harmless: ZMQ
reconnects, Prefill resends what was unanswered, and every request in flight finishes with
the right bytes. Only the I/O thread stalls here (ZMQ's own threads and the rest of the
process run on), unlike the SIGSTOP test in test_e2e_faults.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from rd2h_runtime.control import DecodeControlServer
from rd2h_runtime.testing.engines import FAST_CONTROL, DecodeSpec, PrefillSpec
from tests.runtime.test_e2e_faults import RING, WAIT_S, Local, check_decode, check_prefill, reqs

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def pairs() -> Iterator[list[Local]]:
    made: list[Local] = []
    yield made
    for pair in made:
        pair.stack.close()


def stall_once(server: DecodeControlServer, seconds: float) -> threading.Event:
    """Make the server's I/O thread sleep ``seconds`` the next time it reads its ROUTER;
    the event is set once the stall is over."""
    read = server._read_router
    over = threading.Event()

    def stalled(router: zmq.Socket[bytes]) -> None:
        if not over.is_set():
            time.sleep(seconds)
            over.set()
        read(router)

    server._read_router = stalled  # type: ignore[method-assign]
    return over


@pytest.mark.parametrize("backend", ["loopback", "nixl"])
def test_an_io_thread_stalled_past_the_heartbeat_timeout_loses_nothing(
    backend: str, pairs: list[Local]
) -> None:
    if backend == "nixl":
        pytest.importorskip("nixl")
    control = dataclasses.replace(FAST_CONTROL, reconnect_grace_s=10.0, peer_queued_frames=1)
    stall_s = 3 * control.heartbeat_timeout_s
    pair = Local(
        PrefillSpec(RING, backend=backend, lease_ms=30_000, control=control),
        DecodeSpec(RING, backend=backend, read_delay_s=0.05, control=control),
    )
    pairs.append(pair)
    # A first request shakes hands.
    warm = reqs("warm", 1)
    pair.add(warm, warm)
    assert pair.prefill.run(WAIT_S) == []
    assert all(r.ok for r in pair.decode.wait([warm[0].ext_id], WAIT_S).values())
    assert pair.decode.release([warm[0].ext_id])
    pair.prefill.release([warm[0].ext_id])

    over = stall_once(pair.decode.workers[0]._control, stall_s)
    stalled = reqs("stall")
    ids = [r.ext_id for r in stalled]
    pair.add(stalled, stalled)
    pair.prefill.start()
    assert pair.prefill.join(WAIT_S + stall_s)
    assert over.is_set()
    finished = check_prefill(pair.prefill.wait(ids, WAIT_S), None)
    assert all(f.ok for f in finished.values()), finished
    results = pair.decode.wait(ids, WAIT_S)
    check_decode(results, None)
    assert all(r.ok for r in results.values()), results
    state = pair.prefill.state()
    metrics = state["metrics"][0]
    # The stall did cost the connection (the one-frame queue's known price) ...
    assert metrics["disconnects"] >= 1, metrics
    assert metrics["reconnects"] >= 1, metrics
    # ... and nothing was declared lost.
    assert state["stats"][0]["connections_lost"] == 0, state["stats"][0]
    pair.finish(ids)
