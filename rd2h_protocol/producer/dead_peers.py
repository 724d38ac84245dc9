"""Decode endpoints declared dead (by the runtime's heartbeat, or by their silence while
they hold storage), and connections that broke and came back.

See "Dead peers" in the package docstring for why a dead peer's storage still waits for
the lease.
"""

from __future__ import annotations

import heapq

from rd2h_protocol.errors import ErrorCode, LocalProtocolError
from rd2h_protocol.events import Disconnect
from rd2h_protocol.machines.producer import (
    C_LOCAL_CONNECTION_LOST,
    G_LOCAL_LAST_PEER_DEAD,
    G_LOCAL_PEER_DEAD,
    P_LOCAL_CONNECTION_LOST,
    PUB_HELD,
    R_LOCAL_FAILURE,
)
from rd2h_protocol.machines.producer_inputs import ConnEnd, PubLost
from rd2h_protocol.producer.config import Output
from rd2h_protocol.producer.publications import _Publications
from rd2h_protocol.producer.records import _Pub


class _DeadPeers(_Publications):
    """:meth:`connection_lost`, :meth:`connection_resumed` and silent peers."""

    def connection_lost(self, conn: str, now: float) -> list[Output]:
        """The runtime's heartbeat declared Decode endpoint ``conn`` dead.

        Every publication out on it fails its requests now (``CONNECTION_LOST``); a v2
        peer is sent an ABORT for them, best effort, since it may come back. Their storage
        gates reopen only once their lease has run out as well (at once for a lease that
        ran out already), or when a reply comes after all: see "Dead peers" in the package
        docstring for why the lease is still required. Readiness that waited for the
        handshake is released, and the connection returns to idle, so the next
        publication starts a fresh handshake, preceded by a :class:`Connect` (the runtime
        may have replaced the DEALER); any refusal backoff is forgotten. Frames that still
        arrive on ``conn`` are handled as before. Raises :class:`LocalProtocolError` for a
        name this endpoint never opened.
        """
        c = self._conns.get(conn)
        if c is None:
            raise LocalProtocolError(f"connection {conn!r} is not a Decode endpoint of ours")
        self.stats.connections_lost += 1
        out: list[Output] = []
        message = f"the connection to Decode endpoint {conn} was lost"
        orphans: list[_Pub] = []
        # Held ones (lease ran out AND the peer is dead) end as they are met; what their
        # gates say goes out after the orphans' ABORT.
        reopened: list[Output] = []
        lost = PubLost(now, reopened, G_LOCAL_PEER_DEAD, G_LOCAL_LAST_PEER_DEAD, orphans)
        for pub in list(c.sent.values()):
            self._PUB.apply(self, pub, P_LOCAL_CONNECTION_LOST, lost)
        if orphans and self._can_abort_now(c):
            ids = [r.ext_id for p in orphans for r in p.requests if not r.aborted_toward_peer]
            if ids:
                self._emit_abort(c, list(dict.fromkeys(ids)), "Prefill lost the connection", out)
        for pub in orphans:
            self._fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.CONNECTION_LOST, message, {})
        out.extend(reopened)
        for pub in orphans:  # the requests end now, the gates at the lease
            self._drain_pub(pub, out)
        self._CONN.apply(self, c, C_LOCAL_CONNECTION_LOST, ConnEnd(now, out, None, message))
        return out

    def _fx_orphan(self, pub: _Pub, ctx: PubLost) -> None:
        """Peer dead, lease still running: its requests fail now, its gates wait."""
        ctx.orphans.append(pub)

    def connection_resumed(self, conn: str, now: float) -> list[Output]:
        """The connection to Decode endpoint ``conn`` broke and came back, to the same peer.

        The runtime calls this when its transport reconnected within the grace it gives a
        broken connection (ZMQ reconnects by itself; the peer keeps its state). Frames in
        flight either way may have been lost with the old connection: a readiness that
        never arrived, or a reply that was sent into it. Every publication still waiting
        for its reply on ``conn`` is sent again, under the seq it had and in seq order, to
        a peer with the ``resend`` capability: that peer answers a seq it has served from
        memory (and reads only one it never received), so nothing is read twice. Toward
        any other peer nothing is sent; its leases bound the wait. Nor is a live
        publication whose lease has run out (its lease timer ends it): Decode could start
        that read after its storage reopened. A held one is (only a reply frees it).
        Raises :class:`LocalProtocolError` for a name this endpoint never opened.
        """
        c = self._conns.get(conn)
        if c is None:
            raise LocalProtocolError(f"connection {conn!r} is not a Decode endpoint of ours")
        out: list[Output] = []
        self._resend(c, list(c.sent.values()), now, out)
        return out

    def _check_silence(self, pub: _Pub, now: float, out: list[Output]) -> None:
        """A held publication's silence bound came: declare its peer dead if nothing at all
        came from it for that long (since it was held); else wait that long after its last
        frame (it answers, just not this one yet)."""
        timeout = self.config.silent_peer_timeout_s
        assert timeout is not None
        conn = pub.conn
        silent_since = max(conn.last_heard, pub.held_at)
        if now < silent_since + timeout:
            heapq.heappush(self._timers, (silent_since + timeout, pub.uid))
            return
        self.stats.silent_peers += 1
        held = [p for p in conn.sent.values() if p.state == PUB_HELD]
        self.stats.silent_held_publications += len(held)
        self.stats.silent_held_s += sum(now - p.held_at for p in held)
        reason = f"nothing heard for {timeout:.1f} s while it held storage"
        out.append(Disconnect(conn.name, reason))
        out.extend(self.connection_lost(conn.name, now))
