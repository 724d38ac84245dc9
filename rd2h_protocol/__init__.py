"""rd2h_protocol: the pure, sans-IO core of the RD2H KV-cache transfer protocol.

No sockets, threads, clocks or tensors live here: messages and their codec, layouts,
topology rules, the state machines and the two endpoints that run them.
"""

from rd2h_protocol.codec import decode, encode
from rd2h_protocol.completion import CrossRankCompletion, RankReport
from rd2h_protocol.consumer import ConsumerConfig, ConsumerEndpoint
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
from rd2h_protocol.layout import (
    ComponentDest,
    DestinationLayout,
    LayerLayout,
    decode_layer_metadata,
    encode_layer_metadata,
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
from rd2h_protocol.plan import ComponentAddrs, ReadPlan, RequestRead
from rd2h_protocol.producer import DecodeTarget, ProducerConfig, ProducerEndpoint
from rd2h_protocol.rendezvous import Rendezvous

__all__ = [
    "ACK_V1",
    "PROTOCOL_VERSION",
    "Abort",
    "Ack",
    "ComponentAddrs",
    "ComponentDest",
    "ConfigError",
    "ConsumerConfig",
    "ConsumerEndpoint",
    "CrossRankCompletion",
    "DecodeTarget",
    "DestinationLayout",
    "ErrorCode",
    "FailedRequest",
    "FrameTooLarge",
    "LayerLayout",
    "LayoutMismatch",
    "LocalProtocolError",
    "MalformedFrame",
    "Message",
    "MfMeta",
    "ProducerConfig",
    "ProducerEndpoint",
    "ProtocolError",
    "RankReport",
    "ReadDone",
    "ReadFailed",
    "ReadPlan",
    "ReadReadyBatch",
    "ReadReq",
    "RemoteProtocolError",
    "Rendezvous",
    "RequestRead",
    "TopologyError",
    "TransferError",
    "UnknownMessageKind",
    "ValueOutOfRange",
    "decode",
    "decode_layer_metadata",
    "encode",
    "encode_layer_metadata",
]
