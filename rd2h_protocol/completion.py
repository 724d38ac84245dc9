"""Decode-side request completion: per-rank contributor counting and the cross-rank rule.

Theory of operation
-------------------
A Decode request may be scheduled only after two things hold (reference §2 "Decode
completion"):

1. **On each Decode TP rank**, every Prefill contributor mapped to that rank reported
   the request's final layer. With ``tp_ratio`` Prefill ranks per Decode rank, the
   contributors are the distinct ``group_member_idx`` values ``0 .. ratio-1``. A done
   signal counts only after the read of the message that carried it succeeded (the
   :class:`~rd2h_protocol.consumer.ConsumerEndpoint` calls :meth:`ContributorSet.report`
   only then), and a member that reports twice counts once. :class:`ContributorSet` runs
   the ``contributor completion`` machine for one request on one rank.
2. **Across Decode TP ranks**, the request is terminal (done or failed) on EVERY rank. A
   failure on any rank makes the request's main and indexer destination blocks invalid
   (vLLM load errors), because the main pool is shared by the ranks and every rank needs
   its own complete indexer. :class:`CrossRankCompletion` runs the ``cross-rank
   completion`` machine per request; it is pure, and every rank runs it on the same
   gathered input, so all ranks reach the same answer in the same step.

How the vLLM worker feeds it: each step, every rank collects the terminal outputs of its
endpoint (``RequestDone`` / ``RequestFailed`` external ids) into a :class:`RankReport`,
the reports are gathered over the TP CPU group (``all_gather_object``), and every rank
calls :meth:`CrossRankCompletion.update` with the list indexed by rank and a function
that maps an external id to the internal vLLM request id (or ``None`` while unknown). The
result names the internal ids that finished and those whose blocks must be reported
through ``get_block_ids_with_load_errors``. A request that is terminal everywhere but
whose id mapping is not known yet is kept and retried on every later update, bounded in
count (``max_unmapped``, oldest dropped first) and time (``unmapped_timeout_s``);
dropped ids are returned so the caller can log them.

Everything here is sans-IO: time is the ``now`` argument.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Final

from rd2h_protocol.errors import ConfigError, LocalProtocolError, TopologyError
from rd2h_protocol.machines.declare import Guard, MachineSpec, stay

__all__ = [
    "CONTRIBUTOR_COMPLETION",
    "CROSS_RANK_COMPLETION",
    "CompletionResult",
    "CompletionStats",
    "ContributorSet",
    "CrossRankCompletion",
    "RankReport",
]


#: Every guard the completion tables name: what it says and the method that resolves it.
GUARDS: Final[dict[str, Guard]] = {
    "others_missing": Guard(
        "a new member reported and others have not yet", "ContributorSet.report"
    ),
    "last_member": Guard("the last missing member reported", "ContributorSet.report"),
    "other_ranks_missing": Guard(
        "a new rank reported the request terminal and others have not yet",
        "CrossRankCompletion._on_report",
    ),
    "all_ranks_terminal": Guard(
        "the last missing rank reported the request terminal", "CrossRankCompletion._on_report"
    ),
    "mapped": Guard(
        "resolve() knows the request's internal id",
        "CrossRankCompletion._on_report, ._retry_unmapped",
    ),
    "not_mapped": Guard(
        "resolve() does not know the request's internal id yet",
        "CrossRankCompletion._on_report, ._retry_unmapped",
    ),
}


# -- contributor completion (one request on one Decode rank) -------------------------------

CONTRIB_WAITING: Final = "waiting"
CONTRIB_COMPLETE: Final = "complete"

RECV_DONE_NEW: Final = "RECV_DONE_NEW"
RECV_DONE_LAST: Final = "RECV_DONE_LAST"
RECV_DONE_DUPLICATE: Final = "RECV_DONE_DUPLICATE"

EFFECT_COUNT: Final = "count"
EFFECT_COMPLETE: Final = "complete"
EFFECT_IGNORE_DUPLICATE: Final = "ignore_duplicate"

CONTRIBUTOR_COMPLETION: Final = MachineSpec(
    name="contributor completion",
    doc="""
    One per request on one Decode TP rank. Counts the distinct contributors
    (``group_member_idx`` in ``[0, tp_ratio)``) whose final-layer done signal arrived in a
    message whose read SUCCEEDED; the request is done on this rank when all ``tp_ratio``
    members have reported. A member that reports again is ignored (and counted).
    """,
    states=(CONTRIB_WAITING, CONTRIB_COMPLETE),
    initial=CONTRIB_WAITING,
    guards=GUARDS,
    terminal=frozenset({CONTRIB_COMPLETE}),
    transitions=(
        {
            "trigger": RECV_DONE_NEW,
            "source": CONTRIB_WAITING,
            "dest": CONTRIB_WAITING,
            "conditions": "others_missing",
            "effect": EFFECT_COUNT,
        },
        {
            "trigger": RECV_DONE_LAST,
            "source": CONTRIB_WAITING,
            "dest": CONTRIB_COMPLETE,
            "conditions": "last_member",
            "effect": EFFECT_COMPLETE,
        },
        *stay(RECV_DONE_DUPLICATE, (CONTRIB_WAITING, CONTRIB_COMPLETE), EFFECT_IGNORE_DUPLICATE),
    ),
)


class ContributorSet:
    """The contributor-completion machine of one request on one Decode rank.

    ``ratio`` is the request's ``tp_ratio`` (Prefill ranks per Decode rank); it is fixed
    for the request's life (see :meth:`check_ratio`).
    """

    __slots__ = ("_members", "duplicates", "ratio", "state")

    def __init__(self, ratio: int) -> None:
        if ratio < 1:
            raise TopologyError(f"tp_ratio must be >= 1, got {ratio}")
        self.ratio = ratio
        self.state = CONTRIBUTOR_COMPLETION.initial
        self.duplicates = 0
        self._members: set[int] = set()

    @property
    def complete(self) -> bool:
        """Whether every member reported."""
        return self.state == CONTRIB_COMPLETE

    @property
    def members(self) -> frozenset[int]:
        """The members that reported so far."""
        return frozenset(self._members)

    def check_ratio(self, ratio: int) -> None:
        """Raise :class:`TopologyError` if a message for this request carries another ratio.

        Mixing ratios would let contributors of two topologies complete each other's
        requests (the reference warns that mixed builds duplicate writes).
        """
        if ratio != self.ratio:
            raise TopologyError(
                f"tp_ratio {ratio} differs from the tp_ratio {self.ratio} earlier readiness "
                f"for this request carried"
            )

    def report(self, member: int) -> str:
        """Record member ``member``'s done signal; return the effect of the transition.

        The effect is ``"count"`` (new member, others missing), ``"complete"`` (the last
        member) or ``"ignore_duplicate"``. Raises :class:`TopologyError` for a member
        outside ``[0, ratio)``.
        """
        if not 0 <= member < self.ratio:
            raise TopologyError(f"group_member_idx must lie in [0, {self.ratio}), got {member}")
        if member in self._members:
            event = RECV_DONE_DUPLICATE
        elif len(self._members) + 1 == self.ratio:
            event = RECV_DONE_LAST
        else:
            event = RECV_DONE_NEW
        effect: str = _CONTRIBUTORS.fire(self, self, event, member)
        return effect

    # The machine's effects: (contributors, member) -> the effect's name.

    def _fx_count(self, _self: ContributorSet, member: int) -> str:
        self._members.add(member)
        return EFFECT_COUNT

    def _fx_complete(self, _self: ContributorSet, member: int) -> str:
        self._members.add(member)
        return EFFECT_COMPLETE

    def _fx_ignore_duplicate(self, _self: ContributorSet, member: int) -> str:
        self.duplicates += 1
        return EFFECT_IGNORE_DUPLICATE


_CONTRIBUTORS: Final = CONTRIBUTOR_COMPLETION.bind(
    {
        EFFECT_COUNT: ContributorSet._fx_count,
        EFFECT_COMPLETE: ContributorSet._fx_complete,
        EFFECT_IGNORE_DUPLICATE: ContributorSet._fx_ignore_duplicate,
    }
)


# -- cross-rank completion (one request across the Decode TP ranks) ------------------------

XR_COLLECTING: Final = "collecting"
XR_UNMAPPED: Final = "unmapped"
XR_FINISHED: Final = "finished"
XR_DROPPED: Final = "dropped"

RECV_RANK_TERMINAL: Final = "RECV_RANK_TERMINAL"
RECV_LAST_RANK: Final = "RECV_LAST_RANK"
RECV_LAST_RANK_UNMAPPED: Final = "RECV_LAST_RANK_UNMAPPED"
RECV_DUPLICATE_RANK: Final = "RECV_DUPLICATE_RANK"
LOCAL_MAPPED: Final = "LOCAL_MAPPED"
LOCAL_STILL_UNMAPPED: Final = "LOCAL_STILL_UNMAPPED"
LOCAL_EVICT: Final = "LOCAL_EVICT"
TIMER_GIVE_UP: Final = "TIMER_GIVE_UP"

EFFECT_RECORD: Final = "record"
EFFECT_FINISH: Final = "finish"
EFFECT_KEEP: Final = "keep"
EFFECT_RETRY: Final = "retry"
EFFECT_DROP: Final = "drop"

CROSS_RANK_COMPLETION: Final = MachineSpec(
    name="cross-rank completion",
    doc="""
    One per request across the Decode TP ranks (pure; every rank runs it on the same
    gathered reports). The request finishes only when it is terminal (done or failed) on
    every rank; a failure on any rank reports its destination blocks as load errors. A
    request terminal everywhere whose internal id is not known yet waits in ``unmapped``
    and is retried on every update, bounded in count (evict) and time (give up).
    """,
    states=(XR_COLLECTING, XR_UNMAPPED, XR_FINISHED, XR_DROPPED),
    initial=XR_COLLECTING,
    guards=GUARDS,
    terminal=frozenset({XR_FINISHED, XR_DROPPED}),
    transitions=(
        {
            "trigger": RECV_RANK_TERMINAL,
            "source": XR_COLLECTING,
            "dest": XR_COLLECTING,
            "conditions": "other_ranks_missing",
            "effect": EFFECT_RECORD,
        },
        {
            "trigger": RECV_LAST_RANK,
            "source": XR_COLLECTING,
            "dest": XR_FINISHED,
            "conditions": ["all_ranks_terminal", "mapped"],
            "effect": EFFECT_FINISH,
        },
        {
            "trigger": RECV_LAST_RANK_UNMAPPED,
            "source": XR_COLLECTING,
            "dest": XR_UNMAPPED,
            "conditions": ["all_ranks_terminal", "not_mapped"],
            "effect": EFFECT_KEEP,
        },
        *stay(RECV_DUPLICATE_RANK, (XR_COLLECTING, XR_UNMAPPED), EFFECT_IGNORE_DUPLICATE),
        {
            "trigger": LOCAL_MAPPED,
            "source": XR_UNMAPPED,
            "dest": XR_FINISHED,
            "conditions": "mapped",
            "effect": EFFECT_FINISH,
        },
        {
            "trigger": LOCAL_STILL_UNMAPPED,
            "source": XR_UNMAPPED,
            "dest": XR_UNMAPPED,
            "conditions": "not_mapped",
            "effect": EFFECT_RETRY,
        },
        {"trigger": LOCAL_EVICT, "source": XR_UNMAPPED, "dest": XR_DROPPED, "effect": EFFECT_DROP},
        {
            "trigger": TIMER_GIVE_UP,
            "source": [XR_COLLECTING, XR_UNMAPPED],
            "dest": XR_DROPPED,
            "effect": EFFECT_DROP,
        },
    ),
)


@dataclass(frozen=True, slots=True)
class RankReport:
    """One Decode TP rank's newly terminal requests (external ids) since its last report."""

    done: Collection[str] = ()
    failed: Collection[str] = ()


@dataclass(frozen=True, slots=True)
class CompletionResult:
    """What one :meth:`CrossRankCompletion.update` decided.

    ``finished``: internal request ids terminal on every rank, in the order they became
    so. ``load_errors``: those of them that failed on at least one rank (report their
    main AND indexer destination blocks as load errors). ``dropped``: external ids given
    up without a mapping (too many or too old), for the caller's log.
    """

    finished: tuple[str, ...] = ()
    load_errors: frozenset[str] = frozenset()
    dropped: tuple[str, ...] = ()


@dataclass(slots=True)
class CompletionStats:
    """Counters of :class:`CrossRankCompletion` (for metrics)."""

    finished: int = 0
    load_errors: int = 0
    duplicate_reports: int = 0
    retried_unmapped: int = 0
    dropped: int = 0


@dataclass(slots=True)
class _Entry:
    state: str
    ranks: set[int]
    failed: bool
    since: float  # when the entry was created (collecting) or became unmapped


@dataclass(slots=True)
class _Tally:
    finished: list[str] = field(default_factory=list)
    errors: set[str] = field(default_factory=set)
    dropped: list[str] = field(default_factory=list)


class CrossRankCompletion:
    """The cross-rank completion rule over ``world_size`` Decode TP ranks (pure).

    ``max_unmapped`` and ``unmapped_timeout_s`` bound how many requests terminal on every
    rank may wait for their id mapping, and for how long. ``collect_timeout_s`` (off by
    default) gives up on a request that some rank never reported; the Decode endpoint
    reports every request it was given exactly once, so this only clears the residue of a
    contract violation (for example an external id reused while still in flight).
    """

    def __init__(
        self,
        world_size: int,
        *,
        max_unmapped: int = 4096,
        unmapped_timeout_s: float = 60.0,
        collect_timeout_s: float | None = None,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        if max_unmapped < 0:
            raise ConfigError(f"max_unmapped must be >= 0, got {max_unmapped}")
        if unmapped_timeout_s <= 0:
            raise ConfigError(f"unmapped_timeout_s must be > 0, got {unmapped_timeout_s}")
        if collect_timeout_s is not None and collect_timeout_s <= 0:
            raise ConfigError(f"collect_timeout_s must be > 0 or None, got {collect_timeout_s}")
        self.world_size = world_size
        self.max_unmapped = max_unmapped
        self.unmapped_timeout_s = unmapped_timeout_s
        self.collect_timeout_s = collect_timeout_s
        self.stats = CompletionStats()
        self._collecting: dict[str, _Entry] = {}
        # Insertion order is the order they became unmapped, i.e. oldest first.
        self._unmapped: OrderedDict[str, _Entry] = OrderedDict()

    # -- views -----------------------------------------------------------------------------

    def pending(self) -> dict[str, str]:
        """``{external id: state}`` of every request not finished yet."""
        out = {ext: e.state for ext, e in self._collecting.items()}
        out.update((ext, e.state) for ext, e in self._unmapped.items())
        return out

    def is_idle(self) -> bool:
        """Whether no request is being tracked."""
        return not self._collecting and not self._unmapped

    # -- the input -------------------------------------------------------------------------

    def update(
        self,
        reports: Sequence[RankReport],
        resolve: Callable[[str], str | None],
        now: float,
    ) -> CompletionResult:
        """Apply one gathered round of reports (``reports[rank]``) and decide.

        ``resolve`` maps an external id to the internal vLLM request id, or ``None``
        while the mapping is unknown. Call it every step, with empty reports too, so
        waiting requests are retried and timed out. A rank naming an id both done and
        failed counts as failed.
        """
        if len(reports) != self.world_size:
            raise LocalProtocolError(
                f"expected one report per Decode TP rank ({self.world_size}), got {len(reports)}"
            )
        tally = _Tally()
        self._retry_unmapped(resolve, now, tally)
        for rank, report in enumerate(reports):
            # Ordered (not a set): every rank must produce the same order, whatever its
            # hash seed.
            failed = dict.fromkeys(report.failed)
            for ext in report.done:
                if ext not in failed:
                    self._on_report(ext, rank, False, resolve, now, tally)
            for ext in failed:
                self._on_report(ext, rank, True, resolve, now, tally)
        self._expire(now, tally)
        return CompletionResult(
            tuple(tally.finished), frozenset(tally.errors), tuple(tally.dropped)
        )

    # -- internals -------------------------------------------------------------------------

    def _on_report(
        self,
        ext: str,
        rank: int,
        failed: bool,
        resolve: Callable[[str], str | None],
        now: float,
        tally: _Tally,
    ) -> None:
        entry = self._collecting.get(ext) or self._unmapped.get(ext)
        if entry is None:
            entry = _Entry(XR_COLLECTING, set(), False, now)
            self._collecting[ext] = entry
        if rank in entry.ranks:
            event = RECV_DUPLICATE_RANK
        elif len(entry.ranks) + 1 < self.world_size:
            event = RECV_RANK_TERMINAL
        else:
            req_id = resolve(ext)
            event = RECV_LAST_RANK if req_id is not None else RECV_LAST_RANK_UNMAPPED
        _CROSS_RANK.fire(self, entry, event, ext, resolve, now, tally, rank, failed)

    # The machine's effects: (entry, ext, resolve, now, tally, rank, failed), the last two
    # for a rank's report only.

    def _fx_ignore_duplicate(self, *_report: object) -> None:
        self.stats.duplicate_reports += 1

    def _fx_record(
        self,
        entry: _Entry,
        _ext: str,
        _resolve: object,
        _now: float,
        _tally: _Tally,
        rank: int,
        failed: bool,
    ) -> None:
        entry.ranks.add(rank)
        entry.failed = entry.failed or failed

    def _fx_finish(
        self,
        entry: _Entry,
        ext: str,
        resolve: Callable[[str], str | None],
        now: float,
        tally: _Tally,
        rank: int | None = None,
        failed: bool = False,
    ) -> None:
        """Terminal on every rank and mapped: finished (the last rank's report, or the
        mapping found while it waited unmapped)."""
        if rank is not None:
            self._fx_record(entry, ext, resolve, now, tally, rank, failed)
            del self._collecting[ext]
        else:
            del self._unmapped[ext]
        self._finish(ext, entry, resolve, tally)

    def _fx_keep(
        self,
        entry: _Entry,
        ext: str,
        resolve: Callable[[str], str | None],
        now: float,
        tally: _Tally,
        rank: int,
        failed: bool,
    ) -> None:
        """Terminal on every rank, not mapped yet: wait unmapped (bounded)."""
        self._fx_record(entry, ext, resolve, now, tally, rank, failed)
        del self._collecting[ext]
        entry.since = now
        self._unmapped[ext] = entry
        self._evict_overflow(tally)

    def _fx_retry(self, *_context: object) -> None:
        self.stats.retried_unmapped += 1

    def _fx_drop(
        self, _entry: _Entry, ext: str, _resolve: None, _now: float, tally: _Tally
    ) -> None:
        """Given up without a mapping (too many or too old), for the caller's log."""
        tally.dropped.append(ext)
        self.stats.dropped += 1

    def _finish(
        self, ext: str, entry: _Entry, resolve: Callable[[str], str | None], tally: _Tally
    ) -> None:
        req_id = resolve(ext)
        assert req_id is not None  # the guard "mapped" held when the input was chosen
        tally.finished.append(req_id)
        self.stats.finished += 1
        if entry.failed:
            tally.errors.add(req_id)
            self.stats.load_errors += 1

    def _drop(self, ext: str, entry: _Entry, event: str, tally: _Tally) -> None:
        _CROSS_RANK.fire(self, entry, event, ext, None, 0.0, tally)

    def _retry_unmapped(
        self, resolve: Callable[[str], str | None], now: float, tally: _Tally
    ) -> None:
        for ext in list(self._unmapped):
            entry = self._unmapped[ext]
            event = LOCAL_STILL_UNMAPPED if resolve(ext) is None else LOCAL_MAPPED
            _CROSS_RANK.fire(self, entry, event, ext, resolve, now, tally)

    def _evict_overflow(self, tally: _Tally) -> None:
        while len(self._unmapped) > self.max_unmapped:
            ext, entry = self._unmapped.popitem(last=False)
            self._drop(ext, entry, LOCAL_EVICT, tally)

    def _expire(self, now: float, tally: _Tally) -> None:
        while self._unmapped:
            ext, entry = next(iter(self._unmapped.items()))
            if now - entry.since < self.unmapped_timeout_s:
                break
            del self._unmapped[ext]
            self._drop(ext, entry, TIMER_GIVE_UP, tally)
        if self.collect_timeout_s is None:
            return
        for ext in [
            e for e, v in self._collecting.items() if now - v.since >= self.collect_timeout_s
        ]:
            entry = self._collecting.pop(ext)
            self._drop(ext, entry, TIMER_GIVE_UP, tally)


_CROSS_RANK: Final = CROSS_RANK_COMPLETION.bind(
    {
        EFFECT_RECORD: CrossRankCompletion._fx_record,
        EFFECT_FINISH: CrossRankCompletion._fx_finish,
        EFFECT_KEEP: CrossRankCompletion._fx_keep,
        EFFECT_IGNORE_DUPLICATE: CrossRankCompletion._fx_ignore_duplicate,
        EFFECT_RETRY: CrossRankCompletion._fx_retry,
        EFFECT_DROP: CrossRankCompletion._fx_drop,
    }
)
