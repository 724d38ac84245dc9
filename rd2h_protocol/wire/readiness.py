"""Reading a frame from Prefill on Decode: :func:`read_frame`, one call per frame.

The result says everything the receiver acts on, and nothing is decoded twice to get it:

- :class:`Readiness`: a readiness, its message, and ``ids_below``: when not None, every
  Prefill block id of its entries was checked below it while it was decoded (msgspec
  checks the bound as it builds each int: no Python work per id);
- :class:`Unreadable`: a frame refused, with the verdict :func:`~rd2h_protocol.wire.codec.decode`
  gives it (its code and text) and what could be read of it: ``layer_idx``, ``seq`` and
  the request ids it names, when it is a readiness whose ``layer_idx`` (and ``seq``, when
  present) can be read; ``layer_idx`` None when no reply can be correlated with it;
- any other message, as :func:`~rd2h_protocol.wire.codec.decode` gives it.

Whatever the path, the message and the verdict are exactly those of
:func:`~rd2h_protocol.wire.codec.decode` (entries may hold their ids as tuples; the values
are equal), and nothing escapes: a hostile frame costs one bounded pass, never a tree of
Python objects. The bounds are checked before the work they bound:
:data:`~rd2h_protocol.wire.messages.MAX_FRAME_BYTES` before anything,
:data:`~rd2h_protocol.wire.messages.MAX_BLOCK_IDS_PER_READINESS` from the id lists'
headers before any id is decoded (:func:`~rd2h_protocol.wire.codec.check_block_ids`),
:data:`~rd2h_protocol.wire.messages.MAX_REQUESTS_PER_BATCH` and
:data:`~rd2h_protocol.wire.messages.MAX_NAME_LEN` by the types before an item is built.

The receiver passes what it knows of the sending session as plain values:

- ``id_bound``: one past the largest Prefill block id the session's layout has (its
  smallest ``num_blocks``; :data:`WIRE_ID_LIMIT` for a layout without one, which is
  exactly the codec's own check); None for a peer bound to no session (nothing is
  vouched for then);
- ``kept``: ``(raw, entries)``, the bytes and the decoded entries of the session's last
  readiness (a :class:`Readiness`'s ``keep`` and ``msg.read_reqs``), decoded with the
  same ``id_bound``. Every layer of an engine step carries the same entries, byte for
  byte: only the layer, ``seq`` and done ids differ. When the same bytes stand at the
  entries' place (msgpack values delimit themselves, so equal bytes there are the same
  value), the frame is decoded with an empty array in their place and given the kept
  entries: the ids are decoded once per step, not per layer.

The paths of a readiness as every encoder writes it (a fixarray headed by the bin8 tag),
from a session:

1. kept entries at their place: the rest of the frame is decoded, the entries are the
   kept ones (``reused``);
2. else the frame is decoded with its entries left raw; a frame with too many block ids
   is refused (:class:`~rd2h_protocol.wire.codec.TooManyBlockIds`, named from the decoded
   fields); the entries are decoded with the bound checked (``keep``: their bytes);
3. an id at or past the bound: the entries (only they) are decoded again as the codec
   decodes them, and ``ids_below`` is None: the receiver checks each request's ids itself
   and isolates the offending ones;
4. entries that do not decode: refused with the codec's verdict, worded for the whole
   frame (:func:`~rd2h_protocol.wire.codec.remote_error`).

Any other frame (another message, another spelling, no session, a malformed head) is
decoded by :func:`~rd2h_protocol.wire.codec.decode`; a refused one that is a readiness is
identified by a scan of its raw fields that parses them only as far as needed.

A parked readiness keeps its entries packed (:func:`pack_entries`,
:func:`unpack_entries`): the values come back as this module decoded them.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Final

import msgspec

from rd2h_protocol.errors import ErrorCode, RemoteProtocolError
from rd2h_protocol.wire.codec import (
    NAME_DECODER,
    TooManyBlockIds,
    check_block_ids,
    decode,
    remote_error,
)
from rd2h_protocol.wire.messages import (
    MAX_BLOCKS_PER_REQUEST,
    MAX_FRAME_BYTES,
    MAX_NAME_LEN,
    MAX_REQUESTS_PER_BATCH,
    TAG_READ_READY_BATCH,
    Message,
    ReadReadyBatch,
    ReadReq,
)

__all__ = [
    "PACKED_ENTRIES_DECODER",
    "WIRE_ID_LIMIT",
    "Readiness",
    "Unreadable",
    "entry_request_id",
    "message_ids",
    "pack_entries",
    "read_frame",
    "unique_ids",
    "unpack_entries",
]

#: One past the largest block id the wire carries (``messages.BlockId``): the ``id_bound``
#: of a session whose layout has no ``num_blocks``.
WIRE_ID_LIMIT: Final = 1 << 32

_U32: Final = (1 << 32) - 1
_SEQ_MAX: Final = (1 << 63) - 1


def unique_ids(ids: Iterable[str]) -> list[str]:
    """``ids`` without repeats, in first-seen order."""
    return list(dict.fromkeys(ids))


#: The request id of a readiness entry (``map`` it over entries: no Python-level loop).
entry_request_id: Final = operator.attrgetter("ext_req_id")


def message_ids(msg: ReadReadyBatch) -> list[str]:
    """Every request id a readiness names: its entries, then its done ids."""
    return unique_ids(itertools.chain(map(entry_request_id, msg.read_reqs), msg.done_ext_ids))


class Readiness(msgspec.Struct, frozen=True, gc=False):
    """A readiness read from a frame (see the module docstring).

    ``ids_below``: every Prefill block id of ``msg``'s entries is below it (None: not
    checked). ``keep``: the bytes of entries decoded afresh with the session's bound: keep
    ``(keep, msg.read_reqs)`` and pass it as the session's next ``kept``. ``reused``: the
    entries are the ``kept`` ones.
    """

    msg: ReadReadyBatch
    ids_below: int | None = None
    keep: bytes | None = None
    reused: bool = False


class Unreadable(msgspec.Struct, frozen=True):
    """A frame refused: ``error`` is what :func:`~rd2h_protocol.wire.codec.decode` raises
    for it. ``layer_idx`` and ``seq`` (None: absent) are those of a readiness that can be
    answered, with ``ids`` the request ids it names; ``layer_idx`` is None when no reply
    can be correlated with the frame (not a readiness, or those fields unreadable)."""

    error: RemoteProtocolError
    layer_idx: int | None = None
    seq: int | None = None
    ids: list[str] = []

    @property
    def code(self) -> ErrorCode:
        return self.error.code

    @property
    def message(self) -> str:
        return self.error.message

    @property
    def too_many_block_ids(self) -> bool:
        return isinstance(self.error, TooManyBlockIds)


# -- the decoders ---------------------------------------------------------------------------

# A readiness frame as every encoder writes it: a fixarray (at most 9 fields), then the
# tag as bin8. Other spellings are decoded by codec.decode, which judges them.
_READINESS_HEAD: Final = b"\xc4" + bytes([len(TAG_READ_READY_BATCH)]) + TAG_READ_READY_BATCH
_HEAD_END: Final = 1 + len(_READINESS_HEAD)
# read_reqs is field 3 of a readiness: where an error in its entries stands in the frame.
_ENTRIES_AT: Final = "[3]"
_SEQ_FIELD: Final = ReadReadyBatch.__struct_fields__.index("seq")
_EMPTY_ARRAY: Final = b"\x90"


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
# The entries exactly as codec.decode decodes them (ReadReadyBatch's own field type).
_ENTRIES_DECODER: Final[msgspec.msgpack.Decoder[list[ReadReq]]] = msgspec.msgpack.Decoder(
    next(f.type for f in msgspec.structs.fields(ReadReadyBatch) if f.name == "read_reqs")
)


@functools.lru_cache(maxsize=64)
def _bounded_entries(bound: int) -> msgspec.msgpack.Decoder[list[ReadReq]]:
    """A decoder of readiness entries that also refuses any Prefill block id ``>= bound``.

    The entry type is a :class:`ReadReq` subclass that differs only in the block-id
    element type (and holds the ids as tuples: immutable, so the runtime may key caches
    on them), so entries it accepts carry the same values as
    :func:`~rd2h_protocol.wire.codec.decode` would give. Cached per bound (every session
    of one model has the same ``num_blocks``).
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
        pos = _HEAD_END
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


# -- what a refused frame names -------------------------------------------------------------


class _ReadinessFields(msgspec.Struct, array_like=True):
    """A readiness's fields as raw msgpack, each parsed only when needed (see
    :func:`_identify`); trailing fields beyond these are skipped unparsed."""

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


def _entry_name(item: msgspec.Raw) -> str:
    return _ENTRY_DECODER.decode(item).ext_req_id


def _raw_names(raw: msgspec.Raw | bytes, entry: Callable[[msgspec.Raw], str]) -> list[str]:
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


def _identify(frame: bytes | bytearray | memoryview, error: RemoteProtocolError) -> Unreadable:
    """``error``'s refusal of ``frame``, with ``(layer_idx, seq, request ids)`` when the
    frame is a readiness whose ``layer_idx`` (and ``seq``, when present) can be read.

    Never more work than the bounded codec does: the fields are parsed only as far as they
    are needed, entries are skipped unparsed, and ids come only from lists within a
    batch's bound, so a hostile frame costs a scan of its bytes.
    """
    if len(frame) > MAX_FRAME_BYTES:
        return Unreadable(error)
    try:
        fields = _FIELDS_DECODER.decode(frame)
    except Exception:  # not msgpack, not an array headed by bin, or nesting too deep
        return Unreadable(error)
    if fields.kind != TAG_READ_READY_BATCH:
        return Unreadable(error)
    layer_idx = _raw_int(fields.layer_idx, _U32)
    if layer_idx is None:
        return Unreadable(error)
    seq: int | None = None
    if len(fields.seq):
        seq = _raw_int(fields.seq, _SEQ_MAX)
        if seq is None:  # a seq we cannot echo cannot be correlated
            return Unreadable(error)
    ids = _raw_names(fields.read_reqs, _entry_name)
    ids += _raw_names(fields.done_ext_ids, NAME_DECODER.decode)
    return Unreadable(error, layer_idx, seq, unique_ids(ids))


def _refused(frame: bytes | bytearray | memoryview, shell: Any, error: Exception) -> Unreadable:
    """A readiness whose fields decoded (``shell``) but whose entries did not: named from
    the decoded fields, as :func:`_identify` would name it."""
    verdict = remote_error(error, under=_ENTRIES_AT)
    seq = shell.seq
    if seq is None and (frame[0] & 0x0F) > _SEQ_FIELD:  # seq present, as nil: no echo
        return Unreadable(verdict)
    ids = _raw_names(shell.read_reqs, _entry_name)
    return Unreadable(verdict, shell.layer_idx, seq, unique_ids([*ids, *shell.done_ext_ids]))


def _read_any(frame: bytes | bytearray | memoryview) -> Readiness | Unreadable | Message:
    """Any frame, by :func:`~rd2h_protocol.wire.codec.decode` (nothing vouched for)."""
    try:
        msg = decode(frame)
    except RemoteProtocolError as exc:
        return _identify(frame, exc.with_traceback(None))
    return Readiness(msg) if type(msg) is ReadReadyBatch else msg


# -- the entry point ------------------------------------------------------------------------


def read_frame(
    frame: bytes | bytearray | memoryview,
    *,
    id_bound: int | None = None,
    kept: tuple[bytes, list[ReadReq]] | None = None,
) -> Readiness | Unreadable | Message:
    """Read one frame from a Prefill peer; never raises (see the module docstring).

    ``id_bound``: the session's Prefill block id bound (:data:`WIRE_ID_LIMIT` when its
    layout has none), None for a peer bound to no session. ``kept``: the session's last
    ``(keep, entries)``, read under the same ``id_bound`` (a new layout drops them).
    """
    if (
        id_bound is None
        or not _HEAD_END < len(frame) <= MAX_FRAME_BYTES
        or not 0x91 <= frame[0] <= 0x9F
        or frame[1:_HEAD_END] != _READINESS_HEAD
    ):
        return _read_any(frame)
    try:
        if kept is not None:
            raw, entries = kept
            at = _entries_offset(frame)
            # (bytes.startswith: a memcmp; comparing memoryviews goes item by item)
            if at is not None and bytes(frame).startswith(raw, at):
                rest = b"".join((frame[:at], _EMPTY_ARRAY, frame[at + len(raw) :]))
                msg = _with_entries(_SHELL_DECODER.decode(rest), entries)
                return Readiness(msg, id_bound, reused=True)
        shell = _SHELL_DECODER.decode(frame)
    except Exception:  # a field other than the entries does not decode: the codec words it
        return _read_any(frame)
    raw_entries = shell.read_reqs
    try:
        check_block_ids(raw_entries)
    except TooManyBlockIds as exc:
        names = unique_ids([*exc.names, *shell.done_ext_ids])
        return Unreadable(exc.with_traceback(None), shell.layer_idx, shell.seq, names)
    try:
        entries = _bounded_entries(id_bound).decode(raw_entries)
    except Exception:  # an id at or past the bound, or entries that do not decode
        pass
    else:
        return Readiness(_with_entries(shell, entries), id_bound, keep=bytes(raw_entries))
    try:
        entries = _ENTRIES_DECODER.decode(raw_entries)
    except msgspec.ValidationError as exc:
        return _refused(frame, shell, exc)
    except Exception:  # (invalid UTF-8, nesting too deep: the codec words it)
        return _read_any(frame)
    return Readiness(_with_entries(shell, entries))


# -- packed entries (a parked readiness) ----------------------------------------------------

# Written by this encoder, read back by this decoder, which checks nothing the entries did
# not pass already (they were decoded and checked once: bounded ids, names, starts) and
# yields the same values, with ids as tuples, as the bounded decoder would.
_PACK_ENCODER: Final = msgspec.msgpack.Encoder()
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

#: Decodes entries packed by :func:`pack_entries` (what :func:`unpack_entries` calls).
PACKED_ENTRIES_DECODER: Final[msgspec.msgpack.Decoder[list[ReadReq]]] = msgspec.msgpack.Decoder(
    list[_UNPACKED_ENTRY]
)


def pack_entries(entries: Sequence[ReadReq]) -> bytes:
    """Readiness entries packed as msgpack (raises ``TypeError``, ``OverflowError`` or
    ``ValueError`` only for entries built in-process with values msgpack cannot hold)."""
    return _PACK_ENCODER.encode(entries)


def unpack_entries(packed: bytes) -> list[ReadReq]:
    """Entries packed by :func:`pack_entries`, as the readiness decoder gives them."""
    return PACKED_ENTRIES_DECODER.decode(packed)
