"""Parking: readiness (and Prefill ABORTs) that name requests this rank does not know yet.

The rendezvous can outrun the worker that registers a request; what names such a request
waits here, bounded in count, in bytes held (overall and per session) and in time, until
the request is added or retired (:meth:`_Parking._resolve_waiting`) or its bound runs out.

Layout, chosen so that what a parked item costs is what it holds, and that is small:

* a parked readiness keeps its entries packed as msgpack (``packed``; its ``msg`` then
  holds no entries) and unpacks them when it leaves the park; an ABORT keeps its reason;
* each item keeps ``names``, the sorted tuple of the request ids it names (an ABORT: of
  those it waits for), and ``left``, how many of them it still waits for;
* ``_waiting`` maps each awaited request id to the park id waiting for it, or to the
  ascending tuple of park ids when several wait (rare): no container per id. An item
  still waits for a name exactly when that name is indexed under its park id.

:func:`_park_cost` is the bytes one item holds, summed from the sizes of the objects it
keeps (``sys.getsizeof``) plus a bound for its index entries; the budgets compare it.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

from rd2h_protocol.consumer.held import _entries_bytes, _SessionBudgets
from rd2h_protocol.consumer.records import _Parked, _ParkedAbort, _Readiness
from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.machines.consumer import M_LOCAL_UNPARK, R_RECV_ABORT
from rd2h_protocol.wire.readiness import message_ids, pack_entries, unpack_entries

# What one awaited id costs in the index beyond its string: a dict slot at the worst
# load a dict keeps after growing (it is rebuilt when it empties, see _unindex), and the
# id's slot in its item's ``names`` tuple.
_INDEX_BYTES_PER_ID: Final = 96 + 8
# The fixed part of a parked item: its record, its lists and its entry in ``_parked``.
_RECORD_BYTES: Final = 768


def _names_bytes(names: tuple[str, ...], awaited: int) -> int:
    """Bytes held for ``names`` (strings and tuple) and ``awaited`` index entries."""
    return sys.getsizeof(names) + sum(map(sys.getsizeof, names)) + awaited * _INDEX_BYTES_PER_ID


def _park_cost(item: _Parked, packed: bytes | None = None) -> int:
    """The bytes ``item`` holds while parked (fixed while it is parked: ``left`` only
    shrinks, and what it keeps never changes). A readiness whose entries could not be
    packed (``packed`` None) is charged a bound of its decoded entries."""
    if isinstance(item, _ParkedAbort):
        return _RECORD_BYTES + sys.getsizeof(item.reason) + _names_bytes(item.names, item.left)
    msg = item.msg
    held = _RECORD_BYTES + _names_bytes(item.names, item.left) + sys.getsizeof(msg.layer_name)
    held += sys.getsizeof(msg.done_ext_ids) + sum(map(sys.getsizeof, msg.done_ext_ids))
    if packed is not None:
        return held + sys.getsizeof(packed)
    return held + _entries_bytes(msg.read_reqs)


class _Parking(_SessionBudgets):
    """The park and the memory of retired requests."""

    def _park(self, item: _Parked) -> bool:
        """Park ``item`` if the park has room for it (else count why not)."""
        if not self._park_has_room(item):
            return False
        self._put_parked(item)
        return True

    def _prepare_park(self, rd: _Readiness, missing: Sequence[str]) -> bytes | None:
        """Give ``rd`` what parking keeps of it (names, ``left``, cost); return its
        entries packed (None: they cannot be, and stay decoded)."""
        rd.names = tuple(sorted(message_ids(rd.msg)))
        rd.left = len(missing)
        packed: bytes | None
        try:
            packed = pack_entries(rd.msg.read_reqs)
        except (TypeError, OverflowError, ValueError):  # (only a message built in-process)
            packed = None
        rd.park_cost = _park_cost(rd, packed)
        return packed

    def _park_has_room(self, item: _Parked) -> bool:
        """The ``park_has_room`` guard: the count and byte budgets (a refusal is counted)."""
        if len(self._parked) >= self.config.max_parked:
            self.stats.park_overflow += 1
            return False
        cost = item.park_cost
        mine = self._parked_bytes_by_session.get(item.session, 0) + cost
        if (
            self._parked_bytes + cost > self.config.max_parked_bytes
            or mine > self.config.max_parked_bytes_per_session
        ):
            self.stats.park_budget_refusals += 1
            return False
        return True

    def _put_parked(self, item: _Parked, missing: Iterable[str] = ()) -> None:
        """Park ``item``, awaiting ``missing`` (an ABORT: all its names)."""
        cost = item.park_cost
        self._parked_bytes += cost
        self._parked_bytes_by_session[item.session] = (
            self._parked_bytes_by_session.get(item.session, 0) + cost
        )
        pid = item.park_id = self._next_park_id
        self._next_park_id += 1
        self._parked[pid] = item
        waiting = self._waiting
        for ext in item.names if isinstance(item, _ParkedAbort) else missing:
            held = waiting.get(ext)
            if held is None:
                waiting[ext] = pid
            elif isinstance(held, int):
                waiting[ext] = (held, pid)
            else:
                waiting[ext] = (*held, pid)
        self.stats.parked += 1

    def _awaits(self, item: _Parked, ext: str) -> bool:
        """Whether parked ``item`` still waits for ``ext``."""
        held = self._waiting.get(ext)
        return held == item.park_id or (type(held) is tuple and item.park_id in held)

    def _awaited(self, item: _Parked) -> tuple[str, ...]:
        """The request ids parked ``item`` still waits for, sorted."""
        return tuple(ext for ext in item.names if self._awaits(item, ext))

    def _unpark(self, item: _Parked) -> None:
        del self._parked[item.park_id]
        cost = item.park_cost
        self._parked_bytes -= cost
        left = self._parked_bytes_by_session[item.session] - cost
        if left:
            self._parked_bytes_by_session[item.session] = left
        else:
            del self._parked_bytes_by_session[item.session]
        if item.left:
            self._unindex(item)
        item.left = 0
        item.names = ()
        if isinstance(item, _Readiness) and item.packed is not None:
            entries = unpack_entries(item.packed)
            item.msg = msgspec.structs.replace(item.msg, read_reqs=entries)
            item.packed = None

    def _unindex(self, item: _Parked) -> None:
        """Take ``item``'s park id out of the index entries of the names it awaits."""
        waiting, pid = self._waiting, item.park_id
        for ext in item.names:
            held = waiting.get(ext)
            if held is None:
                continue
            if held == pid:
                del waiting[ext]
            elif type(held) is tuple and pid in held:
                rest = tuple(p for p in held if p != pid)
                waiting[ext] = rest[0] if len(rest) == 1 else rest
        if not waiting:
            # A dict never shrinks its table on deletion: a fresh one gives the memory of
            # a flood back once it has left.
            self._waiting = {}

    def _resolve_waiting(self, ext: str, now: float) -> None:
        """``ext`` became known (added or retired): serve what waited only for it."""
        held = self._waiting.pop(ext, None)
        if held is None:
            return
        if not self._waiting:
            self._waiting = {}  # (see _unindex)
        # Ascending park ids: arrival order; _unpark keeps _waiting exact.
        for pid in (held,) if isinstance(held, int) else held:
            item = self._parked[pid]
            item.left -= 1
            if isinstance(item, _ParkedAbort):
                req = self._requests.get(ext)
                if req is not None:
                    self._request_event(
                        req, R_RECV_ABORT, now, ErrorCode.ABORTED, item.reason, exclude=item.session
                    )
                if not item.left:
                    self._unpark(item)
            elif not item.left:
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
        for item in self._parked.values():
            if isinstance(item, _Readiness):
                names = item.names
                at = bisect_left(names, ext)
                if at < len(names) and names[at] == ext:
                    return True
        return False

    # The readiness machine's PARK effect.

    def _fx_park(self, rd: _Readiness, packed: bytes | None, missing: Iterable[str]) -> None:
        if packed is not None:
            rd.packed = packed
            rd.msg = msgspec.structs.replace(rd.msg, read_reqs=[])
        self._put_parked(rd, missing)
