"""``encode`` and ``decode``: the only way bytes become messages and back.

``decode`` never lets anything but a :class:`RemoteProtocolError` subclass escape: the
caller can drop, count and reply to a bad frame without guessing what it raised.
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from rd2h_protocol.errors import (
    FrameTooLarge,
    MalformedFrame,
    RemoteProtocolError,
    UnknownMessageKind,
    ValueOutOfRange,
)
from rd2h_protocol.messages import (
    ACK_V1,
    MAX_FRAME_BYTES,
    MESSAGE_TYPES,
    TAG_ACK_V1,
    Ack,
    Message,
)

_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODERS: Final = {tag: msgspec.msgpack.Decoder(cls) for tag, cls in MESSAGE_TYPES.items()}
# msgspec names the failed constraint in its message; map the two bound kinds we care about.
_RANGE_RE: Final = re.compile(r"Expected `int` (?:>=|<=|>|<) ")
_LENGTH_RE: Final = re.compile(r"Expected `(?:array|str|bytes)` of length <= ")


def encode(msg: Message) -> bytes:
    """Encode ``msg`` for the wire.

    Trailing ``None`` (absent v2) fields are dropped, so a message that uses only v1
    fields encodes to exactly the bytes a v1 peer sends; the v1 handshake reply encodes
    to the raw frame ``b"ACK"``.
    """
    if type(msg) is Ack and msg.kind == TAG_ACK_V1:
        return TAG_ACK_V1
    fields = msgspec.structs.astuple(msg)
    end = len(fields)
    while end and fields[end - 1] is None:
        end -= 1
    return _ENCODER.encode(fields[:end] if end != len(fields) else msg)


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
    if len(frame) < pos + 2 or frame[pos] != 0xC4:  # bin8
        raise MalformedFrame("the first element (the message tag) must be msgpack bin")
    size = frame[pos + 1]
    tag = bytes(frame[pos + 2 : pos + 2 + size])
    if len(tag) != size:
        raise MalformedFrame("frame ends inside the message tag")
    return tag


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
            return ACK_V1
        tag = _tag_of(frame)
        decoder = _DECODERS.get(tag)
        if decoder is None:
            raise UnknownMessageKind(f"unknown message tag {tag[:64]!r}")
        msg: Message = decoder.decode(frame)
        return msg
    except RemoteProtocolError:
        raise
    except msgspec.ValidationError as exc:
        text = str(exc)
        if _RANGE_RE.match(text):
            raise ValueOutOfRange(text) from None
        if _LENGTH_RE.match(text):
            raise FrameTooLarge(text) from None
        raise MalformedFrame(text) from None
    except Exception as exc:  # msgspec.DecodeError and anything a hostile frame provokes
        raise MalformedFrame(f"undecodable frame: {exc}") from None
