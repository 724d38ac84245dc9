"""The connection machine's effects: the handshake with each Decode endpoint.

MF_META out, ACK in (v2, v1 or a refusal with its backoff); publications and ABORTs wait
in the connection's queue while a handshake runs. Also where ABORTs go out
(:meth:`_Handshakes._emit_abort`), since whether one can depends on what was negotiated,
and where held publications get the ABORT they wait for once a handshake ends
(:meth:`_Handshakes._settle_held`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import msgspec

from rd2h_protocol.errors import ErrorCode, RemoteProtocolError, TopologyError
from rd2h_protocol.events import Connect, Send
from rd2h_protocol.machines.producer import (
    C_LOCAL_HELD_ABORTS,
    C_LOCAL_PUBLISH,
    C_LOCAL_PUBLISH_RETRY,
    C_RECV_ACK_REFUSED,
    C_RECV_ACK_V1,
    C_RECV_ACK_V2,
    CONN_HANDSHAKING,
    CONN_IDLE,
    CONN_READY_V2,
    CONN_REFUSED,
    G_LOCAL_ABORT_SENT,
    G_LOCAL_LAST_ABORT_SENT,
    G_LOCAL_LAST_RELEASE,
    G_LOCAL_LAST_REOPEN_UNSAFE,
    G_LOCAL_RELEASE,
    G_LOCAL_REOPEN_UNSAFE,
    P_LOCAL_ABORT_SENT,
    P_LOCAL_LEASE_LAPSED,
    P_LOCAL_RELEASE,
    P_LOCAL_REOPEN_UNSAFE,
    P_SEND_READINESS,
    PUB_HELD,
)
from rd2h_protocol.machines.producer_inputs import (
    ConnAck,
    ConnAt,
    ConnEnd,
    PubAt,
    PubEnd,
    PubRelease,
)
from rd2h_protocol.producer.config import DecodeTarget, Output
from rd2h_protocol.producer.records import _Conn, _Pub
from rd2h_protocol.producer.state import _ProducerState
from rd2h_protocol.topology import decode_rank_port, map_prefill_rank
from rd2h_protocol.wire.messages import ALL_CAPABILITIES, CAP_ABORT, CAP_LEASE, Abort, Ack


class _Handshakes(_ProducerState):
    """Effects of :data:`~rd2h_protocol.machines.producer.CONNECTION_HANDSHAKE`."""

    def _conn_for(self, target: DecodeTarget) -> _Conn:
        contributor = map_prefill_rank(self.config.p_rank, self.config.p_tp, target.d_tp)
        port = decode_rank_port(target.base_port, contributor.d_rank, target.d_tp)
        name = f"{target.host}:{port}"
        conn = self._conns.get(name)
        if conn is None:
            conn = _Conn(name, target.host, port, target.d_tp, contributor)
            self._conns[name] = conn
        elif conn.d_tp != target.d_tp:
            raise TopologyError(
                f"Decode endpoint {name} was announced with TP size {conn.d_tp}, "
                f"now with {target.d_tp}"
            )
        return conn

    def _send_abort(self, conn: _Conn, ext_ids: list[str], reason: str, out: list[Output]) -> None:
        """ABORT toward a v2 peer that understands it; queued while a handshake runs.

        A v1 peer (or a connection that never started a handshake) cannot be told. A
        queued ABORT does not count as sent: a lease that runs out meanwhile is held.
        """
        if self._can_abort_now(conn):
            self._emit_abort(conn, ext_ids, reason, out)
        elif conn.state == CONN_HANDSHAKING and not self._v1_only:
            conn.pending_aborts.extend(ext_ids)

    def _can_abort_now(self, conn: _Conn) -> bool:
        return conn.state == CONN_READY_V2 and CAP_ABORT in conn.caps

    def _abort_frees_storage(self, conn: _Conn) -> bool:
        """Whether an ABORT sent now makes a lapsed publication's storage free: only toward
        a peer whose reads the lease bounds (it starts none with less than half of the
        lease left and ends each by the deadline). A peer without ``lease`` may start a
        read it was sent long ago at any time: its storage waits for the reply."""
        return self._can_abort_now(conn) and CAP_LEASE in conn.caps

    def _emit_abort(self, conn: _Conn, ext_ids: list[str], reason: str, out: list[Output]) -> None:
        out.append(Send(conn.name, Abort(ext_ids=list(ext_ids), reason=reason)))
        self.stats.aborts_sent += 1
        for ext_id in ext_ids:
            req = self._requests.get(ext_id)
            if req is not None:  # a held lease's requests are finished already
                req.aborted_toward_peer = True

    def _start_handshake(self, conn: _Conn, now: float, out: list[Output]) -> None:
        if not conn.connected or conn.reconnect:
            conn.connected, conn.reconnect = True, False
            out.append(Connect(conn.name, conn.host, conn.port))
        meta = self._meta
        if meta.protocol_version is not None:
            # Readiness seqs are consecutive per connection; say where they resume.
            meta = msgspec.structs.replace(meta, first_seq=conn.next_seq)
        out.append(Send(conn.name, meta))
        self.stats.handshakes += 1
        token = self._uid()
        conn.handshake_token = token
        self._handshakes[token] = conn
        heapq.heappush(self._timers, (now + self.config.handshake_timeout_s, token))

    def _end_handshake(self, conn: _Conn) -> None:
        self._handshakes.pop(conn.handshake_token, None)

    def _on_ack(self, conn: _Conn, ack: Ack, now: float, out: list[Output]) -> None:
        if not ack.is_v1 and ack.error_code:
            event = C_RECV_ACK_REFUSED
        elif ack.is_v1 or self._v1_only:
            event = C_RECV_ACK_V1
        else:
            event = C_RECV_ACK_V2
        self._CONN.apply(self, conn, event, ConnAck(now, out, None, ack), error=RemoteProtocolError)

    def _fx_count_stray_ack(self, conn: _Conn, _ctx: ConnAck) -> None:
        """An ACK no handshake waits for (a duplicate, or after a timeout): counted."""
        self.stats.dropped += 1

    def _fx_refused(self, conn: _Conn, ctx: ConnAck) -> None:
        """Refused: back off (doubling per refusal), fail the readiness queued for it."""
        now, out, ack = ctx.now, ctx.out, ctx.ack
        self._end_handshake(conn)
        self.stats.handshakes_refused += 1
        conn.caps = frozenset()
        cfg = self.config
        conn.refusals += 1
        backoff = min(
            cfg.refused_retry_s * 2.0 ** min(conn.refusals - 1, 32), cfg.refused_retry_max_s
        )
        conn.retry_at = now + backoff
        conn.refusal = (
            f"Decode endpoint {conn.name} refused the handshake "
            f"(code {ack.error_code}): {ack.error or 'no reason given'}"
        )
        self._fail_queued(conn, ErrorCode.INCOMPATIBLE, conn.refusal, out)
        self._settle_held(conn, now, out)

    def _fx_flush(self, conn: _Conn, ctx: ConnAck) -> None:
        """Ready: send the readiness queued for the handshake, then the ABORTs."""
        now, out, ack = ctx.now, ctx.out, ctx.ack
        self._end_handshake(conn)
        conn.refusals = 0
        if conn.state == CONN_READY_V2:
            conn.caps = frozenset(ack.capabilities or ()) & frozenset(ALL_CAPABILITIES)
        else:
            conn.caps = frozenset()
        # A publication whose lease ran out while the handshake ran is expired, not sent: it
        # would carry lease_ms 0, so the Decode could start reading it on arrival while our
        # lease timer, already due, reopens its storage for the next layer.
        for pub in [p for p in conn.queue if int((p.deadline - now) * 1000) <= 0]:
            self.stats.expired_leases += 1
            self._PUB.apply(self, pub, P_LOCAL_LEASE_LAPSED, PubAt(now, out))
        queue, conn.queue = conn.queue, []
        for pub in queue:
            self._send(pub, now, out)
        aborts, conn.pending_aborts = conn.pending_aborts, []
        if aborts and self._can_abort_now(conn):
            self._emit_abort(conn, aborts, "aborted by Prefill", out)
        self._settle_held(conn, now, out, told=aborts)

    def _settle_held(
        self, conn: _Conn, now: float, out: list[Output], told: Iterable[str] = ()
    ) -> None:
        """A handshake ended: deliver the ABORTs held publications wait for, if we can.

        Toward a peer that can be told now, the ABORT goes out, THEN their gates reopen.
        Otherwise, under "reopen", they reopen untold (unsafe); under "hold" they stay, and
        a connection left idle by a timeout tries a new handshake at once (the ABORT is the
        only way out short of a reply or the peer's declared death). ``told``: ids an ABORT
        emitted by this same handshake named already.
        """
        held = [p for p in conn.sent.values() if p.state == PUB_HELD and p.abort_ids]
        if not held:
            return
        if self._can_abort_now(conn) and not self._abort_frees_storage(conn):
            # A peer without leases: told to stop, the storage waits for its replies.
            ids = [i for p in held for i in p.abort_ids if i not in set(told)]
            for p in held:
                p.abort_ids = []
            if ids:
                self._emit_abort(conn, list(dict.fromkeys(ids)), "lease expired", out)
            return
        if self._can_abort_now(conn):
            skip = set(told)
            ids = [i for p in held for i in p.abort_ids if i not in skip]
            if ids:
                reason = "lease expired while the handshake ran"
                self._emit_abort(conn, list(dict.fromkeys(ids)), reason, out)
            event, one, last = P_LOCAL_ABORT_SENT, G_LOCAL_ABORT_SENT, G_LOCAL_LAST_ABORT_SENT
        elif self.config.v1_lease_expiry == "reopen":
            self.stats.unsafe_reopens += len(held)
            event, one, last = (
                P_LOCAL_REOPEN_UNSAFE,
                G_LOCAL_REOPEN_UNSAFE,
                G_LOCAL_LAST_REOPEN_UNSAFE,
            )
        else:
            self._retry_for_held_aborts(conn, now, out)
            return
        ctx = PubEnd(now, out, one, last)
        for pub in held:
            self._PUB.apply(self, pub, event, ctx)

    def _retry_for_held_aborts(self, conn: _Conn, now: float, out: list[Output]) -> None:
        """Start a handshake for held ABORTs on an idle connection whose peer can take them."""
        if conn.state == CONN_IDLE and CAP_ABORT in conn.caps:
            self.stats.handshake_retries += 1
            self._CONN.apply(self, conn, C_LOCAL_HELD_ABORTS, ConnAt(now, out, None))

    def _fail_queued(self, conn: _Conn, code: ErrorCode, message: str, out: list[Output]) -> None:
        """Release the readiness that never left: nothing can read it, the gates reopen."""
        queue, conn.queue = conn.queue, []
        conn.pending_aborts = []
        # (release needs no time: 0.0 stands for ``now``)
        ctx = PubRelease(0.0, out, G_LOCAL_RELEASE, G_LOCAL_LAST_RELEASE, code, message)
        for pub in queue:
            self._PUB.apply(self, pub, P_LOCAL_RELEASE, ctx)

    def _fx_fail_queued(self, conn: _Conn, ctx: ConnEnd) -> None:
        """The handshake timed out: release the readiness queued for it."""
        self._fail_queued(conn, ErrorCode.TIMEOUT, ctx.message, ctx.out)
        self._settle_held(conn, ctx.now, ctx.out)

    def _fx_reset(self, c: _Conn, ctx: ConnEnd) -> None:
        """Forget the handshake (the peer that comes back is a new process), fail what
        waited for it."""
        self._end_handshake(c)
        c.refusals, c.retry_at, c.refusal = 0, 0.0, ""
        c.reconnect = c.connected
        self._fail_queued(c, ErrorCode.CONNECTION_LOST, ctx.message, ctx.out)

    def _conn_publish(self, pub: _Pub, now: float, out: list[Output]) -> None:
        conn = pub.conn
        event = C_LOCAL_PUBLISH
        if conn.state == CONN_REFUSED and now >= conn.retry_at:
            event = C_LOCAL_PUBLISH_RETRY  # the backoff has passed: try a fresh MF_META
            self.stats.handshake_retries += 1
        self._CONN.apply(self, conn, event, ConnAt(now, out, pub))

    # The connection machine's publish effects: (conn, ctx), ``ctx.pub`` or None.

    def _fx_conn_send(self, conn: _Conn, ctx: ConnAt) -> None:
        assert ctx.pub is not None  # LOCAL_PUBLISH names its publication
        self._send(ctx.pub, ctx.now, ctx.out)

    def _fx_conn_release(self, conn: _Conn, ctx: ConnAt) -> None:
        """Refused, backoff running: nothing will be read, fail it at once."""
        pub, now, out = ctx.pub, ctx.now, ctx.out
        assert pub is not None  # LOCAL_PUBLISH names its publication
        conn.queue.append(pub)
        self._fail_queued(
            conn,
            ErrorCode.INCOMPATIBLE,
            f"{conn.refusal}; next handshake attempt in {conn.retry_at - now:.1f} s",
            out,
        )

    def _fx_send_meta(self, conn: _Conn, ctx: ConnAt) -> None:
        """Start a handshake; the publication (if any) waits for it in this queue."""
        self._start_handshake(conn, ctx.now, ctx.out)
        pub = ctx.pub
        if pub is not None:
            conn.queue.append(pub)

    def _fx_queue(self, conn: _Conn, ctx: ConnAt) -> None:
        """A handshake runs: the publication (if any) waits for it in this queue."""
        pub = ctx.pub
        if pub is not None:
            conn.queue.append(pub)

    def _send(self, pub: _Pub, now: float, out: list[Output]) -> None:
        """Put a publication on the wire (first time or replay) with a fresh seq."""
        self._PUB.apply(self, pub, P_SEND_READINESS, PubAt(now, out))
