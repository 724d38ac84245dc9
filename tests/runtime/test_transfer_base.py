"""The backend-independent parts: region bookkeeping, input checks, factory, deadline runner."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h_protocol.errors import ConfigError, MissingExtra, TransferError
from rd2h_runtime.transfer import RegionSet, create_backend, merge_regions, nixl_backend
from rd2h_runtime.transfer.base import BACKENDS, BlockingCallRunner, as_u64, normalise_role

TOP = 1 << 64


def test_merge_regions_sorts_merges_touching_and_overlapping_and_drops_empty() -> None:
    regions = [(300, 50), (100, 100), (200, 10), (0, 0), (205, 20), (500, 1)]
    assert merge_regions(regions) == [(100, 125), (300, 50), (500, 1)]


def test_merge_regions_keeps_a_contained_region_inside() -> None:
    assert merge_regions([(0, 100), (10, 5)]) == [(0, 100)]


@pytest.mark.parametrize("region", [(-1, 10), (10, -1), (TOP - 4, 5)])
def test_merge_regions_refuses_impossible_regions(region: tuple[int, int]) -> None:
    with pytest.raises(ConfigError, match="memory region"):
        merge_regions([region])


def test_region_set_first_outside() -> None:
    regions = RegionSet([(1000, 100), (2000, 100)])
    addrs = np.array([1000, 1099, 2050, 1050, 999, 1100, 2099], dtype=np.uint64)
    lens = np.array([100, 1, 50, 51, 1, 1, 2], dtype=np.uint64)
    # ranges 0-2 fit, 3 runs past its region, 4 starts before the first, 5 sits in the gap
    assert regions.first_outside(addrs[:3], lens[:3]) == -1
    for i in range(3, 7):
        assert regions.first_outside(addrs[[0, i]], lens[[0, i]]) == 1


def test_region_set_handles_the_top_of_the_address_space() -> None:
    regions = RegionSet([(TOP - 4096, 4096)])
    assert regions.regions == [(TOP - 4096, 4096)]
    inside = np.array([TOP - 4096], dtype=np.uint64), np.array([4096], dtype=np.uint64)
    assert regions.first_outside(*inside) == -1
    # a length that would wrap around 2**64 is outside, not "small"
    wrap = np.array([TOP - 10], dtype=np.uint64), np.array([4096], dtype=np.uint64)
    assert regions.first_outside(*wrap) == 0


def test_region_set_empty_and_add() -> None:
    regions = RegionSet()
    one = np.array([5], np.uint64), np.array([1], np.uint64)
    assert len(regions) == 0 and regions.first_outside(*one) == 0
    regions.add([(0, 5)])
    regions.add([(5, 5)])
    assert regions.regions == [(0, 10)] and regions.first_outside(*one) == -1


def _first_outside_reference(
    regions: list[tuple[int, int]], addrs: list[int], lens: list[int]
) -> int:
    for i, (a, n) in enumerate(zip(addrs, lens, strict=True)):
        if not any(start <= a and a + n <= start + size for start, size in regions):
            return i
    return -1


def test_region_set_first_outside_over_many_chunks() -> None:
    """Stretches in one region pass as a whole; a chunk mixing regions is checked range by
    range; the first bad range is found wherever it sits."""
    regions = RegionSet([(1 << 20, 1 << 20), (1 << 30, 1 << 20)])
    n = 5000
    rng = np.random.default_rng(0)
    addrs = (1 << 20) + rng.integers(0, (1 << 20) - 64, n).astype(np.uint64)
    addrs[2500:] += np.uint64((1 << 30) - (1 << 20))  # second half: the other region
    addrs[1500:1600:2] += np.uint64((1 << 30) - (1 << 20))  # a chunk alternating regions
    lens = np.full(n, 64, dtype=np.uint64)
    assert regions.first_outside(addrs, lens) == -1
    for bad in (0, 1023, 1024, 1551, 4999):
        broken = lens.copy()
        broken[bad] = 1 << 21  # runs past its region
        assert regions.first_outside(addrs, broken) == bad


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1 << 14), st.integers(1, 1 << 12)), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(0, 1 << 15), st.integers(1, 1 << 10)), min_size=1, max_size=40),
    st.integers(1, 3000),
    st.randoms(use_true_random=False),
)
def test_region_set_first_outside_matches_a_plain_loop(
    regions: list[tuple[int, int]], pool: list[tuple[int, int]], n: int, rnd: Any
) -> None:
    """Against the definition, with batches long enough to span several chunks."""

    def inside() -> tuple[int, int]:
        a, size = rnd.choice(regions)
        off = rnd.randrange(size)
        return a + off, rnd.randint(1, size - off)

    # Mostly ranges inside a region, a few from anywhere (inside or not).
    picked = [inside() if rnd.random() < 0.995 else rnd.choice(pool) for _ in range(n)]
    addrs, lens = [a for a, _ in picked], [ln for _, ln in picked]
    got = RegionSet(regions).first_outside(
        np.array(addrs, dtype=np.uint64), np.array(lens, dtype=np.uint64)
    )
    assert got == _first_outside_reference(merge_regions(regions), addrs, lens)


def test_as_u64_accepts_lists_and_arrays_and_refuses_the_rest() -> None:
    arr = np.arange(4, dtype=np.uint64)
    assert as_u64(arr, "x") is arr
    assert as_u64([1, TOP - 1], "x").tolist() == [1, TOP - 1]
    assert as_u64(np.arange(3, dtype=np.int32), "x").dtype == np.uint64
    for bad in ([-1], [TOP], [1.5], ["a"], np.array([-1]), np.zeros((2, 2), np.uint64)):
        with pytest.raises(TransferError):
            as_u64(bad, "x")  # type: ignore[arg-type]


def test_roles_are_normalised() -> None:
    assert normalise_role("Prefill") == "prefill" and normalise_role(" decode ") == "decode"
    with pytest.raises(ConfigError, match="role must be one of prefill, decode"):
        normalise_role("producer")


def test_unknown_backend_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="loopback, memfabric, mooncake, nixl"):
        create_backend("rdma-magic", role="decode")


def test_unknown_option_lists_the_accepted_ones() -> None:
    with pytest.raises(ConfigError, match="accepted: protocol, device_name, max_batch_slices"):
        create_backend("mooncake", role="decode", prtocol="tcp")


@pytest.mark.parametrize("name", ["nixl", "mooncake", "memfabric"])
def test_missing_engine_package_names_the_extra(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine_module = BACKENDS[name][3]
    assert engine_module is not None
    # None in sys.modules makes the import fail exactly as if the package were absent.
    for mod in list(sys.modules):
        if mod == engine_module or mod.startswith(engine_module + "."):
            monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, engine_module, None)
    if name == "nixl":
        # The NIXL build an earlier test chose (nixl_cu12, ...) is remembered per process;
        # forget it, so the choice is made again, as in a process without NIXL.
        monkeypatch.setattr(nixl_backend, "_package", None)
    with pytest.raises(MissingExtra, match=rf"pip install 'rd2h\[{name}\]'") as info:
        create_backend(name, role="decode")
    assert info.value.extra == name


def test_importing_the_runtime_loads_no_engine() -> None:
    code = (
        "import sys, rd2h_runtime, rd2h_runtime.transfer, rd2h_runtime.testing.check_read\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in "
        "('nixl', 'nixl_cu12', 'nixl_cu13', 'mooncake', 'memfabric_hybrid', 'zmq')]\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_runner_returns_results_and_raises_errors() -> None:
    runner = BlockingCallRunner("test")
    assert runner.run(lambda: 42, time.monotonic() + 5, "answer") == 42

    def boom() -> None:
        raise TransferError("engine said no", -7)

    with pytest.raises(TransferError, match="engine said no") as info:
        runner.run(boom, time.monotonic() + 5, "boom")
    assert info.value.backend_code == -7 and not runner.busy


def test_runner_stops_waiting_at_the_deadline_and_refuses_overlap() -> None:
    runner = BlockingCallRunner("test")
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="timed out") as info:
        runner.run(lambda: release.wait(10), time.monotonic() + 0.05, "slow")
    assert time.monotonic() - t0 < 1.0
    assert not info.value.transient  # the call may still write: not safe to retry yet
    assert runner.busy and not runner.wait_idle(0.01)
    with pytest.raises(TransferError, match="still running") as busy:
        runner.run(lambda: 1, time.monotonic() + 5, "next")
    assert busy.value.transient
    release.set()
    assert runner.wait_idle(5)
    assert runner.run(lambda: 2, time.monotonic() + 5, "after") == 2


def test_mooncake_without_its_system_libraries_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class BrokenEngine:
        """Import hook that fails like a missing libibverbs.so.1 does."""

        def find_spec(self, name: str, *args: object) -> None:
            if name == "mooncake.engine":
                raise ImportError("libibverbs.so.1: cannot open shared object file")
            return None

    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenEngine(), *sys.meta_path])
    with pytest.raises(ConfigError, match="apt-get install libibverbs1 librdmacm1"):
        create_backend("mooncake", role="decode")


def _runner_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"rd2h-{name}-call"]


def test_runner_keeps_one_worker_thread_across_calls_and_after_a_timeout() -> None:
    runner = BlockingCallRunner("reuse")
    idents = {runner.run(threading.get_ident, time.monotonic() + 5, "who") for _ in range(20)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    assert len(_runner_threads("reuse")) == 1
    release = threading.Event()
    with pytest.raises(TransferError, match="timed out"):
        runner.run(lambda: release.wait(10), time.monotonic() + 0.05, "slow")
    with pytest.raises(TransferError, match="still running"):
        runner.run(threading.get_ident, time.monotonic() + 5, "refused")
    release.set()
    assert runner.wait_idle(5)
    assert runner.run(threading.get_ident, time.monotonic() + 5, "after") in idents
    runner.close()
    runner.close()  # idempotent
    deadline = time.monotonic() + 5
    while _runner_threads("reuse") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _runner_threads("reuse")
    # a call after close starts a new worker
    assert runner.run(lambda: 3, time.monotonic() + 5, "again") == 3
    runner.close()


def test_runner_close_waits_for_the_running_call_and_a_dropped_runner_stops() -> None:
    runner = BlockingCallRunner("drop")
    release = threading.Event()
    with pytest.raises(TransferError, match="timed out"):
        runner.run(lambda: release.wait(10), time.monotonic() + 0.05, "slow")
    runner.close()
    (worker,) = _runner_threads("drop")
    assert runner.busy and worker.is_alive()  # the call still runs: the worker stays
    release.set()
    worker.join(5)
    assert not worker.is_alive() and runner.wait_idle(0)
    runner2 = BlockingCallRunner("drop2")
    runner2.run(lambda: None, time.monotonic() + 5, "one")
    (worker2,) = _runner_threads("drop2")
    del runner2
    gc.collect()
    worker2.join(5)
    assert not worker2.is_alive()
