"""Vectorised read planning against a plain per-request oracle.

The oracle below is the reference rule written the obvious way (loop over components,
requests and blocks; merge while remote AND local addresses are both contiguous), in the
same component-major order as :mod:`rd2h_runtime.planning`. The vectorised planner must
match it exactly: same descriptors, same order.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rd2h_protocol.errors import LocalProtocolError
from rd2h_protocol.plan import ComponentAddrs, ReadPlan, RequestRead
from rd2h_runtime.planning import (
    BlockIds,
    Descriptors,
    build_descriptors,
    descriptors_from_ids,
    gather_ids,
)

Triple = tuple[int, int, int]


def ids(values: Sequence[Any], dtype: Any = np.int64) -> Sequence[int]:
    """A numpy id array typed as RequestRead's field type (build_descriptors takes both)."""
    return cast("Sequence[int]", np.asarray(values, dtype=dtype))


def oracle(plan: ReadPlan) -> tuple[list[Triple], list[tuple[str, int]]]:
    """Descriptors of ``plan`` computed block by block with Python ints."""
    out: list[Triple] = []
    counts: list[tuple[str, int]] = []
    for comps, group in ((plan.main, "main"), (plan.indexer, "indexer")):
        for comp in comps:
            before = len(out)
            for req in plan.requests:
                src: Sequence[int] = getattr(req, f"{group}_src")
                dst: Sequence[int] = getattr(req, f"{group}_dst")
                run: list[int] | None = None  # [remote, local, length] of the open run
                for pid, did in zip(src, dst, strict=True):
                    remote = comp.src_base + int(pid) * comp.block_bytes
                    local = comp.dst_base + int(did) * comp.block_bytes
                    if run is not None and remote == run[0] + run[2] and local == run[1] + run[2]:
                        run[2] += comp.block_bytes
                        continue
                    if run is not None:
                        out.append((run[0], run[1], run[2]))
                    run = [remote, local, comp.block_bytes]
                if run is not None:
                    out.append((run[0], run[1], run[2]))
            counts.append((comp.name, len(out) - before))
    return out, counts


def triples(d: Descriptors) -> list[Triple]:
    return [
        (int(r), int(loc), int(n))
        for r, loc, n in zip(d.remote_addrs, d.local_addrs, d.lengths, strict=True)
    ]


def assert_matches_oracle(plan: ReadPlan) -> Descriptors:
    d = build_descriptors(plan)
    expected, counts = oracle(plan)
    for arr in (d.remote_addrs, d.local_addrs, d.lengths):
        assert arr.dtype == np.uint64
        assert not arr.flags.writeable
        with pytest.raises(ValueError):  # not even on purpose: their block is read-only
            arr.flags.writeable = True
    assert triples(d) == expected
    assert list(d.component_counts) == counts
    assert len(d) == len(expected)
    assert d.total_bytes == sum(t[2] for t in expected) == plan.total_bytes
    return d


K = ComponentAddrs("k", src_base=0x1000_0000, dst_base=0x9000_0000, block_bytes=1024)
V = ComponentAddrs("v", src_base=0x2000_0000, dst_base=0xA000_0000, block_bytes=128)
IDX = ComponentAddrs("indexer", src_base=0x3000_0000, dst_base=0xB000_0000, block_bytes=128)
SCALE = ComponentAddrs("scale", src_base=0x4000_0000, dst_base=0xC000_0000, block_bytes=4)


def make_plan(
    requests: Sequence[RequestRead],
    main: tuple[ComponentAddrs, ...] = (K, V),
    indexer: tuple[ComponentAddrs, ...] = (IDX, SCALE),
) -> ReadPlan:
    return ReadPlan(
        read_id=1,
        session="s",
        layer_name="model.layers.0.attn",
        main=main,
        indexer=indexer,
        requests=tuple(requests),
    )


def req(
    main_src: Sequence[int],
    main_dst: Sequence[int],
    idx_src: Sequence[int] = (),
    idx_dst: Sequence[int] = (),
    name: str = "r",
) -> RequestRead:
    return RequestRead(name, main_src, main_dst, idx_src, idx_dst)


# --- named cases -------------------------------------------------------------------------


def test_contiguous_run_merges_to_one_descriptor_per_component() -> None:
    d = assert_matches_oracle(make_plan([req(range(5, 13), range(40, 48), [3, 4], [7, 8])]))
    assert [c for _, c in d.component_counts] == [1, 1, 1, 1]
    assert triples(d)[0] == (K.src_base + 5 * 1024, K.dst_base + 40 * 1024, 8 * 1024)
    assert triples(d)[1] == (V.src_base + 5 * 128, V.dst_base + 40 * 128, 8 * 128)
    assert triples(d)[3] == (SCALE.src_base + 3 * 4, SCALE.dst_base + 7 * 4, 2 * 4)


def test_break_when_only_src_is_contiguous() -> None:
    d = assert_matches_oracle(make_plan([req([1, 2, 3], [10, 12, 13])], indexer=()))
    k = d.component_slice("k")
    assert d.lengths[k].tolist() == [1024, 2048]


def test_break_when_only_dst_is_contiguous() -> None:
    d = assert_matches_oracle(make_plan([req([1, 5, 6], [10, 11, 12])], indexer=()))
    assert d.lengths[d.component_slice("v")].tolist() == [128, 256]


def test_no_merge_across_requests() -> None:
    # The second request continues both sides exactly, yet it is its own descriptor.
    d = assert_matches_oracle(
        make_plan([req([1, 2], [10, 11], name="a"), req([3, 4], [12, 13], name="b")])
    )
    assert d.lengths[d.component_slice("k")].tolist() == [2048, 2048]


def test_no_merge_across_components() -> None:
    # V starts exactly where K's run ends on both sides; it still is a separate descriptor.
    k = ComponentAddrs("k", src_base=0, dst_base=1 << 40, block_bytes=64)
    v = ComponentAddrs("v", src_base=4 * 64, dst_base=(1 << 40) + 4 * 64, block_bytes=64)
    d = assert_matches_oracle(make_plan([req(range(4), range(4))], main=(k, v), indexer=()))
    assert triples(d) == [(0, 1 << 40, 256), (256, (1 << 40) + 256, 256)]


def test_no_merge_across_id_groups() -> None:
    # The indexer ids continue the main ids on both sides (the planner searches runs over
    # both groups at once): each group still starts its own runs.
    d = assert_matches_oracle(make_plan([req([1, 2], [5, 6], [3, 4], [7, 8])]))
    assert [c for _, c in d.component_counts] == [1, 1, 1, 1]
    assert d.lengths.tolist() == [2048, 256, 256, 8]


def test_empty_plan_and_empty_requests() -> None:
    d = assert_matches_oracle(make_plan([]))
    assert len(d) == 0 and d.total_bytes == 0
    assert d.component_counts == (("k", 0), ("v", 0), ("indexer", 0), ("scale", 0))
    d = assert_matches_oracle(
        make_plan([req([], []), req([4], [9], [], []), req([], [], [1], [2]), req([], [])])
    )
    assert [c for _, c in d.component_counts] == [1, 1, 1, 1]


def test_no_main_components_member_reads_indexer_only() -> None:
    d = assert_matches_oracle(make_plan([req([], [], [0, 1, 2], [5, 6, 9])], main=()))
    assert d.component_counts == (("indexer", 2), ("scale", 2))


def test_component_slice() -> None:
    d = build_descriptors(make_plan([req([1, 3], [1, 3], [2], [2])]))
    assert d.component_slice("k") == slice(0, 2)
    assert d.component_slice("scale") == slice(5, 6)
    with pytest.raises(KeyError):
        d.component_slice("nope")


def test_numpy_ids_take_the_same_path_result() -> None:
    lists = [req([1, 2, 7], [0, 1, 2], [4], [4]), req([], [], [5, 6], [8, 9])]
    dtypes = (np.int64, np.int32, np.uint64, np.int16)
    arrays = [
        RequestRead(
            r.ext_req_id,
            *(
                ids(seq, dt)
                for seq, dt in zip(
                    (r.main_src, r.main_dst, r.indexer_src, r.indexer_dst), dtypes, strict=True
                )
            ),
        )
        for r in lists
    ]
    a = build_descriptors(make_plan(lists))
    b = build_descriptors(make_plan(arrays))
    assert triples(a) == triples(b)
    assert a.component_counts == b.component_counts


def test_uint64_arrays_within_int64_are_accepted() -> None:
    assert_matches_oracle(make_plan([req(ids([5, 6], np.uint64), ids([1, 2], np.uint64))]))


def test_mixed_lists_and_arrays_in_one_group() -> None:
    plan = make_plan(
        [
            req([1, 2], ids([10, 11], np.uint16), ids([4], np.int32), [6]),
            req(range(3, 5), (12, 13), [], ids([], np.int64)),
            req([20, 22, 23], range(30, 36, 2), range(8, 8), range(0)),
            req(ids([9]), [0], [5], ids([7], np.uint64)),
        ]
    )
    assert_matches_oracle(plan)


def test_results_survive_later_plans_and_other_threads() -> None:
    """Work buffers are reused between calls; results must never be views of them."""
    rng = np.random.default_rng(7)

    def random_plan(n: int) -> ReadPlan:
        def some_ids() -> list[int]:
            return [int(x) for x in rng.integers(0, 1000, size=n)]

        reqs = [RequestRead(str(i), *(some_ids() for _ in range(4))) for i in range(4)]
        return make_plan(reqs)

    first = random_plan(50)
    kept = build_descriptors(first)
    expected = oracle(first)[0]
    build_descriptors(random_plan(40))  # a smaller plan reuses the buffers, ...
    build_descriptors(random_plan(900))  # ... a bigger one grows them
    assert triples(kept) == expected

    plans = [random_plan(n) for n in (30, 60, 90, 120)]
    results: dict[int, list[Triple]] = {}

    def work(i: int) -> None:
        for _ in range(20):
            results[i] = triples(build_descriptors(plans[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(results[i] == oracle(p)[0] for i, p in enumerate(plans))


def test_big_bases_near_the_top_of_the_address_space() -> None:
    top = (1 << 64) - 4 * 1024
    k = ComponentAddrs("k", src_base=top, dst_base=1 << 63, block_bytes=1024)
    d = assert_matches_oracle(make_plan([req([0, 1, 2, 3], [0, 1, 2, 3])], main=(k,), indexer=()))
    assert triples(d) == [(top, 1 << 63, 4096)]


def test_address_past_64_bits_is_refused() -> None:
    top = (1 << 64) - 4 * 1024
    k = ComponentAddrs("k", src_base=top, dst_base=0, block_bytes=1024)
    with pytest.raises(LocalProtocolError, match="64-bit"):
        build_descriptors(make_plan([req([4], [0])], main=(k,), indexer=()))
    big = ComponentAddrs("k", src_base=1 << 64, dst_base=0, block_bytes=1)
    with pytest.raises(LocalProtocolError, match="uint64"):
        build_descriptors(make_plan([], main=(big,), indexer=()))


@pytest.mark.parametrize("bad", [0, -8])
def test_non_positive_block_bytes_is_refused(bad: int) -> None:
    k = ComponentAddrs("k", src_base=0, dst_base=0, block_bytes=bad)
    with pytest.raises(LocalProtocolError, match="block_bytes"):
        build_descriptors(make_plan([req([1], [1])], main=(k,), indexer=()))


@pytest.mark.parametrize(
    "request_",
    [
        req([1, 2], [1]),  # unequal lengths
        req([-1], [1]),  # negative id
        req([1], [1 << 70]),  # not an int64
        req([1], range(1 << 63, (1 << 63) + 1)),  # a range past int64
        req([1.5], [1]),  # type: ignore[list-item]  # not an integer
        req([], [], [1], ids([1.0], np.float64)),  # float array
        req(ids([1 << 63], np.uint64), ids([0])),  # uint64 array past int64
        req(ids([[1]]), ids([[0]])),  # not 1-d
    ],
)
def test_bad_ids_are_refused(request_: RequestRead) -> None:
    with pytest.raises(LocalProtocolError):
        build_descriptors(make_plan([request_]))


def test_block_ids_checks_its_shape() -> None:
    i64 = np.array([0, 1], dtype=np.int64)
    with pytest.raises(LocalProtocolError):
        BlockIds(i64, i64[:1], np.array([2], dtype=np.int64))
    with pytest.raises(LocalProtocolError):
        BlockIds(i64, i64, np.array([3], dtype=np.int64))
    with pytest.raises(ValueError, match="group"):
        gather_ids([], "scale")


def test_descriptors_from_ids_matches_build_descriptors() -> None:
    plan = make_plan([req([3, 4, 9], [0, 1, 2], [1], [1]), req([10], [3])])
    direct = descriptors_from_ids(
        plan.main,
        BlockIds(
            np.array([3, 4, 9, 10], dtype=np.int64),
            np.array([0, 1, 2, 3], dtype=np.int64),
            np.array([3, 1], dtype=np.int64),
        ),
        plan.indexer,
        BlockIds(
            np.array([1], dtype=np.int64),
            np.array([1], dtype=np.int64),
            np.array([1, 0], dtype=np.int64),
        ),
    )
    assert triples(direct) == triples(build_descriptors(plan))


# --- random plans ------------------------------------------------------------------------

_BLOCK_BYTES = st.sampled_from([1, 4, 64, 128, 1024, 4096, 65536, 3 * 4096 + 8])
_IDS = 4096  # ids are drawn below this ...
_ID_LIMIT = 2 * _IDS  # ... and a request continuing the previous one stays below this
# Bases anywhere that still leaves room for _ID_LIMIT blocks of the largest size, often
# near 2**63, sometimes at the very top.
_TOP_BASE = (1 << 64) - _ID_LIMIT * 65536
_BASE = st.one_of(
    st.integers(0, _TOP_BASE),
    st.integers((1 << 63) - (1 << 32), (1 << 63) + (1 << 32)),
    st.just(_TOP_BASE),
)


@st.composite
def id_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Paired ids: fully random, fully contiguous, or contiguous stretches with jumps."""
    n = draw(st.integers(0, 40))
    style = draw(st.sampled_from(["random", "contiguous", "runs", "src_only", "dst_only"]))
    any_id = st.integers(0, _IDS - 1)
    if style == "random":
        return (
            draw(st.lists(any_id, min_size=n, max_size=n)),
            draw(st.lists(any_id, min_size=n, max_size=n)),
        )
    s0 = draw(st.integers(0, _IDS - n))
    d0 = draw(st.integers(0, _IDS - n))
    src, dst = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    if style == "contiguous" or n == 0:
        return src, dst
    # Move some positions: on both sides ("runs"), or keep one side contiguous
    # ("src_only": src stays +1, dst jumps; "dst_only" the other way round).
    for i in draw(st.lists(st.integers(0, n - 1), max_size=6)):
        if style in ("runs", "src_only"):
            dst[i] = draw(any_id)
        if style in ("runs", "dst_only"):
            src[i] = draw(any_id)
    return src, dst


def continue_from(
    prev: tuple[list[int], list[int]] | None, pair: tuple[list[int], list[int]]
) -> tuple[list[int], list[int]]:
    """Shift ``pair`` so it starts right after ``prev`` ends, on both sides, if it fits.

    Such requests are contiguous across the request boundary: the planner must still cut.
    """
    if prev is None or not prev[0] or not pair[0]:
        return pair
    out = []
    for before, now in zip(prev, pair, strict=True):
        shift = before[-1] + 1 - now[0]
        out.append([x + shift for x in now])
    if min(min(out[0]), min(out[1])) < 0 or max(max(out[0]), max(out[1])) >= _ID_LIMIT:
        return pair
    return out[0], out[1]


def forms(seq: Sequence[int]) -> list[Sequence[int]]:
    """The same ids as list, tuple, int32 array, and range when they are contiguous."""
    values = list(seq)
    out: list[Sequence[int]] = [values, tuple(values), ids(values, np.int32)]
    if values == list(range(values[0] if values else 0, (values[-1] + 1) if values else 0)):
        out.append(range(values[0], values[-1] + 1) if values else range(0))
    return out


@st.composite
def components(draw: st.DrawFn, names: Sequence[str]) -> tuple[ComponentAddrs, ...]:
    return tuple(ComponentAddrs(n, draw(_BASE), draw(_BASE), draw(_BLOCK_BYTES)) for n in names)


@st.composite
def plans(draw: st.DrawFn) -> ReadPlan:
    main = draw(components(draw(st.sampled_from([(), ("k", "v")]))))
    indexer = draw(components(draw(st.sampled_from([(), ("indexer",), ("indexer", "scale")]))))
    as_numpy = draw(st.booleans())
    requests = []
    prev_main: tuple[list[int], list[int]] | None = None
    prev_idx: tuple[list[int], list[int]] | None = None
    for i in range(draw(st.integers(0, 8))):
        m, x = draw(id_pairs()), draw(id_pairs())
        if draw(st.booleans()):
            m, x = continue_from(prev_main, m), continue_from(prev_idx, x)
        prev_main, prev_idx = m, x
        seqs: list[Sequence[int]] = [*m, *x]
        if as_numpy:  # the all-numpy fast path
            seqs = [ids(s) for s in seqs]
        elif draw(st.booleans()):  # every input form build_descriptors takes, mixed
            seqs = [draw(st.sampled_from(forms(s))) for s in seqs]
        if draw(st.booleans()):  # one object serving main and indexer (packed once)
            seqs[2:] = seqs[:2]
        requests.append(RequestRead(f"req-{i}", *seqs))
    return make_plan(requests, main=main, indexer=indexer)


@given(plans())
def test_vectorised_equals_oracle(plan: ReadPlan) -> None:
    assert_matches_oracle(plan)


def test_benchmark_runs_and_agrees_with_its_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark script checks vectorised == baseline itself; run it tiny."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_planning.py"
    spec = importlib.util.spec_from_file_location("bench_planning", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--requests", "3", "--blocks", "5", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out
    assert out.count("x\n") == 9  # 3 shapes x 3 input forms, each row ending with its ratio


# --- planning the same ids again -----------------------------------------------------------


def _moved(plan: ReadPlan, div: int) -> ReadPlan:
    """The same requests (the same id objects) read for other components: another layer.
    (Lower bases, so every address still fits in 64 bits.)"""

    def move(comps: tuple[ComponentAddrs, ...]) -> tuple[ComponentAddrs, ...]:
        return tuple(
            ComponentAddrs(c.name, c.src_base // div, c.dst_base // (div + 1), c.block_bytes)
            for c in comps
        )

    return make_plan(plan.requests, main=move(plan.main), indexer=move(plan.indexer))


@given(plans())
def test_the_same_ids_planned_again_for_another_layer_match_the_oracle(plan: ReadPlan) -> None:
    assert_matches_oracle(plan)
    assert_matches_oracle(_moved(plan, 2))
    assert_matches_oracle(plan)


def test_ids_of_mutable_sequences_are_read_afresh() -> None:
    """Tuples and ranges may be planned from kept runs; a list changed between two reads
    is planned anew."""
    main_src, idx_src = [1, 2, 3], (7, 8)
    plan = make_plan([req(main_src, range(10, 13), idx_src, (20, 21))])
    assert_matches_oracle(plan)
    main_src[1] = 9
    d = assert_matches_oracle(plan)
    assert len(d) == 2 * 3 + 2 * 1
    kept = make_plan([req((1, 2, 3), range(10, 13), idx_src, (20, 21))])
    assert len(assert_matches_oracle(kept)) == 2 * 1 + 2 * 1
    assert len(assert_matches_oracle(_moved(kept, 3))) == 2 * 1 + 2 * 1


def test_layers_of_one_size_set_share_the_kept_lengths_with_fresh_addresses() -> None:
    """Another layer over the same ids and block sizes gets the same (read-only) lengths,
    their sum known, and address arrays of its own."""
    plan = make_plan([req((1, 2, 5), (7, 8, 9), (3,), (4,))])
    first, second = assert_matches_oracle(plan), assert_matches_oracle(_moved(plan, 2))
    assert np.shares_memory(first.lengths, second.lengths)
    for a, b in (
        (first.remote_addrs, second.remote_addrs),
        (first.local_addrs, second.local_addrs),
    ):
        assert not np.shares_memory(a, b)
    assert second.total_bytes == first.total_bytes == plan.total_bytes


def test_many_id_sets_in_turn_match_the_oracle() -> None:
    """More id sets than a thread keeps, interleaved like several Prefill peers."""
    rng = np.random.default_rng(3)
    plans = []
    for p in range(12):
        reqs = [
            req(
                tuple(int(x) for x in rng.integers(0, 100, 5)),
                range(10 * r, 10 * r + 5),
                tuple(int(x) for x in rng.integers(0, 100, 3)),
                tuple(int(x) for x in rng.integers(0, 100, 3)),
                name=f"p{p}r{r}",
            )
            for r in range(3)
        ]
        plans.append(make_plan(reqs))
    for round_ in range(3):
        for plan in plans:
            assert_matches_oracle(_moved(plan, round_ + 1) if round_ else plan)


def _resized(plan: ReadPlan, block_bytes: int) -> ReadPlan:
    """The same requests read for components of which every other one has ``block_bytes``
    per block: a layer with other block sizes (bases lowered so every address fits)."""

    def resize(comps: tuple[ComponentAddrs, ...]) -> tuple[ComponentAddrs, ...]:
        return tuple(
            ComponentAddrs(
                c.name, c.src_base // 4, c.dst_base // 4, block_bytes if i % 2 else c.block_bytes
            )
            for i, c in enumerate(comps)
        )

    return make_plan(plan.requests, main=resize(plan.main), indexer=resize(plan.indexer))


@given(plans(), st.lists(_BLOCK_BYTES, min_size=1, max_size=7))
def test_the_same_ids_planned_with_other_block_sizes_match_the_oracle(
    plan: ReadPlan, sizes: list[int]
) -> None:
    """Layers with other block sizes share the runs, not their scaled addresses; more
    size sets than the runs keep, in turn and again."""
    assert_matches_oracle(plan)
    for block_bytes in [*sizes, *reversed(sizes)]:
        assert_matches_oracle(_resized(plan, block_bytes))
    assert_matches_oracle(plan)


@given(st.lists(st.integers(0, (1 << 64) - 1), max_size=6), st.integers(0, 3))
def test_total_bytes_is_exact_even_past_64_bits(lengths: list[int], copies: int) -> None:
    """The sum of the lengths, exact whether or not it fits in 64 bits."""
    values = lengths * copies
    column = np.array(values, dtype=np.uint64)
    d = Descriptors(column, column, column, ())
    assert d.total_bytes == sum(values)


def test_kept_runs_are_bounded_in_bytes() -> None:
    # Issue 24: every thread kept the runs (and the Prefill ids) of its last 8 id sets
    # whatever their size: 8 plans at the wire's limit kept ~0.2 GB. Now a plan that alone
    # passes the byte bound is planned and not kept, and the kept sets stay within it.
    from rd2h_protocol.wire.messages import MAX_BLOCK_IDS_PER_READINESS
    from rd2h_runtime import planning

    planning._scratch.runs.clear()
    rng = np.random.default_rng(24)

    def random_plan(n: int) -> ReadPlan:
        src = tuple(int(x) for x in rng.choice(1 << 30, n, replace=False))
        dst = tuple(int(x) for x in rng.choice(1 << 30, n, replace=False))
        req = RequestRead("r", src, dst, (), ())
        comps = tuple(ComponentAddrs(name, 1 << 40, 1 << 41, 64) for name in ("k", "v"))
        return ReadPlan(1, "s", "layer", comps, (), (req,))

    big = random_plan(MAX_BLOCK_IDS_PER_READINESS)
    assert len(build_descriptors(big)) == 2 * MAX_BLOCK_IDS_PER_READINESS
    assert len(planning._scratch.runs) == 0
    for _ in range(8):
        build_descriptors(random_plan(1 << 16))
    kept = planning._scratch.runs.values()
    assert 0 < len(kept) < 8
    assert sum(planning._kept_bytes(r, n) for _, r, n in kept) <= planning._RUNS_KEPT_BYTES
    planning._scratch.runs.clear()
