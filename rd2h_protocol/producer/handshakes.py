"""The connection machine's effects: the handshake with each Decode endpoint.

MF_META out, ACK in (v2, v1 or a refusal with its backoff); publications and ABORTs wait
in the connection's queue while a handshake runs. Also where ABORTs go out
(:meth:`ConnectionEffects.emit_abort`), since whether one can depends on what was
negotiated.
"""

from __future__ import annotations

import heapq
from typing import ClassVar

import msgspec

from rd2h_protocol.errors import ErrorCode, RemoteProtocolError, TopologyError
from rd2h_protocol.events import Connect, Send
from rd2h_protocol.machines.declare import NO_EFFECT, BoundMachine, no_effect
from rd2h_protocol.machines.producer import (
    C_LOCAL_ABORT,
    C_LOCAL_ABORT_UNTOLD,
    C_LOCAL_PUBLISH,
    C_LOCAL_PUBLISH_BACKOFF,
    C_RECV_ACK_REFUSED,
    C_RECV_ACK_V1,
    C_RECV_ACK_V2,
    CONN_READY_V2,
    CONNECTION_HANDSHAKE,
    EFFECT_COUNT_STRAY_ACK,
    EFFECT_EMIT_ABORT,
    EFFECT_FAIL_QUEUED,
    EFFECT_FLUSH,
    EFFECT_QUEUE,
    EFFECT_QUEUE_ABORT,
    EFFECT_REFUSED,
    EFFECT_RELEASE,
    EFFECT_RESET,
    EFFECT_RETRY,
    EFFECT_SEND,
    EFFECT_SEND_META,
    G_LOCAL_LAST_RELEASE,
    G_LOCAL_RELEASE,
    P_LOCAL_LEASE_LAPSED,
    P_LOCAL_RELEASE,
    P_SEND_READINESS,
)
from rd2h_protocol.machines.producer_inputs import (
    ConnAbort,
    ConnAck,
    ConnAt,
    ConnEnd,
    PubAt,
    PubRelease,
)
from rd2h_protocol.producer.config import DecodeTarget
from rd2h_protocol.producer.records import Conn, Pub
from rd2h_protocol.producer.state import Effects
from rd2h_protocol.topology import decode_rank_port, map_prefill_rank
from rd2h_protocol.wire.messages import ALL_CAPABILITIES, CAP_ABORT, CAP_LEASE, Abort, Ack


class ConnectionEffects(Effects):
    """Effects of :data:`~rd2h_protocol.machines.producer.CONNECTION_HANDSHAKE`."""

    __slots__ = ()

    TABLE: ClassVar[BoundMachine]

    def conn_for(self, target: DecodeTarget) -> Conn:
        """The connection to ``target``'s Decode rank for this Prefill rank (made once)."""
        state = self.state
        config = state.config
        contributor = map_prefill_rank(config.p_rank, config.p_tp, target.d_tp)
        port = decode_rank_port(target.base_port, contributor.d_rank, target.d_tp)
        name = f"{target.host}:{port}"
        conn = state.conns.get(name)
        if conn is None:
            conn = Conn(name, target.host, port, target.d_tp, contributor)
            state.conns[name] = conn
        elif conn.d_tp != target.d_tp:
            raise TopologyError(
                f"Decode endpoint {name} was announced with TP size {conn.d_tp}, "
                f"now with {target.d_tp}"
            )
        return conn

    def send_abort(self, conn: Conn, ext_ids: list[str], reason: str) -> None:
        """ABORT toward a v2 peer that understands it; queued while a handshake runs.

        A v1 peer (or a connection that never started a handshake) cannot be told. A
        queued ABORT does not count as sent: a lease that runs out meanwhile is held. The
        table says which, by the connection's state.
        """
        if self.state.v1_only:
            return  # protocol v1 has no ABORT
        event = C_LOCAL_ABORT if CAP_ABORT in conn.caps else C_LOCAL_ABORT_UNTOLD
        self.TABLE.apply(self, conn, event, ConnAbort(ext_ids, reason))

    def _fx_emit_abort(self, conn: Conn, ctx: ConnAbort) -> None:
        self.emit_abort(conn, ctx.ext_ids, ctx.reason)

    def _fx_queue_abort(self, conn: Conn, ctx: ConnAbort) -> None:
        """A handshake runs: the ABORT waits for it (it is not sent yet)."""
        conn.pending_aborts.extend(ctx.ext_ids)

    def can_abort_now(self, conn: Conn) -> bool:
        """Whether an ABORT can go out to ``conn`` now (ready_v2, with ``abort``)."""
        return conn.state == CONN_READY_V2 and CAP_ABORT in conn.caps

    def abort_frees_storage(self, conn: Conn) -> bool:
        """Whether an ABORT sent now makes a lapsed publication's storage free: only toward
        a peer whose reads the lease bounds (it starts none with less than half of the
        lease left and ends each by the deadline). A peer without ``lease`` may start a
        read it was sent long ago at any time: its storage waits for the reply."""
        return self.can_abort_now(conn) and CAP_LEASE in conn.caps

    def emit_abort(self, conn: Conn, ext_ids: list[str], reason: str) -> None:
        """An ABORT out on ``conn`` now; the requests it names know they were told."""
        state = self.state
        state.out.append(Send(conn.name, Abort(ext_ids=list(ext_ids), reason=reason)))
        state.stats.aborts_sent += 1
        requests = state.requests
        for ext_id in ext_ids:
            req = requests.get(ext_id)
            if req is not None:  # a held lease's requests are finished already
                req.aborted_toward_peer = True

    def _start_handshake(self, conn: Conn, now: float) -> None:
        state = self.state
        out = state.out
        if not conn.connected or conn.reconnect:
            conn.connected, conn.reconnect = True, False
            out.append(Connect(conn.name, conn.host, conn.port))
        meta = state.meta
        if meta.protocol_version is not None:
            # Readiness seqs are consecutive per connection; say where they resume.
            meta = msgspec.structs.replace(meta, first_seq=conn.next_seq)
        out.append(Send(conn.name, meta))
        state.stats.handshakes += 1
        token = state.uid()
        conn.handshake_token = token
        state.handshakes[token] = conn
        heapq.heappush(state.timers, (now + state.config.handshake_timeout_s, token))

    def _end_handshake(self, conn: Conn) -> None:
        self.state.handshakes.pop(conn.handshake_token, None)

    def on_ack(self, conn: Conn, ack: Ack, now: float) -> None:
        """The peer answered a handshake (or sent a stray ACK)."""
        if not ack.is_v1 and ack.error_code:
            event = C_RECV_ACK_REFUSED
        elif ack.is_v1 or self.state.v1_only:
            event = C_RECV_ACK_V1
        else:
            event = C_RECV_ACK_V2
        self.TABLE.apply(self, conn, event, ConnAck(now, None, ack), error=RemoteProtocolError)

    def _fx_count_stray_ack(self, conn: Conn, _ctx: ConnAck) -> None:
        """An ACK no handshake waits for (a duplicate, or after a timeout): counted."""
        self.state.stats.dropped += 1

    def _fx_refused(self, conn: Conn, ctx: ConnAck) -> None:
        """Refused: back off (doubling per refusal), fail the readiness queued for it."""
        now, ack = ctx.now, ctx.ack
        self._end_handshake(conn)
        self.state.stats.handshakes_refused += 1
        conn.caps = frozenset()
        cfg = self.state.config
        conn.refusals += 1
        backoff = min(
            cfg.refused_retry_s * 2.0 ** min(conn.refusals - 1, 32), cfg.refused_retry_max_s
        )
        conn.retry_at = now + backoff
        conn.refusal = (
            f"Decode endpoint {conn.name} refused the handshake "
            f"(code {ack.error_code}): {ack.error or 'no reason given'}"
        )
        self.fail_queued(conn, ErrorCode.INCOMPATIBLE, conn.refusal)

    def _fx_flush(self, conn: Conn, ctx: ConnAck) -> None:
        """Ready: send the readiness queued for the handshake, then the ABORTs."""
        now, ack = ctx.now, ctx.ack
        self._end_handshake(conn)
        conn.refusals = 0
        if conn.state == CONN_READY_V2:
            conn.caps = frozenset(ack.capabilities or ()) & frozenset(ALL_CAPABILITIES)
        else:
            conn.caps = frozenset()
        # A publication whose lease ran out while the handshake ran is expired, not sent: it
        # would carry lease_ms 0, so the Decode could start reading it on arrival while our
        # lease timer, already due, reopens its storage for the next layer.
        pub_fx = self.pub_fx
        apply_pub = pub_fx.TABLE.apply
        at = PubAt(now)
        for pub in [p for p in conn.queue if int((p.deadline - now) * 1000) <= 0]:
            self.state.stats.expired_leases += 1
            apply_pub(pub_fx, pub, P_LOCAL_LEASE_LAPSED, at)
        queue, conn.queue = conn.queue, []
        for pub in queue:
            apply_pub(pub_fx, pub, P_SEND_READINESS, at)
        aborts, conn.pending_aborts = conn.pending_aborts, []
        if aborts and self.can_abort_now(conn):
            self.emit_abort(conn, aborts, "aborted by Prefill")

    def fail_queued(self, conn: Conn, code: ErrorCode, message: str) -> None:
        """Release the readiness that never left: nothing can read it, the gates reopen."""
        queue, conn.queue = conn.queue, []
        conn.pending_aborts = []
        # (release needs no time: 0.0 stands for ``now``)
        ctx = PubRelease(0.0, G_LOCAL_RELEASE, G_LOCAL_LAST_RELEASE, code, message)
        pub_fx = self.pub_fx
        for pub in queue:
            pub_fx.TABLE.apply(pub_fx, pub, P_LOCAL_RELEASE, ctx)

    def _fx_fail_queued(self, conn: Conn, ctx: ConnEnd) -> None:
        """The handshake timed out: release the readiness queued for it."""
        self.fail_queued(conn, ErrorCode.TIMEOUT, ctx.message)

    def _fx_reset(self, c: Conn, ctx: ConnEnd) -> None:
        """Forget the handshake (the peer that comes back is a new process), fail what
        waited for it."""
        self._end_handshake(c)
        c.refusals, c.retry_at, c.refusal = 0, 0.0, ""
        c.reconnect = c.connected
        self.fail_queued(c, ErrorCode.CONNECTION_LOST, ctx.message)

    def publish(self, pub: Pub, now: float) -> None:
        """Hand a new publication to its connection: sent, queued, or failed at once."""
        conn = pub.conn
        # (retry_at is in the future only while a refusal's backoff runs)
        event = C_LOCAL_PUBLISH_BACKOFF if now < conn.retry_at else C_LOCAL_PUBLISH
        self.TABLE.apply(self, conn, event, ConnAt(now, pub))

    # The connection machine's publish effects: (conn, ctx), ``ctx.pub`` or None.

    def _fx_conn_send(self, conn: Conn, ctx: ConnAt) -> None:
        pub = ctx.pub
        assert pub is not None  # LOCAL_PUBLISH names its publication
        pub_fx = self.pub_fx
        pub_fx.TABLE.apply(pub_fx, pub, P_SEND_READINESS, PubAt(ctx.now))

    def _fx_conn_release(self, conn: Conn, ctx: ConnAt) -> None:
        """Refused, backoff running: nothing will be read, fail it at once."""
        pub, now = ctx.pub, ctx.now
        assert pub is not None  # LOCAL_PUBLISH_BACKOFF names its publication
        conn.queue.append(pub)
        self.fail_queued(
            conn,
            ErrorCode.INCOMPATIBLE,
            f"{conn.refusal}; next handshake attempt in {conn.retry_at - now:.1f} s",
        )

    def _fx_send_meta(self, conn: Conn, ctx: ConnAt) -> None:
        """Start a handshake; the publication (if any) waits for it in this queue."""
        self._start_handshake(conn, ctx.now)
        pub = ctx.pub
        if pub is not None:
            conn.queue.append(pub)

    def _fx_retry(self, conn: Conn, ctx: ConnAt) -> None:
        """A refused or timed-out connection tries again: a fresh handshake, counted."""
        self.state.stats.handshake_retries += 1
        self._fx_send_meta(conn, ctx)

    def _fx_queue(self, conn: Conn, ctx: ConnAt) -> None:
        """A handshake runs: the publication (if any) waits for it in this queue."""
        pub = ctx.pub
        if pub is not None:
            conn.queue.append(pub)


ConnectionEffects.TABLE = CONNECTION_HANDSHAKE.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_SEND_META: ConnectionEffects._fx_send_meta,
        EFFECT_RETRY: ConnectionEffects._fx_retry,
        EFFECT_QUEUE: ConnectionEffects._fx_queue,
        EFFECT_SEND: ConnectionEffects._fx_conn_send,
        EFFECT_RELEASE: ConnectionEffects._fx_conn_release,
        EFFECT_FLUSH: ConnectionEffects._fx_flush,
        EFFECT_REFUSED: ConnectionEffects._fx_refused,
        EFFECT_FAIL_QUEUED: ConnectionEffects._fx_fail_queued,
        EFFECT_RESET: ConnectionEffects._fx_reset,
        EFFECT_COUNT_STRAY_ACK: ConnectionEffects._fx_count_stray_ack,
        EFFECT_EMIT_ABORT: ConnectionEffects._fx_emit_abort,
        EFFECT_QUEUE_ABORT: ConnectionEffects._fx_queue_abort,
    }
)
