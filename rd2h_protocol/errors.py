"""The one error hierarchy of rd2h.

Every error says what was expected and what was found. Errors caused by input from the
peer are :class:`RemoteProtocolError` (the peer broke the protocol); errors caused by our
own caller are :class:`LocalProtocolError`. Configuration, layout, topology and transfer
failures have their own classes so callers can handle them apart.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Stable numeric codes carried on the wire (v2 replies) and in metrics.

    Append only: a code's number never changes once released.
    """

    UNKNOWN = 0
    MALFORMED = 1  # the frame is not valid msgpack or has the wrong shape
    UNKNOWN_KIND = 2  # the tag names no message we know
    TOO_LARGE = 3  # a size bound was exceeded (frame, list length)
    OUT_OF_RANGE = 4  # an integer lies outside its allowed range
    UNKNOWN_SESSION = 5  # readiness on a connection without a handshake
    UNKNOWN_REQUEST = 6  # readiness for a request Decode does not know
    UNKNOWN_LAYER = 7  # a layer name that is not in the layout
    LAYOUT_MISMATCH = 8  # Prefill and Decode disagree on a tensor layout
    DESTINATION_RANGE = 9  # a destination range does not fit the allocation
    TRANSFER_FAILED = 10  # the batched data read failed
    LEASE_EXPIRED = 11  # the read was not started in time
    ABORTED = 12  # the request was aborted by either side
    INCOMPATIBLE = 13  # handshake compat string or version refused
    TIMEOUT = 14  # no progress within the configured deadline
    STEP_INCOMPLETE = 15  # a Prefill step ended before every cache-bearing layer was written
    CONNECTION_LOST = 16  # the runtime's heartbeat declared the peer endpoint dead
    READINESS_LOST = 17  # a gap in a v2 session's readiness seqs: a layer never arrived


class ProtocolError(Exception):
    """Base class of every rd2h error."""

    code: ErrorCode = ErrorCode.UNKNOWN

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class LocalProtocolError(ProtocolError):
    """Our own caller asked for something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow. Raised by :func:`decode`."""

    code = ErrorCode.MALFORMED


class MalformedFrame(RemoteProtocolError):
    """The frame is not msgpack, or a field has the wrong type or shape."""

    code = ErrorCode.MALFORMED


class UnknownMessageKind(RemoteProtocolError):
    """The frame's tag names no known message."""

    code = ErrorCode.UNKNOWN_KIND


class FrameTooLarge(RemoteProtocolError):
    """A frame, or a list inside it, exceeds its bound."""

    code = ErrorCode.TOO_LARGE


class ValueOutOfRange(RemoteProtocolError):
    """An integer field lies outside its allowed range."""

    code = ErrorCode.OUT_OF_RANGE


class LayoutMismatch(ProtocolError):
    """Prefill's layer layout and Decode's destination layout disagree."""

    code = ErrorCode.LAYOUT_MISMATCH

    def __init__(self, layer: str, component: str, prefill: object, decode: object) -> None:
        super().__init__(
            f"layout mismatch in layer {layer!r}, component {component}: "
            f"Prefill has {prefill!r}, Decode has {decode!r}"
        )
        self.layer = layer
        self.component = component
        self.prefill = prefill
        self.decode = decode


class TopologyError(ProtocolError):
    """A parallel topology, port or block-range rule was broken."""

    code = ErrorCode.OUT_OF_RANGE


class ConfigError(ProtocolError):
    """The configuration is invalid; the message says what to change."""


class TransferError(ProtocolError):
    """A data read failed. ``backend_code`` is the transfer engine's own result code;
    ``code`` is ``TRANSFER_FAILED`` unless another (e.g. ``LEASE_EXPIRED``, ``TIMEOUT``) is
    given."""

    code = ErrorCode.TRANSFER_FAILED

    def __init__(
        self,
        message: str,
        backend_code: int | None = None,
        *,
        transient: bool = False,
        code: ErrorCode | None = None,
    ) -> None:
        super().__init__(message, code)
        self.backend_code = backend_code
        self.transient = transient


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(
            f"{module!r} is not installed; install it with: pip install 'rd2h[{extra}]'"
        )
        self.module = module
        self.extra = extra
