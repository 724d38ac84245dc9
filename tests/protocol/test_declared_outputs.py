"""Every output an effect's handler emits is among the output types its effect declares.

Each endpoint machine declares, per effect, the output types its handler may emit
(``MachineSpec.outputs``, the "outputs" column of specs/machines.md). This test drives the
real endpoints through the model checker's worlds (every configuration, bounded) with each
bound handler wrapped so that an output constructed while it runs is attributed to the
innermost effect running (an effect that fires another machine's row does not own what
that row's handler emits), and checks every attribution against the declaration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import rd2h_protocol.events as events
from rd2h_protocol.checker.configs import CONFIGS
from rd2h_protocol.checker.explore import explore
from rd2h_protocol.consumer import ConsumerEndpoint
from rd2h_protocol.machines.declare import BoundMachine, MachineSpec
from rd2h_protocol.producer.handshakes import ConnectionEffects
from rd2h_protocol.producer.kept import KeptEffects
from rd2h_protocol.producer.publications import GateEffects, PublicationEffects
from rd2h_protocol.producer.requests import RequestEffects

#: The Prefill side's effects objects, one per machine: each binds its machine's table.
PRODUCER_EFFECTS = (RequestEffects, ConnectionEffects, PublicationEffects, GateEffects, KeptEffects)

#: Every output type the endpoints can emit (what their ``Output`` unions name).
OUTPUT_TYPES: tuple[type, ...] = tuple(
    t for union in (events.ProducerOutput, events.ConsumerOutput) for t in union.__args__
)

#: (machine, effect) -> output type names seen emitted by that effect's handler.
Seen = dict[tuple[str, str], set[str]]


def _bound_machines() -> list[BoundMachine]:
    found: dict[int, BoundMachine] = {}
    for cls in (ConsumerEndpoint, *PRODUCER_EFFECTS):
        for klass in cls.__mro__:
            for value in vars(klass).values():
                if isinstance(value, BoundMachine):
                    found[id(value)] = value
    return list(found.values())


@contextmanager
def recording() -> Iterator[Seen]:
    """Attribute each output constructed while a bound handler runs to that handler's
    (machine, effect), innermost first, for as long as the context is open."""
    seen: Seen = {}
    running: list[tuple[str, str]] = []
    saved_inits: dict[type, Any] = {}
    saved_tables: list[tuple[BoundMachine, str, dict[Any, Any]]] = []

    def wrap_init(cls: type) -> None:
        original = cls.__init__  # type: ignore[misc]
        saved_inits[cls] = original
        name = cls.__name__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            if running:
                seen.setdefault(running[-1], set()).add(name)
            original(self, *args, **kwargs)

        cls.__init__ = init  # type: ignore[misc]

    def wrap_handler(key: tuple[str, str], handler: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            running.append(key)
            try:
                return handler(*args, **kwargs)
            finally:
                running.pop()

        return run

    for cls in OUTPUT_TYPES:
        wrap_init(cls)
    for bound in _bound_machines():
        spec = bound.spec
        for attr in ("_dispatch", "_batch_dispatch"):
            table = getattr(bound, attr)
            saved_tables.append((bound, attr, table))
            setattr(
                bound,
                attr,
                {
                    key: (wrap_handler((spec.name, spec.table[key][0]), h), dest)
                    for key, (h, dest) in table.items()
                },
            )
    try:
        yield seen
    finally:
        for cls, original in saved_inits.items():
            cls.__init__ = original  # type: ignore[misc]
        for bound, attr, table in saved_tables:
            setattr(bound, attr, table)


def _specs() -> dict[str, MachineSpec]:
    return {b.spec.name: b.spec for b in _bound_machines()}


def undeclared(seen: Seen) -> list[str]:
    """Each (machine, effect, output) seen that the effect does not declare."""
    specs = _specs()
    wrong = []
    for (machine, effect), names in sorted(seen.items()):
        declared = {t.__name__ for t in specs[machine].outputs_of(effect)}
        wrong.extend(f"{machine}: {effect} emitted {n}" for n in sorted(names - declared))
    return wrong


def test_every_endpoint_machine_declares_its_outputs() -> None:
    for spec in _specs().values():
        assert spec.outputs is not None, spec.name
        for effect in spec.effects:
            for t in spec.outputs_of(effect):
                assert t in OUTPUT_TYPES, (spec.name, effect, t)


# Bounded: 300 states of every configuration (its variants included) reach every effect
# and output type that 1,000 states reach (23 pairs), at a third of the time.
_STATES = 300


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_handlers_emit_only_declared_outputs(name: str) -> None:
    cfg = CONFIGS[name]
    with recording() as seen:
        explore(name, cfg, max_states=_STATES)
    assert undeclared(seen) == []


def test_recording_attributes_to_the_innermost_handler() -> None:
    """The wrapper sees outputs (a sanity check that the instrumentation is live)."""
    with recording() as seen:
        explore("tp2-d1", CONFIGS["tp2-d1"], max_states=500)
    assert any(names for names in seen.values())
