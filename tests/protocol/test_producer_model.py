"""Random runs of the Prefill endpoint against a scripted, misbehaving Decode network.

Hypothesis drives requests, chunks, layer writes, replies (done, isolated failures,
read failures, UNKNOWN_SESSION, duplicates, drops), aborts from both sides, heartbeat
deaths and time. After every step the storage-slot invariant (S1) and the request
bookkeeping are checked, and every publication that ended is checked to have ended
safely: by a reply, or after its lease with its ABORT sent (v2) or its peer declared dead
(v1 never receives an ABORT): by the runtime's heartbeat, or by the endpoint itself once a
peer holding storage stayed silent for ``silent_peer_timeout_s`` (a Disconnect output).
At the end the peers are declared dead, time runs past every deadline and everything
must be open and forgettable (L1, B1).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from test_producer import ACK_V1_FRAME, ack_v2, layers

from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.events import Chunk
from rd2h_protocol.machines.producer import GATE_OPEN
from rd2h_protocol.producer import (
    DecodeTarget,
    Disconnect,
    GateOpened,
    Output,
    ProducerConfig,
    ProducerEndpoint,
    PublicationView,
    RequestFinished,
    Send,
)
from rd2h_protocol.wire.codec import decode, encode
from rd2h_protocol.wire.messages import (
    Abort,
    Ack,
    FailedRequest,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
)

HOST = "127.0.0.1"
ENGINES = (DecodeTarget(HOST, 20000, 1), DecodeTarget(HOST, 21000, 1))
V2_CONN = f"{HOST}:20000"  # engine 0 speaks v2, engine 1 speaks v1
N_LAYERS = 4
LEASE_S = 5.0


class ProducerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ep = ProducerEndpoint(
            ProducerConfig(
                p_rank=0,
                p_tp=1,
                session="prefill-0",
                layers=layers(N_LAYERS, storages=2),
                lease_ms=int(LEASE_S * 1000),
                handshake_timeout_s=3.0,
            )
        )
        self.now = 0.0
        self.network: list[tuple[str, Any]] = []  # (conn, message) sent, not yet handled
        self.finished: dict[str, RequestFinished] = {}
        self.next_id = 0
        self.next_layer = 0
        self.final_scheduled: set[str] = set()
        # For the "ended safely" check: what each live publication was last seen as, the
        # requests it named, and what happened since.
        self.seen: dict[int, tuple[PublicationView, frozenset[str]]] = {}
        self.replied: set[str] = set()  # connections a reply was delivered from, this step
        self.aborted: defaultdict[str, set[str]] = defaultdict(set)  # ids an ABORT named
        self.dead: set[int] = set()  # publications whose peer was declared dead

    # -- helpers ---------------------------------------------------------------------------

    def apply(self, out: list[Output]) -> None:
        for o in out:
            if isinstance(o, Send):
                self.network.append((o.conn, decode(encode(o.msg))))
                if isinstance(o.msg, Abort):
                    self.aborted[o.conn].update(o.msg.ext_ids)
            elif isinstance(o, RequestFinished):
                assert o.ext_req_id not in self.finished, "finished twice"
                assert o.ext_req_id not in self.ep.requests()
                self.finished[o.ext_req_id] = o
            elif isinstance(o, GateOpened):
                assert self.ep.gates()[o.slot][0] == GATE_OPEN
            elif isinstance(o, Disconnect):  # a silent peer declared dead by the endpoint
                self.dead.update(uid for uid, (view, _) in self.seen.items() if view.conn == o.conn)

    # -- rules -----------------------------------------------------------------------------

    def add(self, engine: DecodeTarget) -> None:
        ext_id = f"r{self.next_id}"
        self.next_id += 1
        self.apply(self.ep.add_request(ext_id, engine, self.now))

    @rule(data=st.data())
    def new_step(self, data: st.DataObject) -> None:
        """End the step (layers not written fail their requests), register new requests
        and schedule the next step's chunks.

        One rule, not three (see advance)."""
        self.apply(self.ep.end_step(self.now))
        self.next_layer = 0
        for engine in data.draw(st.lists(st.sampled_from(ENGINES), max_size=2)):
            self.add(engine)
        open_ = [e for e, s in self.ep.requests().items() if s in ("registered", "sending")]
        if not open_:
            return
        for ext_id in data.draw(st.lists(st.sampled_from(open_), min_size=1, unique=True)):
            self.schedule_one(ext_id, data.draw(st.integers(0, 3)), data.draw(st.booleans()))

    def schedule_one(self, ext_id: str, n: int, final: bool) -> None:
        self.ep.schedule_chunk(
            Chunk(
                ext_req_id=ext_id,
                main_block_ids=list(range(n)),
                indexer_block_ids=list(range(n)),
                final=final,
            ),
            self.now,
        )
        if final:
            self.final_scheduled.add(ext_id)

    @initialize()
    def one_request_per_engine(self) -> None:
        """Start with a step under way toward both engines, or most runs publish nothing."""
        for engine in ENGINES:
            self.add(engine)
        for ext_id in self.ep.requests():
            self.schedule_one(ext_id, 2, False)

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """Write layers, deliver frames and let time pass, in a drawn order.

        The core loop is one rule so that every run exercises it: hypothesis enables a
        random subset of rules per run (swarm testing), and runs that lacked one of three
        separate rules almost never got a readiness answered or a lease expired."""
        actions = st.lists(st.sampled_from(["write", "deliver", "tick"]), min_size=1, max_size=6)
        for action in data.draw(actions):
            if action == "write":
                self.write_layer()
            elif action == "deliver":
                self.deliver(data)
            else:
                self.tick(data.draw(st.sampled_from([0.1, 1.0, 2.5, LEASE_S])))

    def write_layer(self) -> None:
        if self.next_layer >= N_LAYERS or not self.ep.can_overwrite(self.next_layer):
            return  # the step is written, or the compute path waits
        out = self.ep.layer_written(self.next_layer, self.now)
        for o in out:
            if isinstance(o, Send) and isinstance(o.msg, ReadReadyBatch):
                if o.msg.layer_idx != N_LAYERS - 1:
                    assert o.msg.done_ext_ids == []
                assert set(o.msg.done_ext_ids) <= self.final_scheduled
        self.apply(out)
        self.next_layer += 1

    def deliver(self, data: st.DataObject) -> None:
        """Deliver one to three frames, each answered as the drawn Decode behaviour says."""
        for _ in range(data.draw(st.integers(1, 3))):
            if self.network:
                self.deliver_one(data)

    def deliver_one(self, data: st.DataObject) -> None:
        conn, msg = self.network.pop(data.draw(st.integers(0, len(self.network) - 1)))
        v2 = conn == V2_CONN
        replies: list[bytes] = []
        if isinstance(msg, MfMeta):
            action = data.draw(st.sampled_from(["ack", "ack", "ack", "refuse", "drop"]))
            if action == "ack":
                replies.append(ack_v2() if v2 else ACK_V1_FRAME)
            elif action == "refuse" and v2:
                replies.append(encode(Ack(protocol_version=2, error_code=13, error="compat")))
        elif isinstance(msg, ReadReadyBatch):
            seq = msg.seq if v2 else None
            action = data.draw(
                st.sampled_from(["done", "done", "isolate", "fail", "unknown", "drop", "twice"])
            )
            if action in ("done", "twice"):
                replies.append(encode(ReadDone(layer_idx=msg.layer_idx, seq=seq)))
            elif action == "isolate" and v2 and msg.read_reqs:
                bad = [FailedRequest(msg.read_reqs[0].ext_req_id, ErrorCode.UNKNOWN_REQUEST)]
                replies.append(encode(ReadDone(layer_idx=msg.layer_idx, seq=seq, failed=bad)))
            elif action == "fail":
                replies.append(encode(ReadFailed(layer_idx=msg.layer_idx, error="x", seq=seq)))
            elif action == "unknown" and v2:
                frame = ReadFailed(layer_idx=msg.layer_idx, seq=seq, code=ErrorCode.UNKNOWN_SESSION)
                replies.append(encode(frame))
            if action == "twice":
                replies.append(replies[0])
        else:
            assert isinstance(msg, Abort) and v2  # a v1 peer is never sent an ABORT
        if replies and isinstance(msg, ReadReadyBatch):
            self.replied.add(conn)
        for frame in replies:
            self.apply(self.ep.receive(conn, frame, self.now))

    def tick(self, dt: float) -> None:
        self.now += dt
        self.apply(self.ep.handle_timer(self.now))

    @precondition(lambda self: bool(self.ep.requests()))
    @rule(data=st.data(), from_decode=st.booleans())
    def abort(self, data: st.DataObject, from_decode: bool) -> None:
        ext_id = data.draw(st.sampled_from(sorted(self.ep.requests())))
        if from_decode:
            frame = encode(Abort(ext_ids=[ext_id], reason="decode gave up"))
            self.apply(self.ep.receive(V2_CONN, frame, self.now))
        else:
            self.apply(self.ep.abort([ext_id], "aborted by Prefill", self.now))

    @precondition(lambda self: bool(self.ep.connections()))
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        """The runtime's heartbeat declares a Decode endpoint dead."""
        conn = data.draw(st.sampled_from(sorted(self.ep.connections())))
        self.dead.update(uid for uid, p in self.ep.publications().items() if p.conn == conn)
        self.apply(self.ep.connection_lost(conn, self.now))

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def storage_slots_are_safe(self) -> None:
        """S1: a slot is open exactly when no live publication may read it."""
        gates = self.ep.gates()
        holders = {slot: 0 for slot in gates}
        for pub in self.ep.publications().values():
            for slot in pub.slots:
                holders[slot] += 1
        for slot, (state, outstanding) in gates.items():
            assert outstanding == holders[slot]
            assert (state == GATE_OPEN) == (outstanding == 0)

    @invariant()
    def publications_name_only_live_requests(self) -> None:
        live = self.ep.requests()
        for pub in self.ep.publications().values():
            assert set(pub.ext_ids) <= set(live)
            if pub.state == "held":  # its lease ran out; it waits for a reply or a death
                assert pub.ext_ids == () and pub.deadline <= self.now
            else:
                assert pub.deadline > self.now  # handle_timer runs whenever time moves

    @invariant()
    def publications_end_safely(self) -> None:
        """S1, per publication: one that may have been read ends only by a reply, or
        after its lease with its ABORT emitted or its peer declared dead."""
        pubs = self.ep.publications()
        for uid, (last, ids) in list(self.seen.items()):
            if uid in pubs:
                continue
            del self.seen[uid]
            if last.state in ("queued", "requeued") or last.conn in self.replied:
                continue  # never readable, or Decode answered
            assert self.now >= last.deadline, f"{last} ended before its lease"
            assert ids <= self.aborted[last.conn] or uid in self.dead, f"{last} ended untold"
        for uid, view in pubs.items():
            ids = self.seen[uid][1] if uid in self.seen else frozenset(view.ext_ids)
            self.seen[uid] = (view, ids)
        self.replied.clear()

    def teardown(self) -> None:
        """L1 and B1: peers declared dead and past every deadline, all gates open;
        aborting the rest empties it. (A v1 peer that never replies and is never declared
        dead holds its storage forever: that is the point of v1_lease_expiry="hold".)"""
        ep = self.ep
        self.apply(ep.end_step(self.now))
        for conn in sorted(ep.connections()):
            self.apply(ep.connection_lost(conn, self.now))
        while (deadline := ep.get_timer()) is not None:
            self.now = max(self.now, deadline)
            self.apply(ep.handle_timer(self.now))
        assert all(state == (GATE_OPEN, 0) for state in ep.gates().values())
        assert ep.publications() == {}
        assert set(ep.requests().values()) <= {"registered", "sending"}
        self.apply(ep.abort(list(ep.requests()), "aborted by Prefill", self.now))
        assert ep.is_idle()


TestProducerModel = ProducerModel.TestCase
TestProducerModel.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
