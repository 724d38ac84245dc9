"""The simulated network of the model world: frames in flight, delivered, lost or duplicated.

An in-flight list of frames (bytes, through :func:`~rd2h_protocol.wire.codec.encode` /
:func:`~rd2h_protocol.wire.codec.decode`). What the real transport (ZMQ DEALER/ROUTER over
TCP) guarantees, and so what the model assumes: frames of one connection arrive in order
(``WorldConfig.fifo``; frames of different connections interleave freely), a frame is
never duplicated or corrupted, and frames are lost when a peer dies (its connections
vanish) or a reconnect drops what was in the socket buffers. The model goes further than
ZMQ on purpose, to prove robustness: frames may be dropped (the explorer drops
Decode->Prefill frames, the state machine any frame but a readiness) or duplicated (any
frame but a readiness) at any time. What the protocol does NOT claim to survive, and the
model does only when asked (the ``lose`` budget): a readiness is delivered exactly once
(a duplicate read after its publication ended would read reused storage; a lost one lets
Decode complete a request from its last layer alone when the layers live in different
storages), and it arrives within half of its lease (``recv < sent + lease_ms / 2``:
Decode starts a read only while half the lease is left since receipt, the protocol's
only defence against clock-free reasoning going wrong). Time cannot pass that bound
while such a frame is in flight.

:class:`NetworkWorld` is a layer of :class:`~rd2h_protocol.checker.world.World`:
:meth:`NetworkWorld.deliverable` and :meth:`NetworkWorld.deliver` are the network a
subclass may replace with a real transport (with ``transmit`` of
:class:`~rd2h_protocol.checker.core.WorldCore`).
"""

from __future__ import annotations

from rd2h_protocol.checker import footprint
from rd2h_protocol.checker.core import WorldCore, reply_key
from rd2h_protocol.checker.model import CLAIM_KINDS, CLAIMS, Addr
from rd2h_protocol.wire.codec import decode
from rd2h_protocol.wire.messages import ReadReadyBatch

__all__ = ["NetworkWorld"]


class NetworkWorld(WorldCore):
    """The network layer of :class:`~rd2h_protocol.checker.world.World`."""

    # -- the network -----------------------------------------------------------------------

    def deliverable(self) -> list[int]:
        """Indices of the frames that may be delivered now (heads of their connection)."""
        seen: set[tuple[Addr, Addr]] = set()
        out = []
        for i, f in enumerate(self.network):
            key = (f.src, f.dst)
            if self.cfg.fifo and key in seen:
                continue
            seen.add(key)
            out.append(i)
        return out

    def deliver(self, i: int) -> None:
        """Deliver in-flight frame ``i`` to its destination."""
        f = self.network.pop(i)
        footprint.touch(footprint.take(f.src[1], f.dst[1]))
        if f.kind in CLAIM_KINDS:  # the claim exchange (Prefill-first): its own channel
            if f.dst[0] == "D":
                e, d = self.static.conn_rank[f.dst[1].removesuffix(CLAIMS)]
                self.claim_answered(e, d, f)
            else:
                p = self.session_rank(f.dst[1].removesuffix(CLAIMS))
                assert p is not None, "frames to dead sessions are purged"
                self.claim_delivered(p, f)
        elif f.dst[0] == "D":
            e, d = self.static.conn_rank[f.dst[1]]
            peer = f.src[1].encode()
            if f.kind == "ReadReadyBatch":
                msg = decode(f.data)
                assert isinstance(msg, ReadReadyBatch)
                key = (e, d, peer, reply_key(msg))
                self._readiness.setdefault(key, []).append(
                    (msg.group_member_idx, tuple(msg.done_ext_ids))
                )
            outs = self.consumers[(e, d)].receive(peer, f.data, self.now)
            self._consumer_outputs(e, d, outs)
        else:
            p = self.session_rank(f.dst[1])
            assert p is not None, "frames to dead sessions are purged"
            self._producer_outputs(p, self.producers[p].receive(f.src[1], f.data, self.now))
        self._gather()

    def droppable(self) -> list[int]:
        """Deliverable frames the model may lose or duplicate (anything but a readiness)."""
        return [i for i in self.deliverable() if self.network[i].kind != "ReadReadyBatch"]

    def drop(self, i: int) -> None:
        """Lose in-flight frame ``i``."""
        f = self.network.pop(i)
        footprint.touch(footprint.take(f.src[1], f.dst[1]))

    def duplicate(self, i: int) -> None:
        """Deliver frame ``i`` twice: a copy joins the end of its connection's queue."""
        f = self.network[i]
        footprint.touch(footprint.take(f.src[1], f.dst[1]))  # reads the head
        footprint.touch(footprint.append(f.src[1], f.dst[1]))
        self.network.append(f)

    def deliver_duplicated(self, i: int) -> None:
        """Deliver frame ``i`` and leave a copy at the end of its connection's queue: the
        explorer's duplicate, made at the latest instant :meth:`duplicate` could make it
        (see "Duplicates made on delivery" in :mod:`~rd2h_protocol.checker.canonical`)."""
        copy = self.network[i]
        self.deliver(i)
        footprint.touch(footprint.append(copy.src[1], copy.dst[1]))
        self.network.append(copy)

    def breakable(self) -> list[tuple[int, str]]:
        """(Prefill rank, Decode endpoint) connections with something to lose or resend."""
        out: list[tuple[int, str]] = []
        for p, prod in enumerate(self.producers):
            session = self.ranks[p].session
            busy = {v.conn for v in prod.publications().values()}
            for f in self.network:
                if session in (f.src[1], f.dst[1]):
                    busy.add(f.dst[1] if f.src[1] == session else f.src[1])
            out.extend((p, conn) for conn in sorted(busy) if conn in prod.connections())
        return out

    def break_connection(self, p: int, conn: str) -> None:
        """The connection between Prefill rank ``p`` and Decode endpoint ``conn`` breaks
        and ZMQ reconnects it within the runtime's grace (a peer stalled past the
        heartbeat timeout): every frame in flight on it is lost, both ways, and the
        producer is told it resumed. Nothing is sent on it in between: the runtime holds
        no frame back while ZMQ reconnects, so a readiness sent in that window could also
        overtake the resent ones (a gap Decode fails safely); that is not modelled."""
        session = self.ranks[p].session
        self.network = [f for f in self.network if {f.src[1], f.dst[1]} != {session, conn}]
        self._producer_outputs(p, self.producers[p].connection_resumed(conn, self.now))
        self._gather()
