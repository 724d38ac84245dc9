"""The Decode server's inbound queue: per-peer byte budgets and fair delivery across peers.

Theory of operation
-------------------
The ROUTER fair-queues *frames* across connections, but frames differ by orders of magnitude
in size and in the time the binding spends on them, and ZMQ bounds its queues in messages,
not bytes. So the I/O thread reads every frame out of ZMQ as soon as it can and files it
here, under the routing id that sent it:

- **Budgets in bytes.** Each peer may hold ``peer_bytes`` (its queued frames plus the one
  being handled, each counted as its length plus a fixed per-frame overhead), and all peers
  together ``total_bytes``. A frame over either budget is refused on arrival and the caller
  drops it: a peer can make the process hold at most its budget, however fast it sends.
- **Fair delivery.** Events are taken by start-time fair queueing: each backlogged peer
  carries the service it has used (seconds of handler time, charged by :meth:`done`; bytes
  in queue mode, where the consumer's time is unknown); the next frame comes from the peer
  that used the least. A peer that becomes backlogged starts at the virtual time of the frame
  in service, so idle time banks no credit. A flood therefore waits behind every other
  peer's frames, and a healthy peer waits at most for the one frame in service.
- **Events of no peer** (timers, connection events, send failures) go first, in order.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from rd2h_runtime.control._common import FRAME_OVERHEAD, wait_for_items

E = TypeVar("E")

Admission = Literal["ok", "peer", "total", "backlog"]


@dataclass(slots=True)
class _Peer(Generic[E]):
    """One peer's backlog: frames (event, charged bytes), bytes held, service used."""

    items: collections.deque[tuple[E, int]] = field(default_factory=collections.deque)
    held: int = 0  # queued + in service, charged bytes
    busy: int = 0  # frames taken but not yet done()
    used: float = 0.0
    rate: float = 0.0  # service per charged byte, a moving average over its done() calls


# FRAME_OVERHEAD: bytes charged per queued frame on top of its payload (the bytes object, the
# event and the queue entry that carry it), so a flood of empty frames is bounded too.


class FairInbox(Generic[E]):
    """A thread-safe inbound queue of keyed events with byte budgets and fair ``get``.

    ``capacity`` bounds the number of queued events for :meth:`room` (queue mode's
    back-pressure); admission itself is in bytes, and with ``peer_backlog`` also in service:
    a peer whose held bytes, at the service per byte its recent frames took, would cost more
    than ``peer_backlog`` is refused ("backlog"), so a flood of frames that are cheap to send
    and dear to handle cannot queue minutes of work either.
    """

    def __init__(
        self,
        *,
        peer_bytes: int,
        total_bytes: int,
        capacity: int,
        peer_backlog: float | None = None,
    ) -> None:
        self._peer_bytes = peer_bytes
        self._peer_backlog = peer_backlog
        self._total_bytes = total_bytes
        self._capacity = capacity
        self._cond = threading.Condition(threading.Lock())
        self._control: collections.deque[E] = collections.deque()
        self._peers: dict[Hashable, _Peer[E]] = {}
        self._count = 0
        self._held = 0
        self._vtime = 0.0
        self._closed = False

    @property
    def held_bytes(self) -> int:
        """Charged bytes queued or in service, all peers together."""
        with self._cond:
            return self._held

    def peer_held(self, key: Hashable) -> int:
        """Charged bytes ``key`` has queued or in service."""
        with self._cond:
            p = self._peers.get(key)
            return 0 if p is None else p.held

    def room(self) -> int:
        """Free event slots below ``capacity``."""
        with self._cond:
            return self._capacity - self._count

    def put(self, event: E) -> None:
        """Queue an event of no peer (delivered before any peer's)."""
        with self._cond:
            self._control.append(event)
            self._count += 1
            self._cond.notify()

    def admits(self, key: Hashable, nbytes: int) -> Admission:
        """Whether :meth:`put_from` would take a frame of ``nbytes`` from ``key`` now: "ok",
        or which budget ("peer", "total") it would exceed. Asked before copying a frame."""
        with self._cond:
            return self._admits(key, nbytes + FRAME_OVERHEAD)

    def _admits(self, key: Hashable, charged: int) -> Admission:
        p = self._peers.get(key)
        if (0 if p is None else p.held) + charged > self._peer_bytes:
            return "peer"
        if self._held + charged > self._total_bytes:
            return "total"
        if (
            self._peer_backlog is not None
            and p is not None
            and (p.held + charged) * p.rate > self._peer_backlog
        ):
            return "backlog"
        return "ok"

    def put_from(self, key: Hashable, event: E, nbytes: int) -> Admission:
        """Queue ``event`` from ``key`` carrying ``nbytes`` of payload, or refuse it.

        Returns "ok", or which budget ("peer", "total") the frame would exceed.
        """
        charged = nbytes + FRAME_OVERHEAD
        with self._cond:
            admitted = self._admits(key, charged)
            if admitted != "ok":
                return admitted
            p = self._peers.get(key)
            if p is None:
                p = self._peers[key] = _Peer(used=self._vtime)
            elif not p.items and not p.busy:
                p.used = max(p.used, self._vtime)
            p.items.append((event, charged))
            p.held += charged
            self._held += charged
            self._count += 1
            self._cond.notify()
            return "ok"

    def get(self, timeout: float | None) -> tuple[Hashable | None, E, int] | None:
        """The next event as ``(key, event, charged)``; None after ``timeout`` seconds.

        ``key`` is None for events of no peer. The caller reports the end of a keyed
        event's handling with :meth:`done`, which releases its bytes. Raises
        :class:`~rd2h_runtime.control.ControlClosed` once closed and empty.
        """
        with self._cond:
            if not wait_for_items(
                self._cond, lambda: self._count > 0, lambda: self._closed, timeout
            ):
                return None
            self._count -= 1
            if self._control:
                return None, self._control.popleft(), 0
            key, p = min(
                ((k, q) for k, q in self._peers.items() if q.items), key=lambda kq: kq[1].used
            )
            event, charged = p.items.popleft()
            p.busy += 1
            self._vtime = max(self._vtime, p.used)
            return key, event, charged

    def done(self, key: Hashable, charged: int, cost: float) -> None:
        """``key``'s event taken by :meth:`get` was handled: charge ``cost`` units of
        service to ``key`` and release the event's bytes."""
        with self._cond:
            p = self._peers.get(key)
            if p is None:
                return
            p.used += cost
            p.rate = cost / charged if not p.rate else 0.5 * (p.rate + cost / charged)
            p.held -= charged
            p.busy -= 1
            self._held -= charged
            if not p.items and not p.busy:
                del self._peers[key]  # an idle peer costs nothing and banks no credit

    def close(self, *, drop: bool) -> None:
        """Wake every waiter; later ``get`` calls raise once empty. ``drop``: empty it now
        (a handler is not called after close), else consumers may drain what is left."""
        with self._cond:
            self._closed = True
            if drop:
                self._control.clear()
                self._peers.clear()
                self._count = 0
                self._held = 0
            self._cond.notify_all()
