"""The state every part of the Prefill endpoint shares, and the tables it fires.

:class:`_ProducerState` declares it all (``__init__``). Each module of this package adds
one concern to it as a subclass, and calls methods only of the classes it derives from:
:mod:`.requests` and :mod:`.handshakes`, then :mod:`.publications`, :mod:`.dead_peers`,
:mod:`.leases`, :mod:`.kept` and :mod:`.endpoint`, whose :class:`ProducerEndpoint` binds
each effect of each table to its handler. Handlers reach the others through those tables
only: a module fires ``self._PUB`` (say) without knowing which class handles the effect.
"""

from __future__ import annotations

from typing import ClassVar

from rd2h_protocol.machines.declare import BoundMachine
from rd2h_protocol.producer.config import ProducerConfig, ProducerStats
from rd2h_protocol.producer.records import _Conn, _Gate, _Kept, _Pub, _Request
from rd2h_protocol.topology import wire_layer_indices
from rd2h_protocol.wire.layout import assign_storage_slots, encode_layer_metadata
from rd2h_protocol.wire.messages import ALL_CAPABILITIES, PROTOCOL_VERSION, MfMeta


class _ProducerState:
    """The records and step bookkeeping of one Prefill endpoint.

    The tables are bound to their handlers by :class:`~.endpoint.ProducerEndpoint`.
    """

    # One table per machine of :mod:`rd2h_protocol.machines.producer`.
    _GATE: ClassVar[BoundMachine]  # STORAGE_GATE: one per storage slot
    _REQUEST: ClassVar[BoundMachine]  # PREFILL_REQUEST
    _PUB: ClassVar[BoundMachine]  # LAYER_PUBLICATION
    _CONN: ClassVar[BoundMachine]  # CONNECTION_HANDSHAKE: one per Decode endpoint
    _KEPT: ClassVar[BoundMachine]  # KEPT_REQUEST: one per Prefill-first request kept

    def __init__(self, config: ProducerConfig) -> None:
        self.config = config
        self.stats = ProducerStats()
        self._layer_names = [name for name, _ in config.layers]
        # Positions are ours; the wire carries each name's layer number (reference §5).
        self._wire_index = wire_layer_indices(self._layer_names)
        self._position_of_wire = {wire: i for i, wire in enumerate(self._wire_index)}
        layouts = [layout for _, layout in config.layers]
        self._layer_slots: list[tuple[int, ...]] = [
            (main,) if idx is None else (main, idx) for main, idx in assign_storage_slots(layouts)
        ]
        self._gates: dict[int, _Gate] = {
            slot: _Gate() for slots in self._layer_slots for slot in slots
        }
        self._last_layer = len(config.layers) - 1
        self._lease_s = config.lease_ms / 1000.0
        self._v1_only = config.protocol == "v1"
        blob = encode_layer_metadata(dict(config.layers))
        if self._v1_only:
            self._meta = MfMeta(p_session=config.session, encoded_layer_metadata=blob)
        else:
            self._meta = MfMeta(
                p_session=config.session,
                encoded_layer_metadata=blob,
                protocol_version=PROTOCOL_VERSION,
                capabilities=list(ALL_CAPABILITIES),
                compat=config.compat or None,
            )
        self._conns: dict[str, _Conn] = {}
        self._requests: dict[str, _Request] = {}
        self._pubs: dict[int, _Pub] = {}  # live publications by uid
        self._handshakes: dict[int, _Conn] = {}  # running handshakes by token
        self._kept: dict[str, _Kept] = {}  # Prefill-first requests kept, by ext id
        self._kept_timers: dict[int, _Kept] = {}  # ... waiting for a claim, by timer uid
        self._timers: list[tuple[float, int]] = []  # (deadline, uid or token), lazy heap
        self._next_uid = 0
        self._pending_raise: dict[int, str] = {}  # slot -> failure to raise ("raise" policy)
        # The current step.
        self._step: dict[str, dict[str, _Request]] = {}  # conn -> ext id -> request
        self._step_count = 0  # chunks scheduled and not yet finished
        self._step_layers = 0  # layers written
        self._step_top = -1  # the highest layer written

    def _uid(self) -> int:
        uid = self._next_uid
        self._next_uid += 1
        return uid
