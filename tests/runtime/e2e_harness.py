"""End-to-end test helpers beside :mod:`rd2h_runtime.testing.engines`: a ZMQ relay that drops,
duplicates or delays frames between Prefill and Decode, and the clean-state checks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq

from rd2h_runtime.testing.engines import HOST

# -- a ZMQ relay that can lose, repeat and hold frames -------------------------------------------

Policy = Callable[[str, bytes], Sequence[float]]


def describe(payload: bytes) -> tuple[Any, ...]:
    """A frame as a tuple (tag first) for policies and assertions; ("raw", bytes) if not msgpack."""
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except Exception:
        return ("raw", payload)
    return tuple(obj) if isinstance(obj, list) else ("raw", payload)


class Relay:
    """Sits between Prefill DEALERs and a Decode ROUTER on 127.0.0.1.

    Prefill connects to :attr:`port`; each Prefill identity gets its own DEALER to the
    Decode port, so identities stay distinct. ``policy(direction, payload)`` returns the
    delays (seconds) at which to forward a frame: ``[]`` drops it, ``[0, 0]`` duplicates
    it. ``direction`` is "up" (Prefill -> Decode) or "down". Every frame is recorded.
    """

    def __init__(self, decode_port: int, policy: Policy) -> None:
        self._decode_port = decode_port
        self._policy = policy
        self.log: list[tuple[float, str, bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self.port = self._front.bind_to_random_port(f"tcp://{HOST}")
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._thread.start()

    def frames(self, direction: str) -> list[tuple[Any, ...]]:
        with self._lock:
            return [describe(p) for _, d, p in self.log if d == direction]

    def _run(self) -> None:
        backs: dict[bytes, zmq.Socket[bytes]] = {}
        owner: dict[zmq.Socket[bytes], bytes] = {}
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        held: list[tuple[float, int, Callable[[], None]]] = []
        counter = 0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                due = [h for h in held if h[0] <= now]
                held = [h for h in held if h[0] > now]
                for _, _, send in sorted(due):
                    send()
                wait = min((h[0] for h in held), default=now + 0.05) - time.monotonic()
                for sock, _ in poller.poll(max(1, int(min(wait, 0.05) * 1000))):
                    if sock is self._front:
                        frames = self._front.recv_multipart()
                        ident, body = frames[0], [f for f in frames[1:] if f]
                        if len(body) != 1:
                            continue
                        back = backs.get(ident)
                        if back is None:
                            back = self._ctx.socket(zmq.DEALER)
                            back.setsockopt(zmq.LINGER, 0)
                            back.connect(f"tcp://{HOST}:{self._decode_port}")
                            backs[ident] = back
                            owner[back] = ident
                            poller.register(back, zmq.POLLIN)
                        direction, payload = "up", body[0]

                        def send(b: zmq.Socket[bytes] = back, p: bytes = payload) -> None:
                            b.send(p)
                    else:
                        frames = sock.recv_multipart()
                        body = [f for f in frames if f]
                        if len(body) != 1:
                            continue
                        direction, payload = "down", body[0]

                        def send(i: bytes = owner[sock], p: bytes = payload) -> None:
                            self._front.send_multipart([i, b"", p])

                    with self._lock:
                        self.log.append((time.monotonic(), direction, payload))
                    for delay in self._policy(direction, payload):
                        counter += 1
                        held.append((time.monotonic() + delay, counter, send))
        finally:
            for back in backs.values():
                back.close(0)
            self._front.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.term()


# -- checks ------------------------------------------------------------------------------------


def all_gates_open(state: dict[str, Any]) -> bool:
    """Every storage gate of every Prefill rank is open with nothing outstanding."""
    return all(g == ("open", 0) for gates in state["gates"] for g in gates.values())


def assert_clean(state: dict[str, Any]) -> None:
    """No residual state, no dead thread, no error caught on an I/O thread."""
    assert all(state["idle"]), f"residual state: {state['requests']}"
    assert all(state["healthy"]), f"unhealthy: {state['errors']}"
    assert not state["errors"], state["errors"]
    if "gates" in state:
        assert all_gates_open(state), state["gates"]
        assert not state["run_errors"], state["run_errors"]


def wait_until(pred: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)
    return True
