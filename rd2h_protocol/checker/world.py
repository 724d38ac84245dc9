"""The model world of RD2H: the real endpoints, a simulated network, memory and runtime.

Theory of operation
-------------------
:class:`World` wires real :class:`~rd2h_protocol.producer.ProducerEndpoint` s (one per
Prefill TP rank) and :class:`~rd2h_protocol.consumer.ConsumerEndpoint` s (one per Decode
TP rank of every Decode engine) to three things it simulates:

* **the network** (:mod:`~rd2h_protocol.checker.network`): an in-flight list of frames;
  what the model assumes of the real transport, and the faults it injects beyond that,
  are stated there.
* **memory** (:mod:`~rd2h_protocol.checker.memory`): what every storage holds, so that a
  read after reuse is not only forbidden by a state check but *detected*.
* **the runtime around the endpoints**: the Prefill compute path writes layer ``L`` of a
  step only when ``can_overwrite(L)`` and publishes it; Decode adds requests, aborts and
  releases them; timers fire; endpoints are killed and restarted.

Every input goes through :meth:`World.apply` (an action tuple) or one of the named
methods it dispatches to; the outputs are executed in order and checked as they come
(S1 at every read, S2 at every ``RequestDone`` and at cross-rank completion, S3 at every
``Releasable`` and every destination write), and :meth:`World.check` checks the state
invariants after every step. :meth:`World.settle` runs a fair scheduler (deliver
everything, finish every read, fire every timer, let time pass) until nothing is left;
:meth:`World.check_quiescent` then checks L1 and, after :meth:`World.release_all`,
:meth:`World.check_idle` checks B1. The invariants are those of
:mod:`rd2h_protocol.checker.invariants`; a breach raises :class:`InvariantViolation`
naming one.

Subclasses can replace the network (:meth:`World.transmit`, :meth:`World.deliverable`) and
the executor of read plans (:meth:`World.execute_read`) with real transports.
:mod:`rd2h_protocol.checker.explore` drives the world through :meth:`World.actions` and
:meth:`World.apply`, :mod:`rd2h_protocol.checker.stateful` with hypothesis. What a world
is made of (its configuration, requests, frames, block ids) is in
:mod:`rd2h_protocol.checker.model`.

Layers
------
:class:`World` is built in layers, one module each, every layer using the ones below it:

* :class:`~rd2h_protocol.checker.state.WorldState` (:mod:`~rd2h_protocol.checker.state`):
  the state, and the endpoints and their configurations built;
* :class:`~rd2h_protocol.checker.core.WorldCore` (:mod:`~rd2h_protocol.checker.core`):
  requests, the Prefill compute path, the outputs and their checks, the state
  invariants;
* :class:`~rd2h_protocol.checker.network.NetworkWorld`: delivering, losing and
  duplicating frames, breaking connections;
* :class:`~rd2h_protocol.checker.memory.MemoryWorld`: running reads against the memory
  model;
* :class:`~rd2h_protocol.checker.clock.TimedWorld`: timers and the clock;
* :class:`World` (here): faults that kill endpoints, the fair scheduler, the actions the
  explorer takes, snapshots.

They share one state (the attributes ``WorldState.__init__`` sets), which the snapshot
pickles as one object and the canonical form reads by attribute name
(:mod:`~rd2h_protocol.checker.canonical`); only :class:`World` is meant to be built.
"""

from __future__ import annotations

import io
import pickle

from rd2h_protocol.checker import footprint
from rd2h_protocol.checker.clock import TimedWorld
from rd2h_protocol.checker.invariants import InvariantViolation
from rd2h_protocol.checker.model import (
    CLAIM_KINDS,
    CLAIMS,
    Action,
    Frame,
    Rank,
    RequestSpec,
    WorldConfig,
)
from rd2h_protocol.checker.snapshot import DISPATCH, connection_of
from rd2h_protocol.claim import decode_claim, decode_claim_answer
from rd2h_protocol.completion import CrossRankCompletion
from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.wire.codec import decode
from rd2h_protocol.wire.messages import Abort, Message, ReadDone, ReadFailed, ReadReadyBatch

__all__ = ["World"]


class World(TimedWorld):
    """Producers, consumers, a network and a memory model, checked after every step.

    See the module docstring. All methods take the world's own clock (``self.now``).
    """

    def __init__(self, cfg: WorldConfig) -> None:
        super().__init__(cfg)
        if cfg.warmup:
            # One request per engine, one after the other, run to the end: every connection
            # has its handshake.
            for e in range(len(cfg.engines)):
                self.new_request(RequestSpec(f"warmup{e}", e, (1,)))
                self.settle()
                self.check_quiescent()
        for spec in cfg.requests:
            self.new_request(spec)
        if cfg.upfront:
            for spec in cfg.requests:
                if spec.ext_id not in cfg.late_decode and self.may_decode_add(spec.ext_id):
                    self.decode_add(spec.ext_id)
                self.prefill_add(spec.ext_id)

    # -- faults ----------------------------------------------------------------------------

    def kill_decode(self, engine: int) -> None:
        """Decode engine ``engine`` dies (any TP rank takes the engine down) and restarts.

        Its frames vanish, its reads never run, its requests are abandoned (their clients
        see an error); Prefill learns through leases, UNKNOWN_SESSION and isolation.
        """
        conns = {self.conn_name(engine, d) for d in range(self.cfg.engines[engine])}
        conns |= {conn + CLAIMS for conn in conns}  # its claim clients too
        self.network = [f for f in self.network if f.src[1] not in conns and f.dst[1] not in conns]
        if self._claims:
            self._claims = {c for c in self._claims if c[0] != engine}
        self.reads = {k: r for k, r in self.reads.items() if k[0] != engine}
        self._engine_gens[engine] += 1
        d_tp = self.cfg.engines[engine]
        for d in range(d_tp):
            self.consumers[(engine, d)] = self._new_consumer(d, d_tp)
        self.completions[engine] = CrossRankCompletion(d_tp)
        self._reports[engine] = [([], []) for _ in range(d_tp)]
        self.dmem = {k: v for k, v in self.dmem.items() if k[0] != engine}
        for table in (self._terminal, self._delivered):
            for key in [k for k in table if k[0] == engine]:
                del table[key]
        self._readiness = {k: v for k, v in self._readiness.items() if k[0] != engine}
        self._released = {k for k in self._released if k[0] != engine}
        for req in self.reqs.values():
            if req.spec.engine == engine and not req.released:
                req.abandoned = True

    def kill_prefill(self, p: int) -> None:
        """Prefill rank ``p`` dies and restarts with a new session and no requests."""
        old = self.ranks[p].session
        gone = {old, old + CLAIMS}  # its claim port too
        self.network = [f for f in self.network if f.src[1] not in gone and f.dst[1] not in gone]
        if self._kept:  # what it kept died with it
            self._kept = {k: v for k, v in self._kept.items() if k[0] != old}
        self._gens[p] += 1
        session = f"p{p}.{self._gens[p]}"
        self.ranks[p] = Rank(session)
        self.producers[p] = self._new_producer(p, session)
        self.pmem = {k: v for k, v in self.pmem.items() if k[0] != old}

    # -- the fair scheduler ----------------------------------------------------------------

    def settle(self, limit: int = 10_000) -> None:
        """Run everything to the end: register every request, deliver every frame, run every
        read, let every rank write, fire every timer, move time on; until nothing is left."""
        for _ in range(limit):
            for ext, req in self.reqs.items():
                if (
                    not req.decode_added
                    and not req.abandoned
                    and not req.released
                    and self.may_decode_add(ext)
                ):
                    self.decode_add(ext)
                if not req.prefill_added:
                    self.prefill_add(ext)
            progressed = False
            while self.network:
                self.deliver(self.deliverable()[0])
                self.check()
                progressed = True
            for key in sorted(self.reads):
                self.finish_read(key)
                self.check()
                progressed = True
            for which in self.timers():
                self.fire_timer(which)
                self.check()
                progressed = True
            for p in range(len(self.producers)):
                if self.can_write(p, idle=False):
                    self.write_layer(p)
                    self.check()
                    progressed = True
            if progressed:
                continue
            t = self.next_time()
            if t is None:
                return
            self.advance_to(t)
        raise InvariantViolation("L1", f"no quiescence after {limit} rounds")

    def release_all(self) -> None:
        """vLLM finishes every request Decode still holds."""
        for ext, req in self.reqs.items():
            if req.decode_added and not req.released and not req.abandoned:
                self.release(ext)

    # -- actions (the explorer's interface) ------------------------------------------------

    def _budget(self, name: str) -> bool:
        return self.budgets.get(name, 0) > 0

    def actions(self) -> list[Action]:
        """Every action enabled now, in a fixed order, within the fault budgets."""
        acts: list[Action] = []
        for i in self.deliverable():
            acts.append(("deliver", i))
        if self._budget("lose"):  # beyond the model's assumptions: see WorldConfig
            acts.extend(
                ("lose", i) for i in self.deliverable() if self.network[i].kind == "ReadReadyBatch"
            )
        if self._budget("drop") or self._budget("dup"):
            for i in self.droppable():
                if self._budget("drop") and self.network[i].src[0] == "D":
                    acts.append(("drop", i))
                if self._budget("dup"):
                    acts.append(("dup", i))
        for key in sorted(self.reads):
            acts.append(("read", key, "ok"))
            if self._budget("read_fail"):
                acts.append(("read", key, "fail"))
                acts.append(("read", key, "transient"))
        for which in self.timers():
            acts.append(("timer", which))
        for p in range(len(self.producers)):
            if self.can_write(p):
                acts.append(("write", p))
        for ext, req in self.reqs.items():
            if not req.decode_added and not req.abandoned and self.may_decode_add(ext):
                acts.append(("decode_add", ext))
            if not req.prefill_added:
                acts.append(("prefill_add", ext))
            live = req.decode_added and not req.abandoned and not req.released
            if live and ((req.finished and not self.cfg.auto_release) or self._budget("release")):
                acts.append(("release", ext))
            may_abort = self._budget("abort") or self._budget("prefill_abort")
            if may_abort and any(ext in p.requests() for p in self.producers):
                acts.append(("prefill_abort", ext))
            if self._budget("abort") and live and not req.decode_aborted:
                acts.append(("decode_abort", ext))
        if self._budget("break"):
            acts.extend(("break", p, conn) for p, conn in self.breakable())
        if self._budget("kill"):
            acts.extend(("kill_decode", e) for e in range(len(self.cfg.engines)))
            acts.extend(("kill_prefill", p) for p in range(self.cfg.p_tp))
        t = self.next_tick() if self.cfg.tick is not None else self.next_time()
        if t is not None:
            acts.append(("advance", t))
        return acts

    def next_tick(self) -> float | None:
        """The explorer's next instant: one tick on, once no timer is due, while something
        still waits on time, and never onto a readiness's delivery bound."""
        assert self.cfg.tick is not None
        # Timers and the compute path are prompt: time moves on only once they are done.
        # The network and the transfer engine may be slow: frames and reads can wait.
        if self.timers() or not self.waits_on_time():
            return None
        if any(self.can_write(p, idle=False) for p in range(len(self.producers))):
            return None
        t = self.now + self.cfg.tick
        bounds = [f.deliver_by for f in self.network if f.deliver_by is not None]
        if bounds and t >= min(bounds):
            return None
        return t

    def apply(self, action: Action) -> None:
        """Perform one action (see :meth:`actions`), spending its budget, then check."""
        kind = action[0]
        if kind in ("advance", "kill_decode", "kill_prefill", "break"):
            footprint.touch(footprint.EVERYTHING)
        if kind == "deliver":
            self.deliver(_int(action[1]))
        elif kind == "drop":
            self._spend("drop")
            self.drop(_int(action[1]))
        elif kind == "lose":
            self._spend("lose")
            self.drop(_int(action[1]))
        elif kind == "dup":
            self._spend("dup")
            if self.cfg.duplicate_on_delivery:
                self.deliver_duplicated(_int(action[1]))
            else:
                self.duplicate(_int(action[1]))
        elif kind == "read":
            key = action[1]
            assert isinstance(key, tuple)
            outcome = str(action[2])
            if outcome != "ok":
                self._spend("read_fail")
            self.finish_read((_int(key[0]), _int(key[1]), _int(key[2])), outcome)
        elif kind == "timer":
            which = action[1]
            assert isinstance(which, tuple)
            self.fire_timer((str(which[0]), _int(which[1]), _int(which[2])))
        elif kind == "write":
            self.write_layer(_int(action[1]))
        elif kind == "decode_add":
            self.decode_add(str(action[1]))
        elif kind == "prefill_add":
            self.prefill_add(str(action[1]))
        elif kind == "release":
            ext = str(action[1])
            if not self.reqs[ext].finished:
                self._spend("release")
            self.release(ext)
        elif kind == "prefill_abort":
            self._spend("prefill_abort" if self._budget("prefill_abort") else "abort")
            self.prefill_abort(str(action[1]))
        elif kind == "decode_abort":
            self._spend("abort")
            self.decode_abort(str(action[1]))
        elif kind == "break":
            self._spend("break")
            self.break_connection(_int(action[1]), str(action[2]))
        elif kind == "kill_decode":
            self._spend("kill")
            self.kill_decode(_int(action[1]))
        elif kind == "kill_prefill":
            self._spend("kill")
            self.kill_prefill(_int(action[1]))
        elif kind == "advance":
            t = action[1]
            assert isinstance(t, float)
            self.advance_to(t)
        else:
            raise ValueError(f"unknown action {action!r}")
        self.check()

    def _spend(self, name: str) -> None:
        footprint.touch(footprint.BUDGETS)
        if self.budgets.get(name, 0) <= 0:
            raise ValueError(f"no {name} budget left")
        self.budgets[name] -= 1

    def describe(self, action: Action) -> str:
        """A readable line for ``action`` in the current state (for traces)."""
        kind = action[0]
        if kind in ("deliver", "drop", "dup", "lose"):
            f = self.network[_int(action[1])]
            what = _claim_summary(f) if f.kind in CLAIM_KINDS else _summary(decode(f.data))
            return f"t={self.now:.3f} {kind} {f.src[1]} -> {f.dst[1]}: {what}"
        if kind == "read":
            key = action[1]
            assert isinstance(key, tuple)
            read = self.reads[(_int(key[0]), _int(key[1]), _int(key[2]))]
            reqs = ",".join(r.ext_req_id for r in read.plan.requests)
            return (
                f"t={self.now:.3f} read {key} of layer {read.layer} from {read.plan.session} "
                f"for [{reqs}] -> {action[2]}"
            )
        if kind == "write":
            p = _int(action[1])
            return (
                f"t={self.now:.3f} {self.ranks[p].session} writes layer {self.ranks[p].next_layer}"
            )
        if kind == "advance":
            return (
                f"t={self.now:.3f} time passes to {action[1]:.3f}"
                if isinstance(action[1], float)
                else ""
            )
        return f"t={self.now:.3f} {' '.join(str(a) for a in action)}"

    # -- snapshots -------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The whole state as bytes (a pickle); equal states give equal bytes, mostly.

        Counters that never influence behaviour are left out (they come back as zeros),
        configurations and layouts are shared rather than copied, and frames are grouped by
        connection (their order across connections means nothing), so that states reached
        along different paths merge and a snapshot stays small.
        """
        self.network.sort(key=connection_of)
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = DISPATCH
        pickler.dump(self)
        return buf.getvalue()


def _int(value: object) -> int:
    assert isinstance(value, int)
    return value


def _claim_summary(frame: Frame) -> str:
    if frame.kind == "Claim":
        return f"claim {decode_claim(frame.data).request_id}"
    answer = decode_claim_answer(frame.data)
    return f"claim answer {answer.request_id} " + ("accepted" if answer.ok else "refused")


def _summary(msg: Message) -> str:
    if isinstance(msg, ReadReadyBatch):
        ids = [r.ext_req_id for r in msg.read_reqs]
        return (
            f"read_ready_batch layer {msg.layer_idx} seq {msg.seq} member {msg.group_member_idx} "
            f"reqs {ids} done {msg.done_ext_ids}"
        )
    if isinstance(msg, ReadDone):
        failed = [(f.ext_req_id, ErrorCode(f.code).name) for f in msg.failed or ()]
        return f"read_done layer {msg.layer_idx} seq {msg.seq}" + (
            f" failed {failed}" if failed else ""
        )
    if isinstance(msg, ReadFailed):
        code = ErrorCode(msg.code).name if msg.code is not None else "?"
        return f"read_failed layer {msg.layer_idx} seq {msg.seq} {code}"
    if isinstance(msg, Abort):
        return f"abort {msg.ext_ids}"
    return type(msg).__name__.lower()
