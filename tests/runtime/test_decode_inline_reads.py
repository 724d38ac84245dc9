"""Which thread runs a Decode read: a short one (at most the backend's
``inline_read_bytes``, none other queued or running) on the ROUTER's I/O thread, right after
the readiness that started it; any other on the read worker; never two at once."""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import pytest
from worker_pair import HOST, closing, decode_worker, prefill_worker

from rd2h_protocol.producer import DecodeTarget
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.transfer import TransferBackend
from rd2h_runtime.transfer.base import U64Array

pytestmark = pytest.mark.timeout(60)

BLOCKS = 8
BLOCK_BYTES = 2 * 64  # K and V of one block in worker_pair's layer
IO_THREAD = "rd2h-control-router-"
READ_WORKER = "rd2h-decode-reader-"


class ThreadBackend(TransferBackend):
    """Moves nothing; records the thread of each read and how many ran at once. A read of
    more than ``hold_over`` bytes waits for ``release`` (set it to let it end)."""

    name: ClassVar[str] = "threads"
    inline_read_bytes: ClassVar[int] = 3 * BLOCK_BYTES

    def __init__(self, *, role: str, hold_over: int = 1 << 62, **options: Any) -> None:
        super().__init__(role=role, host=HOST)
        self.hold_over = hold_over
        self.release = threading.Event()
        self.threads: list[str] = []
        self.running = self.most_at_once = 0
        self._count_lock = threading.Lock()

    @property
    def session_id(self) -> str:
        return "threads:0"

    def _register(self, regions: list[tuple[int, int]]) -> None:
        return None

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        with self._count_lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        self.threads.append(threading.current_thread().name)
        if int(lengths.sum()) > self.hold_over:
            assert self.release.wait(10.0)
        with self._count_lock:
            self.running -= 1

    def _close(self) -> None:
        return None


class WorkerOnly(ThreadBackend):
    """An engine that works on a thread of its own: every read goes to the read worker."""

    inline_read_bytes: ClassVar[int] = 0


def publish(prefill: PrefillWorker, decode: DecodeWorker, ext: str, src: list[int]) -> None:
    prefill.add_request(ext, DecodeTarget(HOST, decode.port, 1))
    prefill.schedule_chunk(ext, src, [], 0, 0, True)
    prefill.layer_written(0)


def read_threads(backend_type: type[ThreadBackend], blocks: int) -> list[str]:
    """Publish one request of ``blocks`` blocks; the threads its reads ran on."""
    backend = backend_type(role="decode")
    decode = decode_worker(backend, BLOCKS)
    prefill = prefill_worker(ThreadBackend(role="prefill"), BLOCKS)
    with closing(prefill, decode):
        decode.add_request("r1", list(range(blocks)), [])
        publish(prefill, decode, "r1", list(range(blocks)))
        assert prefill.wait_writable(0, 10.0)
        outcome = decode.wait_finished("r1", 10.0)
        assert outcome is not None and outcome.ok
    return backend.threads


def test_a_short_read_runs_on_the_io_thread() -> None:
    [thread] = read_threads(ThreadBackend, 2)
    assert thread.startswith(IO_THREAD)


def test_a_read_over_the_backends_inline_bytes_runs_on_the_read_worker() -> None:
    [thread] = read_threads(ThreadBackend, 4)  # 4 blocks > inline_read_bytes
    assert thread.startswith(READ_WORKER)


def test_a_backend_that_declares_no_inline_bytes_reads_on_the_read_worker() -> None:
    [thread] = read_threads(WorkerOnly, 1)
    assert thread.startswith(READ_WORKER)


def test_a_short_read_waits_behind_a_long_one_and_the_io_thread_keeps_serving() -> None:
    backend = ThreadBackend(role="decode", hold_over=3 * BLOCK_BYTES)
    decode = decode_worker(backend, BLOCKS)
    long_p = prefill_worker(ThreadBackend(role="prefill"), BLOCKS)
    short_p = prefill_worker(ThreadBackend(role="prefill"), BLOCKS)
    with closing(long_p, short_p, decode):
        decode.add_request("long", [0, 1, 2, 3], [])
        decode.add_request("short", [4], [])
        publish(long_p, decode, "long", [0, 1, 2, 3])
        deadline = time.monotonic() + 10.0
        while not backend.threads:  # the long read runs (held) on the read worker
            assert time.monotonic() < deadline
            time.sleep(0.01)
        publish(short_p, decode, "short", [4])
        while len(decode.in_flight_reads()) < 2:  # the I/O thread serves the short one
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(backend.threads) == 1  # and its read waits: one read at a time
        backend.release.set()
        for prefill, ext in ((long_p, "long"), (short_p, "short")):
            assert prefill.wait_writable(0, 10.0)
            outcome = decode.wait_finished(ext, 10.0)
            assert outcome is not None and outcome.ok
    assert [t[: len(READ_WORKER)] for t in backend.threads] == [READ_WORKER, READ_WORKER]
    assert backend.most_at_once == 1
