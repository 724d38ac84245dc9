"""Codec unit tests: what ``encode`` writes and what ``decode`` refuses, and as what.

The golden v1 frames live in test_golden_v1.py and the randomized properties in
test_codec_properties.py; this file pins the individual rules.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import msgspec
import pytest

from rd2h_protocol import (
    ACK_V1,
    Abort,
    Ack,
    ErrorCode,
    FailedRequest,
    FrameTooLarge,
    LocalProtocolError,
    MalformedFrame,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadReq,
    RemoteProtocolError,
    UnknownMessageKind,
    ValueOutOfRange,
    decode,
    encode,
)
from rd2h_protocol.wire.codec import StepEncoder
from rd2h_protocol.wire.messages import (
    MAX_BLOCKS_PER_REQUEST,
    MAX_FRAME_BYTES,
    MAX_NAME_LEN,
    MAX_REQUESTS_PER_BATCH,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    TAG_READ_DONE,
    TAG_READ_READY_BATCH,
    V1_FIELD_COUNT,
)


def packb(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def batch(**kw: object) -> ReadReadyBatch:
    fields: dict[str, object] = {
        "layer_idx": 3,
        "layer_name": "model.layers.3.self_attn",
        "read_reqs": [ReadReq("r", [1, 2], [3], 0, 0)],
    }
    fields.update(kw)
    return ReadReadyBatch(**fields)  # type: ignore[arg-type]


V1_BATCH: tuple[object, ...] = (
    b"read_ready_batch",
    3,
    "model.layers.3.self_attn",
    [("r", [1, 2], [3], 0, 0)],
    [],
    0,
    1,
)

# ---------------------------------------------------------------- encode: v2 fields


def test_message_without_v2_fields_encodes_to_v1_tuple() -> None:
    assert encode(batch()) == packb(V1_BATCH)


def test_seq_and_lease_are_appended_after_the_v1_fields() -> None:
    assert encode(batch(seq=9, lease_ms=500)) == packb((*V1_BATCH, 9, 500))


def test_only_trailing_absent_fields_are_dropped() -> None:
    # lease without seq: seq travels as nil so lease keeps its position.
    assert encode(batch(lease_ms=500)) == packb((*V1_BATCH, None, 500))
    assert decode(encode(batch(lease_ms=500))) == batch(lease_ms=500)


def test_read_done_v2_carries_seq_and_isolated_failures() -> None:
    msg = ReadDone(layer_idx=4, seq=7, failed=[FailedRequest("r1", ErrorCode.UNKNOWN_REQUEST, "?")])
    assert encode(msg) == packb((b"read_done", 4, 7, [("r1", 6, "?")]))
    assert decode(encode(msg)) == msg


def test_read_failed_v2_appends_seq_and_code() -> None:
    msg = ReadFailed(layer_idx=4, error="no session", seq=3, code=ErrorCode.UNKNOWN_SESSION)
    assert encode(msg) == packb((b"read_failed", 4, "no session", 3, 5))


def test_mf_meta_v2_appends_version_capabilities_compat() -> None:
    msg = MfMeta(
        p_session="h:1",
        encoded_layer_metadata=b"\x80",
        protocol_version=PROTOCOL_VERSION,
        capabilities=["seq", "lease"],
        compat="model=x;dtype=bf16",
    )
    assert encode(msg) == packb(
        (b"mf_meta", "h:1", b"\x80", 2, ["seq", "lease"], "model=x;dtype=bf16")
    )


def test_v2_ack_is_a_msgpack_array_with_bin_tag() -> None:
    msg = Ack(protocol_version=2, capabilities=["abort"])
    assert encode(msg) == packb((b"ack", 2, ["abort"]))
    refused = Ack(protocol_version=2, capabilities=[], error_code=13, error="compat differs")
    assert decode(encode(refused)) == refused


def test_v1_ack_encodes_to_the_raw_frame() -> None:
    assert encode(ACK_V1) == b"ACK"


def test_abort_round_trips() -> None:
    msg = Abort(ext_ids=["a", "b"], reason="lease expired")
    assert encode(msg) == packb((b"abort", ["a", "b"], "lease expired"))
    assert decode(encode(msg)) == msg


def test_nested_read_req_always_has_five_fields() -> None:
    # v1 always writes 5-field entries; a 2-field construction fills the indexer ids.
    msg = batch(read_reqs=[ReadReq("r", [4, 5])])
    assert encode(msg) == packb((*V1_BATCH[:3], [("r", [4, 5], [4, 5], 0, 0)], *V1_BATCH[4:]))


# ---------------------------------------------------------------- encode: local errors


def test_encode_refuses_a_tag_that_is_not_the_class_tag() -> None:
    with pytest.raises(LocalProtocolError, match="must carry tag"):
        encode(ReadDone(kind=TAG_READ_READY_BATCH, layer_idx=1))


def test_encode_refuses_a_v1_ack_with_fields() -> None:
    with pytest.raises(LocalProtocolError, match="raw frame"):
        encode(Ack(kind=b"ACK", protocol_version=2))


def test_encode_refuses_a_frame_over_the_limit() -> None:
    msg = MfMeta(p_session="s", encoded_layer_metadata=bytes(MAX_FRAME_BYTES))
    with pytest.raises(LocalProtocolError, match="split it"):
        encode(msg)


def test_constructing_a_batch_with_member_not_below_ratio_fails() -> None:
    with pytest.raises(ValueError, match="must be below tp_ratio"):
        batch(group_member_idx=2, tp_ratio=2)


# ---------------------------------------------------------------- decode: accepted shapes


def test_unknown_trailing_message_fields_are_ignored() -> None:
    assert decode(packb((b"read_done", 4, 1, [], "future", {"x": 1}))) == ReadDone(
        layer_idx=4, seq=1, failed=[]
    )


def test_unknown_trailing_read_req_fields_are_ignored() -> None:
    frame = packb((*V1_BATCH[:3], [("r", [1, 2], [3], 0, 0, "future")], *V1_BATCH[4:]))
    assert decode(frame) == batch()


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_decode_accepts_any_bytes_like(wrap: type) -> None:
    assert decode(wrap(packb(V1_BATCH))) == batch()
    assert decode(wrap(b"ACK")) == ACK_V1


def test_array16_and_array32_headers_are_accepted() -> None:
    body = b"\xc4\x09read_done\x04"
    assert decode(b"\xdc\x00\x02" + body) == ReadDone(layer_idx=4)
    assert decode(b"\xdd\x00\x00\x00\x02" + body) == ReadDone(layer_idx=4)


def test_decoded_raw_ack_is_a_fresh_value() -> None:
    first = decode(b"ACK")
    assert isinstance(first, Ack)
    first.protocol_version = 99
    assert decode(b"ACK") == ACK_V1 and ACK_V1.protocol_version is None


def test_read_req_indexer_list_defaults_to_main_list() -> None:
    req = ReadReq("r", [1, 2])
    assert req.indexer_ids == [1, 2]
    assert ReadReq("r", [1], [9]).indexer_ids == [9]


def test_bounds_at_their_limits_are_accepted() -> None:
    frame = packb(
        (
            b"read_ready_batch",
            (1 << 32) - 1,
            "n" * MAX_NAME_LEN,
            [("r", [(1 << 32) - 1], [0], (1 << 32) - 1, 0)],
            [],
            0,
            (1 << 32) - 1,
            (1 << 63) - 1,
            (1 << 32) - 1,
        )
    )
    msg = decode(frame)
    assert isinstance(msg, ReadReadyBatch)
    assert msg.seq == (1 << 63) - 1 and encode(msg) == frame


# ---------------------------------------------------------------- decode: refused input


def refused(
    frame: object, error: type[RemoteProtocolError], match: str | None = None
) -> RemoteProtocolError:
    with pytest.raises(error, match=match) as info:
        decode(frame)  # type: ignore[arg-type]
    return info.value


def test_empty_frame_is_malformed() -> None:
    refused(b"", MalformedFrame, "empty frame")


def test_frame_over_the_limit_is_refused_before_parsing() -> None:
    exc = refused(b"\x91" + bytes(MAX_FRAME_BYTES), FrameTooLarge, "exceeds")
    assert exc.code == ErrorCode.TOO_LARGE


@pytest.mark.parametrize(
    "frame",
    [
        packb({b"read_done": 4}),  # a map, not an array
        b"\x90",  # an empty array
        b"\xdc\x00",  # array16 header cut short
        b"\xdd\x00\x00",  # array32 header cut short
        b"\xc0",  # nil
        b"\x01",  # an int
    ],
)
def test_frame_that_is_not_a_non_empty_array_is_malformed(frame: bytes) -> None:
    refused(frame, MalformedFrame, "expected a non-empty array")


def test_str_tag_is_malformed() -> None:
    refused(packb(("read_done", 4)), MalformedFrame, "must be msgpack bin")


def test_array_with_only_a_header_is_malformed() -> None:
    refused(b"\x91", MalformedFrame, "must be msgpack bin")


def test_frame_ending_inside_the_tag_is_malformed() -> None:
    refused(b"\x92\xc4\x09read", MalformedFrame, "ends inside the message tag")


def test_unknown_tag_is_refused_with_its_own_code() -> None:
    exc = refused(packb((b"read_everything", 1)), UnknownMessageKind, "read_everything")
    assert exc.code == ErrorCode.UNKNOWN_KIND
    refused(packb((b"ACK",)), UnknownMessageKind)  # the raw ACK is not a msgpack tag


@pytest.mark.parametrize(
    "frame",
    [
        packb((b"read_done", -1)),
        packb((b"read_done", 1 << 32)),
        packb((b"read_done", 1, 1 << 63)),  # seq
        packb((*V1_BATCH[:3], [("r", [-1], [3], 0, 0)], *V1_BATCH[4:])),
        packb((*V1_BATCH[:3], [("r", [1 << 32], [3], 0, 0)], *V1_BATCH[4:])),
        packb((*V1_BATCH[:3], [("r", [1], [3], -1, 0)], *V1_BATCH[4:])),
        packb((*V1_BATCH[:6], -1)),
    ],
)
def test_integer_outside_its_range_is_out_of_range(frame: bytes) -> None:
    exc = refused(frame, ValueOutOfRange, "Expected `int`")
    assert exc.code == ErrorCode.OUT_OF_RANGE


@pytest.mark.parametrize(("member", "ratio"), [(1, 1), (2, 2), (5, 0), (1, None)])
def test_member_not_below_ratio_is_out_of_range(member: int, ratio: int | None) -> None:
    tail = (member,) if ratio is None else (member, ratio)
    refused(packb((*V1_BATCH[:5], *tail)), ValueOutOfRange, "must be below tp_ratio")


@pytest.mark.parametrize(
    ("frame", "where"),
    [
        (
            b"\x94\xc4\x10read_ready_batch\x01\xa1l\xdd\xff\xff\xff\xff",
            f"<= {MAX_REQUESTS_PER_BATCH}",
        ),
        (
            b"\x94\xc4\x10read_ready_batch\x01\xa1l\x91\x92\xa1r\xdd\xff\xff\xff\xff",
            f"<= {MAX_BLOCKS_PER_REQUEST}",
        ),
        (packb((b"read_ready_batch", 1, "n" * (MAX_NAME_LEN + 1), [])), f"<= {MAX_NAME_LEN}"),
        (
            packb((b"abort", ["x"] * (MAX_REQUESTS_PER_BATCH + 1), "")),
            f"<= {MAX_REQUESTS_PER_BATCH}",
        ),
    ],
)
def test_list_or_string_over_its_bound_is_too_large(frame: bytes, where: str) -> None:
    # The length is checked from the header, before any element is built.
    refused(frame, FrameTooLarge, where)


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (packb((b"read_done", "4")), "Expected `int`, got `str`"),
        (packb((b"read_done", 4.0)), "Expected `int`, got `float`"),
        (packb((b"read_done", True)), "Expected `int`, got `bool`"),
        (packb((b"read_failed", 4, b"bin")), "Expected `str`, got `bytes`"),
        (packb((b"mf_meta", "s", "str blob")), "Expected `bytes`, got `str`"),
        (packb((b"read_done", msgpack.ExtType(1, b"x"))), "got `ext`"),
        (packb((*V1_BATCH[:3], {"r": [1]}, *V1_BATCH[4:])), "got `object`"),
        (packb((*V1_BATCH[:3], [("r",)], *V1_BATCH[4:])), "at least length 2"),
        (packb((b"read_ready_batch", 1, "l")), "at least length 4"),
        (packb((b"read_done",)), "at least length 2"),
    ],
)
def test_wrong_type_or_shape_is_malformed(frame: bytes, match: str) -> None:
    exc = refused(frame, MalformedFrame, match)
    assert exc.code == ErrorCode.MALFORMED


def test_invalid_utf8_string_is_malformed() -> None:
    refused(b"\x93\xc4\x0bread_failed\x01\xa2\xff\xfe", MalformedFrame, "UTF-8")


def test_trailing_bytes_after_a_valid_message_are_malformed() -> None:
    # v1's msgpack.unpackb refuses them too (ExtraData): one frame holds one message.
    refused(packb((b"read_done", 4)) + b"\x00", MalformedFrame, "trailing characters")


def test_deep_nesting_in_an_ignored_trailing_field_is_malformed() -> None:
    frame = b"\x95\xc4\x09read_done\x01\xc0\xc0" + b"\x91" * 100_000 + b"\xc0"
    refused(frame, MalformedFrame, "recursion")


def test_truncated_frame_is_malformed() -> None:
    refused(packb(V1_BATCH)[:-1], MalformedFrame, "truncated")


def test_input_that_is_not_bytes_is_malformed() -> None:
    refused(None, MalformedFrame)
    refused("read_done", MalformedFrame)


def test_tags_are_the_v1_bytes() -> None:
    assert TAG_READ_DONE == b"read_done" and TAG_READ_READY_BATCH == b"read_ready_batch"


def test_changelog_names_the_version_of_every_v2_field() -> None:
    # CHANGELOG.md must stay accurate to messages.py: each field after a message's v1
    # fields has a row "| `tag` | `field` (position) |", each v2-only message a "(new)" row.
    changelog = (Path(__file__).parents[2] / "CHANGELOG.md").read_text()
    for tag, cls in MESSAGE_TYPES.items():
        name = tag.decode()
        v1_fields = V1_FIELD_COUNT[cls]
        if v1_fields == 0:
            assert f"| `{name}` (new) |" in changelog
            continue
        for pos, field in enumerate(msgspec.structs.fields(cls)):
            row = f"| `{name}` | `{field.name}` ({pos}) |"
            assert (row in changelog) == (pos >= v1_fields), row


def test_step_encoder_frames_are_those_of_encode() -> None:
    # Every layer of a step carries the same chunk objects: their bytes are reused, and
    # the frames stay exactly what encode() writes (v2 and trimmed v1 shapes alike).
    chunks = [ReadReq(f"r{i}", list(range(i, i + 256)), [i], i, 0) for i in range(64)]
    other = [ReadReq(f"s{i}", [i, i + 1], None) for i in range(16)]
    step = StepEncoder()
    messages = [
        ReadReadyBatch(
            layer_idx=layer,
            layer_name=f"model.layers.{layer}",
            read_reqs=entries,
            done_ext_ids=done,
            seq=seq,
            lease_ms=lease,
        )
        for layer, entries, done, seq, lease in [
            (0, chunks, [], 7, 30_000),
            (1, list(chunks), [], 8, 29_000),  # a new list of the same objects
            (2, chunks, ["r1"], None, None),  # v1 shape: trailing fields trimmed
            (3, other, [], 9, 100),  # other entries
            (4, chunks[:8], [], 10, 100),  # fewer of the same
            (5, chunks[:3], [], 11, 100),  # below the reuse threshold
            (6, [], ["r0"], 12, 100),
        ]
    ]
    for msg in [*messages, Abort(ext_ids=["r0"], reason="x"), ReadDone(layer_idx=1, seq=3)]:
        assert step.encode(msg) == encode(msg)
