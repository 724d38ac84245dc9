"""The model world's Prefill-first flow (``WorldConfig.prefill_first``): Prefill computes a
request for no Decode and keeps it, Decode claims it over its own channel, and each fault
the explorer injects there ends as the protocol says (the exploration itself is in
test_explore.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import test_footprints

from rd2h_protocol.checker.configs import CONFIGS
from rd2h_protocol.checker.invariants import InvariantViolation, check_claim_answer
from rd2h_protocol.checker.model import CLAIM_KINDS
from rd2h_protocol.checker.world import World

CFG = replace(CONFIGS["prefill-first"], budgets=())


def computed_and_kept() -> World:
    """r0's prompt computed (two layers, nothing published) and kept on Prefill."""
    world = World(CFG)
    assert world.actions()[0] == ("write", 0) and not world.may_decode_add("r0")
    world.apply(("write", 0))
    world.apply(("write", 0))
    assert world.network == []  # no Decode named: nothing published
    assert world.producers[0].kept() == {"r0": "waiting"}
    assert world.may_decode_add("r0")
    return world


def claims(world: World, kinds: frozenset[str] = CLAIM_KINDS) -> list[int]:
    """The claim exchange's frames that may be delivered now (``kinds``: of these kinds)."""
    return [i for i in world.deliverable() if world.network[i].kind in kinds]


def test_decode_claims_and_reads_a_kept_request() -> None:
    world = computed_and_kept()
    world.apply(("decode_add", "r0"))
    (claim,) = claims(world)
    world.apply(("deliver", claim))
    assert world.producers[0].kept() == {"r0": "claimed"}
    assert {f.kind for f in world.network} == {"ClaimAnswer", "ReadReadyBatch"}
    world.settle()
    world.check_quiescent()
    req = world.reqs["r0"]
    assert req.finished and not req.load_error  # every layer read, in the right blocks
    assert ("p0.0", "r0") in world._prefill_finished and world._kept == {}
    world.check_idle()


def test_a_lost_claim_lets_the_window_run_out_and_decode_time_out() -> None:
    world = computed_and_kept()
    world.apply(("decode_add", "r0"))
    world.drop(claims(world)[0])  # Decode never comes, as far as Prefill knows
    world.settle()
    world.check_quiescent()
    assert world.producers[0].kept() == {} and world.producers[0].is_idle()
    assert world.producers[0].stats.unclaimed == 1
    assert world.reqs["r0"].load_error  # Decode's load timeout
    world.check_idle()


def test_a_claim_after_the_window_is_refused_and_decode_fails_the_request() -> None:
    world = computed_and_kept()
    world.advance_to(world.now + CFG.claim_timeout_s)
    world.fire_timer(("P", 0, 0))
    assert world.producers[0].kept() == {} and world._kept == {}
    world.apply(("decode_add", "r0"))
    world.deliver(claims(world)[0])
    (answer,) = claims(world)
    assert world.network[answer].kind == "ClaimAnswer"
    world.deliver(answer)  # refused: Decode fails r0 at once, not at its load timeout
    req = world.reqs["r0"]
    assert req.decode_aborted and req.finished and req.load_error
    world.settle()
    world.check_quiescent()
    world.check_idle()


def test_a_claim_delivered_twice_is_refused_the_second_time_and_ignored() -> None:
    world = computed_and_kept()
    world.apply(("decode_add", "r0"))
    world.deliver_duplicated(claims(world)[0])
    (copy,) = claims(world, frozenset({"Claim"}))
    world.deliver(copy)  # the first answer waits on the other queue
    assert world.producers[0].stats.claimed == 1
    assert world.producers[0].stats.claims_refused == 1
    world.settle()  # the accepted answer first, then the refusal: ignored
    world.check_quiescent()
    assert not world.reqs["r0"].load_error and not world.reqs["r0"].decode_aborted


def test_a_prefill_killed_after_keeping_refuses_the_claim_of_its_predecessor() -> None:
    world = computed_and_kept()
    world.kill_prefill(0)
    assert world._kept == {}  # what it kept died with it
    world.apply(("decode_add", "r0"))
    world.settle()
    world.check_quiescent()
    assert world.reqs["r0"].load_error and world.reqs["r0"].decode_aborted


def test_a_decode_killed_before_it_claims_leaves_prefill_to_its_window() -> None:
    world = computed_and_kept()
    world.kill_decode(0)
    assert world.reqs["r0"].abandoned
    world.settle()
    world.check_quiescent()
    assert world.producers[0].stats.unclaimed == 1
    world.check_idle()


def test_an_accepted_claim_of_a_request_not_waiting_breaks_s1() -> None:
    check_claim_answer("p0.0", "r0", "waiting", True)
    check_claim_answer("p0.0", "r0", "claimed", False)
    for before in ("claimed", None):
        with pytest.raises(InvariantViolation) as info:
            check_claim_answer("p0.0", "r0", before, True)
        assert info.value.name == "S1"


def test_a_kept_request_never_finished_breaks_l1() -> None:
    world = computed_and_kept()
    world.producers[0].state.kept_timers.clear()  # as if its claim window were never armed
    world.apply(("decode_add", "r0"))
    world.drop(claims(world)[0])
    world.settle()
    with pytest.raises(InvariantViolation, match="still keeps") as info:
        world.check_quiescent()
    assert info.value.name == "L1"


# -- the explorer's reductions hold on the claim exchange ---------------------------------


# (prefill-first alone has 52 such pairs in its first states, below that test's floor.)
@pytest.mark.parametrize("name", ["prefill-first+dup", "prefill-first+abort"])
def test_actions_called_independent_commute(name: str) -> None:
    """Every pair of actions whose footprints do not conflict (claims, answers and keeps
    among them) commutes in the real world (see test_footprints.py)."""
    test_footprints.test_actions_called_independent_commute(name)


@pytest.mark.timeout(600)
def test_sleep_sets_find_every_state_of_prefill_first() -> None:
    test_footprints.test_sleep_sets_find_every_state_with_fewer_transitions("prefill-first")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["prefill-first", "prefill-first+dup"])
def test_reused_endpoint_forms_give_the_fingerprint_built_from_scratch(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    test_footprints.test_reused_endpoint_forms_give_the_fingerprint_built_from_scratch(
        name, monkeypatch
    )
