"""``encode`` and ``decode``: the only way bytes become messages and back.

``decode`` never lets anything but a :class:`RemoteProtocolError` subclass escape: the
caller can drop, count and reply to a bad frame without guessing what it raised. What it
refuses, and as which error:

- a frame over :data:`~rd2h_protocol.wire.messages.MAX_FRAME_BYTES`, a list or string over
  its bound: :class:`FrameTooLarge`; a readiness that carries more than
  :data:`~rd2h_protocol.wire.messages.MAX_BLOCK_IDS_PER_READINESS` block ids in all:
  :class:`TooManyBlockIds` (a :class:`FrameTooLarge`), found from the lists' headers
  before any id is decoded;
- an integer outside its range (negative ids, a layer index over 32 bits):
  :class:`ValueOutOfRange`;
- a tag that names no message: :class:`UnknownMessageKind`;
- everything else (not msgpack, not an array, a str tag, a map, a bin where a str belongs,
  invalid UTF-8, too few fields, nesting too deep, trailing bytes after the message, the
  v1 decoder refuses those too): :class:`MalformedFrame`.

Unknown TRAILING fields of a message or of a ``read_reqs`` entry are ignored, as v1 does,
so a later protocol version can append fields.
"""

from __future__ import annotations

import operator
import re
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from rd2h_protocol.errors import (
    FrameTooLarge,
    LocalProtocolError,
    MalformedFrame,
    RemoteProtocolError,
    UnknownMessageKind,
    ValueOutOfRange,
)
from rd2h_protocol.wire.messages import (
    MAX_BLOCK_IDS_PER_READINESS,
    MAX_FRAME_BYTES,
    MAX_NAME_LEN,
    MAX_REQUESTS_PER_BATCH,
    MESSAGE_TYPES,
    OUT_OF_RANGE_PREFIX,
    TAG_ACK_V1,
    TAG_READ_READY_BATCH,
    Ack,
    Message,
    ReadReadyBatch,
    ReadReq,
)

_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODERS: Final = {tag: msgspec.msgpack.Decoder(cls) for tag, cls in MESSAGE_TYPES.items()}
_TAG_OF_TYPE: Final = {cls: tag for tag, cls in MESSAGE_TYPES.items()}
# msgspec names the failed constraint in its message; map the two bound kinds we care about
# (plus the cross-field range checks of __post_init__, which carry a fixed prefix).
_RANGE_RE: Final = re.compile(rf"Expected `int` (?:>=|<=|>|<) |{re.escape(OUT_OF_RANGE_PREFIX)}")
_LENGTH_RE: Final = re.compile(r"Expected `(?:array|str|bytes)` of length <= ")


def encode(msg: Message) -> bytes:
    """Encode ``msg`` for the wire.

    Trailing ``None`` (absent v2) fields are dropped, so a message that uses only v1
    fields encodes to exactly the bytes a v1 peer sends; the v1 handshake reply encodes
    to the raw frame ``b"ACK"``. Field bounds are the receiver's to enforce (checking
    them here would cost as much as decoding); the tag and the frame size are checked.

    Raises:
        LocalProtocolError: ``msg.kind`` is not its class's tag, a v1 ACK carries v2
            fields, or the frame would exceed ``MAX_FRAME_BYTES``.
    """
    fields = msgspec.structs.astuple(msg)
    expected = _TAG_OF_TYPE.get(type(msg))
    if type(msg) is Ack and msg.kind == TAG_ACK_V1:
        if any(value is not None for value in fields[1:]):
            raise LocalProtocolError("the v1 ACK is a raw frame and carries no fields")
        return TAG_ACK_V1
    if expected is None or msg.kind != expected:
        raise LocalProtocolError(
            f"{type(msg).__name__} must carry tag {expected!r}, found {msg.kind!r}"
        )
    # fields[0] is the tag, never None, so this stops at the last present field.
    end = len(fields)
    while fields[end - 1] is None:
        end -= 1
    frame = _ENCODER.encode(fields[:end] if end != len(fields) else msg)
    if len(frame) > MAX_FRAME_BYTES:
        raise LocalProtocolError(
            f"{type(msg).__name__} encodes to {len(frame)} bytes; the limit is "
            f"{MAX_FRAME_BYTES}: split it"
        )
    return frame


# Below this many entries re-encoding them costs less than checking that they are the same.
_REUSE_MIN_ENTRIES: Final = 8


class StepEncoder:
    """:func:`encode` for one sender, reusing the encoded entries of a readiness whose
    ``read_reqs`` are the very objects the previous readiness carried.

    Every layer of an engine step publishes the same request chunks: the producer builds
    each chunk once per step and never changes it. Re-encoding a 64 x 256-block step's
    entries cost Prefill's compute path 0.3-0.4 ms per layer. The frames are byte for byte
    those of :func:`encode` (a msgpack array's bytes do not depend on where it sits).
    Entries must not be mutated once sent. Not thread-safe: one per sending thread or lock.
    """

    __slots__ = ("_entries", "_raw")

    def __init__(self) -> None:
        self._entries: list[ReadReq] = []
        self._raw = msgspec.Raw()

    def encode(self, msg: Message) -> bytes:
        if type(msg) is not ReadReadyBatch or len(msg.read_reqs) < _REUSE_MIN_ENTRIES:
            return encode(msg)
        entries = msg.read_reqs
        if len(entries) != len(self._entries) or not all(map(operator.is_, entries, self._entries)):
            self._entries = list(entries)
            self._raw = msgspec.Raw(_ENCODER.encode(entries))
        return encode(msgspec.structs.replace(msg, read_reqs=self._raw))


def _tag_of(frame: bytes | bytearray | memoryview) -> bytes:
    """Read the first element of a msgpack array without decoding the rest."""
    if not frame:
        raise MalformedFrame("empty frame; expected a msgpack array")
    head = frame[0]
    if 0x91 <= head <= 0x9F:  # fixarray with at least one element
        pos = 1
    elif head == 0xDC and len(frame) >= 3:  # array16
        pos = 3
    elif head == 0xDD and len(frame) >= 5:  # array32
        pos = 5
    else:
        raise MalformedFrame(f"frame starts with byte 0x{head:02x}; expected a non-empty array")
    # Every tag is short, so v1 (and we) always write it as bin8.
    if len(frame) < pos + 2 or frame[pos] != 0xC4:
        raise MalformedFrame("the first element (the message tag) must be msgpack bin")
    size = frame[pos + 1]
    tag = bytes(frame[pos + 2 : pos + 2 + size])
    if len(tag) != size:
        raise MalformedFrame("frame ends inside the message tag")
    return tag


class TooManyBlockIds(FrameTooLarge):
    """A readiness carries more block ids than
    :data:`~rd2h_protocol.wire.messages.MAX_BLOCK_IDS_PER_READINESS`; ``names`` are the
    request ids its entries name (those that are strings within their bound)."""

    names: list[str]


class _EntryIds(msgspec.Struct, array_like=True):
    """A ``read_reqs`` entry's id lists left undecoded (trailing fields skipped)."""

    ext_req_id: msgspec.Raw
    main_block_ids: msgspec.Raw
    indexer_block_ids: msgspec.Raw = msgspec.Raw()


class _ReadinessIds(msgspec.Struct, array_like=True):
    kind: bytes
    layer_idx: msgspec.Raw
    layer_name: msgspec.Raw
    read_reqs: msgspec.Raw


_ENTRY_IDS_DECODER: Final = msgspec.msgpack.Decoder(
    Annotated[list[_EntryIds], Meta(max_length=MAX_REQUESTS_PER_BATCH)]
)
_READINESS_IDS_DECODER: Final = msgspec.msgpack.Decoder(_ReadinessIds)


def _array_len(raw: bytes | memoryview) -> int:
    """The length a msgpack array says it has (0 for anything that is not one)."""
    if not raw:
        return 0
    head = raw[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC:
        return int.from_bytes(raw[1:3], "big")
    if head == 0xDD:
        return int.from_bytes(raw[1:5], "big")
    return 0


#: Decodes one name (a request id, a layer name) within its bound, alone.
NAME_DECODER: Final = msgspec.msgpack.Decoder(Annotated[str, Meta(max_length=MAX_NAME_LEN)])


def _entry_names(items: list[_EntryIds]) -> list[str]:
    names = []
    for item in items:
        try:
            names.append(NAME_DECODER.decode(item.ext_req_id))
        except Exception:
            continue
    return names


def _count_entries(entries: bytes | memoryview) -> tuple[int, list[_EntryIds]] | None:
    if len(entries) <= MAX_BLOCK_IDS_PER_READINESS:
        return len(entries), []
    try:
        items = _ENTRY_IDS_DECODER.decode(entries)
    except Exception:
        return None
    total = 0
    for item in items:
        total += _array_len(memoryview(item.main_block_ids))
        total += _array_len(memoryview(item.indexer_block_ids))
    return total, items


def check_block_ids(entries: bytes | memoryview) -> None:
    """Raise :class:`TooManyBlockIds` when encoded ``read_reqs`` carry more block ids than
    :data:`~rd2h_protocol.wire.messages.MAX_BLOCK_IDS_PER_READINESS`.

    The count is the sum of every id list's length, read from the lists' headers: no id is
    decoded. A list holds no more ids than it has bytes, so entries of at most that many
    bytes are within the bound without a look; entries that are not an array of entries
    pass (the typed decoder then says what is wrong).
    """
    counted = _count_entries(entries)
    if counted is not None and counted[0] > MAX_BLOCK_IDS_PER_READINESS:
        exc = TooManyBlockIds(
            f"readiness carries {counted[0]} block ids; the limit is "
            f"{MAX_BLOCK_IDS_PER_READINESS} per readiness: split it"
        )
        exc.names = _entry_names(counted[1])
        try:
            raise exc
        finally:
            del exc  # no cycle through this frame: the frame it names is freed at once


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """Decode one control frame into a typed message.

    Accepts every v1 shape (length guards fill the legacy defaults) and the raw ``b"ACK"``
    frame. Raises a :class:`RemoteProtocolError` subclass, with a code and a message that
    says what was wrong and where, for anything else.
    """
    try:
        if len(frame) > MAX_FRAME_BYTES:
            raise FrameTooLarge(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        if frame == TAG_ACK_V1:
            return Ack(kind=TAG_ACK_V1)  # a fresh value: callers may keep and mutate it
        tag = _tag_of(frame)
        decoder = _DECODERS.get(tag)
        if decoder is None:
            raise UnknownMessageKind(f"unknown message tag {tag[:64]!r}")
        if tag == TAG_READ_READY_BATCH and len(frame) > MAX_BLOCK_IDS_PER_READINESS:
            try:
                shell = _READINESS_IDS_DECODER.decode(frame)
            except Exception:  # the typed decoder says what is wrong
                shell = None
            if shell is not None:
                check_block_ids(shell.read_reqs)
        msg: Message = decoder.decode(frame)
        return msg
    except RemoteProtocolError:
        raise
    except Exception as exc:  # msgspec.DecodeError, ValidationError, RecursionError, ...
        raise remote_error(exc) from None


def remote_error(exc: Exception, *, under: str = "") -> RemoteProtocolError:
    """The :class:`RemoteProtocolError` that :func:`decode` raises for ``exc``, what
    msgspec (or a check) raised while decoding a frame.

    ``under``: the location, in a frame's msgpack path (``"[3]"``), of a value that was
    decoded ALONE out of that frame (as a readiness's entries are): a
    :class:`msgspec.ValidationError`'s location is then written as it reads when the whole
    frame is decoded, so the verdict is word for word the one :func:`decode` gives.
    """
    if isinstance(exc, RemoteProtocolError):
        return exc
    if isinstance(exc, msgspec.ValidationError):
        text = str(exc)
        if under:
            head, at, path = text.rpartition(" - at `$")
            text = f"{head}{at}{under}{path}" if at else f"{text} - at `${under}`"
        if _RANGE_RE.match(text):
            return ValueOutOfRange(text)
        if _LENGTH_RE.match(text):
            return FrameTooLarge(text)
        return MalformedFrame(text)
    return MalformedFrame(f"undecodable frame: {exc}")
