"""Every invariant of rd2h_protocol.checker.invariants, checked by calling its check directly: once
on a small state where it holds, once on the same state broken by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rd2h_protocol.checker.invariants import (
    INVARIANTS,
    InvariantViolation,
    check_done_on_rank,
    check_idle,
    check_quiescent,
    check_read_may_start,
    check_release,
    check_single_outcome,
    check_storage_gates,
)
from rd2h_protocol.checker.model import RequestSpec, WorldConfig
from rd2h_protocol.checker.world import World
from rd2h_protocol.machines.producer import GATE_OPEN

SMALL = WorldConfig(p_tp=1, engines=(1,), n_layers=2, n_storages=1)


def _published() -> World:
    """One request; Prefill wrote and published layer 0, Decode started its read."""
    world = World(SMALL)
    world.new_request(RequestSpec("r", 0, (2,)))
    world.decode_add("r")
    world.prefill_add("r")
    world.write_layer(0)
    while not world.reads:
        world.deliver(world.deliverable()[0])
    return world


def _open_every_gate(world: World) -> None:
    """The broken state: Prefill's storage gates open while layer 0 is outstanding."""
    for gate in world.producers[0].state.gates.values():
        gate.state = GATE_OPEN


def _settled(*, released: bool) -> World:
    world = World(SMALL)
    world.new_request(RequestSpec("r", 0, (2,)))
    world.settle()
    if released:
        world.release_all()
        world.settle()
    return world


def _check_s1(world: World) -> None:
    check_storage_gates(world.ranks[0].session, world.producers[0])
    for (_, _, read_id), read in world.reads.items():
        check_read_may_start("d0", read_id, read.plan.session, world.producers[0], read.layer)


def s1_holds() -> None:
    _check_s1(_published())


def s1_broken() -> None:
    world = _published()
    _open_every_gate(world)
    _check_s1(world)


def s1_read_broken() -> None:
    """The read check alone: a gate open (and counting nothing) under a pending read."""
    world = _published()
    _open_every_gate(world)
    for gate in world.producers[0].state.gates.values():
        gate.outstanding = 0
    world.producers[0].state.pubs.clear()
    check_storage_gates(world.ranks[0].session, world.producers[0])  # blind to the read
    _check_s1(world)


def s2_holds() -> None:
    check_done_on_rank("d0", "r", {0, 1}, 2)
    check_single_outcome("d0", "r", None, "done")


def s2_broken() -> None:
    check_done_on_rank("d0", "r", {1}, 2)


def s2_twice() -> None:
    check_single_outcome("d0", "r", "failed", "done")


def _check_s3(world: World, ext: str) -> None:
    cons = world.consumers[(0, 0)]
    writing = [rid for rid, exts in cons.in_flight_reads().items() if ext in exts]
    check_release("d0", ext, writing)


def s3_holds() -> None:
    world = _published()
    world.finish_read(next(iter(world.reads)))
    _check_s3(world, "r")


def s3_broken() -> None:
    _check_s3(_published(), "r")  # its read of layer 0 is in flight


def _check_l1(world: World) -> None:
    check_quiescent({world.ranks[0].session: world.producers[0]}, {"d0": world.consumers[(0, 0)]})


def l1_holds() -> None:
    _check_l1(_settled(released=False))


def l1_broken() -> None:
    _check_l1(_published())


def _check_b1(world: World) -> None:
    check_idle(
        {world.ranks[0].session: world.producers[0]},
        {"d0": world.consumers[(0, 0)]},
        {"0": world.completions[0]},
    )


def b1_holds() -> None:
    _check_b1(_settled(released=True))


def b1_broken() -> None:
    _check_b1(_settled(released=False))  # Decode still holds the finished request


#: Per invariant: the states where it holds, and the states that break it.
CASES: dict[str, tuple[list[Callable[[], None]], list[Callable[[], None]]]] = {
    "S1": ([s1_holds], [s1_broken, s1_read_broken]),
    "S2": ([s2_holds], [s2_broken, s2_twice]),
    "S3": ([s3_holds], [s3_broken]),
    "L1": ([l1_holds], [l1_broken]),
    "B1": ([b1_holds], [b1_broken]),
}


def test_every_invariant_of_the_spec_has_its_cases() -> None:
    assert set(CASES) == {inv.name for inv in INVARIANTS}


def _params(which: int) -> list[object]:
    return [
        pytest.param(name, state, id=state.__name__)
        for name, cases in CASES.items()
        for state in cases[which]
    ]


@pytest.mark.parametrize(("name", "state"), _params(0))
def test_invariant_holds(name: str, state: Callable[[], None]) -> None:
    state()


@pytest.mark.parametrize(("name", "state"), _params(1))
def test_invariant_broken_is_reported_by_name(name: str, state: Callable[[], None]) -> None:
    with pytest.raises(InvariantViolation) as info:
        state()
    assert info.value.name == name
