"""Randomized properties of the codec.

- Round trip: ``decode(encode(m)) == m`` for every message type, v1 and v2 shapes.
- Old decoder, new message: a v2 frame read by a v1 receiver (``msgpack.unpackb`` plus the
  v1 length guards, written out below as :func:`v1_decode`) still yields the v1 fields.
- New decoder, old message: every v1 shape the guards allow decodes to what a v1 receiver
  reads from it.
- Hostile input: random bytes and mutated valid frames either decode to a message that
  re-encodes and decodes to itself, or raise a RemoteProtocolError subclass; nothing else.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from rd2h_protocol import (
    ACK_V1,
    Abort,
    Ack,
    FailedRequest,
    Message,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadReq,
    RemoteProtocolError,
    decode,
    encode,
)

U32 = (1 << 32) - 1

# ---------------------------------------------------------------- the v1 receiver, as a model


def _v1_req(entry: list[Any]) -> tuple[Any, ...]:
    """A read_reqs entry as v1 reads it (2/3/4/5-field guards)."""
    ext_id, main = entry[0], entry[1]
    indexer = entry[2] if len(entry) > 2 else main
    main_start = entry[3] if len(entry) > 3 else 0
    indexer_start = entry[4] if len(entry) > 4 else 0
    return (ext_id, main, indexer, main_start, indexer_start)


def v1_decode(frame: bytes) -> tuple[Any, ...]:
    """What a v1 receiver extracts from ``frame``: its own fields, defaults filled in."""
    if frame == b"ACK":
        return (b"ACK",)
    msg = msgpack.unpackb(frame)
    tag = msg[0]
    if tag == b"mf_meta":
        return (tag, msg[1], msg[2])
    if tag == b"read_ready_batch":
        done = msg[4] if len(msg) > 4 else []
        member = msg[5] if len(msg) > 5 else 0
        ratio = max(msg[6], 1) if len(msg) > 6 else 1
        return (tag, msg[1], msg[2], [_v1_req(e) for e in msg[3]], done, member, ratio)
    if tag == b"read_done":
        return (tag, msg[1])
    if tag == b"read_failed":
        return (tag, msg[1], msg[2] if len(msg) > 2 else "")
    raise AssertionError(f"a v1 receiver does not know {tag!r}")


def v1_view(msg: Message) -> tuple[Any, ...]:
    """The v1 fields of one of our messages, in v1's tuple form."""
    if isinstance(msg, ReadReadyBatch):
        reqs = [
            (
                r.ext_req_id,
                r.main_block_ids,
                r.indexer_ids,
                r.main_start_block,
                r.indexer_start_block,
            )
            for r in msg.read_reqs
        ]
        return (
            msg.kind,
            msg.layer_idx,
            msg.layer_name,
            reqs,
            msg.done_ext_ids,
            msg.group_member_idx,
            msg.tp_ratio,
        )
    if isinstance(msg, MfMeta):
        return (msg.kind, msg.p_session, msg.encoded_layer_metadata)
    if isinstance(msg, ReadDone):
        return (msg.kind, msg.layer_idx)
    if isinstance(msg, ReadFailed):
        return (msg.kind, msg.layer_idx, msg.error)
    assert isinstance(msg, Ack) and msg.is_v1
    return (b"ACK",)


# ---------------------------------------------------------------- strategies

names = st.text(max_size=24)
counts = st.integers(0, U32)
seqs = st.none() | st.integers(0, (1 << 63) - 1)
opt_counts = st.none() | counts
block_ids = st.lists(st.integers(0, U32), max_size=12)
ext_ids = st.lists(names, max_size=5)
capabilities = st.none() | st.lists(names, max_size=6)

read_reqs = st.builds(ReadReq, names, block_ids, block_ids, counts, counts)
failed_requests = st.builds(FailedRequest, names, counts, names)


@st.composite
def read_ready_batches(draw: st.DrawFn, v2: bool = True) -> ReadReadyBatch:
    ratio = draw(st.integers(1, 64))
    return ReadReadyBatch(
        layer_idx=draw(counts),
        layer_name=draw(names),
        read_reqs=draw(st.lists(read_reqs, max_size=5)),
        done_ext_ids=draw(ext_ids),
        group_member_idx=draw(st.integers(0, ratio - 1)),
        tp_ratio=ratio,
        seq=draw(seqs) if v2 else None,
        lease_ms=draw(opt_counts) if v2 else None,
    )


def mf_metas(v2: bool = True) -> st.SearchStrategy[MfMeta]:
    return st.builds(
        MfMeta,
        p_session=names,
        encoded_layer_metadata=st.binary(max_size=64),
        protocol_version=opt_counts if v2 else st.none(),
        capabilities=capabilities if v2 else st.none(),
        compat=st.none() | names if v2 else st.none(),
    )


def read_dones(v2: bool = True) -> st.SearchStrategy[ReadDone]:
    return st.builds(
        ReadDone,
        layer_idx=counts,
        seq=seqs if v2 else st.none(),
        failed=st.none() | st.lists(failed_requests, max_size=4) if v2 else st.none(),
    )


def read_faileds(v2: bool = True) -> st.SearchStrategy[ReadFailed]:
    return st.builds(
        ReadFailed,
        layer_idx=counts,
        error=names,
        seq=seqs if v2 else st.none(),
        code=opt_counts if v2 else st.none(),
    )


v2_acks = st.builds(
    Ack,
    protocol_version=opt_counts,
    capabilities=capabilities,
    error_code=opt_counts,
    error=st.none() | names,
)
aborts = st.builds(Abort, ext_ids=ext_ids, reason=names)

# Messages a v1 peer also sends or receives (with v2 fields, or without).
v1_known_messages: st.SearchStrategy[Message] = st.one_of(
    read_ready_batches(), mf_metas(), read_dones(), read_faileds()
)
messages: st.SearchStrategy[Message] = st.one_of(
    v1_known_messages, v2_acks, aborts, st.just(ACK_V1)
)
v1_only_messages: st.SearchStrategy[Message] = st.one_of(
    read_ready_batches(v2=False), mf_metas(v2=False), read_dones(v2=False), read_faileds(v2=False)
)


def _pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


@st.composite
def v1_readiness_frames(draw: st.DrawFn) -> bytes:
    """READ_READY_BATCH in every shape the v1 guards allow: 4 to 7 fields, entries of
    2 to 5 fields, ratio 0 (read as 1)."""

    def entry() -> tuple[Any, ...]:
        full = (draw(names), draw(block_ids), draw(block_ids), draw(counts), draw(counts))
        return full[: draw(st.integers(2, 5))]

    ratio = draw(st.just(0) | st.integers(1, 16))
    full = (
        b"read_ready_batch",
        draw(counts),
        draw(names),
        [entry() for _ in range(draw(st.integers(0, 4)))],
        draw(ext_ids),
        draw(st.integers(0, max(ratio, 1) - 1)),
        ratio,
    )
    # A 6-field sender predates the ratio field: it is an equal-TP build, member 0.
    size = draw(st.integers(4, 7))
    return _pack(full[:size] if size != 6 else (*full[:5], 0))


@st.composite
def v1_other_frames(draw: st.DrawFn) -> bytes:
    """Every other frame a v1 peer sends: MF_META, raw ACK, READ_DONE, READ_FAILED with
    and without its error."""
    kind = draw(st.sampled_from(["mf_meta", "ack", "read_done", "read_failed"]))
    if kind == "ack":
        return b"ACK"
    if kind == "mf_meta":
        return _pack((b"mf_meta", draw(names), draw(st.binary(max_size=64))))
    if kind == "read_done":
        return _pack((b"read_done", draw(counts)))
    return _pack((b"read_failed", draw(counts), draw(names))[: draw(st.integers(2, 3))])


# ---------------------------------------------------------------- properties


@given(messages)
def test_every_message_round_trips(msg: Message) -> None:
    assert decode(encode(msg)) == msg


@given(v1_only_messages)
def test_message_without_v2_fields_encodes_as_msgpack_python_packs_v1(msg: Message) -> None:
    data: bytes = msgpack.packb(v1_view(msg), use_bin_type=True)
    assert encode(msg) == data


@given(v1_known_messages)
def test_v1_decoder_reads_v1_fields_of_a_v2_message(msg: Message) -> None:
    assert v1_decode(encode(msg)) == v1_view(msg)


@given(v1_readiness_frames())
def test_new_decoder_reads_every_v1_readiness_shape_as_v1_does(frame: bytes) -> None:
    assert v1_view(decode(frame)) == v1_decode(frame)


@given(v1_other_frames())
def test_new_decoder_reads_every_other_v1_message_as_v1_does(frame: bytes) -> None:
    assert v1_view(decode(frame)) == v1_decode(frame)


def _decodes_or_refuses(frame: bytes) -> None:
    """``frame`` decodes to a stable message or is refused with a RemoteProtocolError."""
    try:
        msg = decode(frame)
    except RemoteProtocolError:
        return
    # Whatever was accepted is a normal message: it re-encodes, and decodes to itself.
    assert decode(encode(msg)) == msg


@given(st.binary(max_size=256))
def test_random_bytes_decode_or_raise_remote_protocol_error(frame: bytes) -> None:
    _decodes_or_refuses(frame)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid frame with bit flips, a truncation or inserted bytes."""
    frame = bytearray(encode(draw(messages)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "replace"]))
        pos = draw(st.integers(0, len(frame)))
        if op == "flip" and pos < len(frame):
            frame[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del frame[pos:]
        elif op == "insert":
            frame[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif pos < len(frame):
            frame[pos] = draw(st.integers(0, 255))
    return bytes(frame)


@given(mutated_frames())
def test_mutated_frames_decode_or_raise_remote_protocol_error(frame: bytes) -> None:
    _decodes_or_refuses(frame)


# -- exported JSON parsers at any nesting depth (issue 24) ----------------------------------

_JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(alphabet='[]{}"\\ab', max_size=6)
)


@st.composite
def _nested_bodies(draw: st.DrawFn) -> bytes:
    """A JSON value wrapped in up to 3,000 arrays and objects (mixed), sometimes cut short
    or with a bracket missing: what a hostile peer would post."""
    import json

    depth = draw(st.integers(0, 3000))
    kinds = draw(st.lists(st.sampled_from("[{"), min_size=1, max_size=8))
    inner = json.dumps(draw(st.recursive(_JSON_LEAVES, st.lists, max_leaves=4)))
    opens = "".join('{"k":' if kinds[i % len(kinds)] == "{" else "[" for i in range(depth))
    closes = "".join("}" if kinds[i % len(kinds)] == "{" else "]" for i in reversed(range(depth)))
    body = opens + inner + closes
    cut = draw(st.one_of(st.none(), st.integers(0, len(body))))
    return (body if cut is None else body[:cut]).encode()


@given(_nested_bodies())
def test_nested_json_bodies_get_the_promised_errors_only(body: bytes) -> None:
    from rd2h_protocol.claim import MalformedClaim, decode_claim, decode_claim_answer
    from rd2h_protocol.rendezvous import MalformedRendezvous, parse_rendezvous_json

    with contextlib.suppress(MalformedRendezvous):
        parse_rendezvous_json(body)
    for parse in (decode_claim, decode_claim_answer):
        with contextlib.suppress(MalformedClaim):
            parse(body)
