"""The Prefill request machine's effects: a request scheduled, failed, aborted, finished.

A request is finished (:class:`RequestFinished`, then forgotten) only once no live
publication names it: :meth:`_Requests._maybe_drain` is called wherever that count drops.
"""

from __future__ import annotations

from typing import Final

from rd2h_protocol.errors import ErrorCode, RemoteProtocolError
from rd2h_protocol.events import RequestFinished
from rd2h_protocol.machines.declare import Input
from rd2h_protocol.machines.producer import (
    K_LOCAL_FINISHED,
    R_LOCAL_DRAINED,
    R_RECV_ABORT,
    REQ_ABORTING,
    REQ_COMPLETE,
    REQ_FAILING,
    REQ_FINAL_SENT,
    REQ_PUBLISHING,
)
from rd2h_protocol.machines.producer_inputs import ReqAbort, ReqChunk, ReqFailure, ReqPeerAbort
from rd2h_protocol.producer.config import Output
from rd2h_protocol.producer.records import _Conn, _Request
from rd2h_protocol.producer.state import _ProducerState
from rd2h_protocol.wire.messages import Abort, ReadReq

# Request states that end as soon as no live publication names the request.
_DRAINABLE: Final = frozenset({REQ_FINAL_SENT, REQ_FAILING, REQ_ABORTING})
# Request states whose blocks Decode may still be asked to read.
_STILL_READ: Final = frozenset({*REQ_PUBLISHING, REQ_FINAL_SENT})


class _Requests(_ProducerState):
    """Effects of :data:`~rd2h_protocol.machines.producer.PREFILL_REQUEST`."""

    # The request machine's chunk effects: (req, ctx: ReqChunk); ``ignore``: the
    # scheduler does not know we stopped, its chunks for an ending request are moot.

    def _fx_schedule(self, req: _Request, ctx: ReqChunk) -> None:
        main, indexer = ctx.main, ctx.indexer
        if main or indexer:
            chunk = ctx.chunk
            req.chunk = ReadReq(req.ext_id, main, indexer, chunk.main_start, chunk.indexer_start)
        self._step.setdefault(req.conn.name, {})[req.ext_id] = req
        self._step_count += 1

    def _fx_send_abort(self, req: _Request, ctx: ReqAbort) -> None:
        """Our abort: record it and tell the peer (one ABORT per connection, by the caller)."""
        req.code, req.message = ErrorCode.ABORTED, ctx.reason
        ctx.by_conn.setdefault(req.conn.name, []).append(req.ext_id)

    def _fail(self, req: _Request, event: Input[ReqFailure], code: ErrorCode, message: str) -> None:
        self._REQUEST.apply(self, req, event, ReqFailure(code, message))

    def _fx_record_failure(self, req: _Request, ctx: ReqFailure) -> None:
        """The first reason to stop is the one reported (later ones stay: no effect)."""
        req.code, req.message = ctx.code, ctx.message

    def _maybe_drain(self, req: _Request, out: list[Output]) -> None:
        if req.outstanding or req.state not in _DRAINABLE:
            return
        self._REQUEST.apply(self, req, R_LOCAL_DRAINED, out)

    def _fx_finish(self, req: _Request, out: list[Output]) -> None:
        """Drained: no publication names it any more; RequestFinished frees its blocks."""
        ok = req.state == REQ_COMPLETE
        del self._requests[req.ext_id]
        step = self._step.get(req.conn.name)
        if step is not None and step.pop(req.ext_id, None) is not None:
            self._step_count -= 1
        kept = self._kept.pop(req.ext_id, None)
        if kept is not None:  # a claimed Prefill-first request: delivered (or not) now
            self._KEPT.apply(self, kept, K_LOCAL_FINISHED, None)
        if ok:
            out.append(RequestFinished(req.ext_id, True, None, ""))
        else:
            out.append(RequestFinished(req.ext_id, False, req.code, req.message))

    def _on_abort(self, conn: _Conn, msg: Abort, out: list[Output]) -> None:
        self.stats.aborts_received += 1
        for ext_id in msg.ext_ids:
            req = self._requests.get(ext_id)
            if req is None or req.conn is not conn:
                continue  # finished already, or not this peer's request to abort
            self._REQUEST.apply(
                self, req, R_RECV_ABORT, ReqPeerAbort(conn, msg), error=RemoteProtocolError
            )
            self._maybe_drain(req, out)

    def _fx_stop(self, req: _Request, ctx: ReqPeerAbort) -> None:
        """The Decode aborted it: stop publishing it (nothing to tell the peer)."""
        conn, msg = ctx.conn, ctx.msg
        req.code = ErrorCode.ABORTED
        req.message = f"aborted by Decode {conn.name}: {msg.reason}"
