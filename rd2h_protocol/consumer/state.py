"""The endpoint's state, declared in one place, and the request machine's input.

:class:`_EndpointState` is the bottom layer of :class:`~rd2h_protocol.consumer.ConsumerEndpoint`
(the layers above add behaviour, never state). The three bound tables are class
attributes set by :mod:`rd2h_protocol.consumer.endpoint` once every handler exists: the
handlers of one machine live in several layers, and some of them fire another machine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from rd2h_protocol.consumer.config import ConsumerConfig, ConsumerStats, Output
from rd2h_protocol.consumer.records import _KeptEntries, _Parked, _Readiness, _Request, _Session
from rd2h_protocol.errors import ErrorCode, LocalProtocolError
from rd2h_protocol.machines.declare import BoundMachine
from rd2h_protocol.topology import wire_layer_indices
from rd2h_protocol.wire.layout import DestinationLayout


class _EndpointState:
    """Everything one Decode endpoint holds; the layers above share it."""

    # Each machine's table bound to its handlers (see the module docstring).
    _READINESS: ClassVar[BoundMachine]
    _REQUEST: ClassVar[BoundMachine]
    _SESSION: ClassVar[BoundMachine]

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        self.stats = ConsumerStats()
        self._layers: tuple[tuple[str, DestinationLayout], ...] = tuple(config.layers)
        # name -> (the layer_idx a readiness for it must carry, destination)
        self._by_name: dict[str, tuple[int, DestinationLayout]] = {
            name: (index, dst)
            for (name, dst), index in zip(
                self._layers, wire_layer_indices([n for n, _ in self._layers]), strict=True
            )
        }
        self._caps = frozenset(config.capabilities)
        self._main_limit, self._indexer_limit = self._destination_limits(self._layers)
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._peers: dict[bytes, str] = {}
        self._requests: dict[str, _Request] = {}
        # Load deadlines of active requests, in the order they were set (= deadline order).
        self._deadlines: OrderedDict[str, float] = OrderedDict()
        self._reads: dict[int, _Readiness] = {}
        self._parked: dict[int, _Parked] = {}
        self._parked_bytes = 0  # what the parked items hold (see max_parked_bytes)
        self._parked_bytes_by_session: dict[str, int] = {}
        self._session_bytes = 0  # bytes the sessions kept hold (see _Session.held)
        self._session_bytes_by_origin: dict[bytes, int] = {}
        # connection -> the sessions it opened, least recently bound first
        self._origin_sessions: dict[bytes, OrderedDict[str, None]] = {}
        # awaited request id -> the park id waiting for it, or their ascending tuple
        self._waiting: dict[str, int | tuple[int, ...]] = {}
        self._retired: OrderedDict[str, None] = OrderedDict()
        self._next_read_id = 1
        self._next_park_id = 1
        self._out: list[Output] = []
        self._aborts: dict[str, tuple[list[str], str]] = {}
        # session -> its last readiness entries (bytes, decoded, shares)
        self._entry_cache: OrderedDict[str, _KeptEntries] = OrderedDict()

    @staticmethod
    def _destination_limits(
        layers: Sequence[tuple[str, DestinationLayout]],
    ) -> tuple[int | None, int | None]:
        """The block-id bounds a request's destination ids must respect on every layer."""
        main = [c.num_blocks for _, d in layers for c in d.main]
        idx = [c.num_blocks for _, d in layers for c in (d.indexer, d.scale) if c is not None]
        return (min(main) if main else None), (min(idx) if idx else None)

    def _known(self, ext: str) -> _Request:
        req = self._requests.get(ext)
        if req is None:
            raise LocalProtocolError(f"request {ext!r} is not registered")
        return req

    def _touch(self, reqs: Sequence[_Request], now: float) -> None:
        """Restart the requests' load timers (they made progress): each deadline moves to
        the end, in the order given (as setting each and moving it to the end would)."""
        deadlines = self._deadlines
        exts = [req.ext_id for req in reqs]
        for ext in exts:
            deadlines.pop(ext, None)
        deadlines.update(dict.fromkeys(exts, now + self.config.kv_load_timeout_s))

    def _request_event(
        self,
        req: _Request,
        event: str,
        now: float,
        code: ErrorCode = ErrorCode.UNKNOWN,
        text: str = "",
        *,
        exclude: str | None = None,
    ) -> None:
        """Fire ``event`` on ``req``'s machine (every input but RECV_READINESS)."""
        self._REQUEST.fire(self, req, event, now, code, text, exclude)
