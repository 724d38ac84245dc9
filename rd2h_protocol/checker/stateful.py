"""Model-based testing of RD2H: a hypothesis state machine over the model world.

Theory of operation
-------------------
:class:`ProtocolStateMachine` is a :class:`hypothesis.stateful.RuleBasedStateMachine`
that drives a :class:`rd2h_protocol.checker.world.World`: real Prefill and Decode endpoints
(unequal TP, a reuse ring, chunked requests, two Decode engines by default), a simulated
network and a memory model that detects a read after reuse. Its rules are everything that
can happen to the protocol: requests arrive (on Decode, on Prefill, in either order),
the Prefill compute path writes layers (only when ``can_overwrite``), frames are delivered
in any order across connections (in order within one), dropped or duplicated (any frame
but a readiness: see :mod:`~rd2h_protocol.checker.world` for why), reads finish (well, with a
``TransferError``, or with a transient one), time passes and timers fire, either side
aborts, vLLM releases requests early, endpoints die and restart, and ``drain`` lets
everything settle to check liveness mid-run. After every step the invariants of
:mod:`rd2h_protocol.checker.invariants` are checked (most as the outputs that could break them are
executed; see :meth:`World.check`); at the end (``teardown``) the world settles and L1 and
B1 must hold.

This module imports hypothesis, which :mod:`rd2h_protocol` does not depend on: import it
from tests only (``import rd2h_protocol`` never imports it). Like zarr's
``zarr.testing.stateful``, it ships in the package so that other layers can reuse it with
real parts: subclass :class:`~rd2h_protocol.checker.world.World` and override
:meth:`~rd2h_protocol.checker.world.World.transmit` /
:meth:`~rd2h_protocol.checker.world.World.deliverable` (the network) or
:meth:`~rd2h_protocol.checker.world.World.execute_read` (the executor of read plans), then
subclass the machine and return it from :meth:`ProtocolStateMachine.make_world`::

    class LoopbackWorld(World):
        def execute_read(self, engine, d_rank, plan, start_by, layer):
            error = super().execute_read(engine, d_rank, plan, start_by, layer)
            ...  # also move the bytes with the real backend and compare
            return error

    class LoopbackMachine(ProtocolStateMachine):
        def make_world(self) -> World:
            return LoopbackWorld(self.world_config)

    TestLoopback = LoopbackMachine.TestCase
"""

from __future__ import annotations

import sys
from typing import ClassVar, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rd2h_protocol.checker.model import RequestSpec, WorldConfig
from rd2h_protocol.checker.world import World

__all__ = ["DEFAULT_WORLD", "ProtocolStateMachine"]

#: The default world: Prefill TP 2 feeding a Decode engine of TP 1 (ratio 2: two
#: contributors per Decode rank) and one of TP 2 (the main pool split over two ranks),
#: three layers over two storages (a reuse ring).
DEFAULT_WORLD: WorldConfig = WorldConfig(
    p_tp=2,
    engines=(1, 2),
    n_layers=3,
    n_storages=2,
    lease_ms=1000,
    handshake_timeout_s=0.6,
    park_timeout_s=0.3,
    kv_load_timeout_s=4.0,
    idle_steps=False,
)

_T = TypeVar("_T")
_INDEX = st.integers(min_value=0, max_value=255)
# How long time passes in one move: mostly less than the lease, sometimes past every
# deadline.
_DELAYS: list[float] = [0.01, 0.05, 0.1, 0.2, 0.4, 0.7, 1.5, 3.0]


def _pick(items: list[_T], index: int) -> _T:
    return items[index % len(items)]


class ProtocolStateMachine(RuleBasedStateMachine):
    """Random runs of the whole protocol; see the module docstring.

    Class attributes size a run: ``world_config``, ``max_requests`` (requests created per
    run), and per-run budgets for the faults (``max_drops``, ``max_duplicates``,
    ``max_aborts``, ``max_early_releases``, ``max_read_failures``, ``max_kills``) and for
    mid-run drains (``max_drains``), so that a run has time for requests to succeed
    between faults.
    """

    world_config: ClassVar[WorldConfig] = DEFAULT_WORLD
    max_requests: ClassVar[int] = 6
    max_drops: ClassVar[int] = 3
    max_duplicates: ClassVar[int] = 3
    max_aborts: ClassVar[int] = 2
    max_early_releases: ClassVar[int] = 2
    max_read_failures: ClassVar[int] = 2
    max_kills: ClassVar[int] = 1
    max_drains: ClassVar[int] = 1

    def __init__(self) -> None:
        super().__init__()
        self.world = self.make_world()
        self.created = 0
        self.drops = 0
        self.duplicates = 0
        self.aborts = 0
        self.early_releases = 0
        self.read_failures = 0
        self.kills = 0
        self.drains = 0

    def make_world(self) -> World:
        """The world a run drives (override to plug in real transports)."""
        return World(self.world_config)

    # -- what is enabled -------------------------------------------------------------------

    def _decode_addable(self) -> list[str]:
        return [
            x
            for x, r in self.world.reqs.items()
            if not r.decode_added and not r.abandoned and not r.released
        ]

    def _prefill_addable(self) -> list[str]:
        return [x for x, r in self.world.reqs.items() if not r.prefill_added]

    def _decode_live(self) -> list[str]:
        return [
            x
            for x, r in self.world.reqs.items()
            if r.decode_added and not r.abandoned and not r.released
        ]

    def _prefill_live(self) -> list[str]:
        return sorted({x for prod in self.world.producers for x in prod.requests()})

    def _moves(self) -> list[tuple[str, object]]:
        """What can happen next without a fault, in a fixed order."""
        world = self.world
        moves: list[tuple[str, object]] = [("deliver", i) for i in world.deliverable()]
        moves.extend(("read", key) for key in sorted(world.reads))
        moves.extend(("write", p) for p in range(len(world.producers)) if world.can_write(p))
        moves.extend(("timer", which) for which in world.timers())
        moves.append(("advance", None))
        return moves

    # -- requests --------------------------------------------------------------------------

    @precondition(lambda self: self.created < self.max_requests)
    @rule(
        engine=_INDEX,
        chunks=st.lists(st.integers(min_value=2, max_value=3), min_size=1, max_size=3),
        arrival=st.sampled_from(["decode first", "prefill first", "decode only", "neither"]),
    )
    def new_request(self, engine: int, chunks: list[int], arrival: str) -> None:
        """A client request arrives: Decode allocates, the proxy dispatches to Prefill (the
        usual order, or the rendezvous outruns the Decode worker), or either comes later."""
        ext = f"req{self.created}"
        self.created += 1
        engine %= len(self.world.cfg.engines)
        self.world.new_request(RequestSpec(ext, engine, tuple(chunks)))
        if arrival == "decode first":
            self.world.decode_add(ext)
            self.world.prefill_add(ext)
        elif arrival == "prefill first":
            self.world.prefill_add(ext)
            self.world.decode_add(ext)
        elif arrival == "decode only":
            self.world.decode_add(ext)

    @precondition(lambda self: bool(self._decode_addable()))
    @rule(i=_INDEX)
    def decode_add(self, i: int) -> None:
        """Decode allocates a request's destinations (late)."""
        self.world.decode_add(_pick(self._decode_addable(), i))

    @precondition(lambda self: bool(self._prefill_addable()))
    @rule(i=_INDEX)
    def prefill_add(self, i: int) -> None:
        """The proxy dispatches a request to Prefill (late)."""
        self.world.prefill_add(_pick(self._prefill_addable(), i))

    @precondition(lambda self: bool(self._decode_live()) and self.aborts < self.max_aborts)
    @rule(i=_INDEX)
    def decode_abort(self, i: int) -> None:
        """Decode aborts a request."""
        self.aborts += 1
        self.world.decode_abort(_pick(self._decode_live(), i))

    @precondition(lambda self: bool(self._prefill_live()) and self.aborts < self.max_aborts)
    @rule(i=_INDEX)
    def prefill_abort(self, i: int) -> None:
        """Prefill aborts a request."""
        self.aborts += 1
        self.world.prefill_abort(_pick(self._prefill_live(), i))

    @precondition(
        lambda self: (
            bool(self._decode_live())
            and (
                self.early_releases < self.max_early_releases
                or any(self.world.reqs[x].finished for x in self._decode_live())
            )
        )
    )
    @rule(i=_INDEX, early=st.booleans())
    def release(self, i: int, early: bool) -> None:
        """vLLM finishes a request on Decode: after its KV arrived, or early (a client
        abort, within its budget)."""
        finished = [x for x in self._decode_live() if self.world.reqs[x].finished]
        if early and self.early_releases < self.max_early_releases:
            self.early_releases += 1
            self.world.release(_pick(self._decode_live(), i))
        elif finished:
            self.world.release(_pick(finished, i))

    # -- the system runs -------------------------------------------------------------------

    @rule(picks=st.lists(_INDEX, min_size=1, max_size=16))
    def run(self, picks: list[int]) -> None:
        """The system runs for a while: each pick delivers a frame (the head of some
        connection), finishes a read well, lets a Prefill rank write its next layer (its
        storage is free), lets an endpoint handle its expired deadlines, or lets time pass
        (never past the delivery bound of a readiness in flight)."""
        world = self.world
        for pick in picks:
            moves = self._moves()
            kind, arg = _pick(moves, pick)
            if kind == "deliver":
                assert isinstance(arg, int)
                world.deliver(arg)
            elif kind == "read":
                assert isinstance(arg, tuple)
                world.finish_read(arg)
            elif kind == "write":
                assert isinstance(arg, int)
                world.write_layer(arg)
            elif kind == "timer":
                assert isinstance(arg, tuple)
                world.fire_timer(arg)
            else:
                world.advance(_pick(_DELAYS, pick // len(moves)))
            world.check()

    # -- faults ----------------------------------------------------------------------------

    @precondition(lambda self: bool(self.world.droppable()) and self.drops < self.max_drops)
    @rule(i=_INDEX)
    def drop(self, i: int) -> None:
        """Lose a frame (anything but a readiness)."""
        self.drops += 1
        self.world.drop(_pick(self.world.droppable(), i))

    @precondition(
        lambda self: bool(self.world.droppable()) and self.duplicates < self.max_duplicates
    )
    @rule(i=_INDEX)
    def duplicate(self, i: int) -> None:
        """Deliver a frame twice (anything but a readiness)."""
        self.duplicates += 1
        self.world.duplicate(_pick(self.world.droppable(), i))

    @precondition(
        lambda self: bool(self.world.reads) and self.read_failures < self.max_read_failures
    )
    @rule(i=_INDEX, outcome=st.sampled_from(["fail", "transient"]))
    def fail_read(self, i: int, outcome: str) -> None:
        """A read fails (transiently or not), having written part of its destinations."""
        self.read_failures += 1
        self.world.finish_read(_pick(sorted(self.world.reads), i), outcome)

    # Kills and drains end most of what a run built up: they act on one draw in four, so
    # that most runs keep requests in flight long enough for the other rules to interleave.

    @precondition(lambda self: self.kills < self.max_kills)
    @rule(victim=_INDEX)
    def kill(self, victim: int) -> None:
        """A Decode engine dies and restarts empty, or a Prefill rank dies and restarts with
        a new session."""
        if victim % 4:
            return
        self.kills += 1
        victim //= 4
        if victim % 2:
            self.world.kill_decode(victim // 2 % len(self.world.cfg.engines))
        else:
            self.world.kill_prefill(victim // 2 % self.world.cfg.p_tp)

    @precondition(
        lambda self: (
            self.drains < self.max_drains and bool(self._decode_live() or self._prefill_live())
        )
    )
    @rule(i=_INDEX)
    def drain(self, i: int) -> None:
        """Let everything settle: L1 and, once Decode released everything, B1."""
        if i % 4 == 0:
            self.drains += 1
            self._settle_and_check()

    def _settle_and_check(self) -> None:
        self.world.settle()
        self.world.check_quiescent()
        self.world.release_all()
        self.world.settle()
        self.world.check_idle()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def invariants_hold(self) -> None:
        """S1, S2, S3 on the current state (the event checks ran as outputs came)."""
        self.world.check()

    def teardown(self) -> None:
        """At the end of a run, everything must settle (L1) and leave nothing behind (B1)."""
        if sys.exc_info()[0] is not None:
            return  # a step failed already: report that, not what a broken world does next
        self._settle_and_check()
