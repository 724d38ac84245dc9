"""The endpoint's records: per Prefill session, request, readiness and parked ABORT.

Plain slotted classes; the endpoint's layers (see :mod:`rd2h_protocol.consumer`) hold and
change them, and the model checker snapshots their fields by name
(:mod:`rd2h_protocol.checker.canonical`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeAlias

from rd2h_protocol.completion import ContributorSet
from rd2h_protocol.errors import ErrorCode, LayoutMismatch
from rd2h_protocol.machines.consumer import DECODE_READINESS, DECODE_REQUEST, SESSION_UNBOUND
from rd2h_protocol.plan import ComponentAddrs, ReadPlan, RequestRead
from rd2h_protocol.wire.layout import LayerLayout
from rd2h_protocol.wire.messages import (
    FailedRequest,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadReq,
)


class SessionRecord:
    __slots__ = (
        "caps",
        "held",
        "id_bound",
        "layers",
        "layout_bytes",
        "name",
        "next_seq",
        "origin",
        "peer",
        "refusal",
        "remembered",
        "remembered_bytes",
        "state",
        "validated",
    )

    def __init__(self, name: str, origin: bytes) -> None:
        self.name = name
        self.state = SESSION_UNBOUND
        self.peer: bytes | None = None
        self.origin = origin  # the connection that opened it (its budget pays for it)
        # Bytes it holds, charged to its origin's and the total session budgets (see
        # max_session_bytes): the record, its decoded layouts (layout_bytes), validated
        # layers, its reply memory (remembered_bytes) and its kept entries, if any.
        self.held = 0
        self.layout_bytes = 0
        self.caps: frozenset[str] = frozenset()
        self.layers: dict[str, LayerLayout] = {}
        # Every Prefill block id of the layout lies below this (None: a layout without
        # num_blocks, which cannot be checked); the id_bound of wire.readiness.read_frame.
        self.id_bound: int | None = None
        self.refusal: tuple[ErrorCode, str] = (ErrorCode.UNKNOWN, "")
        # The seq the next v2 readiness must carry (None: not known yet).
        self.next_seq: int | None = None
        # seq -> the reply it got, or None while it is served (see REMEMBERED_SEQS).
        self.remembered: OrderedDict[int, ReadDone | ReadFailed | None] = OrderedDict()
        self.remembered_bytes = 0
        # (layer_idx, layer_name) -> validated components, or the mismatch.
        self.validated: dict[
            tuple[int, str],
            tuple[tuple[ComponentAddrs, ...], tuple[ComponentAddrs, ...]] | LayoutMismatch,
        ] = {}


class RequestRecord:
    __slots__ = (
        "contributors",
        "ext_id",
        "fail_code",
        "fail_message",
        "in_flight",
        "indexer_ids",
        "main_ids",
        "sessions",
        "state",
    )

    def __init__(self, ext_id: str, main_ids: Sequence[int], indexer_ids: Sequence[int]) -> None:
        self.ext_id = ext_id
        self.state = DECODE_REQUEST.initial
        self.main_ids = main_ids
        self.indexer_ids = indexer_ids
        self.in_flight = 0  # reads in flight that write this request's blocks
        self.contributors: ContributorSet | None = None
        self.sessions: set[str] = set()  # Prefill sessions that published for it
        self.fail_code = ErrorCode.UNKNOWN
        self.fail_message = ""


class ReadinessRecord:
    __slots__ = (
        "accepted",
        "caps",
        "deadline",
        "finish_by",
        "ids_below",
        "in_plan",
        "isolated",
        "left",
        "msg",
        "names",
        "packed",
        "park_cost",
        "park_id",
        "peer",
        "plan",
        "receipt",
        "retries_left",
        "session",
        "start_by",
        "state",
    )

    def __init__(
        self,
        peer: bytes,
        session: str,
        msg: ReadReadyBatch,
        now: float,
        ids_below: int | None = None,
    ) -> None:
        self.peer = peer
        self.session = session
        self.msg = msg
        # Every Prefill block id of ``msg`` is below this (proven while decoding), or None.
        self.ids_below = ids_below
        self.receipt = now
        self.state = DECODE_READINESS.initial
        self.start_by = None if msg.lease_ms is None else now + msg.lease_ms / 2000.0
        self.finish_by = None if msg.lease_ms is None else now + msg.lease_ms / 1000.0
        self.caps: frozenset[str] = frozenset()
        # While parked (see consumer.parking): every request id it names, sorted; how many
        # of them are still awaited (those indexed under its park id); its entries packed
        # as msgpack (``msg`` then holds no entries); what it holds, in bytes.
        self.names: tuple[str, ...] = ()
        self.left = 0
        self.packed: bytes | None = None
        self.park_cost = 0
        self.deadline = 0.0
        self.park_id = 0
        self.accepted: list[RequestRecord] = []
        self.in_plan: list[RequestRecord] = []
        self.isolated: list[FailedRequest] = []
        self.plan: ReadPlan | None = None
        self.retries_left = 0


class KeptEntries:
    """A session's last readiness entries with their bytes (a
    :class:`~rd2h_protocol.wire.readiness.Readiness`'s ``keep``, passed back to the decoder
    as ``kept``), and this rank's shares of them worked out so far (see
    ``Serving.accept``): every layer of an engine step carries the same entries, so
    their shares are worked out on its first layer and only looked up on the others."""

    __slots__ = ("cost", "entries", "raw", "shares")

    def __init__(self, raw: bytes, entries: list[ReadReq], cost: int = 0) -> None:
        self.raw = raw
        self.entries = entries
        self.cost = cost  # bytes held, charged to the session (see entries_cost)
        # ext -> (entry, request, share rule, share): the share stands for that entry of
        # that request record under that rule (entries and destination ids never change).
        self.shares: dict[str, tuple[ReadReq, RequestRecord, object, RequestRead]] = {}


class ParkedAbort:
    __slots__ = ("deadline", "left", "names", "park_cost", "park_id", "reason", "session")

    def __init__(
        self, session: str, missing: tuple[str, ...], reason: str, deadline: float
    ) -> None:
        self.session = session
        self.names = missing  # sorted; those still awaited are indexed under its park id
        self.left = len(missing)
        self.park_cost = 0  # bytes held, set when it is parked
        self.reason = reason
        self.deadline = deadline
        self.park_id = 0


Parked: TypeAlias = ReadinessRecord | ParkedAbort
