"""A batched read's outcomes: done signals counted after success, retry, failure."""

from __future__ import annotations

import dataclasses

from rd2h_protocol.completion import EFFECT_IGNORE_DUPLICATE
from rd2h_protocol.consumer.records import _Readiness
from rd2h_protocol.consumer.replies import _Replies
from rd2h_protocol.errors import ErrorCode, TransferError
from rd2h_protocol.events import StartRead
from rd2h_protocol.machines.consumer import (
    M_LOCAL_READ_FAILED,
    M_LOCAL_READ_OK,
    M_LOCAL_READ_RETRY,
    R_LOCAL_ALL_DONE,
    R_LOCAL_FAIL,
    R_LOCAL_READ_OK,
    REQ_RECEIVING,
)
from rd2h_protocol.wire.readiness import unique_ids


class _ReadOutcomes(_Replies):
    """What a :class:`StartRead` leads to, and what its end does."""

    # The readiness machine's START_READ effect.

    def _fx_start_read(self, rd: _Readiness) -> None:
        assert rd.plan is not None
        self._out.append(StartRead(rd.plan, rd.start_by, rd.finish_by))

    def _read_succeeded(self, rd: _Readiness, now: float) -> None:
        self._READINESS.fire(self, rd, M_LOCAL_READ_OK)
        for req in rd.in_plan:
            req.in_flight -= 1
        self._REQUEST.fire_batch(self, rd.in_plan, R_LOCAL_READ_OK, now)
        self._count_done(rd, now)
        self._release_quiescent(rd.in_plan, now)

    def _count_done(self, rd: _Readiness, now: float) -> None:
        """After the done reply: count the message's done signals, complete what can."""
        msg = rd.msg
        if msg.done_ext_ids:  # (the last layer's: the others carry none)
            accepted = {req.ext_id: req for req in rd.accepted}
            for ext in unique_ids(msg.done_ext_ids):
                req = accepted.get(ext)
                if req is None or req.state != REQ_RECEIVING or self._requests.get(ext) is not req:
                    continue
                assert req.contributors is not None
                if req.contributors.report(msg.group_member_idx) == EFFECT_IGNORE_DUPLICATE:
                    self.stats.duplicate_done += 1
        for req in rd.accepted:
            if (
                req.state == REQ_RECEIVING
                and req.in_flight == 0
                and req.contributors is not None
                and req.contributors.complete
                and not self._named_by_parked(req.ext_id)
            ):
                self._request_event(req, R_LOCAL_ALL_DONE, now)

    def _may_retry(self, rd: _Readiness, error: TransferError, now: float) -> bool:
        return (
            error.transient
            and error.code != ErrorCode.LEASE_EXPIRED
            and rd.retries_left > 0
            and (rd.start_by is None or now <= rd.start_by)
            and any(req.state == REQ_RECEIVING for req in rd.in_plan)
        )

    def _retry(self, rd: _Readiness, now: float) -> None:
        """Start the read again for the requests still receiving."""
        assert rd.plan is not None
        keep = [req for req in rd.in_plan if req.state == REQ_RECEIVING]
        gone = [req for req in rd.in_plan if req.state != REQ_RECEIVING]
        for req in gone:
            req.in_flight -= 1
        self._release_quiescent(gone, now)
        kept = {req.ext_id for req in keep}
        read_id = self._next_read_id
        self._next_read_id += 1
        rd.plan = dataclasses.replace(
            rd.plan,
            read_id=read_id,
            requests=tuple(r for r in rd.plan.requests if r.ext_req_id in kept),
        )
        rd.in_plan = keep
        rd.retries_left -= 1
        self._reads[read_id] = rd
        self.stats.read_retries += 1
        self._READINESS.fire(self, rd, M_LOCAL_READ_RETRY)

    def _read_failed(self, rd: _Readiness, error: TransferError, now: float) -> None:
        self.stats.reads_failed += 1
        code = error.code
        if code == ErrorCode.LEASE_EXPIRED:
            self.stats.expired_leases += 1
        text = f"batched read failed: {error.message}"
        if error.backend_code is not None:
            text += f" (backend code {error.backend_code})"
        self._READINESS.fire(self, rd, M_LOCAL_READ_FAILED, code, text)
        for req in rd.in_plan:
            req.in_flight -= 1
        for req in rd.accepted:
            # A request may have been released while this read was in flight: a retry left
            # it out, or it had no share in the read. It is gone; leave it alone.
            if self._requests.get(req.ext_id) is req:
                self._request_event(req, R_LOCAL_FAIL, now, code, text)
        self._release_quiescent(rd.in_plan, now)
