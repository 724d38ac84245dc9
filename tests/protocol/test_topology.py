"""Topology rules of reference-behaviour.md §2: ids, TP map, ports, chunk ranges, split."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rd2h_protocol.errors import TopologyError
from rd2h_protocol.topology import (
    Contributor,
    chunk_block_range,
    decode_base_port,
    decode_rank_port,
    external_request_id,
    group_members,
    indexer_share,
    main_share,
    map_prefill_rank,
    prefill_target_port,
    split_range,
    transferred_tokens_before,
)

# -- external request id ------------------------------------------------------------------


def test_external_id_strips_9_char_suffix() -> None:
    assert external_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert external_request_id("0123456789") == "0"


def test_external_id_keeps_ids_of_9_chars_or_fewer() -> None:
    assert external_request_id("123456789") == "123456789"
    assert external_request_id("short") == "short"
    assert external_request_id("") == ""


# -- topology -----------------------------------------------------------------------------


def test_topology_ratio_d_rank_and_member() -> None:
    # p_tp 8 onto d_tp 2: ratio 4, ranks 0-3 feed Decode rank 0, 4-7 rank 1.
    assert map_prefill_rank(0, 8, 2) == Contributor(d_rank=0, group_member_idx=0, tp_ratio=4)
    assert map_prefill_rank(3, 8, 2) == Contributor(d_rank=0, group_member_idx=3, tp_ratio=4)
    assert map_prefill_rank(5, 8, 2) == Contributor(d_rank=1, group_member_idx=1, tp_ratio=4)
    # Equal TP sizes: one contributor per Decode rank.
    assert map_prefill_rank(2, 4, 4) == Contributor(d_rank=2, group_member_idx=0, tp_ratio=1)


@pytest.mark.parametrize(
    ("p_rank", "p_tp", "d_tp", "rule"),
    [
        (0, 0, 1, "p_tp=0"),
        (0, 4, 0, "d_tp=0"),
        (0, 2, 4, "p_tp=2 < d_tp=4"),
        (0, 6, 4, "multiple"),
        (-1, 4, 2, "p_rank=-1"),
        (4, 4, 2, "p_rank=4"),
    ],
    ids=[
        "p_tp_ge_1",
        "d_tp_ge_1",
        "p_tp_ge_d_tp",
        "p_tp_multiple_of_d_tp",
        "rank_ge_0",
        "rank_lt_tp",
    ],
)
def test_topology_rules_refuse_bad_topology(p_rank: int, p_tp: int, d_tp: int, rule: str) -> None:
    with pytest.raises(TopologyError, match=rule):
        map_prefill_rank(p_rank, p_tp, d_tp)


@given(d_tp=st.integers(1, 16), ratio=st.integers(1, 16))
def test_topology_groups_partition_prefill_ranks(d_tp: int, ratio: int) -> None:
    p_tp = d_tp * ratio
    seen: list[int] = []
    for d_rank in range(d_tp):
        members = group_members(d_rank, p_tp, d_tp)
        for idx, p_rank in enumerate(members):
            assert map_prefill_rank(p_rank, p_tp, d_tp) == Contributor(d_rank, idx, ratio)
        seen.extend(members)
    assert seen == list(range(p_tp))


def test_group_members_refuses_bad_decode_rank() -> None:
    with pytest.raises(TopologyError, match="d_rank=2"):
        group_members(2, 4, 2)
    with pytest.raises(TopologyError, match="multiple"):
        group_members(0, 3, 2)


# -- ports --------------------------------------------------------------------------------


def test_port_base_is_kv_port_plus_dp_rank_times_tp() -> None:
    assert decode_base_port(30000, 0, 4) == 30000
    assert decode_base_port(30000, 3, 4) == 30012


def test_port_rank_binds_base_plus_rank() -> None:
    assert decode_rank_port(30012, 0, 4) == 30012
    assert decode_rank_port(30012, 3, 4) == 30015


def test_port_highest_rank_must_fit() -> None:
    # Highest port 65532 + 3 = 65535 fits; one more DP rank does not.
    assert decode_base_port(65528, 1, 4) == 65532
    with pytest.raises(TopologyError, match="65536 exceeds 65535"):
        decode_base_port(65529, 1, 4)


@pytest.mark.parametrize(
    ("kv_port", "dp", "d_tp", "match"),
    [
        (0, 0, 1, "kv_port"),
        (65536, 0, 1, "kv_port"),
        (1000, -1, 1, "global_dp_rank"),
        (1000, 0, 0, "d_tp"),
    ],
)
def test_port_base_refuses_bad_arguments(kv_port: int, dp: int, d_tp: int, match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        decode_base_port(kv_port, dp, d_tp)


@pytest.mark.parametrize(
    ("base", "d_rank", "d_tp", "match"),
    [
        (1000, 0, 0, "d_tp=0"),
        (1000, 2, 2, "d_rank=2"),
        (1000, -1, 2, "d_rank=-1"),
        (0, 0, 2, "base port"),
        (65535, 1, 2, "65535 \\+ 1"),
    ],
)
def test_port_rank_refuses_bad_arguments(base: int, d_rank: int, d_tp: int, match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        decode_rank_port(base, d_rank, d_tp)


def test_prefill_connects_to_base_plus_its_decode_rank() -> None:
    # p_tp 8, d_tp 2: Prefill rank 5 belongs to Decode rank 1.
    assert prefill_target_port(40000, 5, 8, 2) == 40001
    assert prefill_target_port(40000, 3, 8, 2) == 40000
    with pytest.raises(TopologyError, match="65536"):
        prefill_target_port(65535, 5, 8, 2)


# -- chunk ranges -------------------------------------------------------------------------


def _chunk(
    *, cached: int = 0, sent: int = 0, computed: int, bs: int = 16, alloc: int = 100, final: bool
) -> tuple[int, int]:
    return chunk_block_range(
        remote_cached_tokens=cached,
        transferred_tokens=sent,
        computed_tokens=computed,
        block_size=bs,
        allocated_blocks=alloc,
        final=final,
    )


def test_chunk_start_skips_cached_and_transferred_tokens() -> None:
    assert _chunk(cached=32, sent=16, computed=100, final=False) == (2, 6)
    assert _chunk(cached=16, sent=48, computed=100, final=False) == (3, 6)
    assert _chunk(cached=-5, sent=-7, computed=100, final=False) == (0, 6)


def test_chunk_non_final_sends_only_full_blocks() -> None:
    assert _chunk(computed=47, final=False) == (0, 2)


def test_chunk_final_includes_partial_block() -> None:
    assert _chunk(computed=47, final=True) == (0, 3)
    assert _chunk(computed=48, final=True) == (0, 3)


def test_chunk_end_beyond_allocation_raises() -> None:
    assert _chunk(computed=48, alloc=3, final=True) == (0, 3)
    with pytest.raises(TopologyError, match="only 2 blocks are allocated"):
        _chunk(computed=33, alloc=2, final=True)


def test_chunk_end_never_below_start() -> None:
    # Decode already cached more than this chunk computed: an empty range at start.
    assert _chunk(cached=80, computed=40, final=False) == (5, 5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bs": 0}, "block_size=0"),
        ({"computed": -1}, "computed tokens"),
        ({"alloc": -1}, "allocated blocks"),
    ],
)
def test_chunk_refuses_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    args: dict[str, int] = {"computed": 16, **kwargs}
    with pytest.raises(TopologyError, match=match):
        _chunk(final=True, **args)


@given(
    bs=st.integers(1, 64),
    total=st.integers(0, 2000),
    cuts=st.lists(st.integers(0, 2000), max_size=8),
    cached_blocks=st.integers(0, 40),
)
def test_chunks_send_every_block_exactly_once(
    bs: int, total: int, cuts: list[int], cached_blocks: int
) -> None:
    """Over a chunked prefill, the ranges are disjoint and cover [cached, all blocks)."""
    alloc = -(-total // bs)
    cached = min(cached_blocks * bs, total // bs * bs)
    points = sorted({c for c in cuts if 0 < c < total} | {total})
    sent: list[int] = []
    before = 0
    for i, computed in enumerate(points):
        final = i == len(points) - 1
        start, end = _chunk(
            cached=cached,
            sent=transferred_tokens_before(before, [bs]),
            computed=computed,
            bs=bs,
            alloc=alloc,
            final=final,
        )
        sent.extend(range(start, end))
        before = computed
    assert sent == list(range(cached // bs, alloc))


def test_transferred_tokens_rounded_to_smallest_block_size() -> None:
    assert transferred_tokens_before(100, [64, 16, 128]) == 96
    assert transferred_tokens_before(15, [16]) == 0
    assert transferred_tokens_before(0, (16,)) == 0


@pytest.mark.parametrize(
    ("computed", "sizes", "match"),
    [(10, [], "non-empty"), (10, [16, 0], ">= 1"), (-1, [16], "computed tokens")],
)
def test_transferred_tokens_refuses_bad_arguments(
    computed: int, sizes: list[int], match: str
) -> None:
    with pytest.raises(TopologyError, match=match):
        transferred_tokens_before(computed, sizes)


# -- split --------------------------------------------------------------------------------


def test_split_formula() -> None:
    # 10 over 4 ranks, no rotation: sizes 3, 3, 2, 2.
    assert [split_range(10, r, 4, 0) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_split_rotated_by_start_block() -> None:
    # start_block 5 over 4 ranks: rank 1 holds logical position 0.
    assert [split_range(10, r, 4, 5) for r in range(4)] == [(8, 10), (0, 3), (3, 6), (6, 8)]
    # A one-block chunk lands on a different rank for each start block.
    owners = [next(r for r in range(4) if split_range(1, r, 4, s) == (0, 1)) for s in range(4)]
    assert owners == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, 0, 2, 0), "n=-1"),
        ((4, 0, 0, 0), "size=0"),
        ((4, 2, 2, 0), "rank=2"),
        ((4, -1, 2, 0), "rank=-1"),
        ((4, 0, 2, -1), "start_block=-1"),
    ],
)
def test_split_refuses_bad_arguments(args: tuple[int, int, int, int], match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        split_range(*args)


@given(n=st.integers(0, 5000), size=st.integers(1, 64), start=st.integers(0, 10**6))
def test_split_ranges_disjoint_and_cover(n: int, size: int, start: int) -> None:
    ranges = sorted(split_range(n, r, size, start) for r in range(size))
    pos = 0
    for lo, hi in ranges:
        assert lo == pos and hi >= lo
        pos = hi
    assert pos == n
    lengths = [hi - lo for lo, hi in ranges]
    assert max(lengths) - min(lengths) <= 1


def test_main_kv_pulled_only_by_member_zero() -> None:
    assert main_share(10, 1, 4, 5, member=0) == split_range(10, 1, 4, 5)
    assert main_share(10, 1, 4, 5, member=1) == (0, 0)
    with pytest.raises(TopologyError, match="member index"):
        main_share(10, 1, 4, 5, member=-1)


@given(
    n=st.integers(0, 3000),
    d_tp=st.integers(1, 8),
    start=st.integers(0, 10**5),
)
def test_main_shares_of_decode_ranks_cover_the_chunk(n: int, d_tp: int, start: int) -> None:
    covered: list[int] = []
    for d_rank in range(d_tp):
        lo, hi = main_share(n, d_rank, d_tp, start, member=0)
        covered.extend(range(lo, hi))
    assert sorted(covered) == list(range(n))


def test_indexer_whole_range_with_ratio_one() -> None:
    assert indexer_share(37, 0, 1, 12) == (0, 37)


def test_indexer_split_across_contributors() -> None:
    assert [indexer_share(7, m, 2, 0) for m in range(2)] == [(0, 4), (4, 7)]
    assert [indexer_share(7, m, 2, 1) for m in range(2)] == [(4, 7), (0, 4)]


@given(
    n=st.integers(0, 3000),
    d_tp=st.integers(1, 4),
    ratio=st.integers(1, 8),
    start=st.integers(0, 10**5),
)
def test_contributor_indexer_slices_union_to_full_range(
    n: int, d_tp: int, ratio: int, start: int
) -> None:
    """For every Decode rank, the shares its contributors send make one full copy."""
    p_tp = d_tp * ratio
    for d_rank in range(d_tp):
        covered: list[int] = []
        for p_rank in group_members(d_rank, p_tp, d_tp):
            c = map_prefill_rank(p_rank, p_tp, d_tp)
            lo, hi = indexer_share(n, c.group_member_idx, c.tp_ratio, start)
            covered.extend(range(lo, hi))
        assert sorted(covered) == list(range(n))
