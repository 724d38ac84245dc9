"""Parking: readiness (and Prefill ABORTs) that name requests this rank does not know yet.

The rendezvous can outrun the worker that registers a request; what names such a request
waits here, bounded in count, in ids held (overall and per session) and in time, until
the request is added or retired (:meth:`_Parking._resolve_waiting`) or its bound runs out.
"""

from __future__ import annotations

from rd2h_protocol.consumer.frames import _message_ids
from rd2h_protocol.consumer.records import _Parked, _ParkedAbort, _Readiness
from rd2h_protocol.consumer.state import _EndpointState
from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.machines.consumer import M_LOCAL_UNPARK, R_RECV_ABORT


def _park_cost(item: _Readiness | _ParkedAbort) -> int:
    """What a parked item holds, in ids: its request ids and, for a readiness, every
    block id of its entries (fixed while parked: ``missing`` only shrinks, and the
    message never changes)."""
    if isinstance(item, _ParkedAbort):
        return item.cost
    msg = item.msg
    return len(msg.done_ext_ids) + sum(
        1 + len(r.main_block_ids) + len(r.indexer_block_ids or ()) for r in msg.read_reqs
    )


class _Parking(_EndpointState):
    """The park and the memory of retired requests."""

    def _park(self, item: _Parked) -> bool:
        """Park ``item`` if the park has room for it (else count why not)."""
        if not self._park_has_room(item):
            return False
        self._put_parked(item)
        return True

    def _park_has_room(self, item: _Parked) -> bool:
        """The ``park_has_room`` guard: the count and id budgets (a refusal is counted)."""
        if len(self._parked) >= self.config.max_parked:
            self.stats.park_overflow += 1
            return False
        cost = _park_cost(item)
        mine = self._parked_ids_by_session.get(item.session, 0) + cost
        if (
            self._parked_ids + cost > self.config.max_parked_ids
            or mine > self.config.max_parked_ids_per_session
        ):
            self.stats.park_budget_refusals += 1
            return False
        return True

    def _put_parked(self, item: _Parked) -> None:
        cost = _park_cost(item)
        mine = self._parked_ids_by_session.get(item.session, 0) + cost
        self._parked_ids += cost
        self._parked_ids_by_session[item.session] = mine
        item.park_id = self._next_park_id
        self._next_park_id += 1
        self._parked[item.park_id] = item
        for ext in item.missing:
            self._waiting.setdefault(ext, set()).add(item.park_id)
        self.stats.parked += 1

    def _unpark(self, item: _Parked) -> None:
        del self._parked[item.park_id]
        cost = _park_cost(item)
        self._parked_ids -= cost
        left = self._parked_ids_by_session[item.session] - cost
        if left:
            self._parked_ids_by_session[item.session] = left
        else:
            del self._parked_ids_by_session[item.session]
        for ext in item.missing:  # every id still missing is indexed in _waiting
            waiting = self._waiting[ext]
            waiting.discard(item.park_id)
            if not waiting:
                del self._waiting[ext]
        item.missing = set()

    def _resolve_waiting(self, ext: str, now: float) -> None:
        """``ext`` became known (added or retired): serve what waited only for it."""
        waiting = self._waiting.pop(ext, None)
        if not waiting:
            return
        for pid in sorted(waiting):  # arrival order; _unpark keeps _waiting exact
            item = self._parked[pid]
            item.missing.discard(ext)
            if isinstance(item, _ParkedAbort):
                req = self._requests.get(ext)
                if req is not None:
                    self._request_event(
                        req, R_RECV_ABORT, now, ErrorCode.ABORTED, item.reason, exclude=item.session
                    )
                if not item.missing:
                    self._unpark(item)
            elif not item.missing:
                self._unpark(item)
                self._READINESS.fire(self, item, M_LOCAL_UNPARK, now)

    def _retire(self, ext: str, now: float) -> None:
        """Remember ``ext`` as finished here: readiness for it is refused, not parked."""
        self._retired[ext] = None
        self._retired.move_to_end(ext)
        while len(self._retired) > self.config.max_retired:
            self._retired.popitem(last=False)
        self._resolve_waiting(ext, now)

    def _named_by_parked(self, ext: str) -> bool:
        """Whether a parked readiness names ``ext``: its blocks are not read yet.

        Parking serves a readiness after later ones of the same session (those name only
        known requests), so the last layer's done signal can arrive first; the request is
        done only once the parked readiness was read too (its own completion check).
        """
        return any(
            isinstance(item, _Readiness) and ext in _message_ids(item.msg)
            for item in self._parked.values()
        )

    # The readiness machine's PARK effect.

    def _fx_park(self, rd: _Readiness) -> None:
        self._put_parked(rd)
