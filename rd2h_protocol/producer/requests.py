"""The Prefill request machine's effects: a request scheduled, failed, aborted, finished.

A request is finished (:class:`RequestFinished`, then forgotten) only once no live
publication names it: :meth:`RequestEffects.maybe_drain` is called wherever that count
drops.
"""

from __future__ import annotations

from typing import ClassVar, Final

from rd2h_protocol.errors import ErrorCode, RemoteProtocolError
from rd2h_protocol.events import RequestFinished
from rd2h_protocol.machines.declare import NO_EFFECT, BoundMachine, Input, no_effect
from rd2h_protocol.machines.producer import (
    EFFECT_FINISH,
    EFFECT_IGNORE,
    EFFECT_RECORD_FAILURE,
    EFFECT_SCHEDULE,
    EFFECT_SCHEDULE_CLAIMED,
    EFFECT_SEND_ABORT,
    EFFECT_STOP,
    K_LOCAL_FINISHED,
    PREFILL_REQUEST,
    R_LOCAL_DRAINED,
    R_RECV_ABORT,
    REQ_ABORTING,
    REQ_COMPLETE,
    REQ_FAILING,
    REQ_FINAL_SENT,
    REQ_PUBLISHING,
)
from rd2h_protocol.machines.producer_inputs import ReqAbort, ReqChunk, ReqFailure, ReqPeerAbort
from rd2h_protocol.producer.records import Conn, Request
from rd2h_protocol.producer.state import Effects
from rd2h_protocol.wire.messages import Abort, ReadReq

# Request states that end as soon as no live publication names the request.
DRAINABLE: Final = frozenset({REQ_FINAL_SENT, REQ_FAILING, REQ_ABORTING})
#: Request states whose blocks Decode may still be asked to read.
STILL_READ: Final = frozenset({*REQ_PUBLISHING, REQ_FINAL_SENT})


class RequestEffects(Effects):
    """Effects of :data:`~rd2h_protocol.machines.producer.PREFILL_REQUEST`."""

    __slots__ = ()

    TABLE: ClassVar[BoundMachine]

    # The request machine's chunk effects: (req, ctx: ReqChunk); ``ignore``: the
    # scheduler does not know we stopped, its chunks for an ending request are moot.

    def _fx_schedule(self, req: Request, ctx: ReqChunk) -> None:
        main, indexer = ctx.main, ctx.indexer
        if main or indexer:
            chunk = ctx.chunk
            req.chunk = ReadReq(req.ext_id, main, indexer, chunk.main_start, chunk.indexer_start)
        state = self.state
        state.step.setdefault(req.conn.name, {})[req.ext_id] = req
        state.step_count += 1

    def _fx_schedule_claimed(self, req: Request, ctx: ReqChunk) -> None:
        """The claimed request's blocks, published by the claim itself (no compute step)."""
        main, indexer = ctx.main, ctx.indexer
        if main or indexer:
            chunk = ctx.chunk
            req.chunk = ReadReq(req.ext_id, main, indexer, chunk.main_start, chunk.indexer_start)

    def _fx_send_abort(self, req: Request, ctx: ReqAbort) -> None:
        """Our abort: record it and tell the peer (one ABORT per connection, by the caller)."""
        req.code, req.message = ErrorCode.ABORTED, ctx.reason
        ctx.by_conn.setdefault(req.conn.name, []).append(req.ext_id)

    def fail(self, req: Request, event: Input[ReqFailure], code: ErrorCode, message: str) -> None:
        """Stop ``req`` for this reason (the first one given is the one reported)."""
        self.TABLE.apply(self, req, event, ReqFailure(code, message))

    def _fx_record_failure(self, req: Request, ctx: ReqFailure) -> None:
        """The first reason to stop is the one reported (later ones stay: no effect)."""
        req.code, req.message = ctx.code, ctx.message

    def maybe_drain(self, req: Request) -> None:
        """Finish ``req`` if it is ending and no live publication names it any more."""
        if req.outstanding or req.state not in DRAINABLE:
            return
        self.TABLE.apply(self, req, R_LOCAL_DRAINED, None)

    def _fx_finish(self, req: Request, _ctx: None) -> None:
        """Drained: no publication names it any more; RequestFinished frees its blocks."""
        ok = req.state == REQ_COMPLETE
        state = self.state
        del state.requests[req.ext_id]
        step = state.step.get(req.conn.name)
        if step is not None and step.pop(req.ext_id, None) is not None:
            state.step_count -= 1
        kept = state.kept.pop(req.ext_id, None)
        if kept is not None:  # a claimed Prefill-first request: delivered (or not) now
            kept_fx = self.kept_fx
            kept_fx.TABLE.apply(kept_fx, kept, K_LOCAL_FINISHED, None)
        if ok:
            state.out.append(RequestFinished(req.ext_id, True, None, ""))
        else:
            state.out.append(RequestFinished(req.ext_id, False, req.code, req.message))

    def on_abort(self, conn: Conn, msg: Abort) -> None:
        """The Decode on ``conn`` aborted these requests."""
        self.state.stats.aborts_received += 1
        requests = self.state.requests
        for ext_id in msg.ext_ids:
            req = requests.get(ext_id)
            if req is None or req.conn is not conn:
                continue  # finished already, or not this peer's request to abort
            self.TABLE.apply(
                self, req, R_RECV_ABORT, ReqPeerAbort(conn, msg), error=RemoteProtocolError
            )
            self.maybe_drain(req)

    def _fx_stop(self, req: Request, ctx: ReqPeerAbort) -> None:
        """The Decode aborted it: stop publishing it (nothing to tell the peer)."""
        conn, msg = ctx.conn, ctx.msg
        req.code = ErrorCode.ABORTED
        req.message = f"aborted by Decode {conn.name}: {msg.reason}"


RequestEffects.TABLE = PREFILL_REQUEST.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_SCHEDULE: RequestEffects._fx_schedule,
        EFFECT_SCHEDULE_CLAIMED: RequestEffects._fx_schedule_claimed,
        EFFECT_IGNORE: no_effect,
        EFFECT_RECORD_FAILURE: RequestEffects._fx_record_failure,
        EFFECT_SEND_ABORT: RequestEffects._fx_send_abort,
        EFFECT_STOP: RequestEffects._fx_stop,
        EFFECT_FINISH: RequestEffects._fx_finish,
    }
)
