"""One declaration per state machine, two uses.

Each machine is declared once, as data, in the ``transitions`` package's declarative form
(``states``, ``initial`` and ``transitions`` entries with ``trigger``, ``source``, ``dest``
and optional ``conditions``), plus the name of the side effect each transition has. From
that declaration we derive

* :attr:`MachineSpec.table`: a plain ``{(state, input): (effect, next_state)}`` dict that
  the endpoints use on the hot path (a dict lookup, far cheaper than a transition of a
  ``transitions`` Machine: ``python -m benchmarks.bench_machines`` measures both), and
* :meth:`MachineSpec.build_machine`: a ``transitions.Machine`` for tests and benchmarks
  (``transitions`` comes with the ``rd2h[machines]`` extra; the protocol itself never
  imports it).

Inputs are named ``SEND_*`` / ``RECV_*`` / ``LOCAL_*`` / ``TIMER_*``. Guards are resolved by
the caller before the lookup (an input such as ``RECV_LAST_REPLY`` already says the guard
held); the ``conditions`` in the declaration name that guard so the ``transitions``
Machine and the generated diagram show it. A (state, input) pair missing from the table
is a protocol violation: :meth:`MachineSpec.step` raises the error class the caller names
(h2's rule: what is not allowed is refused, never ignored by accident).

The table drives the action, as in h2's ``stream.py``: an endpoint binds every declared
effect to exactly one handler (:meth:`MachineSpec.bind`, checked when the module is
imported: an effect without a handler, or a handler for no declared effect, raises), and
:meth:`BoundMachine.fire` looks ``(record.state, input)`` up, sets the new state, then
runs the bound handler. Each guard a declaration names is declared next to its table
(``GUARDS``: what it says and which method resolves it) and rendered in the docs.

An input that arrives for many records at once (one readiness names 64 requests) may be
declared *batched* (``MachineSpec.batched``): :meth:`BoundMachine.apply_batch` then takes
the records in order, looks the table up once per run of records in one state, sets
their states and runs the bound handler once for the run, which gets the run's records
instead of one. The rows are the same rows (the table, the diagram and the checker see
no difference); only the handlers of a batched input's effects take a run, so an effect
is reached by batched inputs only or by unbatched inputs only (checked at import).

An input may be declared typed (:class:`Input`: ``Input[Ctx]``): it carries ONE context
value, and :meth:`BoundMachine.apply` fires it with that value, which mypy checks against
the input's declared type, and every handler it reaches takes ``(owner, record, ctx)``
instead of positional arguments padded to one shape for all the inputs that reach it.
Every endpoint machine's inputs are typed; :meth:`BoundMachine.fire` keeps the untyped
``*args`` form for the runtime's and the adapter's small machines. A batched input's
handlers take ``(owner, run, ctx)``, and an input for a record that may not exist is
applied with :meth:`BoundMachine.apply_react`.

An endpoint machine also declares, per effect, the output types its handler may emit
(``MachineSpec.outputs``; every effect named, :data:`NO_EFFECT` included where used): the
"outputs" column of specs/machines.md, and a test drives the endpoints with each handler
watched and fails on an output its effect does not declare (an output is attributed to the
innermost handler running: one whose handler fires another machine's row does not declare
what that row's handler emits).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypedDict, TypeVar

from rd2h_protocol.errors import LocalProtocolError, ProtocolError


class TransitionDecl(TypedDict, total=False):
    """One entry of a declaration, in the ``transitions`` package's own key names."""

    trigger: str
    source: str | list[str]
    dest: str
    conditions: str | list[str]
    effect: str  # ours: the name of the side effect the endpoint performs


NO_EFFECT: Final = "none"

C = TypeVar("C")


class Input(str, Generic[C]):
    """An input name that says the type of the one context value its firing carries.

    It is the name (a ``str``: declarations, tables and specs use it unchanged);
    ``Input[Ctx]`` in its annotation lets :meth:`BoundMachine.apply` check, with mypy,
    that the context given is a ``Ctx``. Every handler the input reaches takes
    ``(owner, record, ctx)``. At run time ``Input(name)`` IS ``name``, the plain ``str``:
    the tables' keys and the hot path's lookups stay exact strings (a ``str`` subclass
    key costs the dict its string fast path, ~10 ns a lookup).
    """

    __slots__ = ()

    def __new__(cls, name: str) -> Input[C]:
        return name  # type: ignore[return-value]


@dataclass(frozen=True)
class Guard:
    """One guard a declaration names: what it says, and the method that resolves it."""

    says: str
    resolved_by: str


@dataclass(frozen=True)
class MachineSpec:
    """A state machine declared once as data."""

    name: str
    doc: str
    states: tuple[str, ...]
    initial: str
    transitions: tuple[TransitionDecl, ...]
    terminal: frozenset[str] = frozenset()
    #: What each guard the declaration names says, and the method that resolves it (given
    #: a mapping, every ``conditions`` name must be in it; only those named are kept).
    guards: Mapping[str, Guard] = field(default_factory=dict, repr=False, compare=False)
    #: Inputs fired for runs of records (:meth:`BoundMachine.apply_batch`); their effects'
    #: handlers take the run's records.
    batched: frozenset[str] = frozenset()
    #: The output types each effect's handler may emit, by effect (every effect named; a
    #: handler that emits nothing maps to ``()``). None: not declared (a machine whose
    #: effects return to their caller instead of emitting outputs).
    outputs: Mapping[str, tuple[type, ...]] | None = field(default=None, repr=False, compare=False)
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
        self._check_batched()
        self._check_outputs()
        if self.guards:
            named = self.guard_names()
            missing = [g for g in named if g not in self.guards]
            if missing:
                raise ValueError(f"{self.name}: guards {missing} are not declared")
            object.__setattr__(self, "guards", {g: self.guards[g] for g in named})

    def _check_batched(self) -> None:
        """Batched inputs are declared ones, and share no effect with unbatched inputs
        (a handler takes either one record or a run of them; :data:`NO_EFFECT` does both)."""
        unknown = self.batched - set(self.inputs)
        if unknown:
            raise ValueError(f"{self.name}: batched inputs {sorted(unknown)} are not declared")
        by_kind: dict[bool, set[str]] = {True: set(), False: set()}
        for (_, event), (effect, _) in self.table.items():
            by_kind[event in self.batched].add(effect)
        shared = (by_kind[True] & by_kind[False]) - {NO_EFFECT}
        if shared:
            raise ValueError(
                f"{self.name}: effects {sorted(shared)} are reached by batched and unbatched "
                "inputs alike"
            )

    def _check_outputs(self) -> None:
        """Declared outputs name exactly the effects the table uses."""
        if self.outputs is None:
            return
        missing = self.effects - self.outputs.keys()
        extra = self.outputs.keys() - self.effects
        if missing or extra:
            raise ValueError(
                f"{self.name}: effects without declared outputs {sorted(missing)}, "
                f"outputs declared for no effect {sorted(extra)}"
            )

    def outputs_of(self, effect: str) -> tuple[type, ...]:
        """The output types ``effect``'s handler may emit (``()`` when none are declared)."""
        return () if self.outputs is None else self.outputs[effect]

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
            raise self.refusal(state, event, error) from None

    def refusal(
        self, state: str, event: str, error: type[ProtocolError] = LocalProtocolError
    ) -> ProtocolError:
        """The error for a pair the table does not allow (what ``step`` and ``fire`` raise)."""
        return error(f"{self.name}: input {event} is not allowed in state {state}")

    @property
    def effects(self) -> frozenset[str]:
        """Every effect name the declaration uses (``none`` included where used)."""
        return frozenset(effect for effect, _ in self.table.values())

    def bind(self, handlers: Mapping[str, Handler]) -> BoundMachine:
        """Bind each declared effect to its handler; raise unless the keys match exactly.

        A handler is called as ``handler(owner, record, *args)`` after the state changed;
        the handler of a batched input's effect as ``handler(owner, records, *args)`` with
        a run of records (see :meth:`BoundMachine.apply_batch`). :data:`NO_EFFECT` must be
        bound too where the declaration uses it (to
        :func:`no_effect`, or to a handler when the caller has something to do).
        """
        missing = self.effects - handlers.keys()
        extra = handlers.keys() - self.effects
        if missing or extra:
            raise ValueError(
                f"{self.name}: effects without a handler {sorted(missing)}, "
                f"handlers for no declared effect {sorted(extra)}"
            )
        return BoundMachine(self, handlers)

    def guard_names(self) -> list[str]:
        """Every guard (``conditions`` name) the declaration uses, sorted."""
        return sorted({c for d in self.transitions for c in _as_list(d.get("conditions", []))})

    def build_machine(self, model: Any = None, **kwargs: Any) -> Any:
        """Build the equivalent ``transitions.Machine`` (tests and docs only).

        Conditions are guards the caller resolved already, so the model passed here gets a
        method per condition name that returns True unless it defines its own.
        """
        from transitions import Machine

        if model is None:
            model = _GuardModel(self.guard_names())
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


Handler = Callable[..., Any]


def no_effect(_owner: Any, _record: Any, *_args: Any) -> None:
    """The handler of :data:`NO_EFFECT`: the state change is all there is."""


class BoundMachine:
    """A :class:`MachineSpec` whose effects are bound to handlers: the table drives the action.

    The hot path is one dict lookup, one attribute store and one call.
    """

    __slots__ = ("_batch_dispatch", "_dispatch", "handlers", "spec")

    def __init__(self, spec: MachineSpec, handlers: Mapping[str, Handler]) -> None:
        self.spec = spec
        self.handlers = dict(handlers)
        # (apply and fire take the unbatched inputs' rows, apply_batch the batched ones')
        self._dispatch: dict[tuple[str, str], tuple[Handler, str]] = {}
        self._batch_dispatch: dict[tuple[str, str], tuple[Handler, str]] = {}
        for key, (effect, dest) in spec.table.items():
            rows = self._batch_dispatch if key[1] in spec.batched else self._dispatch
            rows[key] = (self.handlers[effect], dest)

    def _miss(
        self, state: str, event: str, error: type[ProtocolError], *, batched: bool
    ) -> Exception:
        """What a lookup that found no row raises: the refusal, or a ValueError when the
        input is fired the other way (batched or not)."""
        if (event in self.spec.batched) != batched:
            way = "apply_batch" if event in self.spec.batched else "apply"
            return ValueError(f"{self.spec.name}: {event} is fired with {way}")
        return self.spec.refusal(state, event, error)

    def fire(
        self,
        owner: Any,
        record: Any,
        event: str,
        *args: Any,
        error: type[ProtocolError] = LocalProtocolError,
    ) -> Any:
        """Set ``record.state`` by the table, then run the bound handler and return its result.

        A forbidden ``(record.state, event)`` raises ``error`` and changes nothing.
        """
        try:
            handler, record.state = self._dispatch[(record.state, event)]
        except KeyError:
            raise self._miss(record.state, event, error, batched=False) from None
        return handler(owner, record, *args)

    def apply(
        self,
        owner: Any,
        record: Any,
        event: Input[C],
        ctx: C,
        *,
        error: type[ProtocolError] = LocalProtocolError,
    ) -> None:
        """:meth:`fire` for a typed input: the bound handler gets ``(owner, record, ctx)``,
        ``ctx`` of the type ``event`` declares (checked by mypy at the call)."""
        try:
            handler, record.state = self._dispatch[(record.state, event)]
        except KeyError:
            raise self._miss(record.state, event, error, batched=False) from None
        handler(owner, record, ctx)

    def apply_batch(
        self,
        owner: Any,
        records: Sequence[Any],
        event: Input[C],
        ctx: C,
        *,
        error: type[ProtocolError] = LocalProtocolError,
    ) -> None:
        """:meth:`apply` for each of ``records`` in order, for a typed batched input: one
        lookup per run of consecutive records in one state, whose states are all set before
        the bound handler runs once with the run, as ``(owner, run, ctx)`` (a handler changes
        no other record's state).

        A forbidden pair raises ``error`` with the runs before it handled and its own
        records unchanged, as applying the input one record at a time would.
        """
        n = len(records)
        i = 0
        while i < n:
            state = records[i].state
            j = i + 1
            while j < n and records[j].state == state:
                j += 1
            try:
                handler, dest = self._batch_dispatch[(state, event)]
            except KeyError:
                raise self._miss(state, event, error, batched=True) from None
            run = records if j - i == n else records[i:j]
            for record in run:
                record.state = dest
            handler(owner, run, ctx)
            i = j

    def apply_react(
        self,
        owner: Any,
        record: Any,
        state: str,
        event: Input[C],
        ctx: C,
        *,
        error: type[ProtocolError] = LocalProtocolError,
    ) -> None:
        """:meth:`apply` for a typed input every declared source of which STAYS in its state,
        when the record may not exist (a peer bound to no session, a publication already
        ended): ``state`` stands for its state, and the bound handler gets ``(owner,
        record, ctx)`` with ``record`` possibly None."""
        try:
            handler, dest = self._dispatch[(state, event)]
        except KeyError:
            raise self._miss(state, event, error, batched=False) from None
        if dest != state:
            raise ValueError(f"{self.spec.name}: {event} leaves {state}; use apply")
        handler(owner, record, ctx)


def check_guards(specs: Sequence[MachineSpec], guards: Mapping[str, Guard]) -> None:
    """Raise unless ``guards`` declares exactly the guards ``specs`` name."""
    named = {g for spec in specs for g in spec.guard_names()}
    missing = named - guards.keys()
    extra = guards.keys() - named
    if missing or extra:
        raise ValueError(f"undeclared guards {sorted(missing)}, unused guards {sorted(extra)}")


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
