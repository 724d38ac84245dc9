"""Decode's inline reads (issue 23): the dispatcher runs a small plan itself when the read
worker is idle and the backend reads on the calling thread, saving a thread hand-off per
layer; a large plan, a backend not known to be fast, a busy read worker, or an engine call
that outlives a failed inline read all keep the read worker's path, and the dispatcher
keeps serving other peers while such a read runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from worker_pair import HOST, RecordingBackend, closing, decode_worker, prefill_worker

from rd2h_protocol.errors import LocalProtocolError, TransferError
from rd2h_protocol.producer import DecodeTarget
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.decode_reads import INLINE_READ_BYTES, INLINE_READ_PIECES
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.transfer.base import U64Array
from rd2h_runtime.transfer.loopback import LoopbackBackend

pytestmark = pytest.mark.timeout(60)

# Each block of the test layer is two 64-byte components (K and V): 128 bytes, 2 pieces.
BLOCK_BYTES = 128
READER = "rd2h-decode-reader-"


class ThreadBackend(RecordingBackend):
    """Moves nothing; records the thread each read ran on."""

    name: ClassVar[str] = "thread-recording"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.threads: list[str] = []

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        self.threads.append(threading.current_thread().name)
        super()._read(session, remote, local, lengths, deadline)


class GatedBackend(ThreadBackend):
    """Each read blocks on the calling thread until ``release`` is set (or its deadline)."""

    name: ClassVar[str] = "gated"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.started = threading.Event()
        self.release = threading.Event()

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        super()._read(session, remote, local, lengths, deadline)
        self.started.set()
        if not self.release.wait(max(0.0, deadline - time.monotonic())):
            raise TransferError("gated read timed out")


class LingeringBackend(ThreadBackend):
    """A backend opted into inline reads wrongly: a read fails at once while its engine
    call runs on until ``ended`` is set (``quiesce`` says so)."""

    name: ClassVar[str] = "lingering"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.ended = threading.Event()

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        super()._read(session, remote, local, lengths, deadline)
        raise TransferError("engine call abandoned at its deadline")

    def quiesce(self, timeout_s: float) -> bool:
        return self.ended.wait(timeout_s)


class RefusingOnce:
    """A stand-in for the worker's ``_read_lock`` that refuses the first non-blocking try,
    as a lock the read worker holds would."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.refused = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not blocking and not self.refused:
            self.refused += 1
            return False
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def wait_for(ready: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def start_request(
    prefill: PrefillWorker, decode: DecodeWorker, ext: str, src: list[int], dst: list[int]
) -> None:
    """Publish one layer of ``ext`` from ``prefill`` to ``decode`` (``src`` -> ``dst``)."""
    decode.add_request(ext, dst, [])
    prefill.add_request(ext, DecodeTarget(HOST, decode.port, 1))
    prefill.schedule_chunk(ext, src, [], 0, 0, True)
    prefill.layer_written(0)
    prefill.end_step()


def run_request(prefill: PrefillWorker, decode: DecodeWorker, blocks: int) -> None:
    start_request(prefill, decode, "r1", list(range(blocks)), list(range(blocks)))
    outcome = decode.wait_finished("r1", 10.0)
    assert outcome is not None and outcome.ok, outcome
    assert decode.release("r1")


def test_the_default_bound_depends_on_the_backend() -> None:
    decode = decode_worker(LoopbackBackend(role="decode"), 4)
    other = decode_worker(ThreadBackend(role="decode"), 4)
    with closing(decode, other):
        assert decode.inline_read_bytes == INLINE_READ_BYTES  # reads on the calling thread
        assert other.inline_read_bytes == 0  # unknown: maybe a network round trip
    with pytest.raises(LocalProtocolError, match="inline_read_bytes"):
        decode_worker(ThreadBackend(role="decode"), 4, inline_read_bytes=-1)


def test_a_small_read_runs_on_the_dispatcher() -> None:
    backend = ThreadBackend(role="decode")
    decode = decode_worker(backend, 8, inline_read_bytes=INLINE_READ_BYTES)
    prefill = prefill_worker(RecordingBackend(role="prefill"), 8)
    with closing(prefill, decode):
        run_request(prefill, decode, 2)
        assert len(backend.threads) == 1
        assert backend.threads[0].endswith("-dispatch"), backend.threads
        assert decode.metrics.inline_reads == 1
        assert decode.metrics.reads == 1 and decode.metrics.read_bytes == 2 * BLOCK_BYTES
        assert not decode.errors
        assert wait_for(decode.is_idle)


@pytest.mark.parametrize(
    ("blocks", "inline_bytes"),
    [
        (2, 2 * BLOCK_BYTES - 1),  # over the byte bound
        (INLINE_READ_PIECES // 2 + 1, INLINE_READ_BYTES),  # over the piece bound
        (2, None),  # a backend not known to read on the calling thread: never inline
    ],
    ids=["bytes", "pieces", "backend"],
)
def test_a_large_read_or_an_unknown_backend_keeps_the_read_worker(
    blocks: int, inline_bytes: int | None
) -> None:
    backend = ThreadBackend(role="decode")
    pool = max(8, blocks)
    decode = decode_worker(backend, pool, inline_read_bytes=inline_bytes)
    prefill = prefill_worker(RecordingBackend(role="prefill"), pool)
    with closing(prefill, decode):
        run_request(prefill, decode, blocks)
        assert len(backend.threads) == 1
        assert backend.threads[0].startswith(READER), backend.threads
        assert decode.metrics.inline_reads == 0
        assert decode.metrics.read_bytes == blocks * BLOCK_BYTES


def test_a_busy_read_worker_takes_the_plan_instead() -> None:
    backend = ThreadBackend(role="decode")
    decode = decode_worker(backend, 8, inline_read_bytes=INLINE_READ_BYTES)
    prefill = prefill_worker(RecordingBackend(role="prefill"), 8)
    lock = RefusingOnce()
    decode._read_lock = lock  # type: ignore[assignment]
    with closing(prefill, decode):
        run_request(prefill, decode, 2)
        assert lock.refused == 1
        assert len(backend.threads) == 1 and backend.threads[0].startswith(READER)
        assert decode.metrics.inline_reads == 0
        assert not decode.errors


@pytest.mark.parametrize("opted_in", [True, False], ids=["large-plan", "unknown-backend"])
def test_a_slow_read_leaves_other_peers_served(opted_in: bool) -> None:
    """A slow read runs on the read worker, so the dispatcher answers another Prefill's
    handshake while it runs: with inline reads on, because the plan is over the bound;
    with the default for an unknown backend, because that backend is never read inline."""
    backend = GatedBackend(role="decode")
    # 4 blocks: 512 bytes, over a 300-byte bound.
    decode = decode_worker(backend, 16, inline_read_bytes=300 if opted_in else None)
    slow = prefill_worker(RecordingBackend(role="prefill"), 16)
    other = prefill_worker(RecordingBackend(role="prefill"), 16)
    with closing(slow, other, decode):
        try:
            start_request(slow, decode, "slow", [0, 1, 2, 3], [0, 1, 2, 3])
            assert backend.started.wait(10.0)
            sent = decode.control_stats.frames_out
            start_request(other, decode, "other", [4], [4])
            # The other peer's handshake is handled and acknowledged while the read runs.
            assert wait_for(lambda: decode.stats.handshakes == 2)
            assert wait_for(lambda: decode.control_stats.frames_out > sent)
            assert not backend.release.is_set() and decode.outcomes() == {}
        finally:
            backend.release.set()
        for ext in ("slow", "other"):
            outcome = decode.wait_finished(ext, 10.0)
            assert outcome is not None and outcome.ok, outcome
        assert all(t.startswith(READER) for t in backend.threads), backend.threads
        assert decode.metrics.inline_reads == 0


def test_an_engine_call_that_outlives_a_failed_inline_read_is_waited_for_off_the_dispatcher() -> (
    None
):
    backend = LingeringBackend(role="decode")
    decode = decode_worker(
        backend, 8, inline_read_bytes=INLINE_READ_BYTES, consumer={"max_read_retries": 0}
    )
    first = prefill_worker(RecordingBackend(role="prefill"), 8)
    other = prefill_worker(RecordingBackend(role="prefill"), 8)
    with closing(first, other, decode):
        try:
            start_request(first, decode, "r1", [0, 1], [0, 1])
            assert wait_for(lambda: decode.metrics.inline_reads == 1)
            # The failed read is not reported while its engine call runs (its blocks stay
            # held), and the dispatcher is free: another peer's handshake is answered.
            sent = decode.control_stats.frames_out
            start_request(other, decode, "r2", [2], [2])
            assert wait_for(lambda: decode.stats.handshakes == 2)
            assert wait_for(lambda: decode.control_stats.frames_out > sent)
            assert "r1" not in decode.outcomes()
            assert decode.in_flight_reads()
            assert wait_for(lambda: decode.metrics.reads_outlived == 1)  # the read worker waits
        finally:
            backend.ended.set()
        outcome = decode.wait_finished("r1", 10.0)
        assert outcome is not None and not outcome.ok
        assert backend.threads[0].endswith("-dispatch"), backend.threads
        assert decode.metrics.reads_outlived == 1
        assert not decode.errors
