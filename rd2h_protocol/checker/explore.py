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
found has a shortest trace, which it prints (but see "Sleep sets"). A state with no
enabled action must satisfy L1 and B1 (no deadlock, nothing left behind).

Sleep sets (partial-order reduction)
------------------------------------
Two actions enabled in the same state often commute: a Prefill rank writing its next
layer and Decode delivering a reply of another connection end in the same state in
either order. The plain search takes both orders and finds the second state again.
With sleep sets (Godefroid's, adapted to a breadth-first search with state caching;
``sleep_sets``, on by default), each state carries the actions whose other order was
taken already: when the search takes ``a`` from a state and then ``b``, the state that
``b`` reaches does not take ``a``, if ``a`` and ``b`` are independent there.
Independence is read from the footprints the world notes as each action runs (what it
read and wrote; :mod:`~rd2h_protocol.checker.footprint` argues why disjoint footprints
commute). A sleeping action keeps the footprint it had where the search took it:
nothing it reads has changed since, or it would have woken up. Actions are named by
what they do (:func:`_key`), the same in every state the fingerprint merges. Not with
``symmetry``: a state merged with its mirror image names its requests otherwise than
the sleep sets that reach it.

Why nothing is lost: sleep sets skip transitions, never states. Every state the plain
search reaches is reached, and every transition skipped is one the search took in an
equivalent position, where the action read the same parts of the state (so its checks,
which read only those, gave the same verdict); the state invariants are checked in
every state, as before. What that needs, as in Godefroid's algorithm: a state found
again with a sleep set that lacks some of the actions its first visit slept on must
take those actions too. A state not expanded yet keeps the intersection of its sleep
sets; an expanded one is taken again with the woken actions (from its snapshot while
it is one of the last two depths, else replayed from the root; ``reopened`` counts
them). Tests hold the reduction to this: the same states, final states, depth and
violations as the plain search on complete explorations, and every pair of actions
called independent in the first states of ten configurations taken in both orders in
the real world, to the same state.

The one property it weakens: a trace printed is shortest unless the state it reaches
was first found through a reopened state (``--no-sleep-sets`` always prints a
shortest one). Measured with ``--compare-reduction sleep-sets --jobs 2`` on the 13
designed configurations (one run, 2-core machine shared with other work): 181 621
states either way, 437 388 transitions against 548 626 (x1.25; x1.03 to x1.50 per
configuration), 173 s of CPU against 195 s (x1.13). Most pairs of enabled actions
that the plain search takes in both orders do not commute at all (see "Partial-order
reduction" in :mod:`~rd2h_protocol.checker.canonical`), so the gain stays modest.

Inherited forms
---------------
A fingerprint builds the canonical form of the whole state; most of it is the forms of
the endpoints, and an action touches one agent's (a Prefill rank's, a Decode engine's
ranks'). A child takes its parent's forms of the other endpoints as they are
(``inherited_forms``, on by default; see
:func:`~rd2h_protocol.checker.canonical.fingerprint_reusing`, and a test builds every
inherited fingerprint again from scratch). Measured with ``--compare-reduction
inherited-forms --jobs 2`` (the two searches side by side on a 2-core machine): CPU
time x1.14 for ``tp2-d2`` (four endpoints), x1.07 ``two-engines``, x1.06 ``no-abort``,
x0.97 ``faults`` (two endpoints, where building them costs little).

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
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Final

from rd2h_protocol.checker.canonical import (
    EndpointForms,
    fingerprint,
    fingerprint_reusing,
    read_form,
)
from rd2h_protocol.checker.footprint import EVERYTHING, Footprint, agent, conflict, recording
from rd2h_protocol.checker.invariants import InvariantViolation
from rd2h_protocol.checker.model import Action, WorldConfig
from rd2h_protocol.checker.snapshot import load_world
from rd2h_protocol.checker.world import World

__all__ = ["ExploreResult", "Options", "explore"]


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
    reopened: int = 0
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
    sleep_sets: bool = True,
    inherited_forms: bool = True,
) -> ExploreResult:
    """Breadth-first search over every interleaving of ``cfg``'s enabled actions.

    Stops at the first violation of an invariant that ``cfg.expect`` does not name (its
    trace is a shortest one, but see "Sleep sets" above) or after ``max_states`` distinct
    states (``complete`` is then False). A state that breaks an expected invariant is
    recorded (the first of each name, with its trace) and not expanded; the search goes
    on around it. ``symmetry``: merge states that differ by a permutation of
    interchangeable requests (see :func:`~rd2h_protocol.checker.canonical.fingerprint`).
    ``sleep_sets``: skip the second order of two independent actions (see "Sleep sets").
    ``inherited_forms``: a child takes its parent's canonical forms of the endpoints its
    action did not touch (see "Inherited forms").
    """
    started, cpu_started = time.perf_counter(), time.process_time()
    # A frame action names its queue's head (_key): frames must arrive in order. A sleep
    # set names requests and sessions, which the symmetry reduction renames when it merges
    # a state with its mirror image: the two reductions do not combine.
    sleep_sets = sleep_sets and cfg.fifo and not symmetry
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
    fp, root_forms = _fingerprint_of(root, {}, symmetry)
    # Each state's parent and the action that reached it first; the labels of a trace are
    # written only for the traces printed (a label per transition cost 2 % of the search).
    parents: dict[int, tuple[int, Action] | None] = {fp: None}
    frontier: list[tuple[int, bytes]] = [(fp, data)]

    def path_to(node: int) -> list[Action]:
        """The actions that first reached ``node``, from the root."""
        path: list[Action] = []
        entry = parents[node]
        while entry is not None:
            node, act = entry
            path.append(act)
            entry = parents[node]
        path.reverse()
        return path

    def replay(node: int, labels: list[str] | None = None) -> World:
        """State ``node`` as the search held it (each step a snapshot read back), from the
        root; the label of each action taken goes to ``labels``."""
        state: World = load_world(root_data)
        for act in path_to(node):
            if labels is not None:
                labels.append(state.describe(act))
            state.apply(act)
            state = load_world(state.snapshot())
        return state

    def trace_to(node: int, last: Action | None = None, end: str | None = None) -> list[str]:
        """The labels of the path to ``node`` (and of ``last``, taken from there; then
        ``end``), replayed from the root."""
        labels: list[str] = []
        state = replay(node, labels)
        if last is not None:
            labels.append(state.describe(last))
        return labels if end is None else [*labels, end]

    # The sleep set of every state found (the actions its expansion skips: see "Sleep
    # sets" above), by stable key, with the footprint each had when the search took it.
    sleep: dict[int, dict[Action, Footprint]] = {fp: {}}
    # The canonical forms of the endpoints of every state not expanded yet, for its
    # children to inherit (see canonical.fingerprint_reusing).
    forms: dict[int, EndpointForms] = {fp: root_forms}
    expanded: set[int] = set()
    # Expanded states found again with actions of their sleep set awake: those actions,
    # and the sleep set to take them with.
    reopened: dict[int, tuple[set[Action], dict[Action, Footprint]]] = {}

    def expand(
        fp: int,
        data: bytes,
        state: World,
        acts: list[Action],
        asleep: dict[Action, Footprint],
        only: set[Action] | None = None,
    ) -> bool:
        """Take from ``state`` (consumed; ``data`` is its snapshot) every action of
        ``acts`` not in ``asleep`` (``only``: just those of these keys); False once the
        search must stop."""
        keys = [_key(state, act) for act in acts] if sleep_sets else acts
        parent_forms = forms.pop(fp, None)
        if parent_forms is None:  # taken again (reopened): its forms were let go
            parent_forms = _fingerprint_of(state, {}, symmetry)[1]
        todo = [n for n, k in enumerate(keys) if (k not in asleep if only is None else k in only)]
        taken_before: dict[Action, Footprint] = dict(asleep)
        for n in todo:
            act = acts[n]
            # The last action may consume the parent itself: one copy fewer.
            child: World = state if n == todo[-1] else load_world(data)
            result.transitions += 1
            stop = False
            try:
                with recording() as touched:
                    child.apply(act)
            except InvariantViolation as exc:
                stop = not result.record(exc, partial(trace_to, fp, act))
            except Exception as exc:  # an endpoint that raises is a bug too
                crash = InvariantViolation("CRASH", f"{type(exc).__name__}: {exc}")
                stop = not result.record(crash, partial(trace_to, fp, act))
            else:
                taken = frozenset(touched)
                # The forms of the endpoints the action did not touch are the parent's.
                inherited = (
                    {k: f for k, f in parent_forms.items() if agent(k[0], k[1]) not in taken}
                    if inherited_forms and EVERYTHING not in taken
                    else {}
                )
                child_fp, child_forms = _fingerprint_of(child, inherited, symmetry)
                child_sleep: dict[Action, Footprint] = {}
                if sleep_sets:
                    child_sleep = {k: f for k, f in taken_before.items() if not conflict(taken, f)}
                    taken_before[keys[n]] = taken
                if child_fp in parents:
                    if sleep_sets:
                        revisit(child_fp, child_sleep)
                    continue
                parents[child_fp] = (fp, act)
                sleep[child_fp] = child_sleep
                forms[child_fp] = child_forms
                successors.append((child_fp, child.snapshot()))
                if len(parents) >= max_states:
                    result.complete = False
                    stop = True
            if stop:
                return False
        return True

    def revisit(fp: int, incoming: dict[Action, Footprint]) -> None:
        """``fp`` found again, with sleep set ``incoming``: what slept there and is awake
        on this path must be taken from it too (later, if it is expanded already)."""
        old = sleep[fp]
        woken = {k for k in old if k not in incoming}
        if not woken:
            return
        sleep[fp] = {k: f for k, f in old.items() if k in incoming}
        if fp in expanded:
            if fp in reopened:
                # Taking more actions, each with less asleep, explores a superset.
                more, had = reopened[fp]
                incoming = {k: f for k, f in had.items() if k in incoming}
                woken |= more
            reopened[fp] = (woken, incoming)

    stop = False
    previous: list[tuple[int, bytes]] = []
    while frontier and not stop:
        successors: list[tuple[int, bytes]] = []
        # The snapshots of the last two depths, for states found again from here (most
        # are; the others are replayed from the root).
        held = {**dict(previous), **dict(frontier)}
        for fp, data in frontier:
            state: World = load_world(data)
            expanded.add(fp)
            acts = state.actions()
            if acts:
                if not expand(fp, data, state, acts, sleep[fp]):
                    stop = True
                    break
                continue
            result.final_states += 1
            try:
                state.check_quiescent()
                state.check_idle()
            except InvariantViolation as exc:
                stop = not result.record(exc, partial(trace_to, fp, None, "(no action left)"))
                if stop:
                    break
        while reopened and not stop:
            fp, (woken, asleep) = reopened.popitem()
            result.reopened += 1
            kept = held.get(fp)
            state = replay(fp) if kept is None else load_world(kept)
            data = state.snapshot() if kept is None else kept
            if not expand(fp, data, state, state.actions(), asleep, woken):
                stop = True
        if stop:
            break
        previous, frontier = frontier, successors
        if frontier:
            result.depth += 1
            # Seqs and uids grow by a few per step: far below the block ids (FIRST_*_BLOCK).
            assert result.depth < 1 << 16, "too deep for the symmetry reduction's renaming"
    result.states = len(parents)
    result.seconds = time.perf_counter() - started
    result.cpu_seconds = time.process_time() - cpu_started
    return result


def _fingerprint_of(
    state: World, inherited: EndpointForms, symmetry: bool
) -> tuple[int, EndpointForms]:
    """``state``'s fingerprint, and its endpoints' forms for its children to inherit (none
    with ``symmetry``: its forms are written under a renaming)."""
    if symmetry:
        return fingerprint(state, symmetry=True), {}
    return fingerprint_reusing(state, inherited)


_FRAME_ACTIONS: Final = frozenset({"deliver", "drop", "lose", "dup"})


def _key(state: World, act: Action) -> Action:
    """``act`` by what it does, the same in every state the fingerprint merges: a frame
    action names its connection's queue, not where its frame sits in the network list
    (only a queue's head is taken); a read names its plan, not its read id (a label the
    canonical form leaves out: two merged states may number their reads otherwise); the
    others are stable already."""
    if act[0] in _FRAME_ACTIONS:
        index = act[1]
        assert isinstance(index, int)
        frame = state.network[index]
        return (act[0], frame.src[1], frame.dst[1])
    if act[0] == "read":
        key = act[1]
        assert isinstance(key, tuple)
        return ("read", read_form(state, key), act[2])
    return act


@dataclass(frozen=True)
class Options:
    """How :func:`explore` searches (its keyword arguments of the same names)."""

    symmetry: bool = False
    sleep_sets: bool = True
    inherited_forms: bool = True


def explore_star(job: tuple[str, WorldConfig, int, Options]) -> ExploreResult:
    name, cfg, max_states, options = job
    return explore(name, cfg, max_states=max_states, **asdict(options))
