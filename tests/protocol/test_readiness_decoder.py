"""``wire.readiness.read_frame``, the one call that reads a frame from Prefill on Decode.

Whatever the frame (valid, cut short, bytes flipped, ids past the session's bound, a
field out of range, too many block ids) and whatever the session passes (no session, a
bound, kept entries), the reader never raises and agrees with ``codec.decode``: the same
message, or the same verdict (type, code and text); what a refused readiness names is
what the general path (no session) names; ids it vouches for are below the bound.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h_protocol.errors import RemoteProtocolError
from rd2h_protocol.wire.codec import TooManyBlockIds, decode, encode
from rd2h_protocol.wire.messages import (
    MAX_BLOCK_IDS_PER_READINESS,
    Abort,
    ReadReadyBatch,
    ReadReq,
)
from rd2h_protocol.wire.readiness import (
    WIRE_ID_LIMIT,
    Readiness,
    Unreadable,
    message_ids,
    pack_entries,
    read_frame,
    unpack_entries,
)

BOUND = 64  # the session's num_blocks in these tests

_IDS = st.lists(st.integers(0, BOUND + 2), max_size=4)  # past BOUND - 1: out of bound
_ENTRY = st.builds(
    ReadReq,
    ext_req_id=st.sampled_from(["r0", "r1", "r2", "x" * 40]),
    main_block_ids=_IDS,
    indexer_block_ids=st.one_of(st.none(), _IDS),
    main_start_block=st.integers(0, 3),
    indexer_start_block=st.integers(0, 3),
)
_MSG = st.builds(
    ReadReadyBatch,
    layer_idx=st.one_of(st.integers(0, 3), st.just(300), st.just(70_000)),
    layer_name=st.sampled_from(["l0", "model.layers.1.attn", "n" * 40, "m" * 300]),
    read_reqs=st.lists(_ENTRY, max_size=4),
    done_ext_ids=st.lists(st.sampled_from(["r0", "r3"]), max_size=2),
    seq=st.one_of(st.none(), st.integers(0, 1 << 40)),
    lease_ms=st.one_of(st.none(), st.integers(0, 5000)),
)


def _mutated(frame: bytes, how: str, at: int, byte: int) -> bytes:
    if how == "cut":
        return frame[: at % (len(frame) + 1)]
    if how == "flip":
        i = at % len(frame)
        return frame[:i] + bytes([byte]) + frame[i + 1 :]
    if how == "insert":
        i = at % (len(frame) + 1)
        return frame[:i] + bytes([byte]) + frame[i:]
    if how == "trail":
        return frame + bytes([byte])
    return frame


def _builtins(msg: Any) -> Any:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg))  # tuples and lists alike


def _ident(read: Unreadable) -> tuple[Any, ...]:
    return (read.layer_idx, read.seq, read.ids)


def _agrees(frame: bytes, **session: Any) -> Readiness | Unreadable | object:
    """Read ``frame`` with what ``session`` passes and check it against the codec."""
    read = read_frame(frame, **session)
    general = read_frame(frame)
    try:
        expected = decode(frame)
    except RemoteProtocolError as exc:
        assert isinstance(read, Unreadable) and isinstance(general, Unreadable)
        for got in (read, general):
            assert type(got.error) is type(exc)
            assert (got.code, got.message) == (exc.code, exc.message)
        assert read.too_many_block_ids == isinstance(exc, TooManyBlockIds)
        if not read.too_many_block_ids:  # (the fast path names those from decoded fields)
            assert _ident(read) == _ident(general)
        if read.layer_idx is None:
            assert read.seq is None and read.ids == []
        return read
    if not isinstance(expected, ReadReadyBatch):
        assert _builtins(read) == _builtins(expected) and type(read) is type(expected)
        return read
    assert isinstance(read, Readiness) and isinstance(general, Readiness)
    assert _builtins(read.msg) == _builtins(expected) == _builtins(general.msg)
    assert general.ids_below is None and general.keep is None
    if read.ids_below is not None:
        assert read.ids_below == session["id_bound"]
        for rr in read.msg.read_reqs:
            assert all(i < read.ids_below for i in (*rr.main_block_ids, *rr.indexer_ids))
    return read


@settings(max_examples=400, deadline=None)
@given(
    msg=_MSG,
    how=st.sampled_from(["none", "cut", "flip", "insert", "trail"]),
    at=st.integers(0, 1 << 16),
    byte=st.one_of(st.integers(0, 255), st.sampled_from([0xC0, 0xFF, 0xC4, 0xDC, 0x9F])),
    bound=st.sampled_from([None, BOUND, WIRE_ID_LIMIT]),
)
def test_read_frame_agrees_with_the_codec_and_never_raises(
    msg: ReadReadyBatch, how: str, at: int, byte: int, bound: int | None
) -> None:
    frame = _mutated(encode(msg), how, at, byte)
    _agrees(frame, id_bound=bound)


@settings(max_examples=300, deadline=None)
@given(
    first=_MSG,
    layer=st.integers(0, 3),
    seq=st.one_of(st.none(), st.integers(0, 99)),
    done=st.lists(st.sampled_from(["r0", "r3"]), max_size=2),
    how=st.sampled_from(["none", "none", "cut", "flip", "trail"]),
    at=st.integers(0, 1 << 16),
    byte=st.integers(0, 255),
)
def test_kept_entries_are_reused_only_where_they_stand(
    first: ReadReadyBatch,
    layer: int,
    seq: int | None,
    done: list[str],
    how: str,
    at: int,
    byte: int,
) -> None:
    """The next layer of a step (same entries, other layer, seq and done ids), cut or
    flipped anywhere: read with the kept entries, it still agrees with the codec."""
    read = _agrees(encode(first), id_bound=BOUND)
    if not isinstance(read, Readiness) or read.keep is None:
        return
    kept = (read.keep, read.msg.read_reqs)
    nxt = msgspec.structs.replace(first, layer_idx=layer, seq=seq, done_ext_ids=done)
    again = _agrees(_mutated(encode(nxt), how, at, byte), id_bound=BOUND, kept=kept)
    if how == "none":
        assert isinstance(again, Readiness) and again.reused and again.keep is None
        assert again.msg.read_reqs is read.msg.read_reqs


def _too_many(seq: int | None = 7) -> bytes:
    half = MAX_BLOCK_IDS_PER_READINESS // 2 + 1
    entries = [ReadReq("r1", [1] * half, [2] * half), ReadReq("r2", [3])]
    return encode(ReadReadyBatch(layer_idx=2, layer_name="l", read_reqs=entries, seq=seq))


@pytest.mark.parametrize("bound", [None, BOUND, WIRE_ID_LIMIT])
@pytest.mark.parametrize("seq", [None, 7])
def test_too_many_block_ids_are_refused_from_the_headers(
    bound: int | None, seq: int | None
) -> None:
    frame = _too_many(seq)
    read = _agrees(frame, id_bound=bound)
    assert isinstance(read, Unreadable) and read.too_many_block_ids
    assert _ident(read) == (2, seq, ["r1", "r2"])
    cut = _agrees(frame[:-3], id_bound=bound)  # the last entry cut: the headers still count
    assert isinstance(cut, Unreadable)


def test_an_explicit_nil_seq_cannot_be_answered_on_either_path() -> None:
    """A readiness whose entries do not decode and whose seq is written as nil: no reply
    can echo it, so it is dropped, whichever path read it."""
    msg = ReadReadyBatch(layer_idx=1, layer_name="l", read_reqs=[ReadReq("r1", [1])], seq=5)
    fields = list(msgspec.structs.astuple(msg))
    fields[3] = [["r1", [-1]]]  # a negative id
    fields[7] = None  # seq, as nil
    frame = msgspec.msgpack.encode(fields)
    for bound in (None, BOUND):
        read = _agrees(frame, id_bound=bound)
        assert isinstance(read, Unreadable) and read.layer_idx is None


def test_other_messages_come_back_as_the_codec_gives_them() -> None:
    frame = encode(Abort(ext_ids=["r1"], reason="gone"))
    assert read_frame(frame, id_bound=BOUND) == decode(frame)


def test_out_of_bound_ids_are_read_as_the_codec_reads_them_and_not_vouched_for() -> None:
    msg = ReadReadyBatch(
        layer_idx=0, layer_name="l", read_reqs=[ReadReq("r1", [BOUND]), ReadReq("r2", [1])]
    )
    read = _agrees(encode(msg), id_bound=BOUND)
    assert isinstance(read, Readiness) and read.ids_below is None and read.keep is None
    assert read.msg == decode(encode(msg))


def test_packed_entries_come_back_as_decoded() -> None:
    read = read_frame(
        encode(ReadReadyBatch(layer_idx=0, layer_name="l", read_reqs=[ReadReq("r1", [1, 2])])),
        id_bound=BOUND,
    )
    assert isinstance(read, Readiness)
    entries = unpack_entries(pack_entries(read.msg.read_reqs))
    assert _builtins(entries) == _builtins(read.msg.read_reqs)
    assert entries[0].indexer_block_ids is entries[0].main_block_ids
    assert message_ids(read.msg) == ["r1"]


_BAD = st.sampled_from(
    [-1, "s", b"b", None, 1.5, [], {}, 1 << 33, "x" * 5000, [-1], ["s"], [1 << 33], True]
)


@settings(max_examples=300, deadline=None)
@given(
    msg=_MSG.filter(lambda m: bool(m.read_reqs)),
    which=st.integers(0, 3),
    field=st.integers(0, 5),
    bad=_BAD,
    bound=st.sampled_from([None, BOUND, WIRE_ID_LIMIT]),
)
def test_a_bad_value_inside_the_entries_gets_the_codecs_verdict(
    msg: ReadReadyBatch, which: int, field: int, bad: Any, bound: int | None
) -> None:
    """Fields that decode and entries that do not: the verdict is worded for the whole
    frame, and the readiness is named as the general path names it."""
    fields: list[Any] = list(msgspec.structs.astuple(msg))
    entries = [list(msgspec.structs.astuple(rr)) for rr in msg.read_reqs]
    entry = entries[which % len(entries)]
    if field < len(entry):
        entry[field] = bad
    else:
        del entry[1:]  # an entry of one field
    fields[3] = entries
    while fields[-1] is None:
        fields.pop()
    read = _agrees(msgspec.msgpack.encode(fields), id_bound=bound)
    nil_seq = msg.seq is None and msg.lease_ms is not None  # written as nil: no echo
    if isinstance(read, Unreadable) and not nil_seq:
        assert read.layer_idx == msg.layer_idx
