"""A hostile Prefill peer floods a live Decode worker with frames the codec refuses (each
one a big readiness that decoded untyped would cost seconds and hundreds of MB): the I/O
thread keeps serving a good peer during the flood, and the refusals are logged, per peer
and rate-limited, with counters."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from worker_pair import HOST, LAYER, RecordingBackend, closing, decode_worker, prefill_worker

from rd2h_protocol.producer import DecodeTarget
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.prefill import PrefillWorker

pytestmark = pytest.mark.timeout(120)

BLOCKS = 64
FLOOD_FRAMES = 40


def hostile_frame(n: int = 1_500_000) -> bytes:
    """A readiness the codec refuses at once (far too many entries), 9 MB."""
    entries = [["x", [1]] for _ in range(n)]
    return msgspec.msgpack.encode([b"read_ready_batch", 0, LAYER, entries, [], 0, 1, 5])


@pytest.fixture
def pair() -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    decode = decode_worker(RecordingBackend(role="decode"), BLOCKS)
    prefill = prefill_worker(RecordingBackend(role="prefill"), BLOCKS, lease_ms=20_000)
    with closing(prefill, decode):
        yield prefill, decode


def test_a_flood_of_refused_frames_does_not_starve_a_good_peer(
    pair: tuple[PrefillWorker, DecodeWorker], caplog: pytest.LogCaptureFixture
) -> None:
    prefill, decode = pair
    frame = hostile_frame()
    ctx = zmq.Context.instance()
    attacker = ctx.socket(zmq.DEALER)
    attacker.setsockopt(zmq.IDENTITY, b"attacker")
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.setsockopt(zmq.SNDHWM, 0)
    attacker.connect(f"tcp://{HOST}:{decode.port}")
    flooding = threading.Event()

    def flood() -> None:
        flooding.set()
        for _ in range(FLOOD_FRAMES):
            attacker.send_multipart([b"", frame])

    caplog.set_level(logging.WARNING, logger="rd2h_runtime.decode")
    thread = threading.Thread(target=flood, daemon=True)
    try:
        thread.start()
        flooding.wait()
        # A good peer's requests, one layer each, while the flood is received.
        served = []
        for i in range(5):
            ext = f"good-{i}"
            start = time.monotonic()
            decode.add_request(ext, [2 * i, 2 * i + 1], [])
            prefill.add_request(ext, DecodeTarget(HOST, decode.port, 1))
            prefill.schedule_chunk(ext, [2 * i, 2 * i + 1], [], 0, 0, True)
            prefill.layer_written(0)
            prefill.end_step()
            outcome = decode.wait_finished(ext, 30.0)
            assert outcome is not None and outcome.ok, outcome
            assert prefill.wait_writable(0, 30.0)
            served.append(time.monotonic() - start)
            assert decode.release(ext)
        thread.join(60.0)

        def seen() -> int:  # refused by the codec, or dropped on arrival over the byte budget
            return decode.stats.malformed_frames + decode.control_stats.dropped_over_budget

        deadline = time.monotonic() + 60.0
        while seen() < FLOOD_FRAMES and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        attacker.close()
    stats = decode.stats
    assert seen() == FLOOD_FRAMES, (stats, decode.control_stats)
    print(f"good round trips during the flood: {[f'{s:.3f}' for s in served]} s")
    assert max(served) < 10.0, served
    # Logged, naming the peer; rate-limited to one line per peer per 10 s.
    lines = [r.getMessage() for r in caplog.records if "refused input" in r.getMessage()]
    assert lines and all("attacker" in line for line in lines), lines
    assert len(lines) <= 3, lines
