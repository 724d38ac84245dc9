"""The request machine's effects: progress, the terminal reports, and release."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

from rd2h_protocol.completion import EFFECT_IGNORE_DUPLICATE
from rd2h_protocol.consumer.records import RequestRecord
from rd2h_protocol.consumer.state import ConsumerState
from rd2h_protocol.errors import ErrorCode, LocalProtocolError
from rd2h_protocol.events import Releasable, RequestDone, RequestFailed
from rd2h_protocol.machines.consumer import (
    DECODE_REQUEST,
    EFFECT_ACCEPT,
    EFFECT_COUNT_DONE,
    EFFECT_FAIL,
    EFFECT_FAIL_HOLD,
    EFFECT_FAIL_RELEASE,
    EFFECT_ISOLATE_ABORTED,
    EFFECT_ISOLATE_DONE,
    EFFECT_ISOLATE_FAILED,
    EFFECT_ISOLATE_RELEASED,
    EFFECT_LEAVE_READ,
    EFFECT_PROGRESS,
    EFFECT_READ_AGAIN,
    EFFECT_RELEASE,
    EFFECT_REPORT_DONE,
    R_LOCAL_FAIL,
    R_LOCAL_QUIESCENT,
    REQ_RELEASE_PENDING,
)
from rd2h_protocol.machines.consumer_inputs import (
    ReqAt,
    ReqDoneSignal,
    ReqEnd,
    ReqReadiness,
    ReqRetry,
)
from rd2h_protocol.machines.declare import NO_EFFECT, BoundMachine, Input, no_effect

if TYPE_CHECKING:
    from rd2h_protocol.consumer.parking import Parking
    from rd2h_protocol.consumer.serving import Serving

C = TypeVar("C")


class RequestEffects:
    """What happens to a request when its machine moves (see ``DECODE_REQUEST``): the
    owner its table's handlers run on. Every handler takes ``(self, req, ctx)`` (a
    batched input's: ``(self, run, ctx)``), ``ctx`` its input's context
    (:mod:`rd2h_protocol.machines.consumer_inputs`)."""

    __slots__ = ("parking", "serving", "state")

    #: ``DECODE_REQUEST`` bound to this class's handlers (set below the class).
    TABLE: ClassVar[BoundMachine]

    parking: Parking
    serving: Serving

    def __init__(self, state: ConsumerState) -> None:
        self.state = state

    def known(self, ext: str) -> RequestRecord:
        req = self.state.requests.get(ext)
        if req is None:
            raise LocalProtocolError(f"request {ext!r} is not registered")
        return req

    def touch(self, reqs: Sequence[RequestRecord], now: float) -> None:
        """Restart the requests' load timers (they made progress): each deadline moves to
        the end, in the order given (as setting each and moving it to the end would)."""
        state = self.state
        deadlines = state.deadlines
        exts = [req.ext_id for req in reqs]
        for ext in exts:
            deadlines.pop(ext, None)
        deadlines.update(dict.fromkeys(exts, now + state.config.kv_load_timeout_s))

    def apply(self, req: RequestRecord, event: Input[C], ctx: C) -> None:
        """Fire ``event`` on ``req``'s machine (every input but the batched ones)."""
        self.TABLE.apply(self, req, event, ctx)

    # The RECV_READINESS effects (a batched input): serving's, with the run.

    def fx_accept(self, reqs: Sequence[RequestRecord], ctx: ReqReadiness) -> None:
        self.serving.accept(reqs, ctx)

    def fx_isolate_done(self, reqs: Sequence[RequestRecord], ctx: ReqReadiness) -> None:
        text = "the request already completed on this rank"
        self.serving.isolate_run(reqs, ctx.rd, ErrorCode.UNKNOWN_REQUEST, text)

    def fx_isolate_aborted(self, reqs: Sequence[RequestRecord], ctx: ReqReadiness) -> None:
        self.serving.isolate_run(reqs, ctx.rd, ErrorCode.ABORTED, "the request was aborted")

    def fx_isolate_released(self, reqs: Sequence[RequestRecord], ctx: ReqReadiness) -> None:
        self.serving.isolate_run(reqs, ctx.rd, ErrorCode.ABORTED, "the request was released")

    def fx_isolate_failed(self, reqs: Sequence[RequestRecord], ctx: ReqReadiness) -> None:
        for req in reqs:
            text = f"the request already failed: {req.fail_message}"
            self.serving.isolate(ctx.rd, req.ext_id, req.fail_code, text)

    # The LOCAL_READ_OK effect (a batched input).

    def fx_progress(self, reqs: Sequence[RequestRecord], ctx: ReqAt) -> None:
        """A read for them succeeded: restart their load timers."""
        self.touch(reqs, ctx.now)

    # The LOCAL_READ_RETRY effects (a batched input): sort the run.

    def fx_read_again(self, reqs: Sequence[RequestRecord], ctx: ReqRetry) -> None:
        ctx.keep.extend(reqs)

    def fx_leave_read(self, reqs: Sequence[RequestRecord], ctx: ReqRetry) -> None:
        ctx.gone.extend(reqs)

    # The effects of unbatched inputs.

    def fx_count_done(self, req: RequestRecord, ctx: ReqDoneSignal) -> None:
        """Count a contributor's final-layer done signal (a duplicate is counted apart)."""
        assert req.contributors is not None
        if req.contributors.report(ctx.member) == EFFECT_IGNORE_DUPLICATE:
            self.state.stats.duplicate_done += 1

    def fx_report_done(self, req: RequestRecord, _ctx: ReqAt) -> None:
        state = self.state
        state.deadlines.pop(req.ext_id, None)
        state.stats.requests_done += 1
        state.out.append(RequestDone(req.ext_id))

    def fx_fail(self, req: RequestRecord, ctx: ReqEnd) -> None:
        self._fail(req, ctx.code, ctx.text, ctx.exclude)

    def fx_fail_release(self, req: RequestRecord, ctx: ReqEnd) -> None:
        self._fail(req, ctx.code, ctx.text, ctx.exclude)
        self._released(req, ctx.now)

    def fx_release(self, req: RequestRecord, ctx: ReqAt) -> None:
        self._released(req, ctx.now)

    def _fail(self, req: RequestRecord, code: ErrorCode, text: str, exclude: str | None) -> None:
        state = self.state
        state.deadlines.pop(req.ext_id, None)
        req.fail_code, req.fail_message = code, text
        state.stats.requests_failed += 1
        state.out.append(
            RequestFailed(req.ext_id, code, text, tuple(req.main_ids), tuple(req.indexer_ids))
        )
        reason = f"{code.name}: {text}"
        aborts = state.aborts
        for name in sorted(req.sessions):
            if name != exclude:
                ids, _ = aborts.setdefault(name, ([], reason))
                ids.append(req.ext_id)

    def _released(self, req: RequestRecord, now: float) -> None:
        state = self.state
        del state.requests[req.ext_id]
        state.deadlines.pop(req.ext_id, None)
        state.out.append(Releasable(req.ext_id))
        self.parking.retire(req.ext_id, now)

    def fail_known(self, ids: Iterable[str], now: float, code: ErrorCode, text: str) -> None:
        requests = self.state.requests
        ctx = ReqEnd(now, code, text)
        for ext in ids:
            req = requests.get(ext)
            if req is not None:
                self.TABLE.apply(self, req, R_LOCAL_FAIL, ctx)

    def release_quiescent(self, reqs: Iterable[RequestRecord], now: float) -> None:
        ctx = ReqAt(now)
        for req in reqs:
            if req.state == REQ_RELEASE_PENDING and req.in_flight == 0:
                self.TABLE.apply(self, req, R_LOCAL_QUIESCENT, ctx)


RequestEffects.TABLE = DECODE_REQUEST.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_ACCEPT: RequestEffects.fx_accept,
        EFFECT_ISOLATE_DONE: RequestEffects.fx_isolate_done,
        EFFECT_ISOLATE_FAILED: RequestEffects.fx_isolate_failed,
        EFFECT_ISOLATE_ABORTED: RequestEffects.fx_isolate_aborted,
        EFFECT_ISOLATE_RELEASED: RequestEffects.fx_isolate_released,
        EFFECT_PROGRESS: RequestEffects.fx_progress,
        EFFECT_COUNT_DONE: RequestEffects.fx_count_done,
        EFFECT_READ_AGAIN: RequestEffects.fx_read_again,
        EFFECT_LEAVE_READ: RequestEffects.fx_leave_read,
        EFFECT_REPORT_DONE: RequestEffects.fx_report_done,
        EFFECT_FAIL: RequestEffects.fx_fail,
        EFFECT_FAIL_RELEASE: RequestEffects.fx_fail_release,
        EFFECT_FAIL_HOLD: RequestEffects.fx_fail,  # (release_pending is the hold)
        EFFECT_RELEASE: RequestEffects.fx_release,
    }
)
