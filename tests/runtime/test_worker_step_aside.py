"""The worker lock's order: a call someone waits on (the caller's API, a read's end) goes
before the control handler's next event, so a peer whose frames are dear to handle holds
each of another peer's steps up for at most the one frame in service; and the handler
steps aside for a bounded time only, so a caller that never stops cannot starve the peers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import zmq
from worker_pair import RecordingBackend, closing, decode_worker

from rd2h_runtime.decode import DecodeWorker

pytestmark = pytest.mark.timeout(30)

WAIT_S = 5.0


def _until(what: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _send_frames(decode: DecodeWorker, n: int) -> zmq.Socket[bytes]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{decode.host}:{decode.port}")
    for i in range(n):
        sock.send(b"not a frame %d" % i)  # refused by the endpoint, after its handling
    return sock


def _record_frames(decode: DecodeWorker, order: list[str], hold_first: threading.Event) -> None:
    """Each frame the endpoint handles appends "frame"; the first waits for ``hold_first``."""
    receive = decode._endpoint.receive

    def recording(peer: bytes, frame: bytes, now: float) -> object:
        order.append("frame")
        if order.count("frame") == 1:
            hold_first.wait(WAIT_S)
        return receive(peer, frame, now)

    decode._endpoint.receive = recording  # type: ignore[method-assign, assignment]


def test_a_waiting_call_goes_before_the_handlers_next_frame() -> None:
    decode = decode_worker(RecordingBackend(role="decode"), 16)
    with closing(decode):
        order: list[str] = []
        hold = threading.Event()
        _record_frames(decode, order, hold)
        sock = _send_frames(decode, 3)
        try:
            _until(lambda: order == ["frame"])  # the first is in service, two queued

            def call() -> None:
                decode.add_request("r1", [1], [])
                order.append("call")

            caller = threading.Thread(target=call)
            caller.start()
            _until(lambda: decode._urgent == 1)  # the call waits for the lock
            hold.set()
            caller.join(WAIT_S)
            _until(lambda: order.count("frame") == 3)
            assert order == ["frame", "call", "frame", "frame"]
        finally:
            sock.close(0)


def test_the_handler_steps_aside_for_a_bounded_time_only() -> None:
    decode = decode_worker(RecordingBackend(role="decode"), 16)
    with closing(decode):
        order: list[str] = []
        hold = threading.Event()
        hold.set()
        _record_frames(decode, order, hold)
        with decode._ahead():  # a caller that never lets go
            sock = _send_frames(decode, 3)
            try:
                _until(lambda: order.count("frame") == 3)  # handled all the same
            finally:
                sock.close(0)
        assert decode.stats.malformed_frames == 3
