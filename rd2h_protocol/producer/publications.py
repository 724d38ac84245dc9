"""The layer publication machine's effects, and the storage gates they close and open.

A publication is one readiness (one layer, one Decode endpoint): it closes its storage
gates (:meth:`PublicationEffects.publish`), goes on the wire with a seq, is matched to the
reply that answers it (:meth:`PublicationEffects.find`) and ends
(:meth:`PublicationEffects.end_pub`), counting itself off its gates and its requests. Its
lease effects are in :mod:`.leases`, a dead peer's orphans in :mod:`.dead_peers`: functions
that take this effects object, bound into its table here.
"""

from __future__ import annotations

import heapq
from typing import ClassVar

from rd2h_protocol.errors import ErrorCode, RemoteProtocolError
from rd2h_protocol.events import GateOpened, LayerReplied, Send
from rd2h_protocol.machines.declare import NO_EFFECT, BoundMachine, Input, no_effect
from rd2h_protocol.machines.producer import (
    C_RECV_UNKNOWN_SESSION,
    CONN_HANDSHAKING,
    CONN_READY_V2,
    EFFECT_CHECK_SILENCE,
    EFFECT_COUNT_DUPLICATE,
    EFFECT_COUNT_STALE,
    EFFECT_DONE,
    EFFECT_EXPIRE_ABORT,
    EFFECT_EXPIRE_UNSENT,
    EFFECT_EXPIRE_UNTOLD,
    EFFECT_FAIL,
    EFFECT_HOLD,
    EFFECT_LEASE_RAN_OUT,
    EFFECT_ORPHAN,
    EFFECT_ORPHAN_LEASE_RAN_OUT,
    EFFECT_RELEASE,
    EFFECT_RELEASE_HELD,
    EFFECT_REOPEN,
    EFFECT_REPLAY,
    EFFECT_REQUEUE,
    EFFECT_RESEND,
    EFFECT_SEND,
    G_LOCAL_PUBLISH,
    G_RECV_LAST_REPLY,
    G_RECV_REPLY,
    LAYER_PUBLICATION,
    P_LOCAL_RESEND,
    P_LOCAL_RESEND_LAPSED,
    P_RECV_FAILED,
    P_RECV_UNKNOWN_SESSION,
    PUB_ORPHANED,
    R_LOCAL_FAILURE,
    R_RECV_FAILURE,
    STORAGE_GATE,
)
from rd2h_protocol.machines.producer_inputs import (
    ConnAt,
    PubAt,
    PubEnd,
    PubRelease,
    PubReply,
    ReqFailure,
)
from rd2h_protocol.producer import dead_peers, leases
from rd2h_protocol.producer.records import Conn, Gate, Pub, Request
from rd2h_protocol.producer.requests import STILL_READ
from rd2h_protocol.producer.state import Effects
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


class PublicationEffects(Effects):
    """Effects of :data:`~rd2h_protocol.machines.producer.LAYER_PUBLICATION`."""

    __slots__ = ()

    TABLE: ClassVar[BoundMachine]

    def publish(
        self,
        layer_idx: int,
        slots: tuple[int, ...],
        read_reqs: list[ReadReq],
        done: list[str],
        named: list[Request],
        deadline: float,
    ) -> Pub:
        """A new publication of one layer to one connection: it closes the layer's gates
        and starts its lease (the caller hands it to its connection)."""
        state = self.state
        uid = state.uid()
        pub = Pub(uid, named[0].conn, layer_idx, slots, read_reqs, done, tuple(named), deadline)
        state.pubs[uid] = pub
        for req in named:
            req.outstanding += 1
        gates = state.gates
        gate_fx = self.gate_fx
        apply_gate = gate_fx.TABLE.apply
        for s in slots:
            gate = gates[s]
            apply_gate(gate_fx, gate, G_LOCAL_PUBLISH, s)
            gate.outstanding += 1
        heapq.heappush(state.timers, (deadline, uid))
        state.stats.publications += 1
        return pub

    def _fx_send(self, pub: Pub, ctx: PubAt) -> None:
        now = ctx.now
        conn = pub.conn
        seq = conn.next_seq
        conn.next_seq += 1
        pub.seq = seq
        pub.sent_at = now
        conn.sent[seq] = pub
        self.state.out.append(Send(conn.name, self._readiness(pub, now)))

    def _fx_replay(self, pub: Pub, ctx: PubAt) -> None:
        """Sent again after a new handshake, under a fresh seq: counted as a replay."""
        self.state.stats.replays += 1
        self._fx_send(pub, ctx)

    def _readiness(self, pub: Pub, now: float) -> ReadReadyBatch:
        """The readiness of ``pub`` as it goes out now (its seq, what is left of its lease)."""
        conn = pub.conn
        caps = conn.caps
        read_reqs = pub.read_reqs
        done = pub.done_ids
        if any(r.state not in STILL_READ for r in pub.requests):
            # Some stopped while this waited for the handshake: do not publish them.
            live = {r.ext_id for r in pub.requests if r.state in STILL_READ}
            read_reqs = [r for r in read_reqs if r.ext_req_id in live]
            done = [d for d in done if d in live]
        contributor = conn.contributor
        state = self.state
        return ReadReadyBatch(
            layer_idx=state.wire_index[pub.layer_idx],
            layer_name=state.layer_names[pub.layer_idx],
            read_reqs=read_reqs,
            done_ext_ids=done,
            group_member_idx=contributor.group_member_idx,
            tp_ratio=contributor.tp_ratio,
            seq=pub.seq if CAP_SEQ in caps else None,
            lease_ms=lease_ms_left(pub, now) if CAP_LEASE in caps else None,
        )

    def resend(self, conn: Conn, pubs: list[Pub], now: float) -> None:
        """Send ``pubs`` again under their seqs, in order, if ``conn``'s peer has ``resend``
        and the connection is ready; the table says which (a live one whose lease has run
        out is not)."""
        if CAP_RESEND not in conn.caps or conn.state != CONN_READY_V2:
            return
        ctx = PubAt(now)
        bounded = CAP_LEASE in conn.caps
        for pub in pubs:
            lapsed = bounded and lease_ms_left(pub, now) == 0
            event = P_LOCAL_RESEND_LAPSED if lapsed else P_LOCAL_RESEND
            self.TABLE.apply(self, pub, event, ctx)

    def _fx_resend(self, pub: Pub, ctx: PubAt) -> None:
        """Sent again under the same seq (the peer answers a repeated seq from memory)."""
        self.state.stats.resent += 1
        self.state.out.append(Send(pub.conn.name, self._readiness(pub, ctx.now)))

    def _forget_seq(self, pub: Pub) -> None:
        """Move a publication's seq from the wire map into the bounded history."""
        seq = pub.seq
        if seq is None:
            return
        conn = pub.conn
        del conn.sent[seq]
        pub.seq = None
        limit = self.state.config.history
        if limit:
            history = conn.history
            history[seq] = (pub.layer_idx, pub.state)
            if len(history) > limit:
                history.popitem(last=False)

    def find(self, conn: Conn, layer_idx: int, seq: int | None) -> Pub | str | None:
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

    def on_read_failed(self, conn: Conn, msg: ReadFailed, now: float) -> None:
        """A READ_FAILED from ``conn``: UNKNOWN_SESSION from a peer that reconnects (on a
        connection that can hand-shake again) replays, anything else fails."""
        if (
            msg.code == ErrorCode.UNKNOWN_SESSION
            and CAP_RECONNECT in conn.caps
            and conn.state in (CONN_READY_V2, CONN_HANDSHAKING)
        ):
            event = P_RECV_UNKNOWN_SESSION
        else:
            event = P_RECV_FAILED
        self.on_reply(conn, msg.layer_idx, msg.seq, event, now, None, msg)

    def on_reply(
        self,
        conn: Conn,
        wire_layer: int,
        seq: int | None,
        event: Input[PubReply],
        now: float,
        failed: list[FailedRequest] | None = None,
        read_failed: ReadFailed | None = None,
    ) -> None:
        """A reply from ``conn``: matched to its publication, or counted."""
        state = self.state
        position = state.position_of_wire.get(wire_layer, -1)  # -1: no layer of ours
        found = self.find(conn, position, seq)
        if found is None:
            state.stats.unknown_replies += 1
            return
        ctx = PubReply(now, G_RECV_REPLY, G_RECV_LAST_REPLY, event, failed, read_failed)
        if isinstance(found, str):  # ended: the table says duplicate or stale
            self.TABLE.apply_react(self, None, found, event, ctx, error=RemoteProtocolError)
            return
        state.stats.replies += 1
        if event == P_RECV_UNKNOWN_SESSION and found.state != PUB_ORPHANED:
            # The Decode lost the handshake that every publication still out on this
            # connection went under, so it reads none of them, and their own replies may be
            # lost: each takes this reply, in the order they went out (replays keep it).
            # Orphaned ones went out on an earlier connection: only their own reply counts.
            for pub in [p for p in conn.sent.values() if p.state != PUB_ORPHANED]:
                self.TABLE.apply(self, pub, event, ctx, error=RemoteProtocolError)
            return
        self.TABLE.apply(self, found, event, ctx, error=RemoteProtocolError)

    def _fx_count_duplicate(self, _pub: None, _ctx: PubReply) -> None:
        """A reply for a publication answered already (or superseded by a replay)."""
        self.state.stats.duplicate_replies += 1

    def _fx_count_stale(self, _pub: None, _ctx: PubReply) -> None:
        """A reply for a publication that ended without one."""
        self.state.stats.stale_replies += 1

    # The publication machine's other effects: (pub, ctx), ``ctx.one`` / ``ctx.last`` the
    # gate inputs by which ending it now counts it off its gates.

    def _fx_release_held(self, pub: Pub, ctx: PubEnd) -> None:
        """Held or orphaned: its requests ended already; now its storage is free too."""
        self.end_pub(pub, ctx.one, ctx.last)

    def _fx_requeue(self, pub: Pub, ctx: PubAt) -> None:
        """The Decode lost our handshake, read nothing: replay after a new handshake."""
        self._forget_seq(pub)
        conn_fx = self.conn_fx
        conn_fx.TABLE.apply(conn_fx, pub.conn, C_RECV_UNKNOWN_SESSION, ConnAt(ctx.now, pub))

    def _fx_done(self, pub: Pub, ctx: PubReply) -> None:
        conn = pub.conn
        state = self.state
        state.out.append(LayerReplied(conn.name, pub.layer_idx, ctx.now - pub.sent_at, True))
        failed = ctx.failed
        isolated = {f.ext_req_id: f for f in failed} if failed else {}
        if isolated:
            state.stats.isolated_failures += len(isolated)
        self.fail_requests(pub, R_RECV_FAILURE, ErrorCode.UNKNOWN, "", isolated)
        self.end_pub(pub, ctx.one, ctx.last)

    def _fx_fail(self, pub: Pub, ctx: PubReply) -> None:
        conn, now, read_failed = pub.conn, ctx.now, ctx.read_failed
        assert read_failed is not None  # RECV_FAILED and RECV_UNKNOWN_SESSION carry it
        state = self.state
        state.out.append(LayerReplied(conn.name, pub.layer_idx, now - pub.sent_at, False))
        state.stats.read_failures += 1
        code = _error_code(read_failed.code, ErrorCode.TRANSFER_FAILED)
        message = read_failed.error or f"read failed ({code.name})"
        self.fail_requests(
            pub,
            R_RECV_FAILURE,
            code,
            f"layer {pub.layer_idx} read by {conn.name} failed: {message}",
            {},
        )
        if ctx.event == P_RECV_UNKNOWN_SESSION:
            # The replay met an unknown session too: hand-shake again for later layers.
            conn_fx = self.conn_fx
            conn_fx.TABLE.apply(conn_fx, conn, C_RECV_UNKNOWN_SESSION, ConnAt(now, None))
        self.end_pub(pub, ctx.one, ctx.last)

    def _fx_release(self, pub: Pub, ctx: PubRelease) -> None:
        """Never left (the handshake failed): nothing can read it, the gates reopen."""
        self.fail_requests(pub, R_LOCAL_FAILURE, ctx.code, ctx.message, {})
        self.end_pub(pub, ctx.one, ctx.last)

    def fail_requests(
        self,
        pub: Pub,
        event: Input[ReqFailure],
        code: ErrorCode,
        message: str,
        only: dict[str, FailedRequest],
    ) -> None:
        """Record a failure on the publication's requests (all of them, or ``only``).

        ``only`` empty and ``message`` empty means nothing failed.
        """
        failed_any = False
        fail = self.req_fx.fail
        if only:
            for req in pub.requests:
                entry = only.get(req.ext_id)
                if entry is not None:
                    failed_any = True
                    fail(
                        req,
                        event,
                        _error_code(entry.code, ErrorCode.UNKNOWN),
                        f"layer {pub.layer_idx}: Decode {pub.conn.name} could not serve it: "
                        f"{entry.message or _error_code(entry.code, ErrorCode.UNKNOWN).name}",
                    )
        elif message:
            failed_any = True
            for req in pub.requests:
                fail(req, event, code, message)
        state = self.state
        if failed_any and state.config.read_failure_policy == "raise":
            reason = message or f"requests failed on {pub.conn.name}"
            for s in pub.slots:
                state.pending_raise.setdefault(s, reason)

    def end_pub(self, pub: Pub, one: Input[int], last: Input[int]) -> None:
        """A publication ended: count it off its gates, then off its requests."""
        self._forget_seq(pub)
        state = self.state
        del state.pubs[pub.uid]
        gates = state.gates
        gate_fx = self.gate_fx
        apply_gate = gate_fx.TABLE.apply
        for s in pub.slots:
            gate = gates[s]
            gate.outstanding -= 1
            apply_gate(gate_fx, gate, one if gate.outstanding else last, s)
        self.drain_pub(pub)

    def drain_pub(self, pub: Pub) -> None:
        """Count an ended (or held) publication off its requests, which may finish now."""
        requests, pub.requests = pub.requests, ()
        pub.read_reqs, pub.done_ids = [], []
        maybe_drain = self.req_fx.maybe_drain
        for req in requests:
            req.outstanding -= 1
            maybe_drain(req)


class GateEffects(Effects):
    """Effects of :data:`~rd2h_protocol.machines.producer.STORAGE_GATE`: (gate, slot)."""

    __slots__ = ()

    TABLE: ClassVar[BoundMachine]

    def _fx_reopen(self, _gate: Gate, slot: int) -> None:
        self.state.out.append(GateOpened(slot))


def lease_ms_left(pub: Pub, now: float) -> int:
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


PublicationEffects.TABLE = LAYER_PUBLICATION.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_SEND: PublicationEffects._fx_send,
        EFFECT_REPLAY: PublicationEffects._fx_replay,
        EFFECT_RESEND: PublicationEffects._fx_resend,
        EFFECT_DONE: PublicationEffects._fx_done,
        EFFECT_FAIL: PublicationEffects._fx_fail,
        EFFECT_REQUEUE: PublicationEffects._fx_requeue,
        EFFECT_RELEASE: PublicationEffects._fx_release,
        EFFECT_RELEASE_HELD: PublicationEffects._fx_release_held,
        EFFECT_COUNT_DUPLICATE: PublicationEffects._fx_count_duplicate,
        EFFECT_COUNT_STALE: PublicationEffects._fx_count_stale,
        EFFECT_LEASE_RAN_OUT: leases.fx_lease_ran_out,
        EFFECT_EXPIRE_ABORT: leases.fx_expire_abort,
        EFFECT_EXPIRE_UNSENT: leases.fx_expire_unsent,
        EFFECT_EXPIRE_UNTOLD: leases.fx_expire_untold,
        EFFECT_HOLD: leases.fx_hold,
        EFFECT_ORPHAN_LEASE_RAN_OUT: leases.fx_orphan_lease_ran_out,
        EFFECT_CHECK_SILENCE: dead_peers.fx_check_silence,
        EFFECT_ORPHAN: dead_peers.fx_orphan,
    }
)
GateEffects.TABLE = STORAGE_GATE.bind({NO_EFFECT: no_effect, EFFECT_REOPEN: GateEffects._fx_reopen})
