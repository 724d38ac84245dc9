"""The declaration core (rd2h_protocol.machines.declare) and the small shared modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from transitions import MachineError

from rd2h_protocol.errors import LocalProtocolError, MissingExtra, RemoteProtocolError
from rd2h_protocol.machines.declare import (
    NO_EFFECT,
    BoundMachine,
    Guard,
    Input,
    MachineSpec,
    check_guards,
    no_effect,
    stay,
)
from rd2h_protocol.plan import ComponentAddrs, ReadPlan, RequestRead


def gate() -> MachineSpec:
    return MachineSpec(
        name="gate",
        doc="a tiny gate",
        states=("open", "closed"),
        initial="open",
        transitions=(
            {"trigger": "LOCAL_PUBLISH", "source": ["open", "closed"], "dest": "closed",
             "effect": "count"},
            {"trigger": "RECV_LAST_REPLY", "source": "closed", "dest": "open",
             "conditions": "is_last"},
            *stay("RECV_STALE", ["open", "closed"], "ignore"),
        ),
        terminal=frozenset(),
    )  # fmt: skip


def test_table_is_derived_from_the_declaration() -> None:
    spec = gate()
    assert spec.table == {
        ("open", "LOCAL_PUBLISH"): ("count", "closed"),
        ("closed", "LOCAL_PUBLISH"): ("count", "closed"),
        ("closed", "RECV_LAST_REPLY"): (NO_EFFECT, "open"),
        ("open", "RECV_STALE"): ("ignore", "open"),
        ("closed", "RECV_STALE"): ("ignore", "closed"),
    }
    assert spec.inputs == ("LOCAL_PUBLISH", "RECV_LAST_REPLY", "RECV_STALE")


def test_a_pair_missing_from_the_table_raises_the_named_error() -> None:
    spec = gate()
    assert spec.step("open", "LOCAL_PUBLISH") == ("count", "closed")
    with pytest.raises(LocalProtocolError, match="RECV_LAST_REPLY is not allowed in state open"):
        spec.step("open", "RECV_LAST_REPLY")
    with pytest.raises(RemoteProtocolError):
        spec.step("open", "RECV_LAST_REPLY", RemoteProtocolError)


def test_transitions_machine_agrees_with_the_table_on_every_pair() -> None:
    spec = gate()
    for state in spec.states:
        for event in spec.inputs:
            model = spec.build_machine().models[0]
            model.state = state
            if (state, event) in spec.table:
                getattr(model, event)()
                assert model.state == spec.table[(state, event)][1]
            else:
                with pytest.raises(MachineError):
                    getattr(model, event)()


def test_build_machine_honours_a_model_that_defines_its_guards() -> None:
    class Guarded:
        def is_last(self) -> bool:
            return False

    machine = gate().build_machine(Guarded())
    model = machine.models[0]
    model.LOCAL_PUBLISH()
    assert model.RECV_LAST_REPLY() is False  # the guard refused
    assert model.state == "closed"


def test_stay_declares_one_self_transition_per_state_with_guards() -> None:
    assert stay("T", ["a", "b"], conditions="c") == (
        {"trigger": "T", "source": "a", "dest": "a", "conditions": "c"},
        {"trigger": "T", "source": "b", "dest": "b", "conditions": "c"},
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"initial": "gone"}, "initial state 'gone'"),
        ({"transitions": ({"trigger": "T", "source": "open", "dest": "gone"},)}, "dest 'gone'"),
        ({"transitions": ({"trigger": "T", "source": "gone", "dest": "open"},)}, "source 'gone'"),
        (
            {"transitions": ({"trigger": "T", "source": "open", "dest": "open"},) * 2},
            "declared twice",
        ),
    ],
)
def test_inconsistent_declarations_are_refused(change: dict[str, object], match: str) -> None:
    base: dict[str, object] = {
        "name": "m",
        "doc": "",
        "states": ("open", "closed"),
        "initial": "open",
        "transitions": (),
    }
    with pytest.raises(ValueError, match=match):
        MachineSpec(**{**base, **change})  # type: ignore[arg-type]


class _Rec:
    def __init__(self, state: str) -> None:
        self.state = state


class _Owner:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, tuple[object, ...]]] = []

    def count(self, rec: _Rec | None, *args: object) -> str:
        self.seen.append(("count", "" if rec is None else rec.state, args))
        return "counted"

    def ignore(self, rec: _Rec | None, *args: object) -> None:
        self.seen.append(("ignore", "" if rec is None else rec.state, args))


def bound_gate() -> tuple[_Owner, BoundMachine]:
    return _Owner(), gate().bind(
        {"count": _Owner.count, "ignore": _Owner.ignore, NO_EFFECT: no_effect}
    )


def test_bind_refuses_a_missing_or_an_extra_handler() -> None:
    spec = gate()
    with pytest.raises(ValueError, match=r"without a handler \['none'\]"):
        spec.bind({"count": _Owner.count, "ignore": _Owner.ignore})
    with pytest.raises(ValueError, match=r"for no declared effect \['close'\]"):
        spec.bind(
            {"count": _Owner.count, "ignore": _Owner.ignore, NO_EFFECT: no_effect,
             "close": no_effect}
        )  # fmt: skip


def test_fire_sets_the_state_then_runs_the_handler_with_the_arguments() -> None:
    owner, bound = bound_gate()
    rec = _Rec("open")
    assert bound.fire(owner, rec, "LOCAL_PUBLISH", 7) == "counted"
    assert rec.state == "closed"
    assert owner.seen == [("count", "closed", (7,))]  # the handler sees the new state
    assert bound.fire(owner, rec, "RECV_LAST_REPLY") is None
    assert rec.state == "open"


def test_fire_refuses_a_forbidden_pair_and_changes_nothing() -> None:
    owner, bound = bound_gate()
    rec = _Rec("open")
    with pytest.raises(RemoteProtocolError, match="RECV_LAST_REPLY is not allowed in state open"):
        bound.fire(owner, rec, "RECV_LAST_REPLY", error=RemoteProtocolError)
    assert rec.state == "open" and owner.seen == []


def test_apply_react_runs_a_stay_without_a_record_and_refuses_a_move() -> None:
    owner, bound = bound_gate()
    bound.apply_react(owner, None, "closed", Input("RECV_STALE"), 1)
    assert owner.seen == [("ignore", "", (1,))]
    with pytest.raises(ValueError, match="use apply"):
        bound.apply_react(owner, None, "open", Input("LOCAL_PUBLISH"), None)


def test_guards_are_declared_for_every_condition_and_only_those() -> None:
    is_last = Guard("the last one", "Owner.check")
    spec = MachineSpec(
        name="g", doc="", states=("a", "b"), initial="a",
        transitions=({"trigger": "GO", "source": "a", "dest": "b", "conditions": "is_last"},),
        guards={"is_last": is_last, "unused": is_last},
    )  # fmt: skip
    assert spec.guards == {"is_last": is_last}  # only those it names are kept
    with pytest.raises(ValueError, match="unused guards"):
        check_guards([spec], {"is_last": is_last, "unused": is_last})
    with pytest.raises(ValueError, match=r"guards \['is_last'\] are not declared"):
        MachineSpec(
            name="g", doc="", states=("a", "b"), initial="a",
            transitions=({"trigger": "GO", "source": "a", "dest": "b", "conditions": "is_last"},),
            guards={"other": is_last},
        )  # fmt: skip


def lamp(batched: frozenset[str] = frozenset({"LOCAL_TICK"})) -> MachineSpec:
    """A machine with a batched input: TICK moves off -> on -> on, BREAK ends one lamp."""
    return MachineSpec(
        name="lamp",
        doc="",
        states=("off", "on", "broken"),
        initial="off",
        transitions=(
            {"trigger": "LOCAL_TICK", "source": ["off", "on"], "dest": "on", "effect": "light"},
            *stay("LOCAL_TICK", ["broken"]),
            {"trigger": "LOCAL_BREAK", "source": "on", "dest": "broken", "effect": "smash"},
        ),
        batched=batched,
    )


class _Lamps:
    def __init__(self) -> None:
        self.runs: list[tuple[str, list[str], tuple[object, ...]]] = []

    def light(self, recs: list[_Rec], *args: object) -> None:
        self.runs.append(("light", [r.state for r in recs], args))

    def smash(self, rec: _Rec, *args: object) -> None:
        self.runs.append(("smash", [rec.state], args))


def bound_lamp() -> tuple[_Lamps, BoundMachine]:
    handlers: dict[str, Callable[..., Any]] = {
        "light": _Lamps.light,
        "smash": _Lamps.smash,
        NO_EFFECT: no_effect,
    }
    return _Lamps(), lamp().bind(handlers)


def test_apply_batch_looks_up_once_per_run_of_one_state_and_hands_the_run_over() -> None:
    owner, bound = bound_lamp()
    recs = [_Rec(s) for s in ("off", "off", "on", "broken", "off")]
    bound.apply_batch(owner, recs, Input("LOCAL_TICK"), 7)
    assert [r.state for r in recs] == ["on", "on", "on", "broken", "on"]
    # runs in order; every record of a run is in its new state when the handler runs
    # (no_effect has the broken one; "off", "off" then "on" are two runs: two lookups)
    assert owner.runs == [
        ("light", ["on", "on"], (7,)),
        ("light", ["on"], (7,)),
        ("light", ["on"], (7,)),
    ]
    bound.apply_batch(owner, [], Input("LOCAL_TICK"), 7)  # nothing to fire: nothing happens
    assert len(owner.runs) == 3


def test_apply_batch_refuses_a_forbidden_run_after_handling_the_runs_before_it() -> None:
    spec = MachineSpec(
        name="m", doc="", states=("a", "b"), initial="a",
        transitions=({"trigger": "GO", "source": "a", "dest": "b", "effect": "go"},),
        batched=frozenset({"GO"}),
    )  # fmt: skip
    seen: list[int] = []
    bound = spec.bind({"go": lambda _owner, recs, _ctx: seen.append(len(recs))})
    recs = [_Rec("a"), _Rec("b"), _Rec("a")]
    with pytest.raises(RemoteProtocolError, match="GO is not allowed in state b"):
        bound.apply_batch(None, recs, Input("GO"), None, error=RemoteProtocolError)
    # as one record at a time: the first handled, the forbidden one and those after it not
    assert [r.state for r in recs] == ["b", "b", "a"] and seen == [1]


def test_a_batched_input_is_applied_only_with_apply_batch_and_the_others_not() -> None:
    owner, bound = bound_lamp()
    with pytest.raises(ValueError, match="LOCAL_TICK is fired with apply_batch"):
        bound.fire(owner, _Rec("off"), "LOCAL_TICK")
    with pytest.raises(ValueError, match="LOCAL_TICK is fired with apply_batch"):
        bound.apply_react(owner, None, "broken", Input("LOCAL_TICK"), None)
    with pytest.raises(ValueError, match="LOCAL_BREAK is fired with apply"):
        bound.apply_batch(owner, [_Rec("on")], Input("LOCAL_BREAK"), None)
    rec = _Rec("on")
    bound.fire(owner, rec, "LOCAL_BREAK", 1)
    assert rec.state == "broken" and owner.runs == [("smash", ["broken"], (1,))]


def test_batched_inputs_must_be_declared_and_share_no_effect_with_the_others() -> None:
    with pytest.raises(ValueError, match=r"batched inputs \['LOCAL_FLY'\] are not declared"):
        lamp(frozenset({"LOCAL_TICK", "LOCAL_FLY"}))
    # (the stays reach NO_EFFECT from both kinds: no conflict, it takes a record or a run)
    with pytest.raises(ValueError, match=r"effects \['light'\] are reached by batched and"):
        MachineSpec(
            name="m", doc="", states=("a", "b"), initial="a",
            transitions=(
                {"trigger": "T", "source": "a", "dest": "b", "effect": "light"},
                {"trigger": "U", "source": "b", "dest": "a", "effect": "light"},
                *stay("T", ["b"]),
                *stay("U", ["a"]),
            ),
            batched=frozenset({"T"}),
        )  # fmt: skip


def test_plan_total_bytes_counts_every_component_of_every_request() -> None:
    main = (ComponentAddrs("k", 0, 0, 1024), ComponentAddrs("v", 0, 0, 128))
    indexer = (ComponentAddrs("indexer", 0, 0, 128), ComponentAddrs("scale", 0, 0, 8))
    plan = ReadPlan(
        read_id=1,
        session="s",
        layer_name="l",
        main=main,
        indexer=indexer,
        requests=(
            RequestRead("a", [1, 2], [5, 6], [3], [7]),
            RequestRead("b", [], [], [4, 9], [1, 2]),
        ),
    )
    assert plan.total_bytes == 2 * 1152 + 3 * 136


def test_missing_extra_names_the_pip_extra() -> None:
    err = MissingExtra("nixl", "nixl")
    assert isinstance(err, ImportError)
    assert "pip install 'rd2h[nixl]'" in str(err)
    assert (err.module, err.extra) == ("nixl", "nixl")
