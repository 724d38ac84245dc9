"""What a Prefill session holds on Decode, in bytes: the accounting of the session budgets.

A session is charged (``SessionRecord.held``, summed per connection that opened it and in all;
see ``max_session_bytes`` in :class:`~rd2h_protocol.consumer.ConsumerConfig`):

* its record (:data:`SESSION_RECORD_BYTES`, with its name and its index entries);
* the decoded layouts it keeps, only those of layers this rank has (a readiness for any
  other layer is refused before its layout is looked at), so a handshake of 4,096 layers
  keeps what the Decode's own layers need (:func:`layouts_cost`), and a validated layer
  (:data:`VALIDATED_BYTES` each, one per layer of this rank at most);
* its reply memory (:func:`reply_cost` per remembered seq, at most
  ``REMEMBERED_SEQS`` seqs and ``_REMEMBERED_BYTES``);
* its last readiness entries, while they are kept (:func:`entries_cost`).

Each figure is summed from ``sys.getsizeof`` of the objects kept (the containers' slots
at the load they keep) or is an upper bound of it, so the budgets bound what is held;
``tests/protocol/test_hostile_budgets.py`` measures it with tracemalloc.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from rd2h_protocol.consumer.records import SessionRecord
from rd2h_protocol.consumer.state import ConsumerState
from rd2h_protocol.wire.layout import LayerLayout
from rd2h_protocol.wire.messages import ReadDone, ReadFailed, ReadReq
from rd2h_protocol.wire.readiness import entry_request_id

# A session's record with its empty containers (``remembered``, ``validated``, ``layers``)
# and its entries in ``sessions``, ``origin_sessions`` and ``peers``; its name apart.
SESSION_RECORD_BYTES: Final = 1024

# One validated layer: its key, its two tuples of component addresses (or the mismatch)
# and their dict slot.
VALIDATED_BYTES: Final = 1024

# A dict slot (key hash, key, value and the index), at the worst load a dict keeps.
_SLOT_BYTES: Final = 104

# An int object above 256 (CPython caches those below): 28 bytes below 2**30, 32 below
# 2**60; block ids are below 2**32.
_INT_BYTES: Final = 32

# What working out one entry's share keeps (see KeptEntries.shares): its slot, the tuple
# and the share record; its ids are slices of the entry's (a whole slice is the tuple).
_SHARE_BYTES: Final = 512


def _ints_bytes(values: Iterable[object]) -> int:
    return sum(map(sys.getsizeof, values))


def _layout_cost(name: str, layout: LayerLayout) -> int:
    held = _SLOT_BYTES + sys.getsizeof(name) + sys.getsizeof(layout)
    for values in (
        layout.base_addrs,
        layout.block_len,
        layout.block_size_scale,
        layout.tensor_group_idx,
    ):
        if values is not None:
            held += sys.getsizeof(values) + _ints_bytes(values)
    return held


def layouts_cost(layers: Mapping[str, LayerLayout]) -> int:
    """Bytes the decoded ``layers`` hold (the dict, each name, layout, list and int)."""
    return sys.getsizeof(layers) + sum(_layout_cost(n, lay) for n, lay in layers.items())


def reply_cost(reply: ReadDone | ReadFailed | None) -> int:
    """Bytes one remembered seq holds: its slot (an OrderedDict keeps a link per key),
    the seq and the reply with its texts and failed requests."""
    held = 2 * _SLOT_BYTES + _INT_BYTES
    if reply is None:
        return held
    held += sys.getsizeof(reply)
    if isinstance(reply, ReadFailed):
        return held + sys.getsizeof(reply.error or "")
    failed = reply.failed or ()
    held += sys.getsizeof(failed) + sum(map(sys.getsizeof, failed))
    held += sum(map(sys.getsizeof, map(entry_request_id, failed)))
    return held + sum(map(sys.getsizeof, map(_MESSAGE, failed)))


_MAIN_IDS: Final = operator.attrgetter("main_block_ids")
_MESSAGE: Final = operator.attrgetter("message")


def entries_bytes(entries: Sequence[ReadReq]) -> int:
    """Bytes decoded entries hold: the records, their request ids and their id lists (each
    id an int above 256 at the worst: an upper bound, ids below that are shared objects; a
    list both fields share counted once). Summed by ``map``: this runs once per readiness,
    over up to 16,384 entries, while the Decode worker's lock is held."""
    mains = list(map(_MAIN_IDS, entries))
    indexers = [
        ix
        for rr in entries
        if (ix := rr.indexer_block_ids) is not None and ix is not rr.main_block_ids
    ]
    return (
        sum(map(sys.getsizeof, entries))
        + sum(map(sys.getsizeof, map(entry_request_id, entries)))
        + sum(map(sys.getsizeof, mains))
        + sum(map(sys.getsizeof, indexers))
        + _INT_BYTES * (sum(map(len, mains)) + sum(map(len, indexers)))
    )


def entries_cost(raw: bytes, entries: list[ReadReq]) -> int:
    """Bytes a session's kept entries hold: their bytes, the decoded entries and an
    allowance for the share worked out for each."""
    held = sys.getsizeof(raw) + sys.getsizeof(entries)
    return held + entries_bytes(entries) + _SHARE_BYTES * len(entries)


class SessionBudgets:
    """Charging what sessions hold, and freeing it beyond the budgets (a collaborator of
    the session, readiness and serving parts, over the endpoint's state)."""

    __slots__ = ("state",)

    def __init__(self, state: ConsumerState) -> None:
        self.state = state

    def forget_session(self, name: str) -> None:
        """Drop session ``name`` and what it keeps; its Prefill learns UNKNOWN_SESSION."""
        old = self.state.sessions.pop(name)
        mine = self.state.origin_sessions[old.origin]
        del mine[name]
        if not mine:
            del self.state.origin_sessions[old.origin]
        if old.peer is not None:
            self.state.peers.pop(old.peer, None)
        self.state.entry_cache.pop(name, None)
        self.charge(old, -old.held)
        self.state.stats.sessions_forgotten += 1

    def charge(self, session: SessionRecord, delta: int) -> None:
        """Add ``delta`` bytes to what ``session`` holds, and to its budgets' sums."""
        session.held += delta
        self.state.session_bytes += delta
        left = self.state.session_bytes_by_origin.get(session.origin, 0) + delta
        if left:
            self.state.session_bytes_by_origin[session.origin] = left
        else:
            self.state.session_bytes_by_origin.pop(session.origin, None)

    def account_layout(self, session: SessionRecord, size: int) -> None:
        """Set what ``session``'s layouts (and validated layers) hold."""
        self.charge(session, size - session.layout_bytes)
        session.layout_bytes = size

    def drop_entries(self, name: str) -> bool:
        """Forget session ``name``'s kept entries, if any (the next step decodes again)."""
        kept = self.state.entry_cache.pop(name, None)
        if kept is None:
            return False
        session = self.state.sessions.get(name)
        if session is not None:
            self.charge(session, -kept.cost)
        return True

    def by_weight(self) -> list[bytes]:
        """The connections that opened sessions, those holding the most bytes first."""
        by = self.state.session_bytes_by_origin
        return sorted(by, key=by.__getitem__, reverse=True)

    def shed(self, origin: bytes, keep: SessionRecord, *, entries: bool = True) -> bool:
        """Free something the sessions ``origin`` opened hold; False if nothing is left
        but ``keep``'s record. First the kept entries of its other sessions (least
        recently used first), then its least recently bound session other than
        ``keep``, then ``keep``'s kept entries (``entries``: entries may go)."""
        if entries:
            for name in self.state.entry_cache:
                session = self.state.sessions.get(name)
                if name != keep.name and session is not None and session.origin == origin:
                    self.state.stats.entries_dropped += 1
                    return self.drop_entries(name)
        for name in self.state.origin_sessions.get(origin, ()):
            if name != keep.name:
                self.forget_session(name)
                return True
        if entries and keep.origin == origin and self.drop_entries(keep.name):
            self.state.stats.entries_dropped += 1
            return True
        return False

    def enforce_session_budgets(self, keep: SessionRecord) -> None:
        """Free what sessions hold beyond the byte budgets, never ``keep``'s record: first
        within ``keep``'s connection (its budget), then the heaviest connections' (the
        total), so that a connection flooding sessions or big frames pays for itself."""
        cfg = self.state.config
        by = self.state.session_bytes_by_origin
        origin = keep.origin
        while by.get(origin, 0) > cfg.max_session_bytes_per_peer:
            if not self.shed(origin, keep):
                break
        if self.state.session_bytes <= cfg.max_session_bytes:
            return
        for heavy in self.by_weight():
            while self.state.session_bytes > cfg.max_session_bytes and heavy in by:
                if not self.shed(heavy, keep):
                    break
