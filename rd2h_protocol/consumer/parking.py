"""Parking: readiness (and Prefill ABORTs) that name requests this rank does not know yet.

The rendezvous can outrun the worker that registers a request; what names such a request
waits here, bounded in count, in bytes held (overall and per session) and in time, until
the request is added or retired (:meth:`Parking.resolve_waiting`) or its bound runs out.

Layout, chosen so that what a parked item costs is what it holds, and that is small:

* a parked readiness keeps its entries packed as msgpack (``packed``; its ``msg`` then
  holds no entries) and unpacks them when it leaves the park; an ABORT keeps its reason;
* each item keeps ``names``, the sorted tuple of the request ids it names (an ABORT: of
  those it waits for), and ``left``, how many of them it still waits for;
* ``waiting`` maps each awaited request id to the park id waiting for it, or to the
  ascending tuple of park ids when several wait (rare): no container per id. An item
  still waits for a name exactly when that name is indexed under its park id.

:func:`parked_cost` is the bytes one item holds, summed from the sizes of the objects it
keeps (``sys.getsizeof``) plus a bound for its index entries; the budgets compare it.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final

import msgspec

from rd2h_protocol.consumer.held import entries_bytes
from rd2h_protocol.consumer.records import Parked, ParkedAbort, ReadinessRecord
from rd2h_protocol.consumer.state import ConsumerState
from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.machines.consumer import M_LOCAL_UNPARK, R_RECV_ABORT
from rd2h_protocol.machines.consumer_inputs import RdAt, ReqEnd
from rd2h_protocol.wire.readiness import message_ids, pack_entries, unpack_entries

if TYPE_CHECKING:
    from rd2h_protocol.consumer.reads import ReadinessEffects
    from rd2h_protocol.consumer.requests import RequestEffects

# What one awaited id costs in the index beyond its string: a dict slot at the worst
# load a dict keeps after growing (it is rebuilt when it empties, see _unindex), and the
# id's slot in its item's ``names`` tuple.
_INDEX_BYTES_PER_ID: Final = 96 + 8
# The fixed part of a parked item: its record, its lists and its entry in ``parked``.
_RECORD_BYTES: Final = 768


def _names_bytes(names: tuple[str, ...], awaited: int) -> int:
    """Bytes held for ``names`` (strings and tuple) and ``awaited`` index entries."""
    return sys.getsizeof(names) + sum(map(sys.getsizeof, names)) + awaited * _INDEX_BYTES_PER_ID


def parked_cost(item: Parked, packed: bytes | None = None) -> int:
    """The bytes ``item`` holds while parked (fixed while it is parked: ``left`` only
    shrinks, and what it keeps never changes). A readiness whose entries could not be
    packed (``packed`` None) is charged a bound of its decoded entries."""
    if isinstance(item, ParkedAbort):
        return _RECORD_BYTES + sys.getsizeof(item.reason) + _names_bytes(item.names, item.left)
    msg = item.msg
    held = _RECORD_BYTES + _names_bytes(item.names, item.left) + sys.getsizeof(msg.layer_name)
    held += sys.getsizeof(msg.done_ext_ids) + sum(map(sys.getsizeof, msg.done_ext_ids))
    if packed is not None:
        return held + sys.getsizeof(packed)
    return held + entries_bytes(msg.read_reqs)


def awaited_names(waiting: dict[str, int | tuple[int, ...]], item: Parked) -> tuple[str, ...]:
    """The request ids parked ``item`` still waits for, sorted (``waiting``: the state's
    index of awaited ids)."""
    pid = item.park_id
    return tuple(
        ext
        for ext in item.names
        if (held := waiting.get(ext)) == pid or (type(held) is tuple and pid in held)
    )


class Parking:
    """The park and the memory of retired requests (a collaborator of the machines'
    effects; serving what waited fires the request and readiness machines)."""

    __slots__ = ("readiness", "request", "state")

    readiness: ReadinessEffects
    request: RequestEffects

    def __init__(self, state: ConsumerState) -> None:
        self.state = state

    def park(self, item: Parked) -> bool:
        """Park ``item`` if the park has room for it (else count why not)."""
        if not self.park_has_room(item):
            return False
        self.put_parked(item)
        return True

    def prepare_park(self, rd: ReadinessRecord, missing: Sequence[str]) -> bytes | None:
        """Give ``rd`` what parking keeps of it (names, ``left``, cost); return its
        entries packed (None: they cannot be, and stay decoded)."""
        rd.names = tuple(sorted(message_ids(rd.msg)))
        rd.left = len(missing)
        packed: bytes | None
        try:
            packed = pack_entries(rd.msg.read_reqs)
        except (TypeError, OverflowError, ValueError):  # (only a message built in-process)
            packed = None
        rd.park_cost = parked_cost(rd, packed)
        return packed

    def park_has_room(self, item: Parked) -> bool:
        """The ``park_has_room`` guard: the count and byte budgets (a refusal is counted)."""
        if len(self.state.parked) >= self.state.config.max_parked:
            self.state.stats.park_overflow += 1
            return False
        cost = item.park_cost
        mine = self.state.parked_bytes_by_session.get(item.session, 0) + cost
        if (
            self.state.parked_bytes + cost > self.state.config.max_parked_bytes
            or mine > self.state.config.max_parked_bytes_per_session
        ):
            self.state.stats.park_budget_refusals += 1
            return False
        return True

    def put_parked(self, item: Parked, missing: Iterable[str] = ()) -> None:
        """Park ``item``, awaiting ``missing`` (an ABORT: all its names)."""
        cost = item.park_cost
        self.state.parked_bytes += cost
        self.state.parked_bytes_by_session[item.session] = (
            self.state.parked_bytes_by_session.get(item.session, 0) + cost
        )
        pid = item.park_id = self.state.next_park_id
        self.state.next_park_id += 1
        self.state.parked[pid] = item
        waiting = self.state.waiting
        for ext in item.names if isinstance(item, ParkedAbort) else missing:
            held = waiting.get(ext)
            if held is None:
                waiting[ext] = pid
            elif isinstance(held, int):
                waiting[ext] = (held, pid)
            else:
                waiting[ext] = (*held, pid)
        self.state.stats.parked += 1

    def unpark(self, item: Parked) -> None:
        del self.state.parked[item.park_id]
        cost = item.park_cost
        self.state.parked_bytes -= cost
        left = self.state.parked_bytes_by_session[item.session] - cost
        if left:
            self.state.parked_bytes_by_session[item.session] = left
        else:
            del self.state.parked_bytes_by_session[item.session]
        if item.left:
            self._unindex(item)
        item.left = 0
        item.names = ()
        if isinstance(item, ReadinessRecord) and item.packed is not None:
            entries = unpack_entries(item.packed)
            item.msg = msgspec.structs.replace(item.msg, read_reqs=entries)
            item.packed = None

    def _unindex(self, item: Parked) -> None:
        """Take ``item``'s park id out of the index entries of the names it awaits."""
        waiting, pid = self.state.waiting, item.park_id
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
            self.state.waiting = {}

    def resolve_waiting(self, ext: str, now: float) -> None:
        """``ext`` became known (added or retired): serve what waited only for it."""
        held = self.state.waiting.pop(ext, None)
        if held is None:
            return
        if not self.state.waiting:
            self.state.waiting = {}  # (see _unindex)
        # Ascending park ids: arrival order; _unpark keeps _waiting exact.
        for pid in (held,) if isinstance(held, int) else held:
            item = self.state.parked[pid]
            item.left -= 1
            if isinstance(item, ParkedAbort):
                req = self.state.requests.get(ext)
                if req is not None:
                    ctx = ReqEnd(now, ErrorCode.ABORTED, item.reason, item.session)
                    self.request.apply(req, R_RECV_ABORT, ctx)
                if not item.left:
                    self.unpark(item)
            elif not item.left:
                self.unpark(item)
                readiness = self.readiness
                readiness.TABLE.apply(readiness, item, M_LOCAL_UNPARK, RdAt(now))

    def retire(self, ext: str, now: float) -> None:
        """Remember ``ext`` as finished here: readiness for it is refused, not parked."""
        self.state.retired[ext] = None
        self.state.retired.move_to_end(ext)
        while len(self.state.retired) > self.state.config.max_retired:
            self.state.retired.popitem(last=False)
        self.resolve_waiting(ext, now)

    def named_by_parked(self, ext: str) -> bool:
        """Whether a parked readiness names ``ext``: its blocks are not read yet.

        Parking serves a readiness after later ones of the same session (those name only
        known requests), so the last layer's done signal can arrive first; the request is
        done only once the parked readiness was read too (its own completion check).
        """
        for item in self.state.parked.values():
            if isinstance(item, ReadinessRecord):
                names = item.names
                at = bisect_left(names, ext)
                if at < len(names) and names[at] == ext:
                    return True
        return False

    def park_readiness(
        self, rd: ReadinessRecord, packed: bytes | None, missing: Iterable[str]
    ) -> None:
        """The readiness machine's PARK effect: park ``rd`` (its entries ``packed``, when
        they could be), awaiting ``missing``."""
        if packed is not None:
            rd.packed = packed
            rd.msg = msgspec.structs.replace(rd.msg, read_reqs=[])
        self.put_parked(rd, missing)
