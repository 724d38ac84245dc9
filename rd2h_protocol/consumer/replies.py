"""Replies to readiness: read_done (with the isolated requests) and read_failed.

A session remembers its recent replies by seq, so that a resent readiness is answered
again without reading twice (:meth:`_Replies._remember`).
"""

from __future__ import annotations

from typing import Final

from rd2h_protocol.consumer.held import _reply_cost
from rd2h_protocol.consumer.records import _Readiness, _Session
from rd2h_protocol.consumer.requests import _RequestEffects
from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.events import Reply
from rd2h_protocol.machines.consumer import M_LOCAL_REFUSE
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

# Room kept in a reply frame for everything but the per-request failure texts.
_REPLY_TEXT_BUDGET: Final = MAX_FRAME_BYTES // 2


# What a session remembers of its recent readiness (by seq: the reply, or None while it is
# being served), to answer a resent one without reading twice: at most this many seqs and
# this many bytes held (held.py's _reply_cost; a resend older than that is dropped; its
# lease covers it). Prefill resends only what is unanswered, a few storages' worth. What
# is remembered counts against the session budgets too.
_REMEMBERED_SEQS: Final = 256


_REMEMBERED_BYTES: Final = 1 << 20


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT_LEN else text[: MAX_TEXT_LEN - 3] + "..."


class _Replies(_RequestEffects):
    """Every readiness gets exactly one reply; these build and send it."""

    # The readiness machine's REPLY_DONE and REPLY_FAILED effects.

    def _reply_done(self, rd: _Readiness) -> None:
        msg = rd.msg
        if msg.seq is None:
            reply = ReadDone(layer_idx=msg.layer_idx)
        else:
            failed: list[FailedRequest] | None = None
            if rd.isolated and CAP_ISOLATE in rd.caps:
                failed = rd.isolated[:MAX_REQUESTS_PER_BATCH]
                if sum(len(f.ext_req_id) + len(f.message) for f in failed) > _REPLY_TEXT_BUDGET:
                    failed = [FailedRequest(f.ext_req_id, f.code) for f in failed]
            reply = ReadDone(layer_idx=msg.layer_idx, seq=msg.seq, failed=failed)
        self._answer(rd, reply)

    def _reply_failed(self, rd: _Readiness, code: ErrorCode, text: str) -> None:
        self._answer(rd, self._failure_reply(rd.msg.layer_idx, rd.msg.seq, code, text))

    def _answer(self, rd: _Readiness, reply: ReadDone | ReadFailed) -> None:
        """Send ``rd``'s reply, and remember it if its seq is remembered (see _repeated)."""
        self._out.append(Reply(rd.peer, reply))
        seq = rd.msg.seq
        session = self._sessions.get(rd.session)
        if seq is not None and session is not None and seq in session.remembered:
            self._remember(session, seq, reply)

    @staticmethod
    def _failure_reply(layer_idx: int, seq: int | None, code: ErrorCode, text: str) -> ReadFailed:
        if seq is None:  # v1 shape
            return ReadFailed(layer_idx=layer_idx, error=_clip(text))
        return ReadFailed(layer_idx=layer_idx, error=_clip(text), seq=seq, code=int(code))

    def _refuse(
        self, rd: _Readiness, now: float, code: ErrorCode, text: str, *, fail_known: bool = True
    ) -> None:
        """Fail the whole readiness: reply read_failed, fail every known request it names."""
        self._READINESS.fire(self, rd, M_LOCAL_REFUSE, code, text)
        self.stats.layer_failures += 1
        if fail_known:
            self._fail_known(message_ids(rd.msg), now, code, text)

    def _remember(self, session: _Session, seq: int, reply: ReadDone | ReadFailed | None) -> None:
        """Record ``seq``'s reply (None: being served), within the session's bounds."""
        remembered = session.remembered
        before = session.remembered_bytes
        if seq in remembered:
            session.remembered_bytes -= _reply_cost(remembered[seq])
        remembered[seq] = reply
        session.remembered_bytes += _reply_cost(reply)
        while remembered and (
            len(remembered) > _REMEMBERED_SEQS or session.remembered_bytes > _REMEMBERED_BYTES
        ):
            _, evicted = remembered.popitem(last=False)
            session.remembered_bytes -= _reply_cost(evicted)
        grown = session.remembered_bytes - before
        if grown and self._sessions.get(session.name) is session:
            self._charge(session, grown)
            if grown > 0:
                self._enforce_session_budgets(session)
