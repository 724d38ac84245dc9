"""The Prefill endpoint: its public inputs and views, and its tables bound to their handlers.

:class:`ProducerEndpoint` is every module of this package put together (see
:mod:`.state`); what it adds is what the runtime calls: requests and steps, peer frames,
timers, and the views invariant checks read. :meth:`~ProducerEndpoint.connection_lost`
and :meth:`~ProducerEndpoint.connection_resumed` are in :mod:`.dead_peers`, where the
lease of a silent peer's publication calls the first.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from rd2h_protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError, TransferError
from rd2h_protocol.events import Chunk, ConnectionView, Disconnect
from rd2h_protocol.machines.declare import NO_EFFECT, no_effect
from rd2h_protocol.machines.producer import (
    C_TIMER_HANDSHAKE_EXPIRED,
    CONN_READY_V1,
    CONN_READY_V2,
    CONNECTION_HANDSHAKE,
    EFFECT_COUNT_DUPLICATE,
    EFFECT_COUNT_STALE,
    EFFECT_COUNT_STRAY_ACK,
    EFFECT_DONE,
    EFFECT_EXPIRE_ABORT,
    EFFECT_EXPIRE_UNSENT,
    EFFECT_EXPIRE_UNTOLD,
    EFFECT_FAIL,
    EFFECT_FAIL_QUEUED,
    EFFECT_FINISH,
    EFFECT_FLUSH,
    EFFECT_HOLD,
    EFFECT_IGNORE,
    EFFECT_ORPHAN,
    EFFECT_PUBLISH_KEPT,
    EFFECT_QUEUE,
    EFFECT_RECORD_FAILURE,
    EFFECT_REFUSE_CLAIM,
    EFFECT_REFUSED,
    EFFECT_RELEASE,
    EFFECT_RELEASE_HELD,
    EFFECT_RELEASE_UNCLAIMED,
    EFFECT_REOPEN,
    EFFECT_REQUEUE,
    EFFECT_RESEND,
    EFFECT_RESET,
    EFFECT_SCHEDULE,
    EFFECT_SCHEDULE_CLAIMED,
    EFFECT_SEND,
    EFFECT_SEND_ABORT,
    EFFECT_SEND_META,
    EFFECT_STOP,
    GATE_OPEN,
    KEPT_REQUEST,
    LAYER_PUBLICATION,
    P_RECV_DONE,
    PREFILL_REQUEST,
    R_LOCAL_ABORT,
    R_LOCAL_CHUNK,
    R_LOCAL_FAILURE,
    R_LOCAL_FINAL_CHUNK,
    R_SEND_DONE,
    REQ_FINAL_SCHEDULED,
    REQ_PUBLISHING,
    STORAGE_GATE,
)
from rd2h_protocol.machines.producer_inputs import ConnEnd, ReqAbort, ReqChunk
from rd2h_protocol.producer.config import DecodeTarget, Output, PublicationView
from rd2h_protocol.producer.dead_peers import _DeadPeers
from rd2h_protocol.producer.handshakes import _Handshakes
from rd2h_protocol.producer.kept import _KeptRequests
from rd2h_protocol.producer.leases import _Leases
from rd2h_protocol.producer.publications import _Publications
from rd2h_protocol.producer.records import _Pub, _Request
from rd2h_protocol.producer.requests import _STILL_READ, _Requests
from rd2h_protocol.wire.codec import decode
from rd2h_protocol.wire.messages import Abort, Ack, Message, ReadDone, ReadFailed, ReadReq


class ProducerEndpoint(_KeptRequests):
    """Sans-IO Prefill endpoint for one TP rank (see the package docstring)."""

    # The tables drive the action: each declared effect bound to its handler.
    _GATE = STORAGE_GATE.bind({NO_EFFECT: no_effect, EFFECT_REOPEN: _Publications._fx_reopen})
    _REQUEST = PREFILL_REQUEST.bind(
        {
            NO_EFFECT: no_effect,
            EFFECT_SCHEDULE: _Requests._fx_schedule,
            EFFECT_SCHEDULE_CLAIMED: _KeptRequests._fx_schedule_claimed,
            EFFECT_IGNORE: no_effect,
            EFFECT_RECORD_FAILURE: _Requests._fx_record_failure,
            EFFECT_SEND_ABORT: _Requests._fx_send_abort,
            EFFECT_STOP: _Requests._fx_stop,
            EFFECT_FINISH: _Requests._fx_finish,
        }
    )
    _PUB = LAYER_PUBLICATION.bind(
        {
            NO_EFFECT: no_effect,
            EFFECT_SEND: _Publications._fx_send,
            EFFECT_RESEND: _Publications._fx_resend,
            EFFECT_DONE: _Publications._fx_done,
            EFFECT_FAIL: _Publications._fx_fail,
            EFFECT_REQUEUE: _Publications._fx_requeue,
            EFFECT_RELEASE: _Publications._fx_release,
            EFFECT_EXPIRE_ABORT: _Leases._fx_expire_abort,
            EFFECT_EXPIRE_UNSENT: _Leases._fx_expire_unsent,
            EFFECT_EXPIRE_UNTOLD: _Leases._fx_expire_untold,
            EFFECT_HOLD: _Leases._fx_hold,
            EFFECT_ORPHAN: _DeadPeers._fx_orphan,
            EFFECT_RELEASE_HELD: _Publications._fx_release_held,
            EFFECT_COUNT_DUPLICATE: _Publications._fx_count_duplicate,
            EFFECT_COUNT_STALE: _Publications._fx_count_stale,
        }
    )
    _KEPT = KEPT_REQUEST.bind(
        {
            NO_EFFECT: no_effect,
            EFFECT_PUBLISH_KEPT: _KeptRequests._fx_publish_kept,
            EFFECT_REFUSE_CLAIM: _KeptRequests._fx_refuse_claim,
            EFFECT_RELEASE_UNCLAIMED: _KeptRequests._fx_release_unclaimed,
        }
    )
    _CONN = CONNECTION_HANDSHAKE.bind(
        {
            EFFECT_SEND_META: _Handshakes._fx_send_meta,
            EFFECT_QUEUE: _Handshakes._fx_queue,
            EFFECT_SEND: _Handshakes._fx_conn_send,
            EFFECT_RELEASE: _Handshakes._fx_conn_release,
            EFFECT_FLUSH: _Handshakes._fx_flush,
            EFFECT_REFUSED: _Handshakes._fx_refused,
            EFFECT_FAIL_QUEUED: _Handshakes._fx_fail_queued,
            EFFECT_RESET: _Handshakes._fx_reset,
            EFFECT_COUNT_STRAY_ACK: _Handshakes._fx_count_stray_ack,
        }
    )

    # -- caller inputs ---------------------------------------------------------------------

    def add_request(self, ext_req_id: str, target: DecodeTarget, now: float) -> list[Output]:
        """Register a request to publish to ``target``.

        The Decode rank and this rank's contributor identity come from the target's own
        TP size. Raises :class:`TopologyError` for a topology or port the rules refuse,
        :class:`LocalProtocolError` for an id already registered.
        """
        del now  # registration starts no deadline
        if ext_req_id in self._requests:
            raise LocalProtocolError(f"request {ext_req_id!r} is already registered")
        conn = self._conn_for(target)
        self._requests[ext_req_id] = _Request(ext_req_id, conn, PREFILL_REQUEST.initial)
        return []

    def schedule_chunk(self, chunk: Chunk, now: float) -> list[Output]:
        """Schedule a request's blocks of the current step (before its first layer).

        A chunk for a request that is already failing or aborting is ignored. Raises
        :class:`LocalProtocolError` for an unknown request, a chunk after the step's first
        layer, a second chunk of one request in a step, or a negative offset or block id.
        """
        del now  # scheduling starts no deadline
        ext_req_id = chunk.ext_req_id
        req = self._requests.get(ext_req_id)
        if req is None:
            raise LocalProtocolError(f"request {ext_req_id!r} is not registered")
        if self._step_layers:
            raise LocalProtocolError(
                f"request {ext_req_id!r}: chunks must be scheduled before the step's first "
                f"layer_written ({self._step_layers} layers are written already)"
            )
        if ext_req_id in self._step.get(req.conn.name, ()):
            raise LocalProtocolError(f"request {ext_req_id!r} is scheduled twice in one step")
        if chunk.main_start < 0 or chunk.indexer_start < 0:
            raise LocalProtocolError(
                f"request {ext_req_id!r}: start blocks must be >= 0, got "
                f"main {chunk.main_start}, indexer {chunk.indexer_start}"
            )
        main = list(chunk.main_block_ids)
        indexer = list(chunk.indexer_block_ids)
        if (main and min(main) < 0) or (indexer and min(indexer) < 0):
            raise LocalProtocolError(f"request {ext_req_id!r}: block ids must be >= 0")
        event = R_LOCAL_FINAL_CHUNK if chunk.final else R_LOCAL_CHUNK
        self._REQUEST.apply(self, req, event, ReqChunk(chunk, main, indexer))
        return []

    def can_overwrite(self, layer_idx: int) -> bool:
        """Whether the storage layer ``layer_idx`` writes is free (all its gates open).

        Under policy "raise", a read failure recorded against that storage raises
        :class:`TransferError` here, once.
        """
        slots = self._slots_of(layer_idx)
        if self._pending_raise:
            failures = [self._pending_raise.pop(s) for s in slots if s in self._pending_raise]
            if failures:
                raise TransferError(f"layer {layer_idx}: " + "; ".join(failures))
        gates = self._gates
        return all(gates[s].state == GATE_OPEN for s in slots)

    def layer_written(self, layer_idx: int, now: float) -> list[Output]:
        """Layer ``layer_idx`` of the current step is in storage: publish it.

        One readiness per Decode endpoint with something in the step (its contributor
        identity from that endpoint's TP size; done ids on the last layer), each leased
        until ``now + lease``; the layer's gates close until every one has ended.
        Raises :class:`LocalProtocolError` if the storage is still in use (the runtime
        must wait for :meth:`can_overwrite`) or the layer is not after the step's last.
        """
        slots = self._slots_of(layer_idx)
        if layer_idx <= self._step_top:
            raise LocalProtocolError(
                f"layer {layer_idx} written after layer {self._step_top} in the same step; "
                "layers are written once each, in increasing order"
            )
        busy = [s for s in slots if self._gates[s].state != GATE_OPEN]
        if busy:
            raise LocalProtocolError(
                f"layer {layer_idx} was written while its storage slots {busy} are still "
                f"being read; wait for can_overwrite({layer_idx})"
            )
        self._step_layers += 1
        self._step_top = layer_idx
        for s in slots:
            self._pending_raise.pop(s, None)  # that storage holds new data now
        out: list[Output] = []
        last = layer_idx == self._last_layer
        deadline = now + self._lease_s
        pubs: list[_Pub] = []
        for reqs in self._step.values():
            read_reqs: list[ReadReq] = []
            done: list[str] = []
            named: list[_Request] = []
            for req in reqs.values():
                state = req.state
                if state not in REQ_PUBLISHING:
                    continue  # failing or aborting: stop publishing it
                chunk = req.chunk
                if chunk is not None:
                    read_reqs.append(chunk)
                if last and state == REQ_FINAL_SCHEDULED:
                    done.append(req.ext_id)
                    self._REQUEST.apply(self, req, R_SEND_DONE, None)
                elif chunk is None:
                    continue
                named.append(req)
            if named:
                pubs.append(self._publish(layer_idx, slots, read_reqs, done, named, deadline))
        # Every publication holds the gates before any connection acts on its own, so a
        # refused connection releasing its share never reports a gate the others still hold.
        for pub in pubs:
            self._conn_publish(pub, now, out)
        return out

    def end_step(self, now: float) -> list[Output]:
        """The step is over. Requests whose chunk missed a layer fail (their data is
        incomplete on Decode); the step's chunks are forgotten."""
        del now  # ending a step starts no deadline
        out: list[Output] = []
        missing = len(self._layer_names) - self._step_layers
        for reqs in list(self._step.values()):
            for req in list(reqs.values()):
                req.chunk = None
                if missing and req.state in _STILL_READ:
                    self._fail(
                        req,
                        R_LOCAL_FAILURE,
                        ErrorCode.STEP_INCOMPLETE,
                        f"the step ended with {missing} of {len(self._layer_names)} layers "
                        "not written",
                    )
                    self._maybe_drain(req, out)
        self._step.clear()
        self._step_count = 0
        self._step_layers = 0
        self._step_top = -1
        return out

    def abort(self, ext_ids: Iterable[str], reason: str, now: float) -> list[Output]:
        """Stop publishing these requests and tell their v2 Decode endpoints why.

        Unknown (or already finished) ids are ignored. Each request finishes (aborted,
        with ``reason`` as its message) once the publications already out for it have
        ended.
        """
        del now
        out: list[Output] = []
        by_conn: dict[str, list[str]] = {}
        abort = ReqAbort(reason, by_conn)
        touched: list[_Request] = []
        for ext_id in ext_ids:
            req = self._requests.get(ext_id)
            if req is None:
                continue
            self._REQUEST.apply(self, req, R_LOCAL_ABORT, abort)
            touched.append(req)
        for name, ids in by_conn.items():
            self._send_abort(self._conns[name], ids, reason, out)
        for req in touched:
            self._maybe_drain(req, out)
        return out

    # -- peer input ------------------------------------------------------------------------

    def receive(
        self, conn: str, frame: Message | bytes | bytearray | memoryview, now: float
    ) -> list[Output]:
        """Handle one frame (or decoded message) from Decode endpoint ``conn``.

        Never raises for peer input: malformed, unexpected, unknown, stale and duplicate
        input is counted in :attr:`stats` and changes nothing. Input that no table allows
        (none does today: every reply, ACK and ABORT has its row) is a protocol violation:
        the peer is declared dead, as h2 closes a connection on one (a :class:`Disconnect`
        saying why, then what :meth:`connection_lost` does).
        """
        if isinstance(frame, bytes | bytearray | memoryview):
            try:
                msg = decode(frame)
            except RemoteProtocolError:
                self.stats.malformed_frames += 1
                return []
        else:
            msg = frame
        c = self._conns.get(conn)
        if c is None or not c.connected:  # not a connection we opened
            self.stats.unexpected_messages += 1
            return []
        if self.config.silent_peer_timeout_s is not None:  # (kept only where it is used)
            c.last_heard = now
        out: list[Output] = []
        try:
            if isinstance(msg, ReadDone):
                self._on_reply(c, msg.layer_idx, msg.seq, P_RECV_DONE, now, out, msg.failed)
            elif isinstance(msg, ReadFailed):
                self._on_read_failed(c, msg, now, out)
            elif isinstance(msg, Ack):
                self._on_ack(c, msg, now, out)
            elif isinstance(msg, Abort):
                self._on_abort(c, msg, out)
            else:
                self.stats.unexpected_messages += 1
        except RemoteProtocolError as exc:
            self.stats.protocol_violations += 1
            out.append(Disconnect(conn, f"protocol violation: {exc.message}"))
            out.extend(self.connection_lost(conn, now))
        return out

    # -- time ------------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """The earliest deadline (lease or handshake), or None when nothing is pending."""
        timers = self._timers
        while timers:
            _, uid = timers[0]
            if uid in self._pubs or uid in self._handshakes or uid in self._kept_timers:
                return timers[0][0]
            heapq.heappop(timers)
        return None

    def handle_timer(self, now: float) -> list[Output]:
        """Handle every deadline at or before ``now``.

        A kept request whose claim window ran out finishes unread (Prefill-first).
        An expired lease sends ABORT for the publication's requests to a v2 peer, THEN
        reopens the gates, then fails the requests. When no ABORT can go out now (a v1
        peer, or a handshake in progress) the requests fail and the publication is held:
        its gates stay closed (see the package docstring). An expired handshake releases
        the readiness queued on that connection.
        """
        out: list[Output] = []
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, uid = heapq.heappop(timers)
            pub = self._pubs.get(uid)
            if pub is not None:
                self._expire(pub, now, out)
                continue
            if self._claim_expired(uid, out):
                continue
            conn = self._handshakes.pop(uid, None)
            if conn is not None:
                self.stats.handshake_timeouts += 1
                message = (
                    f"handshake with {conn.name} timed out after "
                    f"{self.config.handshake_timeout_s} s"
                )
                self._CONN.apply(
                    self, conn, C_TIMER_HANDSHAKE_EXPIRED, ConnEnd(now, out, None, message)
                )
        return out

    # -- views for invariant checks --------------------------------------------------------

    def gates(self) -> dict[int, tuple[str, int]]:
        """``{slot: (state, outstanding publications)}``."""
        return {slot: (g.state, g.outstanding) for slot, g in self._gates.items()}

    def layer_slots(self, layer_idx: int) -> tuple[int, ...]:
        """The storage slots layer ``layer_idx`` writes (main, then indexer if any)."""
        return self._slots_of(layer_idx)

    def requests(self) -> dict[str, str]:
        """``{ext_id: state}`` of every request not yet finished."""
        return {ext_id: req.state for ext_id, req in self._requests.items()}

    def publications(self) -> dict[int, PublicationView]:
        """Every live (not yet ended) publication."""
        return {
            uid: PublicationView(
                pub.conn.name,
                pub.layer_idx,
                pub.state,
                pub.seq,
                pub.slots,
                tuple(r.ext_id for r in pub.requests),
                pub.deadline,
            )
            for uid, pub in self._pubs.items()
        }

    def connections(self) -> dict[str, str]:
        """``{conn: handshake state}``."""
        return {name: c.state for name, c in self._conns.items()}

    def negotiated(self, conn: str) -> ConnectionView:
        """The protocol and capabilities negotiated on connection ``conn``.

        Raises :class:`LocalProtocolError` for a connection this endpoint never opened.
        """
        c = self._conns.get(conn)
        if c is None:
            raise LocalProtocolError(f"connection {conn!r} is not a Decode endpoint of ours")
        return ConnectionView.of(
            c.name, c.state, c.caps, v2_state=CONN_READY_V2, v1_state=CONN_READY_V1
        )

    def is_idle(self) -> bool:
        """True when no per-request state is left (no request, publication or chunk)."""
        return not self._requests and not self._pubs and not self._step_count and not self._kept

    def _slots_of(self, layer_idx: int) -> tuple[int, ...]:
        if not 0 <= layer_idx <= self._last_layer:
            raise LocalProtocolError(f"layer index {layer_idx} is outside [0, {self._last_layer}]")
        return self._layer_slots[layer_idx]
