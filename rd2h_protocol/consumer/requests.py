"""The request machine's effects: progress, the terminal reports, and release."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from rd2h_protocol.consumer.records import ReadinessRecord, RequestRecord
from rd2h_protocol.consumer.state import ConsumerState
from rd2h_protocol.errors import ErrorCode, LocalProtocolError
from rd2h_protocol.events import Releasable, RequestDone, RequestFailed
from rd2h_protocol.machines.consumer import (
    DECODE_REQUEST,
    EFFECT_ACCEPT,
    EFFECT_FAIL,
    EFFECT_FAIL_HOLD,
    EFFECT_FAIL_RELEASE,
    EFFECT_ISOLATE,
    EFFECT_PROGRESS,
    EFFECT_RELEASE,
    EFFECT_REPORT_DONE,
    R_LOCAL_FAIL,
    R_LOCAL_QUIESCENT,
    REQ_RELEASE_PENDING,
)
from rd2h_protocol.machines.declare import NO_EFFECT, BoundMachine, no_effect

if TYPE_CHECKING:
    from rd2h_protocol.consumer.parking import Parking
    from rd2h_protocol.consumer.serving import Serving


class RequestEffects:
    """What happens to a request when its machine moves (see ``DECODE_REQUEST``): the
    owner its table's handlers run on."""

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

    def event(
        self,
        req: RequestRecord,
        event: str,
        now: float,
        code: ErrorCode = ErrorCode.UNKNOWN,
        text: str = "",
        *,
        exclude: str | None = None,
    ) -> None:
        """Fire ``event`` on ``req``'s machine (every input but RECV_READINESS)."""
        self.TABLE.fire(self, req, event, now, code, text, exclude)

    # The RECV_READINESS effects (a batched input) are serving's: (reqs, rd, *context).

    def fx_accept(self, reqs: Sequence[RequestRecord], rd: ReadinessRecord, *context: Any) -> None:
        self.serving.accept(reqs, rd, *context)

    def fx_isolate(self, reqs: Sequence[RequestRecord], rd: ReadinessRecord, *_: Any) -> None:
        self.serving.isolate_run(reqs, rd)

    # The LOCAL_READ_OK effect (a batched input): (reqs, now).

    def fx_progress(self, reqs: Sequence[RequestRecord], now: float) -> None:
        """A read for them succeeded: restart their load timers."""
        self.touch(reqs, now)

    # Its effects of unbatched inputs: (req, now, code, text, exclude).

    def fx_report_done(self, req: RequestRecord, *_context: Any) -> None:
        state = self.state
        state.deadlines.pop(req.ext_id, None)
        state.stats.requests_done += 1
        state.out.append(RequestDone(req.ext_id))

    def fx_fail(
        self, req: RequestRecord, now: float, code: ErrorCode, text: str, exclude: str | None
    ) -> None:
        self._fail(req, code, text, exclude)

    def fx_fail_release(
        self, req: RequestRecord, now: float, code: ErrorCode, text: str, exclude: str | None
    ) -> None:
        self._fail(req, code, text, exclude)
        self._released(req, now)

    def fx_release(self, req: RequestRecord, now: float, *_failure: Any) -> None:
        self._released(req, now)

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
        for ext in ids:
            req = requests.get(ext)
            if req is not None:
                self.event(req, R_LOCAL_FAIL, now, code, text)

    def release_quiescent(self, reqs: Iterable[RequestRecord], now: float) -> None:
        for req in reqs:
            if req.state == REQ_RELEASE_PENDING and req.in_flight == 0:
                self.event(req, R_LOCAL_QUIESCENT, now)


RequestEffects.TABLE = DECODE_REQUEST.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_ACCEPT: RequestEffects.fx_accept,
        EFFECT_ISOLATE: RequestEffects.fx_isolate,
        EFFECT_PROGRESS: RequestEffects.fx_progress,
        EFFECT_REPORT_DONE: RequestEffects.fx_report_done,
        EFFECT_FAIL: RequestEffects.fx_fail,
        EFFECT_FAIL_RELEASE: RequestEffects.fx_fail_release,
        EFFECT_FAIL_HOLD: RequestEffects.fx_fail,  # (release_pending is the hold)
        EFFECT_RELEASE: RequestEffects.fx_release,
    }
)
