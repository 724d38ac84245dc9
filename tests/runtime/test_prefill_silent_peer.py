"""A v1 Decode that acknowledges the handshake and then never replies (libzmq answers its
heartbeats, so its connection stays up) must not hold Prefill's storage, and with it every
other Decode's requests, for as long as it stays connected: past its lease plus
``silent_peer_timeout_s`` of silence it is declared dead and the storage reopens."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from worker_pair import HOST, RecordingBackend, closing, decode_worker, prefill_worker

from rd2h_protocol.producer import DecodeTarget
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.prefill import PrefillWorker

pytestmark = pytest.mark.timeout(60)

BLOCKS = 16
LEASE_S = 1.0
SILENT_S = 1.0
SLACK_S = 1.5


class SilentV1Decode:
    """A raw ROUTER that answers MF_META with v1's raw ACK, then never says anything."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.port = self.router.bind_to_random_port(f"tcp://{HOST}")
        self.readiness = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            ident, *_, payload = self.router.recv_multipart()
            if b"mf_meta" in payload[:16]:
                self.router.send_multipart([ident, b"", b"ACK"])
            else:
                self.readiness += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.router.close(0)
        self.ctx.term()


@pytest.fixture(params=[SILENT_S, None], ids=["silence-bound", "hold-forever"])
def world(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[PrefillWorker, DecodeWorker, SilentV1Decode, float | None]]:
    healthy = decode_worker(RecordingBackend(role="decode"), BLOCKS)
    prefill = prefill_worker(
        RecordingBackend(role="prefill"),
        BLOCKS,
        lease_ms=int(LEASE_S * 1000),
        silent_peer_timeout_s=request.param,
    )
    silent = SilentV1Decode()
    try:
        with closing(prefill, healthy):
            yield prefill, healthy, silent, request.param
    finally:
        silent.close()


def test_a_silent_v1_decode_does_not_stall_a_healthy_one(
    world: tuple[PrefillWorker, DecodeWorker, SilentV1Decode, float | None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefill, healthy, silent, silence_s = world
    caplog.set_level(logging.WARNING, logger="rd2h_runtime.prefill")
    # One layer to the silent v1 Decode: its storage is held once the lease runs out.
    prefill.add_request("to-silent", DecodeTarget(HOST, silent.port, 1))
    prefill.schedule_chunk("to-silent", [1, 2], [], 0, 0, True)
    prefill.layer_written(0)
    prefill.end_step()
    published = time.monotonic()
    finished = prefill.wait_finished("to-silent", LEASE_S + SLACK_S)
    assert finished is not None and not finished.ok
    # The next step, for the healthy Decode, needs that storage.
    healthy.add_request("to-healthy", [3, 4], [])
    prefill.add_request("to-healthy", DecodeTarget(HOST, healthy.port, 1))
    prefill.schedule_chunk("to-healthy", [3, 4], [], 0, 0, True)
    if silence_s is None:
        # The old behaviour, kept on request: held for as long as the connection lasts.
        assert not prefill.wait_writable(0, 5.0)
        assert prefill.metrics.gate_timeouts >= 1
        return
    assert prefill.wait_writable(0, LEASE_S + silence_s + SLACK_S)
    reopened = time.monotonic() - published
    assert reopened <= LEASE_S + silence_s + SLACK_S
    prefill.layer_written(0)
    prefill.end_step()
    outcome = healthy.wait_finished("to-healthy", 10.0)
    assert outcome is not None and outcome.ok
    done = prefill.wait_finished("to-healthy", 10.0)
    assert done is not None and done.ok
    assert prefill.stats.silent_peers == 1 and silent.readiness == 1
    assert any("nothing heard" in r.getMessage() for r in caplog.records)
    print(f"storage reopened {reopened:.2f} s after publishing (lease {LEASE_S} s + {silence_s} s)")
