"""The state every part of the Prefill endpoint shares, and the base of its effects objects.

:class:`ProducerState` is one plain record: every field the endpoint keeps, under public
names, so the effects objects, the model checker and tests read it alike
(``endpoint.state.pubs``). It holds no effects object and no table, so a snapshot of an
endpoint is a snapshot of its state (:meth:`~.endpoint.ProducerEndpoint.__reduce__`).

One effects object per machine of :mod:`rd2h_protocol.machines.producer` works on it
(:mod:`.requests`, :mod:`.handshakes`, :mod:`.publications` with :mod:`.leases` and
:mod:`.dead_peers`, :mod:`.kept`): each derives from :class:`Effects` alone, binds its
machine's table to its own handlers (``TABLE``) and reaches the other machines through
their effects objects, which :func:`wire_effects` links. Outputs go to ``state.out``; the
endpoint's input method that caused them hands the list back and starts a new one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rd2h_protocol.producer.config import Output, ProducerConfig, ProducerStats
from rd2h_protocol.producer.records import Conn, Gate, Kept, Pub, Request
from rd2h_protocol.topology import wire_layer_indices
from rd2h_protocol.wire.layout import assign_storage_slots, encode_layer_metadata
from rd2h_protocol.wire.messages import ALL_CAPABILITIES, PROTOCOL_VERSION, MfMeta, ReadReq

if TYPE_CHECKING:
    from rd2h_protocol.producer.handshakes import ConnectionEffects
    from rd2h_protocol.producer.kept import KeptEffects
    from rd2h_protocol.producer.publications import GateEffects, PublicationEffects
    from rd2h_protocol.producer.requests import RequestEffects


class ProducerState:
    """The records and step bookkeeping of one Prefill endpoint."""

    def __init__(self, config: ProducerConfig) -> None:
        self.config = config
        self.stats = ProducerStats()
        self.layer_names = [name for name, _ in config.layers]
        # Positions are ours; the wire carries each name's layer number (reference §5).
        self.wire_index = wire_layer_indices(self.layer_names)
        self.position_of_wire = {wire: i for i, wire in enumerate(self.wire_index)}
        layouts = [layout for _, layout in config.layers]
        self.layer_slots: list[tuple[int, ...]] = [
            (main,) if idx is None else (main, idx) for main, idx in assign_storage_slots(layouts)
        ]
        self.gates: dict[int, Gate] = {slot: Gate() for slots in self.layer_slots for slot in slots}
        self.last_layer = len(config.layers) - 1
        self.lease_s = config.lease_ms / 1000.0
        self.v1_only = config.protocol == "v1"
        blob = encode_layer_metadata(dict(config.layers))
        if self.v1_only:
            self.meta = MfMeta(p_session=config.session, encoded_layer_metadata=blob)
        else:
            self.meta = MfMeta(
                p_session=config.session,
                encoded_layer_metadata=blob,
                protocol_version=PROTOCOL_VERSION,
                capabilities=list(ALL_CAPABILITIES),
                compat=config.compat or None,
            )
        self.conns: dict[str, Conn] = {}
        self.requests: dict[str, Request] = {}
        self.pubs: dict[int, Pub] = {}  # live publications by uid
        self.handshakes: dict[int, Conn] = {}  # running handshakes by token
        self.kept: dict[str, Kept] = {}  # Prefill-first requests kept, by ext id
        self.kept_timers: dict[int, Kept] = {}  # ... waiting for a claim, by timer uid
        self.timers: list[tuple[float, int]] = []  # (deadline, uid or token), lazy heap
        self.next_uid = 0
        self.pending_raise: dict[int, str] = {}  # slot -> failure to raise ("raise" policy)
        # The current step.
        self.step: dict[str, dict[str, Request]] = {}  # conn -> ext id -> request
        self.step_count = 0  # chunks scheduled and not yet finished
        self.step_layers = 0  # layers written
        self.step_top = -1  # the highest layer written
        # Claimed requests whose later layers wait for the step's end: ext id -> (first
        # layer, what Decode reads).
        self.claims_waiting: dict[str, tuple[int, list[ReadReq]]] = {}
        # The outputs of the input under way (empty between inputs).
        self.out: list[Output] = []

    def uid(self) -> int:
        """A fresh id for a publication, a handshake or a claim window (their timers)."""
        uid = self.next_uid
        self.next_uid += 1
        return uid


class Effects:
    """What every effects object holds: the shared state, and the other machines' effects
    objects (linked by :func:`wire_effects`)."""

    __slots__ = ("conn_fx", "gate_fx", "kept_fx", "pub_fx", "req_fx", "state")

    state: ProducerState
    req_fx: RequestEffects
    conn_fx: ConnectionEffects
    pub_fx: PublicationEffects
    gate_fx: GateEffects
    kept_fx: KeptEffects

    def __init__(self, state: ProducerState) -> None:
        self.state = state


def wire_effects(
    req: RequestEffects,
    conn: ConnectionEffects,
    pub: PublicationEffects,
    gate: GateEffects,
    kept: KeptEffects,
) -> None:
    """Give each effects object (one per machine) the others."""
    for fx in (req, conn, pub, gate, kept):
        fx.req_fx, fx.conn_fx, fx.pub_fx, fx.gate_fx, fx.kept_fx = req, conn, pub, gate, kept
