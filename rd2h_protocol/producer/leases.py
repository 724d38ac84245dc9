"""Leases that run out: ABORT, THEN reopen the storage; or hold it.

Toward a peer that can be told (and whose reads the lease bounds) the ABORT goes out
before the gates reopen. Toward one that cannot be told now, the publication is held:
its requests fail, its storage stays closed (see "Peers that cannot be told" in the
package docstring).
"""

from __future__ import annotations

import heapq

from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.machines.producer import (
    G_LOCAL_ABORT_SENT,
    G_LOCAL_LAST_ABORT_SENT,
    G_LOCAL_LAST_PEER_DEAD,
    G_LOCAL_LAST_RELEASE,
    G_LOCAL_LAST_REOPEN_UNSAFE,
    G_LOCAL_PEER_DEAD,
    G_LOCAL_RELEASE,
    G_LOCAL_REOPEN_UNSAFE,
    G_TIMER_LEASE_EXPIRED,
    P_TIMER_LEASE_EXPIRED,
    P_TIMER_LEASE_EXPIRED_UNSAFE,
    P_TIMER_LEASE_EXPIRED_UNTOLD,
    PUB_HELD,
    PUB_ORPHANED,
    R_LOCAL_FAILURE,
)
from rd2h_protocol.machines.producer_inputs import PubAt, PubExpiry
from rd2h_protocol.producer.config import Output
from rd2h_protocol.producer.dead_peers import _DeadPeers
from rd2h_protocol.producer.records import _Pub
from rd2h_protocol.wire.messages import CAP_ABORT, CAP_LEASE


class _Leases(_DeadPeers):
    """The lease effects of :data:`~rd2h_protocol.machines.producer.LAYER_PUBLICATION`."""

    def _expire(self, pub: _Pub, now: float, out: list[Output]) -> None:
        """A lease ran out. Order of outputs: ABORT, THEN reopened gates, then finished
        requests. Without an ABORT to send now the publication is held instead (or, under
        v1_lease_expiry="reopen" toward a peer that can never be told, reopened untold)."""
        conn = pub.conn
        if pub.state == PUB_HELD:  # held, and silent_peer_timeout_s has passed since
            self._check_silence(pub, now, out)
            return
        if pub.state == PUB_ORPHANED:
            # The peer was declared dead before; now its lease has run out as well.
            self._mark_expired(pub)
            self._PUB.apply(
                self,
                pub,
                P_TIMER_LEASE_EXPIRED,
                PubExpiry(now, out, G_LOCAL_PEER_DEAD, G_LOCAL_LAST_PEER_DEAD, []),
            )
            return
        self.stats.expired_leases += 1
        ids = [r.ext_id for r in pub.requests if not r.aborted_toward_peer]
        if pub.seq is None or (
            CAP_LEASE in conn.caps and (not ids or self._abort_frees_storage(conn))
        ):
            # Never on the wire; or, toward a peer the lease bounds, every request told
            # already or the ABORT goes out now.
            event = P_TIMER_LEASE_EXPIRED
        elif CAP_ABORT in conn.caps or self.config.v1_lease_expiry == "hold":
            event = P_TIMER_LEASE_EXPIRED_UNTOLD
        else:
            event = P_TIMER_LEASE_EXPIRED_UNSAFE
        # (one / last: read by the orphaned row only, handled above)
        self._PUB.apply(
            self, pub, event, PubExpiry(now, out, G_LOCAL_PEER_DEAD, G_LOCAL_LAST_PEER_DEAD, ids)
        )

    def _lease_message(self, pub: _Pub) -> str:
        return (
            f"layer {pub.layer_idx}: no reply from {pub.conn.name} within {self.config.lease_ms} ms"
        )

    # The lease effects: (pub, ctx), ``ctx.ids`` the ids of its requests not told yet.

    def _fx_expire_unsent(self, pub: _Pub, ctx: PubAt) -> None:
        """Never sent (or refused unread): nothing can be reading it."""
        pub.conn.queue.remove(pub)
        message = self._lease_message(pub)
        self._fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
        self._end_pub(pub, ctx.out, G_LOCAL_RELEASE, G_LOCAL_LAST_RELEASE)

    def _fx_expire_abort(self, pub: _Pub, ctx: PubExpiry) -> None:
        """ABORT, THEN the reopened gates, then the finished requests."""
        ids, out = ctx.ids, ctx.out
        if ids:
            self._emit_abort(pub.conn, ids, f"lease of layer {pub.layer_idx} expired", out)
        message = self._lease_message(pub)
        self._fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
        self._mark_expired(pub)
        self._end_pub(pub, out, G_LOCAL_ABORT_SENT, G_LOCAL_LAST_ABORT_SENT)

    def _fx_expire_untold(self, pub: _Pub, ctx: PubAt) -> None:
        """UNSAFE (v1_lease_expiry="reopen"): reopen without telling the peer."""
        out = ctx.out
        message = self._lease_message(pub)
        self._fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
        self._mark_expired(pub)
        self.stats.unsafe_reopens += 1
        self._end_pub(pub, out, G_LOCAL_REOPEN_UNSAFE, G_LOCAL_LAST_REOPEN_UNSAFE)

    def _fx_hold(self, pub: _Pub, ctx: PubExpiry) -> None:
        """No ABORT can go out now: the requests fail, the gates stay closed."""
        now, out, ids = ctx.now, ctx.out, ctx.ids
        conn = pub.conn
        message = self._lease_message(pub)
        self._fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
        self._mark_expired(pub)
        self.stats.held_leases += 1
        if self.config.silent_peer_timeout_s is not None:
            pub.held_at = now
            heapq.heappush(self._timers, (now + self.config.silent_peer_timeout_s, pub.uid))
        self._drain_pub(pub, out)  # its requests end now; the gates wait
        if self._can_abort_now(conn) or (CAP_ABORT in conn.caps and not ids):
            # A peer without leases: told to stop, its storage waits for the reply.
            if ids:
                self._emit_abort(conn, ids, f"lease of layer {pub.layer_idx} expired", out)
        else:
            pub.abort_ids = ids
            self._retry_for_held_aborts(conn, now, out)
        # Ask for that reply, which alone frees the storage: the readiness may never
        # have arrived (a peer with ``resend`` serves an unseen seq, now empty, and
        # answers one it saw, or one lost in a gap, from memory).
        self._resend(conn, [pub], now, out)

    def _mark_expired(self, pub: _Pub) -> None:
        """Tell the publication's gates that its lease ran out (they stay closed)."""
        for s in pub.slots:
            gate = self._gates[s]
            self._GATE.fire(self, gate, G_TIMER_LEASE_EXPIRED, s, None)
