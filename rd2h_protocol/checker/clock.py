"""Time in the model world: endpoint timers, and the instants worth moving the clock to.

:class:`TimedWorld` is a layer of :class:`~rd2h_protocol.checker.world.World`. Time moves
only when asked (:meth:`TimedWorld.advance`, :meth:`TimedWorld.advance_to`), and never past
half the lease of a readiness still in flight (the bound the network assumes: see
:mod:`~rd2h_protocol.checker.network`). :meth:`TimedWorld.next_time` names the next instant
where something changes (a deadline, just after a read's ``start_by``); a timer that is
due fires only through :meth:`TimedWorld.fire_timer`, which also checks that a publication
ended by its lease toward a v2 peer had its ABORT (S1).
"""

from __future__ import annotations

from collections.abc import Mapping

from rd2h_protocol.checker.invariants import InvariantViolation
from rd2h_protocol.checker.memory import MemoryWorld
from rd2h_protocol.checker.model import TICK
from rd2h_protocol.consumer import ConsumerEndpoint
from rd2h_protocol.producer import ProducerEndpoint, PublicationView

__all__ = ["TimedWorld"]


class TimedWorld(MemoryWorld):
    """The time layer of :class:`~rd2h_protocol.checker.world.World`."""

    # -- time ------------------------------------------------------------------------------

    def timers(self) -> list[tuple[str, int, int]]:
        """Endpoints whose earliest deadline has passed: ``("P", p, 0)`` / ``("D", e, d)``."""
        out: list[tuple[str, int, int]] = []
        for p, prod in enumerate(self.producers):
            t = prod.get_timer()
            if t is not None and t <= self.now:
                out.append(("P", p, 0))
        for (e, d), cons in self.consumers.items():
            t = cons.get_timer()
            if t is not None and t <= self.now:
                out.append(("D", e, d))
        return out

    def fire_timer(self, which: tuple[str, int, int]) -> None:
        """Let one endpoint handle its expired deadlines."""
        side, a, b = which
        if side == "D":
            self._consumer_outputs(a, b, self.consumers[(a, b)].handle_timer(self.now))
        else:
            prod = self.producers[a]
            before = prod.publications()
            outs = prod.handle_timer(self.now)
            self._producer_outputs(a, outs)
            self._check_expiry_aborts(a, before)
        self._gather()

    def _check_expiry_aborts(self, p: int, before: Mapping[int, PublicationView]) -> None:
        """S1: a publication that ended by its lease on a ready v2 connection had its ABORT."""
        prod = self.producers[p]
        after = prod.publications()
        conns = prod.connections()
        session = self.ranks[p].session
        for uid, view in before.items():
            if uid in after:
                continue
            if view.state not in ("published", "replayed") or conns.get(view.conn) != "ready_v2":
                continue
            for ext in view.ext_ids:
                if (session, view.conn, ext) not in self._aborted_to:
                    raise InvariantViolation(
                        "S1",
                        f"{session} reopened the storage of layer {view.layer_idx} after "
                        f"its lease toward {view.conn} expired without an ABORT for {ext}",
                    )

    def next_time(self) -> float | None:
        """The next instant worth moving to, or None (nothing waits, or a bound forbids it).

        Candidates: every endpoint deadline, just after every read's ``start_by``, just
        before every readiness's delivery bound; time never reaches a delivery bound.
        """
        now = self.now
        candidates: list[float] = []
        for prod in self.producers:
            t = prod.get_timer()
            if t is not None and t > now:
                candidates.append(t)
        for cons in self.consumers.values():
            t = cons.get_timer()
            if t is not None and t > now:
                candidates.append(t)
        for read in self.reads.values():
            if read.start_by is not None and read.start_by + TICK > now:
                candidates.append(read.start_by + TICK)
        bounds = [f.deliver_by for f in self.network if f.deliver_by is not None]
        for b in bounds:
            if b - TICK > now:
                candidates.append(b - TICK)
        if not candidates:
            return None
        t = min(candidates)
        if bounds and t >= min(bounds):
            return None
        return t

    def waits_on_time(self) -> bool:
        """Whether some deadline or read lease lies ahead (time passing changes something)."""
        now = self.now
        endpoints: list[ProducerEndpoint | ConsumerEndpoint] = [
            *self.producers,
            *self.consumers.values(),
        ]
        for ep in endpoints:
            t = ep.get_timer()
            if t is not None and t > now:
                return True
        return any(r.start_by is not None and r.start_by >= now for r in self.reads.values())

    def advance(self, dt: float) -> None:
        """Let up to ``dt`` seconds pass (less if a readiness in flight bounds it)."""
        target = self.now + dt
        bounds = [f.deliver_by for f in self.network if f.deliver_by is not None]
        if bounds:
            target = min(target, min(bounds) - TICK)
        if target > self.now:
            self.now = target
        self._gather()

    def advance_to(self, t: float) -> None:
        """Move the clock to ``t`` (from :meth:`next_time`)."""
        assert t > self.now
        self.now = t
        self._gather()

    def quiet(self) -> bool:
        """Nothing in flight, nothing to read, no deadline pending."""
        return (
            not self.network and not self.reads and self.next_time() is None and not self.timers()
        )
