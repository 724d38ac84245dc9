"""Wire messages of the RD2H control protocol.

Theory of operation
-------------------
Every message is a msgpack ARRAY whose first element is a msgpack BIN tag (the v1
implementation encodes Python ``bytes`` tags, which msgspec's tagged unions cannot
express, so each Struct carries the tag as its first field ``kind`` and the codec
dispatches on it). Fields keep the v1 order and names; fields added by protocol v2 are
appended with a ``None`` default that means "absent" and are dropped from the end of the
array when encoding, so a message that uses no v2 field encodes to the v1 bytes exactly.

Receivers are lenient where v1 was lenient (the tuple-length guards): missing trailing
v1 fields take their legacy defaults, which ``__post_init__`` normalises, and unknown
trailing fields are ignored. They are strict everywhere else: every field is typed and
bounded, so a hostile frame is refused by :func:`rd2h_protocol.decode` before any state
changes.

Schema evolution rule: append only; never reorder, never change a field's type.
"""

from __future__ import annotations

from typing import Annotated, Final, TypeAlias

import msgspec
from msgspec import Meta

#: The protocol version this library speaks. v1 is the existing implementation.
PROTOCOL_VERSION: Final = 2

# Tags (msgpack BIN on the wire).
TAG_MF_META: Final = b"mf_meta"
TAG_ACK_V1: Final = b"ACK"  # v1 sends this raw frame, not msgpack
TAG_ACK: Final = b"ack"
TAG_READ_READY_BATCH: Final = b"read_ready_batch"
TAG_READ_DONE: Final = b"read_done"
TAG_READ_FAILED: Final = b"read_failed"
TAG_ABORT: Final = b"abort"

# Capabilities a v2 peer announces in its handshake. A feature is used toward a peer only
# after that peer announced it.
CAP_SEQ: Final = "seq"  # readiness carries seq, replies echo it
CAP_LEASE: Final = "lease"  # readiness carries lease_ms
CAP_ABORT: Final = "abort"  # ABORT messages are understood
CAP_ISOLATE: Final = "isolate"  # per-request failures in READ_DONE
CAP_RECONNECT: Final = "reconnect"  # UNKNOWN_SESSION triggers a re-handshake
# A readiness may come again under the seq it had (Prefill resends what is unanswered
# when a broken connection comes back); Decode answers a repeated seq from memory and
# never reads it twice.
CAP_RESEND: Final = "resend"
ALL_CAPABILITIES: Final = (
    CAP_SEQ,
    CAP_LEASE,
    CAP_ABORT,
    CAP_ISOLATE,
    CAP_RECONNECT,
    CAP_RESEND,
)

# Bounds. A frame larger than this is refused before parsing (ZMQ_MAXMSGSIZE too). The
# largest real frame is a readiness for a whole unchunked long prompt: 1M tokens in 16-token
# blocks is 65536 ids per list, about 0.7 MB. 16 MiB leaves ample room while capping what a
# hostile frame can make the decoder allocate (a few hundred MB of int objects at most).
MAX_FRAME_BYTES: Final = 16 << 20
MAX_REQUESTS_PER_BATCH: Final = 16384
MAX_BLOCKS_PER_REQUEST: Final = 1 << 20
# The block ids one readiness may carry in all (every entry's main and indexer lists, as
# sent: an absent indexer list counts nothing). Decoded, a block id is a Python int in a
# tuple, 8 B of slot plus up to 32 B of int (one byte on the wire when below 128), so the
# frame size alone let a 16 MiB readiness of 14 M one-byte ids decode to ~0.2 GB and plan
# to ~1.4 GB. At this bound a readiness decodes to at most 2^18 * 40 B = 10.5 MB and
# plans to at most 2^19 descriptors (two components per id: K and V, or indexer and
# scale) of 24 B = 12.6 MB, whatever its ids. It keeps every frame an existing v1
# Prefill sends legal: a step's readiness names the blocks that step computed, and two
# whole unchunked 1M-token prompts in 16-token blocks with both id lists are 2^18 ids.
# Refused by the receiver before any id is decoded (codec.decode, FrameTooLarge).
MAX_BLOCK_IDS_PER_READINESS: Final = 1 << 18
MAX_NAME_LEN: Final = 4096
MAX_TEXT_LEN: Final = 65536
MAX_CAPABILITIES: Final = 64

#: Prefix of the errors ``__post_init__`` raises for a value outside its range.
OUT_OF_RANGE_PREFIX: Final = "out of range: "

Uint64 = Annotated[int, Meta(ge=0, le=(1 << 64) - 1)]
BlockId = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
Count = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
Seq = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Name = Annotated[str, Meta(max_length=MAX_NAME_LEN)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_LEN)]
BlockIds = Annotated[list[BlockId], Meta(max_length=MAX_BLOCKS_PER_REQUEST)]
ExtIds = Annotated[list[Name], Meta(max_length=MAX_REQUESTS_PER_BATCH)]
Capabilities = Annotated[list[Name], Meta(max_length=MAX_CAPABILITIES)]


class ReadReq(msgspec.Struct, array_like=True, gc=False):
    """One request's share of a readiness message.

    Block ids are Prefill physical block ids; the two start values are LOGICAL offsets
    into Decode's own per-request destination block list. v1 guards: a 2-field entry uses
    the same ids for main and indexer; missing starts are 0.
    """

    ext_req_id: Name
    main_block_ids: BlockIds
    indexer_block_ids: BlockIds | None = None
    main_start_block: Count = 0
    indexer_start_block: Count = 0

    def __post_init__(self) -> None:
        if self.indexer_block_ids is None:
            self.indexer_block_ids = self.main_block_ids

    @property
    def indexer_ids(self) -> list[int]:
        """The indexer block ids, never ``None`` after construction."""
        ids = self.indexer_block_ids
        assert ids is not None
        return ids


class FailedRequest(msgspec.Struct, array_like=True, gc=False):
    """v2: one request Decode could not serve, reported alone (failure isolation)."""

    ext_req_id: Name
    code: Count
    message: Text = ""


class MfMeta(msgspec.Struct, array_like=True, kw_only=True):
    """Handshake, Prefill -> Decode, once per connection before any readiness.

    ``encoded_layer_metadata`` is a second msgpack blob (see :mod:`rd2h_protocol.wire.layout`).
    v2 appends the protocol version, capabilities and a compat string (model, dtype,
    block sizes, layout version); compat travels here rather than as a map key because a
    v1 Decode iterates every key of the inner map as a layer name. ``first_seq`` (v2) is
    the seq the next readiness on this connection will carry: readiness seqs are
    consecutive per connection, so Decode can tell a lost readiness from a late one.
    """

    kind: bytes = TAG_MF_META
    p_session: Name
    encoded_layer_metadata: Annotated[bytes, Meta(max_length=MAX_FRAME_BYTES)]
    protocol_version: Count | None = None  # v2
    capabilities: Capabilities | None = None  # v2
    compat: Text | None = None  # v2
    first_seq: Seq | None = None  # v2


class Ack(msgspec.Struct, array_like=True, kw_only=True):
    """Handshake reply, Decode -> Prefill.

    v1 is the raw frame ``b"ACK"`` (``kind == TAG_ACK_V1``, every other field ``None``);
    v2 is ``(b"ack", protocol_version, capabilities, error_code, error)``. A non-zero
    ``error_code`` refuses the handshake (compat mismatch) and ``error`` says why.
    """

    kind: bytes = TAG_ACK
    protocol_version: Count | None = None
    capabilities: Capabilities | None = None
    error_code: Count | None = None
    error: Text | None = None

    @property
    def is_v1(self) -> bool:
        """True for the raw v1 reply ``b"ACK"`` (the peer speaks protocol v1)."""
        return self.kind == TAG_ACK_V1


class ReadReadyBatch(msgspec.Struct, array_like=True, kw_only=True):
    """Layer readiness, Prefill -> Decode: one per layer and Decode endpoint.

    v1 guards: <= 4 fields: no done ids; <= 5: member 0; <= 6 or 0: ratio 1.
    ``group_member_idx`` must be below ``tp_ratio`` (v1 computes it as ``p_rank % ratio``);
    a frame that breaks this is refused, since it would count a contributor that cannot
    exist and let a request complete early.
    v2 appends ``seq`` (strictly increasing per connection, echoed by the reply) and
    ``lease_ms`` (Decode must not START a read when less than half of it is left).
    """

    kind: bytes = TAG_READ_READY_BATCH
    layer_idx: Count
    layer_name: Name
    read_reqs: Annotated[list[ReadReq], Meta(max_length=MAX_REQUESTS_PER_BATCH)]
    done_ext_ids: ExtIds = msgspec.field(default_factory=list)
    group_member_idx: Count = 0
    tp_ratio: Count = 1
    seq: Seq | None = None  # v2
    lease_ms: Count | None = None  # v2

    def __post_init__(self) -> None:
        if self.tp_ratio == 0:  # v1 reads max(ratio, 1)
            self.tp_ratio = 1
        if self.group_member_idx >= self.tp_ratio:
            # ValueError: msgspec turns it into a ValidationError while decoding; the
            # prefix lets the codec report it as ValueOutOfRange.
            raise ValueError(
                f"{OUT_OF_RANGE_PREFIX}group_member_idx {self.group_member_idx} must be "
                f"below tp_ratio {self.tp_ratio}"
            )


class ReadDone(msgspec.Struct, array_like=True, kw_only=True):
    """Layer reply, Decode -> Prefill: the read ended (v2: ``failed`` lists requests
    left out of the read, each with a code)."""

    kind: bytes = TAG_READ_DONE
    layer_idx: Count
    seq: Seq | None = None  # v2
    failed: Annotated[list[FailedRequest], Meta(max_length=MAX_REQUESTS_PER_BATCH)] | None = (
        None  # v2
    )


class ReadFailed(msgspec.Struct, array_like=True, kw_only=True):
    """Layer reply, Decode -> Prefill: the batched read as a whole failed."""

    kind: bytes = TAG_READ_FAILED
    layer_idx: Count
    error: Text = ""
    seq: Seq | None = None  # v2
    code: Count | None = None  # v2


class Abort(msgspec.Struct, array_like=True, kw_only=True):
    """v2, both directions: stop working on these requests now."""

    kind: bytes = TAG_ABORT
    ext_ids: ExtIds
    reason: Text = ""


Message: TypeAlias = MfMeta | Ack | ReadReadyBatch | ReadDone | ReadFailed | Abort

#: Message classes by wire tag (the raw v1 ACK frame is handled by the codec).
MESSAGE_TYPES: Final[dict[bytes, type[Message]]] = {
    TAG_MF_META: MfMeta,
    TAG_ACK: Ack,
    TAG_READ_READY_BATCH: ReadReadyBatch,
    TAG_READ_DONE: ReadDone,
    TAG_READ_FAILED: ReadFailed,
    TAG_ABORT: Abort,
}

#: Fields each message had in protocol v1 (everything after them arrived in v2).
V1_FIELD_COUNT: Final[dict[type[Message], int]] = {
    MfMeta: 3,
    Ack: 0,
    ReadReadyBatch: 7,
    ReadDone: 2,
    ReadFailed: 3,
    Abort: 0,
}

#: The raw v1 handshake reply, as a message value.
ACK_V1: Final = Ack(kind=TAG_ACK_V1)
