"""The Decode endpoint (ConsumerEndpoint), driven with hand-built Prefill messages.

Messages go through the codec (``encode`` then ``receive``) so what is tested is
what a peer's bytes do; replies are encoded too, to check their wire shape (v1 replies
must carry only v1 fields).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h_protocol.consumer import (
    CONSUMER_MACHINES,
    ConsumerConfig,
    ConsumerEndpoint,
    Output,
    Releasable,
    Reply,
    RequestDone,
    RequestFailed,
    SendAbort,
    StartRead,
)
from rd2h_protocol.consumer.sessions import SessionEffects
from rd2h_protocol.errors import (
    ConfigError,
    ErrorCode,
    LocalProtocolError,
    TransferError,
)
from rd2h_protocol.machines.consumer import DECODE_SESSION, S_RECV_READINESS, SESSION_V2
from rd2h_protocol.plan import ReadPlan
from rd2h_protocol.topology import chunk_block_range, map_prefill_rank
from rd2h_protocol.wire.codec import decode, encode
from rd2h_protocol.wire.layout import (
    ComponentDest,
    DestinationLayout,
    LayerLayout,
    encode_layer_metadata,
)
from rd2h_protocol.wire.messages import (
    ALL_CAPABILITIES,
    CAP_ABORT,
    CAP_RESEND,
    CAP_SEQ,
    TAG_ACK_V1,
    TAG_READ_READY_BATCH,
    Abort,
    Ack,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadReq,
)
from rd2h_protocol.wire.readiness import Readiness, read_frame

# -- fixtures ------------------------------------------------------------------------------

K_BYTES, V_BYTES, IDX_BYTES, SCALE_BYTES = 1024, 1024, 128, 8
P_BASES = (0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000)
D_BASES = (0x9000_0000, 0xA000_0000, 0xB000_0000, 0xC000_0000)
NUM_LAYERS = 3
LAYER_NAMES = [f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS)]
NUM_BLOCKS = 256
PEER = b"peer-0"
LAST = NUM_LAYERS - 1


def src_layout(
    *, tensors: int = 4, k_bytes: int = K_BYTES, num_blocks: int | None = NUM_BLOCKS
) -> LayerLayout:
    """Prefill's layout of one layer: K, V, indexer, scale (fewer with ``tensors``)."""
    return LayerLayout(
        base_addrs=list(P_BASES[:tensors]),
        block_len=[k_bytes, V_BYTES, IDX_BYTES, SCALE_BYTES][:tensors],
        tensor_group_idx=[0, 0, 1, 1][:tensors],
        num_blocks=num_blocks,
    )


def dst_layout(*, indexer: bool = True, num_blocks: int = NUM_BLOCKS) -> DestinationLayout:
    def comp(i: int, size: int) -> ComponentDest:
        return ComponentDest(D_BASES[i], size, num_blocks)

    return DestinationLayout(
        main=(comp(0, K_BYTES), comp(1, V_BYTES)),
        indexer=comp(2, IDX_BYTES) if indexer else None,
        scale=comp(3, SCALE_BYTES) if indexer else None,
    )


def config(d_rank: int = 0, d_tp: int = 1, **kw: Any) -> ConsumerConfig:
    layers = kw.pop("layers", [(name, dst_layout()) for name in LAYER_NAMES])
    return ConsumerConfig(d_rank=d_rank, d_tp=d_tp, layers=layers, **kw)


def endpoint(d_rank: int = 0, d_tp: int = 1, **kw: Any) -> ConsumerEndpoint:
    return ConsumerEndpoint(config(d_rank, d_tp, **kw))


def meta(
    session: str = "p0",
    *,
    v2: bool = True,
    compat: str | None = None,
    caps: Sequence[str] = ALL_CAPABILITIES,
    layouts: dict[str, LayerLayout] | None = None,
    blob: bytes | None = None,
) -> MfMeta:
    if blob is None:
        blob = encode_layer_metadata(layouts or {name: src_layout() for name in LAYER_NAMES})
    if not v2:
        return MfMeta(p_session=session, encoded_layer_metadata=blob)
    return MfMeta(
        p_session=session,
        encoded_layer_metadata=blob,
        protocol_version=2,
        capabilities=list(caps),
        compat=compat,
    )


def rrb(
    layer_idx: int,
    reqs: Sequence[ReadReq],
    *,
    done: Sequence[str] = (),
    member: int = 0,
    ratio: int = 1,
    seq: int | None = None,
    lease_ms: int | None = None,
) -> ReadReadyBatch:
    return ReadReadyBatch(
        layer_idx=layer_idx,
        layer_name=LAYER_NAMES[layer_idx] if layer_idx < NUM_LAYERS else "model.layers.99",
        read_reqs=list(reqs),
        done_ext_ids=list(done),
        group_member_idx=member,
        tp_ratio=ratio,
        seq=seq,
        lease_ms=lease_ms,
    )


def rr(
    ext: str, main: Sequence[int], idx: Sequence[int] | None = None, ms: int = 0, js: int = 0
) -> ReadReq:
    return ReadReq(ext, list(main), list(main if idx is None else idx), ms, js)


def send(ep: ConsumerEndpoint, msg: Any, now: float = 0.0, peer: bytes = PEER) -> list[Output]:
    """Deliver ``msg`` as its wire bytes; check every reply round-trips through the codec."""
    outs = ep.receive(peer, encode(msg), now)
    for out in outs:
        if isinstance(out, Reply | SendAbort):
            assert decode(encode(out.msg)) == out.msg
    return outs


def of(outs: Sequence[Output], kind: type[Any]) -> list[Any]:
    return [o for o in outs if isinstance(o, kind)]


def only(outs: Sequence[Output], kind: type[Any]) -> Any:
    found = of(outs, kind)
    assert len(found) == 1, outs
    return found[0]


def replies(outs: Sequence[Output]) -> list[Any]:
    return [o.msg for o in outs if isinstance(o, Reply)]


def wire_len(msg: Any) -> int:
    """Number of fields a message has on the wire."""
    return len(msgspec.msgpack.decode(encode(msg)))


def ready(v2: bool = True, **kw: Any) -> ConsumerEndpoint:
    ep = endpoint(**kw)
    send(ep, meta(v2=v2))
    return ep


def finish(
    ep: ConsumerEndpoint,
    outs: Sequence[Output],
    now: float = 0.0,
    error: TransferError | None = None,
) -> list[Output]:
    """Complete the one read ``outs`` started."""
    start = only(outs, StartRead)
    return ep.read_finished(start.plan.read_id, error, now)


def request_ids(plan: ReadPlan) -> list[str]:
    return [r.ext_req_id for r in plan.requests]


# -- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"d_tp": 0}, "d_tp"),
        ({"d_rank": 2, "d_tp": 2}, "d_rank"),
        ({"layers": [("a", dst_layout()), ("a", dst_layout())]}, "unique"),
        ({"capabilities": ("seq", "teleport")}, "teleport"),
        ({"kv_load_timeout_s": 0}, "kv_load_timeout_s"),
        ({"park_timeout_s": -1}, "park_timeout_s"),
        ({"max_parked": -1}, "max_parked"),
        ({"max_sessions": 0}, "max_sessions"),
    ],
)
def test_config_is_validated(kw: dict[str, Any], needle: str) -> None:
    args: dict[str, Any] = {"d_rank": 0, "d_tp": 1}
    args.update(kw)
    with pytest.raises(ConfigError, match=needle):
        config(**args)


def test_consumer_machines_are_exported() -> None:
    names = [m.name for m in CONSUMER_MACHINES]
    assert names == [
        "Decode request",
        "Decode readiness",
        "Decode session",
        "contributor completion",
        "cross-rank completion",
    ]


# -- handshake -----------------------------------------------------------------------------


def test_v1_handshake_gets_raw_ack_and_v1_replies() -> None:
    ep = endpoint()
    outs = send(ep, meta(v2=False))
    assert [encode(m) for m in replies(outs)] == [TAG_ACK_V1]
    assert ep.sessions() == {"p0": "ready_v1"}
    ep.add_request("r1", [10, 11], [20, 21], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [1, 2])]))
    start = only(outs, StartRead)
    assert start.start_by is None
    reply = replies(ep.read_finished(start.plan.read_id, None, 0.1))[0]
    assert reply == ReadDone(layer_idx=0)
    assert encode(reply) == encode(ReadDone(layer_idx=0)) and wire_len(reply) == 2
    assert ep.stats.handshakes == 1


def test_v2_handshake_gets_ack_with_version_and_capabilities() -> None:
    ep = endpoint(capabilities=(CAP_SEQ, CAP_ABORT))
    outs = send(ep, meta(caps=["abort", "lease"]))
    ack = replies(outs)[0]
    assert ack == Ack(protocol_version=2, capabilities=[CAP_SEQ, CAP_ABORT])
    assert not ack.is_v1
    assert ep.sessions() == {"p0": "ready_v2"}


def test_compat_mismatch_is_refused_naming_both_values() -> None:
    ep = endpoint(compat="glm5-bf16-bs128-L1")
    ack = replies(send(ep, meta(compat="glm5-fp8-bs64-L1")))[0]
    assert ack.error_code == ErrorCode.INCOMPATIBLE
    assert "glm5-fp8-bs64-L1" in ack.error and "glm5-bf16-bs128-L1" in ack.error
    assert ep.sessions() == {"p0": "refused"}
    assert ep.stats.refused_handshakes == 1
    # Readiness on a refused session is answered with the refusal and fails its requests.
    ep.add_request("r1", [0], [0], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [1])], seq=1))
    failed = replies(outs)[0]
    assert isinstance(failed, ReadFailed) and failed.code == ErrorCode.INCOMPATIBLE
    assert failed.seq == 1
    assert only(outs, RequestFailed).code == ErrorCode.INCOMPATIBLE


def test_compat_accepted_when_equal_or_unstated() -> None:
    ep = endpoint(compat="c1")
    assert replies(send(ep, meta(compat="c1")))[0].error_code is None
    assert replies(send(ep, meta("p1", compat=None)))[0].error_code is None


def test_undecodable_layout_v2_is_refused_v1_is_dropped() -> None:
    ep = endpoint()
    ack = replies(send(ep, meta(blob=b"\xc1not msgpack")))[0]
    assert ack.error_code == ErrorCode.MALFORMED and "layer metadata" in ack.error
    assert send(ep, meta("p1", v2=False, blob=b"\xc1")) == []
    assert ep.sessions() == {"p0": "refused", "p1": "refused"}
    assert ep.stats.refused_handshakes == 2
    # v1-shaped readiness on the refused v1 session: v1 read_failed.
    reply = replies(send(ep, rrb(0, []), peer=PEER))[0]
    assert isinstance(reply, ReadFailed) and wire_len(reply) == 3


def test_rehandshake_from_new_identity_keeps_session_state() -> None:
    ep = ready()
    ep.add_request("r1", [0, 1], [0, 1], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [5, 6])], seq=1))
    start = only(outs, StartRead)
    # The Prefill reconnects with a new identity: same session, same request state.
    send(ep, meta(), peer=b"peer-new")
    assert ep.sessions() == {"p0": "ready_v2"}
    # The old identity no longer maps to a session.
    assert (
        of(send(ep, rrb(1, [], seq=2), peer=PEER), Reply)[0].msg.code == ErrorCode.UNKNOWN_SESSION
    )
    # The reply to the read in flight goes where the readiness came from.
    done = ep.read_finished(start.plan.read_id, None, 1.0)
    assert only(done, Reply).peer == PEER
    # Aborts go to the session's current identity.
    outs = ep.abort(["r1"], "client went away", 2.0)
    assert only(outs, SendAbort).peer == b"peer-new"


def test_identity_reused_by_another_session_unbinds_the_first() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    only(send(ep, rrb(0, [rr("r1", [1])], seq=1)), StartRead)
    send(ep, meta("p1"))  # same peer identity, a different Prefill process
    outs = ep.abort(["r1"], "stop", 1.0)
    # p0 has no identity any more: its abort cannot be sent.
    assert of(outs, SendAbort) == []
    assert ep.sessions() == {"p0": "ready_v2", "p1": "ready_v2"}


def test_oldest_session_is_forgotten_beyond_max_sessions() -> None:
    ep = endpoint(max_sessions=1)
    send(ep, meta("p0"), peer=b"a")
    send(ep, meta("p1"), peer=b"b")
    assert ep.sessions() == {"p1": "ready_v2"}
    reply = replies(send(ep, rrb(0, [], seq=3), peer=b"a"))[0]
    assert reply.code == ErrorCode.UNKNOWN_SESSION
    send(ep, meta("p1"), peer=b"b")  # re-handshake of a known session keeps it
    assert ep.sessions() == {"p1": "ready_v2"}


# -- equal TP ------------------------------------------------------------------------------


def test_equal_tp_request_completes_after_final_layer_read() -> None:
    ep = ready()
    ep.add_request("r1", [40, 41, 42], [50, 51, 52], 0.0)
    assert ep.requests() == {"r1": "advertised"}
    for layer in range(NUM_LAYERS):
        done = ["r1"] if layer == LAST else []
        outs = send(
            ep, rrb(layer, [rr("r1", [7, 8, 9], [3, 4, 5])], done=done, seq=layer + 1), now=layer
        )
        start = only(outs, StartRead)
        plan = start.plan
        assert plan.layer_name == LAYER_NAMES[layer] and plan.session == "p0"
        assert [c.name for c in plan.main] == ["k", "v"]
        assert [c.name for c in plan.indexer] == ["indexer", "scale"]
        assert plan.main[0].src_base == P_BASES[0] and plan.main[0].dst_base == D_BASES[0]
        (read,) = plan.requests
        assert list(read.main_src) == [7, 8, 9] and list(read.main_dst) == [40, 41, 42]
        assert list(read.indexer_src) == [3, 4, 5] and list(read.indexer_dst) == [50, 51, 52]
        assert ep.requests() == {"r1": "receiving"}
        assert ep.in_flight_reads() == {plan.read_id: ("r1",)}
        outs = ep.read_finished(plan.read_id, None, layer + 0.5)
        assert replies(outs) == [ReadDone(layer_idx=layer, seq=layer + 1)]
        assert of(outs, RequestDone) == ([RequestDone("r1")] if layer == LAST else [])
    assert ep.requests() == {"r1": "done_on_rank"}
    assert ep.get_timer() is None  # a done request has no load timer
    assert ep.release("r1", 5.0) == [Releasable("r1")]
    assert ep.is_idle()
    assert ep.stats.requests_done == 1 and ep.stats.reads_started == NUM_LAYERS


def test_layer_without_indexer_reads_main_only() -> None:
    layers = [(name, dst_layout(indexer=False)) for name in LAYER_NAMES]
    ep = endpoint(layers=layers)
    send(ep, meta(layouts={name: src_layout(tensors=2) for name in LAYER_NAMES}))
    ep.add_request("r1", [0, 1], [], 0.0)  # no indexer destination at all
    plan = only(send(ep, rrb(0, [ReadReq("r1", [4, 5])], seq=1)), StartRead).plan
    assert plan.indexer == ()
    assert list(plan.requests[0].indexer_src) == []
    assert list(plan.requests[0].main_dst) == [0, 1]


def test_zero_block_rank_still_acknowledges_and_counts_done() -> None:
    ep = ready()
    ep.add_request("r1", [], [], 0.0)
    outs = send(ep, rrb(LAST, [rr("r1", [])], done=["r1"], seq=9))
    assert of(outs, StartRead) == []
    assert replies(outs) == [ReadDone(layer_idx=LAST, seq=9)]
    assert of(outs, RequestDone) == [RequestDone("r1")]


def test_done_id_without_entry_counts_after_successful_read() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    ep.add_request("r2", [1], [1], 0.0)
    outs = send(ep, rrb(LAST, [rr("r1", [3])], done=["r1", "r2"], seq=1))
    assert request_ids(only(outs, StartRead).plan) == ["r1"]
    outs = finish(ep, outs)
    assert sorted(o.ext_req_id for o in of(outs, RequestDone)) == ["r1", "r2"]


# -- unequal TP ----------------------------------------------------------------------------


def _chunk_reads(
    ep: ConsumerEndpoint, member: int, ratio: int, entries: list[ReadReq], done: Sequence[str] = ()
) -> ReadPlan | None:
    outs = send(ep, rrb(0, entries, member=member, ratio=ratio, seq=member + 1, done=done))
    starts = of(outs, StartRead)
    return starts[0].plan if starts else None


@pytest.mark.parametrize("main_shared", [True, False], ids=["shared-pool", "rank-local"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(4, 2), (4, 1), (2, 2), (8, 2)])
def test_unequal_tp_main_from_member_0_split_over_ranks_indexer_split_over_members(
    p_tp: int, d_tp: int, main_shared: bool
) -> None:
    n_main, n_idx = 11, 7
    p_main = list(range(100, 100 + n_main))
    p_idx = list(range(200, 200 + n_idx))
    d_main = list(range(10, 10 + n_main))
    d_idx = list(range(30, 30 + n_idx))
    main_written: list[int] = []
    for d_rank in range(d_tp):
        ep = endpoint(d_rank=d_rank, d_tp=d_tp, main_shared=main_shared)
        ep.add_request("r1", d_main, d_idx, 0.0)
        idx_written: list[int] = []
        for p_rank in range(p_tp):
            c = map_prefill_rank(p_rank, p_tp, d_tp)
            if c.d_rank != d_rank:
                continue
            peer = f"p{p_rank}".encode()
            send(ep, meta(f"s{p_rank}"), peer=peer)
            msg = rrb(
                0, [rr("r1", p_main, p_idx)], member=c.group_member_idx, ratio=c.tp_ratio, seq=1
            )
            msg.done_ext_ids = ["r1"]
            outs = send(ep, msg, peer=peer)
            for start in of(outs, StartRead):
                (read,) = start.plan.requests
                if c.group_member_idx:
                    assert list(read.main_src) == []
                # Prefill id i lands in Decode id i of the request (logical order kept).
                assert [p_main.index(s) for s in read.main_src] == [
                    d_main.index(d) for d in read.main_dst
                ]
                assert [p_idx.index(s) for s in read.indexer_src] == [
                    d_idx.index(d) for d in read.indexer_dst
                ]
                main_written += read.main_dst
                idx_written += read.indexer_dst
                finish(ep, outs)
        # Every Decode rank holds the whole indexer, each block written once.
        assert sorted(idx_written) == d_idx
        assert ep.requests() == {"r1": "done_on_rank"}
    if main_shared:
        # The main pool is shared: the Decode ranks together write every block once.
        assert sorted(main_written) == d_main
    else:
        # Each rank has its own main KV (vLLM's cache): each writes every block once.
        assert sorted(main_written) == sorted(d_main * d_tp)


def test_contributor_completion_needs_every_member_duplicates_ignored() -> None:
    ep = endpoint()  # Prefill TP 4 -> Decode TP 1: ratio 4
    ep.add_request("r1", [0, 1, 2, 3], [0, 1, 2, 3], 0.0)
    for m in range(4):
        send(ep, meta(f"s{m}"), peer=f"p{m}".encode())

    def final(member: int, seq: int) -> list[Output]:
        msg = rrb(LAST, [rr("r1", [4, 5, 6, 7])], done=["r1"], member=member, ratio=4, seq=seq)
        outs = send(ep, msg, peer=f"p{member}".encode())
        return finish(ep, outs) if of(outs, StartRead) else outs

    assert of(final(0, 1), RequestDone) == []
    assert of(final(1, 1), RequestDone) == []
    assert of(final(1, 2), RequestDone) == []  # member 1 again: a duplicate
    assert ep.stats.duplicate_done == 1
    assert of(final(2, 1), RequestDone) == []
    assert of(final(3, 1), RequestDone) == [RequestDone("r1")]


def test_done_counts_only_after_successful_read() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    outs = send(ep, rrb(LAST, [rr("r1", [1])], done=["r1"], seq=1))
    outs = finish(ep, outs, error=TransferError("boom", 7))
    assert of(outs, RequestDone) == []
    assert only(outs, RequestFailed).code == ErrorCode.TRANSFER_FAILED


def test_done_waits_for_other_reads_in_flight() -> None:
    ep = ready()
    ep.add_request("r1", [0, 1], [0, 1], 0.0)
    first = only(send(ep, rrb(0, [rr("r1", [5, 6])], seq=1)), StartRead)
    last = send(ep, rrb(LAST, [rr("r1", [5, 6])], done=["r1"], seq=2))
    outs = finish(ep, last)
    assert of(outs, RequestDone) == []  # layer 0 is still being read
    outs = ep.read_finished(first.plan.read_id, None, 1.0)
    assert of(outs, RequestDone) == [RequestDone("r1")]


def test_ratio_change_for_a_request_isolates_it() -> None:
    ep = ready()
    ep.add_request("r1", [0, 1], [0, 1], 0.0)
    finish(ep, send(ep, rrb(0, [rr("r1", [5, 6])], ratio=2, seq=1)))
    outs = send(ep, rrb(1, [rr("r1", [5, 6])], ratio=4, seq=2))
    reply = replies(outs)[0]
    assert reply.failed[0].code == ErrorCode.OUT_OF_RANGE and "tp_ratio" in reply.failed[0].message
    assert only(outs, RequestFailed).ext_req_id == "r1"


# -- chunked requests ----------------------------------------------------------------------


def test_three_chunks_with_partial_final_block_cover_destination_once() -> None:
    block_size, prompt = 16, 16 * 5 + 3  # six blocks, the last one partial
    allocated = -(-prompt // block_size)
    p_blocks = list(range(200, 200 + allocated))
    d_main = list(range(60, 60 + allocated))
    d_idx = list(range(90, 90 + allocated))
    for d_tp in (1, 2):
        written: dict[str, list[int]] = {"main": [], "idx": []}
        for d_rank in range(d_tp):
            ep = endpoint(d_rank=d_rank, d_tp=d_tp)
            send(ep, meta())
            ep.add_request("r1", d_main, d_idx, 0.0)
            transferred, seq = 0, 0
            for computed, final in ((32, False), (70, False), (prompt, True)):
                start, end = chunk_block_range(
                    remote_cached_tokens=0,
                    transferred_tokens=transferred,
                    computed_tokens=computed,
                    block_size=block_size,
                    allocated_blocks=allocated,
                    final=final,
                )
                transferred = computed // block_size * block_size
                ids = p_blocks[start:end]
                for layer in range(NUM_LAYERS):
                    seq += 1
                    done = ["r1"] if final and layer == LAST else []
                    msg = rrb(layer, [rr("r1", ids, ids, start, start)], done=done, seq=seq)
                    outs = send(ep, msg)
                    for s in of(outs, StartRead):
                        (read,) = s.plan.requests
                        if layer == 0:
                            written["main"] += read.main_dst
                            written["idx"] += read.indexer_dst
                        outs = finish(ep, outs)
            assert ep.requests() == {"r1": "done_on_rank"}
        assert sorted(written["main"]) == d_main
        assert sorted(written["idx"]) == sorted(d_idx * d_tp)


# -- isolation -----------------------------------------------------------------------------


def _isolation_setup(v2: bool) -> tuple[ConsumerEndpoint, list[Output]]:
    ep = ready(v2=v2)
    ep.add_request("good", [0, 1], [0, 1], 0.0)
    ep.add_request("short", [2], [2], 0.0)  # one destination block only
    ep.abort(["gone"], "client left", 0.0)  # retired: not waited for
    ep.add_request("done", [3], [3], 0.0)
    send(ep, rrb(0, [rr("done", [])], done=["done"], seq=1 if v2 else None))
    assert ep.requests()["done"] == "done_on_rank"
    entries = [rr("good", [5, 6]), rr("short", [7, 8]), rr("gone", [9]), rr("done", [4])]
    outs = send(ep, rrb(1, entries, seq=2 if v2 else None))
    return ep, outs


def test_isolation_v2_reads_the_others_and_lists_failures() -> None:
    ep, outs = _isolation_setup(v2=True)
    assert request_ids(only(outs, StartRead).plan) == ["good"]
    failed = only(outs, RequestFailed)
    assert failed.ext_req_id == "short" and failed.code == ErrorCode.DESTINATION_RANGE
    assert failed.main_block_ids == (2,) and failed.indexer_block_ids == (2,)
    reply = replies(finish(ep, outs))[0]
    codes = {f.ext_req_id: f.code for f in reply.failed}
    assert codes == {
        "short": ErrorCode.DESTINATION_RANGE,
        "gone": ErrorCode.UNKNOWN_REQUEST,
        "done": ErrorCode.UNKNOWN_REQUEST,
    }
    assert ep.stats.isolated_requests == 3
    assert ep.requests()["good"] == "receiving"


def test_isolation_v1_reads_the_others_and_replies_plain_read_done() -> None:
    ep, outs = _isolation_setup(v2=False)
    assert request_ids(only(outs, StartRead).plan) == ["good"]
    reply = replies(finish(ep, outs))[0]
    assert reply == ReadDone(layer_idx=1) and wire_len(reply) == 2
    assert ep.requests()["short"] == "failed"


def test_isolation_without_capability_omits_failed_list() -> None:
    ep = endpoint()
    send(ep, meta(caps=[CAP_SEQ]))
    outs = send(ep, rrb(0, [rr("nobody", [1])], seq=4))
    # nothing known: parked; expire it
    outs = ep.handle_timer(ep.get_timer() or 0.0)
    assert replies(outs) == [ReadDone(layer_idx=0, seq=4)]


def test_destination_offsets_out_of_range_are_isolated() -> None:
    ep = ready()
    ep.add_request("r1", [0, 1, 2], [0, 1], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [5, 6], [5, 6], ms=0, js=1)], seq=1))
    assert of(outs, StartRead) == []
    (f,) = replies(outs)[0].failed
    assert f.code == ErrorCode.DESTINATION_RANGE and "indexer" in f.message


def test_member_nonzero_main_ids_are_not_range_checked() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0, 1], 0.0)
    # member 1 sends main ids that would not fit: they are ignored, not refused.
    outs = send(ep, rrb(0, [rr("r1", [5, 6, 7], [8, 9])], member=1, ratio=2, seq=1))
    (read,) = only(outs, StartRead).plan.requests
    assert list(read.main_src) == [] and len(read.indexer_src) == 1


def test_prefill_block_ids_beyond_num_blocks_are_isolated() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    ep.add_request("r2", [1], [1], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [NUM_BLOCKS], [0]), rr("r2", [0], [NUM_BLOCKS + 5])], seq=1))
    reply = replies(outs)[0]
    assert [(f.ext_req_id, f.code) for f in reply.failed] == [
        ("r1", ErrorCode.OUT_OF_RANGE),
        ("r2", ErrorCode.OUT_OF_RANGE),
    ]
    assert "main" in reply.failed[0].message and "indexer" in reply.failed[1].message


def test_v1_layout_without_num_blocks_skips_source_check() -> None:
    ep = endpoint()
    send(ep, meta(v2=False, layouts={n: src_layout(num_blocks=None) for n in LAYER_NAMES}))
    ep.add_request("r1", [0], [0], 0.0)
    assert of(send(ep, rrb(0, [rr("r1", [10**6])])), StartRead)


def test_duplicate_entry_in_one_message_isolates_the_request() -> None:
    ep = ready()
    ep.add_request("r1", [0, 1], [0, 1], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [5]), rr("r1", [6], ms=1, js=1)], seq=1))
    assert of(outs, StartRead) == []
    (f,) = replies(outs)[0].failed
    assert f.ext_req_id == "r1" and "more than once" in f.message


# -- whole-layer failures ------------------------------------------------------------------


def test_layout_mismatch_fails_the_layer_no_partial_writes() -> None:
    ep = endpoint()
    layouts = {name: src_layout() for name in LAYER_NAMES}
    layouts[LAYER_NAMES[1]] = src_layout(k_bytes=2048)
    send(ep, meta(layouts=layouts))
    ep.add_request("r1", [0], [0], 0.0)
    ep.add_request("r2", [1], [1], 0.0)
    outs = send(ep, rrb(1, [rr("r1", [5]), rr("r2", [6])], seq=3))
    assert of(outs, StartRead) == []
    reply = replies(outs)[0]
    assert (
        isinstance(reply, ReadFailed) and reply.code == ErrorCode.LAYOUT_MISMATCH and reply.seq == 3
    )
    assert "2048" in reply.error and "1024" in reply.error
    assert sorted(f.ext_req_id for f in of(outs, RequestFailed)) == ["r1", "r2"]
    # The verdict is cached per session and layer, and a good layer still reads.
    ep.add_request("r3", [2], [2], 0.0)
    assert replies(send(ep, rrb(1, [rr("r3", [5])], seq=4)))[0].code == ErrorCode.LAYOUT_MISMATCH
    assert of(send(ep, rrb(0, [], seq=5)), Reply)


def test_layout_mismatch_v1_reply_shape() -> None:
    ep = endpoint()
    send(ep, meta(v2=False, layouts={n: src_layout(tensors=3) for n in LAYER_NAMES}))
    reply = replies(send(ep, rrb(0, [])))[0]
    assert isinstance(reply, ReadFailed) and "scale" in reply.error and wire_len(reply) == 3


def test_unknown_layer_name_fails_the_layer() -> None:
    ep = ready()
    reply = replies(send(ep, rrb(NUM_LAYERS, [], seq=1)))[0]
    assert reply.code == ErrorCode.UNKNOWN_LAYER and "model.layers.99" in reply.error
    msg = rrb(0, [], seq=2)
    msg.layer_name = "model.layers.77.self_attn"
    reply = replies(send(ep, msg))[0]
    assert reply.code == ErrorCode.UNKNOWN_LAYER and "77" in reply.error
    assert ep.stats.layer_failures == 2


def test_layer_index_that_disagrees_with_the_name_is_refused_naming_both() -> None:
    ep = ready()
    msg = rrb(1, [], seq=1)
    msg.layer_idx = 2  # names model.layers.1 but says layer 2
    reply = replies(send(ep, msg))[0]
    assert isinstance(reply, ReadFailed) and reply.code == ErrorCode.LAYOUT_MISMATCH
    assert "layer_idx 2" in reply.error and "'model.layers.1.self_attn'" in reply.error
    assert "layer 1" in reply.error


def test_lost_readiness_fails_the_sessions_requests_and_refuses_the_next_one() -> None:
    # A v2 Prefill says in MF_META that its readiness resumes at seq 10 and numbers it
    # consecutively; seq 11 lost on a live connection must not let r1 complete.
    ep = endpoint()
    handshake = meta()
    handshake.first_seq = 10
    send(ep, handshake)
    ep.add_request("r1", [5, 6], [5, 6], 0.0)
    ep.add_request("r2", [7], [7], 0.0)  # never named by this session: unaffected
    outs = send(ep, rrb(0, [rr("r1", [1, 2])], seq=10))
    assert isinstance(replies(finish(ep, outs))[0], ReadDone)
    # seq 11 (layer 1) never arrives; seq 12 (the last layer) carries r1's done signal.
    outs = send(ep, rrb(LAST, [rr("r1", [1, 2])], done=["r1"], seq=12))
    assert of(outs, StartRead) == []
    (reply,) = replies(outs)
    assert isinstance(reply, ReadFailed) and reply.code == ErrorCode.READINESS_LOST
    assert "seq 11..11" in reply.error and reply.seq == 12
    failed = {o.ext_req_id: o.code for o in outs if isinstance(o, RequestFailed)}
    assert failed == {"r1": ErrorCode.READINESS_LOST}
    assert ep.requests()["r2"] == "advertised"
    assert ep.stats.lost_readiness == 1
    # The session goes on from seq 13: no second gap is reported.
    ep.add_request("r3", [8], [8], 0.0)
    outs = send(ep, rrb(0, [rr("r3", [3])], seq=13))
    assert of(outs, StartRead)
    assert ep.stats.lost_readiness == 1


def test_first_readiness_after_the_handshake_lost_is_detected() -> None:
    ep = endpoint()
    handshake = meta()
    handshake.first_seq = 0
    send(ep, handshake)
    ep.add_request("r1", [5], [5], 0.0)
    outs = send(ep, rrb(1, [rr("r1", [1])], seq=1))  # seq 0 (layer 0) was lost
    assert replies(outs)[0].code == ErrorCode.READINESS_LOST
    assert ep.requests()["r1"] not in ("advertised", "receiving")


def test_a_resent_seq_is_answered_from_memory_never_read_twice() -> None:
    # Prefill resends what is unanswered when a broken connection comes back: the reply
    # may have been lost, while the request has moved on (its blocks may be Decode's now).
    ep = endpoint()
    handshake = meta()
    handshake.first_seq = 0
    send(ep, handshake)
    ep.add_request("r1", [5, 6], [5, 6], 0.0)
    layer0 = rrb(0, [rr("r1", [1, 2])], seq=0)
    outs = send(ep, layer0)
    # Resent while its read runs: nothing now, the read's reply answers both.
    assert send(ep, layer0) == []
    (reply,) = replies(finish(ep, outs))
    assert reply == ReadDone(layer_idx=0, seq=0)
    # Resent after the reply: the same reply again, no read.
    outs = send(ep, layer0)
    assert of(outs, StartRead) == [] and replies(outs) == [reply]
    # A failure is remembered too (a layer this Decode does not have).
    unknown = rrb(NUM_LAYERS, [rr("r1", [1])], seq=1)
    (refusal,) = replies(send(ep, unknown))
    assert replies(send(ep, unknown)) == [refusal]
    assert ep.stats.repeated_readiness == 3 and ep.stats.replies_resent == 2
    assert ep.stats.reads_started == 1


def test_a_lost_seq_that_comes_after_all_gets_the_loss_and_frees_prefill() -> None:
    # Seq 1 is lost; seq 2 reveals the gap (r1 fails). When seq 1 comes after all (resent,
    # or late from the old connection), it is answered with the loss, never read: the
    # reply is what frees the storage on a Prefill that holds it until then.
    ep = endpoint()
    handshake = meta()
    handshake.first_seq = 0
    send(ep, handshake)
    ep.add_request("r1", [5, 6], [5, 6], 0.0)
    finish(ep, send(ep, rrb(0, [rr("r1", [1, 2])], seq=0)))
    assert replies(send(ep, rrb(LAST, [rr("r1", [1, 2])], done=["r1"], seq=2)))[0].seq == 2
    outs = send(ep, rrb(1, [rr("r1", [1, 2])], seq=1))
    assert of(outs, StartRead) == []
    (reply,) = replies(outs)
    assert isinstance(reply, ReadFailed)
    assert (reply.layer_idx, reply.seq, reply.code) == (1, 1, ErrorCode.READINESS_LOST)
    assert "seq 1..1" in reply.error


def test_memory_of_seqs_is_bounded_and_a_huge_gap_costs_nothing() -> None:
    ep = endpoint()
    handshake = meta()
    handshake.first_seq = 0
    send(ep, handshake)
    ep.add_request("r1", [5], [5], 0.0)
    send(ep, rrb(0, [rr("r1", [1])], seq=(1 << 62)))  # a gap of 2**62 seqs
    (session,) = ep.state.sessions.values()
    assert len(session.remembered) <= 257
    assert session.remembered_bytes <= 1 << 20


def test_without_the_resend_capability_a_repeated_seq_is_served_again() -> None:
    # (the behaviour toward a Prefill that never resends: a repeat is a fresh readiness)
    ep = endpoint(capabilities=[c for c in ALL_CAPABILITIES if c != CAP_RESEND])
    handshake = meta()
    handshake.first_seq = 0
    send(ep, handshake)
    ep.add_request("r1", [5], [5], 0.0)
    layer0 = rrb(0, [rr("r1", [1])], seq=0)
    finish(ep, send(ep, layer0))
    assert of(send(ep, layer0), StartRead)
    assert ep.stats.repeated_readiness == 0


def test_v1_prefill_and_v2_without_first_seq_keep_working() -> None:
    ep = ready(v2=False)  # no seq at all: nothing to check
    ep.add_request("r1", [5], [5], 0.0)
    assert of(send(ep, rrb(0, [rr("r1", [1])])), StartRead)
    ep2 = ready()  # an older v2 Prefill without first_seq: the first seq sets the base
    ep2.add_request("r1", [5], [5], 0.0)
    assert of(send(ep2, rrb(0, [rr("r1", [1])], seq=40)), StartRead)
    assert ep2.stats.lost_readiness == 0


def test_kv_heads_split_over_prefill_ranks_are_refused_with_the_cause() -> None:
    # Prefill TP 2 -> Decode TP 1 with head-sharded KV: each Prefill block is half of
    # Decode's, so no byte moves and the reply says why.
    ep = endpoint(layers=[(name, dst_layout(indexer=False)) for name in LAYER_NAMES])
    send(ep, meta(layouts={n: src_layout(tensors=2, k_bytes=K_BYTES // 2) for n in LAYER_NAMES}))
    ep.add_request("r1", [5], [5], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [1])], ratio=2, seq=1))
    (reply,) = replies(outs)
    assert reply.code == ErrorCode.LAYOUT_MISMATCH and of(outs, StartRead) == []
    assert "holds a share of the KV heads" in reply.error
    assert f"Prefill has {K_BYTES // 2}, Decode has {K_BYTES}" in reply.error


# Cache-bearing layers numbered with gaps (layers without KV, MTP layers, cache groups).
GAPPED = [f"model.layers.{n}.self_attn" for n in (1, 2, 4, 7)]


@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1-prefill"])
def test_layers_numbered_with_gaps_land_in_the_destination_named(v2: bool) -> None:
    # Each Decode layer has its own destination base, so a read shows where bytes land.
    dests = [
        (
            name,
            DestinationLayout(
                main=(
                    ComponentDest(D_BASES[0] + i * 0x100_0000, K_BYTES, NUM_BLOCKS),
                    ComponentDest(D_BASES[1] + i * 0x100_0000, V_BYTES, NUM_BLOCKS),
                )
            ),
        )
        for i, name in enumerate(GAPPED)
    ]
    ep = endpoint(layers=dests)
    send(ep, meta(v2=v2, layouts={n: src_layout(tensors=2) for n in GAPPED}))
    ep.add_request("r1", [5], [5], 0.0)
    for seq, (number, (name, dst)) in enumerate(zip((1, 2, 4, 7), dests, strict=True), 1):
        # A v1 Prefill sends the number parsed from the name, not a position.
        msg = ReadReadyBatch(
            layer_idx=number,
            layer_name=name,
            read_reqs=[rr("r1", [9])],
            done_ext_ids=["r1"] if number == 7 else [],
            group_member_idx=0,
            tp_ratio=1,
            seq=seq if v2 else None,
        )
        outs = send(ep, msg)
        plan = only(outs, StartRead).plan
        assert plan.layer_name == name
        assert [c.dst_base for c in plan.main] == [c.base for c in dst.main]
        (reply,) = replies(finish(ep, outs))
        assert isinstance(reply, ReadDone) and reply.layer_idx == number
    assert ep.requests() == {"r1": "done_on_rank"}


def test_a_layer_present_on_one_side_only_fails_that_layer_alone() -> None:
    # Prefill has layers 1, 2, 3; Decode has 1, 2, 5: layer 3 is refused, not misplaced.
    decode_names = [f"model.layers.{n}.self_attn" for n in (1, 2, 5)]
    ep = endpoint(layers=[(name, dst_layout(indexer=False)) for name in decode_names])
    prefill_names = [f"model.layers.{n}.self_attn" for n in (1, 2, 3)]
    send(ep, meta(layouts={n: src_layout(tensors=2) for n in prefill_names}))
    msg = ReadReadyBatch(
        layer_idx=3,
        layer_name=prefill_names[2],
        read_reqs=[],
        done_ext_ids=[],
        group_member_idx=0,
        tp_ratio=1,
        seq=1,
    )
    reply = replies(send(ep, msg))[0]
    assert reply.code == ErrorCode.UNKNOWN_LAYER and "model.layers.3" in reply.error
    msg.layer_idx, msg.layer_name, msg.seq = 2, prefill_names[1], 2
    (reply,) = replies(send(ep, msg))
    assert isinstance(reply, ReadDone) and reply.layer_idx == 2


# -- parking (early readiness) -------------------------------------------------------------


def test_unknown_request_parked_then_served_when_added() -> None:
    ep = ready()
    outs0 = send(ep, rrb(0, [rr("r1", [5])], seq=1), now=1.0)
    outs1 = send(ep, rrb(1, [rr("r1", [5])], seq=2), now=1.1)
    assert outs0 == [] and outs1 == []
    assert list(ep.parked().values()) == [("r1",), ("r1",)]
    assert ep.get_timer() == pytest.approx(1.0 + ep.config.park_timeout_s)
    outs = ep.add_request("r1", [9], [9], 2.0)
    plans = [s.plan for s in of(outs, StartRead)]
    assert [p.layer_name for p in plans] == LAYER_NAMES[:2]  # arrival order
    assert ep.parked() == {} and ep.stats.parked == 2


def test_a_session_flooding_the_park_leaves_room_for_the_others() -> None:
    # Issue 12: 150 readiness frames naming 16,384 unknown requests each cost 13 MB apiece
    # within max_parked. Now the park holds at most a session's share of bytes.
    import tracemalloc

    ep = endpoint(max_parked_bytes=2_400_000, max_parked_bytes_per_session=1_200_000)
    send(ep, meta("bad"), peer=b"bad")
    send(ep, meta("good"), peer=b"good")
    flood = [rr(f"x{i}", [1]) for i in range(5_000)]  # 3 ids per entry: 15,000 ids
    tracemalloc.start()
    try:
        for seq in range(20):
            outs = send(ep, rrb(0, flood, seq=seq), peer=b"bad")
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ep.parked()) == 1  # its share: one such message; the others served at once
    (reply,) = replies(outs)
    # Not one request known: the readiness fails whole, no failure record per request.
    assert isinstance(reply, ReadFailed) and reply.code == ErrorCode.UNKNOWN_REQUEST
    assert "none of its 5000 requests" in (reply.error or "")
    assert ep.stats.park_budget_refusals == 19 and ep.stats.isolated_requests == 0
    assert held < 8 << 20, f"{held} bytes held"
    # The good session still parks what outran its Decode request, and is served.
    assert send(ep, rrb(0, [rr("g1", [7])], seq=0), peer=b"good") == []
    outs = ep.add_request("g1", [9], [9], 0.0)
    assert [s.plan.session for s in of(outs, StartRead)] == ["good"]


def test_a_full_park_still_serves_the_known_requests_a_readiness_names() -> None:
    ep = endpoint(max_parked_bytes=2_400_000, max_parked_bytes_per_session=1_200_000)
    send(ep, meta("s"))
    flood = [rr(f"x{i}", [1]) for i in range(5_000)]
    send(ep, rrb(0, flood, seq=0))  # the session's share of the park, taken
    ep.add_request("known", [9], [9], 0.0)
    outs = send(ep, rrb(0, [*flood, rr("known", [3])], seq=1))
    (start,) = of(outs, StartRead)
    assert [r.ext_req_id for r in start.plan.requests] == ["known"]
    assert ep.stats.park_budget_refusals == 1 and ep.stats.isolated_requests == 5_000


def test_sessions_one_connection_opens_are_bounded_in_bytes() -> None:
    # Issue 12: 300 handshakes from one connection, each a new session with a big layout,
    # were all kept. Now that connection's oldest sessions go; nobody else's. (Issue 24:
    # the budgets count the bytes a session holds, see consumer.held.)
    names = [f"model.layers.{i}.self_attn" for i in range(64)]
    big = {name: src_layout() for name in names}
    probe = endpoint()
    send(probe, meta("s00", layouts=big), peer=b"bad")
    one = probe.state.sessions["s00"].held
    ep = endpoint(max_session_bytes_per_peer=4 * one + one // 2, max_session_bytes=64 * one)
    send(ep, meta("good"), peer=b"good")
    for i in range(100):
        send(ep, meta(f"s{i}", layouts=big), peer=b"bad")
    sessions = ep.sessions()
    assert "good" in sessions
    assert sorted(n for n in sessions if n != "good") == ["s96", "s97", "s98", "s99"]
    assert ep.stats.sessions_forgotten == 96
    # Many connections at once: the total holds, the heaviest connections' go first.
    for i in range(80):
        send(ep, meta(f"m{i}", layouts=big), peer=f"peer{i}".encode())
    assert ep.state.session_bytes <= 64 * one
    assert sum(1 for n in ep.sessions() if n.startswith(("m", "s"))) <= 64
    assert "m79" in ep.sessions() and not any(n.startswith("s") for n in ep.sessions())
    assert ep.state.session_bytes == sum(s.held for s in ep.state.sessions.values())


def test_parked_message_waits_for_all_its_requests() -> None:
    ep = ready()
    send(ep, rrb(0, [rr("a", [1]), rr("b", [2])], seq=1))
    assert ep.add_request("a", [0], [0], 0.0) == []
    assert list(ep.parked().values()) == [("b",)]
    outs = ep.add_request("b", [1], [1], 0.0)
    assert request_ids(only(outs, StartRead).plan) == ["a", "b"]


def test_parked_message_expires_and_is_served_with_unknown_isolated() -> None:
    ep = ready()
    ep.add_request("known", [0], [0], 0.0)
    send(ep, rrb(0, [rr("known", [1]), rr("late", [2])], seq=1), now=0.0)
    assert ep.handle_timer(ep.config.park_timeout_s - 0.01) == []
    outs = ep.handle_timer(ep.config.park_timeout_s)
    assert request_ids(only(outs, StartRead).plan) == ["known"]
    (f,) = replies(finish(ep, outs))[0].failed
    assert f.ext_req_id == "late" and f.code == ErrorCode.UNKNOWN_REQUEST
    assert ep.stats.park_expired == 1


def test_park_overflow_serves_at_once() -> None:
    ep = ready(max_parked=1)
    send(ep, rrb(0, [rr("x", [1])], seq=1))
    outs = send(ep, rrb(1, [rr("y", [1])], seq=2))
    (reply,) = replies(outs)  # its one request unknown: it fails whole
    assert isinstance(reply, ReadFailed) and reply.code == ErrorCode.UNKNOWN_REQUEST
    assert ep.stats.park_overflow == 1


def test_parked_readiness_released_by_local_abort_of_unknown_id() -> None:
    ep = ready()
    send(ep, rrb(0, [rr("x", [1])], seq=1))
    outs = ep.abort(["x"], "client left", 0.5)
    assert replies(outs)[0].failed[0].ext_req_id == "x"
    assert ep.is_idle()


def test_parked_lease_bound_then_lease_expired() -> None:
    ep = ready()
    send(ep, rrb(0, [rr("r1", [1])], seq=1, lease_ms=2000), now=10.0)
    assert ep.get_timer() == pytest.approx(11.0)  # half the lease, sooner than the park bound
    assert of(ep.add_request("r1", [0], [0], 10.5), StartRead)  # in time
    # Parked until exactly half the lease is left: still allowed to start.
    ep.add_request("k", [1], [1], 20.0)
    send(ep, rrb(1, [rr("k", [1]), rr("r2", [1])], seq=2, lease_ms=2000), now=20.0)
    outs = ep.handle_timer(21.0)
    assert request_ids(only(outs, StartRead).plan) == ["k"]
    # Served after the half-way point: refused.
    send(ep, rrb(2, [rr("r3", [1])], seq=3, lease_ms=2000), now=30.0)
    ep.add_request("r3", [0], [0], 31.5)
    assert ep.stats.expired_leases == 1
    assert ep.requests()["r3"] == "failed"


def test_lease_expired_reply_shape() -> None:
    ep = ready()
    send(ep, rrb(0, [rr("r1", [1])], seq=7, lease_ms=1000), now=0.0)
    outs = ep.add_request("r1", [0], [0], 0.6)
    reply = replies(outs)[0]
    assert (
        isinstance(reply, ReadFailed) and reply.code == ErrorCode.LEASE_EXPIRED and reply.seq == 7
    )
    assert only(outs, RequestFailed).code == ErrorCode.LEASE_EXPIRED


def test_start_by_is_half_the_lease_and_runtime_lease_refusal() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [1])], seq=1, lease_ms=4000), now=100.0)
    start = only(outs, StartRead)
    assert start.start_by == pytest.approx(102.0)
    err = TransferError("worker queue too deep", transient=True)
    err.code = ErrorCode.LEASE_EXPIRED
    outs = ep.read_finished(start.plan.read_id, err, 102.5)
    reply = replies(outs)[0]
    assert reply.code == ErrorCode.LEASE_EXPIRED
    assert ep.stats.expired_leases == 1 and ep.stats.read_retries == 0


def test_parked_abort_applies_when_request_arrives() -> None:
    ep = ready()
    send(ep, Abort(ext_ids=["r1", "r2"], reason="lease expired"))
    assert len(ep.parked()) == 1
    outs = ep.add_request("r1", [0], [0], 0.0)
    assert only(outs, RequestFailed).code == ErrorCode.ABORTED
    assert of(outs, SendAbort) == []  # the aborting peer is not told back
    outs = ep.add_request("r2", [1], [1], 0.0)
    assert only(outs, RequestFailed).ext_req_id == "r2"
    assert ep.parked() == {}


def test_parked_abort_expires_and_overflow_drops() -> None:
    ep = ready(max_parked=1)
    send(ep, Abort(ext_ids=["r1"]))
    send(ep, Abort(ext_ids=["r2"]))
    assert ep.stats.park_overflow == 1 and ep.stats.dropped == 1
    assert ep.handle_timer(ep.config.park_timeout_s) == []
    assert ep.is_idle()
    assert of(ep.add_request("r1", [0], [0], 20.0), RequestFailed) == []


def test_parked_readiness_after_session_gone_or_refused() -> None:
    ep = ready(max_sessions=1)
    send(ep, rrb(0, [rr("r1", [1])], seq=1))
    send(ep, meta("other"), peer=b"x")  # p0 forgotten
    reply = replies(ep.add_request("r1", [0], [0], 0.0))[0]
    assert reply.code == ErrorCode.UNKNOWN_SESSION
    ep2 = ready()
    send(ep2, rrb(0, [rr("r1", [1])], seq=1))
    send(ep2, meta(blob=b"\xc1"))  # the re-handshake fails
    reply = replies(ep2.add_request("r1", [0], [0], 0.0))[0]
    assert reply.code == ErrorCode.MALFORMED and "refused" in reply.error


# -- read outcomes -------------------------------------------------------------------------


@pytest.mark.parametrize("v2", [True, False])
def test_read_failure_fails_every_request_with_main_and_indexer_blocks(v2: bool) -> None:
    ep = ready(v2=v2)
    ep.add_request("r1", [10, 11], [20, 21], 0.0)
    ep.add_request("r2", [12], [22], 0.0)
    ep.add_request("r3", [], [], 0.0)  # nothing to read here, still part of the message
    outs = send(ep, rrb(0, [rr("r1", [1, 2]), rr("r2", [3]), rr("r3", [])], seq=5 if v2 else None))
    outs = finish(ep, outs, error=TransferError("memfabric read returned -3", -3))
    reply = replies(outs)[0]
    assert isinstance(reply, ReadFailed) and "-3" in reply.error
    if v2:
        assert reply.code == ErrorCode.TRANSFER_FAILED and reply.seq == 5
    else:
        assert wire_len(reply) == 3
    failed = {f.ext_req_id: f for f in of(outs, RequestFailed)}
    assert set(failed) == {"r1", "r2", "r3"}
    assert failed["r1"].main_block_ids == (10, 11) and failed["r1"].indexer_block_ids == (20, 21)
    assert ep.stats.reads_failed == 1


def test_transient_failure_is_retried_once_then_reported() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [1])], seq=1))
    first = only(outs, StartRead).plan
    outs = ep.read_finished(first.read_id, TransferError("busy", transient=True), 0.1)
    second = only(outs, StartRead).plan
    assert second.read_id != first.read_id and second.requests == first.requests
    assert replies(outs) == [] and ep.stats.read_retries == 1
    with pytest.raises(LocalProtocolError):
        ep.read_finished(first.read_id, None, 0.2)
    outs = ep.read_finished(second.read_id, TransferError("busy", transient=True), 0.2)
    assert isinstance(replies(outs)[0], ReadFailed)


def test_retry_drops_requests_that_stopped_waiting() -> None:
    ep = ready()
    ep.add_request("a", [0], [0], 0.0)
    ep.add_request("b", [1], [1], 0.0)
    plan = only(send(ep, rrb(0, [rr("a", [1]), rr("b", [2])], seq=1)), StartRead).plan
    ep.abort(["a"], "gone", 0.05)
    ep.release("a", 0.06)
    outs = ep.read_finished(plan.read_id, TransferError("busy", transient=True), 0.1)
    assert Releasable("a") in outs
    retry = only(outs, StartRead).plan
    assert request_ids(retry) == ["b"]
    outs = ep.read_finished(retry.read_id, None, 0.2)
    assert replies(outs) == [ReadDone(layer_idx=0, seq=1)]


def test_no_retry_when_nothing_waits_or_lease_margin_gone() -> None:
    ep = ready()
    ep.add_request("a", [0], [0], 0.0)
    plan = only(send(ep, rrb(0, [rr("a", [1])], seq=1)), StartRead).plan
    ep.abort(["a"], "gone", 0.0)
    outs = ep.read_finished(plan.read_id, TransferError("busy", transient=True), 0.1)
    assert of(outs, StartRead) == [] and isinstance(replies(outs)[0], ReadFailed)
    ep.add_request("b", [0], [0], 0.0)
    plan = only(send(ep, rrb(0, [rr("b", [1])], seq=2, lease_ms=1000), now=1.0), StartRead).plan
    outs = ep.read_finished(plan.read_id, TransferError("busy", transient=True), 1.6)
    assert of(outs, StartRead) == []


def test_unknown_read_id_raises() -> None:
    ep = ready()
    with pytest.raises(LocalProtocolError, match="not in flight"):
        ep.read_finished(12345, None, 0.0)


# -- abort, release, quiescence ------------------------------------------------------------


def test_abort_while_read_in_flight_delays_release_until_read_finished() -> None:
    ep = ready()
    ep.add_request("r1", [0, 1], [2, 3], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [5, 6])], seq=1))
    start = only(outs, StartRead)
    outs = ep.abort(["r1"], "client disconnected", 1.0)
    assert only(outs, RequestFailed).code == ErrorCode.ABORTED
    abort = only(outs, SendAbort)
    assert (
        abort.peer == PEER
        and abort.msg.ext_ids == ["r1"]
        and "client disconnected" in abort.msg.reason
    )
    assert ep.stats.aborts_sent == 1
    assert ep.release("r1", 1.1) == []  # a read may still write its blocks
    assert ep.requests() == {"r1": "release_pending"}
    assert ep.in_flight_count("r1") == 1
    outs = ep.read_finished(start.plan.read_id, None, 2.0)
    assert Releasable("r1") in outs and of(outs, RequestDone) == []
    assert ep.is_idle()
    # Readiness arriving later for the retired id is refused at once, not parked.
    reply = replies(send(ep, rrb(1, [rr("r1", [5, 6])], seq=2)))[0]
    assert reply.failed[0].code == ErrorCode.UNKNOWN_REQUEST


def test_release_before_kv_arrived_fails_then_releases_when_quiescent() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    start = only(send(ep, rrb(0, [rr("r1", [5])], seq=1)), StartRead)
    outs = ep.release("r1", 1.0)
    assert only(outs, RequestFailed).code == ErrorCode.ABORTED
    assert only(outs, SendAbort).msg.ext_ids == ["r1"]
    assert of(outs, Releasable) == []
    # New readiness for it is isolated (never written while release is pending).
    reply_outs = send(ep, rrb(1, [rr("r1", [5])], seq=2))
    assert replies(reply_outs)[0].failed[0].code == ErrorCode.ABORTED
    outs = ep.read_finished(start.plan.read_id, TransferError("x"), 2.0)
    assert Releasable("r1") in outs
    assert of(outs, RequestFailed) == []  # the request already reported its failure


def test_release_without_reads_is_immediate() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    outs = ep.release("r1", 0.0)
    assert of(outs, Releasable) == [Releasable("r1")] and only(outs, RequestFailed)
    assert of(outs, SendAbort) == []  # no Prefill published for it
    assert ep.release("never-added", 0.0) == [Releasable("never-added")]
    with pytest.raises(LocalProtocolError):
        ep.advertise("r1", 0.0)


def test_release_of_failed_request_with_read_in_flight() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    start = only(send(ep, rrb(0, [rr("r1", [5])], seq=1)), StartRead)
    send(ep, Abort(ext_ids=["r1"], reason="lease"))
    assert ep.requests() == {"r1": "failed"}
    assert ep.release("r1", 0.5) == []
    with pytest.raises(LocalProtocolError):
        ep.release("r1", 0.6)  # released twice
    assert ep.read_finished(start.plan.read_id, None, 1.0) == [
        Reply(PEER, ReadDone(layer_idx=0, seq=1)),
        Releasable("r1"),
    ]


def test_abort_from_prefill_fails_and_tells_other_contributors() -> None:
    ep = endpoint()
    for m in range(2):
        send(ep, meta(f"s{m}"), peer=f"p{m}".encode())
    ep.add_request("r1", [0], [0, 1], 0.0)
    for m in range(2):
        outs = send(
            ep, rrb(0, [rr("r1", [5], [6, 7])], member=m, ratio=2, seq=1), peer=f"p{m}".encode()
        )
        finish(ep, outs)
    outs = send(ep, Abort(ext_ids=["r1", "r1"], reason="lease expired"), peer=b"p0")
    failed = only(outs, RequestFailed)
    assert failed.code == ErrorCode.ABORTED and "lease expired" in failed.message
    assert [a.peer for a in of(outs, SendAbort)] == [b"p1"]
    assert ep.stats.aborts_received == 1
    # Aborting again changes nothing.
    assert of(send(ep, Abort(ext_ids=["r1"]), peer=b"p1"), RequestFailed) == []


def test_abort_from_unbound_peer_is_dropped() -> None:
    ep = endpoint()
    ep.add_request("r1", [0], [0], 0.0)
    assert send(ep, Abort(ext_ids=["r1"])) == []
    assert ep.requests() == {"r1": "advertised"} and ep.stats.dropped == 1


def test_aborts_only_to_v2_peers_with_the_capability() -> None:
    ep = endpoint()
    send(ep, meta("v1", v2=False), peer=b"a")
    send(ep, meta("nocap", caps=[CAP_SEQ]), peer=b"b")
    send(ep, meta("full"), peer=b"c")
    ep.add_request("r1", [0], [0, 1, 2], 0.0)
    for m, peer in enumerate((b"a", b"b", b"c")):
        seq = None if peer == b"a" else 1
        outs = send(ep, rrb(0, [rr("r1", [5], [6, 7, 8])], member=m, ratio=3, seq=seq), peer=peer)
        finish(ep, outs)
    outs = ep.abort(["r1"], "stop", 1.0)
    assert [a.peer for a in of(outs, SendAbort)] == [b"c"]


def test_abort_of_many_requests_is_one_message_per_peer() -> None:
    ep = ready()
    ids = [f"r{i}" for i in range(5)]
    for i, ext in enumerate(ids):
        ep.add_request(ext, [i], [i], 0.0)
    finish(ep, send(ep, rrb(0, [rr(ext, [i]) for i, ext in enumerate(ids)], seq=1)))
    outs = ep.abort([*ids, "unknown"], "shutdown", 1.0)
    assert len(of(outs, RequestFailed)) == 5
    assert only(outs, SendAbort).msg.ext_ids == ids


def test_advertise_later() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0, advertised=False)
    assert ep.requests() == {"r1": "allocated"}
    ep.advertise("r1", 1.0)
    assert ep.requests() == {"r1": "advertised"}
    with pytest.raises(LocalProtocolError):
        ep.advertise("r1", 1.0)


def test_add_request_misuse_raises() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    with pytest.raises(LocalProtocolError, match="already registered"):
        ep.add_request("r1", [0], [0], 0.0)
    with pytest.raises(LocalProtocolError, match="main destination") as info:
        ep.add_request("r2", [NUM_BLOCKS], [0], 0.0)
    assert info.value.code == ErrorCode.DESTINATION_RANGE
    with pytest.raises(LocalProtocolError, match="indexer destination"):
        ep.add_request("r2", [0], [-1], 0.0)


# -- timers --------------------------------------------------------------------------------


def test_kv_load_timeout_fails_request_and_aborts_peers() -> None:
    ep = ready(kv_load_timeout_s=5.0)
    ep.add_request("r1", [0], [0], 0.0)
    ep.add_request("r2", [1], [1], 1.0)
    assert ep.get_timer() == 5.0
    finish(ep, send(ep, rrb(0, [rr("r1", [1])], seq=1), now=3.0), now=4.0)  # progress
    assert ep.get_timer() == 6.0  # r2 is now the first to expire
    assert ep.handle_timer(5.99) == []
    outs = ep.handle_timer(6.0)
    assert only(outs, RequestFailed).ext_req_id == "r2" and of(outs, SendAbort) == []
    outs = ep.handle_timer(9.0)
    failed = only(outs, RequestFailed)
    assert failed.ext_req_id == "r1" and failed.code == ErrorCode.TIMEOUT
    assert only(outs, SendAbort).msg.ext_ids == ["r1"]
    assert ep.stats.load_timeouts == 2 and ep.get_timer() is None


# -- malformed input -----------------------------------------------------------------------


def _raw(fields: list[Any]) -> bytes:
    return msgspec.msgpack.encode(fields)


def test_garbage_is_dropped_and_counted() -> None:
    ep = ready()
    for frame in (
        b"",
        b"\xc1",
        b"\x93\xa1x\x01\x02",
        _raw([b"nonsense", 1]),
        _raw([b"read_ready_batch"]),
    ):
        assert ep.receive(PEER, frame, 0.0) == []
    assert ep.stats.malformed_frames == 5 and ep.stats.dropped == 5


def test_identifiable_malformed_readiness_gets_failure_reply() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    # A negative block id: typed decoding refuses it, but layer and seq are readable.
    frame = _raw(
        [TAG_READ_READY_BATCH, 4, LAYER_NAMES[0], [["r1", [-1], [0], 0, 0]], ["r1"], 0, 1, 77]
    )
    outs = ep.receive(PEER, frame, 0.0)
    reply = replies(outs)[0]
    assert isinstance(reply, ReadFailed) and reply.layer_idx == 4 and reply.seq == 77
    assert reply.code == ErrorCode.OUT_OF_RANGE
    assert only(outs, RequestFailed).ext_req_id == "r1"
    # v1-shaped (no seq): v1 read_failed. member >= ratio is refused as out of range.
    frame = _raw([TAG_READ_READY_BATCH, 2, LAYER_NAMES[2], [], [], 3, 2])
    reply = replies(ep.receive(PEER, frame, 0.0))[0]
    assert reply == ReadFailed(layer_idx=2, error=reply.error) and "group_member_idx" in reply.error
    # Unreadable seq or layer: dropped.
    assert ep.receive(PEER, _raw([TAG_READ_READY_BATCH, 2, "x", [], [], 0, 1, "s"]), 0.0) == []
    assert ep.receive(PEER, _raw([TAG_READ_READY_BATCH, -2, "x", 5]), 0.0) == []
    assert ep.stats.malformed_frames == 4 and ep.stats.dropped == 2


def test_identify_ignores_odd_entries() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    frame = _raw([TAG_READ_READY_BATCH, 0, 7, [5, [], [1], ["r1", "bad"]], "nope"])
    outs = ep.receive(PEER, frame, 0.0)
    assert only(outs, RequestFailed).ext_req_id == "r1"


def test_unexpected_messages_from_prefill_are_counted() -> None:
    ep = ready()
    assert send(ep, ReadDone(layer_idx=0)) == []
    assert send(ep, Ack(protocol_version=2)) == []
    assert ep.receive(PEER, b"ACK", 0.0) == []
    assert ep.stats.unexpected_messages == 3


def test_internal_table_miss_from_peer_input_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = ready()

    def broken(*_a: Any) -> None:
        raise LocalProtocolError("table miss")

    monkeypatch.setattr(SessionEffects, "on_readiness", broken)
    assert send(ep, rrb(0, [], seq=1)) == []
    assert ep.stats.protocol_errors == 1


# -- reconnect -----------------------------------------------------------------------------


def test_readiness_without_handshake_gets_unknown_session() -> None:
    ep = endpoint()
    ep.add_request("r1", [0], [0], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [1])], seq=3))
    reply = replies(outs)[0]
    assert reply == ReadFailed(
        layer_idx=0, error=reply.error, seq=3, code=ErrorCode.UNKNOWN_SESSION
    )
    assert of(outs, RequestFailed) == []  # a v2 Prefill replays it after a new handshake
    send(ep, meta())
    assert of(send(ep, rrb(0, [rr("r1", [1])], seq=3)), StartRead)
    # v1-shaped: a v1 Prefill never replays; its requests fail now.
    ep2 = endpoint()
    ep2.add_request("r1", [0], [0], 0.0)
    outs = send(ep2, rrb(0, [rr("r1", [1])]))
    assert wire_len(replies(outs)[0]) == 3
    assert only(outs, RequestFailed).code == ErrorCode.UNKNOWN_SESSION
    assert ep2.stats.unknown_session == 1


# -- bounded state -------------------------------------------------------------------------


def test_retired_ids_are_bounded() -> None:
    ep = ready(max_retired=3)
    for i in range(10):
        ep.release(f"x{i}", 0.0)
    outs = send(ep, rrb(0, [rr("x0", [1])], seq=1))
    assert outs == []  # x0 was forgotten: a readiness for it is parked again
    outs = send(ep, rrb(0, [rr("x9", [1])], seq=2))
    assert replies(outs)[0].failed[0].ext_req_id == "x9"


_ENDINGS = ("done", "read_fail", "abort", "prefill_abort", "timeout", "release_early", "isolate")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(_ENDINGS), min_size=1, max_size=12), st.booleans())
def test_no_residual_state_after_churn(endings: list[str], park_first: bool) -> None:
    ep = ready(kv_load_timeout_s=50.0)
    now = 0.0
    terminal: dict[str, int] = {}
    seqs = itertools.count(1)  # a v2 Prefill numbers readiness consecutively
    for i, ending in enumerate(endings):
        ext = f"r{i}"
        now += 1.0
        first = rrb(0, [rr(ext, [1])], seq=next(seqs), done=[ext] if ending == "done" else [])
        if park_first:
            send(ep, first, now=now)
            outs = ep.add_request(ext, [i % NUM_BLOCKS], [i % NUM_BLOCKS], now)
        else:
            ep.add_request(ext, [i % NUM_BLOCKS], [i % NUM_BLOCKS], now)
            outs = send(ep, first, now=now)
        starts = of(outs, StartRead)
        read_id = starts[0].plan.read_id if starts else None
        if ending == "abort":
            outs += ep.abort([ext], "x", now)
        elif ending == "prefill_abort":
            outs += send(ep, Abort(ext_ids=[ext]), now=now)
        elif ending == "release_early":
            outs += ep.release(ext, now)
        elif ending == "isolate":
            outs += send(ep, rrb(1, [rr(ext, [1, 2, 3])], seq=next(seqs)), now=now)
        if read_id is not None:
            err = TransferError("x") if ending == "read_fail" else None
            outs += ep.read_finished(read_id, err, now)
        if ending == "timeout":
            outs += ep.handle_timer(now + 100.0)
            now += 100.0
        for o in outs:
            if isinstance(o, RequestDone | RequestFailed):
                terminal[o.ext_req_id] = terminal.get(o.ext_req_id, 0) + 1
        if ending != "release_early":
            ep.release(ext, now)
    # Exactly one terminal report per request, and nothing left behind.
    assert terminal == {f"r{i}": 1 for i in range(len(endings))}
    assert ep.is_idle(), (ep.requests(), ep.in_flight_reads(), ep.parked())
    assert ep.get_timer() is None


# -- corner cases --------------------------------------------------------------------------


def test_oversized_frame_is_dropped() -> None:
    ep = ready()
    frame = _raw([TAG_READ_READY_BATCH, 0, "x", [], [], 0, 1, 1, 0, "x" * (16 << 20)])
    assert ep.receive(PEER, frame, 0.0) == []
    assert ep.stats.dropped == 1


@pytest.mark.parametrize("where", ["entries", "ids", "entry"])
def test_a_refused_frame_costs_no_more_than_the_bounded_codec(where: str) -> None:
    # Issue: a 16 MiB frame the codec refuses at once was then decoded untyped to find
    # its layer and ids: seconds of CPU and a GB of Python objects per frame, on the I/O
    # thread. Now the fields are scanned, not built: memory stays flat.
    import tracemalloc

    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    n = 1_500_000
    if where == "entries":  # far more entries than a batch may hold
        fields = [[["r1", [1]] for _ in range(n)], []]
    elif where == "ids":  # far more done ids than a batch may hold
        fields = [[], ["r1"] * n]
    else:  # one entry with far more block ids than a request may have
        fields = [[["r1", list(range(n)), [0], 0, 0]], []]
    frame = _raw([TAG_READ_READY_BATCH, 1, LAYER_NAMES[1], *fields, 0, 1, 9])
    assert 4 << 20 < len(frame) <= 16 << 20
    tracemalloc.start()
    try:
        outs = ep.receive(PEER, frame, 0.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes"
    (reply,) = replies(outs)
    assert isinstance(reply, ReadFailed) and (reply.layer_idx, reply.seq) == (1, 9)
    # The named request fails where its name could be read within the bounds.
    failed = [o.ext_req_id for o in outs if isinstance(o, RequestFailed)]
    assert failed == (["r1"] if where == "entry" else [])


def test_identify_with_non_list_entries() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    frame = _raw([TAG_READ_READY_BATCH, 1, "x", 7, ["r1"], 0, 1, 2])
    outs = ep.receive(PEER, frame, 0.0)
    assert replies(outs)[0].seq == 2 and only(outs, RequestFailed).ext_req_id == "r1"
    frame = _raw([TAG_READ_READY_BATCH, 1, "x", [["ghost", [1]]], [], 0, 1, 3])
    assert of(ep.receive(PEER, frame, 0.0), RequestFailed) == []


def test_eviction_of_a_session_without_identity() -> None:
    ep = endpoint(max_sessions=2)
    send(ep, meta("p0"), peer=b"a")
    send(ep, meta("p1"), peer=b"a")  # p0 loses its identity
    send(ep, meta("p2"), peer=b"b")  # p0 is the oldest: forgotten
    assert ep.sessions() == {"p1": "ready_v2", "p2": "ready_v2"}


def test_readiness_for_aborted_or_failed_request_is_isolated_with_its_reason() -> None:
    ep = ready()
    ep.add_request("ab", [0], [0], 0.0)
    ep.add_request("fa", [1], [1], 0.0)
    ep.abort(["ab"], "client left", 0.0)
    send(ep, Abort(ext_ids=["fa"], reason="lease"))
    reply = replies(send(ep, rrb(0, [rr("ab", [1]), rr("fa", [1])], seq=1)))[0]
    by_id = {f.ext_req_id: f for f in reply.failed}
    assert by_id["ab"].code == ErrorCode.ABORTED and "aborted" in by_id["ab"].message
    assert by_id["fa"].code == ErrorCode.ABORTED and "already failed" in by_id["fa"].message


def test_prefill_abort_of_retired_id_is_ignored() -> None:
    ep = ready()
    ep.release("old", 0.0)
    assert send(ep, Abort(ext_ids=["old"])) == []
    assert ep.parked() == {} and ep.stats.aborts_received == 1


def test_done_signal_of_request_aborted_during_read_does_not_count() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    outs = send(ep, rrb(LAST, [rr("r1", [1])], done=["r1"], seq=1))
    ep.abort(["r1"], "gone", 0.1)
    outs = finish(ep, outs)
    assert of(outs, RequestDone) == [] and ep.requests() == {"r1": "aborted"}


def test_failure_texts_are_dropped_when_the_reply_would_be_too_large(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import rd2h_protocol.consumer.replies as replies_module

    monkeypatch.setattr(replies_module, "REPLY_TEXT_BUDGET", 10)
    ep = ready()
    outs = send(ep, rrb(0, [rr("someone", [1])], seq=1))
    outs = ep.handle_timer(ep.get_timer() or 0.0)
    (f,) = replies(outs)[0].failed
    assert f.ext_req_id == "someone" and f.message == ""


def test_two_parked_messages_for_one_request_expire_separately() -> None:
    ep = ready()
    send(ep, rrb(0, [rr("x", [1])], seq=1), now=0.0)
    send(ep, rrb(1, [rr("x", [1])], seq=2), now=1.0)
    outs = ep.handle_timer(ep.config.park_timeout_s)
    assert [r.layer_idx for r in replies(outs)] == [0]
    outs = ep.add_request("x", [0], [0], 2.0)
    assert only(outs, StartRead).plan.layer_name == LAYER_NAMES[1]


def test_parked_prefill_abort_resolved_by_local_release() -> None:
    ep = ready()
    send(ep, Abort(ext_ids=["x"]))
    assert ep.release("x", 0.0) == [Releasable("x")]
    assert ep.parked() == {} and ep.is_idle()


_wire_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from([b"read_ready_batch", b"mf_meta", b"abort", "r1", LAYER_NAMES[0]]),
    lambda children: st.lists(children, max_size=9),
    max_leaves=12,
)


@settings(max_examples=100, deadline=None)
@given(st.lists(_wire_value, max_size=10), st.binary(max_size=40))
def test_hostile_frames_never_raise(fields: list[Any], noise: bytes) -> None:
    ep = ready()
    ep.add_request("r1", [0, 1], [0, 1], 0.0)
    for frame in (_raw([TAG_READ_READY_BATCH, *fields]), _raw(fields), noise):
        for out in ep.receive(PEER, frame, 1.0):
            if isinstance(out, Reply):
                decode(encode(out.msg))  # every reply is a valid frame
            if isinstance(out, StartRead):
                ep.read_finished(out.plan.read_id, None, 1.0)
    assert set(ep.requests()) <= {"r1"}


# -- fast paths keep the checks ------------------------------------------------------------


def _array16(msg: ReadReadyBatch) -> bytes:
    """``msg`` spelled with an array16 header (legal msgpack, unlike what encoders write)."""
    frame = encode(msg)
    assert 0x91 <= frame[0] <= 0x9F
    return b"\xdc" + (frame[0] & 0x0F).to_bytes(2, "big") + frame[1:]


@pytest.mark.parametrize("bad_id", [None, NUM_BLOCKS - 1, NUM_BLOCKS])
def test_readiness_decodes_alike_on_every_path(
    bad_id: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session with num_blocks decodes readiness with the bound checked; any other
    spelling (or an id at the bound) takes the general path: same plan, same reply."""
    fast = _spy_fast(monkeypatch)
    seen = []
    for frame_of in (encode, _array16):
        ep = ready()
        ep.add_request("r1", [3, 4], [5], 0.0)
        ep.add_request("r2", [6], [7], 0.0)
        last = 9 if bad_id is None else bad_id
        msg = rrb(0, [rr("r1", [1, 2], [8]), rr("r2", [0], [last])], seq=1)
        outs = ep.receive(PEER, frame_of(msg), 0.0)
        plans = [
            (r.ext_req_id, *map(list, (r.main_src, r.main_dst, r.indexer_src, r.indexer_dst)))
            for o in of(outs, StartRead)
            for r in o.plan.requests
        ]
        seen.append((plans, replies(finish(ep, outs))))
    # the handshake, then the readiness: fast unless spelled otherwise or out of bound
    assert fast == [False, bad_id != NUM_BLOCKS, False, False]
    assert seen[0] == seen[1]
    plans, (reply,) = seen[0]
    if bad_id == NUM_BLOCKS:
        assert [(f.ext_req_id, f.code) for f in reply.failed] == [("r2", ErrorCode.OUT_OF_RANGE)]
        assert [p[0] for p in plans] == ["r1"]
    else:
        assert reply.failed is None
        assert plans[1] == ("r2", [0], [6], [last], [7])


def test_source_ids_checked_against_the_layout_in_force_when_served() -> None:
    """Ids proven below the bound of the layout at decode time are checked again when the
    session re-handshakes with fewer blocks while the message is parked."""
    ep = ready()
    send(ep, rrb(0, [rr("r1", [200], [1])], seq=1))  # r1 unknown: parked
    small = {name: src_layout(num_blocks=100) for name in LAYER_NAMES}
    send(ep, meta(layouts=small))
    reply = replies(ep.add_request("r1", [0], [0], 0.0))[0]
    assert [(f.ext_req_id, f.code) for f in reply.failed] == [("r1", ErrorCode.OUT_OF_RANGE)]


@pytest.mark.parametrize(
    "dst",
    [range(4, 8), range(4, 12, 2), [4, 5, 6, 7], [7, 4, 5, 6], (9,), [], [4, 5, 7, 8]],
    ids=repr,
)
def test_destination_ids_of_any_shape_plan_and_fail_alike(dst: Sequence[int]) -> None:
    ep = ready()
    ep.add_request("r1", dst, dst, 0.0)
    n = len(dst)
    outs = send(ep, rrb(0, [rr("r1", list(range(n)))], seq=1))
    if n:
        (read,) = only(outs, StartRead).plan.requests
        assert list(read.main_dst) == list(dst) and list(read.indexer_dst) == list(dst)
    failed = only(ep.abort(["r1"], "test", 0.0), RequestFailed)
    assert failed.main_block_ids == tuple(dst) and failed.indexer_block_ids == tuple(dst)


def _respelled(msg: ReadReadyBatch, idx: bytes, name: bytes) -> bytes:
    """``msg``'s frame with ``layer_idx`` and ``layer_name`` spelled as given."""
    frame = encode(msg)
    std = 1 + 18 + len(msgspec.msgpack.encode(msg.layer_idx))
    std += len(msgspec.msgpack.encode(msg.layer_name))
    return frame[:19] + idx + name + frame[std:]


def _name_spellings(name: bytes) -> dict[str, bytes]:
    n = len(name)
    return {
        "fixstr": bytes([0xA0 | n]) + name,
        "str8": b"\xd9" + n.to_bytes(1, "big") + name,
        "str16": b"\xda" + n.to_bytes(2, "big") + name,
        "str32": b"\xdb" + n.to_bytes(4, "big") + name,
    }


_IDX_SPELLINGS = {
    "fixint": b"\x01",
    "uint8": b"\xcc\x01",
    "uint16": b"\xcd\x00\x01",
    "uint32": b"\xce\x00\x00\x00\x01",
    "uint64": b"\xcf" + (1).to_bytes(8, "big"),
}


@pytest.mark.parametrize("idx", list(_IDX_SPELLINGS))
@pytest.mark.parametrize("name", ["fixstr", "str8", "str16", "str32"])
def test_every_spelling_of_layer_and_name_is_read_alike(idx: str, name: str) -> None:
    """Legal msgpack spellings of the fields before the entries: the entries' offset is
    found for those encoders write (else None), and the endpoint answers all alike."""
    from rd2h_protocol.wire.readiness import _entries_offset

    def run(frame: bytes) -> tuple[list[Any], list[Any]]:
        ep = ready()
        ep.add_request("r1", [3, 4], [5], 0.0)
        first = ep.receive(PEER, encode(rrb(0, [rr("r1", [1, 2], [8])], seq=1)), 0.0)
        finish(ep, first)  # the entries are kept now
        outs = ep.receive(PEER, frame, 0.0)
        reads = [list(r.main_src) for o in of(outs, StartRead) for r in o.plan.requests]
        return reads, replies(finish(ep, outs))

    msg = rrb(1, [rr("r1", [1, 2], [8])], seq=2)
    spelled = _respelled(msg, _IDX_SPELLINGS[idx], _name_spellings(LAYER_NAMES[1].encode())[name])
    offset = _entries_offset(spelled)
    if idx == "uint64" or name == "str32":
        assert offset is None
    else:
        assert offset is not None and spelled[offset:] == encode(msg)[-len(spelled) + offset :]
    assert run(spelled) == run(encode(msg)) == ([[1, 2]], [ReadDone(layer_idx=1, seq=2)])


def test_entries_offset_of_a_cut_frame_is_none() -> None:
    from rd2h_protocol.wire.readiness import _entries_offset

    msg = rrb(0, [rr("r1", [1])], seq=1)
    frame = encode(msg)
    for cut in (19, 20):  # nothing, or only layer_idx, after the head
        assert _entries_offset(frame[:cut]) is None
    str8 = _respelled(msg, b"\x00", _name_spellings(LAYER_NAMES[0].encode())["str8"])
    assert _entries_offset(str8[:21]) is None  # cut inside the name's length


def test_repeated_entries_are_decoded_once_and_read_alike() -> None:
    """Every layer of a step carries the same entries: they are decoded once (the plans of
    later layers hold the very same id objects) and read exactly as if decoded anew."""
    ep = ready()
    ep.add_request("r1", [10, 11], [12, 13], 0.0)
    ep.add_request("r2", [20], [21], 0.0)
    entries = [rr("r1", [1, 2], [3, 4]), rr("r2", [5], [5])]

    def layer(ep: ConsumerEndpoint, i: int, seq: int, done: Sequence[str] = ()) -> Any:
        outs = ep.receive(PEER, encode(rrb(i, entries, seq=seq, done=done)), 0.0)
        plan = only(outs, StartRead).plan
        return plan, replies(finish(ep, outs))

    plans = [layer(ep, i, i + 1) for i in range(NUM_LAYERS)]
    ids = [[(r.main_src, r.indexer_src) for r in p.requests] for p, _ in plans]
    for later in ids[1:]:
        assert all(a is b and c is d for (a, c), (b, d) in zip(ids[0], later, strict=True))
    assert ids[0][1][0] is ids[0][1][1]  # equal main and indexer ids: one object
    # the same as a fresh endpoint decoding each message alone
    for i, (plan, reply) in enumerate(plans):
        fresh = ready()
        fresh.add_request("r1", [10, 11], [12, 13], 0.0)
        fresh.add_request("r2", [20], [21], 0.0)
        plan2, reply2 = layer(fresh, i, i + 1)
        assert reply == reply2
        assert [
            list(map(list, (r.main_src, r.main_dst, r.indexer_src, r.indexer_dst)))
            for r in plan.requests
        ] == [
            list(map(list, (r.main_src, r.main_dst, r.indexer_src, r.indexer_dst)))
            for r in plan2.requests
        ]
    # other entries, or a new handshake: decoded again
    entries[1] = rr("r2", [6], [6])
    plan, _ = layer(ep, 0, NUM_LAYERS + 1)
    assert list(plan.requests[1].main_src) == [6] and plan.requests[0].main_src is not ids[0][0][0]
    same, _ = layer(ep, 1, NUM_LAYERS + 2)
    assert same.requests[0].main_src is plan.requests[0].main_src
    send(ep, meta())
    again, _ = layer(ep, 2, 1)
    assert again.requests[0].main_src is not plan.requests[0].main_src


def test_kept_entries_never_vouch_for_the_rest_of_a_frame() -> None:
    """Known entries followed by a bad field: refused exactly as the general path does."""
    ep = ready()
    ep.add_request("r1", [10], [12], 0.0)
    finish(ep, send(ep, rrb(0, [rr("r1", [1])], seq=1)))
    bad = rrb(1, [rr("r1", [1])], seq=2)
    frame = bytearray(encode(bad))
    assert frame[-1] == 2  # seq, the last field: make it a negative int
    frame[-1] = 0xFF
    outs = ep.receive(PEER, bytes(frame), 0.0)
    assert of(outs, StartRead) == [] and ep.stats.malformed_frames == 1
    fresh = ready()
    fresh.add_request("r1", [10], [12], 0.0)
    assert replies(fresh.receive(PEER, bytes(frame), 0.0)) == replies(outs)
    # a frame cut short after the head is malformed too
    assert ep.receive(PEER, bytes(frame[:22]), 0.0) == []
    assert ep.stats.malformed_frames == 2


def test_entries_kept_for_a_bounded_number_of_sessions() -> None:
    from rd2h_protocol.consumer.endpoint import ENTRY_CACHE_SESSIONS as _ENTRY_CACHE_SESSIONS

    ep = endpoint()
    peers = [f"peer-{i}".encode() for i in range(_ENTRY_CACHE_SESSIONS + 1)]
    for i, peer in enumerate(peers):
        send(ep, meta(f"p{i}"), peer=peer)
        ep.add_request(f"r{i}", [0], [0], 0.0)
        finish(ep, send(ep, rrb(0, [rr(f"r{i}", [1])], seq=1), peer=peer))
    assert len(ep.state.entry_cache) == _ENTRY_CACHE_SESSIONS
    assert "p0" not in ep.state.entry_cache and f"p{len(peers) - 1}" in ep.state.entry_cache


def test_kept_entries_are_checked_again_after_a_handshake_shrinks_the_layout() -> None:
    ep = ready()
    ep.add_request("r1", [10], [12], 0.0)
    msg = rrb(0, [rr("r1", [200])], seq=1)
    finish(ep, send(ep, msg))  # id 200 < 256: read, and the entries are kept
    send(ep, meta(layouts={name: src_layout(num_blocks=100) for name in LAYER_NAMES}))
    reply = replies(send(ep, msg))[0]
    assert [(f.ext_req_id, f.code) for f in reply.failed] == [("r1", ErrorCode.OUT_OF_RANGE)]


def test_finish_by_is_receipt_plus_the_lease_kept_on_retry_none_without_lease() -> None:
    ep = ready()
    ep.add_request("r1", [0], [0], 0.0)
    # parked first (r2 unknown): the receipt, not the time it is served, counts
    ep2 = ready()
    ep2.add_request("r1", [0], [0], 0.0)
    send(ep2, rrb(0, [rr("r1", [1]), rr("r2", [2])], seq=1, lease_ms=4000), now=50.0)
    start = only(ep2.add_request("r2", [1], [1], 50.5), StartRead)
    assert (start.start_by, start.finish_by) == (pytest.approx(52.0), pytest.approx(54.0))
    outs = send(ep, rrb(0, [rr("r1", [1])], seq=1, lease_ms=4000), now=100.0)
    start = only(outs, StartRead)
    assert (start.start_by, start.finish_by) == (pytest.approx(102.0), pytest.approx(104.0))
    retry = only(
        ep.read_finished(start.plan.read_id, TransferError("busy", transient=True), 101.0),
        StartRead,
    )
    assert (retry.start_by, retry.finish_by) == (start.start_by, start.finish_by)
    v1 = ready(v2=False)
    v1.add_request("r1", [0], [0], 0.0)
    start = only(send(v1, rrb(0, [rr("r1", [1])])), StartRead)
    assert start.start_by is None and start.finish_by is None


@pytest.mark.parametrize(("ms", "js"), [(-1, 0), (0, -1)])
def test_negative_destination_offsets_of_a_hand_built_message_are_isolated(
    ms: int, js: int
) -> None:
    """receive() takes messages no decoder checked: a negative offset is still refused."""
    ep = ready()
    ep.add_request("r1", [0, 1, 2], [0, 1, 2], 0.0)
    outs = ep.receive(PEER, rrb(0, [rr("r1", [5], [5], ms=ms, js=js)], seq=1), 0.0)
    assert of(outs, StartRead) == []
    (f,) = replies(outs)[0].failed
    assert f.code == ErrorCode.DESTINATION_RANGE


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_frames_in_other_buffers_are_read_alike(kind: Any) -> None:
    ep = ready()
    ep.add_request("r1", [10, 11], [12], 0.0)
    entries = [rr("r1", [1, 2], [3])]
    first = ep.receive(PEER, kind(encode(rrb(0, entries, seq=1))), 0.0)
    again = ep.receive(PEER, kind(encode(rrb(1, entries, seq=2))), 0.0)  # kept entries
    for outs in (first, again):
        (read,) = only(outs, StartRead).plan.requests
        assert (list(read.main_src), list(read.indexer_src)) == ([1, 2], [3])
    assert ep.stats.malformed_frames == 0


# -- v1 layouts without num_blocks take the fast decode path -------------------------------


def _v1_unbounded() -> ConsumerEndpoint:
    ep = endpoint()
    send(ep, meta(v2=False, layouts={n: src_layout(num_blocks=None) for n in LAYER_NAMES}))
    return ep


def _spy_fast(monkeypatch: pytest.MonkeyPatch, *, disable: bool = False) -> list[bool]:
    """Record whether each frame took the fast decode, its ids checked against the
    session's bound while decoded (or force the general path)."""
    fast: list[bool] = []

    def spy(frame: bytes, **session: Any) -> Any:
        result = _general_read(frame) if disable else read_frame(frame, **session)
        fast.append(isinstance(result, Readiness) and result.ids_below is not None)
        return result

    monkeypatch.setattr(ConsumerEndpoint, "read_frame", staticmethod(spy))
    return fast


def _general_read(frame: bytes, **_session: Any) -> Any:
    """The frame reader with nothing known of the session: the general decode path."""
    return read_frame(frame)


def _served(ep: ConsumerEndpoint, msg: ReadReadyBatch) -> tuple[Any, ...]:
    outs = ep.receive(PEER, encode(msg), 0.0)
    plans = [
        (r.ext_req_id, *map(list, (r.main_src, r.main_dst, r.indexer_src, r.indexer_dst)))
        for o in of(outs, StartRead)
        for r in o.plan.requests
    ]
    after = finish(ep, outs) if of(outs, StartRead) else []
    return (
        plans,
        replies(outs) + replies(after),
        [(o.ext_req_id, o.code) for o in [*outs, *after] if isinstance(o, RequestFailed)],
    )


def test_v1_layout_without_num_blocks_serves_good_ids_on_the_fast_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = _spy_fast(monkeypatch)
    ep = _v1_unbounded()
    ep.add_request("r1", [3, 4], [5], 0.0)
    ep.add_request("r2", [6], [7], 0.0)
    top = (1 << 32) - 1  # the largest id the wire carries: no layout bound to refuse it
    msg = rrb(0, [rr("r1", [1, 2], [8]), rr("r2", [top], [9])])
    outs = send(ep, msg)
    assert fast == [False, True]  # the handshake, then the readiness
    plan = only(outs, StartRead).plan
    assert [(r.ext_req_id, list(r.main_src), list(r.main_dst)) for r in plan.requests] == [
        ("r1", [1, 2], [3, 4]),
        ("r2", [top], [6]),
    ]
    # immutable ids: the runtime's planner keeps their runs for the step's later layers
    assert all(type(r.main_src) is tuple for r in plan.requests)
    assert replies(finish(ep, outs)) == [ReadDone(layer_idx=0)]
    # the next layer of the step reuses the decoded entries
    outs = send(ep, rrb(1, [rr("r1", [1, 2], [8]), rr("r2", [top], [9])]))
    assert fast[-1] is True
    assert only(outs, StartRead).plan.requests[0].main_src is plan.requests[0].main_src


@pytest.mark.parametrize(
    "bad", [[-1], [1 << 32], [0, -5]], ids=["negative", "past-wire-limit", "negative-later"]
)
@pytest.mark.parametrize("where", ["main", "indexer"])
def test_v1_layout_without_num_blocks_bad_ids_get_the_general_paths_verdict(
    bad: list[int], where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ids no layout can hold (negative, past the wire's block id type) get exactly the
    verdict, codes and failed requests they got before the fast path served v1 layouts;
    the other requests of the session are served as before."""
    seen = []
    for disable in (True, False):
        fast = _spy_fast(monkeypatch, disable=disable)
        ep = _v1_unbounded()
        ep.add_request("r1", [0, 1], [0, 1], 0.0)
        ep.add_request("r2", [2], [2], 0.0)
        main, idx = (bad, [0]) if where == "main" else ([0], bad)
        msg = rrb(0, [rr("r2", [4], [5]), rr("r1", main, idx)])
        verdict = _served(ep, msg)
        assert verdict[0] == [] and verdict[1], verdict  # nothing read, a failure reply
        # the codec refuses the frame: the layer fails, every request it names with it
        assert isinstance(verdict[1][0], ReadFailed)
        assert sorted(verdict[2]) == [
            ("r1", ErrorCode.OUT_OF_RANGE),
            ("r2", ErrorCode.OUT_OF_RANGE),
        ]
        assert fast[-1] is False
        # a good readiness afterwards is served (a new request: the old ones failed)
        ep.add_request("r3", [7], [8], 0.0)
        good = _served(ep, rrb(1, [rr("r3", [9], [10])]))
        assert good[0] == [("r3", [9], [7], [10], [8])] and good[2] == []
        seen.append((verdict, good))
    assert seen[0] == seen[1]


def test_v1_layout_with_num_blocks_isolates_ids_past_it_with_the_same_code() -> None:
    ep = endpoint()
    send(ep, meta(v2=False, layouts={n: src_layout(num_blocks=100) for n in LAYER_NAMES}))
    ep.add_request("r1", [0], [0], 0.0)
    ep.add_request("r2", [1], [1], 0.0)
    outs = send(ep, rrb(0, [rr("r1", [100]), rr("r2", [99])]))
    (read,) = only(outs, StartRead).plan.requests
    assert read.ext_req_id == "r2"
    assert [(f.ext_req_id, f.code) for f in of(outs, RequestFailed)] == [
        ("r1", ErrorCode.OUT_OF_RANGE)
    ]
    assert replies(finish(ep, outs)) == [ReadDone(layer_idx=0)]  # v1: the plain read_done


def test_input_no_table_allows_closes_that_peers_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # None reaches this today (the session table is total); plant one: the table forgets
    # that a ready v2 session may send readiness.
    decls = tuple(
        d
        for d in DECODE_SESSION.transitions
        if not (d["trigger"] == S_RECV_READINESS and d["source"] == SESSION_V2)
    )
    planted = replace(DECODE_SESSION, transitions=decls)
    monkeypatch.setattr(SessionEffects, "TABLE", planted.bind(SessionEffects.TABLE.handlers))
    ep = endpoint()
    send(ep, meta("p0"), peer=b"bad")
    send(ep, meta("p1"), peer=b"good")
    assert send(ep, rrb(0, [], seq=0), peer=b"bad") == []
    assert ep.stats.protocol_errors == 1
    # Only that peer's session is closed; its next readiness learns it must hand-shake.
    assert ep.sessions() == {"p1": "ready_v2"} and ep.negotiated(b"bad") is None
    reply = replies(send(ep, rrb(0, [], seq=1), peer=b"bad"))[0]
    assert reply.code == ErrorCode.UNKNOWN_SESSION


_ENTRY = st.tuples(
    st.lists(st.integers(0, NUM_BLOCKS), max_size=5),  # NUM_BLOCKS itself is out of range
    st.one_of(st.none(), st.lists(st.integers(0, NUM_BLOCKS), max_size=5)),  # None: = main
    st.integers(0, 6),  # main_start_block: past 3 some destination ranges do not fit
    st.integers(0, 6),  # indexer_start_block
)


@settings(max_examples=80, deadline=None)
@given(st.lists(_ENTRY, min_size=1, max_size=4))
def test_whole_shares_on_the_fast_path_equal_the_general_path(
    entries: list[tuple[list[int], list[int] | None, int, int]],
) -> None:
    """The bounded decode's whole-entry shares (one Decode rank, one contributor, source
    ids proven in range) against the general path, which checks every request's source
    ids and destination range itself: the same plans, replies and failed requests, for
    ids in and past the layout's bound and destination ranges that fit or not; on two
    layers (the second one's shares, of kept entries, looked up on the fast path)."""
    seen = []
    for general in (False, True):
        ep = ready()
        if general:
            ep.read_frame = _general_read  # type: ignore[method-assign]
        msgs = []
        for i, (main, idx, ms, js) in enumerate(entries):
            ep.add_request(f"r{i}", list(range(100, 108)), list(range(200, 208)), 0.0)
            msgs.append(rr(f"r{i}", main, idx, ms, js))
        seen.append([_served(ep, rrb(layer, msgs)) for layer in (0, 1)])
    assert seen[0] == seen[1]


# -- one readiness, many requests: the batched request machine ------------------------------


def test_mixed_states_in_one_readiness_are_served_in_order_as_one_at_a_time() -> None:
    """Requests in several states (runs of one state, an unknown and a stopped one between
    them, a failure inside a run) get what firing them one at a time gives: plan, failed
    list and failures in message order, load deadlines restarted in that order."""
    ep = ready()
    for ext in ("rcv", "rcv2"):
        ep.add_request(ext, [0], [0], 0.0)
    finish(ep, send(ep, rrb(0, [rr("rcv", [1]), rr("rcv2", [2])], seq=0)))  # now receiving
    for ext in ("adv", "bad", "adv2", "ab"):
        ep.add_request(ext, [3], [3], 0.0)
    ep.add_request("new", [4], [4], 0.0, advertised=False)
    ep.abort(["ab"], "client left", 0.0)
    ep.release("gone", 0.0)  # retired: unknown without parking
    ep.add_request("idle", [5], [5], 0.0)  # named by nothing: its deadline stays first
    states = ep.requests()
    assert [states[e] for e in ("adv", "rcv", "new", "ab")] == [
        "advertised", "receiving", "allocated", "aborted",
    ]  # fmt: skip
    msg = rrb(
        1,
        [
            rr("adv", [6]), rr("bad", [7], ms=1), rr("adv2", [8]),  # one run, a failure in it
            rr("rcv", [9]), rr("rcv2", [10]),
            rr("gone", [11]), rr("ab", [12]), rr("new", [13]),
        ],
        seq=1,
    )  # fmt: skip
    outs = send(ep, msg, now=1.0)
    assert request_ids(only(outs, StartRead).plan) == ["adv", "adv2", "rcv", "rcv2", "new"]
    assert [(f.ext_req_id, f.code) for f in of(outs, RequestFailed)] == [
        ("bad", ErrorCode.DESTINATION_RANGE)
    ]
    states = ep.requests()
    assert {e: states[e] for e in ("adv", "adv2", "new", "bad", "ab")} == {
        "adv": "receiving", "adv2": "receiving", "new": "receiving", "bad": "failed",
        "ab": "aborted",
    }  # fmt: skip
    assert list(ep.state.deadlines) == ["idle", "adv", "adv2", "rcv", "rcv2", "new"]
    reply = replies(finish(ep, outs, now=2.0))[0]
    assert [(f.ext_req_id, f.code) for f in reply.failed] == [
        ("bad", ErrorCode.DESTINATION_RANGE),
        ("gone", ErrorCode.UNKNOWN_REQUEST),
        ("ab", ErrorCode.ABORTED),
    ]
    assert ep.state.deadlines == {
        "idle": ep.config.kv_load_timeout_s,
        **dict.fromkeys(["adv", "adv2", "rcv", "rcv2", "new"], 2.0 + ep.config.kv_load_timeout_s),
    }


def test_a_request_failing_among_batched_ones_fails_alone_and_the_others_complete() -> None:
    """A request whose entry is unsound, in a run of requests in one state: it alone is
    isolated and fails (ABORT to its peer), the others are read and complete."""
    ep = ready()
    names = ["a", "b", "c", "d"]
    for ext in names:
        ep.add_request(ext, [0, 1], [0, 1], 0.0)
    outs = send(ep, rrb(0, [rr(e, [1]) for e in names], seq=0))
    finish(ep, outs)
    assert set(ep.requests().values()) == {"receiving"}
    entries = [rr(e, [2]) for e in names]
    entries[2] = rr("c", [2, 3, 4])  # three blocks into two: the destination does not fit
    outs = send(ep, rrb(LAST, entries, done=names, seq=1))
    assert request_ids(only(outs, StartRead).plan) == ["a", "b", "d"]
    assert [(f.ext_req_id, f.code) for f in of(outs, RequestFailed)] == [
        ("c", ErrorCode.DESTINATION_RANGE)
    ]
    assert [(a.msg.ext_ids, a.peer) for a in of(outs, SendAbort)] == [(["c"], PEER)]
    after = finish(ep, outs)
    assert [o.ext_req_id for o in of(after, RequestDone)] == ["a", "b", "d"]
    assert [f.ext_req_id for f in replies(after)[0].failed] == ["c"]
    assert ep.requests() == {"a": "done_on_rank", "b": "done_on_rank", "c": "failed",
                             "d": "done_on_rank"}  # fmt: skip


def test_shares_of_kept_entries_stand_only_for_their_request_and_rule() -> None:
    """Later layers of a step reuse the shares worked out on an earlier one (the same
    objects); a layer shared otherwise (here one without indexer) or a request registered
    anew under the same id gets its share worked out again."""
    layers = [(name, dst_layout(indexer=i != 1)) for i, name in enumerate(LAYER_NAMES)]
    ep = endpoint(layers=layers)
    tensors = {name: src_layout(tensors=2 if i == 1 else 4) for i, name in enumerate(LAYER_NAMES)}
    send(ep, meta(layouts=tensors))
    ep.add_request("r1", [10, 11], [12, 13], 0.0)
    ep.add_request("r2", [20], [21], 0.0)
    entries = [rr("r1", [1, 2], [3, 4]), rr("r2", [5], [5])]
    seqs = itertools.count()

    def shares(layer: int) -> tuple[Any, ...]:
        outs = send(ep, rrb(layer, entries, seq=next(seqs)))
        finish(ep, outs)
        plan: ReadPlan = only(outs, StartRead).plan
        return plan.requests

    first = shares(0)
    assert all(a is b for a, b in zip(first, shares(2), strict=True))
    main_only = shares(1)
    assert [list(r.indexer_src) for r in main_only] == [[], []]
    again = shares(2)
    assert again == first and all(a is not b for a, b in zip(first, again, strict=True))
    ep.release("r2", 0.0)
    ep.add_request("r2", [30], [31], 0.0)
    r1, r2 = shares(0)
    assert r1 is again[0] and list(r2.main_dst) == [30] and list(r2.indexer_dst) == [31]
