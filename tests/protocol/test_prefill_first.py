"""The Prefill-first flow in the endpoints: keep, claim, publish at once, expire, refuse.

A standard router sends Prefill the prompt first; Prefill keeps the request
(``keep_request``) until a Decode claims it (``claim``), which publishes every layer at
once, or until the claim window runs out. The round trip at the end runs a real consumer
endpoint against it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from test_producer import (
    ACK_V1_FRAME,
    CONN,
    ack_v2,
    chunk,
    done,
    endpoint,
    finished,
    readiness,
    target,
    write_layers,
)

import rd2h_protocol as rd
from rd2h_protocol.claim import (
    CLAIM_VERSION,
    KEPT_MARKER_KEY,
    Claim,
    ClaimAnswer,
    KeptSource,
    MalformedClaim,
    decode_claim,
    decode_claim_answer,
    encode_claim,
    is_kept_params,
    is_prefill_first,
    kept_params,
    kept_source_from_params,
)
from rd2h_protocol.errors import ErrorCode, LocalProtocolError
from rd2h_protocol.events import ClaimAnswered
from rd2h_protocol.machines.producer import KEPT_CLAIMED, KEPT_WAITING
from rd2h_protocol.producer import Output


def answers(out: list[Output]) -> list[ClaimAnswered]:
    return [o for o in out if isinstance(o, ClaimAnswered)]


def kept_endpoint(**kw: Any) -> rd.ProducerEndpoint:
    ep = endpoint(3, claim_timeout_s=10.0, **kw)
    # The prompt was computed in an ordinary step with nobody to publish to.
    write_layers(ep, range(3), 0.0)
    ep.end_step(0.0)
    assert ep.keep_request("r1", 0.5) == []
    return ep


def test_a_claim_publishes_every_layer_at_once_and_the_replies_finish_it() -> None:
    ep = kept_endpoint()
    assert ep.kept() == {"r1": KEPT_WAITING}
    assert not ep.is_idle()
    out = ep.claim("r1", target(), chunk("r1", [4, 5], start=1), 1.0)
    assert answers(out) == [ClaimAnswered("r1", True, None, "")]
    out += ep.receive(CONN, ack_v2(), 1.0)
    msgs = readiness(out)
    assert [m.layer_idx for m in msgs] == [0, 1, 2]
    assert all(m.read_reqs[0].main_block_ids == [4, 5] for m in msgs)
    assert all(m.read_reqs[0].main_start_block == 1 for m in msgs)
    assert [m.done_ext_ids for m in msgs] == [[], [], ["r1"]]
    assert ep.kept() == {"r1": KEPT_CLAIMED}
    # Gates are closed while Decode reads: the compute path must wait.
    assert not ep.can_overwrite(0)
    out = []
    for m in msgs:
        out += ep.receive(CONN, done(m), 1.1)
    assert finished(out)["r1"].ok
    assert ep.kept() == {} and ep.is_idle() and ep.can_overwrite(0)


def test_a_claim_can_come_while_a_compute_step_is_half_written() -> None:
    ep = kept_endpoint()
    ep.add_request("r2", target(), 1.0)
    ep.schedule_chunk(chunk("r2", [7]), 1.0)
    out = ep.layer_written(0, 1.0)
    out += ep.claim("r1", target(), chunk("r1", [4]), 1.0)
    out += ep.receive(CONN, ack_v2(), 1.0)
    # The layer the step wrote goes out now (for both); the later ones wait for the step.
    first = readiness(out)
    assert sorted(m.layer_idx for m in first) == [0, 0]
    for m in first:
        out += ep.receive(CONN, done(m), 1.1)
    out += write_layers(ep, [1, 2], 1.2)
    out += ep.end_step(1.2)
    later = readiness(out)[2:]
    assert [(m.layer_idx, [r.ext_req_id for r in m.read_reqs]) for m in later] == [
        (1, ["r2"]),
        (2, ["r2"]),
        (1, ["r1"]),
        (2, ["r1"]),
    ]
    for m in later:
        out += ep.receive(CONN, done(m), 1.3)
    ended = finished(out)
    assert ended["r1"].ok and ended["r2"].ok
    assert ep.is_idle()


def test_a_claim_between_a_layer_wait_and_its_write_leaves_the_storage_to_the_step() -> None:
    """The runtime waits for a layer's storage (can_overwrite) and writes it later: a claim
    published in between closed the gate under the write, and the write was refused
    ("written without waiting for its storage", the step failed; seen in tests/serving)."""
    ep = kept_endpoint()
    ep.add_request("r2", target(), 1.0)
    ep.schedule_chunk(chunk("r2", [7]), 1.0)
    assert ep.can_overwrite(0)  # the compute path's wait for layer 0 is over
    out = ep.claim("r1", target(), chunk("r1", [4]), 1.0)
    out += ep.layer_written(0, 1.0)  # no LocalProtocolError: layer 0 is the step's
    out += ep.receive(CONN, ack_v2(), 1.0)
    assert [m.layer_idx for m in readiness(out)] == [0]  # r2's layer 0; r1 waits
    out += write_layers(ep, [1, 2], 1.2)
    out += ep.end_step(1.2)
    msgs = readiness(out)
    assert [m.done_ext_ids for m in msgs if m.read_reqs[0].ext_req_id == "r1"] == [[], [], ["r1"]]
    for m in msgs:
        out += ep.receive(CONN, done(m), 1.3)
    ended = finished(out)
    assert ended["r1"].ok and ended["r2"].ok
    assert ep.is_idle()


def test_no_claim_within_the_window_frees_the_request_unread() -> None:
    ep = kept_endpoint()
    assert ep.get_timer() == pytest.approx(10.5)
    assert ep.handle_timer(10.4) == []
    out = ep.handle_timer(10.5)
    ended = finished(out)["r1"]
    assert not ended.ok and ended.code == ErrorCode.LEASE_EXPIRED
    assert "no Decode claimed it within 10 s" in ended.message
    assert ep.stats.unclaimed == 1 and ep.is_idle()
    # A claim that comes too late is refused, and names why.
    late = answers(ep.claim("r1", target(), chunk("r1", [4]), 11.0))
    assert late[0].ok is False and "claim window (10 s) ran out" in late[0].message


def test_a_second_claim_is_refused_and_publishes_nothing() -> None:
    ep = kept_endpoint()
    ep.claim("r1", target(), chunk("r1", [4]), 1.0)
    again = ep.claim("r1", target(base_port=21000), chunk("r1", [4]), 1.0)
    assert [type(o) for o in again] == [ClaimAnswered]
    assert again[0] == ClaimAnswered(
        "r1",
        False,
        ErrorCode.UNKNOWN_REQUEST,
        f"request 'r1' was claimed already by Decode {CONN}; its KV is published once",
    )
    assert ep.stats.claimed == 1 and ep.stats.claims_refused == 1


def test_a_claim_from_a_decode_this_prefill_cannot_serve_is_refused_and_the_request_stays() -> None:
    ep = endpoint(3, p_tp=1, claim_timeout_s=10.0)
    ep.keep_request("r1", 0.0)
    bad = answers(ep.claim("r1", target(d_tp=2), chunk("r1", [4]), 1.0))
    assert bad[0].ok is False and "TP" in bad[0].message
    assert ep.kept() == {"r1": KEPT_WAITING}
    assert answers(ep.claim("r1", target(), chunk("r1", [4]), 1.0))[0].ok


def test_a_v1_decode_is_refused_with_a_message_that_names_the_flow() -> None:
    ep = endpoint(3, claim_timeout_s=10.0)
    # A v1 Decode this rank already speaks to (Decode-first).
    ep.add_request("r0", target(), 0.0)
    ep.schedule_chunk(chunk("r0", [1]), 0.0)
    out = write_layers(ep, range(3), 0.0)
    out += ep.end_step(0.0)
    out += ep.receive(CONN, ACK_V1_FRAME, 0.0)
    ep.keep_request("r1", 0.0)
    refused = answers(ep.claim("r1", target(), chunk("r1", [4]), 1.0))
    assert refused[0].ok is False
    assert "protocol v1, which has no Prefill-first flow" in refused[0].message


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"storages": 1}, "share storage buffers.*rd2h proxy"), ({"protocol": "v1"}, "v1 only")],
)
def test_a_prefill_that_cannot_keep_refuses_to_and_names_the_decode_first_proxy(
    kw: dict[str, Any], match: str
) -> None:
    ep = endpoint(3, **kw)
    with pytest.raises(LocalProtocolError, match=match):
        ep.keep_request("r1", 0.0)


def test_keeping_an_id_twice_is_refused() -> None:
    ep = kept_endpoint()
    with pytest.raises(LocalProtocolError, match="already kept"):
        ep.keep_request("r1", 1.0)


def test_unknown_claim_is_answered_not_raised() -> None:
    ep = endpoint(2)
    out = ep.claim("nope", target(), chunk("nope", [1]), 0.0)
    assert answers(out)[0].code == ErrorCode.UNKNOWN_REQUEST
    assert ep.is_idle()


def test_round_trip_with_a_real_consumer_endpoint() -> None:
    layer_names = ["model.layers.0.attn", "model.layers.1.attn"]
    src = [
        rd.LayerLayout(base_addrs=[a, a + 512], block_len=[64, 64], tensor_group_idx=[0, 0])
        for a in (0x1000, 0x2000)
    ]
    dst = rd.DestinationLayout((rd.ComponentDest(0x9000, 64, 8), rd.ComponentDest(0x9200, 64, 8)))
    prefill = rd.ProducerEndpoint(
        rd.ProducerConfig(
            p_rank=0, p_tp=1, session="p0", layers=list(zip(layer_names, src, strict=True))
        )
    )
    decode = rd.ConsumerEndpoint(
        rd.ConsumerConfig(d_rank=0, d_tp=1, layers=[(n, dst) for n in layer_names])
    )
    now = 0.0
    # Prefill computes the prompt with nobody to publish to, then keeps it.
    for layer in range(2):
        prefill.layer_written(layer, now)
    prefill.end_step(now)
    prefill.keep_request("req-1", now)
    to_decode: list[bytes] = []
    to_prefill: list[bytes] = []
    seen: list[object] = []

    def run(outputs: list[Any]) -> None:
        for out in outputs:
            seen.append(out)
            if isinstance(out, rd.Send):
                to_decode.append(rd.encode(out.msg))
            elif isinstance(out, rd.Reply):
                to_prefill.append(rd.encode(out.msg))
            elif isinstance(out, rd.StartRead):
                run(decode.read_finished(out.plan.read_id, None, now))

    # Decode allocates its blocks, then claims the request.
    run(decode.add_request("req-1", [4, 5, 6], [], now))
    run(prefill.claim("req-1", rd.DecodeTarget("decode", 20000, d_tp=1), chunk3(), now))
    while to_decode or to_prefill:
        now += 0.001
        run(decode.receive(b"p0", to_decode.pop(0), now) if to_decode else [])
        run(prefill.receive("decode:20000", to_prefill.pop(0), now) if to_prefill else [])
    run(decode.release("req-1", now))
    assert rd.RequestDone("req-1") in seen
    assert any(isinstance(o, rd.RequestFinished) and o.ok for o in seen)
    assert prefill.is_idle() and decode.is_idle()


def chunk3() -> rd.Chunk:
    return rd.Chunk(ext_req_id="req-1", main_block_ids=[1, 2, 3], final=True)


# -- the parameters and frames of the flow -------------------------------------------------


ROUTER_FIRST_STEP = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def source(**kw: Any) -> KeptSource:
    fields: dict[str, Any] = {
        "remote_engine_id": "prefill-engine",
        "remote_host": "198.18.0.1",
        "remote_port": 20060,
        "remote_tp_size": 2,
        "remote_request_id": "cmpl-abc-0",
        "remote_num_tokens": 57,
        "rd2h_claim_version": CLAIM_VERSION,
    }
    fields.update(kw)
    return KeptSource(**fields)


def test_a_standard_routers_first_step_is_recognised() -> None:
    assert is_prefill_first(ROUTER_FIRST_STEP)
    assert is_prefill_first({"do_remote_decode": True})
    assert not is_prefill_first({**ROUTER_FIRST_STEP, "remote_host": "h"})
    assert not is_prefill_first({"do_remote_prefill": True})


def test_kept_params_round_trip_through_json() -> None:
    params = msgspec.json.decode(msgspec.json.encode(kept_params(source())))
    assert is_kept_params(params) and params[KEPT_MARKER_KEY] == CLAIM_VERSION
    assert kept_source_from_params(params) == source()
    # Unknown keys (a newer Prefill's) are ignored.
    assert kept_source_from_params({**params, "remote_block_ids": []}) == source()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"remote_port": 0}, "remote_port"),
        ({"remote_host": None}, "remote_host"),
        ({"remote_request_id": ""}, "remote_request_id"),
        ({"remote_tp_size": "2"}, "remote_tp_size"),
        ({"do_remote_decode": True}, "do_remote_decode=True"),
        ({"remote_port": 65535}, "65535"),
    ],
)
def test_bad_kept_params_name_the_field(change: dict[str, Any], field: str) -> None:
    params = {**kept_params(source()), **change}
    with pytest.raises(MalformedClaim, match=field):
        kept_source_from_params(params)


def test_claim_frames_round_trip_and_bad_ones_are_named() -> None:
    claim = Claim(
        version=CLAIM_VERSION,
        request_id="cmpl-abc-0",
        engine_id="decode",
        host="198.18.0.2",
        port=20050,
        tp_size=1,
        cached_tokens=16,
        num_tokens=57,
    )
    assert decode_claim(encode_claim(claim)) == claim
    answer = ClaimAnswer(request_id="cmpl-abc-0", ok=False, code=6, message="no")
    assert decode_claim_answer(encode_claim(answer)) == answer
    with pytest.raises(MalformedClaim, match="port"):
        decode_claim(encode_claim(msgspec.structs.replace(claim, port=65535, tp_size=2)))
    with pytest.raises(MalformedClaim, match="exceeds"):
        decode_claim(b" " * 20000)
    with pytest.raises(MalformedClaim, match="malformed"):
        decode_claim(b"[" * 5000)
