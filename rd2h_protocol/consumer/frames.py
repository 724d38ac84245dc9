"""Reading readiness frames: the bounded fast path's pieces, and what a refused frame names.

The endpoint's ``_decode_bounded`` (:mod:`rd2h_protocol.consumer.endpoint`) decodes a
readiness with its Prefill block ids checked against the session's bound
(:func:`_bounded_entries`) and reuses the entries of the previous layer of the same step
(:func:`_entries_offset`, :func:`_with_entries`). A frame that fails typed decoding is
still identified, at no more cost than the codec's (:func:`_identify_readiness`), so that
it gets a failure reply. :func:`_message_ids` is what a decoded readiness names.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Final

import msgspec

from rd2h_protocol.wire.codec import NAME_DECODER
from rd2h_protocol.wire.messages import (
    MAX_BLOCKS_PER_REQUEST,
    MAX_FRAME_BYTES,
    MAX_NAME_LEN,
    MAX_REQUESTS_PER_BATCH,
    TAG_READ_READY_BATCH,
    ReadReadyBatch,
    ReadReq,
)

_U32: Final = (1 << 32) - 1


_SEQ_MAX: Final = (1 << 63) - 1


def _unique(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))


#: The request id of a readiness entry (``map`` it over entries: no Python-level loop).
entry_request_id: Final = operator.attrgetter("ext_req_id")


def _message_ids(msg: ReadReadyBatch) -> list[str]:
    """Every request id a readiness names: its entries, then its done ids."""
    return _unique(itertools.chain(map(entry_request_id, msg.read_reqs), msg.done_ext_ids))


# A readiness frame as every encoder writes it: a fixarray (at most 9 fields), then the
# tag as bin8. Other spellings take the general path (codec.decode), which judges them.
_READINESS_HEAD: Final = b"\xc4" + bytes([len(TAG_READ_READY_BATCH)]) + TAG_READ_READY_BATCH


class _SharedIdsReadReq(ReadReq):
    """A readiness entry whose indexer ids, when equal to its main ids, are the SAME object.

    Prefill sends the same ids twice when both caches share one block table (the usual
    case); one object lets the planner unbox them once per read. Comparing two equal
    sequences costs less than unboxing one, and unequal ones differ early.
    """

    def __post_init__(self) -> None:
        # ReadReq's own rule (None means the main ids) folded in: one call per entry.
        indexer = self.indexer_block_ids
        if indexer is None or indexer == self.main_block_ids:
            self.indexer_block_ids = self.main_block_ids


# A readiness whose entries are left undecoded (msgspec.Raw): every other field is decoded
# and checked exactly as ReadReadyBatch's (it is a subclass that overrides one field).
_READINESS_SHELL: Final[Any] = msgspec.defstruct(
    "_ReadinessShell", [("read_reqs", msgspec.Raw)], bases=(ReadReadyBatch,), kw_only=True
)


_SHELL_DECODER: Final = msgspec.msgpack.Decoder(_READINESS_SHELL)


_BATCH_FIELDS: Final = tuple(f for f in ReadReadyBatch.__struct_fields__ if f != "read_reqs")


_EMPTY_ARRAY: Final = b"\x90"


# One past the largest block id the wire carries (messages.BlockId): the bound of a
# session whose layout has no num_blocks (see _decode_bounded).
_WIRE_ID_LIMIT: Final = 1 << 32


# Sessions whose last readiness entries are remembered (see _decode_bounded).
_ENTRY_CACHE_SESSIONS: Final = 64


@functools.lru_cache(maxsize=64)
def _bounded_entries(bound: int) -> msgspec.msgpack.Decoder[list[ReadReq]]:
    """A decoder of readiness entries that also refuses any Prefill block id ``>= bound``.

    The entry type is a :class:`ReadReq` subclass that differs only in the block-id
    element type (and holds the ids as tuples: immutable, so the runtime may key caches
    on them), so entries it accepts carry the same values as
    :func:`~rd2h_protocol.wire.codec.decode` would give. msgspec checks the bound while it
    builds each int anyway: the per-request source-range check then costs nothing for
    the usual message, with no Python work per id. Cached per bound (every session of one
    model has the same ``num_blocks``).
    """
    # Types built at run time (the bound is data), hence Any for the type checker.
    block_id: Any = Annotated[int, msgspec.Meta(ge=0, lt=bound)]
    ids: Any = Annotated[tuple[block_id, ...], msgspec.Meta(max_length=MAX_BLOCKS_PER_REQUEST)]
    entry: Any = msgspec.defstruct(
        "_BoundedReadReq",
        [("main_block_ids", ids), ("indexer_block_ids", ids | None, None)],
        bases=(_SharedIdsReadReq,),
    )
    entries: Any = Annotated[list[entry], msgspec.Meta(max_length=MAX_REQUESTS_PER_BATCH)]
    decoder: msgspec.msgpack.Decoder[list[ReadReq]] = msgspec.msgpack.Decoder(entries)
    return decoder


def _entries_offset(frame: bytes | bytearray | memoryview) -> int | None:
    """Where ``read_reqs`` starts in a readiness frame (after the head, ``layer_idx`` and
    ``layer_name``); None for spellings of those two that encoders do not write."""
    try:
        pos = 1 + len(_READINESS_HEAD)
        head = frame[pos]
        if head <= 0x7F:  # positive fixint
            pos += 1
        elif 0xCC <= head <= 0xCE:  # uint8, uint16, uint32
            pos += 1 + (1 << (head - 0xCC))
        else:
            return None
        head = frame[pos]
        if 0xA0 <= head <= 0xBF:  # fixstr
            return pos + 1 + (head & 0x1F)
        if head == 0xD9:  # str8
            return pos + 2 + frame[pos + 1]
        if head == 0xDA:  # str16
            return pos + 3 + int.from_bytes(frame[pos + 1 : pos + 3], "big")
    except IndexError:
        pass
    return None


def _with_entries(shell: ReadReadyBatch, entries: list[ReadReq]) -> ReadReadyBatch:
    """The plain :class:`ReadReadyBatch` of a decoded shell and its decoded entries."""
    fields = {name: getattr(shell, name) for name in _BATCH_FIELDS}
    return ReadReadyBatch(read_reqs=entries, **fields)


class _ReadinessFields(msgspec.Struct, array_like=True):
    """A readiness's fields as raw msgpack, each parsed only when needed (see
    :func:`_identify_readiness`); trailing fields beyond these are skipped unparsed."""

    kind: bytes
    layer_idx: msgspec.Raw
    layer_name: msgspec.Raw = msgspec.Raw()
    read_reqs: msgspec.Raw = msgspec.Raw()
    done_ext_ids: msgspec.Raw = msgspec.Raw()
    group_member_idx: msgspec.Raw = msgspec.Raw()
    tp_ratio: msgspec.Raw = msgspec.Raw()
    seq: msgspec.Raw = msgspec.Raw()


class _NamedEntry(msgspec.Struct, array_like=True):
    """A read_reqs entry's request id; the rest of the entry is skipped unparsed."""

    ext_req_id: Annotated[str, msgspec.Meta(max_length=MAX_NAME_LEN)]


_FIELDS_DECODER: Final = msgspec.msgpack.Decoder(_ReadinessFields)


_RAW_LIST_DECODER: Final = msgspec.msgpack.Decoder(
    Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_REQUESTS_PER_BATCH)]
)


_ENTRY_DECODER: Final = msgspec.msgpack.Decoder(_NamedEntry)


def _raw_int(raw: msgspec.Raw, high: int) -> int | None:
    try:
        value = msgspec.msgpack.decode(raw, type=int)
    except Exception:
        return None
    return value if 0 <= value <= high else None


def _raw_names(raw: msgspec.Raw, entry: Callable[[msgspec.Raw], str]) -> list[str]:
    """The names in a raw list, one per entry that holds one; none from a list that is
    not a list or longer than a batch may be (it is not parsed further)."""
    try:
        items = _RAW_LIST_DECODER.decode(raw)
    except Exception:
        return []
    names = []
    for item in items:
        try:
            names.append(entry(item))
        except Exception:
            continue
    return names


def _identify_readiness(
    frame: bytes | bytearray | memoryview,
) -> tuple[int, int | None, list[str]] | None:
    """Read ``(layer_idx, seq, request ids)`` from a readiness that failed typed decoding.

    Returns ``None`` when the frame is not a readiness or those fields are unreadable
    (then no reply can be correlated with it and it is dropped). Never more work than the
    bounded codec does: the fields are parsed only as far as they are needed, entries
    are skipped unparsed, and ids come only from lists within a batch's bound, so a
    hostile frame costs a scan of its bytes, never a tree of Python objects.
    """
    if len(frame) > MAX_FRAME_BYTES:
        return None
    try:
        fields = _FIELDS_DECODER.decode(frame)
    except Exception:  # not msgpack, not an array headed by bin, or nesting too deep
        return None
    if fields.kind != TAG_READ_READY_BATCH:
        return None
    layer_idx = _raw_int(fields.layer_idx, _U32)
    if layer_idx is None:
        return None
    seq: int | None = None
    if len(fields.seq):
        seq = _raw_int(fields.seq, _SEQ_MAX)
        if seq is None:  # a seq we cannot echo cannot be correlated
            return None
    ids = _raw_names(fields.read_reqs, lambda item: _ENTRY_DECODER.decode(item).ext_req_id)
    ids += _raw_names(fields.done_ext_ids, NAME_DECODER.decode)
    return layer_idx, seq, _unique(ids)


# A parked readiness keeps its entries packed as msgpack (see consumer.parking): written
# by this encoder, read back by this decoder, which checks nothing the entries did not
# pass already (they were decoded and checked once: bounded ids, names, starts) and
# yields the same values, with ids as tuples, as the bounded decoder would.
_PARK_ENCODER: Final = msgspec.msgpack.Encoder()


_UNPACKED_ENTRY: Final[Any] = msgspec.defstruct(
    "_UnpackedReadReq",
    [
        ("ext_req_id", str),
        ("main_block_ids", tuple[int, ...]),
        ("indexer_block_ids", tuple[int, ...] | None, None),
        ("main_start_block", int, 0),
        ("indexer_start_block", int, 0),
    ],
    bases=(_SharedIdsReadReq,),
)


_UNPACK_DECODER: Final[msgspec.msgpack.Decoder[list[ReadReq]]] = msgspec.msgpack.Decoder(
    list[_UNPACKED_ENTRY]
)
