"""The explorer: a bounded exhaustive search over every interleaving of a model world.

Theory of operation
-------------------
The explorer (``python -m rd2h_protocol.checker``) runs a breadth-first search over every
interleaving of the enabled actions (:meth:`World.actions
<rd2h_protocol.checker.world.World.actions>`) of small configurations
(:data:`~rd2h_protocol.checker.configs.CONFIGS`), with a budget for each fault (dropped
replies, aborts, early releases, read failures, kills). A state is a pickle of the world
(the endpoints are plain objects, shared configuration left out: see
:mod:`~rd2h_protocol.checker.snapshot`); its fingerprint is the hash of a canonical form
(see :mod:`~rd2h_protocol.checker.canonical`) in which what never changes behaviour is
left out (dict order, read ids, counters, texts, the history of finished requests, a
shift of every time), so that states reached along different paths merge. Time moves in
ticks once every due timer fired and no compute step is possible (the network and reads
may be slow; timers and compute are prompt). Breadth first means the first violation
found has a shortest trace, which it prints. A state with no enabled action must satisfy
L1 and B1 (no deadlock, nothing left behind).

Peers and expected violations: a configuration may model a v1 Prefill, a Decode with a
subset of the capabilities (none at all models a v1 Decode) and ``v1_lease_expiry``
(see :class:`~rd2h_protocol.checker.model.WorldConfig`). Where an invariant does not hold
by design (the ``does_not_hold`` of :mod:`rd2h_protocol.checker.invariants`), the
configuration names it in ``expect``: the explorer records the first violation of each
expected invariant with a shortest trace, does not expand that state, and goes on; the
configuration passes only if it finds exactly its expected set (an exploration cut by
``--max-states`` may not find them all yet) and nothing else. Any other violation stops
it at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from rd2h_protocol.checker.canonical import fingerprint
from rd2h_protocol.checker.invariants import InvariantViolation
from rd2h_protocol.checker.model import Action, WorldConfig
from rd2h_protocol.checker.snapshot import load_world
from rd2h_protocol.checker.world import World

__all__ = ["ExploreResult", "explore"]


@dataclass
class ExploreResult:
    """What one exploration found: counts, and the first violation of each invariant
    found (``found``: name -> (violation, a shortest trace to it))."""

    name: str
    expect: frozenset[str] = frozenset()
    states: int = 0
    transitions: int = 0
    depth: int = 0
    final_states: int = 0
    complete: bool = True
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    found: dict[str, tuple[InvariantViolation, list[str]]] = field(default_factory=dict)

    @property
    def unexpected(self) -> list[str]:
        """Invariants broken that the configuration does not expect to break."""
        return [name for name in self.found if name not in self.expect]

    @property
    def missing(self) -> list[str]:
        """Expected breaks a complete exploration did not find (a bounded one may not)."""
        return sorted(self.expect - set(self.found)) if self.complete else []

    @property
    def passed(self) -> bool:
        """No unexpected violation and, if complete, every expected one found."""
        return not self.unexpected and not self.missing

    @property
    def violation(self) -> InvariantViolation | None:
        """The unexpected violation that stopped the exploration, if any."""
        unexpected = self.unexpected
        return self.found[unexpected[0]][0] if unexpected else None

    @property
    def trace(self) -> list[str]:
        """A shortest trace to :attr:`violation` (empty without one)."""
        unexpected = self.unexpected
        return self.found[unexpected[0]][1] if unexpected else []

    def record(self, violation: InvariantViolation, trace: Callable[[], list[str]]) -> bool:
        """Remember ``violation`` with ``trace()`` (the first of its name only: its trace is
        written only then); True if it is expected."""
        if violation.name not in self.found:
            self.found[violation.name] = (violation, trace())
        return violation.name in self.expect


def explore(
    name: str,
    cfg: WorldConfig,
    *,
    max_states: int = 1_000_000,
    world: Callable[[WorldConfig], World] = World,
    symmetry: bool = False,
) -> ExploreResult:
    """Breadth-first search over every interleaving of ``cfg``'s enabled actions.

    Stops at the first violation of an invariant that ``cfg.expect`` does not name (its
    trace is a shortest one) or after ``max_states`` distinct states (``complete`` is
    then False). A state that breaks an expected invariant is recorded (the first of each
    name, with a shortest trace) and not expanded; the search goes on around it.
    ``symmetry``: merge states that differ by a permutation of interchangeable requests
    (see :func:`~rd2h_protocol.checker.canonical.fingerprint`).
    """
    started, cpu_started = time.perf_counter(), time.process_time()
    result = ExploreResult(name, frozenset(cfg.expect))
    try:
        root = world(cfg)
        root.check()
    except InvariantViolation as exc:
        result.record(exc, lambda: ["(while building the initial state)"])
        result.seconds = time.perf_counter() - started
        result.cpu_seconds = time.process_time() - cpu_started
        return result
    data = root_data = root.snapshot()
    fp = fingerprint(root, symmetry=symmetry)
    # Each state's parent and the action that reached it first; the labels of a trace are
    # written only for the traces printed (a label per transition cost 2 % of the search).
    parents: dict[int, tuple[int, Action] | None] = {fp: None}
    frontier: list[tuple[int, bytes]] = [(fp, data)]

    def trace_to(node: int, last: Action | None = None, end: str | None = None) -> list[str]:
        """The labels of the path to ``node`` (and of ``last``, taken from there; then
        ``end``), replayed from the root: each state as the search held it, a snapshot
        read back."""
        path: list[Action] = []
        entry = parents[node]
        while entry is not None:
            node, act = entry
            path.append(act)
            entry = parents[node]
        path.reverse()
        if last is not None:
            path.append(last)
        labels: list[str] = []
        state: World = load_world(root_data)
        for n, act in enumerate(path):
            labels.append(state.describe(act))
            if n < len(path) - 1:
                state.apply(act)
                state = load_world(state.snapshot())
        return labels if end is None else [*labels, end]

    stop = False
    while frontier and not stop:
        successors: list[tuple[int, bytes]] = []
        for fp, data in frontier:
            state: World = load_world(data)
            acts = state.actions()
            if not acts:
                result.final_states += 1
                try:
                    state.check_quiescent()
                    state.check_idle()
                except InvariantViolation as exc:
                    stop = not result.record(exc, partial(trace_to, fp, None, "(no action left)"))
                    if stop:
                        break
                continue
            for n, act in enumerate(acts):
                # The last action may consume the parent itself: one copy fewer.
                child: World = state if n == len(acts) - 1 else load_world(data)
                result.transitions += 1
                try:
                    child.apply(act)
                except InvariantViolation as exc:
                    stop = not result.record(exc, partial(trace_to, fp, act))
                except Exception as exc:  # an endpoint that raises is a bug too
                    crash = InvariantViolation("CRASH", f"{type(exc).__name__}: {exc}")
                    stop = not result.record(crash, partial(trace_to, fp, act))
                else:
                    child_fp = fingerprint(child, symmetry=symmetry)
                    if child_fp in parents:
                        continue
                    parents[child_fp] = (fp, act)
                    successors.append((child_fp, child.snapshot()))
                    if len(parents) >= max_states:
                        result.complete = False
                        stop = True
                if stop:
                    break
            if stop:
                break
        if stop:
            break
        frontier = successors
        if frontier:
            result.depth += 1
            # Seqs and uids grow by a few per step: far below the block ids (FIRST_*_BLOCK).
            assert result.depth < 1 << 16, "too deep for the symmetry reduction's renaming"
    result.states = len(parents)
    result.seconds = time.perf_counter() - started
    result.cpu_seconds = time.process_time() - cpu_started
    return result


def _explore_star(job: tuple[str, WorldConfig, int, bool]) -> ExploreResult:
    name, cfg, max_states, symmetry = job
    return explore(name, cfg, max_states=max_states, symmetry=symmetry)
