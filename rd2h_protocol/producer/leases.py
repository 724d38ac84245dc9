"""Leases that run out: ABORT, THEN reopen the storage; or hold it.

Toward a peer that can be told (and whose reads the lease bounds) the ABORT goes out
before the gates reopen. Toward one that cannot be told now, the publication is held:
its requests fail, its storage stays closed (see "Peers that cannot be told" in the
package docstring).

These are effects of the layer publication machine: functions of its effects object
(:class:`~.publications.PublicationEffects`, which binds them into its table).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

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
    R_LOCAL_FAILURE,
)
from rd2h_protocol.machines.producer_inputs import PubAt, PubExpiry
from rd2h_protocol.producer.records import Pub
from rd2h_protocol.wire.messages import CAP_ABORT, CAP_LEASE

if TYPE_CHECKING:
    from rd2h_protocol.producer.publications import PublicationEffects


def fx_lease_ran_out(fx: PublicationEffects, pub: Pub, ctx: PubAt) -> None:
    """A waiting or sent publication's lease ran out: resolve the lease guards into the
    input that says what happens. Order of outputs: ABORT, THEN reopened gates, then
    finished requests. Without an ABORT to send now the publication is held instead (or,
    under v1_lease_expiry="reopen" toward a peer that can never be told, reopened
    untold)."""
    state = fx.state
    conn = pub.conn
    state.stats.expired_leases += 1
    ids = [r.ext_id for r in pub.requests if not r.aborted_toward_peer]
    if pub.seq is None or (
        CAP_LEASE in conn.caps and (not ids or fx.conn_fx.abort_frees_storage(conn))
    ):
        # Never on the wire; or, toward a peer the lease bounds, every request told
        # already or the ABORT goes out now.
        event = P_TIMER_LEASE_EXPIRED
    elif CAP_ABORT in conn.caps or state.config.v1_lease_expiry == "hold":
        event = P_TIMER_LEASE_EXPIRED_UNTOLD
    else:
        event = P_TIMER_LEASE_EXPIRED_UNSAFE
    # (one / last: read by the orphaned row only, see fx_orphan_lease_ran_out)
    fx.TABLE.apply(
        fx, pub, event, PubExpiry(ctx.now, G_LOCAL_PEER_DEAD, G_LOCAL_LAST_PEER_DEAD, ids)
    )


def fx_orphan_lease_ran_out(fx: PublicationEffects, pub: Pub, ctx: PubAt) -> None:
    """The peer was declared dead before; now its lease has run out as well."""
    mark_expired(fx, pub)
    fx.TABLE.apply(
        fx,
        pub,
        P_TIMER_LEASE_EXPIRED,
        PubExpiry(ctx.now, G_LOCAL_PEER_DEAD, G_LOCAL_LAST_PEER_DEAD, []),
    )


def lease_message(fx: PublicationEffects, pub: Pub) -> str:
    """Why a publication's requests fail when its lease runs out."""
    return (
        f"layer {pub.layer_idx}: no reply from {pub.conn.name} within {fx.state.config.lease_ms} ms"
    )


# The lease effects: (fx, pub, ctx), ``ctx.ids`` the ids of its requests not told yet.


def fx_expire_unsent(fx: PublicationEffects, pub: Pub, ctx: PubAt) -> None:
    """Never sent (or refused unread): nothing can be reading it."""
    pub.conn.queue.remove(pub)
    message = lease_message(fx, pub)
    fx.fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
    fx.end_pub(pub, G_LOCAL_RELEASE, G_LOCAL_LAST_RELEASE)


def fx_expire_abort(fx: PublicationEffects, pub: Pub, ctx: PubExpiry) -> None:
    """ABORT, THEN the reopened gates, then the finished requests."""
    ids = ctx.ids
    if ids:
        fx.conn_fx.emit_abort(pub.conn, ids, f"lease of layer {pub.layer_idx} expired")
    message = lease_message(fx, pub)
    fx.fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
    mark_expired(fx, pub)
    fx.end_pub(pub, G_LOCAL_ABORT_SENT, G_LOCAL_LAST_ABORT_SENT)


def fx_expire_untold(fx: PublicationEffects, pub: Pub, ctx: PubAt) -> None:
    """UNSAFE (v1_lease_expiry="reopen"): reopen without telling the peer."""
    message = lease_message(fx, pub)
    fx.fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
    mark_expired(fx, pub)
    fx.state.stats.unsafe_reopens += 1
    fx.end_pub(pub, G_LOCAL_REOPEN_UNSAFE, G_LOCAL_LAST_REOPEN_UNSAFE)


def fx_hold(fx: PublicationEffects, pub: Pub, ctx: PubExpiry) -> None:
    """No ABORT can go out now: the requests fail, the gates stay closed."""
    now, ids = ctx.now, ctx.ids
    state = fx.state
    conn = pub.conn
    conn_fx = fx.conn_fx
    message = lease_message(fx, pub)
    fx.fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
    mark_expired(fx, pub)
    state.stats.held_leases += 1
    silence = state.config.silent_peer_timeout_s
    if silence is not None:
        pub.held_at = now
        heapq.heappush(state.timers, (now + silence, pub.uid))
    fx.drain_pub(pub)  # its requests end now; the gates wait
    if ids and conn_fx.can_abort_now(conn):
        # A peer without leases: told to stop, its storage waits for the reply.
        conn_fx.emit_abort(conn, ids, f"lease of layer {pub.layer_idx} expired")
    # Ask for that reply, which alone frees the storage: the readiness may never
    # have arrived (a peer with ``resend`` serves an unseen seq, now empty, and
    # answers one it saw, or one lost in a gap, from memory).
    fx.resend(conn, [pub], now)


def mark_expired(fx: PublicationEffects, pub: Pub) -> None:
    """Tell the publication's gates that its lease ran out (they stay closed)."""
    gates = fx.state.gates
    gate_fx = fx.gate_fx
    for s in pub.slots:
        gate_fx.TABLE.apply(gate_fx, gates[s], G_TIMER_LEASE_EXPIRED, s)
