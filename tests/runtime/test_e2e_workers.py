"""The runtime binding itself, in this process on loopback: what the workers add to the
endpoints -- the read worker's lease check before starting a read, a transient read error
retried, a planner or engine that raises without killing a thread, and clean shutdown."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rd2h_protocol.consumer import ConsumerConfig
from rd2h_protocol.errors import ErrorCode, TransferError
from rd2h_protocol.plan import ReadPlan
from rd2h_protocol.producer import DecodeTarget, ProducerConfig
from rd2h_runtime.control import BindError, ControlClosed
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.decode_reads import ReadRecord
from rd2h_runtime.planning import Descriptors, build_descriptors
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.testing.engines import (
    FAST_CONTROL,
    HOST,
    DecodeEngine,
    DecodeSpec,
    HookedBackend,
    PrefillEngine,
    PrefillSpec,
)
from rd2h_runtime.testing.synthetic import (
    BlockAllocator,
    DecodeDestinations,
    PrefillCache,
    PrefillRankDriver,
    RequestSpec,
    SyntheticModel,
)
from rd2h_runtime.transfer import create_backend
from tests.runtime.e2e_harness import (
    assert_clean,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

FLAT = SyntheticModel(num_layers=4)
WAIT_S = 10.0


def rd2h_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rd2h-")]


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    before = set(rd2h_threads())
    yield
    assert wait_until(lambda: not (set(rd2h_threads()) - before), 5.0), rd2h_threads()


def test_a_read_whose_start_by_passed_in_the_queue_is_not_started() -> None:
    # Each read takes 0.3 s; the lease is 0.4 s, so a readiness queued behind a read has
    # less than half of its lease left when the worker gets to it: it must not start.
    # One plan per engine read: the queued readiness must wait behind the slow read.
    decode = DecodeEngine(DecodeSpec(FLAT, read_delay_s=0.3, max_batched_reads=1))
    prefill = PrefillEngine(PrefillSpec(FLAT, lease_ms=400))
    try:
        reqs = [RequestSpec("late", 100)]
        decode.add(reqs)
        prefill.add(reqs, decode.target())
        assert prefill.run(WAIT_S) == []
        [(finished, _)] = prefill.wait(["late"], WAIT_S)["late"]  # type: ignore[misc]
        assert not finished.ok and finished.code == ErrorCode.LEASE_EXPIRED
        [res] = decode.wait(["late"], WAIT_S).values()
        assert res.terminal and not res.ok
        assert decode.state()["metrics"][0]["reads_not_started"] >= 1
        assert decode.release(["late"])
        assert wait_until(lambda: all(prefill.state()["idle"]), WAIT_S)
        assert_clean(decode.state())
        assert_clean(prefill.state())
    finally:
        prefill.close()
        decode.close()


class Pair:
    """One Prefill rank and one Decode rank with hooks on the Decode read path.

    ``max_batched_reads`` 1 (the default here) gives each plan its own engine read, so a
    hook's n-th call is the n-th layer read.
    """

    def __init__(
        self,
        before_read: object = None,
        planner: object = None,
        max_batched_reads: int = 1,
        on_read: Callable[[ReadRecord], None] | None = None,
    ) -> None:
        self.dest = DecodeDestinations(FLAT, 1)
        backend = create_backend("loopback", role="decode")
        if before_read is not None:
            backend = HookedBackend(backend, before_read)  # type: ignore[arg-type]
        self.decode = DecodeWorker(
            ConsumerConfig(d_rank=0, d_tp=1, layers=self.dest.layers(0)),
            backend,
            host=HOST,
            regions=self.dest.regions(0),
            control_options=FAST_CONTROL,
            planner=planner or build_descriptors,  # type: ignore[arg-type]
            max_batched_reads=max_batched_reads,
            on_read=on_read,
        )
        self.cache = PrefillCache(FLAT)
        self.prefill = PrefillWorker(
            ProducerConfig(p_rank=0, p_tp=1, session="", layers=self.cache.layers(), lease_ms=5000),
            create_backend("loopback", role="prefill"),
            regions=self.cache.regions(),
            control_options=FAST_CONTROL,
        )
        self.driver = PrefillRankDriver(self.prefill, self.cache, gate_timeout_s=WAIT_S)
        self.palloc = BlockAllocator(FLAT.num_blocks, 1)
        self.dalloc = BlockAllocator(256, 2)
        self.ids: dict[str, tuple[list[int], list[int]]] = {}

    def run(self, ext: str, tokens: int) -> tuple[bool, ErrorCode | None]:
        main_n, idx_n = FLAT.blocks_for(tokens)
        self.ids[ext] = (self.dalloc.allocate(main_n), self.dalloc.allocate(idx_n))
        self.decode.add_request(ext, *self.ids[ext])
        self.prefill.add_request(ext, DecodeTarget(HOST, self.decode.port, 1))
        self.driver.add(
            RequestSpec(ext, tokens), self.palloc.allocate(main_n), self.palloc.allocate(idx_n)
        )
        self.driver.run_all()
        finished = self.prefill.wait_finished(ext, WAIT_S)
        outcome = self.decode.wait_finished(ext, WAIT_S)
        assert finished is not None and outcome is not None
        assert finished.ok == outcome.ok
        if outcome.ok:
            assert self.dest.verify(ext, *self.ids[ext]) == []
        assert self.decode.release(ext) or self.decode.wait_releasable(ext, WAIT_S)
        return outcome.ok, outcome.code

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


def test_a_transient_read_error_is_retried_once() -> None:
    def flaky(n: int) -> None:
        if n == 2:
            raise TransferError("engine busy", -1, transient=True)

    pair = Pair(before_read=flaky)
    try:
        assert pair.run("flaky", 150) == (True, None)
        assert pair.decode.stats.read_retries == 1
        assert pair.decode.healthy and pair.prefill.healthy
        assert pair.decode.is_idle() and pair.prefill.is_idle()
    finally:
        pair.close()


def test_a_planner_or_engine_that_raises_fails_the_read_not_the_thread() -> None:
    calls = {"plan": 0, "armed": 0}

    def planner(plan: ReadPlan) -> Descriptors:
        calls["plan"] += 1
        if calls["plan"] == 2:
            raise ValueError("planner bug")
        return build_descriptors(plan)

    def engine(n: int) -> None:
        if calls["armed"]:
            calls["armed"] = 0
            raise RuntimeError("engine bug")

    pair = Pair(before_read=engine, planner=planner)
    try:
        ok, code = pair.run("planner-bug", 150)
        assert not ok and code == ErrorCode.TRANSFER_FAILED
        calls["armed"] = 1
        ok, code = pair.run("engine-bug", 150)
        assert not ok and code == ErrorCode.TRANSFER_FAILED
        # Both threads survived: the next request goes through, byte for byte.
        assert pair.run("after", 150) == (True, None)
        assert pair.decode.healthy and pair.decode.errors == []
        assert pair.decode.metrics.read_failures == 2
        assert pair.decode.is_idle() and pair.prefill.is_idle()
    finally:
        pair.close()


def test_a_plan_whose_descriptors_miss_bytes_fails_instead_of_succeeding_empty() -> None:
    # A planner bug that drops descriptors (all of them, or one) must fail the read loudly:
    # a read that moved less than its plan owns is never reported done.
    def planner(plan: ReadPlan) -> Descriptors:
        full = build_descriptors(plan)
        ext = plan.requests[0].ext_req_id
        keep = {"none-moved": 0, "one-short": len(full) - 1}.get(ext, len(full))
        return dataclasses.replace(
            full,
            remote_addrs=full.remote_addrs[:keep],
            local_addrs=full.local_addrs[:keep],
            lengths=full.lengths[:keep],
        )

    pair = Pair(planner=planner)
    try:
        assert pair.run("none-moved", 150) == (False, ErrorCode.TRANSFER_FAILED)
        assert pair.run("one-short", 150) == (False, ErrorCode.TRANSFER_FAILED)
        assert pair.run("after", 150) == (True, None)
        assert pair.decode.metrics.read_failures >= 2 and pair.decode.healthy
    finally:
        pair.close()


def test_close_joins_every_thread_and_refuses_later_calls() -> None:
    pair = Pair()
    assert pair.run("one", 60) == (True, None)
    # A compute path blocked on a busy gate is released by close().
    pair.prefill.add_request("blocked", DecodeTarget(HOST, pair.decode.port, 1))
    pair.decode.add_request("blocked", [1], [1])
    released: list[bool] = []
    pair.prefill.schedule_chunk("blocked", [0], [0], 0, 0, False)
    pair.decode.close()  # nobody will answer: the gate stays closed
    pair.prefill.layer_written(0)
    waiter = threading.Thread(target=lambda: released.append(pair.prefill.wait_writable(0, 30)))
    waiter.start()
    time.sleep(0.1)
    pair.prefill.close()
    waiter.join(5)
    assert released == [False]
    pair.close()  # idempotent
    with pytest.raises(ControlClosed):
        pair.prefill.layer_written(1)
    with pytest.raises(ControlClosed):
        pair.decode.add_request("late", [2], [2])
    assert pair.prefill.backend.closed and pair.decode.backend.closed


def test_decode_restarted_on_the_same_port_is_served_after_a_fresh_handshake() -> None:
    pair = Pair()
    try:
        assert pair.run("before", 120) == (True, None)
        port = pair.decode.port
        pair.decode.close()
        # A new Decode process would bind the same rank port again; its endpoint knows no
        # Prefill session.
        for _ in range(50):
            try:
                pair.decode = DecodeWorker(
                    ConsumerConfig(d_rank=0, d_tp=1, layers=pair.dest.layers(0)),
                    create_backend("loopback", role="decode"),
                    host=HOST,
                    port=port,
                    regions=pair.dest.regions(0),
                    control_options=FAST_CONTROL,
                )
                break
            except BindError:
                time.sleep(0.05)
        assert pair.run("after", 120) == (True, None)
        stats = pair.prefill.stats
        assert stats.handshakes == 2, stats
        assert pair.decode.is_idle() and pair.prefill.is_idle()
        assert pair.prefill.healthy and pair.decode.healthy
    finally:
        pair.close()


def test_layers_queued_behind_a_slow_read_are_read_in_one_engine_call() -> None:
    # The first engine read is held until every layer's readiness is queued (it may have
    # taken several already): the rest then goes in ONE more engine call at most, and every
    # byte still lands right.
    release = threading.Event()
    calls: list[int] = []

    def hold_first(n: int) -> None:
        calls.append(n)
        if n == 1:
            release.wait(WAIT_S)

    records: list[ReadRecord] = []
    pair = Pair(before_read=hold_first, max_batched_reads=64, on_read=records.append)
    layers = len(pair.cache.layers())
    threading.Timer(0.3, release.set).start()
    try:
        assert pair.run("batched", 150) == (True, None)
        assert calls in ([1], [1, 2]), f"{layers} layers read in {len(calls)} engine calls"
        assert pair.decode.metrics.batched_reads >= 1
        assert pair.decode.metrics.reads == layers  # each plan counted as read
        # Each plan's record holds its byte share of its engine read's time: summed, the
        # engine's time (bytes over seconds is the rate while reading, not a fraction).
        assert len(records) == layers
        assert sum(r.nbytes for r in records) == pair.decode.metrics.read_bytes
        assert sum(r.seconds for r in records) == pytest.approx(
            pair.decode.metrics.read_s, rel=0.05
        )
        assert pair.decode.is_idle() and pair.prefill.is_idle()
    finally:
        release.set()
        pair.close()


def test_a_transient_error_of_a_batched_read_retries_each_of_its_plans_once() -> None:
    release = threading.Event()

    def fail_first(n: int) -> None:
        if n == 1:  # held until every readiness is queued, then failed
            release.wait(WAIT_S)
            raise TransferError("engine busy", -1, transient=True)

    pair = Pair(before_read=fail_first, max_batched_reads=64)
    layers = len(pair.cache.layers())
    threading.Timer(0.3, release.set).start()
    try:
        assert pair.run("flaky-batch", 150) == (True, None)
        # Each plan of the failed engine read was retried once, and read once in the end.
        retried = pair.decode.stats.read_retries
        assert 1 <= retried <= layers
        assert pair.decode.metrics.read_failures == retried
        assert pair.decode.metrics.reads == layers
        assert pair.decode.is_idle() and pair.prefill.is_idle()
    finally:
        release.set()
        pair.close()
