"""Per-parent state of the proxy: which children have posted, and the dispatch-once rule.

Theory of operation
-------------------
A client request (the *parent*, keyed by its X-Request-Id) is opened with the external ids
of its children. Decode posts one rendezvous per child. :meth:`Registry.record` answers
``READY`` exactly once per parent, for the post that completes the set; only that answer
starts a Prefill dispatch, so no child is ever dispatched twice. A repeated identical post
is ``DUPLICATE`` (Decode's metaserver client may retry a post whose answer it lost); a
repeated post with different content is refused.

A parent id (and every child id) is in use from :meth:`Registry.open` until BOTH the client
exchange is over and no dispatch for it is running; a client retrying with the same
X-Request-Id during that window is refused, so the same children are never live twice on
Decode or Prefill. When both are over the parent is removed: nothing stays behind.

A parent fails once (Prefill answered an error, timed out, or the rendezvous did not
arrive in time); the client handler waits on :attr:`Parent.failed` to stop the Decode
exchange early. A parent's phase changes only by firing the declared
:data:`~rd2h_proxy.phases.PROXY_REQUEST` machine, whose effects are bound to the
registry's ``_fx_*`` handlers at the bottom of this module.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn

from rd2h_protocol.machines import NO_EFFECT, no_effect
from rd2h_proxy.phases import (
    EFFECT_DISPATCH,
    EFFECT_FAIL,
    EFFECT_RECORD,
    EFFECT_REFUSE,
    P_RECV_DISPATCH_OK,
    P_RECV_LAST_POST,
    P_RECV_POST,
    P_RECV_POST_CLIENT_GONE,
    PHASE_WAITING,
    PROXY_REQUEST,
)


class Outcome(enum.Enum):
    """What a rendezvous post did."""

    RECORDED = "recorded"  # new child, others still missing
    READY = "ready"  # new child completing the set: dispatch now (once per parent)
    DUPLICATE = "duplicate"  # identical repeat of an earlier post: nothing to do


class ParentInFlight(Exception):
    """A parent with this id (or one sharing a child id) is still in flight."""


class UnknownChild(Exception):
    """No open parent expects this child id."""


class RendezvousRefused(Exception):
    """The post conflicts with what was recorded, or the parent can no longer use it."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Parent:
    """One client request and its children."""

    parent_id: str
    api: str
    body: dict[str, Any]
    headers: dict[str, str]
    children: tuple[str, ...]
    opened_at: float
    posted: dict[str, dict[str, Any]] = field(default_factory=dict)
    state: str = PHASE_WAITING  # its phase: a state of PROXY_REQUEST
    client_open: bool = True
    dispatch_running: bool = False
    failure: tuple[int, str] | None = None
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None


class Registry:
    """Open parents, indexed by parent id and by child id."""

    def __init__(self) -> None:
        self._parents: dict[str, Parent] = {}
        self._by_child: dict[str, Parent] = {}

    def __len__(self) -> int:
        return len(self._parents)

    def __iter__(self) -> Iterator[Parent]:
        return iter(list(self._parents.values()))

    @property
    def child_count(self) -> int:
        """Child ids currently indexed (for leak checks)."""
        return len(self._by_child)

    def open(
        self,
        parent_id: str,
        api: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        children: tuple[str, ...],
        now: float,
    ) -> Parent:
        """Register a new parent; :class:`ParentInFlight` if its id or a child id is in use."""
        if parent_id in self._parents:
            raise ParentInFlight(
                f"request {parent_id!r} is still in flight; retry after it has finished"
            )
        clash = next((c for c in children if c in self._by_child), None)
        if clash is not None:
            raise ParentInFlight(
                f"child request {clash!r} of {parent_id!r} is still in flight "
                f"(for request {self._by_child[clash].parent_id!r})"
            )
        if len(set(children)) != len(children):
            raise ValueError(f"duplicate child ids in {children!r}")
        parent = Parent(parent_id, api, body, dict(headers), children, now)
        self._parents[parent_id] = parent
        for child in children:
            self._by_child[child] = parent
        return parent

    def lookup(self, child_id: str) -> Parent | None:
        """The open parent expecting ``child_id``."""
        return self._by_child.get(child_id)

    def record(self, child_id: str, params: dict[str, Any]) -> tuple[Parent, Outcome]:
        """Record a child's rendezvous params; see :class:`Outcome`.

        Raises :class:`UnknownChild` when no open parent expects the child, and
        :class:`RendezvousRefused` (409) for a post that contradicts an earlier one, or
        (410) for a parent whose client has gone or that already failed.
        """
        parent = self._by_child.get(child_id)
        if parent is None:
            raise UnknownChild(f"no request in flight expects a rendezvous for {child_id!r}")
        earlier = parent.posted.get(child_id)
        if earlier is not None:
            if earlier != params:
                raise RendezvousRefused(
                    f"a different rendezvous for {child_id!r} was already recorded", 409
                )
            return parent, Outcome.DUPLICATE
        if not parent.client_open:
            event = P_RECV_POST_CLIENT_GONE
        elif len(parent.posted) + 1 == len(parent.children):
            event = P_RECV_LAST_POST
        else:
            event = P_RECV_POST
        return parent, _PROXY_REQUEST.fire(self, parent, event, child_id, params)

    def fail(self, parent: Parent, event: str, status: int, message: str) -> bool:
        """Fire ``parent`` with a failure input (``P_TIMER_RENDEZVOUS_EXPIRED`` or
        ``P_RECV_DISPATCH_FAILED``); True if this call failed it (the first failure wins:
        only :meth:`_fx_fail` answers)."""
        return bool(_PROXY_REQUEST.fire(self, parent, event, status, message))

    def dispatch_succeeded(self, parent: Parent) -> None:
        """Prefill accepted the dispatch."""
        _PROXY_REQUEST.fire(self, parent, P_RECV_DISPATCH_OK)

    def finish_dispatch(self, parent: Parent) -> None:
        """The dispatch task is over (either way); remove the parent if its client is gone."""
        parent.dispatch_running = False
        self._maybe_remove(parent)

    def close_client(self, parent: Parent) -> None:
        """The client exchange is over; remove the parent unless a dispatch still runs."""
        parent.client_open = False
        if parent.timer is not None:
            parent.timer.cancel()
            parent.timer = None
        self._maybe_remove(parent)

    def _maybe_remove(self, parent: Parent) -> None:
        if parent.client_open or parent.dispatch_running:
            return
        if self._parents.get(parent.parent_id) is parent:
            del self._parents[parent.parent_id]
        for child in parent.children:
            if self._by_child.get(child) is parent:
                del self._by_child[child]

    # -- the effects of PROXY_REQUEST ------------------------------------------------------

    def _fx_record(self, parent: Parent, child_id: str, params: dict[str, Any]) -> Outcome:
        """Keep a child's rendezvous; others are still missing."""
        parent.posted[child_id] = params
        return Outcome.RECORDED

    def _fx_dispatch(self, parent: Parent, child_id: str, params: dict[str, Any]) -> Outcome:
        """Keep the post completing the set: the one and only place a dispatch is started."""
        parent.posted[child_id] = params
        parent.dispatch_running = True
        if parent.timer is not None:
            parent.timer.cancel()
            parent.timer = None
        return Outcome.READY

    def _fx_refuse(self, parent: Parent, _child_id: str, _params: dict[str, Any]) -> NoReturn:
        """410: the parent is over (it failed, or its client has gone)."""
        why = parent.failure[1] if parent.failure else "its client request has ended"
        raise RendezvousRefused(f"request {parent.parent_id!r} is over: {why}", 410)

    def _fx_fail(self, parent: Parent, status: int, message: str) -> bool:
        """Keep the first failure and wake the client handler."""
        parent.failure = (status, message)
        parent.failed.set()
        return True


# -- the table drives the action: each declared effect bound to its handler ----------------

_PROXY_REQUEST: Final = PROXY_REQUEST.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_RECORD: Registry._fx_record,
        EFFECT_DISPATCH: Registry._fx_dispatch,
        EFFECT_REFUSE: Registry._fx_refuse,
        EFFECT_FAIL: Registry._fx_fail,
    }
)
