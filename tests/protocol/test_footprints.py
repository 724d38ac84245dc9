"""What the explorer does with the footprints of actions: its partial-order reduction (sleep
sets) and its reuse of the canonical forms of endpoints an action did not touch. What the
world notes of each action, when two footprints conflict, that actions called independent
do commute in the real world, that the reduction finds every state the plain search
finds, and that reused forms give the fingerprints built from scratch."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest

from rd2h_protocol.checker import canonical, footprint
from rd2h_protocol.checker import explore as explorer
from rd2h_protocol.checker.canonical import EndpointForms, fingerprint
from rd2h_protocol.checker.configs import CONFIGS
from rd2h_protocol.checker.explore import _key, explore
from rd2h_protocol.checker.model import Action
from rd2h_protocol.checker.snapshot import load_world
from rd2h_protocol.checker.world import World
from rd2h_protocol.completion import RankReport

P0, D0, D1 = footprint.agent("P", 0), footprint.agent("D", 0), footprint.agent("D", 1)


def fp(*tokens: footprint.Token) -> footprint.Footprint:
    return frozenset(tokens)


# -- conflict ------------------------------------------------------------------------------


def test_actions_of_one_agent_conflict_and_of_two_agents_do_not() -> None:
    assert footprint.conflict(fp(P0), fp(P0))
    assert not footprint.conflict(fp(P0), fp(D0))
    assert not footprint.conflict(fp(D0), fp(D1))


def test_taking_a_head_commutes_with_appending_to_the_same_queue() -> None:
    deliver = fp(D0, footprint.take("p0", "d0"))
    publish = fp(P0, footprint.append("p0", "d0"))
    assert not footprint.conflict(deliver, publish)


def test_two_appends_or_two_takes_of_one_queue_conflict() -> None:
    assert footprint.conflict(fp(footprint.append("a", "b")), fp(footprint.append("a", "b")))
    assert footprint.conflict(fp(footprint.take("a", "b")), fp(footprint.take("a", "b")))
    # The other direction of the connection is another queue.
    assert not footprint.conflict(fp(footprint.append("a", "b")), fp(footprint.append("b", "a")))


def test_a_purge_conflicts_with_anything_on_either_direction() -> None:
    purge = fp(footprint.purge("b", "a"))
    assert footprint.conflict(purge, fp(footprint.take("a", "b")))
    assert footprint.conflict(fp(footprint.append("b", "a")), purge)
    assert footprint.conflict(purge, fp(footprint.purge("a", "b")))
    assert not footprint.conflict(purge, fp(footprint.take("a", "c")))


def test_a_storage_write_conflicts_with_its_reads_only() -> None:
    write = fp(footprint.storage_write("p0.0"))
    assert footprint.conflict(write, fp(footprint.storage_read("p0.0")))
    assert footprint.conflict(fp(footprint.storage_read("p0.0")), write)
    assert footprint.conflict(write, write)
    assert not footprint.conflict(write, fp(footprint.storage_read("p1.0")))
    read = fp(footprint.storage_read("p0.0"))
    assert not footprint.conflict(read, read)


def test_budgets_and_everything_conflict() -> None:
    assert footprint.conflict(fp(footprint.BUDGETS, D0), fp(footprint.BUDGETS, P0))
    assert footprint.conflict(fp(footprint.EVERYTHING), fp())
    assert footprint.conflict(fp(), fp(footprint.EVERYTHING))


# -- what the world notes ------------------------------------------------------------------


def _taken(world: World, act: Action) -> footprint.Footprint:
    with footprint.recording() as touched:
        world.apply(act)
    return frozenset(touched)


def test_the_world_notes_a_write_a_delivery_and_a_fault() -> None:
    world = World(CONFIGS["tp2-d1"])
    session = world.ranks[0].session
    write = _taken(world, ("write", 0))
    assert {P0, footprint.storage_write(session)} <= write
    assert footprint.append(session, world.conn_name(0, 0)) in write
    assert not any(t[0] == "A" and t[1] == "D" for t in write)
    (i,) = [i for i in world.deliverable() if world.network[i].src[1] == session]
    lose = _taken(load_world(world.snapshot()), ("lose", i))
    assert footprint.BUDGETS in lose and footprint.take(session, world.conn_name(0, 0)) in lose
    deliver = _taken(world, ("deliver", i))
    assert D0 in deliver and footprint.take(session, world.conn_name(0, 0)) in deliver
    assert P0 not in deliver


def test_time_kills_and_breaks_conflict_with_everything() -> None:
    world = World(CONFIGS["reconnect+kill"])
    world.apply(("write", 0))  # a readiness in flight: its connection can break
    (brk,) = [a for a in world.actions() if a[0] == "break"]
    assert footprint.EVERYTHING in _taken(load_world(world.snapshot()), brk)
    assert footprint.EVERYTHING in _taken(load_world(world.snapshot()), ("kill_prefill", 0))
    world.settle()
    world.new_request(replace(CONFIGS["faults"].requests[0], ext_id="late"))
    world.decode_add("late")
    assert world.actions()[-1][0] == "advance"
    assert footprint.EVERYTHING in _taken(world, world.actions()[-1])


# -- independence holds in the real world --------------------------------------------------


def _locate(world: World, key: Action) -> Action | None:
    for act in world.actions():
        if _key(world, act) == key:
            return act
    return None


@pytest.mark.parametrize("name", ["tp2-d2", "faults+dup", "two-engines+abort"])
def test_actions_called_independent_commute(name: str) -> None:
    """Breadth first over the first states of a configuration: every pair of enabled actions
    whose footprints do not conflict is taken in both orders; each stays enabled after the
    other, and both orders end in the same state."""
    root = World(CONFIGS[name])
    queue = deque([root.snapshot()])
    seen = {fingerprint(root)}
    pairs = 0
    for _ in range(120):
        if not queue:
            break
        data = queue.popleft()
        state = load_world(data)
        acts = state.actions()
        taken: list[tuple[Action, footprint.Footprint, World]] = []
        for act in acts:
            child = load_world(data)
            try:
                touched = _taken(child, act)
            except Exception:  # a violation: the explorer stops there; so do we
                continue
            taken.append((_key(state, act), touched, child))
            child_fp = fingerprint(child)
            if child_fp not in seen:
                seen.add(child_fp)
                queue.append(child.snapshot())
        for n, (key_a, fp_a, after_a) in enumerate(taken):
            for key_b, fp_b, after_b in taken[n + 1 :]:
                if footprint.conflict(fp_a, fp_b):
                    continue
                pairs += 1
                ab, ba = load_world(after_a.snapshot()), load_world(after_b.snapshot())
                act_b, act_a = _locate(ab, key_b), _locate(ba, key_a)
                assert act_b is not None, f"{key_a} disabled {key_b}"
                assert act_a is not None, f"{key_b} disabled {key_a}"
                assert _taken(ab, act_b) == fp_b, f"{key_b} ran otherwise after {key_a}"
                assert _taken(ba, act_a) == fp_a, f"{key_a} ran otherwise after {key_b}"
                assert fingerprint(ab) == fingerprint(ba), f"{key_a} and {key_b} do not commute"
    assert pairs > 100


# -- the reduction keeps every state -------------------------------------------------------


# Complete explorations of 2,271 to 10,002 states (~30 s of CPU for the three, both ways);
# the timeout guards against a hang on a loaded machine.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["v1-prefill", "handshake", "faults"])
def test_sleep_sets_find_every_state_with_fewer_transitions(name: str) -> None:
    """The same distinct states, final states, depth and violations (v1-prefill has its two
    expected ones) as the plain search, with fewer transitions. (The states of a search
    are those of the canonical form, so this also holds the form to giving equal states
    equal successors, whatever path reached them: it once kept a parked abort's reason
    text and counted 30 states of ``parking`` twice over, depending on the order.)"""
    reduced = explore(name, CONFIGS[name])
    plain = explore(name, CONFIGS[name], sleep_sets=False)
    assert reduced.complete and plain.complete
    assert (reduced.states, reduced.final_states, reduced.depth) == (
        plain.states,
        plain.final_states,
        plain.depth,
    )
    assert set(reduced.found) == set(plain.found) and reduced.passed
    assert reduced.transitions < plain.transitions


def test_updating_a_waiting_completion_with_no_reports_changes_nothing() -> None:
    """The one read the footprints leave out (see the footprint module): every action's
    cross-rank gathering updates each non-idle engine with empty reports. In the model
    that is a no-op, however late: its ids are always mapped, and no collect timeout."""
    world = World(CONFIGS["tp2-d2"])
    completion = world.completions[0]
    assert completion.collect_timeout_s is None
    rank0_done = [RankReport(("r0",)), RankReport()]
    assert completion.update(rank0_done, lambda ext: ext, 0.0).finished == ()
    before = completion.pending()
    for now in (0.0, 1.0, 1e6):
        result = completion.update([RankReport(), RankReport()], lambda ext: ext, now)
        assert (result.finished, result.load_errors, result.dropped) == ((), frozenset(), ())
        assert completion.pending() == before


# -- forms of untouched endpoints ----------------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tp2-d2", "reconnect+kill", "two-engines+dup", "parking+abort"])
def test_reused_endpoint_forms_give_the_fingerprint_built_from_scratch(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = canonical.fingerprint_reusing
    checked = []

    def checking(world: World, inherited: EndpointForms) -> tuple[int, EndpointForms]:
        h, forms = built(world, inherited)
        assert h == fingerprint(world), f"forms {sorted(inherited)} inherited wrongly"
        checked.append(len(inherited))
        return h, forms

    monkeypatch.setattr(explorer, "fingerprint_reusing", checking)
    explore(name, CONFIGS[name], max_states=1500)
    # Children inherit often (an action touches one agent; time, kills and breaks all).
    assert len(checked) > 1500 and sum(1 for n in checked if n) > len(checked) // 4
