"""The declaration core (rd2h_protocol.machines.declare) and the small shared modules."""

from __future__ import annotations

import pytest
from transitions import MachineError

from rd2h_protocol.errors import LocalProtocolError, MissingExtra, RemoteProtocolError
from rd2h_protocol.machines.declare import (
    NO_EFFECT,
    BoundMachine,
    Guard,
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


def test_react_runs_a_stay_without_a_record_and_refuses_a_move() -> None:
    owner, bound = bound_gate()
    bound.react(owner, None, "closed", "RECV_STALE", 1)
    assert owner.seen == [("ignore", "", (1,))]
    with pytest.raises(ValueError, match="use fire"):
        bound.react(owner, None, "open", "LOCAL_PUBLISH")


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
