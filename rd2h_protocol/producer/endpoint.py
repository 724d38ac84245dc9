"""The Prefill endpoint: its public inputs and views, over one state and its effects objects.

:class:`ProducerEndpoint` holds a :class:`~.state.ProducerState` (``state``, the one
record of everything it keeps) and one effects object per machine, built over that state
(see :mod:`.state`). What it adds is what the runtime calls: requests and steps, peer
frames, timers, dead and resumed connections, Prefill-first keeping and claims, and the
views invariant checks read. Every input method returns the outputs its effects appended
to ``state.out``, and starts a new list. It pickles as its state alone: the effects
objects hold nothing of their own and are rebuilt when it is read back.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from rd2h_protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError, TransferError
from rd2h_protocol.events import Chunk, ConnectionView, Disconnect
from rd2h_protocol.machines.producer import (
    C_TIMER_HANDSHAKE_EXPIRED,
    CONN_READY_V1,
    CONN_READY_V2,
    GATE_OPEN,
    P_RECV_DONE,
    P_TIMER_DUE,
    PREFILL_REQUEST,
    R_LOCAL_ABORT,
    R_LOCAL_CHUNK,
    R_LOCAL_FAILURE,
    R_LOCAL_FINAL_CHUNK,
    R_SEND_DONE,
    REQ_FINAL_SCHEDULED,
    REQ_PUBLISHING,
)
from rd2h_protocol.machines.producer_inputs import ConnEnd, PubAt, ReqAbort, ReqChunk
from rd2h_protocol.producer.config import (
    DecodeTarget,
    Output,
    ProducerConfig,
    ProducerStats,
    PublicationView,
)
from rd2h_protocol.producer.dead_peers import lose_connection, resume_connection
from rd2h_protocol.producer.handshakes import ConnectionEffects
from rd2h_protocol.producer.kept import KeptEffects
from rd2h_protocol.producer.publications import GateEffects, PublicationEffects
from rd2h_protocol.producer.records import Conn, Pub, Request
from rd2h_protocol.producer.requests import STILL_READ, RequestEffects
from rd2h_protocol.producer.state import ProducerState, wire_effects
from rd2h_protocol.wire.codec import decode
from rd2h_protocol.wire.messages import Abort, Ack, Message, ReadDone, ReadFailed, ReadReq


class ProducerEndpoint:
    """Sans-IO Prefill endpoint for one TP rank (see the package docstring)."""

    def __init__(self, config: ProducerConfig) -> None:
        self._attach(ProducerState(config))

    def _attach(self, state: ProducerState) -> None:
        """Build the effects objects over ``state`` (one per machine) and link them."""
        self.state = state
        self._req_fx = req = RequestEffects(state)
        self._conn_fx = conn = ConnectionEffects(state)
        self._pub_fx = pub = PublicationEffects(state)
        gate = GateEffects(state)
        self._kept_fx = kept = KeptEffects(state)
        wire_effects(req, conn, pub, gate, kept)

    def __reduce__(self) -> tuple[Any, tuple[ProducerState]]:
        # A snapshot holds the state only; the effects objects are rebuilt over it.
        return _restore, (self.state,)

    @property
    def config(self) -> ProducerConfig:
        """What the caller configured."""
        return self.state.config

    @property
    def stats(self) -> ProducerStats:
        """Counters (see :class:`ProducerStats`)."""
        return self.state.stats

    def _flush(self) -> list[Output]:
        """Hand out the outputs of this call; the next one starts a new list."""
        state = self.state
        out, state.out = state.out, []
        return out

    # -- caller inputs ---------------------------------------------------------------------

    def add_request(self, ext_req_id: str, target: DecodeTarget, now: float) -> list[Output]:
        """Register a request to publish to ``target``.

        The Decode rank and this rank's contributor identity come from the target's own
        TP size. Raises :class:`TopologyError` for a topology or port the rules refuse,
        :class:`LocalProtocolError` for an id already registered.
        """
        del now  # registration starts no deadline
        requests = self.state.requests
        if ext_req_id in requests:
            raise LocalProtocolError(f"request {ext_req_id!r} is already registered")
        conn = self._conn_fx.conn_for(target)
        requests[ext_req_id] = Request(ext_req_id, conn, PREFILL_REQUEST.initial)
        return []

    def schedule_chunk(self, chunk: Chunk, now: float) -> list[Output]:
        """Schedule a request's blocks of the current step (before its first layer).

        A chunk for a request that is already failing or aborting is ignored. Raises
        :class:`LocalProtocolError` for an unknown request, a chunk after the step's first
        layer, a second chunk of one request in a step, or a negative offset or block id.
        """
        del now  # scheduling starts no deadline
        state = self.state
        ext_req_id = chunk.ext_req_id
        req = state.requests.get(ext_req_id)
        if req is None:
            raise LocalProtocolError(f"request {ext_req_id!r} is not registered")
        if state.step_layers:
            raise LocalProtocolError(
                f"request {ext_req_id!r}: chunks must be scheduled before the step's first "
                f"layer_written ({state.step_layers} layers are written already)"
            )
        if ext_req_id in state.step.get(req.conn.name, ()):
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
        req_fx = self._req_fx
        req_fx.TABLE.apply(req_fx, req, event, ReqChunk(chunk, main, indexer))
        return []

    def can_overwrite(self, layer_idx: int) -> bool:
        """Whether the storage layer ``layer_idx`` writes is free (all its gates open).

        Under policy "raise", a read failure recorded against that storage raises
        :class:`TransferError` here, once.
        """
        slots = self._slots_of(layer_idx)
        state = self.state
        pending = state.pending_raise
        if pending:
            failures = [pending.pop(s) for s in slots if s in pending]
            if failures:
                raise TransferError(f"layer {layer_idx}: " + "; ".join(failures))
        gates = state.gates
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
        state = self.state
        if layer_idx <= state.step_top:
            raise LocalProtocolError(
                f"layer {layer_idx} written after layer {state.step_top} in the same step; "
                "layers are written once each, in increasing order"
            )
        gates = state.gates
        busy = [s for s in slots if gates[s].state != GATE_OPEN]
        if busy:
            raise LocalProtocolError(
                f"layer {layer_idx} was written while its storage slots {busy} are still "
                f"being read; wait for can_overwrite({layer_idx})"
            )
        state.step_layers += 1
        state.step_top = layer_idx
        pending = state.pending_raise
        for s in slots:
            pending.pop(s, None)  # that storage holds new data now
        last = layer_idx == state.last_layer
        deadline = now + state.lease_s
        pubs: list[Pub] = []
        req_fx = self._req_fx
        apply_req = req_fx.TABLE.apply
        publish = self._pub_fx.publish
        for reqs in state.step.values():
            read_reqs: list[ReadReq] = []
            done: list[str] = []
            named: list[Request] = []
            for req in reqs.values():
                req_state = req.state
                if req_state not in REQ_PUBLISHING:
                    continue  # failing or aborting: stop publishing it
                chunk = req.chunk
                if chunk is not None:
                    read_reqs.append(chunk)
                if last and req_state == REQ_FINAL_SCHEDULED:
                    done.append(req.ext_id)
                    apply_req(req_fx, req, R_SEND_DONE, None)
                elif chunk is None:
                    continue
                named.append(req)
            if named:
                pubs.append(publish(layer_idx, slots, read_reqs, done, named, deadline))
        # Every publication holds the gates before any connection acts on its own, so a
        # refused connection releasing its share never reports a gate the others still hold.
        conn_publish = self._conn_fx.publish
        for pub in pubs:
            conn_publish(pub, now)
        return self._flush()

    def end_step(self, now: float) -> list[Output]:
        """The step is over. Requests whose chunk missed a layer fail (their data is
        incomplete on Decode); the step's chunks are forgotten."""
        state = self.state
        req_fx = self._req_fx
        n_layers = len(state.layer_names)
        missing = n_layers - state.step_layers
        for reqs in list(state.step.values()):
            for req in list(reqs.values()):
                req.chunk = None
                if missing and req.state in STILL_READ:
                    req_fx.fail(
                        req,
                        R_LOCAL_FAILURE,
                        ErrorCode.STEP_INCOMPLETE,
                        f"the step ended with {missing} of {n_layers} layers not written",
                    )
                    req_fx.maybe_drain(req)
        state.step.clear()
        state.step_count = 0
        state.step_layers = 0
        state.step_top = -1
        self._kept_fx.publish_waiting(now)
        return self._flush()

    def abort(self, ext_ids: Iterable[str], reason: str, now: float) -> list[Output]:
        """Stop publishing these requests and tell their v2 Decode endpoints why.

        Unknown (or already finished) ids are ignored. Each request finishes (aborted,
        with ``reason`` as its message) once the publications already out for it have
        ended.
        """
        del now
        state = self.state
        by_conn: dict[str, list[str]] = {}
        abort = ReqAbort(reason, by_conn)
        touched: list[Request] = []
        req_fx = self._req_fx
        for ext_id in ext_ids:
            req = state.requests.get(ext_id)
            if req is None:
                continue
            req_fx.TABLE.apply(req_fx, req, R_LOCAL_ABORT, abort)
            touched.append(req)
        conn_fx = self._conn_fx
        for name, ids in by_conn.items():
            conn_fx.send_abort(state.conns[name], ids, reason)
        for req in touched:
            req_fx.maybe_drain(req)
        return self._flush()

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
        state = self.state
        if isinstance(frame, bytes | bytearray | memoryview):
            try:
                msg = decode(frame)
            except RemoteProtocolError:
                state.stats.malformed_frames += 1
                return []
        else:
            msg = frame
        c = state.conns.get(conn)
        if c is None or not c.connected:  # not a connection we opened
            state.stats.unexpected_messages += 1
            return []
        if state.config.silent_peer_timeout_s is not None:  # (kept only where it is used)
            c.last_heard = now
        pub_fx = self._pub_fx
        try:
            if isinstance(msg, ReadDone):
                pub_fx.on_reply(c, msg.layer_idx, msg.seq, P_RECV_DONE, now, msg.failed)
            elif isinstance(msg, ReadFailed):
                pub_fx.on_read_failed(c, msg, now)
            elif isinstance(msg, Ack):
                self._conn_fx.on_ack(c, msg, now)
            elif isinstance(msg, Abort):
                self._req_fx.on_abort(c, msg)
            else:
                state.stats.unexpected_messages += 1
        except RemoteProtocolError as exc:
            state.stats.protocol_violations += 1
            state.out.append(Disconnect(conn, f"protocol violation: {exc.message}"))
            lose_connection(pub_fx, c, now)
        return self._flush()

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
        lose_connection(self._pub_fx, self._conn_named(conn), now)
        return self._flush()

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
        resume_connection(self._pub_fx, self._conn_named(conn), now)
        return self._flush()

    def _conn_named(self, conn: str) -> Conn:
        c = self.state.conns.get(conn)
        if c is None:
            raise LocalProtocolError(f"connection {conn!r} is not a Decode endpoint of ours")
        return c

    # -- Prefill-first ---------------------------------------------------------------------

    def keep_request(self, ext_req_id: str, now: float) -> list[Output]:
        """Keep a computed request for the Decode that will claim it (Prefill-first).

        Its blocks must stay untouched until :class:`RequestFinished` names it: after a
        claim's reads, or unread when ``claim_timeout_s`` passes with no claim. Raises
        :class:`LocalProtocolError` for an id kept or registered already, or when this
        Prefill cannot keep a request (v1 only, or storage shared between layers: the
        message names the Decode-first proxy instead).
        """
        self._kept_fx.keep_request(ext_req_id, now)
        return []

    def claim(
        self, ext_req_id: str, target: DecodeTarget, chunk: Chunk, now: float
    ) -> list[Output]:
        """Decode ``target`` claims kept request ``ext_req_id``: publish ``chunk`` to it.

        ``chunk`` holds the request's blocks that Decode does not hold yet (its prefix
        hit left out), ``final``. Peer input: never raises; the answer is a
        :class:`ClaimAnswered` among the outputs (refused for an id not kept here, one
        claimed already, or a Decode whose topology this Prefill cannot serve).
        """
        self._kept_fx.claim(ext_req_id, target, chunk, now)
        return self._flush()

    # -- time ------------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """The earliest deadline (lease or handshake), or None when nothing is pending."""
        state = self.state
        timers = state.timers
        pubs, handshakes, kept_timers = state.pubs, state.handshakes, state.kept_timers
        while timers:
            _, uid = timers[0]
            if uid in pubs or uid in handshakes or uid in kept_timers:
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
        state = self.state
        timers = state.timers
        pub_fx = self._pub_fx
        while timers and timers[0][0] <= now:
            _, uid = heapq.heappop(timers)
            pub = state.pubs.get(uid)
            if pub is not None:  # the table says which deadline it was
                pub_fx.TABLE.apply(pub_fx, pub, P_TIMER_DUE, PubAt(now))
                continue
            if self._kept_fx.claim_expired(uid):
                continue
            conn = state.handshakes.pop(uid, None)
            if conn is not None:
                state.stats.handshake_timeouts += 1
                message = (
                    f"handshake with {conn.name} timed out after "
                    f"{state.config.handshake_timeout_s} s"
                )
                conn_fx = self._conn_fx
                conn_fx.TABLE.apply(
                    conn_fx, conn, C_TIMER_HANDSHAKE_EXPIRED, ConnEnd(now, None, message)
                )
        return self._flush()

    # -- views for invariant checks --------------------------------------------------------

    def gates(self) -> dict[int, tuple[str, int]]:
        """``{slot: (state, outstanding publications)}``."""
        return {slot: (g.state, g.outstanding) for slot, g in self.state.gates.items()}

    def layer_slots(self, layer_idx: int) -> tuple[int, ...]:
        """The storage slots layer ``layer_idx`` writes (main, then indexer if any)."""
        return self._slots_of(layer_idx)

    def requests(self) -> dict[str, str]:
        """``{ext_id: state}`` of every request not yet finished."""
        return {ext_id: req.state for ext_id, req in self.state.requests.items()}

    def kept(self) -> dict[str, str]:
        """``{ext_id: kept-request state}`` of every request kept or claimed, not finished."""
        return {ext_id: kept.state for ext_id, kept in self.state.kept.items()}

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
            for uid, pub in self.state.pubs.items()
        }

    def connections(self) -> dict[str, str]:
        """``{conn: handshake state}``."""
        return {name: c.state for name, c in self.state.conns.items()}

    def negotiated(self, conn: str) -> ConnectionView:
        """The protocol and capabilities negotiated on connection ``conn``.

        Raises :class:`LocalProtocolError` for a connection this endpoint never opened.
        """
        c = self._conn_named(conn)
        return ConnectionView.of(
            c.name, c.state, c.caps, v2_state=CONN_READY_V2, v1_state=CONN_READY_V1
        )

    def is_idle(self) -> bool:
        """True when no per-request state is left (no request, publication or chunk)."""
        state = self.state
        return not state.requests and not state.pubs and not state.step_count and not state.kept

    def _slots_of(self, layer_idx: int) -> tuple[int, ...]:
        last = self.state.last_layer
        if not 0 <= layer_idx <= last:
            raise LocalProtocolError(f"layer index {layer_idx} is outside [0, {last}]")
        return self.state.layer_slots[layer_idx]


def _restore(state: ProducerState) -> ProducerEndpoint:
    """An endpoint read back from a snapshot of its state (see ``__reduce__``)."""
    endpoint = ProducerEndpoint.__new__(ProducerEndpoint)
    endpoint._attach(state)
    return endpoint
