"""The public vocabulary of the endpoints: rd2h_protocol.events, exported from the root."""

from __future__ import annotations

import rd2h_protocol
from rd2h_protocol import (
    ACK_V1,
    Ack,
    Chunk,
    ConnectionView,
    ConsumerConfig,
    ConsumerEndpoint,
    DecodeTarget,
    ErrorCode,
    LayerLayout,
    MfMeta,
    ProducerConfig,
    ProducerEndpoint,
    ReadPlan,
    Send,
    StartRead,
    TransferError,
    encode,
    encode_layer_metadata,
    events,
)
from rd2h_protocol.wire.messages import ALL_CAPABILITIES, CAP_ABORT, CAP_SEQ

LAYOUT = LayerLayout(base_addrs=[0x1000, 0x2000], block_len=[64, 64], tensor_group_idx=[0, 0])


def test_every_event_is_exported_from_the_package_root() -> None:
    for name in events.__all__:
        assert getattr(rd2h_protocol, name) is getattr(events, name), name
        assert name in rd2h_protocol.__all__


def test_transfer_error_takes_its_code() -> None:
    assert TransferError("x").code is ErrorCode.TRANSFER_FAILED
    err = TransferError("late", 7, transient=True, code=ErrorCode.TIMEOUT)
    assert (err.code, err.backend_code, err.transient, err.message) == (
        ErrorCode.TIMEOUT,
        7,
        True,
        "late",
    )


def test_start_read_says_whether_it_may_start_and_how_to_report_it() -> None:
    plan = ReadPlan(3, "s", "model.layers.0", (), (), ())
    assert StartRead(plan).may_start(1e9)
    start = StartRead(plan, start_by=10.0, finish_by=20.0)
    assert start.may_start(10.0)
    assert not start.may_start(10.5)
    err = start.not_started(10.5)
    assert err.code is ErrorCode.LEASE_EXPIRED
    assert "read 3 not started" in err.message and "0.500 s ago" in err.message


def producer(protocol: str = "v2") -> ProducerEndpoint:
    return ProducerEndpoint(
        ProducerConfig(
            p_rank=0, p_tp=1, session="p0", layers=[("model.layers.0", LAYOUT)], protocol=protocol
        )  # type: ignore[arg-type]
    )


def handshaking(ep: ProducerEndpoint) -> str:
    ep.add_request("r1", DecodeTarget("d", 20000, 1), 0.0)
    ep.schedule_chunk(Chunk(ext_req_id="r1", main_block_ids=[1], final=True), 0.0)
    (conn,) = {o.conn for o in ep.layer_written(0, 0.0) if isinstance(o, Send)}
    return conn


def test_producer_view_of_a_v2_connection() -> None:
    ep = producer()
    conn = handshaking(ep)
    assert ep.negotiated(conn) == ConnectionView(conn, "handshaking", None, frozenset())
    ep.receive(conn, encode(Ack(protocol_version=2, capabilities=[CAP_SEQ, "x"])), 0.1)
    assert ep.negotiated(conn) == ConnectionView(conn, "ready_v2", "v2", frozenset({CAP_SEQ}))


def test_producer_view_of_a_v1_connection() -> None:
    ep = producer()
    conn = handshaking(ep)
    ep.receive(conn, ACK_V1, 0.1)
    assert ep.negotiated(conn) == ConnectionView(conn, "ready_v1", "v1", frozenset())


def test_consumer_view_of_its_sessions() -> None:
    ep = ConsumerEndpoint(ConsumerConfig(d_rank=0, d_tp=1, layers=[]))
    assert ep.negotiated(b"p") is None
    meta = MfMeta(
        p_session="s2",
        encoded_layer_metadata=encode_layer_metadata({}),
        protocol_version=2,
        capabilities=list(ALL_CAPABILITIES),
    )
    ep.receive(b"p", encode(meta), 0.0)
    view = ep.negotiated(b"p")
    assert view is not None and (view.name, view.protocol) == ("s2", "v2")
    assert CAP_ABORT in view.capabilities
    v1_meta = MfMeta(p_session="s1", encoded_layer_metadata=encode_layer_metadata({}))
    ep.receive(b"q", encode(v1_meta), 0.0)
    assert ep.negotiated(b"q") == ConnectionView("s1", "ready_v1", "v1", frozenset())
