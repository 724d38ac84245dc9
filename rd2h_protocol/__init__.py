"""rd2h_protocol: the pure, sans-IO core of the RD2H KV-cache transfer protocol.

No sockets, threads, clocks or tensors live here: messages and their codec, layouts,
topology rules, the state machines and the two endpoints that run them. Everything a
runtime needs to drive the endpoints is exported here: the endpoints and their
configurations, their inputs and outputs (:mod:`rd2h_protocol.events`), the messages and
codec, and the errors. specs/api.md shows how to drive an endpoint.
"""

from rd2h_protocol.completion import CrossRankCompletion, RankReport
from rd2h_protocol.consumer import ConsumerConfig, ConsumerEndpoint, ConsumerStats
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
from rd2h_protocol.events import (
    Chunk,
    Connect,
    ConnectionView,
    ConsumerOutput,
    Disconnect,
    GateOpened,
    LayerReplied,
    ProducerOutput,
    Releasable,
    Reply,
    RequestDone,
    RequestFailed,
    RequestFinished,
    Send,
    SendAbort,
    StartRead,
)
from rd2h_protocol.plan import ComponentAddrs, ReadPlan, RequestRead
from rd2h_protocol.producer import DecodeTarget, ProducerConfig, ProducerEndpoint, ProducerStats
from rd2h_protocol.rendezvous import Rendezvous
from rd2h_protocol.wire.codec import decode, encode
from rd2h_protocol.wire.layout import (
    ComponentDest,
    DestinationLayout,
    LayerLayout,
    decode_layer_metadata,
    encode_layer_metadata,
)
from rd2h_protocol.wire.messages import (
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
    "Chunk",
    "ComponentAddrs",
    "ComponentDest",
    "ConfigError",
    "Connect",
    "ConnectionView",
    "ConsumerConfig",
    "ConsumerEndpoint",
    "ConsumerOutput",
    "ConsumerStats",
    "CrossRankCompletion",
    "DecodeTarget",
    "DestinationLayout",
    "Disconnect",
    "ErrorCode",
    "FailedRequest",
    "FrameTooLarge",
    "GateOpened",
    "LayerLayout",
    "LayerReplied",
    "LayoutMismatch",
    "LocalProtocolError",
    "MalformedFrame",
    "Message",
    "MfMeta",
    "ProducerConfig",
    "ProducerEndpoint",
    "ProducerOutput",
    "ProducerStats",
    "ProtocolError",
    "RankReport",
    "ReadDone",
    "ReadFailed",
    "ReadPlan",
    "ReadReadyBatch",
    "ReadReq",
    "Releasable",
    "RemoteProtocolError",
    "Rendezvous",
    "Reply",
    "RequestDone",
    "RequestFailed",
    "RequestFinished",
    "RequestRead",
    "Send",
    "SendAbort",
    "StartRead",
    "TopologyError",
    "TransferError",
    "UnknownMessageKind",
    "ValueOutOfRange",
    "decode",
    "decode_layer_metadata",
    "encode",
    "encode_layer_metadata",
]
