"""rd2h_protocol: the pure, sans-IO core of the RD2H KV-cache transfer protocol.

No sockets, threads, clocks or tensors live here: messages and their codec, layouts,
topology rules, the state machines and the two endpoints that run them.
"""

from rd2h_protocol.codec import decode, encode
from rd2h_protocol.errors import (
    ConfigError,
    ErrorCode,
    FrameTooLarge,
    LayoutMismatch,
    LocalProtocolError,
    MalformedFrame,
    ProtocolError,
    RemoteProtocolError,
    TopologyError,
    TransferError,
    UnknownMessageKind,
    ValueOutOfRange,
)
from rd2h_protocol.messages import (
    ACK_V1,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    FailedRequest,
    Message,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadReq,
)

__all__ = [
    "ACK_V1",
    "PROTOCOL_VERSION",
    "Abort",
    "Ack",
    "ConfigError",
    "ErrorCode",
    "FailedRequest",
    "FrameTooLarge",
    "LayoutMismatch",
    "LocalProtocolError",
    "MalformedFrame",
    "Message",
    "MfMeta",
    "ProtocolError",
    "ReadDone",
    "ReadFailed",
    "ReadReadyBatch",
    "ReadReq",
    "RemoteProtocolError",
    "TopologyError",
    "TransferError",
    "UnknownMessageKind",
    "ValueOutOfRange",
    "decode",
    "encode",
]
