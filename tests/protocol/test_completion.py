"""Contributor completion and the cross-rank completion rule (reference §2)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rd2h_protocol.completion import (
    CompletionResult,
    ContributorSet,
    CrossRankCompletion,
    RankReport,
)
from rd2h_protocol.errors import ConfigError, LocalProtocolError, TopologyError

# -- contributor completion ----------------------------------------------------------------


def test_contributors_complete_with_all_distinct_members() -> None:
    cs = ContributorSet(3)
    assert cs.report(2) == "count"
    assert cs.report(2) == "ignore_duplicate"
    assert cs.report(0) == "count"
    assert not cs.complete and cs.members == {0, 2}
    assert cs.report(1) == "complete"
    assert cs.complete
    assert cs.report(1) == "ignore_duplicate" and cs.duplicates == 2


def test_single_contributor_completes_at_once() -> None:
    cs = ContributorSet(1)
    assert cs.report(0) == "complete"


def test_contributor_bounds() -> None:
    with pytest.raises(TopologyError):
        ContributorSet(0)
    cs = ContributorSet(2)
    with pytest.raises(TopologyError, match=r"\[0, 2\)"):
        cs.report(2)
    cs.check_ratio(2)
    with pytest.raises(TopologyError, match="tp_ratio 4 differs"):
        cs.check_ratio(4)


@given(st.integers(1, 8), st.lists(st.integers(0, 7), max_size=40))
def test_complete_iff_every_member_reported(ratio: int, reports: list[int]) -> None:
    cs = ContributorSet(ratio)
    seen: set[int] = set()
    for member in reports:
        if member >= ratio:
            continue
        effect = cs.report(member)
        assert (effect == "ignore_duplicate") == (member in seen)
        seen.add(member)
        assert cs.complete == (len(seen) == ratio)


# -- cross-rank completion -----------------------------------------------------------------

IDS = {"a": "a-0001", "b": "b-0002", "c": "c-0003"}


def test_finished_only_when_terminal_on_every_rank() -> None:
    xr = CrossRankCompletion(2)
    r = xr.update([RankReport(done=["a"]), RankReport()], IDS.get, 0.0)
    assert r == CompletionResult()
    assert xr.pending() == {"a": "collecting"}
    r = xr.update([RankReport(), RankReport(done=["a"])], IDS.get, 1.0)
    assert r.finished == ("a-0001",) and r.load_errors == frozenset()
    assert xr.is_idle() and xr.stats.finished == 1


def test_failure_on_any_rank_is_a_load_error() -> None:
    xr = CrossRankCompletion(3)
    reports = [RankReport(done=["a", "b"]), RankReport(failed=["a"], done=["b"]), RankReport()]
    assert xr.update(reports, IDS.get, 0.0).finished == ()
    r = xr.update([RankReport(), RankReport(), RankReport(done=["a", "b"])], IDS.get, 0.0)
    assert r.finished == ("a-0001", "b-0002")
    assert r.load_errors == {"a-0001"} and xr.stats.load_errors == 1


def test_done_and_failed_in_one_report_counts_as_failed() -> None:
    xr = CrossRankCompletion(1)
    r = xr.update([RankReport(done=["a"], failed=["a"])], IDS.get, 0.0)
    assert r.finished == ("a-0001",) and r.load_errors == {"a-0001"}


def test_duplicate_reports_of_a_rank_are_ignored() -> None:
    xr = CrossRankCompletion(2)
    xr.update([RankReport(done=["a"]), RankReport()], IDS.get, 0.0)
    r = xr.update([RankReport(failed=["a"]), RankReport()], IDS.get, 0.0)
    assert r.finished == () and xr.stats.duplicate_reports == 1
    r = xr.update([RankReport(), RankReport(done=["a"])], IDS.get, 0.0)
    assert r.load_errors == frozenset()  # the duplicate's failure did not count


def test_unknown_mapping_is_kept_and_retried() -> None:
    mapping: dict[str, str] = {}
    xr = CrossRankCompletion(1)
    r = xr.update([RankReport(done=["a"])], mapping.get, 0.0)
    assert r.finished == () and xr.pending() == {"a": "unmapped"}
    r = xr.update([RankReport(done=["a"])], mapping.get, 1.0)  # a duplicate meanwhile
    assert r.finished == () and xr.stats.duplicate_reports == 1
    assert xr.stats.retried_unmapped == 1
    mapping["a"] = "a-0001"
    r = xr.update([RankReport()], mapping.get, 2.0)
    assert r.finished == ("a-0001",) and xr.is_idle()


def test_unmapped_is_bounded_in_count_and_time() -> None:
    none: dict[str, str] = {}
    xr = CrossRankCompletion(1, max_unmapped=2, unmapped_timeout_s=10.0)
    r = xr.update([RankReport(failed=["a", "b", "c"])], none.get, 0.0)
    assert r.dropped == ("a",) and list(xr.pending()) == ["b", "c"]
    assert xr.update([RankReport(done=["d"])], none.get, 5.0).dropped == ("b",)
    r = xr.update([RankReport()], none.get, 10.0)
    assert r.dropped == ("c",)
    assert list(xr.pending()) == ["d"]
    r = xr.update([RankReport()], none.get, 15.0)
    assert r.dropped == ("d",) and xr.is_idle() and xr.stats.dropped == 4


def test_collect_timeout_clears_reports_some_rank_never_sends() -> None:
    xr = CrossRankCompletion(2, collect_timeout_s=30.0)
    xr.update([RankReport(done=["a"]), RankReport()], IDS.get, 0.0)
    assert xr.update([RankReport(), RankReport()], IDS.get, 29.0).dropped == ()
    assert xr.update([RankReport(), RankReport()], IDS.get, 30.0).dropped == ("a",)
    assert xr.is_idle()


def test_completion_misuse() -> None:
    with pytest.raises(ConfigError):
        CrossRankCompletion(0)
    with pytest.raises(ConfigError):
        CrossRankCompletion(1, max_unmapped=-1)
    with pytest.raises(ConfigError):
        CrossRankCompletion(1, unmapped_timeout_s=0)
    with pytest.raises(ConfigError):
        CrossRankCompletion(1, collect_timeout_s=0)
    with pytest.raises(LocalProtocolError, match="one report per Decode TP rank"):
        CrossRankCompletion(2).update([RankReport()], IDS.get, 0.0)


@given(
    st.integers(1, 4),
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.booleans()),
        max_size=30,
    ),
)
def test_every_rank_agrees_and_finishes_exactly_once(
    world: int, events: list[tuple[str, int, bool]]
) -> None:
    """Fed the same rounds, the rule finishes a request exactly when every rank reported."""
    xr = CrossRankCompletion(world)
    reported: dict[str, set[int]] = {}
    failed: dict[str, bool] = {}
    finished: list[str] = []
    errors: set[str] = set()
    for ext, rank, fail in events:
        rank %= world
        if ext in finished:
            continue  # the endpoint reports each request once per rank
        reports = [RankReport() for _ in range(world)]
        if rank not in reported.setdefault(ext, set()):
            failed[ext] = failed.get(ext, False) or fail
        reports[rank] = RankReport(failed=[ext]) if fail else RankReport(done=[ext])
        reported[ext].add(rank)
        r = xr.update(reports, IDS.get, 0.0)
        finished += [k for k, v in IDS.items() if v in r.finished]
        errors |= {k for k, v in IDS.items() if v in r.load_errors}
    assert sorted(finished) == sorted(e for e, ranks in reported.items() if len(ranks) == world)
    assert len(finished) == len(set(finished))
    assert errors == {e for e in finished if failed[e]}
