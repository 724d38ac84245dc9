"""Replies to readiness: read_done (with the isolated requests) and read_failed.

A session remembers its recent replies by seq, so that a resent readiness is answered
again without reading twice (:meth:`Replies.remember`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from rd2h_protocol.consumer.held import reply_cost
from rd2h_protocol.consumer.records import ReadinessRecord, SessionRecord
from rd2h_protocol.consumer.state import ConsumerState
from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.events import Reply
from rd2h_protocol.machines.consumer import M_LOCAL_REFUSE
from rd2h_protocol.machines.consumer_inputs import RdFailure
from rd2h_protocol.wire.messages import (
    CAP_ISOLATE,
    MAX_FRAME_BYTES,
    MAX_REQUESTS_PER_BATCH,
    MAX_TEXT_LEN,
    FailedRequest,
    ReadDone,
    ReadFailed,
)
from rd2h_protocol.wire.readiness import message_ids

if TYPE_CHECKING:
    from rd2h_protocol.consumer.held import SessionBudgets
    from rd2h_protocol.consumer.reads import ReadinessEffects
    from rd2h_protocol.consumer.requests import RequestEffects

# Room kept in a reply frame for everything but the per-request failure texts.
REPLY_TEXT_BUDGET: Final = MAX_FRAME_BYTES // 2


# What a session remembers of its recent readiness (by seq: the reply, or None while it is
# being served), to answer a resent one without reading twice: at most this many seqs and
# this many bytes held (held.py's reply_cost; a resend older than that is dropped; its
# lease covers it). Prefill resends only what is unanswered, a few storages' worth. What
# is remembered counts against the session budgets too.
REMEMBERED_SEQS: Final = 256


_REMEMBERED_BYTES: Final = 1 << 20


def clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT_LEN else text[: MAX_TEXT_LEN - 3] + "..."


class Replies:
    """Every readiness gets exactly one reply; these build and send it (a collaborator of
    the readiness and session machines' effects)."""

    __slots__ = ("budgets", "readiness", "request", "state")

    budgets: SessionBudgets
    readiness: ReadinessEffects
    request: RequestEffects

    def __init__(self, state: ConsumerState) -> None:
        self.state = state

    # The readiness machine's REPLY_DONE and REPLY_FAILED effects.

    def reply_done(self, rd: ReadinessRecord) -> None:
        msg = rd.msg
        if msg.seq is None:
            reply = ReadDone(layer_idx=msg.layer_idx)
        else:
            failed: list[FailedRequest] | None = None
            if rd.isolated and CAP_ISOLATE in rd.caps:
                failed = rd.isolated[:MAX_REQUESTS_PER_BATCH]
                if sum(len(f.ext_req_id) + len(f.message) for f in failed) > REPLY_TEXT_BUDGET:
                    failed = [FailedRequest(f.ext_req_id, f.code) for f in failed]
            reply = ReadDone(layer_idx=msg.layer_idx, seq=msg.seq, failed=failed)
        self._answer(rd, reply)

    def reply_failed(self, rd: ReadinessRecord, code: ErrorCode, text: str) -> None:
        self._answer(rd, self.failure_reply(rd.msg.layer_idx, rd.msg.seq, code, text))

    def _answer(self, rd: ReadinessRecord, reply: ReadDone | ReadFailed) -> None:
        """Send ``rd``'s reply, and remember it if its seq is remembered (see
        ``SessionEffects.repeated``)."""
        state = self.state
        state.out.append(Reply(rd.peer, reply))
        seq = rd.msg.seq
        session = state.sessions.get(rd.session)
        if seq is not None and session is not None and seq in session.remembered:
            self.remember(session, seq, reply)

    @staticmethod
    def failure_reply(layer_idx: int, seq: int | None, code: ErrorCode, text: str) -> ReadFailed:
        if seq is None:  # v1 shape
            return ReadFailed(layer_idx=layer_idx, error=clip(text))
        return ReadFailed(layer_idx=layer_idx, error=clip(text), seq=seq, code=int(code))

    def refuse(
        self,
        rd: ReadinessRecord,
        now: float,
        code: ErrorCode,
        text: str,
        *,
        fail_known: bool = True,
    ) -> None:
        """Fail the whole readiness: reply read_failed, fail every known request it names."""
        readiness = self.readiness
        readiness.TABLE.apply(readiness, rd, M_LOCAL_REFUSE, RdFailure(code, text))
        self.state.stats.layer_failures += 1
        if fail_known:
            self.request.fail_known(message_ids(rd.msg), now, code, text)

    def remember(
        self, session: SessionRecord, seq: int, reply: ReadDone | ReadFailed | None
    ) -> None:
        """Record ``seq``'s reply (None: being served), within the session's bounds."""
        remembered = session.remembered
        before = session.remembered_bytes
        if seq in remembered:
            session.remembered_bytes -= reply_cost(remembered[seq])
        remembered[seq] = reply
        session.remembered_bytes += reply_cost(reply)
        while remembered and (
            len(remembered) > REMEMBERED_SEQS or session.remembered_bytes > _REMEMBERED_BYTES
        ):
            _, evicted = remembered.popitem(last=False)
            session.remembered_bytes -= reply_cost(evicted)
        grown = session.remembered_bytes - before
        if grown and self.state.sessions.get(session.name) is session:
            self.budgets.charge(session, grown)
            if grown > 0:
                self.budgets.enforce_session_budgets(session)
