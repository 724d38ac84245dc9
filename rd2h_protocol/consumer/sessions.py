"""The session machine's effects: handshake, ABORT from Prefill, admission of readiness.

The MF_META handshake and the session budgets; an ABORT from Prefill; and what a
readiness meets before it is served: an unknown or refused session, a resent seq
answered from memory, a seq gap refused.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping

import msgspec

from rd2h_protocol.consumer.held import _SESSION_RECORD_BYTES, _layouts_cost
from rd2h_protocol.consumer.parking import _park_cost
from rd2h_protocol.consumer.records import _ParkedAbort, _Readiness, _Session
from rd2h_protocol.consumer.replies import _REMEMBERED_SEQS, _clip
from rd2h_protocol.consumer.serving import _Serving
from rd2h_protocol.errors import ErrorCode, RemoteProtocolError
from rd2h_protocol.events import Reply
from rd2h_protocol.machines.consumer import (
    R_RECV_ABORT,
    S_RECV_ABORT,
    S_RECV_MF_META_BAD_V1,
    S_RECV_MF_META_BAD_V2,
    S_RECV_MF_META_V1,
    S_RECV_MF_META_V2,
    S_RECV_READINESS,
    SESSION_UNBOUND,
)
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


def _id_bound(layers: Mapping[str, LayerLayout]) -> int | None:
    """The smallest ``num_blocks`` of a Prefill layout; None if a layer does not say it."""
    bound: int | None = None
    for layout in layers.values():
        if layout.num_blocks is None:
            return None
        bound = layout.num_blocks if bound is None else min(bound, layout.num_blocks)
    return bound


class _SessionEffects(_Serving):
    """What the Prefill sessions' machine does with MF_META, ABORT and readiness."""

    # -- handshake -------------------------------------------------------------------------

    def _on_mf_meta(self, peer: bytes, msg: MfMeta) -> None:
        v2 = msg.protocol_version is not None and msg.protocol_version >= 2
        error: tuple[ErrorCode, str] | None = None
        layers: dict[str, LayerLayout] = {}
        try:
            layers = decode_layer_metadata(msg.encoded_layer_metadata)
        except RemoteProtocolError as exc:
            error = (exc.code, f"layer metadata refused: {exc.message}")
        ours = self.config.compat
        if error is None and v2 and ours is not None and msg.compat not in (None, ours):
            error = (
                ErrorCode.INCOMPATIBLE,
                f"compat mismatch: Prefill has {msg.compat!r}, Decode has {ours!r}",
            )
        if error is None:
            event = S_RECV_MF_META_V2 if v2 else S_RECV_MF_META_V1
        else:
            event = S_RECV_MF_META_BAD_V2 if v2 else S_RECV_MF_META_BAD_V1
        session = self._bind(peer, msg.p_session)
        self._SESSION.fire(
            self, session, event, peer, msg, layers, error, error=RemoteProtocolError
        )

    # The session machine's MF_META effects: (session, peer, msg, layers, refusal).

    def _install_handshake(
        self, session: _Session, msg: MfMeta, layers: dict[str, LayerLayout]
    ) -> None:
        """A new MF_META replaces the session's previous handshake, refused or not.

        Only the layouts of this rank's layers are kept: a readiness for any other layer
        is refused before its layout is looked at (see _Serving), so what a session holds
        is bounded by this rank's layers, not by what the peer sent."""
        v2 = msg.protocol_version is not None and msg.protocol_version >= 2
        session.validated = {}
        session.id_bound = _id_bound(layers)
        ours = self._by_name
        session.layers = {name: lay for name, lay in layers.items() if name in ours}
        self._drop_entries(session.name)
        self._account_layout(session, _layouts_cost(session.layers) if session.layers else 0)
        self._enforce_session_budgets(session)
        session.caps = frozenset(msg.capabilities or ()) & self._caps if v2 else frozenset()
        session.next_seq = msg.first_seq if v2 else None

    def _fx_ack_v1(
        self,
        session: _Session,
        peer: bytes,
        msg: MfMeta,
        layers: dict[str, LayerLayout],
        _refusal: None,
    ) -> None:
        self._install_handshake(session, msg, layers)
        self.stats.handshakes += 1
        self._out.append(Reply(peer, Ack(kind=TAG_ACK_V1)))

    def _fx_ack_v2(
        self,
        session: _Session,
        peer: bytes,
        msg: MfMeta,
        layers: dict[str, LayerLayout],
        _refusal: None,
    ) -> None:
        self._install_handshake(session, msg, layers)
        self.stats.handshakes += 1
        self._out.append(Reply(peer, self._ack()))

    def _fx_refuse_v1(
        self,
        session: _Session,
        peer: bytes,
        msg: MfMeta,
        layers: dict[str, LayerLayout],
        refusal: tuple[ErrorCode, str],
    ) -> None:
        """Refused; a v1 peer has no refusal shape: nothing is said."""
        self._install_handshake(session, msg, layers)
        session.refusal = refusal
        self.stats.refused_handshakes += 1

    def _fx_refuse_v2(
        self,
        session: _Session,
        peer: bytes,
        msg: MfMeta,
        layers: dict[str, LayerLayout],
        refusal: tuple[ErrorCode, str],
    ) -> None:
        """Refused: the Ack says why."""
        self._fx_refuse_v1(session, peer, msg, layers, refusal)
        code, text = refusal
        self._out.append(Reply(peer, self._ack(error_code=int(code), error=_clip(text))))

    def _ack(self, error_code: int | None = None, error: str | None = None) -> Ack:
        caps: list[str] = [c for c in ALL_CAPABILITIES if c in self._caps]
        return Ack(
            protocol_version=PROTOCOL_VERSION, capabilities=caps, error_code=error_code, error=error
        )

    def _bind(self, peer: bytes, name: str) -> _Session:
        """The session ``name``, now reached through ``peer`` (created if new)."""
        session = self._sessions.get(name)
        if session is None:
            session = _Session(name, peer)
            self._sessions[name] = session
            self._origin_sessions.setdefault(peer, OrderedDict())[name] = None
            self._charge(session, _SESSION_RECORD_BYTES + sys.getsizeof(name))
            while len(self._sessions) > self.config.max_sessions:
                # One of the heaviest connection's sessions goes: a connection that opens
                # session after session forgets its own, nobody else's.
                if not any(self._shed(o, session, entries=False) for o in self._by_weight()):
                    break
        else:
            self._sessions.move_to_end(name)
            self._origin_sessions[session.origin].move_to_end(name)
        # Invariant: every (peer -> name) in _peers has sessions[name].peer == peer.
        previous = self._peers.get(peer)
        if previous is not None and previous != name:
            self._sessions[previous].peer = None
        if session.peer is not None and session.peer != peer:
            self._peers.pop(session.peer, None)
        session.peer = peer
        self._peers[peer] = name
        return session

    def _session_of(self, peer: bytes) -> _Session | None:
        name = self._peers.get(peer)
        return None if name is None else self._sessions.get(name)

    # -- abort from Prefill ----------------------------------------------------------------

    def _on_abort(self, peer: bytes, msg: Abort, now: float) -> None:
        session = self._session_of(peer)
        state = SESSION_UNBOUND if session is None else session.state
        self._SESSION.react(self, session, state, S_RECV_ABORT, msg, now, error=RemoteProtocolError)

    def _fx_drop(self, _session: _Session | None, _msg: Abort, _now: float) -> None:
        """An ABORT from a peer with no usable session: count it."""
        self.stats.dropped += 1

    def _fx_apply_abort(self, session: _Session, msg: Abort, now: float) -> None:
        """Fail the requests an ABORT names; park it for those not known yet."""
        self.stats.aborts_received += 1
        reason = f"aborted by Prefill: {msg.reason}" if msg.reason else "aborted by Prefill"
        missing: list[str] = []
        for ext in unique_ids(msg.ext_ids):
            req = self._requests.get(ext)
            if req is not None:
                self._request_event(
                    req, R_RECV_ABORT, now, ErrorCode.ABORTED, reason, exclude=session.name
                )
            elif ext not in self._retired:
                missing.append(ext)
        if missing:
            # The abort outran the worker too: apply it when the request arrives.
            parked = _ParkedAbort(
                session.name, tuple(sorted(missing)), reason, now + self.config.park_timeout_s
            )
            parked.park_cost = _park_cost(parked)
            if not self._park(parked):
                self.stats.dropped += 1

    # -- readiness -------------------------------------------------------------------------

    def _on_readiness(
        self, peer: bytes, msg: ReadReadyBatch, now: float, ids_below: int | None
    ) -> None:
        session = self._session_of(peer)
        state = SESSION_UNBOUND if session is None else session.state
        rd = _Readiness(peer, "" if session is None else session.name, msg, now, ids_below)
        self._SESSION.react(
            self, session, state, S_RECV_READINESS, rd, now, error=RemoteProtocolError
        )

    # The session machine's RECV_READINESS effects: (session, rd, now).

    def _fx_reply_unknown_session(self, _session: None, rd: _Readiness, now: float) -> None:
        self.stats.unknown_session += 1
        # A v2 Prefill (seq present) re-handshakes and replays this message once, so
        # its requests stay alive; a v1 one never replays, so they cannot complete.
        self._refuse(
            rd,
            now,
            ErrorCode.UNKNOWN_SESSION,
            "no MF_META handshake on this connection",
            fail_known=rd.msg.seq is None,
        )

    def _fx_reply_refused(self, session: _Session, rd: _Readiness, now: float) -> None:
        code, text = session.refusal
        self._refuse(rd, now, code, f"handshake refused: {text}")

    def _fx_serve(self, session: _Session, rd: _Readiness, now: float) -> None:
        """Serve the readiness: a repeated seq from memory, a seq gap refused, else read."""
        msg = rd.msg
        if msg.seq is not None and CAP_SEQ in session.caps:
            if CAP_RESEND in session.caps:
                if self._repeated(rd, session):
                    return
                self._remember(session, msg.seq, None)
            if self._lost_before(session, msg):
                self._refuse_after_loss(rd, session, now)
                return
        self._serve(rd, now, allow_park=True)

    def _repeated(self, rd: _Readiness, session: _Session) -> bool:
        """Whether ``rd`` carries a seq this session sent before (resent after a broken
        connection came back, or duplicated): then it is answered again from memory, or
        not at all while its read runs (that read's reply answers both), and never read
        twice, since the request may have moved on and its blocks with it."""
        seq = rd.msg.seq
        assert seq is not None
        if session.next_seq is None or seq >= session.next_seq:
            return False
        self.stats.repeated_readiness += 1
        reply = session.remembered.get(seq)
        if reply is not None:
            self.stats.replies_resent += 1
            # (the layer as asked: a seq lost in a gap is remembered before its layer is known)
            self._out.append(
                Reply(rd.peer, msgspec.structs.replace(reply, layer_idx=rd.msg.layer_idx))
            )
        return True

    @staticmethod
    def _lost_before(session: _Session, msg: ReadReadyBatch) -> bool:
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

    def _refuse_after_loss(self, rd: _Readiness, session: _Session, now: float) -> None:
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
            for seq in range(max(session.next_seq, msg.seq - _REMEMBERED_SEQS), msg.seq):
                reply = self._failure_reply(0, seq, ErrorCode.READINESS_LOST, text)
                self._remember(session, seq, reply)
        session.next_seq = msg.seq + 1
        self.stats.lost_readiness += 1
        carried = [ext for ext, req in self._requests.items() if session.name in req.sessions]
        self._fail_known(carried, now, ErrorCode.READINESS_LOST, text)
        self._refuse(rd, now, ErrorCode.READINESS_LOST, text)
