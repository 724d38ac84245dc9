"""The Decode side of the protocol: one sans-IO endpoint per Decode TP rank.

Over 600 lines: one endpoint class whose effect handlers (bound to the tables of
:mod:`rd2h_protocol.machines.consumer`) share its private state; split into modules they
would reach back into one another's records. The checker imports its private names here.

Theory of operation
-------------------
:class:`ConsumerEndpoint` owns nothing but state. The runtime feeds it what happened --
a frame from a Prefill peer (:meth:`~ConsumerEndpoint.receive`), a request whose
destination blocks vLLM allocated (:meth:`~ConsumerEndpoint.add_request`), the end of a
data read (:meth:`~ConsumerEndpoint.read_finished`), an abort or a release from vLLM, the
passing of time (:meth:`~ConsumerEndpoint.handle_timer`) -- always with ``now``
(monotonic seconds), and executes the outputs it gets back, in order: :class:`Reply` and
:class:`SendAbort` go on the wire, :class:`StartRead` goes to a read worker,
:class:`RequestDone` / :class:`RequestFailed` feed the cross-rank completion
(:mod:`rd2h_protocol.completion`), :class:`Releasable` lets vLLM free the blocks.
Nothing here raises for peer input: bad frames and messages are counted in
:attr:`~ConsumerEndpoint.stats` and answered when they can be identified.

Serving one readiness (reference §2, departures 1, 4, 6, 11):

1. The peer must be bound to a session by MF_META (else ``UNKNOWN_SESSION``; a refused
   session gets its refusal code). The layer is identified by NAME (reference §5):
   ``layer_name`` must be one of this rank's layers and of the session's layout, and
   ``layer_idx`` must be the index v1 peers derive from that name
   (:func:`~rd2h_protocol.topology.wire_layer_index`, else ``LAYOUT_MISMATCH`` naming
   both); the layout must match the destination
   (:func:`~rd2h_protocol.wire.layout.validate_layer`). A failure here
   fails the WHOLE layer, ``read_failed``, before any byte moves (never a partial write),
   and every known request the message names fails with it.
2. Requests this rank does not know yet (the rendezvous outran the worker) park the
   message, bounded in count and time; requests retired recently (released, aborted) are
   not waited for.
3. The lease (v2): a read is never STARTED once less than half of ``lease_ms`` is left
   since the message arrived; the message is refused ``LEASE_EXPIRED`` instead.
4. Per request: unknown (after parking), no longer waiting, inconsistent ``tp_ratio``,
   destination range that does not fit, or Prefill block ids outside the layout's
   ``num_blocks``: the request is *isolated* -- left out of the read, failed on this rank,
   and (v2 with the ``isolate`` capability) listed in the reply's ``failed``. Every other
   request contributes its share: the main blocks only from ``group_member_idx`` 0,
   split over the Decode TP ranks with :func:`~rd2h_protocol.topology.main_share` when
   the ranks share one main pool (``main_shared``), else all of them on every rank (each
   rank's own KV cache, e.g. vLLM's); the
   indexer (and its scale) split over the contributors with
   :func:`~rd2h_protocol.topology.indexer_share`.
5. ONE :class:`~rd2h_protocol.plan.ReadPlan` per message (``StartRead``), or, when this
   rank has nothing to read, ``read_done`` at once. A whole-entry share is not copied:
   the plan holds the message's own ids (tuples decoded once per engine step, as every
   layer carries the same entries; see ``_decode_bounded``) and the request's own
   destination ids (a tuple, or a range when contiguous), so the runtime can plan the
   later layers of a step with no per-id work. When the read ends, the reply goes out;
   done signals count (contributor completion) only after a successful read; a failed
   read fails every request of the message. A transient failure is retried
   (``max_read_retries``) while the lease still leaves its margin.

Toward a v1 peer: isolation still applies (the other requests are read), and the reply
is the plain ``read_done`` -- v1 has no per-request failure field, and its Prefill raises
on ``read_failed`` and so fails every request of its batch. The isolated requests fail on
Decode, which owns their completion, so nothing depends on the v1 Prefill learning of
them. ``read_failed`` is kept for what fails the whole layer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, TypeAlias

import msgspec

from rd2h_protocol.completion import EFFECT_IGNORE_DUPLICATE, ContributorSet
from rd2h_protocol.errors import (
    ConfigError,
    ErrorCode,
    LayoutMismatch,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    TransferError,
)
from rd2h_protocol.events import (
    ConnectionView,
    ConsumerOutput,
    Releasable,
    Reply,
    RequestDone,
    RequestFailed,
    SendAbort,
    StartRead,
)
from rd2h_protocol.machines.consumer import (
    CONSUMER_MACHINES,
    DECODE_READINESS,
    DECODE_REQUEST,
    DECODE_SESSION,
    EFFECT_ACCEPT,
    EFFECT_ACK_V1,
    EFFECT_ACK_V2,
    EFFECT_APPLY_ABORT,
    EFFECT_DROP,
    EFFECT_FAIL,
    EFFECT_FAIL_HOLD,
    EFFECT_FAIL_RELEASE,
    EFFECT_ISOLATE,
    EFFECT_PARK,
    EFFECT_PROCESS,
    EFFECT_PROGRESS,
    EFFECT_REFUSE_V1,
    EFFECT_REFUSE_V2,
    EFFECT_RELEASE,
    EFFECT_REPLY_DONE,
    EFFECT_REPLY_FAILED,
    EFFECT_REPLY_REFUSED,
    EFFECT_REPLY_UNKNOWN_SESSION,
    EFFECT_REPORT_DONE,
    EFFECT_SERVE,
    EFFECT_START_READ,
    M_LOCAL_NOTHING_TO_READ,
    M_LOCAL_PARK,
    M_LOCAL_READ_FAILED,
    M_LOCAL_READ_OK,
    M_LOCAL_READ_RETRY,
    M_LOCAL_REFUSE,
    M_LOCAL_START_READ,
    M_LOCAL_UNPARK,
    M_TIMER_PARK_EXPIRED,
    R_LOCAL_ABORT,
    R_LOCAL_ADVERTISE,
    R_LOCAL_ALL_DONE,
    R_LOCAL_FAIL,
    R_LOCAL_QUIESCENT,
    R_LOCAL_READ_OK,
    R_LOCAL_RELEASE,
    R_LOCAL_RELEASE_BUSY,
    R_RECV_ABORT,
    R_RECV_READINESS,
    R_TIMER_LOAD_TIMEOUT,
    REQ_ABORTED,
    REQ_DONE,
    REQ_RECEIVING,
    REQ_RELEASE_PENDING,
    S_RECV_ABORT,
    S_RECV_MF_META_BAD_V1,
    S_RECV_MF_META_BAD_V2,
    S_RECV_MF_META_V1,
    S_RECV_MF_META_V2,
    S_RECV_READINESS,
    SESSION_READY,
    SESSION_UNBOUND,
    SESSION_V1,
    SESSION_V2,
)
from rd2h_protocol.machines.declare import NO_EFFECT, no_effect
from rd2h_protocol.plan import ComponentAddrs, ReadPlan, RequestRead
from rd2h_protocol.topology import indexer_share, main_share, wire_layer_indices
from rd2h_protocol.wire.codec import decode
from rd2h_protocol.wire.layout import (
    DestinationLayout,
    LayerLayout,
    check_destination_range,
    check_source_blocks,
    decode_layer_metadata,
    validate_layer,
)
from rd2h_protocol.wire.messages import (
    ALL_CAPABILITIES,
    CAP_ABORT,
    CAP_ISOLATE,
    CAP_RESEND,
    CAP_SEQ,
    MAX_BLOCKS_PER_REQUEST,
    MAX_FRAME_BYTES,
    MAX_NAME_LEN,
    MAX_REQUESTS_PER_BATCH,
    MAX_TEXT_LEN,
    PROTOCOL_VERSION,
    TAG_ACK_V1,
    TAG_READ_READY_BATCH,
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
    "CONSUMER_MACHINES",
    "ConsumerConfig",
    "ConsumerEndpoint",
    "ConsumerStats",
    "Output",
    "Releasable",
    "Reply",
    "RequestDone",
    "RequestFailed",
    "SendAbort",
    "StartRead",
]

_U32: Final = (1 << 32) - 1
_SEQ_MAX: Final = (1 << 63) - 1
# Room kept in a reply frame for everything but the per-request failure texts.
_REPLY_TEXT_BUDGET: Final = MAX_FRAME_BYTES // 2
# What a session remembers of its recent readiness (by seq: the reply, or None while it is
# being served), to answer a resent one without reading twice: at most this many seqs and
# about this many bytes of replies (a resend older than that is dropped; its lease covers
# it). Prefill resends only what is unanswered, a few storages' worth.
_REMEMBERED_SEQS: Final = 256
_REMEMBERED_BYTES: Final = 1 << 20


# -- configuration -------------------------------------------------------------------------


@dataclass(frozen=True)
class ConsumerConfig:
    """Configuration of one Decode TP rank's endpoint.

    ``layers`` is this rank's ordered list of ``(layer name, destination)``: a readiness
    is served by its layer NAME, and its ``layer_idx`` is checked against that name.
    ``compat`` is compared with a v2
    Prefill's MF_META ``compat`` (when both are set); a mismatch refuses the handshake.
    ``kv_load_timeout_s``: a request waiting for KV with no progress for that long fails.
    ``max_parked`` / ``park_timeout_s`` bound the readiness (and aborts) kept for requests
    not known yet, and so do ``max_parked_ids`` (what they hold, counted in request and
    block ids: 54 bytes each once decoded, measured; the default 2M ids keep about
    110 MB) and ``max_parked_ids_per_session`` (one
    Prefill session's share of it, so that a flood from one peer leaves room for the
    others); a readiness beyond a bound is served at once, its unknown requests failing
    alone. ``max_read_retries``: retries of a batched read that failed with a
    transient error. ``max_retired``: how many recently finished request ids are
    remembered, so a late readiness for them is refused at once instead of parked.
    ``max_sessions``: Prefill sessions kept (the oldest handshake is forgotten first);
    ``max_session_bytes`` bounds the layouts they keep (counted as the bytes of their
    encoded MF_META layouts; the decoded form costs 4.3 times that, measured for a
    4096-layer layout, so the default 64 MiB keeps about 280 MB; a 61-layer layout
    encodes in about 10 KB) and
    ``max_session_bytes_per_peer`` what the sessions one connection opened keep: beyond
    it that connection's oldest sessions are forgotten, nobody else's. A forgotten
    session's Prefill (v2) is told UNKNOWN_SESSION and hand-shakes again.
    ``main_shared``: the main destinations are one pool shared by the Decode TP ranks
    (vllm-ascend's SparseKVOffloadManager, a TP-shared host pool), so each rank reads a
    disjoint share of the main blocks; False when every rank has its own full main KV
    (vLLM's own KV cache), so every rank reads all of them from its contributor member 0.
    """

    d_rank: int
    d_tp: int
    layers: Sequence[tuple[str, DestinationLayout]]
    capabilities: Sequence[str] = ALL_CAPABILITIES
    compat: str | None = None
    kv_load_timeout_s: float = 120.0
    max_parked: int = 1024
    park_timeout_s: float = 10.0
    max_read_retries: int = 1
    max_retired: int = 16384
    max_sessions: int = 4096
    max_session_bytes: int = 64 << 20
    max_session_bytes_per_peer: int = 4 << 20
    max_parked_ids: int = 1 << 21
    max_parked_ids_per_session: int = 1 << 19
    main_shared: bool = True

    def __post_init__(self) -> None:
        if self.d_tp < 1:
            raise ConfigError(f"d_tp must be >= 1, got {self.d_tp}")
        if not 0 <= self.d_rank < self.d_tp:
            raise ConfigError(f"d_rank must lie in [0, {self.d_tp}), got {self.d_rank}")
        names = [name for name, _ in self.layers]
        if len(set(names)) != len(names):
            raise ConfigError("layer names must be unique; got duplicates in `layers`")
        unknown = sorted(set(self.capabilities) - set(ALL_CAPABILITIES))
        if unknown:
            raise ConfigError(
                f"unknown capabilities {unknown}; expected a subset of {list(ALL_CAPABILITIES)}"
            )
        for name in ("kv_load_timeout_s", "park_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "max_parked",
            "max_read_retries",
            "max_retired",
            "max_session_bytes",
            "max_session_bytes_per_peer",
            "max_parked_ids",
            "max_parked_ids_per_session",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_sessions < 1:
            raise ConfigError(f"max_sessions must be >= 1, got {self.max_sessions}")


Output: TypeAlias = ConsumerOutput


@dataclass(slots=True)
class ConsumerStats:
    """Counters of one endpoint (monotonic, for metrics)."""

    handshakes: int = 0
    refused_handshakes: int = 0
    malformed_frames: int = 0
    dropped: int = 0
    unexpected_messages: int = 0
    unknown_session: int = 0
    layer_failures: int = 0
    isolated_requests: int = 0
    parked: int = 0
    park_expired: int = 0
    park_overflow: int = 0
    reads_started: int = 0
    reads_failed: int = 0
    read_retries: int = 0
    expired_leases: int = 0
    aborts_sent: int = 0
    aborts_received: int = 0
    load_timeouts: int = 0
    duplicate_done: int = 0
    lost_readiness: int = 0  # seq gaps: readiness that never arrived
    repeated_readiness: int = 0  # a seq seen before (resent or duplicated): never re-read
    replies_resent: int = 0  # ...answered again from memory
    requests_done: int = 0
    requests_failed: int = 0
    protocol_errors: int = 0
    sessions_forgotten: int = 0  # beyond max_sessions or a byte budget
    park_budget_refusals: int = 0  # beyond max_parked_ids(_per_session)


# -- internal records ----------------------------------------------------------------------


class _Session:
    __slots__ = (
        "caps",
        "id_bound",
        "layers",
        "layout_bytes",
        "name",
        "next_seq",
        "origin",
        "peer",
        "refusal",
        "remembered",
        "remembered_bytes",
        "state",
        "validated",
    )

    def __init__(self, name: str, origin: bytes) -> None:
        self.name = name
        self.state = SESSION_UNBOUND
        self.peer: bytes | None = None
        self.origin = origin  # the connection that opened it (its budget pays for it)
        self.layout_bytes = 0  # its encoded layout's size (see max_session_bytes)
        self.caps: frozenset[str] = frozenset()
        self.layers: dict[str, LayerLayout] = {}
        # Every Prefill block id of the layout lies below this (None: a layout without
        # num_blocks, which cannot be checked); see _decode_bounded.
        self.id_bound: int | None = None
        self.refusal: tuple[ErrorCode, str] = (ErrorCode.UNKNOWN, "")
        # The seq the next v2 readiness must carry (None: not known yet).
        self.next_seq: int | None = None
        # seq -> the reply it got, or None while it is served (see _REMEMBERED_SEQS).
        self.remembered: OrderedDict[int, ReadDone | ReadFailed | None] = OrderedDict()
        self.remembered_bytes = 0
        # (layer_idx, layer_name) -> validated components, or the mismatch.
        self.validated: dict[
            tuple[int, str],
            tuple[tuple[ComponentAddrs, ...], tuple[ComponentAddrs, ...]] | LayoutMismatch,
        ] = {}


class _Request:
    __slots__ = (
        "contributors",
        "ext_id",
        "fail_code",
        "fail_message",
        "in_flight",
        "indexer_ids",
        "main_ids",
        "sessions",
        "state",
    )

    def __init__(self, ext_id: str, main_ids: Sequence[int], indexer_ids: Sequence[int]) -> None:
        self.ext_id = ext_id
        self.state = DECODE_REQUEST.initial
        self.main_ids = main_ids
        self.indexer_ids = indexer_ids
        self.in_flight = 0  # reads in flight that write this request's blocks
        self.contributors: ContributorSet | None = None
        self.sessions: set[str] = set()  # Prefill sessions that published for it
        self.fail_code = ErrorCode.UNKNOWN
        self.fail_message = ""


class _Readiness:
    __slots__ = (
        "accepted",
        "caps",
        "deadline",
        "finish_by",
        "ids_below",
        "in_plan",
        "isolated",
        "missing",
        "msg",
        "park_id",
        "peer",
        "plan",
        "receipt",
        "retries_left",
        "session",
        "start_by",
        "state",
    )

    def __init__(
        self,
        peer: bytes,
        session: str,
        msg: ReadReadyBatch,
        now: float,
        ids_below: int | None = None,
    ) -> None:
        self.peer = peer
        self.session = session
        self.msg = msg
        # Every Prefill block id of ``msg`` is below this (proven while decoding), or None.
        self.ids_below = ids_below
        self.receipt = now
        self.state = DECODE_READINESS.initial
        self.start_by = None if msg.lease_ms is None else now + msg.lease_ms / 2000.0
        self.finish_by = None if msg.lease_ms is None else now + msg.lease_ms / 1000.0
        self.caps: frozenset[str] = frozenset()
        self.missing: set[str] = set()
        self.deadline = 0.0
        self.park_id = 0
        self.accepted: list[_Request] = []
        self.in_plan: list[_Request] = []
        self.isolated: list[FailedRequest] = []
        self.plan: ReadPlan | None = None
        self.retries_left = 0


class _ParkedAbort:
    __slots__ = ("cost", "deadline", "missing", "park_id", "reason", "session")

    def __init__(self, session: str, missing: set[str], reason: str, deadline: float) -> None:
        self.session = session
        self.missing = missing
        self.cost = len(missing)  # fixed: ``missing`` shrinks while it is parked
        self.reason = reason
        self.deadline = deadline
        self.park_id = 0


_Parked: TypeAlias = _Readiness | _ParkedAbort


def _explain(mismatch: LayoutMismatch, tp_ratio: int) -> str:
    """A layout mismatch's message, with the likely cause when block sizes differ by
    exactly the TP ratio: the KV heads are split over the Prefill ranks."""
    prefill, decode = mismatch.prefill, mismatch.decode
    if (
        tp_ratio > 1
        and isinstance(prefill, int)
        and isinstance(decode, int)
        and prefill * tp_ratio == decode
    ):
        return (
            f"{mismatch.message} (each of the {tp_ratio} Prefill TP ranks per Decode rank "
            "holds a share of the KV heads; RD2H needs the whole KV on every Prefill rank, "
            "as with MLA, or equal Prefill and Decode TP)"
        )
    return mismatch.message


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT_LEN else text[: MAX_TEXT_LEN - 3] + "..."


def _park_cost(item: _Readiness | _ParkedAbort) -> int:
    """What a parked item holds, in ids: its request ids and, for a readiness, every
    block id of its entries (fixed while parked: ``missing`` only shrinks, and the
    message never changes)."""
    if isinstance(item, _ParkedAbort):
        return item.cost
    msg = item.msg
    return len(msg.done_ext_ids) + sum(
        1 + len(r.main_block_ids) + len(r.indexer_block_ids or ()) for r in msg.read_reqs
    )


def _reply_size(reply: ReadDone | ReadFailed) -> int:
    """About what a remembered reply costs in bytes (its texts and ids dominate)."""
    if isinstance(reply, ReadFailed):
        return 64 + len(reply.error or "")
    return 64 + sum(64 + len(f.ext_req_id) + len(f.message or "") for f in reply.failed or ())


def _unique(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))


def _message_ids(msg: ReadReadyBatch) -> list[str]:
    """Every request id a readiness names: its entries, then its done ids."""
    return _unique([*(rr.ext_req_id for rr in msg.read_reqs), *msg.done_ext_ids])


def _check_source(layer: str, component: str, ids: Sequence[int], num_blocks: int | None) -> None:
    """Prefill block ids must lie in ``[0, num_blocks)`` when the layout says ``num_blocks``."""
    if num_blocks is not None and ids and max(ids) >= num_blocks:  # max(): no per-id Python
        check_source_blocks(layer, component, ids, num_blocks)


def _frozen_ids(ids: Sequence[int]) -> Sequence[int]:
    """A request's destination ids, kept immutable: a ``range`` when they are contiguous
    (plans then carry no per-id data for them), else a tuple (a whole-tuple slice is the
    tuple itself, so plans share it instead of copying)."""
    if isinstance(ids, range) and ids.step == 1:
        return ids
    held = tuple(ids)
    n = len(held)
    if n > 1 and isinstance(held[0], int) and isinstance(held[-1], int):
        first = held[0]
        if held[-1] - first == n - 1 and held == tuple(range(first, first + n)):
            return range(first, first + n)
    return held


def _part(ids: Sequence[int], start: int, end: int) -> Sequence[int]:
    """``ids[start:end]``, without a copy when that is all of ``ids``."""
    return ids if start == 0 and end == len(ids) else ids[start:end]


def _id_bound(layers: Mapping[str, LayerLayout]) -> int | None:
    """The smallest ``num_blocks`` of a Prefill layout; None if a layer does not say it."""
    bound: int | None = None
    for layout in layers.values():
        if layout.num_blocks is None:
            return None
        bound = layout.num_blocks if bound is None else min(bound, layout.num_blocks)
    return bound


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
        super().__post_init__()
        if self.indexer_block_ids == self.main_block_ids:
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
_NAME_DECODER: Final = msgspec.msgpack.Decoder(
    Annotated[str, msgspec.Meta(max_length=MAX_NAME_LEN)]
)


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
    ids += _raw_names(fields.done_ext_ids, _NAME_DECODER.decode)
    return layer_idx, seq, _unique(ids)


# -- the endpoint --------------------------------------------------------------------------


class ConsumerEndpoint:
    """One Decode TP rank's protocol state (sans-IO). See the module docstring.

    Every input method takes ``now`` (monotonic seconds, never decreasing) and returns the
    list of outputs to execute in order.
    """

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        self.stats = ConsumerStats()
        self._layers: tuple[tuple[str, DestinationLayout], ...] = tuple(config.layers)
        # name -> (the layer_idx a readiness for it must carry, destination)
        self._by_name: dict[str, tuple[int, DestinationLayout]] = {
            name: (index, dst)
            for (name, dst), index in zip(
                self._layers, wire_layer_indices([n for n, _ in self._layers]), strict=True
            )
        }
        self._caps = frozenset(config.capabilities)
        self._main_limit, self._indexer_limit = self._destination_limits(self._layers)
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._peers: dict[bytes, str] = {}
        self._requests: dict[str, _Request] = {}
        # Load deadlines of active requests, in the order they were set (= deadline order).
        self._deadlines: OrderedDict[str, float] = OrderedDict()
        self._reads: dict[int, _Readiness] = {}
        self._parked: dict[int, _Parked] = {}
        self._parked_ids = 0  # what the parked items hold, in ids (see max_parked_ids)
        self._parked_ids_by_session: dict[str, int] = {}
        self._session_bytes = 0  # encoded layout bytes of the sessions kept
        self._session_bytes_by_origin: dict[bytes, int] = {}
        self._waiting: dict[str, set[int]] = {}  # unknown request id -> parked ids
        self._retired: OrderedDict[str, None] = OrderedDict()
        self._next_read_id = 1
        self._next_park_id = 1
        self._out: list[Output] = []
        self._aborts: dict[str, tuple[list[str], str]] = {}
        # session -> (bytes, decoded entries) of its last readiness entries
        self._entry_cache: OrderedDict[str, tuple[bytes, list[ReadReq]]] = OrderedDict()

    @staticmethod
    def _destination_limits(
        layers: Sequence[tuple[str, DestinationLayout]],
    ) -> tuple[int | None, int | None]:
        """The block-id bounds a request's destination ids must respect on every layer."""
        main = [c.num_blocks for _, d in layers for c in d.main]
        idx = [c.num_blocks for _, d in layers for c in (d.indexer, d.scale) if c is not None]
        return (min(main) if main else None), (min(idx) if idx else None)

    # -- views (for invariant checks and metrics) ------------------------------------------

    def requests(self) -> dict[str, str]:
        """``{external request id: state}`` of every request this rank holds."""
        return {ext: req.state for ext, req in self._requests.items()}

    def in_flight_reads(self) -> dict[int, tuple[str, ...]]:
        """``{read_id: request ids whose blocks the read writes}`` of every read in flight."""
        return {rid: tuple(r.ext_id for r in rd.in_plan) for rid, rd in self._reads.items()}

    def parked(self) -> dict[int, tuple[str, ...]]:
        """``{park id: request ids still awaited}`` of every parked readiness or abort."""
        return {pid: tuple(sorted(p.missing)) for pid, p in self._parked.items()}

    def sessions(self) -> dict[str, str]:
        """``{Prefill session: state}``."""
        return {name: s.state for name, s in self._sessions.items()}

    def negotiated(self, peer: bytes) -> ConnectionView | None:
        """The protocol and capabilities of the session ``peer`` is bound to (None: none)."""
        session = self._session_of(peer)
        if session is None:
            return None
        return ConnectionView.of(
            session.name, session.state, session.caps, v2_state=SESSION_V2, v1_state=SESSION_V1
        )

    def session_of_peer(self, peer: bytes) -> str | None:
        """The name of the Prefill session ``peer`` hand-shook for, if any (for logs)."""
        session = self._session_of(peer)
        return None if session is None else session.name

    def in_flight_count(self, ext_req_id: str) -> int:
        """Reads in flight that write ``ext_req_id``'s blocks (0 for an unknown request)."""
        req = self._requests.get(ext_req_id)
        return 0 if req is None else req.in_flight

    def is_idle(self) -> bool:
        """Whether no per-request state is left (requests, reads, parked messages)."""
        return not (self._requests or self._reads or self._parked or self._deadlines)

    # -- timers ----------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """The earliest deadline, or ``None`` when nothing waits on time."""
        times = [p.deadline for p in self._parked.values()]
        if self._deadlines:
            times.append(next(iter(self._deadlines.values())))
        return min(times) if times else None

    def handle_timer(self, now: float) -> list[Output]:
        """Handle every deadline at or before ``now``.

        Parked readiness past its bound is served with its still-unknown requests
        isolated (or refused, past its lease); a request with no progress for
        ``kv_load_timeout_s`` fails with ``TIMEOUT`` and its v2 peers get ABORT.
        """
        # Serving one expired item never unparks another (only add/retire do), so the
        # list taken up front stays valid.
        for item in [p for p in self._parked.values() if p.deadline <= now]:
            self._unpark(item)
            self.stats.park_expired += 1
            if isinstance(item, _Readiness):
                _READINESS.fire(self, item, M_TIMER_PARK_EXPIRED, now)
        while self._deadlines:
            ext, deadline = next(iter(self._deadlines.items()))
            if deadline > now:
                break
            req = self._requests[ext]
            self.stats.load_timeouts += 1
            self._request_event(
                req,
                R_TIMER_LOAD_TIMEOUT,
                now,
                ErrorCode.TIMEOUT,
                f"no KV progress for {self.config.kv_load_timeout_s} s",
            )
        return self._flush()

    # -- local inputs ----------------------------------------------------------------------

    def add_request(
        self,
        ext_req_id: str,
        main_block_ids: Sequence[int],
        indexer_block_ids: Sequence[int],
        now: float,
        *,
        advertised: bool = True,
    ) -> list[Output]:
        """Register a request's destination block ids (logical order) on this rank.

        ``advertised``: the rendezvous was posted already (the usual case); otherwise
        call :meth:`advertise` later. Readiness parked for the request is served now.
        Raises :class:`LocalProtocolError` for an id already held or a block id outside
        the destination layout.
        """
        if ext_req_id in self._requests:
            raise LocalProtocolError(f"request {ext_req_id!r} is already registered")
        main, idx = _frozen_ids(main_block_ids), _frozen_ids(indexer_block_ids)
        if idx == main:
            idx = main  # one object: the planner unboxes shared ids once per read
        limits = (("main", main, self._main_limit), ("indexer", idx, self._indexer_limit))
        for what, ids, limit in limits:
            if ids and (min(ids) < 0 or (limit is not None and max(ids) >= limit)):
                raise LocalProtocolError(
                    f"request {ext_req_id!r}: {what} destination block ids must lie in "
                    f"[0, {limit}), got {min(ids)}..{max(ids)}",
                    ErrorCode.DESTINATION_RANGE,
                )
        self._retired.pop(ext_req_id, None)
        req = _Request(ext_req_id, main, idx)
        self._requests[ext_req_id] = req
        self._touch(req, now)
        if advertised:
            self._request_event(req, R_LOCAL_ADVERTISE, now)
        self._resolve_waiting(ext_req_id, now)
        return self._flush()

    def advertise(self, ext_req_id: str, now: float) -> list[Output]:
        """The request's rendezvous was posted (for ``add_request(advertised=False)``)."""
        req = self._known(ext_req_id)
        self._request_event(req, R_LOCAL_ADVERTISE, now)
        self._touch(req, now)
        return self._flush()

    def abort(self, ext_ids: Iterable[str], reason: str, now: float) -> list[Output]:
        """Abort requests locally: each fails (``ABORTED``) and its v2 peers get ABORT.

        Ids this rank does not hold are remembered as retired, so readiness for them is
        refused instead of parked.
        """
        for ext in _unique(ext_ids):
            req = self._requests.get(ext)
            if req is None:
                self._retire(ext, now)
            else:
                self._request_event(req, R_LOCAL_ABORT, now, ErrorCode.ABORTED, reason)
        return self._flush()

    def release(self, ext_req_id: str, now: float) -> list[Output]:
        """vLLM finished the request (``request_finished``).

        The blocks may be freed now if and only if the returned outputs contain
        ``Releasable(ext_req_id)``; otherwise a read may still write them, and a later
        output (from :meth:`read_finished`) says when. A request released before its KV
        arrived ends as aborted (``RequestFailed`` + ABORT to its v2 peers).
        """
        req = self._requests.get(ext_req_id)
        if req is None:
            self._retire(ext_req_id, now)
            self._out.append(Releasable(ext_req_id))
        else:
            event = R_LOCAL_RELEASE if req.in_flight == 0 else R_LOCAL_RELEASE_BUSY
            self._request_event(
                req, event, now, ErrorCode.ABORTED, "released by vLLM before its KV arrived"
            )
        return self._flush()

    def read_finished(self, read_id: int, error: TransferError | None, now: float) -> list[Output]:
        """A :class:`StartRead` ended: ``error`` is ``None`` on success.

        Raises :class:`LocalProtocolError` for a ``read_id`` not in flight.
        """
        rd = self._reads.pop(read_id, None)
        if rd is None:
            raise LocalProtocolError(f"read {read_id} is not in flight")
        if error is None:
            self._read_succeeded(rd, now)
        elif self._may_retry(rd, error, now):
            self._retry(rd, now)
        else:
            self._read_failed(rd, error, now)
        return self._flush()

    # -- peer input ------------------------------------------------------------------------

    def receive(
        self, peer: bytes, frame: Message | bytes | bytearray | memoryview, now: float
    ) -> list[Output]:
        """Handle one frame (or decoded message) from Prefill peer ``peer``; never raises.

        A frame that does not decode is counted; if it is a readiness whose ``layer_idx``
        (and ``seq``, when present) can be read, it still gets a failure reply and the
        known requests it names fail, so no Prefill gate waits for it.
        """
        if not isinstance(frame, bytes | bytearray | memoryview):
            return self._receive(peer, frame, now, None)
        bounded = self._decode_bounded(peer, frame)
        if bounded is not None:
            readiness, ids_below = bounded
            return self._receive(peer, readiness, now, ids_below)
        try:
            msg = decode(frame)
        except RemoteProtocolError as exc:
            self.stats.malformed_frames += 1
            ident = _identify_readiness(frame)
            if ident is None:
                self.stats.dropped += 1
                return []
            layer_idx, seq, ids = ident
            self.stats.layer_failures += 1
            self._out.append(
                Reply(peer, self._failure_reply(layer_idx, seq, exc.code, exc.message))
            )
            self._fail_known(ids, now, exc.code, f"malformed readiness: {exc.message}")
            return self._flush()
        return self._receive(peer, msg, now, None)

    def _decode_bounded(
        self, peer: bytes, frame: bytes | bytearray | memoryview
    ) -> tuple[ReadReadyBatch, int] | None:
        """A readiness from a bound session, decoded with its Prefill block id bound checked
        (the layout's smallest ``num_blocks``; without one, the wire's own limit, which is
        exactly the codec's check), and the bound; None to take the general path.

        None covers every frame this cannot vouch for: not a readiness as encoders write
        it, no session, too big, malformed, or ANY id at or past the bound. The
        general path then decodes it again and finds the offending requests one by one
        (isolating them), so an out-of-range id costs a second decode, never a guarantee.

        Every layer of an engine step carries the same entries, byte for byte; only the
        layer, ``seq`` and done ids differ. So the session's last entries are kept with
        their bytes: when the same bytes stand at the entries' place (msgpack values
        delimit themselves, so equal bytes there are the same value), the frame is decoded
        with an empty array in their place and given the kept entries, which were decoded
        and bound-checked already; the ids are decoded once per step, not per layer.
        """
        session = self._session_of(peer)
        if (
            session is None
            or not len(_READINESS_HEAD) < len(frame) <= MAX_FRAME_BYTES
            or not 0x91 <= frame[0] <= 0x9F
            or frame[1 : 1 + len(_READINESS_HEAD)] != _READINESS_HEAD
        ):
            return None
        # A layout without num_blocks (a v1 Prefill) bounds nothing beyond the wire's own
        # block id type: the ids are decoded with exactly the codec's check, so the frame
        # gets the same verdict as on the general path, and the immutable entries the
        # planner caches per step.
        bound = _WIRE_ID_LIMIT if session.id_bound is None else session.id_bound
        # Kept entries were checked against this bound: a handshake drops them.
        cached = self._entry_cache.get(session.name)
        try:
            if cached is not None:
                raw, entries = cached
                at = _entries_offset(frame)
                # (bytes.startswith: a memcmp; comparing memoryviews goes item by item)
                if at is not None and bytes(frame).startswith(raw, at):
                    self._entry_cache.move_to_end(session.name)
                    rest = b"".join((frame[:at], _EMPTY_ARRAY, frame[at + len(raw) :]))
                    return _with_entries(_SHELL_DECODER.decode(rest), entries), bound
            shell = _SHELL_DECODER.decode(frame)
            entries = _bounded_entries(bound).decode(shell.read_reqs)
        except Exception:  # out of bound or malformed: the general path judges it
            return None
        self._entry_cache[session.name] = (bytes(shell.read_reqs), entries)
        self._entry_cache.move_to_end(session.name)
        while len(self._entry_cache) > _ENTRY_CACHE_SESSIONS:
            self._entry_cache.popitem(last=False)
        return _with_entries(shell, entries), bound

    def _receive(
        self, peer: bytes, msg: Message, now: float, ids_below: int | None
    ) -> list[Output]:
        try:
            if isinstance(msg, ReadReadyBatch):
                self._on_readiness(peer, msg, now, ids_below)
            elif isinstance(msg, MfMeta):
                self._on_mf_meta(peer, msg)
            elif isinstance(msg, Abort):
                self._on_abort(peer, msg, now)
            else:
                self.stats.unexpected_messages += 1
        except ProtocolError:
            # Input that no table allows (none does today: the session table has a row for
            # every input in every state). As h2 closes a stream on a protocol error, that
            # peer's session is closed: nothing half-done of it stays bound, and its Prefill
            # learns UNKNOWN_SESSION on its next readiness and hand-shakes again (a v1 one
            # gets a read_failed). The runtime logs the peer with the count.
            self.stats.protocol_errors += 1
            name = self._peers.get(peer)
            if name is not None and name in self._sessions:
                self._forget_session(name)
        return self._flush()

    # -- handshake -------------------------------------------------------------------------

    def _on_mf_meta(self, peer: bytes, msg: MfMeta) -> None:
        v2 = msg.protocol_version is not None and msg.protocol_version >= 2
        error: tuple[ErrorCode, str] | None = None
        layers: dict[str, LayerLayout] = {}
        try:
            layers = decode_layer_metadata(msg.encoded_layer_metadata)
        except RemoteProtocolError as exc:
            error = (exc.code, f"layer metadata refused: {exc.message}")
        ours = self.config.compat
        if error is None and v2 and ours is not None and msg.compat not in (None, ours):
            error = (
                ErrorCode.INCOMPATIBLE,
                f"compat mismatch: Prefill has {msg.compat!r}, Decode has {ours!r}",
            )
        if error is None:
            event = S_RECV_MF_META_V2 if v2 else S_RECV_MF_META_V1
        else:
            event = S_RECV_MF_META_BAD_V2 if v2 else S_RECV_MF_META_BAD_V1
        session = self._bind(peer, msg.p_session)
        _SESSION.fire(self, session, event, peer, msg, layers, error, error=RemoteProtocolError)

    # The session machine's MF_META effects: (session, peer, msg, layers, refusal).

    def _install_handshake(
        self, session: _Session, msg: MfMeta, layers: dict[str, LayerLayout]
    ) -> None:
        """A new MF_META replaces the session's previous handshake, refused or not."""
        v2 = msg.protocol_version is not None and msg.protocol_version >= 2
        session.validated = {}
        session.layers = layers
        session.id_bound = _id_bound(layers)
        self._entry_cache.pop(session.name, None)
        self._account_layout(session, len(msg.encoded_layer_metadata) if layers else 0)
        self._enforce_session_budgets(session)
        session.caps = frozenset(msg.capabilities or ()) & self._caps if v2 else frozenset()
        session.next_seq = msg.first_seq if v2 else None

    def _fx_ack_v1(
        self,
        session: _Session,
        peer: bytes,
        msg: MfMeta,
        layers: dict[str, LayerLayout],
        _refusal: None,
    ) -> None:
        self._install_handshake(session, msg, layers)
        self.stats.handshakes += 1
        self._out.append(Reply(peer, Ack(kind=TAG_ACK_V1)))

    def _fx_ack_v2(
        self,
        session: _Session,
        peer: bytes,
        msg: MfMeta,
        layers: dict[str, LayerLayout],
        _refusal: None,
    ) -> None:
        self._install_handshake(session, msg, layers)
        self.stats.handshakes += 1
        self._out.append(Reply(peer, self._ack()))

    def _fx_refuse_v1(
        self,
        session: _Session,
        peer: bytes,
        msg: MfMeta,
        layers: dict[str, LayerLayout],
        refusal: tuple[ErrorCode, str],
    ) -> None:
        """Refused; a v1 peer has no refusal shape: nothing is said."""
        self._install_handshake(session, msg, layers)
        session.refusal = refusal
        self.stats.refused_handshakes += 1

    def _fx_refuse_v2(
        self,
        session: _Session,
        peer: bytes,
        msg: MfMeta,
        layers: dict[str, LayerLayout],
        refusal: tuple[ErrorCode, str],
    ) -> None:
        """Refused: the Ack says why."""
        self._fx_refuse_v1(session, peer, msg, layers, refusal)
        code, text = refusal
        self._out.append(Reply(peer, self._ack(error_code=int(code), error=_clip(text))))

    def _ack(self, error_code: int | None = None, error: str | None = None) -> Ack:
        caps: list[str] = [c for c in ALL_CAPABILITIES if c in self._caps]
        return Ack(
            protocol_version=PROTOCOL_VERSION, capabilities=caps, error_code=error_code, error=error
        )

    def _bind(self, peer: bytes, name: str) -> _Session:
        """The session ``name``, now reached through ``peer`` (created if new)."""
        session = self._sessions.get(name)
        if session is None:
            session = _Session(name, peer)
            self._sessions[name] = session
            while len(self._sessions) > self.config.max_sessions:
                self._forget_session(next(iter(self._sessions)))
        else:
            self._sessions.move_to_end(name)
        # Invariant: every (peer -> name) in _peers has sessions[name].peer == peer.
        previous = self._peers.get(peer)
        if previous is not None and previous != name:
            self._sessions[previous].peer = None
        if session.peer is not None and session.peer != peer:
            self._peers.pop(session.peer, None)
        session.peer = peer
        self._peers[peer] = name
        return session

    def _forget_session(self, name: str) -> None:
        """Drop session ``name`` and what it keeps; its Prefill learns UNKNOWN_SESSION."""
        old = self._sessions.pop(name)
        if old.peer is not None:
            self._peers.pop(old.peer, None)
        self._entry_cache.pop(name, None)
        self._account_layout(old, 0)
        self.stats.sessions_forgotten += 1

    def _account_layout(self, session: _Session, size: int) -> None:
        """Set what ``session``'s layout counts against the session byte budgets."""
        delta = size - session.layout_bytes
        session.layout_bytes = size
        self._session_bytes += delta
        left = self._session_bytes_by_origin.get(session.origin, 0) + delta
        if left:
            self._session_bytes_by_origin[session.origin] = left
        else:
            self._session_bytes_by_origin.pop(session.origin, None)

    def _enforce_session_budgets(self, keep: _Session) -> None:
        """Forget the oldest sessions beyond the byte budgets, never ``keep``: first those
        ``keep``'s connection opened (its budget), then anyone's (the total)."""
        origin = keep.origin
        if self._session_bytes_by_origin.get(origin, 0) > self.config.max_session_bytes_per_peer:
            for name in [n for n, s in self._sessions.items() if s.origin == origin]:
                if (
                    name == keep.name
                    or self._session_bytes_by_origin.get(origin, 0)
                    <= self.config.max_session_bytes_per_peer
                ):
                    break
                self._forget_session(name)
        while self._session_bytes > self.config.max_session_bytes:
            oldest = next(iter(self._sessions))
            if oldest == keep.name:
                break
            self._forget_session(oldest)

    def _session_of(self, peer: bytes) -> _Session | None:
        name = self._peers.get(peer)
        return None if name is None else self._sessions.get(name)

    # -- abort from Prefill ----------------------------------------------------------------

    def _on_abort(self, peer: bytes, msg: Abort, now: float) -> None:
        session = self._session_of(peer)
        state = SESSION_UNBOUND if session is None else session.state
        _SESSION.react(self, session, state, S_RECV_ABORT, msg, now, error=RemoteProtocolError)

    def _fx_drop(self, _session: _Session | None, _msg: Abort, _now: float) -> None:
        """An ABORT from a peer with no usable session: count it."""
        self.stats.dropped += 1

    def _fx_apply_abort(self, session: _Session, msg: Abort, now: float) -> None:
        """Fail the requests an ABORT names; park it for those not known yet."""
        self.stats.aborts_received += 1
        reason = f"aborted by Prefill: {msg.reason}" if msg.reason else "aborted by Prefill"
        missing: set[str] = set()
        for ext in _unique(msg.ext_ids):
            req = self._requests.get(ext)
            if req is not None:
                self._request_event(
                    req, R_RECV_ABORT, now, ErrorCode.ABORTED, reason, exclude=session.name
                )
            elif ext not in self._retired:
                missing.add(ext)
        if missing:
            # The abort outran the worker too: apply it when the request arrives.
            parked = _ParkedAbort(session.name, missing, reason, now + self.config.park_timeout_s)
            if not self._park(parked):
                self.stats.dropped += 1

    # -- readiness -------------------------------------------------------------------------

    def _on_readiness(
        self, peer: bytes, msg: ReadReadyBatch, now: float, ids_below: int | None
    ) -> None:
        session = self._session_of(peer)
        state = SESSION_UNBOUND if session is None else session.state
        rd = _Readiness(peer, "" if session is None else session.name, msg, now, ids_below)
        _SESSION.react(self, session, state, S_RECV_READINESS, rd, now, error=RemoteProtocolError)

    # The session machine's RECV_READINESS effects: (session, rd, now).

    def _fx_reply_unknown_session(self, _session: None, rd: _Readiness, now: float) -> None:
        self.stats.unknown_session += 1
        # A v2 Prefill (seq present) re-handshakes and replays this message once, so
        # its requests stay alive; a v1 one never replays, so they cannot complete.
        self._refuse(
            rd,
            now,
            ErrorCode.UNKNOWN_SESSION,
            "no MF_META handshake on this connection",
            fail_known=rd.msg.seq is None,
        )

    def _fx_reply_refused(self, session: _Session, rd: _Readiness, now: float) -> None:
        code, text = session.refusal
        self._refuse(rd, now, code, f"handshake refused: {text}")

    def _fx_serve(self, session: _Session, rd: _Readiness, now: float) -> None:
        """Serve the readiness: a repeated seq from memory, a seq gap refused, else read."""
        msg = rd.msg
        if msg.seq is not None and CAP_SEQ in session.caps:
            if CAP_RESEND in session.caps:
                if self._repeated(rd, session):
                    return
                self._remember(session, msg.seq, None)
            if self._lost_before(session, msg):
                self._refuse_after_loss(rd, session, now)
                return
        self._serve(rd, now, allow_park=True)

    def _repeated(self, rd: _Readiness, session: _Session) -> bool:
        """Whether ``rd`` carries a seq this session sent before (resent after a broken
        connection came back, or duplicated): then it is answered again from memory, or
        not at all while its read runs (that read's reply answers both), and never read
        twice, since the request may have moved on and its blocks with it."""
        seq = rd.msg.seq
        assert seq is not None
        if session.next_seq is None or seq >= session.next_seq:
            return False
        self.stats.repeated_readiness += 1
        reply = session.remembered.get(seq)
        if reply is not None:
            self.stats.replies_resent += 1
            # (the layer as asked: a seq lost in a gap is remembered before its layer is known)
            self._out.append(
                Reply(rd.peer, msgspec.structs.replace(reply, layer_idx=rd.msg.layer_idx))
            )
        return True

    @staticmethod
    def _remember(session: _Session, seq: int, reply: ReadDone | ReadFailed | None) -> None:
        """Record ``seq``'s reply (None: being served), within the session's bounds."""
        remembered = session.remembered
        old = remembered.get(seq)
        if old is not None:
            session.remembered_bytes -= _reply_size(old)
        remembered[seq] = reply
        if reply is not None:
            session.remembered_bytes += _reply_size(reply)
        while remembered and (
            len(remembered) > _REMEMBERED_SEQS or session.remembered_bytes > _REMEMBERED_BYTES
        ):
            _, evicted = remembered.popitem(last=False)
            if evicted is not None:
                session.remembered_bytes -= _reply_size(evicted)

    @staticmethod
    def _lost_before(session: _Session, msg: ReadReadyBatch) -> bool:
        """Whether readiness was lost before ``msg`` on this session (a seq gap); else
        advance the expected seq. A v2 Prefill numbers readiness consecutively per
        connection and says in MF_META where it resumes, and a connection delivers in
        order, so a seq above the expected one means the ones between never arrived."""
        assert msg.seq is not None
        expected = session.next_seq
        if expected is not None and msg.seq > expected:
            return True
        if expected is None or msg.seq >= expected:
            session.next_seq = msg.seq + 1
        return False

    def _refuse_after_loss(self, rd: _Readiness, session: _Session, now: float) -> None:
        """Readiness was lost on a live connection (ZMQ drops queued frames at a high-water
        mark or a reconnect): any request it carried would miss that layer. Fail every
        request this session has contributed to and every request the message names.
        The lost message's own storage reopens on Prefill when its lease expires or, toward
        a Prefill with ``resend``, when the lost seq comes again and gets this failure."""
        msg = rd.msg
        assert msg.seq is not None and session.next_seq is not None
        text = (
            f"readiness seq {session.next_seq}..{msg.seq - 1} from Prefill session "
            f"{session.name!r} never arrived: a layer of its requests is missing"
        )
        if CAP_RESEND in session.caps:
            # A lost seq that comes after all (resent, or late from a broken connection) is
            # answered with this failure, never read: its requests failed here already.
            for seq in range(max(session.next_seq, msg.seq - _REMEMBERED_SEQS), msg.seq):
                reply = self._failure_reply(0, seq, ErrorCode.READINESS_LOST, text)
                self._remember(session, seq, reply)
        session.next_seq = msg.seq + 1
        self.stats.lost_readiness += 1
        carried = [ext for ext, req in self._requests.items() if session.name in req.sessions]
        self._fail_known(carried, now, ErrorCode.READINESS_LOST, text)
        self._refuse(rd, now, ErrorCode.READINESS_LOST, text)

    def _serve(self, rd: _Readiness, now: float, *, allow_park: bool) -> None:
        """Serve one readiness (received, or leaving the park)."""
        msg = rd.msg
        session = self._sessions.get(rd.session)
        if session is None:  # only after parking: the session was forgotten meanwhile
            self._refuse(rd, now, ErrorCode.UNKNOWN_SESSION, "the Prefill session is gone")
            return
        if session.state not in SESSION_READY:  # only after parking: a new handshake failed
            code, text = session.refusal
            self._refuse(rd, now, code, f"handshake refused: {text}")
            return
        rd.caps = session.caps
        local_name = msg.layer_name
        known = self._by_name.get(local_name)
        if known is None:
            self._refuse(
                rd,
                now,
                ErrorCode.UNKNOWN_LAYER,
                f"layer {local_name!r} (layer_idx {msg.layer_idx}) is not one of Decode's "
                f"{len(self._layers)} cache-bearing layers",
            )
            return
        expected, dst = known
        if msg.layer_idx != expected:
            self._refuse(
                rd,
                now,
                ErrorCode.LAYOUT_MISMATCH,
                f"layer_idx {msg.layer_idx} disagrees with layer name {local_name!r}, "
                f"which is layer {expected}",
            )
            return
        src = session.layers.get(msg.layer_name)
        if src is None:
            self._refuse(
                rd,
                now,
                ErrorCode.UNKNOWN_LAYER,
                f"layer {msg.layer_name!r} is not in the session's MF_META layout",
            )
            return
        key = (msg.layer_idx, msg.layer_name)
        comps = session.validated.get(key)
        if comps is None:
            try:
                comps = validate_layer(msg.layer_name, src, dst)
            except LayoutMismatch as exc:
                comps = exc
            session.validated[key] = comps
        if isinstance(comps, LayoutMismatch):
            self._refuse(rd, now, ErrorCode.LAYOUT_MISMATCH, _explain(comps, msg.tp_ratio))
            return
        if allow_park:
            missing = {
                ext
                for ext in _message_ids(msg)
                if ext not in self._requests and ext not in self._retired
            }
            if missing:
                rd.missing = missing
                rd.deadline = now + self.config.park_timeout_s
                if rd.start_by is not None:
                    rd.deadline = min(rd.deadline, rd.start_by)
                if self._park_has_room(rd):
                    _READINESS.fire(self, rd, M_LOCAL_PARK)
                    return
                rd.missing = set()
        if rd.start_by is not None and now > rd.start_by:
            self.stats.expired_leases += 1
            self._refuse(
                rd,
                now,
                ErrorCode.LEASE_EXPIRED,
                f"less than half of the {msg.lease_ms} ms lease was left to start the read",
            )
            return
        main, indexer = comps
        self._plan(rd, session, src, local_name, main, indexer, now)

    def _plan(
        self,
        rd: _Readiness,
        session: _Session,
        src: LayerLayout,
        local_name: str,
        main: tuple[ComponentAddrs, ...],
        indexer: tuple[ComponentAddrs, ...],
        now: float,
    ) -> None:
        msg = rd.msg
        counts: dict[str, int] = {}
        for rr in msg.read_reqs:
            counts[rr.ext_req_id] = counts.get(rr.ext_req_id, 0) + 1
        reads: list[RequestRead] = []
        entries: list[tuple[str, ReadReq | None]] = [(rr.ext_req_id, rr) for rr in msg.read_reqs]
        entries += [(ext, None) for ext in _unique(msg.done_ext_ids) if ext not in counts]
        handled: set[str] = set()
        for ext, entry in entries:
            if ext in handled:
                continue
            handled.add(ext)
            req = self._requests.get(ext)
            if req is None:
                self._isolate(rd, ext, ErrorCode.UNKNOWN_REQUEST, "unknown request")
                continue
            read = _REQUEST.fire(
                self, req, R_RECV_READINESS, rd, entry, counts.get(ext, 0), src, indexer, now
            )
            if read is not None and (read.main_src or read.indexer_src):
                reads.append(read)
                rd.in_plan.append(req)
        if not reads:
            _READINESS.fire(self, rd, M_LOCAL_NOTHING_TO_READ)
            self._count_done(rd, now)
            return
        read_id = self._next_read_id
        self._next_read_id += 1
        rd.plan = ReadPlan(read_id, session.name, local_name, main, indexer, tuple(reads))
        rd.retries_left = self.config.max_read_retries
        for req in rd.in_plan:
            req.in_flight += 1
        self._reads[read_id] = rd
        self.stats.reads_started += 1
        _READINESS.fire(self, rd, M_LOCAL_START_READ)

    def _share(
        self,
        req: _Request,
        rr: ReadReq,
        src: LayerLayout,
        rd: _Readiness,
        has_indexer: bool,
    ) -> RequestRead:
        """This rank's blocks of one readiness entry, mapped to the request's own ids.

        No id is copied when the share is the whole entry: the plan holds the message's
        own lists and the request's own (immutable) destination ids.
        """
        msg, cfg = rd.msg, self.config
        member = msg.group_member_idx
        # One Decode rank and one contributor (the usual shape): every share is the whole
        # entry (split_range over one rank), with no call per request.
        whole = (cfg.d_tp == 1 or not cfg.main_shared) and msg.tp_ratio == 1
        num_blocks = src.num_blocks
        if num_blocks is not None and rd.ids_below is not None and rd.ids_below <= num_blocks:
            num_blocks = None  # every Prefill id of the message is below it: checked already
        main_ids = rr.main_block_ids
        n = len(main_ids)
        if whole:
            start, end = 0, n
        elif cfg.main_shared:
            start, end = main_share(n, cfg.d_rank, cfg.d_tp, rr.main_start_block, member)
        else:
            start, end = main_share(n, 0, 1, rr.main_start_block, member)
        main_src: Sequence[int] = ()
        main_dst: Sequence[int] = ()
        if member == 0:
            base = rr.main_start_block
            if base < 0 or base + n > len(req.main_ids):  # (the check, inlined: it raises)
                check_destination_range(req.ext_id, "main", base, n, len(req.main_ids))
            main_src = _part(main_ids, start, end)
            main_dst = req.main_ids[base + start : base + end]
            if num_blocks is not None:
                _check_source(msg.layer_name, "main", main_src, num_blocks)
        idx_src: Sequence[int] = ()
        idx_dst: Sequence[int] = ()
        if has_indexer:
            idx_ids = rr.indexer_ids
            n = len(idx_ids)
            base = rr.indexer_start_block
            if base < 0 or base + n > len(req.indexer_ids):
                check_destination_range(req.ext_id, "indexer", base, n, len(req.indexer_ids))
            if whole:
                start, end = 0, n
            else:
                start, end = indexer_share(n, member, msg.tp_ratio, base)
            idx_src = _part(idx_ids, start, end)
            idx_dst = req.indexer_ids[base + start : base + end]
            if num_blocks is not None:
                _check_source(msg.layer_name, "indexer", idx_src, num_blocks)
        return RequestRead(req.ext_id, main_src, main_dst, idx_src, idx_dst)

    def _not_waiting(self, req: _Request) -> tuple[ErrorCode, str]:
        """Why readiness for a request that stopped waiting is refused."""
        if req.state == REQ_DONE:
            return ErrorCode.UNKNOWN_REQUEST, "the request already completed on this rank"
        if req.state == REQ_ABORTED:
            return ErrorCode.ABORTED, "the request was aborted"
        if req.state == REQ_RELEASE_PENDING:
            return ErrorCode.ABORTED, "the request was released"
        return req.fail_code, f"the request already failed: {req.fail_message}"

    def _isolate(self, rd: _Readiness, ext: str, code: ErrorCode, text: str) -> None:
        self.stats.isolated_requests += 1
        rd.isolated.append(FailedRequest(ext, int(code), _clip(text)))

    # The request machine's RECV_READINESS effects: (req, rd, entry, count, src, indexer,
    # now) -> the request's share of the read, or None (nothing to read for it).

    def _fx_isolate(self, req: _Request, rd: _Readiness, *_context: Any) -> None:
        """The request stopped waiting: leave it out of the read, report it alone."""
        self._isolate(rd, req.ext_id, *self._not_waiting(req))

    def _fx_accept(
        self,
        req: _Request,
        rd: _Readiness,
        entry: ReadReq | None,
        count: int,
        src: LayerLayout,
        indexer: tuple[ComponentAddrs, ...],
        now: float,
    ) -> RequestRead | None:
        """Take the readiness for the request: its entry must be sound (named once, the
        same ``tp_ratio``, a destination range that fits, source ids within the layout),
        else the request is isolated and fails (``LOCAL_FAIL``)."""
        msg = rd.msg
        try:
            if count > 1:
                raise RemoteProtocolError("the request appears more than once in the message")
            if req.contributors is not None:
                req.contributors.check_ratio(msg.tp_ratio)
            read = None if entry is None else self._share(req, entry, src, rd, bool(indexer))
        except ProtocolError as exc:
            self._isolate(rd, req.ext_id, exc.code, exc.message)
            self._request_event(req, R_LOCAL_FAIL, now, exc.code, exc.message)
            return None
        self._touch(req, now)
        req.sessions.add(rd.session)
        if req.contributors is None:
            req.contributors = ContributorSet(msg.tp_ratio)
        rd.accepted.append(req)
        return read

    # -- read outcomes ---------------------------------------------------------------------

    def _read_succeeded(self, rd: _Readiness, now: float) -> None:
        _READINESS.fire(self, rd, M_LOCAL_READ_OK)
        for req in rd.in_plan:
            req.in_flight -= 1
            self._request_event(req, R_LOCAL_READ_OK, now)
        self._count_done(rd, now)
        self._release_quiescent(rd.in_plan, now)

    def _count_done(self, rd: _Readiness, now: float) -> None:
        """After the done reply: count the message's done signals, complete what can."""
        msg = rd.msg
        accepted = {req.ext_id: req for req in rd.accepted}
        for ext in _unique(msg.done_ext_ids):
            req = accepted.get(ext)
            if req is None or req.state != REQ_RECEIVING or self._requests.get(ext) is not req:
                continue
            assert req.contributors is not None
            if req.contributors.report(msg.group_member_idx) == EFFECT_IGNORE_DUPLICATE:
                self.stats.duplicate_done += 1
        for req in rd.accepted:
            if (
                req.state == REQ_RECEIVING
                and req.in_flight == 0
                and req.contributors is not None
                and req.contributors.complete
                and not self._named_by_parked(req.ext_id)
            ):
                self._request_event(req, R_LOCAL_ALL_DONE, now)

    def _named_by_parked(self, ext: str) -> bool:
        """Whether a parked readiness names ``ext``: its blocks are not read yet.

        Parking serves a readiness after later ones of the same session (those name only
        known requests), so the last layer's done signal can arrive first; the request is
        done only once the parked readiness was read too (its own completion check).
        """
        return any(
            isinstance(item, _Readiness) and ext in _message_ids(item.msg)
            for item in self._parked.values()
        )

    def _may_retry(self, rd: _Readiness, error: TransferError, now: float) -> bool:
        return (
            error.transient
            and error.code != ErrorCode.LEASE_EXPIRED
            and rd.retries_left > 0
            and (rd.start_by is None or now <= rd.start_by)
            and any(req.state == REQ_RECEIVING for req in rd.in_plan)
        )

    def _retry(self, rd: _Readiness, now: float) -> None:
        """Start the read again for the requests still receiving."""
        assert rd.plan is not None
        keep = [req for req in rd.in_plan if req.state == REQ_RECEIVING]
        gone = [req for req in rd.in_plan if req.state != REQ_RECEIVING]
        for req in gone:
            req.in_flight -= 1
        self._release_quiescent(gone, now)
        kept = {req.ext_id for req in keep}
        read_id = self._next_read_id
        self._next_read_id += 1
        rd.plan = dataclasses.replace(
            rd.plan,
            read_id=read_id,
            requests=tuple(r for r in rd.plan.requests if r.ext_req_id in kept),
        )
        rd.in_plan = keep
        rd.retries_left -= 1
        self._reads[read_id] = rd
        self.stats.read_retries += 1
        _READINESS.fire(self, rd, M_LOCAL_READ_RETRY)

    def _read_failed(self, rd: _Readiness, error: TransferError, now: float) -> None:
        self.stats.reads_failed += 1
        code = error.code
        if code == ErrorCode.LEASE_EXPIRED:
            self.stats.expired_leases += 1
        text = f"batched read failed: {error.message}"
        if error.backend_code is not None:
            text += f" (backend code {error.backend_code})"
        _READINESS.fire(self, rd, M_LOCAL_READ_FAILED, code, text)
        for req in rd.in_plan:
            req.in_flight -= 1
        for req in rd.accepted:
            # A request may have been released while this read was in flight: a retry left
            # it out, or it had no share in the read. It is gone; leave it alone.
            if self._requests.get(req.ext_id) is req:
                self._request_event(req, R_LOCAL_FAIL, now, code, text)
        self._release_quiescent(rd.in_plan, now)

    def _release_quiescent(self, reqs: Iterable[_Request], now: float) -> None:
        for req in reqs:
            if req.state == REQ_RELEASE_PENDING and req.in_flight == 0:
                self._request_event(req, R_LOCAL_QUIESCENT, now)

    # -- replies ---------------------------------------------------------------------------

    def _reply_done(self, rd: _Readiness) -> None:
        msg = rd.msg
        if msg.seq is None:
            reply = ReadDone(layer_idx=msg.layer_idx)
        else:
            failed: list[FailedRequest] | None = None
            if rd.isolated and CAP_ISOLATE in rd.caps:
                failed = rd.isolated[:MAX_REQUESTS_PER_BATCH]
                if sum(len(f.ext_req_id) + len(f.message) for f in failed) > _REPLY_TEXT_BUDGET:
                    failed = [FailedRequest(f.ext_req_id, f.code) for f in failed]
            reply = ReadDone(layer_idx=msg.layer_idx, seq=msg.seq, failed=failed)
        self._answer(rd, reply)

    def _reply_failed(self, rd: _Readiness, code: ErrorCode, text: str) -> None:
        self._answer(rd, self._failure_reply(rd.msg.layer_idx, rd.msg.seq, code, text))

    def _answer(self, rd: _Readiness, reply: ReadDone | ReadFailed) -> None:
        """Send ``rd``'s reply, and remember it if its seq is remembered (see _repeated)."""
        self._out.append(Reply(rd.peer, reply))
        seq = rd.msg.seq
        session = self._sessions.get(rd.session)
        if seq is not None and session is not None and seq in session.remembered:
            self._remember(session, seq, reply)

    @staticmethod
    def _failure_reply(layer_idx: int, seq: int | None, code: ErrorCode, text: str) -> ReadFailed:
        if seq is None:  # v1 shape
            return ReadFailed(layer_idx=layer_idx, error=_clip(text))
        return ReadFailed(layer_idx=layer_idx, error=_clip(text), seq=seq, code=int(code))

    def _refuse(
        self, rd: _Readiness, now: float, code: ErrorCode, text: str, *, fail_known: bool = True
    ) -> None:
        """Fail the whole readiness: reply read_failed, fail every known request it names."""
        _READINESS.fire(self, rd, M_LOCAL_REFUSE, code, text)
        self.stats.layer_failures += 1
        if fail_known:
            self._fail_known(_message_ids(rd.msg), now, code, text)

    def _fail_known(self, ids: Iterable[str], now: float, code: ErrorCode, text: str) -> None:
        for ext in ids:
            req = self._requests.get(ext)
            if req is not None:
                self._request_event(req, R_LOCAL_FAIL, now, code, text)

    # -- parking ---------------------------------------------------------------------------

    def _park(self, item: _Parked) -> bool:
        """Park ``item`` if the park has room for it (else count why not)."""
        if not self._park_has_room(item):
            return False
        self._put_parked(item)
        return True

    def _park_has_room(self, item: _Parked) -> bool:
        """The ``park_has_room`` guard: the count and id budgets (a refusal is counted)."""
        if len(self._parked) >= self.config.max_parked:
            self.stats.park_overflow += 1
            return False
        cost = _park_cost(item)
        mine = self._parked_ids_by_session.get(item.session, 0) + cost
        if (
            self._parked_ids + cost > self.config.max_parked_ids
            or mine > self.config.max_parked_ids_per_session
        ):
            self.stats.park_budget_refusals += 1
            return False
        return True

    def _put_parked(self, item: _Parked) -> None:
        cost = _park_cost(item)
        mine = self._parked_ids_by_session.get(item.session, 0) + cost
        self._parked_ids += cost
        self._parked_ids_by_session[item.session] = mine
        item.park_id = self._next_park_id
        self._next_park_id += 1
        self._parked[item.park_id] = item
        for ext in item.missing:
            self._waiting.setdefault(ext, set()).add(item.park_id)
        self.stats.parked += 1

    def _unpark(self, item: _Parked) -> None:
        del self._parked[item.park_id]
        cost = _park_cost(item)
        self._parked_ids -= cost
        left = self._parked_ids_by_session[item.session] - cost
        if left:
            self._parked_ids_by_session[item.session] = left
        else:
            del self._parked_ids_by_session[item.session]
        for ext in item.missing:  # every id still missing is indexed in _waiting
            waiting = self._waiting[ext]
            waiting.discard(item.park_id)
            if not waiting:
                del self._waiting[ext]
        item.missing = set()

    def _resolve_waiting(self, ext: str, now: float) -> None:
        """``ext`` became known (added or retired): serve what waited only for it."""
        waiting = self._waiting.pop(ext, None)
        if not waiting:
            return
        for pid in sorted(waiting):  # arrival order; _unpark keeps _waiting exact
            item = self._parked[pid]
            item.missing.discard(ext)
            if isinstance(item, _ParkedAbort):
                req = self._requests.get(ext)
                if req is not None:
                    self._request_event(
                        req, R_RECV_ABORT, now, ErrorCode.ABORTED, item.reason, exclude=item.session
                    )
                if not item.missing:
                    self._unpark(item)
            elif not item.missing:
                self._unpark(item)
                _READINESS.fire(self, item, M_LOCAL_UNPARK, now)

    def _retire(self, ext: str, now: float) -> None:
        """Remember ``ext`` as finished here: readiness for it is refused, not parked."""
        self._retired[ext] = None
        self._retired.move_to_end(ext)
        while len(self._retired) > self.config.max_retired:
            self._retired.popitem(last=False)
        self._resolve_waiting(ext, now)

    # -- request machine -------------------------------------------------------------------

    def _known(self, ext: str) -> _Request:
        req = self._requests.get(ext)
        if req is None:
            raise LocalProtocolError(f"request {ext!r} is not registered")
        return req

    def _touch(self, req: _Request, now: float) -> None:
        """Restart the request's load timer (it made progress)."""
        self._deadlines[req.ext_id] = now + self.config.kv_load_timeout_s
        self._deadlines.move_to_end(req.ext_id)

    def _request_event(
        self,
        req: _Request,
        event: str,
        now: float,
        code: ErrorCode = ErrorCode.UNKNOWN,
        text: str = "",
        *,
        exclude: str | None = None,
    ) -> None:
        """Fire ``event`` on ``req``'s machine (every input but RECV_READINESS)."""
        _REQUEST.fire(self, req, event, now, code, text, exclude)

    # The request machine's other effects: (req, now, code, text, exclude).

    def _fx_progress(self, req: _Request, now: float, *_failure: Any) -> None:
        """A read for it succeeded: restart its load timer."""
        self._touch(req, now)

    def _fx_report_done(self, req: _Request, *_context: Any) -> None:
        self._deadlines.pop(req.ext_id, None)
        self.stats.requests_done += 1
        self._out.append(RequestDone(req.ext_id))

    def _fx_fail(
        self, req: _Request, now: float, code: ErrorCode, text: str, exclude: str | None
    ) -> None:
        self._fail(req, code, text, exclude)

    def _fx_fail_release(
        self, req: _Request, now: float, code: ErrorCode, text: str, exclude: str | None
    ) -> None:
        self._fail(req, code, text, exclude)
        self._released(req, now)

    def _fx_release(self, req: _Request, now: float, *_failure: Any) -> None:
        self._released(req, now)

    def _fail(self, req: _Request, code: ErrorCode, text: str, exclude: str | None) -> None:
        self._deadlines.pop(req.ext_id, None)
        req.fail_code, req.fail_message = code, text
        self.stats.requests_failed += 1
        self._out.append(
            RequestFailed(req.ext_id, code, text, tuple(req.main_ids), tuple(req.indexer_ids))
        )
        reason = f"{code.name}: {text}"
        for name in sorted(req.sessions):
            if name != exclude:
                ids, _ = self._aborts.setdefault(name, ([], reason))
                ids.append(req.ext_id)

    def _released(self, req: _Request, now: float) -> None:
        del self._requests[req.ext_id]
        self._deadlines.pop(req.ext_id, None)
        self._out.append(Releasable(req.ext_id))
        self._retire(req.ext_id, now)

    # -- the readiness machine's effects ---------------------------------------------------

    def _fx_park(self, rd: _Readiness) -> None:
        self._put_parked(rd)

    def _fx_process(self, rd: _Readiness, now: float) -> None:
        """Out of the park: serve it now, its still-unknown requests isolated."""
        self._serve(rd, now, allow_park=False)

    def _fx_start_read(self, rd: _Readiness) -> None:
        assert rd.plan is not None
        self._out.append(StartRead(rd.plan, rd.start_by, rd.finish_by))

    # -- output ----------------------------------------------------------------------------

    def _flush(self) -> list[Output]:
        """Hand out the outputs of this call, ABORTs grouped per peer at the end."""
        out, self._out = self._out, []
        for name, (ids, reason) in self._aborts.items():
            session = self._sessions.get(name)
            if (
                session is None
                or session.peer is None
                or session.state != SESSION_V2
                or CAP_ABORT not in session.caps
            ):
                continue
            for i in range(0, len(ids), MAX_REQUESTS_PER_BATCH):
                chunk = ids[i : i + MAX_REQUESTS_PER_BATCH]
                out.append(SendAbort(session.peer, Abort(ext_ids=chunk, reason=_clip(reason))))
                self.stats.aborts_sent += 1
        self._aborts = {}
        return out


# -- the tables drive the action: each declared effect bound to its handler ----------------

_READINESS: Final = DECODE_READINESS.bind(
    {
        EFFECT_PARK: ConsumerEndpoint._fx_park,
        EFFECT_PROCESS: ConsumerEndpoint._fx_process,
        EFFECT_START_READ: ConsumerEndpoint._fx_start_read,
        EFFECT_REPLY_DONE: ConsumerEndpoint._reply_done,
        EFFECT_REPLY_FAILED: ConsumerEndpoint._reply_failed,
    }
)
_REQUEST: Final = DECODE_REQUEST.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_ACCEPT: ConsumerEndpoint._fx_accept,
        EFFECT_ISOLATE: ConsumerEndpoint._fx_isolate,
        EFFECT_PROGRESS: ConsumerEndpoint._fx_progress,
        EFFECT_REPORT_DONE: ConsumerEndpoint._fx_report_done,
        EFFECT_FAIL: ConsumerEndpoint._fx_fail,
        EFFECT_FAIL_RELEASE: ConsumerEndpoint._fx_fail_release,
        EFFECT_FAIL_HOLD: ConsumerEndpoint._fx_fail,  # (release_pending is the hold)
        EFFECT_RELEASE: ConsumerEndpoint._fx_release,
    }
)
_SESSION: Final = DECODE_SESSION.bind(
    {
        EFFECT_ACK_V1: ConsumerEndpoint._fx_ack_v1,
        EFFECT_ACK_V2: ConsumerEndpoint._fx_ack_v2,
        EFFECT_REFUSE_V1: ConsumerEndpoint._fx_refuse_v1,
        EFFECT_REFUSE_V2: ConsumerEndpoint._fx_refuse_v2,
        EFFECT_SERVE: ConsumerEndpoint._fx_serve,
        EFFECT_REPLY_REFUSED: ConsumerEndpoint._fx_reply_refused,
        EFFECT_REPLY_UNKNOWN_SESSION: ConsumerEndpoint._fx_reply_unknown_session,
        EFFECT_APPLY_ABORT: ConsumerEndpoint._fx_apply_abort,
        EFFECT_DROP: ConsumerEndpoint._fx_drop,
    }
)
