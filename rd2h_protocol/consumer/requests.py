"""The request machine's effects: progress, the terminal reports, and release."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rd2h_protocol.consumer.parking import _Parking
from rd2h_protocol.consumer.records import _Request
from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.events import Releasable, RequestDone, RequestFailed
from rd2h_protocol.machines.consumer import R_LOCAL_FAIL, R_LOCAL_QUIESCENT, REQ_RELEASE_PENDING


class _RequestEffects(_Parking):
    """What happens to a request when its machine moves (see ``DECODE_REQUEST``)."""

    # The request machine's LOCAL_READ_OK effect (a batched input): (reqs, now).

    def _fx_progress(self, reqs: Sequence[_Request], now: float) -> None:
        """A read for them succeeded: restart their load timers."""
        self._touch(reqs, now)

    # Its effects of unbatched inputs: (req, now, code, text, exclude).

    def _fx_report_done(self, req: _Request, *_context: Any) -> None:
        self._deadlines.pop(req.ext_id, None)
        self.stats.requests_done += 1
        self._out.append(RequestDone(req.ext_id))

    def _fx_fail(
        self, req: _Request, now: float, code: ErrorCode, text: str, exclude: str | None
    ) -> None:
        self._fail(req, code, text, exclude)

    def _fx_fail_release(
        self, req: _Request, now: float, code: ErrorCode, text: str, exclude: str | None
    ) -> None:
        self._fail(req, code, text, exclude)
        self._released(req, now)

    def _fx_release(self, req: _Request, now: float, *_failure: Any) -> None:
        self._released(req, now)

    def _fail(self, req: _Request, code: ErrorCode, text: str, exclude: str | None) -> None:
        self._deadlines.pop(req.ext_id, None)
        req.fail_code, req.fail_message = code, text
        self.stats.requests_failed += 1
        self._out.append(
            RequestFailed(req.ext_id, code, text, tuple(req.main_ids), tuple(req.indexer_ids))
        )
        reason = f"{code.name}: {text}"
        for name in sorted(req.sessions):
            if name != exclude:
                ids, _ = self._aborts.setdefault(name, ([], reason))
                ids.append(req.ext_id)

    def _released(self, req: _Request, now: float) -> None:
        del self._requests[req.ext_id]
        self._deadlines.pop(req.ext_id, None)
        self._out.append(Releasable(req.ext_id))
        self._retire(req.ext_id, now)

    def _fail_known(self, ids: Iterable[str], now: float, code: ErrorCode, text: str) -> None:
        for ext in ids:
            req = self._requests.get(ext)
            if req is not None:
                self._request_event(req, R_LOCAL_FAIL, now, code, text)

    def _release_quiescent(self, reqs: Iterable[_Request], now: float) -> None:
        for req in reqs:
            if req.state == REQ_RELEASE_PENDING and req.in_flight == 0:
                self._request_event(req, R_LOCAL_QUIESCENT, now)
