"""The readiness machine's effects, and a batched read's outcomes: done signals counted
after success, retry, failure."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from rd2h_protocol.completion import EFFECT_IGNORE_DUPLICATE
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
    REQ_RECEIVING,
)
from rd2h_protocol.machines.declare import BoundMachine
from rd2h_protocol.wire.readiness import unique_ids

if TYPE_CHECKING:
    from rd2h_protocol.consumer.parking import Parking
    from rd2h_protocol.consumer.replies import Replies
    from rd2h_protocol.consumer.requests import RequestEffects
    from rd2h_protocol.consumer.serving import Serving


class ReadinessEffects:
    """What happens to a readiness when its machine moves (see ``DECODE_READINESS``; the
    owner its table's handlers run on), what a :class:`StartRead` leads to, and what its
    end does."""

    __slots__ = ("parking", "replies", "request", "serving", "state")

    #: ``DECODE_READINESS`` bound to this class's handlers (set below the class).
    TABLE: ClassVar[BoundMachine]

    parking: Parking
    replies: Replies
    request: RequestEffects
    serving: Serving

    def __init__(self, state: ConsumerState) -> None:
        self.state = state

    # The readiness machine's effects.

    def fx_park(self, rd: ReadinessRecord, packed: bytes | None, missing: Iterable[str]) -> None:
        self.parking.park_readiness(rd, packed, missing)

    def fx_process(self, rd: ReadinessRecord, now: float) -> None:
        """Out of the park: serve it now, its still-unknown requests isolated."""
        self.serving.serve(rd, now, allow_park=False)

    def fx_start_read(self, rd: ReadinessRecord) -> None:
        assert rd.plan is not None
        self.state.out.append(StartRead(rd.plan, rd.start_by, rd.finish_by))

    def fx_reply_done(self, rd: ReadinessRecord) -> None:
        self.replies.reply_done(rd)

    def fx_reply_failed(self, rd: ReadinessRecord, code: ErrorCode, text: str) -> None:
        self.replies.reply_failed(rd, code, text)

    def read_succeeded(self, rd: ReadinessRecord, now: float) -> None:
        self.TABLE.fire(self, rd, M_LOCAL_READ_OK)
        for req in rd.in_plan:
            req.in_flight -= 1
        request = self.request
        request.TABLE.fire_batch(request, rd.in_plan, R_LOCAL_READ_OK, now)
        self.count_done(rd, now)
        self.request.release_quiescent(rd.in_plan, now)

    def count_done(self, rd: ReadinessRecord, now: float) -> None:
        """After the done reply: count the message's done signals, complete what can."""
        msg = rd.msg
        if msg.done_ext_ids:  # (the last layer's: the others carry none)
            requests = self.state.requests
            accepted = {req.ext_id: req for req in rd.accepted}
            for ext in unique_ids(msg.done_ext_ids):
                req = accepted.get(ext)
                if req is None or req.state != REQ_RECEIVING or requests.get(ext) is not req:
                    continue
                assert req.contributors is not None
                if req.contributors.report(msg.group_member_idx) == EFFECT_IGNORE_DUPLICATE:
                    self.state.stats.duplicate_done += 1
        for req in rd.accepted:
            if (
                req.state == REQ_RECEIVING
                and req.in_flight == 0
                and req.contributors is not None
                and req.contributors.complete
                and not self.parking.named_by_parked(req.ext_id)
            ):
                self.request.event(req, R_LOCAL_ALL_DONE, now)

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
        keep = [req for req in rd.in_plan if req.state == REQ_RECEIVING]
        gone = [req for req in rd.in_plan if req.state != REQ_RECEIVING]
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
        self.TABLE.fire(self, rd, M_LOCAL_READ_RETRY)

    def read_failed(self, rd: ReadinessRecord, error: TransferError, now: float) -> None:
        self.state.stats.reads_failed += 1
        code = error.code
        if code == ErrorCode.LEASE_EXPIRED:
            self.state.stats.expired_leases += 1
        text = f"batched read failed: {error.message}"
        if error.backend_code is not None:
            text += f" (backend code {error.backend_code})"
        self.TABLE.fire(self, rd, M_LOCAL_READ_FAILED, code, text)
        for req in rd.in_plan:
            req.in_flight -= 1
        for req in rd.accepted:
            # A request may have been released while this read was in flight: a retry left
            # it out, or it had no share in the read. It is gone; leave it alone.
            if self.state.requests.get(req.ext_id) is req:
                self.request.event(req, R_LOCAL_FAIL, now, code, text)
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
