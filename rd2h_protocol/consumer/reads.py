"""The readiness machine's effects, and a batched read's outcomes: done signals counted
after success, retry, failure."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

from rd2h_protocol.consumer.records import ReadinessRecord
from rd2h_protocol.consumer.state import ConsumerState
from rd2h_protocol.errors import ErrorCode, TransferError
from rd2h_protocol.events import StartRead
from rd2h_protocol.machines.consumer import (
    DECODE_READINESS,
    EFFECT_PARK,
    EFFECT_PROCESS,
    EFFECT_REPLY_DONE,
    EFFECT_REPLY_FAILED,
    EFFECT_START_READ,
    M_LOCAL_READ_FAILED,
    M_LOCAL_READ_OK,
    M_LOCAL_READ_RETRY,
    R_LOCAL_ALL_DONE,
    R_LOCAL_FAIL,
    R_LOCAL_READ_OK,
    R_LOCAL_READ_RETRY,
    R_RECV_DONE_SIGNAL,
    REQ_RECEIVING,
    S_LOCAL_UNPARKED,
    SESSION_UNBOUND,
)
from rd2h_protocol.machines.consumer_inputs import (
    RdAt,
    RdFailure,
    RdPark,
    ReqAt,
    ReqDoneSignal,
    ReqEnd,
    ReqRetry,
    SessReadiness,
)
from rd2h_protocol.machines.declare import BoundMachine
from rd2h_protocol.wire.readiness import unique_ids

if TYPE_CHECKING:
    from rd2h_protocol.consumer.parking import Parking
    from rd2h_protocol.consumer.replies import Replies
    from rd2h_protocol.consumer.requests import RequestEffects
    from rd2h_protocol.consumer.serving import Serving
    from rd2h_protocol.consumer.sessions import SessionEffects


class ReadinessEffects:
    """What happens to a readiness when its machine moves (see ``DECODE_READINESS``; the
    owner its table's handlers run on), what a :class:`StartRead` leads to, and what its
    end does."""

    __slots__ = ("parking", "replies", "request", "serving", "sessions", "state")

    #: ``DECODE_READINESS`` bound to this class's handlers (set below the class).
    TABLE: ClassVar[BoundMachine]

    parking: Parking
    replies: Replies
    request: RequestEffects
    serving: Serving
    sessions: SessionEffects

    def __init__(self, state: ConsumerState) -> None:
        self.state = state

    # The readiness machine's effects.

    def fx_park(self, rd: ReadinessRecord, ctx: RdPark) -> None:
        self.parking.park_readiness(rd, ctx.packed, ctx.missing)

    def fx_process(self, rd: ReadinessRecord, ctx: RdAt) -> None:
        """Out of the park: its session's machine decides (``LOCAL_UNPARKED``): served now,
        its still-unknown requests isolated, while the session is ready."""
        sessions = self.sessions
        session = self.state.sessions.get(rd.session)
        state = SESSION_UNBOUND if session is None else session.state
        sessions.TABLE.apply_react(
            sessions, session, state, S_LOCAL_UNPARKED, SessReadiness(rd, ctx.now)
        )

    def fx_start_read(self, rd: ReadinessRecord, _ctx: None) -> None:
        assert rd.plan is not None
        self.state.out.append(StartRead(rd.plan, rd.start_by, rd.finish_by))

    def fx_reply_done(self, rd: ReadinessRecord, _ctx: None) -> None:
        self.replies.reply_done(rd)

    def fx_reply_failed(self, rd: ReadinessRecord, ctx: RdFailure) -> None:
        self.replies.reply_failed(rd, ctx.code, ctx.text)

    def read_succeeded(self, rd: ReadinessRecord, now: float) -> None:
        self.TABLE.apply(self, rd, M_LOCAL_READ_OK, None)
        for req in rd.in_plan:
            req.in_flight -= 1
        request = self.request
        request.TABLE.apply_batch(request, rd.in_plan, R_LOCAL_READ_OK, ReqAt(now))
        self.count_done(rd, now)
        self.request.release_quiescent(rd.in_plan, now)

    def count_done(self, rd: ReadinessRecord, now: float) -> None:
        """After the done reply: count the message's done signals (``RECV_DONE_SIGNAL``),
        complete what can (``LOCAL_ALL_DONE``; the request machine's rows say which
        states count and complete)."""
        msg = rd.msg
        requests = self.state.requests
        request = self.request
        table = request.TABLE
        if msg.done_ext_ids:  # (the last layer's: the others carry none)
            signal = ReqDoneSignal(msg.group_member_idx)
            accepted = {req.ext_id: req for req in rd.accepted}
            for ext in unique_ids(msg.done_ext_ids):
                req = accepted.get(ext)
                if req is not None and requests.get(ext) is req:
                    table.apply(request, req, R_RECV_DONE_SIGNAL, signal)
        at: ReqAt | None = None
        for req in rd.accepted:
            if (
                req.in_flight == 0
                and req.contributors is not None
                and req.contributors.complete
                and requests.get(req.ext_id) is req
                and not self.parking.named_by_parked(req.ext_id)
            ):
                at = ReqAt(now) if at is None else at
                table.apply(request, req, R_LOCAL_ALL_DONE, at)

    def may_retry(self, rd: ReadinessRecord, error: TransferError, now: float) -> bool:
        return (
            error.transient
            and error.code != ErrorCode.LEASE_EXPIRED
            and rd.retries_left > 0
            and (rd.start_by is None or now <= rd.start_by)
            and any(req.state == REQ_RECEIVING for req in rd.in_plan)
        )

    def retry(self, rd: ReadinessRecord, now: float) -> None:
        """Start the read again for the requests still receiving."""
        assert rd.plan is not None
        request = self.request
        sorting = ReqRetry([], [])
        request.TABLE.apply_batch(request, rd.in_plan, R_LOCAL_READ_RETRY, sorting)
        keep, gone = sorting.keep, sorting.gone
        for req in gone:
            req.in_flight -= 1
        self.request.release_quiescent(gone, now)
        kept = {req.ext_id for req in keep}
        state = self.state
        read_id = state.next_read_id
        state.next_read_id += 1
        rd.plan = dataclasses.replace(
            rd.plan,
            read_id=read_id,
            requests=tuple(r for r in rd.plan.requests if r.ext_req_id in kept),
        )
        rd.in_plan = keep
        rd.retries_left -= 1
        state.reads[read_id] = rd
        state.stats.read_retries += 1
        self.TABLE.apply(self, rd, M_LOCAL_READ_RETRY, None)

    def read_failed(self, rd: ReadinessRecord, error: TransferError, now: float) -> None:
        self.state.stats.reads_failed += 1
        code = error.code
        if code == ErrorCode.LEASE_EXPIRED:
            self.state.stats.expired_leases += 1
        text = f"batched read failed: {error.message}"
        if error.backend_code is not None:
            text += f" (backend code {error.backend_code})"
        self.TABLE.apply(self, rd, M_LOCAL_READ_FAILED, RdFailure(code, text))
        for req in rd.in_plan:
            req.in_flight -= 1
        requests, failure = self.state.requests, ReqEnd(now, code, text)
        for req in rd.accepted:
            # A request may have been released while this read was in flight: a retry left
            # it out, or it had no share in the read. It is gone; leave it alone.
            if requests.get(req.ext_id) is req:
                self.request.apply(req, R_LOCAL_FAIL, failure)
        self.request.release_quiescent(rd.in_plan, now)


ReadinessEffects.TABLE = DECODE_READINESS.bind(
    {
        EFFECT_PARK: ReadinessEffects.fx_park,
        EFFECT_PROCESS: ReadinessEffects.fx_process,
        EFFECT_START_READ: ReadinessEffects.fx_start_read,
        EFFECT_REPLY_DONE: ReadinessEffects.fx_reply_done,
        EFFECT_REPLY_FAILED: ReadinessEffects.fx_reply_failed,
    }
)
