"""Decode endpoints declared dead (by the runtime's heartbeat, or by their silence while
they hold storage), and connections that broke and came back.

See "Dead peers" in the package docstring for why a dead peer's storage still waits for
the lease. Functions of the layer publication machine's effects object
(:class:`~.publications.PublicationEffects`): two of them are its effects (bound into its
table there), the others serve the endpoint's ``connection_lost`` and
``connection_resumed``.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.events import Disconnect
from rd2h_protocol.machines.producer import (
    C_LOCAL_CONNECTION_LOST,
    G_LOCAL_LAST_PEER_DEAD,
    G_LOCAL_PEER_DEAD,
    P_LOCAL_CONNECTION_LOST,
    PUB_HELD,
    R_LOCAL_FAILURE,
)
from rd2h_protocol.machines.producer_inputs import ConnEnd, PubAt, PubLost
from rd2h_protocol.producer.records import Conn, Pub

if TYPE_CHECKING:
    from rd2h_protocol.producer.publications import PublicationEffects


def lose_connection(fx: PublicationEffects, c: Conn, now: float) -> None:
    """Decode endpoint ``c`` is dead: what :meth:`~.endpoint.ProducerEndpoint.connection_lost`
    says, its outputs appended to the state's."""
    state = fx.state
    out = state.out
    conn_fx = fx.conn_fx
    state.stats.connections_lost += 1
    message = f"the connection to Decode endpoint {c.name} was lost"
    orphans: list[Pub] = []
    # Held ones (lease ran out AND the peer is dead) end as they are met; what their
    # gates say goes out after the orphans' ABORT.
    mark = len(out)
    lost = PubLost(now, G_LOCAL_PEER_DEAD, G_LOCAL_LAST_PEER_DEAD, orphans)
    for pub in list(c.sent.values()):
        fx.TABLE.apply(fx, pub, P_LOCAL_CONNECTION_LOST, lost)
    reopened = out[mark:]
    del out[mark:]
    if orphans and conn_fx.can_abort_now(c):
        ids = [r.ext_id for p in orphans for r in p.requests if not r.aborted_toward_peer]
        if ids:
            conn_fx.emit_abort(c, list(dict.fromkeys(ids)), "Prefill lost the connection")
    for pub in orphans:
        fx.fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.CONNECTION_LOST, message, {})
    out.extend(reopened)
    for pub in orphans:  # the requests end now, the gates at the lease
        fx.drain_pub(pub)
    conn_fx.TABLE.apply(conn_fx, c, C_LOCAL_CONNECTION_LOST, ConnEnd(now, None, message))


def fx_orphan(_fx: PublicationEffects, pub: Pub, ctx: PubLost) -> None:
    """Peer dead, lease still running: its requests fail now, its gates wait."""
    ctx.orphans.append(pub)


def resume_connection(fx: PublicationEffects, c: Conn, now: float) -> None:
    """What :meth:`~.endpoint.ProducerEndpoint.connection_resumed` says: every publication
    still waiting for its reply on ``c`` is sent again, where the table allows it."""
    fx.resend(c, list(c.sent.values()), now)


def fx_check_silence(fx: PublicationEffects, pub: Pub, ctx: PubAt) -> None:
    """A held publication's silence bound came: declare its peer dead if nothing at all
    came from it for that long (since it was held); else wait that long after its last
    frame (it answers, just not this one yet)."""
    now = ctx.now
    state = fx.state
    timeout = state.config.silent_peer_timeout_s
    assert timeout is not None  # the bound is armed only when set
    conn = pub.conn
    silent_since = max(conn.last_heard, pub.held_at)
    if now < silent_since + timeout:
        heapq.heappush(state.timers, (silent_since + timeout, pub.uid))
        return
    stats = state.stats
    stats.silent_peers += 1
    held = [p for p in conn.sent.values() if p.state == PUB_HELD]
    stats.silent_held_publications += len(held)
    stats.silent_held_s += sum(now - p.held_at for p in held)
    reason = f"nothing heard for {timeout:.1f} s while it held storage"
    state.out.append(Disconnect(conn.name, reason))
    lose_connection(fx, conn, now)
