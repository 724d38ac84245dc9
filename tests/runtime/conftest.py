"""Fixtures for the transfer-backend tests: a Prefill source in a separate process.

The source is ``rd2h_runtime.check_read --role prefill``: it fills a buffer with
``check_read.pattern(size, seed)``, registers it with the backend under test and answers one
Decode on a ZMQ REP socket (127.0.0.1, port chosen at run time). The test process plays
Decode: it gets the session, address and length, reads with its own backend, and at
teardown sends the final report that lets the source exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq

STARTUP_TIMEOUT_S = 30.0


@dataclass
class TransferSource:
    """A live Prefill source: what a Decode needs to read from it."""

    backend: str
    session: str
    addr: int
    length: int
    seed: int
    sha256: str
    proc: subprocess.Popen[str]
    output: list[str] = field(default_factory=list)


def _start_source(backend: str, size: int) -> tuple[TransferSource, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "UCX_MODULES": "^ib"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rd2h_runtime.check_read",
            "--backend",
            backend,
            "--role",
            "prefill",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--size",
            str(size),
            "--timeout",
            "120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    output: list[str] = []
    ready = threading.Event()
    endpoint: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line.rstrip("\n"))
            if line.startswith("CONTROL "):
                endpoint.append(line.split()[1])
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(STARTUP_TIMEOUT_S) or not endpoint:
        proc.kill()
        proc.wait(5)
        raise RuntimeError(f"{backend} source did not start:\n" + "\n".join(output[-20:]))
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(STARTUP_TIMEOUT_S * 1000))
    sock.connect(endpoint[0])
    sock.send_json({"op": "hello", "backend": backend})
    info = sock.recv_json()
    assert isinstance(info, dict) and info["op"] == "source", info
    source = TransferSource(
        backend=backend,
        session=info["session"],
        addr=int(info["addr"]),
        length=int(info["length"]),
        seed=int(info["seed"]),
        sha256=info["sha256"],
        proc=proc,
        output=output,
    )
    return source, sock


def _stop_source(source: TransferSource, sock: Any) -> None:
    try:
        sock.send_json({"op": "result", "result": {"ok": True, "reason": "test done"}})
        sock.recv_json()
    except zmq.ZMQError:
        pass  # the source may have died; the exit-code check below reports it
    finally:
        sock.close(linger=0)
    try:
        source.proc.wait(15)
    except subprocess.TimeoutExpired:
        source.proc.kill()
        source.proc.wait(5)


@pytest.fixture(scope="module")
def transfer_source() -> Iterator[Callable[[str, int], TransferSource]]:
    """Factory: ``transfer_source(backend, size)`` -> a running source (one per module+args)."""
    started: dict[tuple[str, int], tuple[TransferSource, Any]] = {}

    def get(backend: str, size: int) -> TransferSource:
        key = (backend, size)
        if key not in started:
            started[key] = _start_source(backend, size)
        return started[key][0]

    yield get
    for source, sock in started.values():
        _stop_source(source, sock)
