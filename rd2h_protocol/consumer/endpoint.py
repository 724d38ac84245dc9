"""The Decode endpoint's inputs: what the runtime calls, and the tables bound to handlers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar, Final

from rd2h_protocol.consumer.config import ConsumerConfig, ConsumerStats, Output
from rd2h_protocol.consumer.held import SessionBudgets, entries_cost
from rd2h_protocol.consumer.parking import Parking, awaited_names
from rd2h_protocol.consumer.reads import ReadinessEffects
from rd2h_protocol.consumer.records import (
    KeptEntries,
    ReadinessRecord,
    RequestRecord,
    SessionRecord,
)
from rd2h_protocol.consumer.replies import Replies, clip
from rd2h_protocol.consumer.requests import RequestEffects
from rd2h_protocol.consumer.serving import Serving
from rd2h_protocol.consumer.sessions import SessionEffects
from rd2h_protocol.consumer.state import ConsumerState
from rd2h_protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, TransferError
from rd2h_protocol.events import ConnectionView, Releasable, Reply, SendAbort
from rd2h_protocol.machines.consumer import (
    M_TIMER_PARK_EXPIRED,
    R_LOCAL_ABORT,
    R_LOCAL_ADVERTISE,
    R_LOCAL_RELEASE,
    R_LOCAL_RELEASE_BUSY,
    R_TIMER_LOAD_TIMEOUT,
    SESSION_V1,
    SESSION_V2,
)
from rd2h_protocol.machines.consumer_inputs import RdAt, ReqAt, ReqEnd
from rd2h_protocol.machines.declare import BoundMachine
from rd2h_protocol.wire.messages import (
    CAP_ABORT,
    MAX_REQUESTS_PER_BATCH,
    Abort,
    Message,
    MfMeta,
    ReadReadyBatch,
    ReadReq,
)
from rd2h_protocol.wire.readiness import (
    WIRE_ID_LIMIT,
    Readiness,
    Unreadable,
    read_frame,
    unique_ids,
)

# Sessions whose last readiness entries are kept (see receive).
ENTRY_CACHE_SESSIONS: Final = 64

# What ConsumerEndpoint._build sets: the attributes a read-back endpoint builds on first use.
_PARTS: Final = frozenset(
    {
        "config",
        "stats",
        "budgets",
        "parking",
        "requests_fx",
        "replies",
        "readiness_fx",
        "serving",
        "sessions_fx",
    }
)


def _frozen_ids(ids: Sequence[int]) -> Sequence[int]:
    """A request's destination ids, kept immutable: a ``range`` when they are contiguous
    (plans then carry no per-id data for them), else a tuple (a whole-tuple slice is the
    tuple itself, so plans share it instead of copying)."""
    if isinstance(ids, range) and ids.step == 1:
        return ids
    held = tuple(ids)
    n = len(held)
    if n > 1 and isinstance(held[0], int) and isinstance(held[-1], int):
        first = held[0]
        if held[-1] - first == n - 1 and held == tuple(range(first, first + n)):
            return range(first, first + n)
    return held


class ConsumerEndpoint:
    """One Decode TP rank's protocol state (sans-IO). See the package docstring.

    Every input method takes ``now`` (monotonic seconds, never decreasing) and returns the
    list of outputs to execute in order: what the parts appended to ``state.out`` during
    the call, then cleared.

    The endpoint is its :class:`~rd2h_protocol.consumer.state.ConsumerState` (``state``)
    and the parts that act on it: one effects object per machine (``sessions_fx``,
    ``readiness_fx``, ``requests_fx``; each owns its machine's bound table, ``TABLE``)
    and the collaborators they share (``budgets``, ``parking``, ``replies``,
    ``serving``). The parts hold nothing but references, so an endpoint pickles as its
    state alone (:func:`endpoint_of` reads it back), and a read-back endpoint builds its
    parts when one is first used (the model checker reads back many endpoints of which
    it drives one).
    """

    #: The three machines' bound tables (each its effects class's ``TABLE``).
    READINESS: ClassVar[BoundMachine] = ReadinessEffects.TABLE
    REQUEST: ClassVar[BoundMachine] = RequestEffects.TABLE
    SESSION: ClassVar[BoundMachine] = SessionEffects.TABLE

    state: ConsumerState
    config: ConsumerConfig
    stats: ConsumerStats
    budgets: SessionBudgets
    parking: Parking
    requests_fx: RequestEffects
    replies: Replies
    readiness_fx: ReadinessEffects
    serving: Serving
    sessions_fx: SessionEffects

    def __init__(self, config: ConsumerConfig) -> None:
        self.state = ConsumerState(config)
        self._build()

    def _build(self) -> None:
        """Build the parts around ``self.state`` and wire each to those it uses."""
        state = self.state
        self.config = state.config
        self.stats = state.stats
        budgets = self.budgets = SessionBudgets(state)
        parking = self.parking = Parking(state)
        request = self.requests_fx = RequestEffects(state)
        replies = self.replies = Replies(state)
        readiness = self.readiness_fx = ReadinessEffects(state)
        serving = self.serving = Serving(state)
        session = self.sessions_fx = SessionEffects(state)
        parking.request, parking.readiness = request, readiness
        request.parking, request.serving = parking, serving
        replies.budgets, replies.request, replies.readiness = budgets, request, readiness
        readiness.parking, readiness.replies = parking, replies
        readiness.request, readiness.serving, readiness.sessions = request, serving, session
        serving.budgets, serving.parking, serving.replies = budgets, parking, replies
        serving.request, serving.readiness = request, readiness
        session.budgets, session.parking, session.replies = budgets, parking, replies
        session.request, session.serving = request, serving

    if not TYPE_CHECKING:  # hidden from mypy, which then still reports unknown names

        def __getattr__(self, name: str) -> object:
            # Reached only for an attribute not set: a part of an endpoint read back, built
            # now (see the class docstring); then every part is a plain attribute.
            if name not in _PARTS or "state" not in self.__dict__:
                raise AttributeError(name)
            self._build()
            return self.__dict__[name]

    def __reduce__(self) -> tuple[Callable[[ConsumerState], ConsumerEndpoint], tuple[object]]:
        # Only the state: the parts are rebuilt around it (see the class docstring).
        return endpoint_of, (self.state,)

    # -- views (for invariant checks and metrics) ------------------------------------------

    def requests(self) -> dict[str, str]:
        """``{external request id: state}`` of every request this rank holds."""
        return {ext: req.state for ext, req in self.state.requests.items()}

    def in_flight_reads(self) -> dict[int, tuple[str, ...]]:
        """``{read_id: request ids whose blocks the read writes}`` of every read in flight."""
        return {rid: tuple(r.ext_id for r in rd.in_plan) for rid, rd in self.state.reads.items()}

    def parked(self) -> dict[int, tuple[str, ...]]:
        """``{park id: request ids still awaited}`` of every parked readiness or abort."""
        # (views read the state alone: a read-back endpoint builds no parts for them)
        waiting = self.state.waiting
        return {pid: awaited_names(waiting, p) for pid, p in self.state.parked.items()}

    def sessions(self) -> dict[str, str]:
        """``{Prefill session: state}``."""
        return {name: s.state for name, s in self.state.sessions.items()}

    def negotiated(self, peer: bytes) -> ConnectionView | None:
        """The protocol and capabilities of the session ``peer`` is bound to (None: none)."""
        session = self._session_of(peer)
        if session is None:
            return None
        return ConnectionView.of(
            session.name, session.state, session.caps, v2_state=SESSION_V2, v1_state=SESSION_V1
        )

    def session_of_peer(self, peer: bytes) -> str | None:
        """The name of the Prefill session ``peer`` hand-shook for, if any (for logs)."""
        session = self._session_of(peer)
        return None if session is None else session.name

    def _session_of(self, peer: bytes) -> SessionRecord | None:
        state = self.state
        name = state.peers.get(peer)
        return None if name is None else state.sessions.get(name)

    def in_flight_count(self, ext_req_id: str) -> int:
        """Reads in flight that write ``ext_req_id``'s blocks (0 for an unknown request)."""
        req = self.state.requests.get(ext_req_id)
        return 0 if req is None else req.in_flight

    def is_idle(self) -> bool:
        """Whether no per-request state is left (requests, reads, parked messages)."""
        state = self.state
        return not (state.requests or state.reads or state.parked or state.deadlines)

    # -- timers ----------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """The earliest deadline, or ``None`` when nothing waits on time."""
        state = self.state
        times = [p.deadline for p in state.parked.values()]
        if state.deadlines:
            times.append(next(iter(state.deadlines.values())))
        return min(times) if times else None

    def handle_timer(self, now: float) -> list[Output]:
        """Handle every deadline at or before ``now``.

        Parked readiness past its bound is served with its still-unknown requests
        isolated (or refused, past its lease); a request with no progress for
        ``kv_load_timeout_s`` fails with ``TIMEOUT`` and its v2 peers get ABORT.
        """
        # Serving one expired item never unparks another (only add/retire do), so the
        # list taken up front stays valid.
        state, readiness = self.state, self.readiness_fx
        for item in [p for p in state.parked.values() if p.deadline <= now]:
            self.parking.unpark(item)
            state.stats.park_expired += 1
            if isinstance(item, ReadinessRecord):
                readiness.TABLE.apply(readiness, item, M_TIMER_PARK_EXPIRED, RdAt(now))
        deadlines = state.deadlines
        while deadlines:
            ext, deadline = next(iter(deadlines.items()))
            if deadline > now:
                break
            req = state.requests[ext]
            state.stats.load_timeouts += 1
            text = f"no KV progress for {state.config.kv_load_timeout_s} s"
            self.requests_fx.apply(req, R_TIMER_LOAD_TIMEOUT, ReqEnd(now, ErrorCode.TIMEOUT, text))
        return self._flush()

    # -- local inputs ----------------------------------------------------------------------

    def add_request(
        self,
        ext_req_id: str,
        main_block_ids: Sequence[int],
        indexer_block_ids: Sequence[int],
        now: float,
        *,
        advertised: bool = True,
    ) -> list[Output]:
        """Register a request's destination block ids (logical order) on this rank.

        ``advertised``: the rendezvous was posted already (the usual case); otherwise
        call :meth:`advertise` later. Readiness parked for the request is served now.
        Raises :class:`LocalProtocolError` for an id already held or a block id outside
        the destination layout.
        """
        state = self.state
        if ext_req_id in state.requests:
            raise LocalProtocolError(f"request {ext_req_id!r} is already registered")
        main, idx = _frozen_ids(main_block_ids), _frozen_ids(indexer_block_ids)
        if idx == main:
            idx = main  # one object: the planner unboxes shared ids once per read
        limits = (("main", main, state.main_limit), ("indexer", idx, state.indexer_limit))
        for what, ids, limit in limits:
            if ids and (min(ids) < 0 or (limit is not None and max(ids) >= limit)):
                raise LocalProtocolError(
                    f"request {ext_req_id!r}: {what} destination block ids must lie in "
                    f"[0, {limit}), got {min(ids)}..{max(ids)}",
                    ErrorCode.DESTINATION_RANGE,
                )
        state.retired.pop(ext_req_id, None)
        req = RequestRecord(ext_req_id, main, idx)
        state.requests[ext_req_id] = req
        request = self.requests_fx
        request.touch((req,), now)
        if advertised:
            request.apply(req, R_LOCAL_ADVERTISE, ReqAt(now))
        self.parking.resolve_waiting(ext_req_id, now)
        return self._flush()

    def advertise(self, ext_req_id: str, now: float) -> list[Output]:
        """The request's rendezvous was posted (for ``add_request(advertised=False)``)."""
        request = self.requests_fx
        req = request.known(ext_req_id)
        request.apply(req, R_LOCAL_ADVERTISE, ReqAt(now))
        request.touch((req,), now)
        return self._flush()

    def abort(self, ext_ids: Iterable[str], reason: str, now: float) -> list[Output]:
        """Abort requests locally: each fails (``ABORTED``) and its v2 peers get ABORT.

        Ids this rank does not hold are remembered as retired, so readiness for them is
        refused instead of parked.
        """
        requests, ctx = self.state.requests, ReqEnd(now, ErrorCode.ABORTED, reason)
        for ext in unique_ids(ext_ids):
            req = requests.get(ext)
            if req is None:
                self.parking.retire(ext, now)
            else:
                self.requests_fx.apply(req, R_LOCAL_ABORT, ctx)
        return self._flush()

    def release(self, ext_req_id: str, now: float) -> list[Output]:
        """vLLM finished the request (``request_finished``).

        The blocks may be freed now if and only if the returned outputs contain
        ``Releasable(ext_req_id)``; otherwise a read may still write them, and a later
        output (from :meth:`read_finished`) says when. A request released before its KV
        arrived ends as aborted (``RequestFailed`` + ABORT to its v2 peers).
        """
        req = self.state.requests.get(ext_req_id)
        if req is None:
            self.parking.retire(ext_req_id, now)
            self.state.out.append(Releasable(ext_req_id))
        else:
            event = R_LOCAL_RELEASE if req.in_flight == 0 else R_LOCAL_RELEASE_BUSY
            text = "released by vLLM before its KV arrived"
            self.requests_fx.apply(req, event, ReqEnd(now, ErrorCode.ABORTED, text))
        return self._flush()

    def read_finished(self, read_id: int, error: TransferError | None, now: float) -> list[Output]:
        """A :class:`StartRead` ended: ``error`` is ``None`` on success.

        Raises :class:`LocalProtocolError` for a ``read_id`` not in flight.
        """
        rd = self.state.reads.pop(read_id, None)
        if rd is None:
            raise LocalProtocolError(f"read {read_id} is not in flight")
        readiness = self.readiness_fx
        if error is None:
            readiness.read_succeeded(rd, now)
        elif readiness.may_retry(rd, error, now):
            readiness.retry(rd, now)
        else:
            readiness.read_failed(rd, error, now)
        return self._flush()

    # -- peer input ------------------------------------------------------------------------

    def receive(
        self, peer: bytes, frame: Message | bytes | bytearray | memoryview, now: float
    ) -> list[Output]:
        """Handle one frame (or decoded message) from Prefill peer ``peer``; never raises.

        A frame is read once, by :func:`~rd2h_protocol.wire.readiness.read_frame`, given
        the session's block id bound and kept entries; what it returns decides the rest.
        A frame that does not decode is counted; if it is a readiness whose ``layer_idx``
        (and ``seq``, when present) can be read, it still gets a failure reply and the
        known requests it names fail, so no Prefill gate waits for it.
        """
        if not isinstance(frame, bytes | bytearray | memoryview):
            return self._receive(peer, frame, now, None)
        session = self.sessions_fx.session_of(peer)
        if session is None:
            read = self.read_frame(frame)
        else:
            # Kept entries were read under this bound: a handshake drops them.
            kept = self.state.entry_cache.get(session.name)
            read = self.read_frame(
                frame,
                id_bound=WIRE_ID_LIMIT if session.id_bound is None else session.id_bound,
                kept=None if kept is None else (kept.raw, kept.entries),
            )
        if isinstance(read, Readiness):
            if session is not None:
                if read.reused:
                    self.state.entry_cache.move_to_end(session.name)
                elif read.keep is not None:
                    self._keep_entries(session, read.keep, read.msg.read_reqs)
            return self._receive(peer, read.msg, now, read.ids_below)
        if isinstance(read, Unreadable):
            return self._unreadable(peer, read, now)
        return self._receive(peer, read, now, None)

    #: Reads a frame (:func:`~rd2h_protocol.wire.readiness.read_frame`); an attribute so
    #: that a test or a benchmark can stand another reader in for it.
    read_frame = staticmethod(read_frame)

    def _unreadable(self, peer: bytes, read: Unreadable, now: float) -> list[Output]:
        """A frame that does not decode: counted; a readiness that names its layer (and
        its ``seq``, when present) gets a failure reply, and the known requests it names
        fail, so no Prefill gate waits for it."""
        stats = self.state.stats
        stats.malformed_frames += 1
        if read.too_many_block_ids:
            stats.block_id_refusals += 1
        if read.layer_idx is None:
            stats.dropped += 1
            return []
        stats.layer_failures += 1
        reply = self.replies.failure_reply(read.layer_idx, read.seq, read.code, read.message)
        self.state.out.append(Reply(peer, reply))
        self.requests_fx.fail_known(
            read.ids, now, read.code, f"malformed readiness: {read.message}"
        )
        return self._flush()

    def _keep_entries(self, session: SessionRecord, raw: bytes, entries: list[ReadReq]) -> None:
        """Keep ``session``'s last entries (a :class:`Readiness`'s ``keep``, passed back to
        the decoder as ``kept``), charged to its budgets: at most ENTRY_CACHE_SESSIONS
        sessions' and what the byte budgets leave room for (entries that do not fit are
        not kept: the next layer decodes its own)."""
        budgets, cache = self.budgets, self.state.entry_cache
        budgets.drop_entries(session.name)
        kept = KeptEntries(raw, entries, entries_cost(raw, entries))
        cache[session.name] = kept
        budgets.charge(session, kept.cost)
        while len(cache) > ENTRY_CACHE_SESSIONS:
            budgets.drop_entries(next(iter(cache)))
        budgets.enforce_session_budgets(session)

    def _receive(
        self, peer: bytes, msg: Message, now: float, ids_below: int | None
    ) -> list[Output]:
        try:
            if isinstance(msg, ReadReadyBatch):
                self.sessions_fx.on_readiness(peer, msg, now, ids_below)
            elif isinstance(msg, MfMeta):
                self.sessions_fx.on_mf_meta(peer, msg)
            elif isinstance(msg, Abort):
                self.sessions_fx.on_abort(peer, msg, now)
            else:
                self.state.stats.unexpected_messages += 1
        except ProtocolError:
            # Input that no table allows (none does today: the session table has a row for
            # every input in every state). As h2 closes a stream on a protocol error, that
            # peer's session is closed: nothing half-done of it stays bound, and its Prefill
            # learns UNKNOWN_SESSION on its next readiness and hand-shakes again (a v1 one
            # gets a read_failed). The runtime logs the peer with the count.
            self.state.stats.protocol_errors += 1
            name = self.state.peers.get(peer)
            if name is not None and name in self.state.sessions:
                self.budgets.forget_session(name)
        return self._flush()

    # -- output ----------------------------------------------------------------------------

    def _flush(self) -> list[Output]:
        """Hand out the outputs of this call, ABORTs grouped per peer at the end."""
        state = self.state
        out = state.out
        state.out = []
        if not state.aborts:
            return out
        for name, (ids, reason) in state.aborts.items():
            session = state.sessions.get(name)
            if (
                session is None
                or session.peer is None
                or session.state != SESSION_V2
                or CAP_ABORT not in session.caps
            ):
                continue
            for i in range(0, len(ids), MAX_REQUESTS_PER_BATCH):
                chunk = ids[i : i + MAX_REQUESTS_PER_BATCH]
                out.append(SendAbort(session.peer, Abort(ext_ids=chunk, reason=clip(reason))))
                state.stats.aborts_sent += 1
        state.aborts = {}
        return out


def endpoint_of(state: ConsumerState) -> ConsumerEndpoint:
    """The endpoint whose state is ``state`` (its parts built around it): how a pickled
    endpoint is read back."""
    endpoint = ConsumerEndpoint.__new__(ConsumerEndpoint)
    endpoint.state = state
    return endpoint
