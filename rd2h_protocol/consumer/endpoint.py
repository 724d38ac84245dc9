"""The Decode endpoint's inputs: what the runtime calls, and the tables bound to handlers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from rd2h_protocol.consumer.config import Output
from rd2h_protocol.consumer.held import _entries_cost
from rd2h_protocol.consumer.records import _KeptEntries, _Readiness, _Request, _Session
from rd2h_protocol.consumer.replies import _clip
from rd2h_protocol.consumer.sessions import _SessionEffects
from rd2h_protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, TransferError
from rd2h_protocol.events import ConnectionView, Releasable, Reply, SendAbort
from rd2h_protocol.machines.consumer import (
    DECODE_READINESS,
    DECODE_REQUEST,
    DECODE_SESSION,
    EFFECT_ACCEPT,
    EFFECT_ACK_V1,
    EFFECT_ACK_V2,
    EFFECT_APPLY_ABORT,
    EFFECT_DROP,
    EFFECT_FAIL,
    EFFECT_FAIL_HOLD,
    EFFECT_FAIL_RELEASE,
    EFFECT_ISOLATE,
    EFFECT_PARK,
    EFFECT_PROCESS,
    EFFECT_PROGRESS,
    EFFECT_REFUSE_V1,
    EFFECT_REFUSE_V2,
    EFFECT_RELEASE,
    EFFECT_REPLY_DONE,
    EFFECT_REPLY_FAILED,
    EFFECT_REPLY_REFUSED,
    EFFECT_REPLY_UNKNOWN_SESSION,
    EFFECT_REPORT_DONE,
    EFFECT_SERVE,
    EFFECT_START_READ,
    M_TIMER_PARK_EXPIRED,
    R_LOCAL_ABORT,
    R_LOCAL_ADVERTISE,
    R_LOCAL_RELEASE,
    R_LOCAL_RELEASE_BUSY,
    R_TIMER_LOAD_TIMEOUT,
    SESSION_V1,
    SESSION_V2,
)
from rd2h_protocol.machines.declare import NO_EFFECT, no_effect
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


class ConsumerEndpoint(_SessionEffects):
    """One Decode TP rank's protocol state (sans-IO). See the package docstring.

    Every input method takes ``now`` (monotonic seconds, never decreasing) and returns the
    list of outputs to execute in order.
    """

    # -- views (for invariant checks and metrics) ------------------------------------------

    def requests(self) -> dict[str, str]:
        """``{external request id: state}`` of every request this rank holds."""
        return {ext: req.state for ext, req in self._requests.items()}

    def in_flight_reads(self) -> dict[int, tuple[str, ...]]:
        """``{read_id: request ids whose blocks the read writes}`` of every read in flight."""
        return {rid: tuple(r.ext_id for r in rd.in_plan) for rid, rd in self._reads.items()}

    def parked(self) -> dict[int, tuple[str, ...]]:
        """``{park id: request ids still awaited}`` of every parked readiness or abort."""
        return {pid: self._awaited(p) for pid, p in self._parked.items()}

    def sessions(self) -> dict[str, str]:
        """``{Prefill session: state}``."""
        return {name: s.state for name, s in self._sessions.items()}

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

    def in_flight_count(self, ext_req_id: str) -> int:
        """Reads in flight that write ``ext_req_id``'s blocks (0 for an unknown request)."""
        req = self._requests.get(ext_req_id)
        return 0 if req is None else req.in_flight

    def is_idle(self) -> bool:
        """Whether no per-request state is left (requests, reads, parked messages)."""
        return not (self._requests or self._reads or self._parked or self._deadlines)

    # -- timers ----------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """The earliest deadline, or ``None`` when nothing waits on time."""
        times = [p.deadline for p in self._parked.values()]
        if self._deadlines:
            times.append(next(iter(self._deadlines.values())))
        return min(times) if times else None

    def handle_timer(self, now: float) -> list[Output]:
        """Handle every deadline at or before ``now``.

        Parked readiness past its bound is served with its still-unknown requests
        isolated (or refused, past its lease); a request with no progress for
        ``kv_load_timeout_s`` fails with ``TIMEOUT`` and its v2 peers get ABORT.
        """
        # Serving one expired item never unparks another (only add/retire do), so the
        # list taken up front stays valid.
        for item in [p for p in self._parked.values() if p.deadline <= now]:
            self._unpark(item)
            self.stats.park_expired += 1
            if isinstance(item, _Readiness):
                self._READINESS.fire(self, item, M_TIMER_PARK_EXPIRED, now)
        while self._deadlines:
            ext, deadline = next(iter(self._deadlines.items()))
            if deadline > now:
                break
            req = self._requests[ext]
            self.stats.load_timeouts += 1
            self._request_event(
                req,
                R_TIMER_LOAD_TIMEOUT,
                now,
                ErrorCode.TIMEOUT,
                f"no KV progress for {self.config.kv_load_timeout_s} s",
            )
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
        if ext_req_id in self._requests:
            raise LocalProtocolError(f"request {ext_req_id!r} is already registered")
        main, idx = _frozen_ids(main_block_ids), _frozen_ids(indexer_block_ids)
        if idx == main:
            idx = main  # one object: the planner unboxes shared ids once per read
        limits = (("main", main, self._main_limit), ("indexer", idx, self._indexer_limit))
        for what, ids, limit in limits:
            if ids and (min(ids) < 0 or (limit is not None and max(ids) >= limit)):
                raise LocalProtocolError(
                    f"request {ext_req_id!r}: {what} destination block ids must lie in "
                    f"[0, {limit}), got {min(ids)}..{max(ids)}",
                    ErrorCode.DESTINATION_RANGE,
                )
        self._retired.pop(ext_req_id, None)
        req = _Request(ext_req_id, main, idx)
        self._requests[ext_req_id] = req
        self._touch((req,), now)
        if advertised:
            self._request_event(req, R_LOCAL_ADVERTISE, now)
        self._resolve_waiting(ext_req_id, now)
        return self._flush()

    def advertise(self, ext_req_id: str, now: float) -> list[Output]:
        """The request's rendezvous was posted (for ``add_request(advertised=False)``)."""
        req = self._known(ext_req_id)
        self._request_event(req, R_LOCAL_ADVERTISE, now)
        self._touch((req,), now)
        return self._flush()

    def abort(self, ext_ids: Iterable[str], reason: str, now: float) -> list[Output]:
        """Abort requests locally: each fails (``ABORTED``) and its v2 peers get ABORT.

        Ids this rank does not hold are remembered as retired, so readiness for them is
        refused instead of parked.
        """
        for ext in unique_ids(ext_ids):
            req = self._requests.get(ext)
            if req is None:
                self._retire(ext, now)
            else:
                self._request_event(req, R_LOCAL_ABORT, now, ErrorCode.ABORTED, reason)
        return self._flush()

    def release(self, ext_req_id: str, now: float) -> list[Output]:
        """vLLM finished the request (``request_finished``).

        The blocks may be freed now if and only if the returned outputs contain
        ``Releasable(ext_req_id)``; otherwise a read may still write them, and a later
        output (from :meth:`read_finished`) says when. A request released before its KV
        arrived ends as aborted (``RequestFailed`` + ABORT to its v2 peers).
        """
        req = self._requests.get(ext_req_id)
        if req is None:
            self._retire(ext_req_id, now)
            self._out.append(Releasable(ext_req_id))
        else:
            event = R_LOCAL_RELEASE if req.in_flight == 0 else R_LOCAL_RELEASE_BUSY
            self._request_event(
                req, event, now, ErrorCode.ABORTED, "released by vLLM before its KV arrived"
            )
        return self._flush()

    def read_finished(self, read_id: int, error: TransferError | None, now: float) -> list[Output]:
        """A :class:`StartRead` ended: ``error`` is ``None`` on success.

        Raises :class:`LocalProtocolError` for a ``read_id`` not in flight.
        """
        rd = self._reads.pop(read_id, None)
        if rd is None:
            raise LocalProtocolError(f"read {read_id} is not in flight")
        if error is None:
            self._read_succeeded(rd, now)
        elif self._may_retry(rd, error, now):
            self._retry(rd, now)
        else:
            self._read_failed(rd, error, now)
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
        session = self._session_of(peer)
        if session is None:
            read = self._read_frame(frame)
        else:
            # Kept entries were read under this bound: a handshake drops them.
            kept = self._entry_cache.get(session.name)
            read = self._read_frame(
                frame,
                id_bound=WIRE_ID_LIMIT if session.id_bound is None else session.id_bound,
                kept=None if kept is None else (kept.raw, kept.entries),
            )
        if isinstance(read, Readiness):
            if session is not None:
                if read.reused:
                    self._entry_cache.move_to_end(session.name)
                elif read.keep is not None:
                    self._keep_entries(session, read.keep, read.msg.read_reqs)
            return self._receive(peer, read.msg, now, read.ids_below)
        if isinstance(read, Unreadable):
            return self._unreadable(peer, read, now)
        return self._receive(peer, read, now, None)

    #: Reads a frame (:func:`~rd2h_protocol.wire.readiness.read_frame`); an attribute so
    #: that a test or a benchmark can stand another reader in for it.
    _read_frame = staticmethod(read_frame)

    def _unreadable(self, peer: bytes, read: Unreadable, now: float) -> list[Output]:
        """A frame that does not decode: counted; a readiness that names its layer (and
        its ``seq``, when present) gets a failure reply, and the known requests it names
        fail, so no Prefill gate waits for it."""
        self.stats.malformed_frames += 1
        if read.too_many_block_ids:
            self.stats.block_id_refusals += 1
        if read.layer_idx is None:
            self.stats.dropped += 1
            return []
        self.stats.layer_failures += 1
        self._out.append(
            Reply(peer, self._failure_reply(read.layer_idx, read.seq, read.code, read.message))
        )
        self._fail_known(read.ids, now, read.code, f"malformed readiness: {read.message}")
        return self._flush()

    def _keep_entries(self, session: _Session, raw: bytes, entries: list[ReadReq]) -> None:
        """Keep ``session``'s last entries (a :class:`Readiness`'s ``keep``, passed back to
        the decoder as ``kept``), charged to its budgets: at most ENTRY_CACHE_SESSIONS
        sessions' and what the byte budgets leave room for (entries that do not fit are
        not kept: the next layer decodes its own)."""
        self._drop_entries(session.name)
        kept = _KeptEntries(raw, entries, _entries_cost(raw, entries))
        self._entry_cache[session.name] = kept
        self._charge(session, kept.cost)
        while len(self._entry_cache) > ENTRY_CACHE_SESSIONS:
            self._drop_entries(next(iter(self._entry_cache)))
        self._enforce_session_budgets(session)

    def _receive(
        self, peer: bytes, msg: Message, now: float, ids_below: int | None
    ) -> list[Output]:
        try:
            if isinstance(msg, ReadReadyBatch):
                self._on_readiness(peer, msg, now, ids_below)
            elif isinstance(msg, MfMeta):
                self._on_mf_meta(peer, msg)
            elif isinstance(msg, Abort):
                self._on_abort(peer, msg, now)
            else:
                self.stats.unexpected_messages += 1
        except ProtocolError:
            # Input that no table allows (none does today: the session table has a row for
            # every input in every state). As h2 closes a stream on a protocol error, that
            # peer's session is closed: nothing half-done of it stays bound, and its Prefill
            # learns UNKNOWN_SESSION on its next readiness and hand-shakes again (a v1 one
            # gets a read_failed). The runtime logs the peer with the count.
            self.stats.protocol_errors += 1
            name = self._peers.get(peer)
            if name is not None and name in self._sessions:
                self._forget_session(name)
        return self._flush()

    # -- output ----------------------------------------------------------------------------

    def _flush(self) -> list[Output]:
        """Hand out the outputs of this call, ABORTs grouped per peer at the end."""
        out, self._out = self._out, []
        for name, (ids, reason) in self._aborts.items():
            session = self._sessions.get(name)
            if (
                session is None
                or session.peer is None
                or session.state != SESSION_V2
                or CAP_ABORT not in session.caps
            ):
                continue
            for i in range(0, len(ids), MAX_REQUESTS_PER_BATCH):
                chunk = ids[i : i + MAX_REQUESTS_PER_BATCH]
                out.append(SendAbort(session.peer, Abort(ext_ids=chunk, reason=_clip(reason))))
                self.stats.aborts_sent += 1
        self._aborts = {}
        return out


# -- the tables drive the action: each declared effect bound to its handler ----------------
# (Each handler lives in the layer of its concern: see the reading order in the package.)

ConsumerEndpoint._READINESS = DECODE_READINESS.bind(
    {
        EFFECT_PARK: ConsumerEndpoint._fx_park,
        EFFECT_PROCESS: ConsumerEndpoint._fx_process,
        EFFECT_START_READ: ConsumerEndpoint._fx_start_read,
        EFFECT_REPLY_DONE: ConsumerEndpoint._reply_done,
        EFFECT_REPLY_FAILED: ConsumerEndpoint._reply_failed,
    }
)
ConsumerEndpoint._REQUEST = DECODE_REQUEST.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_ACCEPT: ConsumerEndpoint._fx_accept,
        EFFECT_ISOLATE: ConsumerEndpoint._fx_isolate,
        EFFECT_PROGRESS: ConsumerEndpoint._fx_progress,
        EFFECT_REPORT_DONE: ConsumerEndpoint._fx_report_done,
        EFFECT_FAIL: ConsumerEndpoint._fx_fail,
        EFFECT_FAIL_RELEASE: ConsumerEndpoint._fx_fail_release,
        EFFECT_FAIL_HOLD: ConsumerEndpoint._fx_fail,  # (release_pending is the hold)
        EFFECT_RELEASE: ConsumerEndpoint._fx_release,
    }
)
ConsumerEndpoint._SESSION = DECODE_SESSION.bind(
    {
        EFFECT_ACK_V1: ConsumerEndpoint._fx_ack_v1,
        EFFECT_ACK_V2: ConsumerEndpoint._fx_ack_v2,
        EFFECT_REFUSE_V1: ConsumerEndpoint._fx_refuse_v1,
        EFFECT_REFUSE_V2: ConsumerEndpoint._fx_refuse_v2,
        EFFECT_SERVE: ConsumerEndpoint._fx_serve,
        EFFECT_REPLY_REFUSED: ConsumerEndpoint._fx_reply_refused,
        EFFECT_REPLY_UNKNOWN_SESSION: ConsumerEndpoint._fx_reply_unknown_session,
        EFFECT_APPLY_ABORT: ConsumerEndpoint._fx_apply_abort,
        EFFECT_DROP: ConsumerEndpoint._fx_drop,
    }
)
