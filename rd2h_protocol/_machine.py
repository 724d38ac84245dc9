"""One declaration per state machine, two uses.

Each machine is declared once, as data, in the ``transitions`` package's declarative form
(``states``, ``initial`` and ``transitions`` entries with ``trigger``, ``source``, ``dest``
and optional ``conditions``), plus the name of the side effect each transition has. From
that declaration we derive

* :attr:`MachineSpec.table`: a plain ``{(state, input): (effect, next_state)}`` dict that
  the endpoints use on the hot path (a dict lookup costs ~0.2 us, a ``transitions``
  Machine ~8 us per transition), and
* :meth:`MachineSpec.build_machine`: a ``transitions.Machine`` for tests and benchmarks
  (``transitions`` comes with the ``rd2h[machines]`` extra; the protocol itself never
  imports it).

Inputs are named ``SEND_*`` / ``RECV_*`` / ``LOCAL_*`` / ``TIMER_*``. Guards are resolved by
the caller before the lookup (an input such as ``RECV_LAST_REPLY`` already says the guard
held); the ``conditions`` in the declaration name that guard so the ``transitions``
Machine and the generated diagram show it. A (state, input) pair missing from the table
is a protocol violation: :meth:`MachineSpec.step` raises the error class the caller names
(h2's rule: what is not allowed is refused, never ignored by accident).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypedDict

from rd2h_protocol.errors import LocalProtocolError, ProtocolError


class TransitionDecl(TypedDict, total=False):
    """One entry of a declaration, in the ``transitions`` package's own key names."""

    trigger: str
    source: str | list[str]
    dest: str
    conditions: str | list[str]
    effect: str  # ours: the name of the side effect the endpoint performs


NO_EFFECT: Final = "none"


@dataclass(frozen=True)
class MachineSpec:
    """A state machine declared once as data."""

    name: str
    doc: str
    states: tuple[str, ...]
    initial: str
    transitions: tuple[TransitionDecl, ...]
    terminal: frozenset[str] = frozenset()
    table: Mapping[tuple[str, str], tuple[str, str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        table: dict[tuple[str, str], tuple[str, str]] = {}
        known = set(self.states)
        if self.initial not in known:
            raise ValueError(f"{self.name}: initial state {self.initial!r} is not declared")
        for decl in self.transitions:
            dest = decl["dest"]
            if dest not in known:
                raise ValueError(f"{self.name}: dest {dest!r} is not a declared state")
            for source in _as_list(decl["source"]):
                if source not in known:
                    raise ValueError(f"{self.name}: source {source!r} is not a declared state")
                key = (source, decl["trigger"])
                if key in table:
                    raise ValueError(f"{self.name}: {key} is declared twice")
                table[key] = (decl.get("effect", NO_EFFECT), dest)
        object.__setattr__(self, "table", table)

    @property
    def inputs(self) -> tuple[str, ...]:
        """Every input name, in declaration order."""
        return tuple(dict.fromkeys(d["trigger"] for d in self.transitions))

    def step(
        self, state: str, event: str, error: type[ProtocolError] = LocalProtocolError
    ) -> tuple[str, str]:
        """Return ``(effect, next_state)`` or raise ``error`` for a forbidden pair."""
        try:
            return self.table[(state, event)]
        except KeyError:
            raise error(f"{self.name}: input {event} is not allowed in state {state}") from None

    def _condition_names(self) -> list[str]:
        return sorted({c for d in self.transitions for c in _as_list(d.get("conditions", []))})

    def build_machine(self, model: Any = None, **kwargs: Any) -> Any:
        """Build the equivalent ``transitions.Machine`` (tests and docs only).

        Conditions are guards the caller resolved already, so the model passed here gets a
        method per condition name that returns True unless it defines its own.
        """
        from transitions import Machine

        if model is None:
            model = _GuardModel(self._condition_names())
        decls = [
            {k: v for k, v in d.items() if k in ("trigger", "source", "dest", "conditions")}
            for d in self.transitions
        ]
        return Machine(
            model=model,
            states=list(self.states),
            transitions=decls,
            initial=self.initial,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            **kwargs,
        )


def stay(
    trigger: str,
    sources: Sequence[str],
    effect: str | None = None,
    *,
    conditions: str | list[str] | None = None,
) -> tuple[TransitionDecl, ...]:
    """Self-transitions: ``trigger`` keeps each of ``sources`` in its state.

    (``transitions`` spells this ``"dest": "="``; the table needs the state named.)
    """
    out: list[TransitionDecl] = []
    for source in sources:
        decl: TransitionDecl = {"trigger": trigger, "source": source, "dest": source}
        if effect is not None:
            decl["effect"] = effect
        if conditions is not None:
            decl["conditions"] = conditions
        out.append(decl)
    return tuple(out)


class _GuardModel:
    """A model whose declared conditions all hold (guards are resolved before the lookup)."""

    def __init__(self, conditions: Sequence[str]) -> None:
        for name in conditions:
            setattr(self, name, _always_true)


def _always_true(*_args: Any, **_kwargs: Any) -> bool:
    return True


def _as_list(value: str | Sequence[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)
