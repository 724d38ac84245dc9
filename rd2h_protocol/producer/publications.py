"""The layer publication machine's effects, and the storage gates they close and open.

A publication is one readiness (one layer, one Decode endpoint): it closes its storage
gates (:meth:`_Publications._publish`), goes on the wire with a seq, is matched to the
reply that answers it (:meth:`_Publications._find`) and ends
(:meth:`_Publications._end_pub`), counting itself off its gates and its requests.
"""

from __future__ import annotations

import heapq

from rd2h_protocol.errors import ErrorCode, RemoteProtocolError
from rd2h_protocol.events import GateOpened, LayerReplied, Send
from rd2h_protocol.machines.declare import Input
from rd2h_protocol.machines.producer import (
    C_RECV_UNKNOWN_SESSION,
    CONN_HANDSHAKING,
    CONN_READY_V2,
    G_LOCAL_PUBLISH,
    G_RECV_LAST_REPLY,
    G_RECV_REPLY,
    P_LOCAL_RESEND,
    P_RECV_FAILED,
    P_RECV_UNKNOWN_SESSION,
    PUB_HELD,
    PUB_REPLAYED,
    R_LOCAL_FAILURE,
    R_RECV_FAILURE,
)
from rd2h_protocol.machines.producer_inputs import (
    ConnAt,
    PubAt,
    PubEnd,
    PubRelease,
    PubReply,
    ReqFailure,
)
from rd2h_protocol.producer.config import Output
from rd2h_protocol.producer.handshakes import _Handshakes
from rd2h_protocol.producer.records import _Conn, _Gate, _Pub, _Request
from rd2h_protocol.producer.requests import _STILL_READ, _Requests
from rd2h_protocol.wire.messages import (
    CAP_LEASE,
    CAP_RECONNECT,
    CAP_RESEND,
    CAP_SEQ,
    FailedRequest,
    ReadFailed,
    ReadReadyBatch,
    ReadReq,
)


class _Publications(_Handshakes, _Requests):
    """Effects of :data:`~rd2h_protocol.machines.producer.LAYER_PUBLICATION` and
    :data:`~rd2h_protocol.machines.producer.STORAGE_GATE` (a lease's run-out is in
    :mod:`.leases`, a dead peer's orphans in :mod:`.dead_peers`)."""

    def _publish(
        self,
        layer_idx: int,
        slots: tuple[int, ...],
        read_reqs: list[ReadReq],
        done: list[str],
        named: list[_Request],
        deadline: float,
    ) -> _Pub:
        uid = self._uid()
        pub = _Pub(uid, named[0].conn, layer_idx, slots, read_reqs, done, tuple(named), deadline)
        self._pubs[uid] = pub
        for req in named:
            req.outstanding += 1
        for s in slots:
            gate = self._gates[s]
            self._GATE.fire(self, gate, G_LOCAL_PUBLISH, s, None)
            gate.outstanding += 1
        heapq.heappush(self._timers, (deadline, uid))
        self.stats.publications += 1
        return pub

    def _fx_send(self, pub: _Pub, ctx: PubAt) -> None:
        now = ctx.now
        if pub.state == PUB_REPLAYED:
            self.stats.replays += 1
        conn = pub.conn
        seq = conn.next_seq
        conn.next_seq += 1
        pub.seq = seq
        pub.sent_at = now
        conn.sent[seq] = pub
        ctx.out.append(Send(conn.name, self._readiness(pub, now)))

    def _readiness(self, pub: _Pub, now: float) -> ReadReadyBatch:
        """The readiness of ``pub`` as it goes out now (its seq, what is left of its lease)."""
        conn = pub.conn
        caps = conn.caps
        read_reqs = pub.read_reqs
        done = pub.done_ids
        if any(r.state not in _STILL_READ for r in pub.requests):
            # Some stopped while this waited for the handshake: do not publish them.
            live = {r.ext_id for r in pub.requests if r.state in _STILL_READ}
            read_reqs = [r for r in read_reqs if r.ext_req_id in live]
            done = [d for d in done if d in live]
        contributor = conn.contributor
        return ReadReadyBatch(
            layer_idx=self._wire_index[pub.layer_idx],
            layer_name=self._layer_names[pub.layer_idx],
            read_reqs=read_reqs,
            done_ext_ids=done,
            group_member_idx=contributor.group_member_idx,
            tp_ratio=contributor.tp_ratio,
            seq=pub.seq if CAP_SEQ in caps else None,
            lease_ms=_lease_ms_left(pub, now) if CAP_LEASE in caps else None,
        )

    def _resend(self, conn: _Conn, pubs: list[_Pub], now: float, out: list[Output]) -> None:
        """Send ``pubs`` again under their seqs, in order, if ``conn``'s peer has ``resend``
        and the connection is ready; skip a live one whose lease has run out."""
        if CAP_RESEND not in conn.caps or conn.state != CONN_READY_V2:
            return
        ctx = PubAt(now, out)
        for pub in pubs:
            if pub.state != PUB_HELD and CAP_LEASE in conn.caps and _lease_ms_left(pub, now) == 0:
                continue  # the peer could start it after the lease timer reopened the storage
            self._PUB.apply(self, pub, P_LOCAL_RESEND, ctx)

    def _fx_resend(self, pub: _Pub, ctx: PubAt) -> None:
        """Sent again under the same seq (the peer answers a repeated seq from memory)."""
        self.stats.resent += 1
        ctx.out.append(Send(pub.conn.name, self._readiness(pub, ctx.now)))

    def _forget_seq(self, pub: _Pub) -> None:
        """Move a publication's seq from the wire map into the bounded history."""
        seq = pub.seq
        if seq is None:
            return
        conn = pub.conn
        del conn.sent[seq]
        pub.seq = None
        limit = self.config.history
        if limit:
            history = conn.history
            history[seq] = (pub.layer_idx, pub.state)
            if len(history) > limit:
                history.popitem(last=False)

    def _find(self, conn: _Conn, layer_idx: int, seq: int | None) -> _Pub | str | None:
        """The live publication a reply answers, else the state it ended in, else None."""
        if seq is not None and CAP_SEQ in conn.caps:
            pub = conn.sent.get(seq)
            if pub is not None:
                return pub if pub.layer_idx == layer_idx else None
            ended = conn.history.get(seq)
            return ended[1] if ended is not None and ended[0] == layer_idx else None
        # No seq (v1 peer): the oldest publication of that layer on this connection.
        for pub in conn.sent.values():
            if pub.layer_idx == layer_idx:
                return pub
        for ended_layer, state in reversed(conn.history.values()):
            if ended_layer == layer_idx:
                return state
        return None

    def _on_read_failed(self, conn: _Conn, msg: ReadFailed, now: float, out: list[Output]) -> None:
        if (
            msg.code == ErrorCode.UNKNOWN_SESSION
            and CAP_RECONNECT in conn.caps
            and conn.state in (CONN_READY_V2, CONN_HANDSHAKING)
        ):
            event = P_RECV_UNKNOWN_SESSION
        else:
            event = P_RECV_FAILED
        self._on_reply(conn, msg.layer_idx, msg.seq, event, now, out, None, msg)

    def _on_reply(
        self,
        conn: _Conn,
        wire_layer: int,
        seq: int | None,
        event: Input[PubReply],
        now: float,
        out: list[Output],
        failed: list[FailedRequest] | None = None,
        read_failed: ReadFailed | None = None,
    ) -> None:
        position = self._position_of_wire.get(wire_layer, -1)  # -1: no layer of ours
        found = self._find(conn, position, seq)
        if found is None:
            self.stats.unknown_replies += 1
            return
        ctx = PubReply(now, out, G_RECV_REPLY, G_RECV_LAST_REPLY, event, failed, read_failed)
        if isinstance(found, str):  # ended: the table says duplicate or stale
            self._PUB.react(self, None, found, event, ctx, error=RemoteProtocolError)
            return
        self.stats.replies += 1
        self._PUB.apply(self, found, event, ctx, error=RemoteProtocolError)

    def _fx_count_duplicate(self, _pub: None, _ctx: PubReply) -> None:
        """A reply for a publication answered already (or superseded by a replay)."""
        self.stats.duplicate_replies += 1

    def _fx_count_stale(self, _pub: None, _ctx: PubReply) -> None:
        """A reply for a publication that ended without one."""
        self.stats.stale_replies += 1

    # The publication machine's other effects: (pub, ctx), ``ctx.one`` / ``ctx.last`` the
    # gate inputs by which ending it now counts it off its gates.

    def _fx_release_held(self, pub: _Pub, ctx: PubEnd) -> None:
        """Held or orphaned: its requests ended already; now its storage is free too."""
        self._end_pub(pub, ctx.out, ctx.one, ctx.last)

    def _fx_requeue(self, pub: _Pub, ctx: PubAt) -> None:
        """The Decode lost our handshake, read nothing: replay after a new handshake."""
        self._forget_seq(pub)
        self._CONN.apply(self, pub.conn, C_RECV_UNKNOWN_SESSION, ConnAt(ctx.now, ctx.out, pub))

    def _fx_done(self, pub: _Pub, ctx: PubReply) -> None:
        conn = pub.conn
        ctx.out.append(LayerReplied(conn.name, pub.layer_idx, ctx.now - pub.sent_at, True))
        failed = ctx.failed
        isolated = {f.ext_req_id: f for f in failed} if failed else {}
        if isolated:
            self.stats.isolated_failures += len(isolated)
        self._fail_requests(pub, R_RECV_FAILURE, ErrorCode.UNKNOWN, "", isolated)
        self._end_pub(pub, ctx.out, ctx.one, ctx.last)

    def _fx_fail(self, pub: _Pub, ctx: PubReply) -> None:
        conn, now, out, read_failed = pub.conn, ctx.now, ctx.out, ctx.read_failed
        assert read_failed is not None  # RECV_FAILED and RECV_UNKNOWN_SESSION carry it
        out.append(LayerReplied(conn.name, pub.layer_idx, now - pub.sent_at, False))
        self.stats.read_failures += 1
        code = _error_code(read_failed.code, ErrorCode.TRANSFER_FAILED)
        message = read_failed.error or f"read failed ({code.name})"
        self._fail_requests(
            pub,
            R_RECV_FAILURE,
            code,
            f"layer {pub.layer_idx} read by {conn.name} failed: {message}",
            {},
        )
        if ctx.event == P_RECV_UNKNOWN_SESSION:
            # The replay met an unknown session too: hand-shake again for later layers.
            self._CONN.apply(self, conn, C_RECV_UNKNOWN_SESSION, ConnAt(now, out, None))
        self._end_pub(pub, out, ctx.one, ctx.last)

    def _fx_release(self, pub: _Pub, ctx: PubRelease) -> None:
        """Never left (the handshake failed): nothing can read it, the gates reopen."""
        self._fail_requests(pub, R_LOCAL_FAILURE, ctx.code, ctx.message, {})
        self._end_pub(pub, ctx.out, ctx.one, ctx.last)

    def _fail_requests(
        self,
        pub: _Pub,
        event: Input[ReqFailure],
        code: ErrorCode,
        message: str,
        only: dict[str, FailedRequest],
    ) -> None:
        """Record a failure on the publication's requests (all of them, or ``only``).

        ``only`` empty and ``message`` empty means nothing failed.
        """
        failed_any = False
        if only:
            for req in pub.requests:
                entry = only.get(req.ext_id)
                if entry is not None:
                    failed_any = True
                    self._fail(
                        req,
                        event,
                        _error_code(entry.code, ErrorCode.UNKNOWN),
                        f"layer {pub.layer_idx}: Decode {pub.conn.name} could not serve it: "
                        f"{entry.message or _error_code(entry.code, ErrorCode.UNKNOWN).name}",
                    )
        elif message:
            failed_any = True
            for req in pub.requests:
                self._fail(req, event, code, message)
        if failed_any and self.config.read_failure_policy == "raise":
            reason = message or f"requests failed on {pub.conn.name}"
            for s in pub.slots:
                self._pending_raise.setdefault(s, reason)

    def _end_pub(self, pub: _Pub, out: list[Output], one: str, last: str) -> None:
        """A publication ended: count it off its gates, then off its requests."""
        self._forget_seq(pub)
        del self._pubs[pub.uid]
        for s in pub.slots:
            gate = self._gates[s]
            gate.outstanding -= 1
            event = one if gate.outstanding else last
            self._GATE.fire(self, gate, event, s, out)
        self._drain_pub(pub, out)

    def _fx_reopen(self, _gate: _Gate, slot: int, out: list[Output]) -> None:
        out.append(GateOpened(slot))

    def _drain_pub(self, pub: _Pub, out: list[Output]) -> None:
        requests, pub.requests = pub.requests, ()
        pub.read_reqs, pub.done_ids = [], []
        for req in requests:
            req.outstanding -= 1
            self._maybe_drain(req, out)


def _lease_ms_left(pub: _Pub, now: float) -> int:
    """What is left of ``pub``'s lease, as a readiness carries it (0: run out)."""
    return max(0, int((pub.deadline - now) * 1000))


def _error_code(value: int | None, default: ErrorCode) -> ErrorCode:
    """A wire code as an :class:`ErrorCode`; unknown numbers (a newer peer) keep ``default``."""
    if value is None:
        return default
    try:
        return ErrorCode(value)
    except ValueError:
        return default
