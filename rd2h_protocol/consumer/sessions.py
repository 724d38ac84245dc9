"""The session machine's effects: handshake, ABORT from Prefill, admission of readiness.

The MF_META handshake and the session budgets; an ABORT from Prefill; and what a
readiness meets before it is served: an unknown or refused session, a resent seq
answered from memory, a seq gap refused.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import msgspec

from rd2h_protocol.consumer.held import SESSION_RECORD_BYTES, layouts_cost
from rd2h_protocol.consumer.parking import parked_cost
from rd2h_protocol.consumer.records import ParkedAbort, ReadinessRecord, SessionRecord
from rd2h_protocol.consumer.replies import REMEMBERED_SEQS, clip
from rd2h_protocol.consumer.state import ConsumerState
from rd2h_protocol.errors import ErrorCode, RemoteProtocolError
from rd2h_protocol.events import Reply
from rd2h_protocol.machines.consumer import (
    DECODE_SESSION,
    EFFECT_ACK_V1,
    EFFECT_ACK_V2,
    EFFECT_APPLY_ABORT,
    EFFECT_DROP,
    EFFECT_REFUSE_V1,
    EFFECT_REFUSE_V2,
    EFFECT_REPLY_REFUSED,
    EFFECT_REPLY_SESSION_GONE,
    EFFECT_REPLY_UNKNOWN_SESSION,
    EFFECT_SERVE,
    EFFECT_SERVE_UNPARKED,
    R_RECV_ABORT,
    S_RECV_ABORT,
    S_RECV_MF_META_BAD_V1,
    S_RECV_MF_META_BAD_V2,
    S_RECV_MF_META_V1,
    S_RECV_MF_META_V2,
    S_RECV_READINESS,
    SESSION_UNBOUND,
)
from rd2h_protocol.machines.consumer_inputs import ReqEnd, SessAbort, SessHandshake, SessReadiness
from rd2h_protocol.machines.declare import BoundMachine
from rd2h_protocol.wire.layout import LayerLayout, decode_layer_metadata
from rd2h_protocol.wire.messages import (
    ALL_CAPABILITIES,
    CAP_RESEND,
    CAP_SEQ,
    PROTOCOL_VERSION,
    TAG_ACK_V1,
    Abort,
    Ack,
    MfMeta,
    ReadReadyBatch,
)
from rd2h_protocol.wire.readiness import unique_ids

if TYPE_CHECKING:
    from rd2h_protocol.consumer.held import SessionBudgets
    from rd2h_protocol.consumer.parking import Parking
    from rd2h_protocol.consumer.replies import Replies
    from rd2h_protocol.consumer.requests import RequestEffects
    from rd2h_protocol.consumer.serving import Serving


def _id_bound(layers: Mapping[str, LayerLayout]) -> int | None:
    """The smallest ``num_blocks`` of a Prefill layout; None if a layer does not say it."""
    bound: int | None = None
    for layout in layers.values():
        if layout.num_blocks is None:
            return None
        bound = layout.num_blocks if bound is None else min(bound, layout.num_blocks)
    return bound


class SessionEffects:
    """What the Prefill sessions' machine does with MF_META, ABORT and readiness (see
    ``DECODE_SESSION``): the owner its table's handlers run on."""

    __slots__ = ("budgets", "parking", "replies", "request", "serving", "state")

    #: ``DECODE_SESSION`` bound to this class's handlers (set below the class).
    TABLE: ClassVar[BoundMachine]

    budgets: SessionBudgets
    parking: Parking
    replies: Replies
    request: RequestEffects
    serving: Serving

    def __init__(self, state: ConsumerState) -> None:
        self.state = state

    # -- handshake -------------------------------------------------------------------------

    def on_mf_meta(self, peer: bytes, msg: MfMeta) -> None:
        v2 = msg.protocol_version is not None and msg.protocol_version >= 2
        error: tuple[ErrorCode, str] | None = None
        layers: dict[str, LayerLayout] = {}
        try:
            layers = decode_layer_metadata(msg.encoded_layer_metadata)
        except RemoteProtocolError as exc:
            error = (exc.code, f"layer metadata refused: {exc.message}")
        ours = self.state.config.compat
        if error is None and v2 and ours is not None and msg.compat not in (None, ours):
            error = (
                ErrorCode.INCOMPATIBLE,
                f"compat mismatch: Prefill has {msg.compat!r}, Decode has {ours!r}",
            )
        if error is None:
            event = S_RECV_MF_META_V2 if v2 else S_RECV_MF_META_V1
        else:
            event = S_RECV_MF_META_BAD_V2 if v2 else S_RECV_MF_META_BAD_V1
        session = self.bind(peer, msg.p_session)
        ctx = SessHandshake(peer, msg, layers, error)
        self.TABLE.apply(self, session, event, ctx, error=RemoteProtocolError)

    # The session machine's MF_META effects: (session, peer, msg, layers, refusal).

    def install_handshake(
        self, session: SessionRecord, msg: MfMeta, layers: dict[str, LayerLayout]
    ) -> None:
        """A new MF_META replaces the session's previous handshake, refused or not.

        Only the layouts of this rank's layers are kept: a readiness for any other layer
        is refused before its layout is looked at (see Serving), so what a session holds
        is bounded by this rank's layers, not by what the peer sent."""
        v2 = msg.protocol_version is not None and msg.protocol_version >= 2
        session.validated = {}
        session.id_bound = _id_bound(layers)
        ours = self.state.by_name
        session.layers = {name: lay for name, lay in layers.items() if name in ours}
        budgets = self.budgets
        budgets.drop_entries(session.name)
        budgets.account_layout(session, layouts_cost(session.layers) if session.layers else 0)
        budgets.enforce_session_budgets(session)
        session.caps = frozenset(msg.capabilities or ()) & self.state.caps if v2 else frozenset()
        session.next_seq = msg.first_seq if v2 else None

    def fx_ack_v1(self, session: SessionRecord, ctx: SessHandshake) -> None:
        self.install_handshake(session, ctx.msg, ctx.layers)
        self.state.stats.handshakes += 1
        self.state.out.append(Reply(ctx.peer, Ack(kind=TAG_ACK_V1)))

    def fx_ack_v2(self, session: SessionRecord, ctx: SessHandshake) -> None:
        self.install_handshake(session, ctx.msg, ctx.layers)
        self.state.stats.handshakes += 1
        self.state.out.append(Reply(ctx.peer, self._ack()))

    def fx_refuse_v1(self, session: SessionRecord, ctx: SessHandshake) -> None:
        """Refused; a v1 peer has no refusal shape: nothing is said."""
        assert ctx.refusal is not None
        self.install_handshake(session, ctx.msg, ctx.layers)
        session.refusal = ctx.refusal
        self.state.stats.refused_handshakes += 1

    def fx_refuse_v2(self, session: SessionRecord, ctx: SessHandshake) -> None:
        """Refused: the Ack says why."""
        self.fx_refuse_v1(session, ctx)
        assert ctx.refusal is not None
        code, text = ctx.refusal
        self.state.out.append(Reply(ctx.peer, self._ack(error_code=int(code), error=clip(text))))

    def _ack(self, error_code: int | None = None, error: str | None = None) -> Ack:
        caps: list[str] = [c for c in ALL_CAPABILITIES if c in self.state.caps]
        return Ack(
            protocol_version=PROTOCOL_VERSION, capabilities=caps, error_code=error_code, error=error
        )

    def bind(self, peer: bytes, name: str) -> SessionRecord:
        """The session ``name``, now reached through ``peer`` (created if new)."""
        state = self.state
        sessions = state.sessions
        session = sessions.get(name)
        if session is None:
            budgets = self.budgets
            session = SessionRecord(name, peer)
            sessions[name] = session
            state.origin_sessions.setdefault(peer, OrderedDict())[name] = None
            budgets.charge(session, SESSION_RECORD_BYTES + sys.getsizeof(name))
            while len(sessions) > state.config.max_sessions:
                # One of the heaviest connection's sessions goes: a connection that opens
                # session after session forgets its own, nobody else's.
                if not any(budgets.shed(o, session, entries=False) for o in budgets.by_weight()):
                    break
        else:
            sessions.move_to_end(name)
            state.origin_sessions[session.origin].move_to_end(name)
        # Invariant: every (peer -> name) in _peers has sessions[name].peer == peer.
        peers = state.peers
        previous = peers.get(peer)
        if previous is not None and previous != name:
            sessions[previous].peer = None
        if session.peer is not None and session.peer != peer:
            peers.pop(session.peer, None)
        session.peer = peer
        peers[peer] = name
        return session

    def session_of(self, peer: bytes) -> SessionRecord | None:
        state = self.state
        name = state.peers.get(peer)
        return None if name is None else state.sessions.get(name)

    # -- abort from Prefill ----------------------------------------------------------------

    def on_abort(self, peer: bytes, msg: Abort, now: float) -> None:
        session = self.session_of(peer)
        state = SESSION_UNBOUND if session is None else session.state
        ctx = SessAbort(msg, now)
        self.TABLE.apply_react(self, session, state, S_RECV_ABORT, ctx, error=RemoteProtocolError)

    def fx_drop(self, _session: SessionRecord | None, _ctx: SessAbort) -> None:
        """An ABORT from a peer with no usable session: count it."""
        self.state.stats.dropped += 1

    def fx_apply_abort(self, session: SessionRecord, ctx: SessAbort) -> None:
        """Fail the requests an ABORT names; park it for those not known yet."""
        msg, now = ctx.msg, ctx.now
        self.state.stats.aborts_received += 1
        reason = f"aborted by Prefill: {msg.reason}" if msg.reason else "aborted by Prefill"
        failure = ReqEnd(now, ErrorCode.ABORTED, reason, session.name)
        missing: list[str] = []
        for ext in unique_ids(msg.ext_ids):
            req = self.state.requests.get(ext)
            if req is not None:
                self.request.apply(req, R_RECV_ABORT, failure)
            elif ext not in self.state.retired:
                missing.append(ext)
        if missing:
            # The abort outran the worker too: apply it when the request arrives.
            deadline = now + self.state.config.park_timeout_s
            parked = ParkedAbort(session.name, tuple(sorted(missing)), reason, deadline)
            parked.park_cost = parked_cost(parked)
            if not self.parking.park(parked):
                self.state.stats.dropped += 1

    # -- readiness -------------------------------------------------------------------------

    def on_readiness(
        self, peer: bytes, msg: ReadReadyBatch, now: float, ids_below: int | None
    ) -> None:
        session = self.session_of(peer)
        state = SESSION_UNBOUND if session is None else session.state
        rd = ReadinessRecord(peer, "" if session is None else session.name, msg, now, ids_below)
        ctx = SessReadiness(rd, now)
        self.TABLE.apply_react(
            self, session, state, S_RECV_READINESS, ctx, error=RemoteProtocolError
        )

    # The session machine's RECV_READINESS and LOCAL_UNPARKED effects.

    def fx_reply_unknown_session(self, _session: None, ctx: SessReadiness) -> None:
        rd, now = ctx.rd, ctx.now
        self.state.stats.unknown_session += 1
        # A v2 Prefill (seq present) re-handshakes and replays this message once, so
        # its requests stay alive; a v1 one never replays, so they cannot complete.
        self.replies.refuse(
            rd,
            now,
            ErrorCode.UNKNOWN_SESSION,
            "no MF_META handshake on this connection",
            fail_known=rd.msg.seq is None,
        )

    def fx_reply_refused(self, session: SessionRecord, ctx: SessReadiness) -> None:
        code, text = session.refusal
        self.replies.refuse(ctx.rd, ctx.now, code, f"handshake refused: {text}")

    def fx_reply_session_gone(self, _session: None, ctx: SessReadiness) -> None:
        """Out of the park, its session was forgotten meanwhile."""
        self.replies.refuse(
            ctx.rd, ctx.now, ErrorCode.UNKNOWN_SESSION, "the Prefill session is gone"
        )

    def fx_serve_unparked(self, session: SessionRecord, ctx: SessReadiness) -> None:
        """Out of the park: serve it now, its still-unknown requests isolated."""
        self.serving.serve(ctx.rd, session, ctx.now, allow_park=False)

    def fx_serve(self, session: SessionRecord, ctx: SessReadiness) -> None:
        """Serve the readiness: a repeated seq from memory, a seq gap refused, else read."""
        rd, now = ctx.rd, ctx.now
        msg = rd.msg
        if msg.seq is not None and CAP_SEQ in session.caps:
            if CAP_RESEND in session.caps:
                if self.repeated(rd, session):
                    return
                self.replies.remember(session, msg.seq, None)
            if self.lost_before(session, msg):
                self.refuse_after_loss(rd, session, now)
                return
        self.serving.serve(rd, session, now, allow_park=True)

    def repeated(self, rd: ReadinessRecord, session: SessionRecord) -> bool:
        """Whether ``rd`` carries a seq this session sent before (resent after a broken
        connection came back, or duplicated): then it is answered again from memory, or
        not at all while its read runs (that read's reply answers both), and never read
        twice, since the request may have moved on and its blocks with it."""
        seq = rd.msg.seq
        assert seq is not None
        if session.next_seq is None or seq >= session.next_seq:
            return False
        self.state.stats.repeated_readiness += 1
        reply = session.remembered.get(seq)
        if reply is not None:
            self.state.stats.replies_resent += 1
            # (the layer as asked: a seq lost in a gap is remembered before its layer is known)
            self.state.out.append(
                Reply(rd.peer, msgspec.structs.replace(reply, layer_idx=rd.msg.layer_idx))
            )
        return True

    @staticmethod
    def lost_before(session: SessionRecord, msg: ReadReadyBatch) -> bool:
        """Whether readiness was lost before ``msg`` on this session (a seq gap); else
        advance the expected seq. A v2 Prefill numbers readiness consecutively per
        connection and says in MF_META where it resumes, and a connection delivers in
        order, so a seq above the expected one means the ones between never arrived."""
        assert msg.seq is not None
        expected = session.next_seq
        if expected is not None and msg.seq > expected:
            return True
        if expected is None or msg.seq >= expected:
            session.next_seq = msg.seq + 1
        return False

    def refuse_after_loss(self, rd: ReadinessRecord, session: SessionRecord, now: float) -> None:
        """Readiness was lost on a live connection (ZMQ drops queued frames at a high-water
        mark or a reconnect): any request it carried would miss that layer. Fail every
        request this session has contributed to and every request the message names.
        The lost message's own storage reopens on Prefill when its lease expires or, toward
        a Prefill with ``resend``, when the lost seq comes again and gets this failure."""
        msg = rd.msg
        assert msg.seq is not None and session.next_seq is not None
        text = (
            f"readiness seq {session.next_seq}..{msg.seq - 1} from Prefill session "
            f"{session.name!r} never arrived: a layer of its requests is missing"
        )
        if CAP_RESEND in session.caps:
            # A lost seq that comes after all (resent, or late from a broken connection) is
            # answered with this failure, never read: its requests failed here already.
            for seq in range(max(session.next_seq, msg.seq - REMEMBERED_SEQS), msg.seq):
                reply = self.replies.failure_reply(0, seq, ErrorCode.READINESS_LOST, text)
                self.replies.remember(session, seq, reply)
        session.next_seq = msg.seq + 1
        self.state.stats.lost_readiness += 1
        requests = self.state.requests
        carried = [ext for ext, req in requests.items() if session.name in req.sessions]
        self.request.fail_known(carried, now, ErrorCode.READINESS_LOST, text)
        self.replies.refuse(rd, now, ErrorCode.READINESS_LOST, text)


SessionEffects.TABLE = DECODE_SESSION.bind(
    {
        EFFECT_ACK_V1: SessionEffects.fx_ack_v1,
        EFFECT_ACK_V2: SessionEffects.fx_ack_v2,
        EFFECT_REFUSE_V1: SessionEffects.fx_refuse_v1,
        EFFECT_REFUSE_V2: SessionEffects.fx_refuse_v2,
        EFFECT_SERVE: SessionEffects.fx_serve,
        EFFECT_SERVE_UNPARKED: SessionEffects.fx_serve_unparked,
        EFFECT_REPLY_SESSION_GONE: SessionEffects.fx_reply_session_gone,
        EFFECT_REPLY_REFUSED: SessionEffects.fx_reply_refused,
        EFFECT_REPLY_UNKNOWN_SESSION: SessionEffects.fx_reply_unknown_session,
        EFFECT_APPLY_ABORT: SessionEffects.fx_apply_abort,
        EFFECT_DROP: SessionEffects.fx_drop,
    }
)
