"""The endpoint's state, declared in one place: :class:`ConsumerState`.

Every part of :class:`~rd2h_protocol.consumer.ConsumerEndpoint` (the effects object of
each machine and the collaborators they share, see :mod:`rd2h_protocol.consumer`) works
on one such record and holds no state of its own, so the record is what the endpoint IS:
the model checker snapshots and canonicalises it alone, and rebuilds the parts around it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from rd2h_protocol.consumer.config import ConsumerConfig, ConsumerStats, Output
from rd2h_protocol.consumer.records import (
    KeptEntries,
    Parked,
    ReadinessRecord,
    RequestRecord,
    SessionRecord,
)
from rd2h_protocol.topology import wire_layer_indices
from rd2h_protocol.wire.layout import DestinationLayout


class ConsumerState:
    """Everything one Decode endpoint holds; its parts share it (attributes are public:
    the parts live in several modules, and the checker and tests read them)."""

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        self.stats = ConsumerStats()
        self.layers: tuple[tuple[str, DestinationLayout], ...] = tuple(config.layers)
        # name -> (the layer_idx a readiness for it must carry, destination)
        self.by_name: dict[str, tuple[int, DestinationLayout]] = {
            name: (index, dst)
            for (name, dst), index in zip(
                self.layers, wire_layer_indices([n for n, _ in self.layers]), strict=True
            )
        }
        self.caps = frozenset(config.capabilities)
        self.main_limit, self.indexer_limit = destination_limits(self.layers)
        self.sessions: OrderedDict[str, SessionRecord] = OrderedDict()
        self.peers: dict[bytes, str] = {}
        self.requests: dict[str, RequestRecord] = {}
        # Load deadlines of active requests, in the order they were set (= deadline order).
        self.deadlines: OrderedDict[str, float] = OrderedDict()
        self.reads: dict[int, ReadinessRecord] = {}
        self.parked: dict[int, Parked] = {}
        self.parked_bytes = 0  # what the parked items hold (see max_parked_bytes)
        self.parked_bytes_by_session: dict[str, int] = {}
        self.session_bytes = 0  # bytes the sessions kept hold (see SessionRecord.held)
        self.session_bytes_by_origin: dict[bytes, int] = {}
        # connection -> the sessions it opened, least recently bound first
        self.origin_sessions: dict[bytes, OrderedDict[str, None]] = {}
        # awaited request id -> the park id waiting for it, or their ascending tuple
        self.waiting: dict[str, int | tuple[int, ...]] = {}
        self.retired: OrderedDict[str, None] = OrderedDict()
        self.next_read_id = 1
        self.next_park_id = 1
        # The outputs of the input being handled (every part appends; the endpoint's
        # input method hands them out and clears the list).
        self.out: list[Output] = []
        # session -> (the request ids to ABORT toward it, the reason), sent at the end
        self.aborts: dict[str, tuple[list[str], str]] = {}
        # session -> its last readiness entries (bytes, decoded, shares)
        self.entry_cache: OrderedDict[str, KeptEntries] = OrderedDict()


def destination_limits(
    layers: Sequence[tuple[str, DestinationLayout]],
) -> tuple[int | None, int | None]:
    """The block-id bounds a request's destination ids must respect on every layer."""
    main = [c.num_blocks for _, d in layers for c in d.main]
    idx = [c.num_blocks for _, d in layers for c in (d.indexer, d.scale) if c is not None]
    return (min(main) if main else None), (min(idx) if idx else None)
