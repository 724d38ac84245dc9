"""The Prefill endpoint, driven with hand-built Decode replies.

Helpers at the top are shared with ``test_producer_model.py``. Replies reach the endpoint
as raw frames (``encode``), and its messages are read back through an encode/decode trip,
so every test also exercises the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgpack
import pytest

from rd2h_protocol.errors import (
    ConfigError,
    ErrorCode,
    LocalProtocolError,
    TopologyError,
    TransferError,
)
from rd2h_protocol.events import Chunk
from rd2h_protocol.machines.producer import C_RECV_ACK_V2, CONN_READY_V2, CONNECTION_HANDSHAKE
from rd2h_protocol.producer import (
    Connect,
    DecodeTarget,
    Disconnect,
    GateOpened,
    LayerReplied,
    Output,
    ProducerConfig,
    ProducerEndpoint,
    PublicationView,
    RequestFinished,
    Send,
)
from rd2h_protocol.producer.handshakes import ConnectionEffects
from rd2h_protocol.wire.codec import decode, encode
from rd2h_protocol.wire.layout import LayerLayout, decode_layer_metadata
from rd2h_protocol.wire.messages import (
    ALL_CAPABILITIES,
    CAP_LEASE,
    CAP_RECONNECT,
    CAP_RESEND,
    CAP_SEQ,
    Abort,
    Ack,
    FailedRequest,
    Message,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
)

HOST = "127.0.0.1"
BASE_PORT = 20000
CONN = f"{HOST}:{BASE_PORT}"  # Decode rank 0 of the default engine
OTHER_PORT = 21000
OTHER = f"{HOST}:{OTHER_PORT}"  # a second Decode engine


# -- helpers -------------------------------------------------------------------------------


def layout(storage: int, *, indexer: bool = True) -> LayerLayout:
    """A layer whose tensors live in storage number ``storage`` (same number, same buffers)."""
    base = 0x1000_0000 * (storage + 1)
    addrs = [base, base + 0x100_0000]
    if indexer:
        addrs.append(base + 0x200_0000)
    return LayerLayout(
        base_addrs=addrs,
        block_len=[1024, 1024, 128][: len(addrs)],
        tensor_group_idx=[0, 0, 1][: len(addrs)],
    )


def layers(n: int, storages: int | None = None, *, indexer: bool = True) -> list[Any]:
    """``n`` layers over ``storages`` storages (default: one storage per layer)."""
    ring = storages or n
    return [(f"model.layers.{i}.self_attn", layout(i % ring, indexer=indexer)) for i in range(n)]


def endpoint(n_layers: int = 2, storages: int | None = None, **kw: Any) -> ProducerEndpoint:
    cfg: dict[str, Any] = {"p_rank": 0, "p_tp": 1, "session": "prefill-0"}
    cfg.update(kw)
    cfg.setdefault("layers", layers(n_layers, storages))
    return ProducerEndpoint(ProducerConfig(**cfg))


def target(d_tp: int = 1, base_port: int = BASE_PORT) -> DecodeTarget:
    return DecodeTarget(HOST, base_port, d_tp)


def ack_v2(caps: Sequence[str] = ALL_CAPABILITIES) -> bytes:
    return encode(Ack(protocol_version=2, capabilities=list(caps)))


ACK_V1_FRAME = b"ACK"


def sends(out: Sequence[Output], kind: type[Any] | None = None) -> list[Any]:
    """The messages of the Send outputs (of one kind), each through an encode/decode trip."""
    msgs = [decode(encode(o.msg)) for o in out if isinstance(o, Send)]
    return [m for m in msgs if kind is None or isinstance(m, kind)]


def readiness(out: Sequence[Output], conn: str | None = None) -> list[ReadReadyBatch]:
    msgs = [
        decode(encode(o.msg))
        for o in out
        if isinstance(o, Send) and (conn is None or o.conn == conn)
    ]
    return [m for m in msgs if isinstance(m, ReadReadyBatch)]


def finished(out: Sequence[Output]) -> dict[str, RequestFinished]:
    return {o.ext_req_id: o for o in out if isinstance(o, RequestFinished)}


def opened(out: Sequence[Output]) -> list[int]:
    return [o.slot for o in out if isinstance(o, GateOpened)]


def done(msg: ReadReadyBatch, failed: list[FailedRequest] | None = None) -> bytes:
    """The reply a Decode sends after reading ``msg`` (no seq toward a v1 Prefill)."""
    return encode(ReadDone(layer_idx=msg.layer_idx, seq=msg.seq, failed=failed))


def failed(msg: ReadReadyBatch, error: str = "read failed", code: int | None = None) -> bytes:
    if msg.seq is None:
        return encode(ReadFailed(layer_idx=msg.layer_idx, error=error))
    return encode(ReadFailed(layer_idx=msg.layer_idx, error=error, seq=msg.seq, code=code))


def write_layers(ep: ProducerEndpoint, layers_: Sequence[int], now: float) -> list[Output]:
    out: list[Output] = []
    for layer in layers_:
        assert ep.can_overwrite(layer)
        out += ep.layer_written(layer, now)
    return out


def chunk(
    ext_id: str,
    ids: list[int],
    indexer: list[int] | None = None,
    start: int = 0,
    final: bool = True,
) -> Chunk:
    """A chunk whose indexer blocks are its main blocks unless given, both from ``start``."""
    return Chunk(
        ext_req_id=ext_id,
        main_block_ids=ids,
        indexer_block_ids=ids if indexer is None else indexer,
        main_start=start,
        indexer_start=start,
        final=final,
    )


def one_request_ready(
    ep: ProducerEndpoint, ack: bytes = b"", final: bool = True
) -> list[ReadReadyBatch]:
    """r1 to the default engine, one chunk over every layer, handshake answered."""
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1, 2], indexer=[3], final=final), 0.0)
    out = write_layers(ep, range(len(ep.config.layers)), 1.0)
    out += ep.receive(CONN, ack or ack_v2(), 1.0)
    return readiness(out)


def snapshot(ep: ProducerEndpoint) -> tuple[Any, ...]:
    return (ep.gates(), ep.requests(), ep.publications(), ep.connections())


# -- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"layers": []}, "at least one"),
        ({"layers": [("a", layout(0)), ("a", layout(1))]}, "unique"),
        ({"lease_ms": 0}, "lease_ms"),
        ({"lease_ms": 1 << 32}, "lease_ms"),
        ({"read_failure_policy": "ignore"}, "read_failure_policy"),
        ({"protocol": "v3"}, "protocol"),
        ({"handshake_timeout_s": 0.0}, "handshake_timeout_s"),
        ({"history": -1}, "history"),
        ({"v1_lease_expiry": "ignore"}, "v1_lease_expiry"),
        ({"refused_retry_s": 0.0}, "refused_retry_s"),
        ({"refused_retry_s": 10.0, "refused_retry_max_s": 5.0}, "refused_retry_max_s"),
    ],
)
def test_config_refuses_bad_values(kw: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {"p_rank": 0, "p_tp": 1, "session": "s", "layers": layers(1)}
    base.update(kw)
    with pytest.raises(ConfigError, match=match):
        ProducerConfig(**base)


def test_config_refuses_bad_rank() -> None:
    with pytest.raises(TopologyError):
        ProducerConfig(p_rank=2, p_tp=2, session="s", layers=layers(1))


# -- handshake -----------------------------------------------------------------------------


def test_v2_handshake_queues_readiness_then_flushes_it_with_seq_and_lease() -> None:
    ep = endpoint(2)
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1, 2], indexer=[3]), 0.0)
    out = ep.layer_written(0, 1.0)
    assert out[0] == Connect(CONN, HOST, BASE_PORT)
    (meta,) = sends(out)
    assert isinstance(meta, MfMeta)
    assert meta.p_session == "prefill-0"
    assert meta.protocol_version == 2
    assert meta.capabilities == list(ALL_CAPABILITIES)
    assert list(decode_layer_metadata(meta.encoded_layer_metadata)) == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]
    assert ep.layer_written(1, 1.5) == []  # queued behind the same handshake
    assert ep.connections() == {CONN: "handshaking"}
    assert ep.get_timer() == pytest.approx(11.0)  # the handshake deadline comes first

    msgs = readiness(ep.receive(CONN, ack_v2(), 2.0))
    assert ep.connections() == {CONN: "ready_v2"}
    assert [(m.layer_idx, m.seq, m.lease_ms) for m in msgs] == [(0, 0, 29000), (1, 1, 29500)]
    assert [m.done_ext_ids for m in msgs] == [[], ["r1"]]
    assert msgs[0].layer_name == "model.layers.0.self_attn"
    assert (msgs[0].group_member_idx, msgs[0].tp_ratio) == (0, 1)
    (entry,) = msgs[0].read_reqs
    assert (entry.ext_req_id, entry.main_block_ids, entry.indexer_block_ids) == ("r1", [1, 2], [3])
    assert ep.get_timer() == pytest.approx(31.0)  # the first lease


def test_v2_mf_meta_says_where_readiness_seqs_resume() -> None:
    ep = endpoint(2)
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1, 2], indexer=[3]), 0.0)
    out = write_layers(ep, range(2), 1.0)
    (handshake,) = sends(out, MfMeta)
    out += ep.receive(CONN, ack_v2(), 1.0)
    msgs = readiness(out)
    assert [m.seq for m in msgs] == [handshake.first_seq, handshake.first_seq + 1]
    forced_v1 = endpoint(2, protocol="v1")
    forced_v1.add_request("r1", target(), 0.0)
    forced_v1.schedule_chunk(chunk("r1", [1, 2], indexer=[3]), 0.0)
    (v1_meta,) = sends(write_layers(forced_v1, range(2), 1.0), MfMeta)
    assert v1_meta.first_seq is None and len(msgpack.unpackb(encode(v1_meta))) == 3


def test_compat_string_travels_in_mf_meta() -> None:
    ep = endpoint(1, compat="glm5|bf16|bs128|layout1")
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1]), 0.0)
    (meta,) = sends(ep.layer_written(0, 0.0))
    assert meta.compat == "glm5|bf16|bs128|layout1"


def test_v1_peer_gets_v1_shapes_only() -> None:
    ep = endpoint(2)
    msgs = one_request_ready(ep, ACK_V1_FRAME)
    assert ep.connections() == {CONN: "ready_v1"}
    for msg in msgs:
        assert (msg.seq, msg.lease_ms) == (None, None)
        frame = encode(msg)
        assert len(msgpack.unpackb(frame)) == 7  # exactly the v1 tuple
    out = ep.receive(CONN, done(msgs[0]), 2.0) + ep.receive(CONN, done(msgs[1]), 2.0)
    assert finished(out)["r1"].ok


def test_forced_v1_sends_v1_mf_meta_and_ignores_v2_ack() -> None:
    ep = endpoint(1, protocol="v1")
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1]), 0.0)
    out = ep.layer_written(0, 0.0)
    meta_frame = encode(next(o.msg for o in out if isinstance(o, Send)))
    assert len(msgpack.unpackb(meta_frame)) == 3
    (msg,) = readiness(ep.receive(CONN, ack_v2(), 0.5))
    assert ep.connections() == {CONN: "ready_v1"}
    assert (msg.seq, msg.lease_ms) == (None, None)


def test_v2_peer_features_follow_its_capabilities() -> None:
    ep = endpoint(1)
    (msg,) = one_request_ready(ep, ack_v2([CAP_SEQ, "future-cap"]))
    assert (msg.seq, msg.lease_ms) == (0, None)
    # No "abort" capability: an expired lease cannot be told, so it is held like a v1 one.
    out = ep.handle_timer(31.0)
    assert sends(out, Abort) == []
    assert opened(out) == []
    assert finished(out)["r1"].code == ErrorCode.LEASE_EXPIRED
    assert ep.publications()[0].state == "held"


def test_slow_handshake_blocks_only_its_own_connection() -> None:
    ep = endpoint(1)
    ep.add_request("r1", target(), 0.0)
    ep.add_request("r2", target(base_port=OTHER_PORT), 0.0)
    ep.schedule_chunk(chunk("r1", [1]), 0.0)
    ep.schedule_chunk(chunk("r2", [2]), 0.0)
    out = ep.layer_written(0, 1.0)
    assert [o for o in out if isinstance(o, Connect)] == [
        Connect(CONN, HOST, BASE_PORT),
        Connect(OTHER, HOST, OTHER_PORT),
    ]
    assert ep.gates() == {0: ("closed", 2), 1: ("closed", 2)}
    (msg,) = readiness(ep.receive(CONN, ack_v2(), 1.1), CONN)  # OTHER never answers
    out = ep.receive(CONN, done(msg), 1.2)
    assert finished(out)["r1"].ok
    assert ep.gates() == {0: ("closed", 1), 1: ("closed", 1)}
    assert not ep.can_overwrite(0)

    assert ep.handle_timer(10.9) == []
    out = ep.handle_timer(11.0)  # the handshake with OTHER timed out: no deadlock
    assert opened(out) == [0, 1]
    r2 = finished(out)["r2"]
    assert (r2.ok, r2.code) == (False, ErrorCode.TIMEOUT)
    assert "timed out" in r2.message
    assert ep.connections()[OTHER] == "idle"
    assert ep.stats.handshake_timeouts == 1
    assert ep.can_overwrite(0)
    assert ep.is_idle()
    ep.end_step(12.0)

    # The next request to OTHER starts a new handshake on the same DEALER (no Connect).
    ep.add_request("r3", target(base_port=OTHER_PORT), 13.0)
    ep.schedule_chunk(chunk("r3", [1]), 0.0)
    out = ep.layer_written(0, 13.0)
    assert not any(isinstance(o, Connect) for o in out)
    assert isinstance(sends(out)[0], MfMeta)
    assert ep.stats.handshakes == 3


def test_refused_handshake_fails_queued_and_later_requests_at_once() -> None:
    ep = endpoint(1)
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1]), 0.0)
    ep.layer_written(0, 0.0)
    refusal = Ack(
        protocol_version=2,
        capabilities=[],
        error_code=ErrorCode.INCOMPATIBLE,
        error="compat: prefill 'a' != decode 'b'",
    )
    out = ep.receive(CONN, encode(refusal), 0.5)
    r1 = finished(out)["r1"]
    assert (r1.ok, r1.code) == (False, ErrorCode.INCOMPATIBLE)
    assert "prefill 'a' != decode 'b'" in r1.message
    assert opened(out) == [0, 1]
    assert ep.connections() == {CONN: "refused"}
    assert ep.stats.handshakes_refused == 1
    ep.end_step(0.6)

    ep.add_request("r2", target(), 1.0)
    ep.schedule_chunk(chunk("r2", [1]), 0.0)
    out = ep.layer_written(0, 1.0)
    assert sends(out) == []
    assert opened(out) == [0, 1]
    assert finished(out)["r2"].code == ErrorCode.INCOMPATIBLE
    ep.end_step(1.1)
    assert ep.is_idle()


def test_refused_connection_does_not_report_a_gate_another_connection_holds() -> None:
    ep = endpoint(1)
    ep.add_request("a", target(), 0.0)
    ep.schedule_chunk(chunk("a", [1]), 0.0)
    ep.layer_written(0, 0.0)
    ep.receive(CONN, encode(Ack(protocol_version=2, error_code=13, error="compat")), 0.1)
    ep.end_step(0.2)
    ep.add_request("b", target(), 1.0)  # to the refused endpoint
    ep.add_request("c", target(base_port=OTHER_PORT), 1.0)
    ep.schedule_chunk(chunk("b", [1]), 0.0)
    ep.schedule_chunk(chunk("c", [1]), 0.0)
    out = ep.layer_written(0, 1.0)
    assert opened(out) == []  # c's publication still holds the storage
    assert finished(out)["b"].code == ErrorCode.INCOMPATIBLE
    assert ep.gates() == {0: ("closed", 1), 1: ("closed", 1)}


def test_refusal_without_reason_still_says_who_refused() -> None:
    ep = endpoint(1)
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1]), 0.0)
    ep.layer_written(0, 0.0)
    out = ep.receive(CONN, encode(Ack(protocol_version=2, error_code=13)), 0.5)
    assert CONN in finished(out)["r1"].message
    assert "no reason given" in finished(out)["r1"].message


def test_ack_outside_a_handshake_is_dropped() -> None:
    ep = endpoint(1)
    one_request_ready(ep)
    before = snapshot(ep)
    assert ep.receive(CONN, ack_v2(), 2.0) == []
    assert ep.receive(CONN, ACK_V1_FRAME, 2.0) == []
    assert snapshot(ep) == before
    assert ep.stats.dropped == 2


# -- topology ------------------------------------------------------------------------------


def test_unequal_tp_four_to_two() -> None:
    ep = endpoint(1, p_rank=3, p_tp=4)
    ep.add_request("r1", target(d_tp=2), 0.0)
    ep.schedule_chunk(chunk("r1", [1]), 0.0)
    out = ep.layer_written(0, 0.0)
    assert out[0] == Connect(f"{HOST}:{BASE_PORT + 1}", HOST, BASE_PORT + 1)
    (msg,) = readiness(ep.receive(f"{HOST}:{BASE_PORT + 1}", ack_v2(), 0.1))
    assert (msg.group_member_idx, msg.tp_ratio) == (1, 2)


def test_two_decode_engines_with_different_tp_get_their_own_identity() -> None:
    ep = endpoint(1, p_rank=3, p_tp=4)
    engine_a = target(d_tp=4)  # ratio 1: this rank is d_rank 3, member 0
    engine_b = target(d_tp=1, base_port=OTHER_PORT)  # ratio 4: d_rank 0, member 3
    ep.add_request("a", engine_a, 0.0)
    ep.add_request("b", engine_b, 0.0)
    ep.schedule_chunk(chunk("a", [1]), 0.0)
    ep.schedule_chunk(chunk("b", [2]), 0.0)
    ep.layer_written(0, 0.0)
    conn_a = f"{HOST}:{BASE_PORT + 3}"
    assert set(ep.connections()) == {conn_a, OTHER}
    (msg_a,) = readiness(ep.receive(conn_a, ack_v2(), 0.1))
    (msg_b,) = readiness(ep.receive(OTHER, ack_v2(), 0.1))
    assert (msg_a.group_member_idx, msg_a.tp_ratio) == (0, 1)
    assert (msg_b.group_member_idx, msg_b.tp_ratio) == (3, 4)
    assert [r.ext_req_id for r in msg_a.read_reqs] == ["a"]
    assert [r.ext_req_id for r in msg_b.read_reqs] == ["b"]


def test_topology_errors_surface_at_registration() -> None:
    ep = endpoint(1, p_rank=0, p_tp=2)
    with pytest.raises(TopologyError):
        ep.add_request("r1", target(d_tp=3), 0.0)  # 2 % 3 != 0
    with pytest.raises(TopologyError):
        ep.add_request("r1", DecodeTarget(HOST, 65536, 1), 0.0)
    ep.add_request("r1", target(d_tp=1), 0.0)
    with pytest.raises(TopologyError, match="TP size"):
        ep.add_request("r2", target(d_tp=2), 0.0)  # same port, different TP: two engines?
    with pytest.raises(LocalProtocolError, match="already registered"):
        ep.add_request("r1", target(d_tp=1), 0.0)


# -- storage-slot gates --------------------------------------------------------------------


def test_reuse_ring_waits_for_every_endpoint_of_the_previous_owner() -> None:
    ep = endpoint(8, storages=3)
    assert [ep.layer_slots(i) for i in range(4)] == [(0, 1), (2, 3), (4, 5), (0, 1)]
    ep.add_request("a", target(), 0.0)
    ep.add_request("b", target(base_port=OTHER_PORT), 0.0)
    ep.schedule_chunk(chunk("a", [1, 2], indexer=[1]), 0.0)
    ep.schedule_chunk(chunk("b", [3], indexer=[2]), 0.0)
    write_layers(ep, [0, 1, 2], 1.0)
    msgs = {
        CONN: readiness(ep.receive(CONN, ack_v2(), 1.0)),
        OTHER: readiness(ep.receive(OTHER, ACK_V1_FRAME, 1.0)),
    }
    replies = {conn: {m.layer_idx: m for m in ms} for conn, ms in msgs.items()}
    for layer in range(3, 8):
        owner = layer - 3
        assert not ep.can_overwrite(layer)
        with pytest.raises(LocalProtocolError, match="still"):
            ep.layer_written(layer, 2.0)
        out = ep.receive(CONN, done(replies[CONN][owner]), 2.0)
        assert opened(out) == []
        assert not ep.can_overwrite(layer)  # OTHER has not replied for the previous owner
        out = ep.receive(OTHER, done(replies[OTHER][owner]), 2.0)
        assert opened(out) == list(ep.layer_slots(owner))
        assert ep.can_overwrite(layer)
        out = ep.layer_written(layer, 2.0)
        for conn in (CONN, OTHER):
            (msg,) = readiness(out, conn)
            replies[conn][layer] = msg
    out = []
    for layer in (5, 6, 7):
        for conn in (CONN, OTHER):
            out += ep.receive(conn, done(replies[conn][layer]), 3.0)
    assert set(finished(out)) == {"a", "b"}
    assert all(state == ("open", 0) for state in ep.gates().values())
    ep.end_step(3.0)
    assert ep.is_idle()


def test_layer_without_indexer_has_one_slot_and_empty_layers_publish_nothing() -> None:
    ep = endpoint(layers=[("l0", layout(0, indexer=False))])
    assert ep.layer_slots(0) == (0,)
    assert ep.layer_written(0, 0.0) == []  # no request in the step
    assert ep.gates() == {0: ("open", 0)}
    ep.end_step(0.0)
    assert ep.is_idle()


# -- reply correlation ---------------------------------------------------------------------


def test_stale_duplicate_and_unknown_replies_are_counted_and_change_nothing() -> None:
    ep = endpoint(2)
    m0, m1 = one_request_ready(ep)
    ignored = [
        encode(ReadDone(layer_idx=0, seq=7)),  # never sent
        encode(ReadDone(layer_idx=1, seq=0)),  # seq 0 is layer 0's
    ]
    before = snapshot(ep)
    for frame in ignored:
        assert ep.receive(CONN, frame, 2.0) == []
    assert snapshot(ep) == before
    assert ep.stats.unknown_replies == 2

    assert opened(ep.receive(CONN, done(m0), 2.0)) == [0, 1]
    before = snapshot(ep)
    for frame in (done(m0), failed(m0), failed(m0, code=ErrorCode.UNKNOWN_SESSION)):
        assert ep.receive(CONN, frame, 2.1) == []
    assert ep.receive(CONN, encode(ReadDone(layer_idx=1, seq=0)), 2.1) == []  # wrong layer
    assert snapshot(ep) == before
    assert ep.stats.duplicate_replies == 3
    assert ep.stats.unknown_replies == 3

    out = ep.handle_timer(31.0)  # m1 is never answered
    assert finished(out)["r1"].code == ErrorCode.LEASE_EXPIRED
    assert ep.receive(CONN, done(m1), 32.0) == []
    assert ep.stats.stale_replies == 1
    assert ep.stats.replies == 1


def test_v1_replies_match_the_oldest_publication_of_their_layer() -> None:
    ep = endpoint(2)
    _m0, _m1 = one_request_ready(ep, ACK_V1_FRAME)
    assert opened(ep.receive(CONN, encode(ReadDone(layer_idx=1)), 2.0)) == [2, 3]
    assert ep.gates()[0] == ("closed", 1)
    assert ep.receive(CONN, encode(ReadDone(layer_idx=1)), 2.0) == []
    assert ep.stats.duplicate_replies == 1
    # A seq from a peer that never announced it is not trusted: layer matching still.
    out = ep.receive(CONN, encode(ReadDone(layer_idx=0, seq=99)), 2.0)
    assert opened(out) == [0, 1]
    assert finished(out)["r1"].ok
    assert ep.receive(CONN, encode(ReadFailed(layer_idx=0)), 2.0) == []
    assert ep.stats.duplicate_replies == 2
    assert ep.receive(CONN, encode(ReadDone(layer_idx=5)), 2.0) == []
    assert ep.stats.unknown_replies == 1


@pytest.mark.parametrize("ack", [ACK_V1_FRAME, b""], ids=["v1-decode", "v2-decode"])
def test_gapped_layer_numbers_go_on_the_wire_and_replies_match_them(ack: bytes) -> None:
    # Cache-bearing layers 1, 2, 4 (no KV in 0 and 3): the wire carries each name's
    # number, as a v1 Decode expects, and replies naming it open that layer's storage.
    names = [f"model.layers.{n}.self_attn" for n in (1, 2, 4)]
    ep = endpoint(layers=[(name, layout(i)) for i, name in enumerate(names)])
    msgs = one_request_ready(ep, ack)
    assert [(m.layer_idx, m.layer_name) for m in msgs] == list(zip((1, 2, 4), names, strict=True))
    assert opened(ep.receive(CONN, done(msgs[2]), 2.0)) == list(ep.layer_slots(2))
    # A reply for a number that is no layer of ours (0, 3) matches nothing.
    assert ep.receive(CONN, encode(ReadDone(layer_idx=3)), 2.0) == []
    assert ep.stats.unknown_replies == 1
    out = ep.receive(CONN, done(msgs[0]), 2.0) + ep.receive(CONN, done(msgs[1]), 2.0)
    assert finished(out)["r1"].ok


def test_two_layers_with_one_wire_number_are_refused() -> None:
    twins = [("a.layers.3.attn", layout(0)), ("b.layers.3.attn", layout(1))]
    with pytest.raises(ConfigError, match="both be layer 3"):
        endpoint(layers=twins)


def test_history_is_bounded() -> None:
    ep = endpoint(2, history=1)
    m0, m1 = one_request_ready(ep)
    ep.receive(CONN, done(m0), 2.0)
    ep.receive(CONN, done(m1), 2.0)
    assert ep.receive(CONN, done(m0), 2.0) == []  # forgotten: unknown
    assert ep.receive(CONN, done(m1), 2.0) == []  # remembered: duplicate
    assert (ep.stats.unknown_replies, ep.stats.duplicate_replies) == (1, 1)

    ep = endpoint(1, history=0)
    (m0,) = one_request_ready(ep)
    ep.receive(CONN, done(m0), 2.0)
    assert ep.receive(CONN, done(m0), 2.0) == []
    assert (ep.stats.unknown_replies, ep.stats.duplicate_replies) == (1, 0)


# -- leases --------------------------------------------------------------------------------


def test_lease_expiry_sends_abort_then_reopens_then_fails() -> None:
    ep = endpoint(2)
    one_request_ready(ep)
    assert ep.handle_timer(30.99) == []
    out = ep.handle_timer(31.5)  # both layers' leases (deadline 31.0) ran out
    kinds = [type(o).__name__ for o in out]
    assert kinds == [
        "Send",
        "GateOpened",
        "GateOpened",
        "GateOpened",
        "GateOpened",
        "RequestFinished",
    ]
    (abort,) = sends(out, Abort)
    assert abort.ext_ids == ["r1"]  # once, although two publications named it
    assert "lease" in abort.reason
    r1 = finished(out)["r1"]
    assert (r1.ok, r1.code) == (False, ErrorCode.LEASE_EXPIRED)
    assert ep.stats.expired_leases == 2
    assert ep.stats.aborts_sent == 1
    assert ep.get_timer() is None
    assert ep.is_idle()


def test_lease_expiry_with_two_endpoints_aborts_both_before_reopening() -> None:
    ep = endpoint(1)
    ep.add_request("a", target(), 0.0)
    ep.add_request("b", target(base_port=OTHER_PORT), 0.0)
    ep.schedule_chunk(chunk("a", [1]), 0.0)
    ep.schedule_chunk(chunk("b", [2]), 0.0)
    ep.layer_written(0, 1.0)
    ep.receive(CONN, ack_v2(), 1.0)
    ep.receive(OTHER, ack_v2(), 1.0)
    out = ep.handle_timer(31.0)
    sent = [(o.conn, o.msg.ext_ids) for o in out if isinstance(o, Send)]
    assert sent == [(CONN, ["a"]), (OTHER, ["b"])]
    first_open = next(i for i, o in enumerate(out) if isinstance(o, GateOpened))
    last_abort = max(i for i, o in enumerate(out) if isinstance(o, Send))
    assert last_abort < first_open  # S1: every abort precedes the reopening
    assert ep.gates() == {0: ("open", 0), 1: ("open", 0)}
    assert {k: v.code for k, v in finished(out).items()} == {
        "a": ErrorCode.LEASE_EXPIRED,
        "b": ErrorCode.LEASE_EXPIRED,
    }


def test_v1_lease_expiry_reopen_is_v1s_unsafe_behaviour() -> None:
    ep = endpoint(1, v1_lease_expiry="reopen")
    one_request_ready(ep, ACK_V1_FRAME)
    out = ep.handle_timer(31.0)
    assert sends(out) == []
    assert opened(out) == [0, 1]  # nobody told the peer: it may still be reading
    assert finished(out)["r1"].code == ErrorCode.LEASE_EXPIRED
    assert (ep.stats.unsafe_reopens, ep.stats.held_leases) == (1, 0)
    assert ep.receive(CONN, encode(ReadDone(layer_idx=0)), 32.0) == []
    assert ep.stats.stale_replies == 1


def test_lease_expiry_of_readiness_that_never_left() -> None:
    ep = endpoint(1, lease_ms=1000)
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1]), 0.0)
    ep.layer_written(0, 0.0)
    out = ep.handle_timer(1.0)  # the handshake (10 s) is still running
    assert sends(out) == []  # nothing was on the wire, nothing to abort
    assert opened(out) == [0, 1]
    assert finished(out)["r1"].code == ErrorCode.LEASE_EXPIRED
    assert ep.connections() == {CONN: "handshaking"}
    assert ep.receive(CONN, ack_v2(), 2.0) == []  # its queue is empty now
    assert ep.connections() == {CONN: "ready_v2"}


def test_readiness_whose_lease_ran_out_during_the_handshake_is_not_sent() -> None:
    ep = endpoint(1, lease_ms=1000)
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1]), 0.0)
    ep.layer_written(0, 0.0)
    out = ep.receive(CONN, ack_v2(), 1.0)  # the ACK comes before the lease timer runs
    assert readiness(out) == []  # lease_ms 0 would let Decode read a reopened storage
    assert opened(out) == [0, 1]
    assert finished(out)["r1"].code == ErrorCode.LEASE_EXPIRED
    assert ep.handle_timer(1.0) == []


def test_raise_policy_makes_the_layer_entry_check_raise_once() -> None:
    ep = endpoint(2, read_failure_policy="raise")
    m0, m1 = one_request_ready(ep)
    out = ep.receive(CONN, failed(m0, "memfabric read returned -5", ErrorCode.TRANSFER_FAILED), 2.0)
    assert opened(out) == [0, 1]  # released so the compute path raises instead of hanging
    with pytest.raises(TransferError, match="memfabric read returned -5"):
        ep.can_overwrite(0)
    assert ep.can_overwrite(0)  # raised once
    out = ep.receive(CONN, done(m1), 2.0)
    r1 = finished(out)["r1"]
    assert (r1.ok, r1.code) == (False, ErrorCode.TRANSFER_FAILED)
    assert ep.can_overwrite(1)


def test_raise_policy_error_belongs_to_its_storage_only() -> None:
    ep = endpoint(2, read_failure_policy="raise")
    m0, m1 = one_request_ready(ep)
    ep.receive(CONN, failed(m1, "layer 1 failed"), 2.0)
    ep.receive(CONN, done(m0), 2.0)
    assert ep.can_overwrite(0)  # layer 0's storage was read fine
    with pytest.raises(TransferError, match="layer 1 failed"):
        ep.can_overwrite(1)


def test_raise_policy_error_is_dropped_once_the_storage_is_overwritten() -> None:
    ep = endpoint(2, read_failure_policy="raise")
    m0, m1 = one_request_ready(ep)
    ep.receive(CONN, done(m1, failed=[FailedRequest("r1", ErrorCode.DESTINATION_RANGE, "")]), 2)
    ep.end_step(2.0)
    ep.receive(CONN, done(m0), 2.0)
    ep.layer_written(1, 3.0)  # the runtime did not ask; the pending error is moot now
    assert ep.can_overwrite(1)


def test_isolate_policy_never_raises_and_reports_through_request_finished() -> None:
    ep = endpoint(1)
    (m0,) = one_request_ready(ep)
    out = ep.receive(CONN, failed(m0, "boom", 999), 2.0)  # a code from a newer peer
    assert ep.can_overwrite(0)
    r1 = finished(out)["r1"]
    assert (r1.ok, r1.code) == (False, ErrorCode.TRANSFER_FAILED)
    assert "boom" in r1.message
    assert ep.stats.read_failures == 1


def test_v1_read_failed_without_text_gets_a_message() -> None:
    ep = endpoint(1)
    (_m0,) = one_request_ready(ep, ACK_V1_FRAME)
    out = ep.receive(CONN, encode(ReadFailed(layer_idx=0)), 2.0)
    assert "TRANSFER_FAILED" in finished(out)["r1"].message


def test_isolated_failures_fail_only_their_requests() -> None:
    ep = endpoint(2)
    for ext_id in ("r1", "r2", "r3"):
        ep.add_request(ext_id, target(), 0.0)
        ep.schedule_chunk(chunk(ext_id, [1]), 0.0)
    ep.layer_written(0, 1.0)
    (m0,) = readiness(ep.receive(CONN, ack_v2(), 1.0))
    bad = [
        FailedRequest("r1", ErrorCode.UNKNOWN_REQUEST, "not known on Decode"),
        FailedRequest("r3", 999),
        FailedRequest("not-in-this-message", ErrorCode.UNKNOWN_REQUEST),
    ]
    out = ep.receive(CONN, done(m0, bad), 2.0)
    assert opened(out) == [0, 1]
    results = finished(out)
    assert (results["r1"].code, results["r3"].code) == (
        ErrorCode.UNKNOWN_REQUEST,
        ErrorCode.UNKNOWN,
    )
    assert "not known on Decode" in results["r1"].message
    assert "r2" not in results
    assert ep.stats.isolated_failures == 3
    (m1,) = readiness(ep.layer_written(1, 2.0))
    assert [r.ext_req_id for r in m1.read_reqs] == ["r2"]
    assert m1.done_ext_ids == ["r2"]
    assert finished(ep.receive(CONN, done(m1), 3.0))["r2"].ok


# -- reconnects ----------------------------------------------------------------------------


def test_unknown_session_rehandshakes_and_replays_once() -> None:
    ep = endpoint(2)
    m0, m1 = one_request_ready(ep)
    unknown = ErrorCode.UNKNOWN_SESSION
    out = ep.receive(CONN, failed(m0, "who are you", unknown), 5.0)
    assert not any(isinstance(o, Connect) for o in out)
    assert [type(m) for m in sends(out)] == [MfMeta]
    assert ep.connections() == {CONN: "handshaking"}
    # m1 went out under the same lost handshake: it was queued for the replay with m0, so
    # its own UNKNOWN_SESSION is a duplicate.
    assert ep.receive(CONN, failed(m1, "who are you", unknown), 5.0) == []
    assert ep.stats.duplicate_replies == 1
    assert ep.gates()[0] == ("closed", 1)  # still held: the replay may be read

    replays = readiness(ep.receive(CONN, ack_v2(), 6.0))
    assert [(m.layer_idx, m.seq, m.lease_ms) for m in replays] == [(0, 2, 25000), (1, 3, 25000)]
    assert ep.stats.replays == 2
    assert ep.receive(CONN, done(m0), 6.5) == []  # the superseded seq: answered already
    assert ep.stats.duplicate_replies == 2
    out = ep.receive(CONN, done(replays[0]), 7.0) + ep.receive(CONN, done(replays[1]), 7.0)
    assert finished(out)["r1"].ok


@pytest.mark.parametrize("answered", [0, 1])
def test_unknown_session_replays_what_went_out_under_it_in_order(answered: int) -> None:
    """One UNKNOWN_SESSION is news for every publication still out on the connection: the
    other's reply may be lost (the Decode restarted and a frame was dropped), and replaying
    only the answered layer let the last layer's done complete the request on Decode with
    the other layer unread (an S2 violation the stateful model found)."""
    ep = endpoint(2)
    sent = one_request_ready(ep)
    ep.receive(CONN, failed(sent[answered], "", ErrorCode.UNKNOWN_SESSION), 5.0)
    replays = readiness(ep.receive(CONN, ack_v2(), 6.0))
    assert [(m.layer_idx, m.seq) for m in replays] == [(0, 2), (1, 3)]  # the order they went
    assert ep.gates()[0] == ("closed", 1)
    out = ep.receive(CONN, done(replays[0]), 7.0) + ep.receive(CONN, done(replays[1]), 7.0)
    assert finished(out)["r1"].ok


def test_unknown_session_on_a_replay_fails_it_and_rehandshakes() -> None:
    ep = endpoint(1)
    (m0,) = one_request_ready(ep)
    ep.receive(CONN, failed(m0, "", ErrorCode.UNKNOWN_SESSION), 2.0)
    (replay,) = readiness(ep.receive(CONN, ack_v2(), 2.5))
    out = ep.receive(CONN, failed(replay, "", ErrorCode.UNKNOWN_SESSION), 3.0)
    assert [type(m) for m in sends(out)] == [MfMeta]  # later layers need a session again
    r1 = finished(out)["r1"]
    assert (r1.ok, r1.code) == (False, ErrorCode.UNKNOWN_SESSION)
    assert opened(out) == [0, 1]


def test_unknown_session_on_two_replays_rehandshakes_once() -> None:
    ep = endpoint(2)
    m0, m1 = one_request_ready(ep)
    unknown = ErrorCode.UNKNOWN_SESSION
    ep.receive(CONN, failed(m0, "", unknown), 2.0)
    ep.receive(CONN, failed(m1, "", unknown), 2.0)
    r0, r1 = readiness(ep.receive(CONN, ack_v2(), 2.5))
    out = ep.receive(CONN, failed(r0, "", unknown), 3.0)
    assert [type(m) for m in sends(out)] == [MfMeta]
    assert sends(ep.receive(CONN, failed(r1, "", unknown), 3.0)) == []  # one handshake runs
    assert ep.stats.handshakes == 3  # the first, after m0's reply, after r0's reply
    assert ep.requests() == {}
    ep.end_step(3.0)
    assert ep.is_idle()


def test_unknown_session_without_reconnect_capability_is_a_plain_failure() -> None:
    ep = endpoint(1)
    (m0,) = one_request_ready(ep, ack_v2([CAP_SEQ]))
    out = ep.receive(CONN, failed(m0, "", ErrorCode.UNKNOWN_SESSION), 2.0)
    assert sends(out) == []
    assert finished(out)["r1"].code == ErrorCode.UNKNOWN_SESSION


def test_abort_during_a_rehandshake_is_held_until_the_ack() -> None:
    ep = endpoint(1)
    (m0,) = one_request_ready(ep)
    ep.receive(CONN, failed(m0, "", ErrorCode.UNKNOWN_SESSION), 2.0)
    assert ep.abort(["r1"], "aborted by Prefill", 2.1) == []  # no session on the peer yet
    out = ep.receive(CONN, ack_v2(), 2.2)
    (replay,) = readiness(out)
    assert replay.read_reqs == [] and replay.done_ext_ids == []  # r1 is not published
    (abort,) = sends(out, Abort)
    assert abort.ext_ids == ["r1"]
    assert [type(o.msg) for o in out if isinstance(o, Send)] == [ReadReadyBatch, Abort]
    out = ep.receive(CONN, done(replay), 2.5)
    assert finished(out)["r1"].code == ErrorCode.ABORTED


def test_handshake_timeout_drops_held_aborts() -> None:
    ep = endpoint(1)
    (m0,) = one_request_ready(ep)
    ep.receive(CONN, failed(m0, "", ErrorCode.UNKNOWN_SESSION), 2.0)
    ep.abort(["r1"], "aborted by Prefill", 2.1)
    out = ep.handle_timer(12.0)
    assert sends(out) == []
    assert finished(out)["r1"].code == ErrorCode.ABORTED  # the first reason is reported
    assert ep.receive(CONN, ACK_V1_FRAME, 13.0) == []  # late: dropped
    assert ep.is_idle()


# -- aborts --------------------------------------------------------------------------------


def test_abort_stops_publishing_and_tells_a_v2_peer() -> None:
    ep = endpoint(2)
    ep.add_request("r1", target(), 0.0)
    ep.add_request("r2", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1]), 0.0)
    ep.schedule_chunk(chunk("r2", [2]), 0.0)
    ep.layer_written(0, 1.0)
    (m0,) = readiness(ep.receive(CONN, ack_v2(), 1.0))
    out = ep.abort(["r1", "nope"], "aborted by Prefill", 1.5)
    (abort,) = sends(out)
    assert isinstance(abort, Abort) and abort.ext_ids == ["r1"]
    assert finished(out) == {}  # layer 0 may still be read: wait for its reply
    assert ep.requests() == {"r1": "aborting", "r2": "final_scheduled"}
    (m1,) = readiness(ep.layer_written(1, 2.0))
    assert [r.ext_req_id for r in m1.read_reqs] == ["r2"]
    assert m1.done_ext_ids == ["r2"]
    assert ep.abort(["r1"], "aborted by Prefill", 2.0) == []  # aborting already
    out = ep.receive(CONN, done(m0), 2.5)
    r1 = finished(out)["r1"]
    assert (r1.ok, r1.code) == (False, ErrorCode.ABORTED)
    # r1 is forgotten now: a chunk for it is the caller's mistake.
    with pytest.raises(LocalProtocolError, match="not registered"):
        ep.schedule_chunk(chunk("r1", [1]), 0.0)
    assert finished(ep.receive(CONN, done(m1), 3.0))["r2"].ok
    ep.end_step(3.0)
    assert ep.is_idle()


def test_abort_toward_v1_peer_and_before_any_chunk() -> None:
    ep = endpoint(1)
    (_m0,) = one_request_ready(ep, ACK_V1_FRAME)
    assert ep.abort(["r1"], "aborted by Prefill", 2.0) == []  # a v1 peer cannot be told
    ep.add_request("r2", target(), 2.0)
    out = ep.abort(["r2"], "aborted by Prefill", 2.0)  # nothing out for it: finished at once
    assert finished(out)["r2"].code == ErrorCode.ABORTED


def test_chunks_for_an_ending_request_are_ignored() -> None:
    ep = endpoint(2)
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1], final=False), 0.0)
    ep.layer_written(0, 0.0)
    ep.abort(["r1"], "aborted by Prefill", 0.5)
    assert ep.end_step(0.5) == []  # aborting already: not failed for the missing layer
    assert (
        ep.schedule_chunk(
            chunk("r1", [2], start=1, final=False),
            0.0,
        )
        == []
    )
    assert (
        ep.schedule_chunk(
            chunk("r1", [3], start=2),
            0.0,
        )
        == []
    )
    assert ep.layer_written(1, 1.0) == []  # nothing: r1 is not published
    out = ep.handle_timer(11.0)  # the handshake never finished
    assert finished(out)["r1"].code == ErrorCode.ABORTED
    ep.end_step(11.0)
    assert ep.is_idle()


def test_abort_from_decode_stops_the_request_without_an_echo() -> None:
    ep = endpoint(2)
    m0, m1 = one_request_ready(ep)
    ep.add_request("r2", target(base_port=OTHER_PORT), 0.0)
    out = ep.receive(CONN, encode(Abort(ext_ids=["r1", "r2", "ghost"], reason="kv timeout")), 2.0)
    assert out == []  # r1 waits for its two publications; r2 is not CONN's request
    assert ep.requests() == {"r1": "aborting", "r2": "registered"}
    assert ep.stats.aborts_received == 1
    ep.receive(CONN, done(m0), 2.5)
    out = ep.receive(CONN, done(m1), 2.5)
    r1 = finished(out)["r1"]
    assert (r1.code, sends(out)) == (ErrorCode.ABORTED, [])
    assert "kv timeout" in r1.message
    ep.receive(OTHER, encode(Abort(ext_ids=["r2"])), 3.0)  # never connected: not a peer yet
    assert ep.requests() == {"r2": "registered"}


def test_abort_from_decode_after_a_failure_keeps_the_failure() -> None:
    ep = endpoint(2)
    m0, m1 = one_request_ready(ep)
    ep.receive(CONN, failed(m0, "bad", ErrorCode.TRANSFER_FAILED), 2.0)
    ep.receive(CONN, encode(Abort(ext_ids=["r1"])), 2.1)
    ep.abort(["r1"], "aborted by Prefill", 2.2)
    out = ep.receive(CONN, done(m1, [FailedRequest("r1", ErrorCode.ABORTED)]), 2.5)
    assert finished(out)["r1"].code == ErrorCode.TRANSFER_FAILED


# -- peers that cannot be told (S1 toward v1) -----------------------------------------------


@pytest.mark.parametrize(
    ("kw", "ack"),
    [
        ({}, ACK_V1_FRAME),  # a v1 peer
        ({"protocol": "v1"}, ack_v2()),  # everyone is v1
        ({}, ack_v2([CAP_SEQ, CAP_LEASE])),  # a v2 peer without the abort capability
    ],
    ids=["v1-peer", "forced-v1", "v2-without-abort"],
)
def test_v1_lease_expiry_hold_fails_at_once_but_keeps_the_gate_until_the_reply(
    kw: dict[str, Any], ack: bytes
) -> None:
    ep = endpoint(1, **kw)
    (m0,) = one_request_ready(ep, ack)
    out = ep.handle_timer(31.0)
    assert sends(out) == []
    assert opened(out) == []
    r1 = finished(out)["r1"]
    assert (r1.ok, r1.code) == (False, ErrorCode.LEASE_EXPIRED)
    ((_, view),) = ep.publications().items()
    assert (view.state, view.ext_ids) == ("held", ())
    assert ep.gates() == {0: ("expired", 1), 1: ("expired", 1)}
    assert not ep.can_overwrite(0)
    assert ep.requests() == {}
    assert not ep.is_idle()
    assert (ep.stats.held_leases, ep.stats.expired_leases) == (1, 1)
    # Nothing but the peer, its declared death or its silence frees it.
    assert ep.get_timer() == 31.0 + ep.config.silent_peer_timeout_s

    out = ep.receive(CONN, done(m0), 50.0)  # the peer finally replies, within that
    assert out == [GateOpened(0), GateOpened(1)]
    assert ep.can_overwrite(0)
    assert ep.is_idle()
    assert ep.receive(CONN, done(m0), 51.0) == []
    assert ep.stats.duplicate_replies == 1


def test_lease_expiry_toward_a_peer_without_leases_aborts_but_holds_until_the_reply() -> None:
    # Nothing bounds such a peer's reads: it may start one it was sent long ago, so the
    # ABORT goes out but the storage waits for the reply (S1).
    ep = endpoint(1)
    (m0,) = one_request_ready(ep, ack_v2([cap for cap in ALL_CAPABILITIES if cap != CAP_LEASE]))
    out = ep.handle_timer(31.0)
    (abort,) = sends(out, Abort)
    assert abort.ext_ids == ["r1"]
    # ...and asks for that reply: the readiness again under its seq, naming nobody now
    # (the peer answers a seq it saw from memory; one it never got it serves empty).
    (again,) = readiness(out)
    assert (again.seq, again.layer_idx, again.read_reqs, again.done_ext_ids) == (
        m0.seq,
        m0.layer_idx,
        [],
        [],
    )
    assert [type(m).__name__ for m in sends(out)] == ["Abort", "ReadReadyBatch"]
    assert ep.stats.resent == 1
    assert opened(out) == []
    r1 = finished(out)["r1"]
    assert (r1.ok, r1.code) == (False, ErrorCode.LEASE_EXPIRED)
    assert ep.gates() == {0: ("expired", 1), 1: ("expired", 1)}
    assert not ep.can_overwrite(0)
    out = ep.receive(CONN, failed(m0, "aborted", ErrorCode.ABORTED), 40.0)
    assert opened(out) == [0, 1]
    assert ep.is_idle()
    assert ep.stats.aborts_sent == 1


def test_resumed_connection_resends_what_is_unanswered_under_the_same_seqs() -> None:
    ep = endpoint(3)
    m0, m1, m2 = one_request_ready(ep)
    ep.receive(CONN, done(m0), 2.0)
    out = ep.connection_resumed(CONN, 11.0)
    assert [(m.seq, m.layer_idx, m.read_reqs, m.done_ext_ids) for m in readiness(out)] == [
        (m.seq, m.layer_idx, m.read_reqs, m.done_ext_ids) for m in (m1, m2)
    ]
    assert {m.lease_ms for m in readiness(out)} == {20_000}  # what is left of 30 s
    assert ep.stats.resent == 2
    # Replies to either copy count once; a second one is a duplicate.
    ep.receive(CONN, done(m1), 12.0)
    out = ep.receive(CONN, done(m2), 12.0)
    assert finished(out)["r1"].ok
    assert ep.receive(CONN, done(m2), 12.5) == []
    assert ep.stats.duplicate_replies == 1
    assert ep.is_idle()


def test_resumed_connection_resends_nothing_the_peer_cannot_answer_from_memory() -> None:
    ep = endpoint(2)
    one_request_ready(ep, ack_v2([c for c in ALL_CAPABILITIES if c != CAP_RESEND]))
    assert ep.connection_resumed(CONN, 2.0) == []
    ep = endpoint(2)
    one_request_ready(ep, ACK_V1_FRAME)
    assert ep.connection_resumed(CONN, 2.0) == []
    assert ep.stats.resent == 0


def test_resumed_connection_leaves_a_lease_that_ran_out_to_its_timer() -> None:
    # Resent with nothing left of its lease, the readiness could be read after the lease
    # timer reopened the storage.
    ep = endpoint(1)
    one_request_ready(ep)
    assert ep.connection_resumed(CONN, 31.0) == []  # deadline 31.0
    with pytest.raises(LocalProtocolError, match="not a Decode endpoint"):
        ep.connection_resumed("127.0.0.1:1", 31.0)


def test_a_silent_peer_holding_storage_is_declared_dead() -> None:
    # Issue 12: a v1 Decode that ACKs and never replies (libzmq answers its heartbeats)
    # held every storage it was sent for as long as it stayed connected.
    ep = endpoint(1, silent_peer_timeout_s=5.0)
    one_request_ready(ep, ACK_V1_FRAME)
    out = ep.handle_timer(31.0)  # lease over: held
    assert opened(out) == [] and ep.gates() == {0: ("expired", 1), 1: ("expired", 1)}
    assert ep.get_timer() == 36.0
    out = ep.handle_timer(36.0)
    # A fresh DEALER next time, and the runtime's log says why.
    assert out[0] == Disconnect(CONN, "nothing heard for 5.0 s while it held storage")
    assert opened(out) == [0, 1]
    assert ep.stats.silent_peers == 1 and ep.stats.connections_lost == 1
    assert ep.is_idle()
    # The next publication hand-shakes again on a new connection.
    ep.end_step(36.0)
    ep.add_request("r2", target(), 40.0)
    ep.schedule_chunk(chunk("r2", [1]), 0.0)
    out = write_layers(ep, [0], 40.0)
    assert isinstance(out[0], Connect) and isinstance(sends(out)[0], MfMeta)


def test_a_peer_that_answers_is_not_silent_even_if_it_holds_storage() -> None:
    ep = endpoint(2, silent_peer_timeout_s=5.0)
    m0, _ = one_request_ready(ep, ACK_V1_FRAME)
    ep.handle_timer(31.0)  # both held
    ep.receive(CONN, done(m0), 34.0)  # it answers one: alive
    assert ep.handle_timer(36.0) == []
    assert ep.get_timer() == 39.0  # five seconds after it was last heard
    out = ep.handle_timer(39.0)
    assert Disconnect(CONN, "nothing heard for 5.0 s while it held storage") in out
    assert opened(out) == [2, 3]


def test_silent_peer_rule_can_be_turned_off() -> None:
    ep = endpoint(1, silent_peer_timeout_s=None)
    one_request_ready(ep, ACK_V1_FRAME)
    ep.handle_timer(31.0)
    assert ep.get_timer() is None  # held until a reply or the runtime's verdict
    with pytest.raises(ConfigError, match="silent_peer_timeout_s"):
        endpoint(1, silent_peer_timeout_s=0)


def test_held_publication_is_freed_by_a_failure_reply_too() -> None:
    ep = endpoint(1)
    (m0,) = one_request_ready(ep, ACK_V1_FRAME)
    ep.handle_timer(31.0)
    out = ep.receive(CONN, failed(m0, "read failed late"), 40.0)
    assert opened(out) == [0, 1]
    assert finished(out) == {}  # r1 was reported at the expiry already
    assert ep.stats.read_failures == 0


def test_held_publication_is_freed_by_unknown_session_without_a_replay() -> None:
    ep = endpoint(1)
    (m0,) = one_request_ready(ep, ack_v2([CAP_SEQ, CAP_LEASE, CAP_RECONNECT]))
    ep.handle_timer(31.0)
    out = ep.receive(CONN, failed(m0, "", ErrorCode.UNKNOWN_SESSION), 40.0)
    assert out == [GateOpened(0), GateOpened(1)]  # it read nothing; no replay, no MF_META
    assert ep.connections() == {CONN: "ready_v2"}


def test_held_v1_gate_waits_for_every_endpoint_of_the_layer() -> None:
    ep = endpoint(1)
    ep.add_request("a", target(), 0.0)
    ep.add_request("b", target(base_port=OTHER_PORT), 0.0)
    ep.schedule_chunk(chunk("a", [1]), 0.0)
    ep.schedule_chunk(chunk("b", [2]), 0.0)
    ep.layer_written(0, 1.0)
    (ma,) = readiness(ep.receive(CONN, ACK_V1_FRAME, 1.0))
    (_mb,) = readiness(ep.receive(OTHER, ACK_V1_FRAME, 1.0))
    ep.handle_timer(31.0)
    assert ep.gates() == {0: ("expired", 2), 1: ("expired", 2)}
    assert ep.connection_lost(OTHER, 40.0) == []  # OTHER's share ends, CONN's still holds
    assert ep.gates() == {0: ("expired", 1), 1: ("expired", 1)}
    assert opened(ep.receive(CONN, done(ma), 41.0)) == [0, 1]


def test_lease_expiring_during_a_rehandshake_frees_what_the_lost_session_held() -> None:
    ep = endpoint(2)
    m0, m1 = one_request_ready(ep)
    ep.receive(CONN, failed(m1, "", ErrorCode.UNKNOWN_SESSION), 25.0)  # both requeued
    assert ep.connections() == {CONN: "handshaking"}
    assert ep.gates()[0] == ("closed", 1)  # the replay may yet be read
    out = ep.handle_timer(31.0)
    # The Decode lost the session both went out under: nothing reads them, no ABORT.
    assert sends(out) == []
    assert opened(out) == [0, 1, 2, 3]
    assert finished(out)["r1"].code == ErrorCode.LEASE_EXPIRED
    assert sends(ep.receive(CONN, ack_v2(), 32.0)) == []  # nothing left to replay
    assert ep.is_idle()
    assert ep.receive(CONN, done(m0), 33.0) == []  # its seq was superseded: counted
    assert ep.stats.duplicate_replies == 1


def test_rehandshake_sends_one_abort_for_an_aborted_request_whose_lease_ran_out() -> None:
    ep = endpoint(2)
    _m0, m1 = one_request_ready(ep)
    ep.receive(CONN, failed(m1, "", ErrorCode.UNKNOWN_SESSION), 25.0)
    ep.abort(["r1"], "aborted by Prefill", 26.0)  # queued behind the handshake: not sent yet
    out = ep.handle_timer(31.0)
    assert opened(out) == [0, 1, 2, 3]
    assert finished(out)["r1"].code == ErrorCode.ABORTED
    out = ep.receive(CONN, ack_v2(), 32.0)
    assert [m.ext_ids for m in sends(out, Abort)] == [["r1"]]  # once, not per reason


# -- refused connections ---------------------------------------------------------------------


def publish_one(ep: ProducerEndpoint, ext_id: str, now: float) -> list[Output]:
    """Register ``ext_id`` to the default engine and publish its one layer at ``now``."""
    ep.add_request(ext_id, target(), now)
    ep.schedule_chunk(chunk(ext_id, [1]), 0.0)
    out = ep.layer_written(0, now)
    ep.end_step(now)
    return out


REFUSAL = encode(Ack(protocol_version=2, error_code=13, error="compat: 'a' != 'b'"))


def test_refused_connection_is_retried_after_a_doubling_backoff() -> None:
    ep = endpoint(1, refused_retry_s=30.0, refused_retry_max_s=45.0)
    publish_one(ep, "r0", 0.0)
    ep.receive(CONN, REFUSAL, 0.5)  # next attempt from 30.5
    out = publish_one(ep, "r1", 30.0)
    assert sends(out) == []
    r1 = finished(out)["r1"]
    assert (r1.code, ep.connections()) == (ErrorCode.INCOMPATIBLE, {CONN: "refused"})
    assert "'a' != 'b'" in r1.message and "next handshake attempt in 0.5 s" in r1.message

    out = publish_one(ep, "r2", 30.5)
    assert [type(m) for m in sends(out)] == [MfMeta]  # fresh MF_META, same DEALER
    assert not any(isinstance(o, Connect) for o in out)
    assert finished(out) == {} and ep.stats.handshake_retries == 1
    out = ep.receive(CONN, REFUSAL, 31.0)  # refused again: 60 s, capped at 45
    assert finished(out)["r2"].code == ErrorCode.INCOMPATIBLE
    assert finished(publish_one(ep, "r3", 75.9))["r3"].code == ErrorCode.INCOMPATIBLE
    assert [type(m) for m in sends(publish_one(ep, "r4", 76.0))] == [MfMeta]
    (m,) = readiness(ep.receive(CONN, ack_v2(), 76.5))  # accepted at last
    assert finished(ep.receive(CONN, done(m), 77.0))["r4"].ok

    # The count starts over after a success: the next refusal waits 30 s again.
    ep.receive(CONN, failed(m, "", ErrorCode.UNKNOWN_SESSION), 78.0)  # stale: ignored
    assert ep.connection_lost(CONN, 78.0) == []
    publish_one(ep, "r5", 79.0)
    ep.receive(CONN, REFUSAL, 79.0)
    assert finished(publish_one(ep, "r6", 108.9))["r6"].code == ErrorCode.INCOMPATIBLE
    assert [type(m) for m in sends(publish_one(ep, "r7", 109.0))] == [MfMeta]


# -- connection lost -------------------------------------------------------------------------


def test_connection_lost_v2_aborts_at_once_and_reopens_when_the_lease_ends() -> None:
    ep = endpoint(2)
    one_request_ready(ep)
    out = ep.connection_lost(CONN, 5.0)
    assert [type(o).__name__ for o in out] == ["Send", "RequestFinished"]
    (abort,) = sends(out, Abort)
    assert abort.ext_ids == ["r1"]
    r1 = finished(out)["r1"]
    assert (r1.ok, r1.code) == (False, ErrorCode.CONNECTION_LOST)
    assert "connection to Decode endpoint" in r1.message and "was lost" in r1.message
    assert {v.state for v in ep.publications().values()} == {"orphaned"}
    assert ep.connections() == {CONN: "idle"}
    assert not ep.can_overwrite(0)  # a heartbeat does not prove no read is in flight
    assert ep.connection_lost(CONN, 6.0) == []  # said twice: nothing more
    assert ep.handle_timer(30.9) == []
    out = ep.handle_timer(31.0)
    assert out == [GateOpened(0), GateOpened(1), GateOpened(2), GateOpened(3)]
    assert ep.is_idle()
    assert (ep.stats.connections_lost, ep.stats.expired_leases) == (2, 0)


def test_connection_lost_after_a_v1_lease_expired_reopens_at_once() -> None:
    ep = endpoint(1)
    one_request_ready(ep, ACK_V1_FRAME)
    ep.handle_timer(31.0)
    assert ep.connection_lost(CONN, 40.0) == [GateOpened(0), GateOpened(1)]
    assert ep.is_idle()


def test_connection_lost_v1_within_the_lease_waits_for_the_lease() -> None:
    ep = endpoint(1)
    (_m0,) = one_request_ready(ep, ACK_V1_FRAME)
    out = ep.connection_lost(CONN, 5.0)
    assert sends(out) == []  # a v1 peer cannot be told
    assert finished(out)["r1"].code == ErrorCode.CONNECTION_LOST
    assert opened(out) == []
    assert opened(ep.handle_timer(31.0)) == [0, 1]


def test_reply_after_connection_lost_frees_the_storage_early() -> None:
    ep = endpoint(1)
    (m0,) = one_request_ready(ep)
    ep.connection_lost(CONN, 5.0)
    assert ep.receive(CONN, done(m0), 6.0) == [GateOpened(0), GateOpened(1)]
    assert ep.handle_timer(31.0) == []
    assert ep.is_idle()


def test_connection_lost_sends_no_second_abort_for_an_aborted_request() -> None:
    ep = endpoint(1)
    one_request_ready(ep)
    assert len(sends(ep.abort(["r1"], "aborted by Prefill", 2.0), Abort)) == 1
    out = ep.connection_lost(CONN, 3.0)
    assert sends(out) == []
    assert finished(out)["r1"].code == ErrorCode.ABORTED  # the first reason is kept


def test_connection_lost_during_a_handshake_releases_its_queue_and_starts_over() -> None:
    ep = endpoint(1)
    publish_one(ep, "r1", 0.0)
    out = ep.connection_lost(CONN, 1.0)
    assert opened(out) == [0, 1]
    assert finished(out)["r1"].code == ErrorCode.CONNECTION_LOST
    assert ep.connections() == {CONN: "idle"}
    assert ep.get_timer() is None  # the handshake deadline is gone with it
    out = publish_one(ep, "r2", 2.0)
    assert out[0] == Connect(CONN, HOST, BASE_PORT)  # the runtime may have replaced it
    assert [type(m) for m in sends(out)] == [MfMeta]
    (m,) = readiness(ep.receive(CONN, ack_v2(), 2.5))
    assert finished(ep.receive(CONN, done(m), 3.0))["r2"].ok


def test_connection_lost_for_a_name_never_opened_is_the_callers_mistake() -> None:
    ep = endpoint(1)
    with pytest.raises(LocalProtocolError, match="not a Decode endpoint"):
        ep.connection_lost(CONN, 0.0)


# -- requests and steps --------------------------------------------------------------------


def test_chunked_request_sends_done_only_with_the_final_chunks_last_layer() -> None:
    ep = endpoint(2)
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1, 2], indexer=[1], final=False), 0.0)
    out = write_layers(ep, [0, 1], 1.0)
    out += ep.receive(CONN, ack_v2(), 1.0)
    step1 = readiness(out)
    assert [m.done_ext_ids for m in step1] == [[], []]
    out = ep.receive(CONN, done(step1[0]), 1.5) + ep.receive(CONN, done(step1[1]), 1.5)
    assert finished(out) == {}
    assert ep.requests() == {"r1": "sending"}
    ep.end_step(1.5)

    ep.schedule_chunk(
        Chunk(
            ext_req_id="r1",
            main_block_ids=[3],
            indexer_block_ids=[2],
            main_start=2,
            indexer_start=1,
            final=True,
        ),
        0.0,
    )
    step2 = readiness(write_layers(ep, [0, 1], 2.0))
    assert [m.done_ext_ids for m in step2] == [[], ["r1"]]
    assert [(r.main_start_block, r.indexer_start_block) for r in step2[0].read_reqs] == [(2, 1)]
    assert ep.requests() == {"r1": "final_sent"}
    assert finished(ep.receive(CONN, done(step2[0]), 2.5)) == {}
    out = ep.receive(CONN, done(step2[1]), 2.5)
    assert finished(out) == {"r1": RequestFinished("r1", True, None, "")}
    assert ep.is_idle()  # forgotten at once, although its step is still open
    ep.end_step(3.0)
    assert ep.is_idle()


def test_final_chunk_without_new_blocks_sends_only_the_done_id() -> None:
    ep = endpoint(2)
    ep.add_request("r1", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [], indexer=(), start=4), 0.0)
    out = write_layers(ep, [0, 1], 1.0)
    assert ep.gates()[0] == ("open", 0)  # layer 0 published nothing
    (msg,) = readiness(out + ep.receive(CONN, ack_v2(), 1.0))
    assert (msg.layer_idx, msg.read_reqs, msg.done_ext_ids) == (1, [], ["r1"])
    assert finished(ep.receive(CONN, done(msg), 2.0))["r1"].ok


def test_end_step_with_missing_layers_fails_its_requests_with_step_incomplete() -> None:
    ep = endpoint(3)
    ep.add_request("r1", target(), 0.0)
    ep.add_request("idle", target(), 0.0)
    ep.schedule_chunk(chunk("r1", [1]), 0.0)
    out = write_layers(ep, [0], 1.0)
    (m0,) = readiness(out + ep.receive(CONN, ack_v2(), 1.0))
    assert ep.end_step(1.5) == []  # failing, but layer 0 is still out
    assert ep.requests() == {"r1": "failing", "idle": "registered"}
    r1 = finished(ep.receive(CONN, done(m0), 2.0))["r1"]
    assert (r1.ok, r1.code) == (False, ErrorCode.STEP_INCOMPLETE)
    assert "2 of 3 layers" in r1.message


def test_local_misuse_raises() -> None:
    ep = endpoint(3)
    ep.add_request("r1", target(), 0.0)
    with pytest.raises(LocalProtocolError, match="not registered"):
        ep.schedule_chunk(chunk("nope", [1], final=False), 0.0)
    with pytest.raises(LocalProtocolError, match="start blocks"):
        ep.schedule_chunk(
            Chunk(
                ext_req_id="r1",
                main_block_ids=[1],
                indexer_block_ids=[1],
                main_start=-1,
                final=False,
            ),
            0.0,
        )
    with pytest.raises(LocalProtocolError, match="block ids"):
        ep.schedule_chunk(chunk("r1", [1, -2], indexer=[1], final=False), 0.0)
    with pytest.raises(LocalProtocolError, match="block ids"):
        ep.schedule_chunk(chunk("r1", [1], indexer=[-1], final=False), 0.0)
    ep.schedule_chunk(chunk("r1", [1], final=False), 0.0)
    with pytest.raises(LocalProtocolError, match="twice"):
        ep.schedule_chunk(chunk("r1", [1], final=False), 0.0)
    with pytest.raises(LocalProtocolError, match="outside"):
        ep.layer_written(3, 0.0)
    with pytest.raises(LocalProtocolError, match="outside"):
        ep.can_overwrite(-1)
    ep.layer_written(1, 0.0)
    for layer in (0, 1):
        with pytest.raises(LocalProtocolError, match="increasing order"):
            ep.layer_written(layer, 0.0)
    ep.add_request("r2", target(), 0.0)
    with pytest.raises(LocalProtocolError, match="before the step's first"):
        ep.schedule_chunk(chunk("r2", [1], final=False), 0.0)
    ep.layer_written(2, 0.0)
    ep.end_step(0.0)
    # A final chunk closes the request's schedule.
    ep = endpoint(1)
    one_request_ready(ep)
    ep.end_step(1.0)
    with pytest.raises(LocalProtocolError, match="LOCAL_CHUNK is not allowed in state final_sent"):
        ep.schedule_chunk(
            chunk("r1", [2], start=1, final=False),
            0.0,
        )


# -- peer input hygiene --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "counter"),
    [
        (b"\x00garbage", "malformed_frames"),
        (b"", "malformed_frames"),
        (encode(MfMeta(p_session="x", encoded_layer_metadata=b"")), "unexpected_messages"),
        (
            encode(ReadReadyBatch(layer_idx=0, layer_name="l", read_reqs=[])),
            "unexpected_messages",
        ),
    ],
)
def test_bad_or_unexpected_frames_are_counted(frame: bytes, counter: str) -> None:
    ep = endpoint(1)
    one_request_ready(ep)
    before = snapshot(ep)
    assert ep.receive(CONN, frame, 2.0) == []
    assert snapshot(ep) == before
    assert getattr(ep.stats, counter) == 1


def test_frames_from_an_unknown_connection_are_counted() -> None:
    ep = endpoint(1)
    assert ep.receive("127.0.0.1:1", encode(ReadDone(layer_idx=0, seq=0)), 0.0) == []
    assert ep.stats.unexpected_messages == 1


def test_receive_accepts_decoded_messages_too() -> None:
    ep = endpoint(1)
    (m0,) = one_request_ready(ep)
    msg: Message = ReadDone(layer_idx=0, seq=m0.seq)
    assert finished(ep.receive(CONN, msg, 2.0))["r1"].ok


# -- views ---------------------------------------------------------------------------------


def test_views_describe_live_state() -> None:
    ep = endpoint(1)
    assert (ep.get_timer(), ep.publications(), ep.requests(), ep.connections()) == (
        None,
        {},
        {},
        {},
    )
    (m0,) = one_request_ready(ep)
    ((_uid, view),) = ep.publications().items()
    assert view == PublicationView(CONN, 0, "published", 0, (0, 1), ("r1",), 31.0)
    assert ep.requests() == {"r1": "final_sent"}
    assert ep.gates() == {0: ("closed", 1), 1: ("closed", 1)}
    assert not ep.is_idle()
    ep.receive(CONN, done(m0), 2.0)
    ep.end_step(2.0)
    assert ep.is_idle()
    assert ep.get_timer() is None  # the spent lease timer is gone
    assert ep.stats.publications == 1


def test_terminal_reply_reports_round_trip_from_send_to_reply() -> None:
    ep = endpoint(2)
    msgs = one_request_ready(ep)  # readiness goes out when the ACK arrives at t=1.0
    out = ep.receive(CONN, done(msgs[0]), 1.25)
    out += ep.receive(CONN, failed(msgs[1]), 4.0)
    replied = [o for o in out if isinstance(o, LayerReplied)]
    assert [(r.conn, r.layer_idx, r.ok) for r in replied] == [(CONN, 0, True), (CONN, 1, False)]
    assert [r.round_trip_s for r in replied] == pytest.approx([0.25, 3.0])
    # a duplicate reply is not a round trip
    assert not [o for o in ep.receive(CONN, done(msgs[0]), 5.0) if isinstance(o, LayerReplied)]


def test_an_ack_no_handshake_waits_for_is_counted_by_the_table() -> None:
    ep = endpoint(1)
    one_request_ready(ep)
    before = snapshot(ep)
    for ack in (ack_v2(), ACK_V1_FRAME):
        assert ep.receive(CONN, ack, 2.0) == []  # a duplicate: the handshake is over
    assert ep.stats.dropped == 2 and ep.stats.protocol_violations == 0
    assert snapshot(ep) == before


def test_input_no_table_allows_declares_the_peer_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    # None reaches this today; plant one: the table forgets that a ready connection may
    # get a stray ACK.
    decls = tuple(
        d
        for d in CONNECTION_HANDSHAKE.transitions
        if not (d["trigger"] == C_RECV_ACK_V2 and d["source"] == CONN_READY_V2)
    )
    planted = replace(CONNECTION_HANDSHAKE, transitions=decls)
    monkeypatch.setattr(ConnectionEffects, "TABLE", planted.bind(ConnectionEffects.TABLE.handlers))
    ep = endpoint(1)
    one_request_ready(ep)
    out = ep.receive(CONN, ack_v2(), 2.0)
    assert out[0] == Disconnect(
        CONN,
        "protocol violation: connection handshake: input RECV_ACK_V2 is not allowed in "
        "state ready_v2",
    )
    assert ep.stats.protocol_violations == 1 and ep.stats.connections_lost == 1
    assert finished(out)["r1"].code == ErrorCode.CONNECTION_LOST
