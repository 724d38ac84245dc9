"""The Prefill side of RD2H as a sans-IO endpoint.

Over 600 lines: one endpoint class whose effect handlers (bound to the tables of
:mod:`rd2h_protocol.machines.producer`) share its private state; split into modules they
would reach back into one another's records. The checker imports its private names here.

Theory of operation
-------------------
One :class:`ProducerEndpoint` serves one Prefill TP rank. The runtime feeds it events
(a request arrived, a chunk was scheduled, a layer's KV is written, a frame arrived, a
deadline passed) together with ``now`` (monotonic seconds) and executes the outputs it
returns, in order: :class:`Connect` a DEALER, :class:`Send` a message, report a
:class:`RequestFinished`, wake the compute path on :class:`GateOpened`. Nothing here
reads a clock, opens a socket or sleeps.

The rules that change state are the tables in :mod:`rd2h_protocol.machines.producer`
(storage-slot gates, layer publications, requests, connection handshakes); this module
resolves their guards and performs their effects. The two properties it protects:

* buffer reuse (S1): the runtime asks :meth:`ProducerEndpoint.can_overwrite` before a
  layer's storage is written; it is True only while every publication against that
  storage has ended (a terminal reply, a local release, or an expired lease whose ABORT
  went out first -- emitted as a :class:`Send` before the :class:`GateOpened`).
  :meth:`ProducerEndpoint.layer_written` refuses to publish into a storage that is not
  open;
* bounded state (B1): a request is forgotten the moment it is finished, and it is
  finished only when no publication that named it is outstanding (or still readable by
  a peer that could not be told: such a publication keeps only its gates, see below).

Peers that cannot be told (S1 toward v1)
----------------------------------------
A v1 Decode (or a v2 one without the ``abort`` capability, or any peer under
``protocol="v1"``) cannot receive an ABORT, so an expired lease alone proves nothing: it
may still be reading. With ``v1_lease_expiry="hold"`` (the default) such a publication is
*held*: its requests are reported failed (``LEASE_EXPIRED``) at once, but its storage
gates stay closed until that connection replies to it, or until the runtime declares
the endpoint dead with :meth:`ProducerEndpoint.connection_lost`. The same holds for a v2
peer whose ABORT has to wait for a handshake in progress (after UNKNOWN_SESSION): the
gates reopen only once the ABORT has been emitted. ``v1_lease_expiry="reopen"`` keeps
v1's behaviour (reopen at expiry, untold) and is UNSAFE: the compute path may overwrite
storage a Decode is still reading.

Dead peers
----------
:meth:`ProducerEndpoint.connection_lost` is for the runtime's heartbeat. Publications
out on that connection fail their requests at once (``CONNECTION_LOST``; an ABORT goes
out best effort to a v2 peer, which may come back), but their gates reopen only when the
lease has ALSO run out (or a reply comes). A heartbeat proves that the peer process is
gone or cut off, not that no read it started is still moving bytes, and for a v1 peer
nothing else ever will; the lease (30 s by default, against reads of milliseconds that
v1 starts on receipt) is what bounds such a read. Residual risk, accepted: a Decode cut
off on the control network only, whose data path still works, and that starts a read
more than a lease after the readiness arrived. A reply that such a peer sends after
that (v1 replies carry no seq) may also be matched to a newer publication of the same
layer on that connection.

Step protocol, per engine step: ``schedule_chunk`` for every request with blocks in the
step, then ``layer_written`` for each cache-bearing layer (each at most once), then
``end_step``. Replies, aborts and timers may arrive at any time.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

import msgspec

from rd2h_protocol.errors import (
    ConfigError,
    ErrorCode,
    LocalProtocolError,
    RemoteProtocolError,
    TopologyError,
    TransferError,
)
from rd2h_protocol.events import (
    Chunk,
    Connect,
    ConnectionView,
    Disconnect,
    GateOpened,
    LayerReplied,
    ProducerOutput,
    RequestFinished,
    Send,
)
from rd2h_protocol.machines.declare import NO_EFFECT, no_effect
from rd2h_protocol.machines.producer import (
    C_LOCAL_CONNECTION_LOST,
    C_LOCAL_HELD_ABORTS,
    C_LOCAL_PUBLISH,
    C_LOCAL_PUBLISH_RETRY,
    C_RECV_ACK_REFUSED,
    C_RECV_ACK_V1,
    C_RECV_ACK_V2,
    C_RECV_UNKNOWN_SESSION,
    C_TIMER_HANDSHAKE_EXPIRED,
    CONN_HANDSHAKING,
    CONN_IDLE,
    CONN_READY_V1,
    CONN_READY_V2,
    CONN_REFUSED,
    CONNECTION_HANDSHAKE,
    EFFECT_COUNT_DUPLICATE,
    EFFECT_COUNT_STALE,
    EFFECT_COUNT_STRAY_ACK,
    EFFECT_DONE,
    EFFECT_EXPIRE_ABORT,
    EFFECT_EXPIRE_UNSENT,
    EFFECT_EXPIRE_UNTOLD,
    EFFECT_FAIL,
    EFFECT_FAIL_QUEUED,
    EFFECT_FINISH,
    EFFECT_FLUSH,
    EFFECT_HOLD,
    EFFECT_IGNORE,
    EFFECT_ORPHAN,
    EFFECT_QUEUE,
    EFFECT_RECORD_FAILURE,
    EFFECT_REFUSED,
    EFFECT_RELEASE,
    EFFECT_RELEASE_HELD,
    EFFECT_REOPEN,
    EFFECT_REQUEUE,
    EFFECT_RESEND,
    EFFECT_RESET,
    EFFECT_SCHEDULE,
    EFFECT_SEND,
    EFFECT_SEND_ABORT,
    EFFECT_SEND_META,
    EFFECT_STOP,
    G_LOCAL_ABORT_SENT,
    G_LOCAL_LAST_ABORT_SENT,
    G_LOCAL_LAST_PEER_DEAD,
    G_LOCAL_LAST_RELEASE,
    G_LOCAL_LAST_REOPEN_UNSAFE,
    G_LOCAL_PEER_DEAD,
    G_LOCAL_PUBLISH,
    G_LOCAL_RELEASE,
    G_LOCAL_REOPEN_UNSAFE,
    G_RECV_LAST_REPLY,
    G_RECV_REPLY,
    G_TIMER_LEASE_EXPIRED,
    GATE_OPEN,
    LAYER_PUBLICATION,
    P_LOCAL_ABORT_SENT,
    P_LOCAL_CONNECTION_LOST,
    P_LOCAL_LEASE_LAPSED,
    P_LOCAL_RELEASE,
    P_LOCAL_REOPEN_UNSAFE,
    P_LOCAL_RESEND,
    P_RECV_DONE,
    P_RECV_FAILED,
    P_RECV_UNKNOWN_SESSION,
    P_SEND_READINESS,
    P_TIMER_LEASE_EXPIRED,
    P_TIMER_LEASE_EXPIRED_UNSAFE,
    P_TIMER_LEASE_EXPIRED_UNTOLD,
    PREFILL_REQUEST,
    PRODUCER_MACHINES,
    PUB_HELD,
    PUB_ORPHANED,
    PUB_QUEUED,
    PUB_REPLAYED,
    R_LOCAL_ABORT,
    R_LOCAL_CHUNK,
    R_LOCAL_DRAINED,
    R_LOCAL_FAILURE,
    R_LOCAL_FINAL_CHUNK,
    R_RECV_ABORT,
    R_RECV_FAILURE,
    R_SEND_DONE,
    REQ_ABORTING,
    REQ_COMPLETE,
    REQ_FAILING,
    REQ_FINAL_SCHEDULED,
    REQ_FINAL_SENT,
    REQ_PUBLISHING,
    STORAGE_GATE,
)
from rd2h_protocol.topology import (
    Contributor,
    decode_rank_port,
    map_prefill_rank,
    wire_layer_indices,
)
from rd2h_protocol.wire.codec import decode
from rd2h_protocol.wire.layout import LayerLayout, assign_storage_slots, encode_layer_metadata
from rd2h_protocol.wire.messages import (
    ALL_CAPABILITIES,
    CAP_ABORT,
    CAP_LEASE,
    CAP_RECONNECT,
    CAP_RESEND,
    CAP_SEQ,
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
    "PRODUCER_MACHINES",
    "Connect",
    "DecodeTarget",
    "Disconnect",
    "GateOpened",
    "LayerReplied",
    "Output",
    "ProducerConfig",
    "ProducerEndpoint",
    "ProducerStats",
    "PublicationView",
    "RequestFinished",
    "Send",
]

ReadFailurePolicy: TypeAlias = Literal["isolate", "raise"]
ProtocolChoice: TypeAlias = Literal["v2", "v1"]
V1LeaseExpiry: TypeAlias = Literal["hold", "reopen"]

_MAX_LEASE_MS: Final = (1 << 32) - 1  # lease_ms is a uint32 on the wire
# Request states that end as soon as no live publication names the request.
_DRAINABLE: Final = frozenset({REQ_FINAL_SENT, REQ_FAILING, REQ_ABORTING})
# Request states whose blocks Decode may still be asked to read.
_STILL_READ: Final = frozenset({*REQ_PUBLISHING, REQ_FINAL_SENT})


# -- configuration -------------------------------------------------------------------------


@dataclass(frozen=True)
class ProducerConfig:
    """Configuration of one Prefill TP rank.

    ``layers`` lists the cache-bearing layers in order (the last one carries the done
    ids); a readiness names its layer and carries the ``layer_idx`` v1 peers expect for
    that name (:func:`~rd2h_protocol.topology.wire_layer_index`: ``N`` of ``layers.N``).
    ``lease_ms`` bounds how long a publication
    may hold its storage without a reply. ``read_failure_policy`` "isolate" reports a
    failed read through :class:`RequestFinished` only; "raise" also makes the next
    :meth:`ProducerEndpoint.can_overwrite` of the affected storage raise (v1 behaviour).
    ``protocol`` "v1" speaks v1 to every peer (interop tests). ``history`` is how many
    ended publications per connection are remembered to tell duplicate from stale replies.

    ``v1_lease_expiry`` decides what an expired lease does toward a peer that cannot
    receive an ABORT (v1): "hold" (default, safe) fails the requests at once but keeps the
    storage closed until that peer replies or is declared dead (module docstring);
    "reopen" reopens at once as v1 did, which is UNSAFE (the peer may still be reading).
    A refused handshake is tried again by the first publication ``refused_retry_s`` after
    the refusal; the wait doubles per consecutive refusal, up to ``refused_retry_max_s``.

    ``silent_peer_timeout_s``: a held publication whose connection has sent nothing at all
    for this long since it was held gets its peer declared dead, as the runtime's
    heartbeat would (:class:`Disconnect`, then :meth:`ProducerEndpoint.connection_lost`):
    its storage reopens. libzmq answers heartbeats for a v1 Decode that never replies, so
    without this one silent peer holds every storage it was sent, and stalls every other
    peer's requests behind it. The trade-off (stated in ``specs/invariants.md``, S1): a
    peer that cannot be told, alive but silent for a lease plus this long, may still be
    reading storage that is then reused. ``None`` holds for as long as the connection
    lasts.
    """

    p_rank: int
    p_tp: int
    session: str
    layers: Sequence[tuple[str, LayerLayout]]
    lease_ms: int = 30_000
    read_failure_policy: ReadFailurePolicy = "isolate"
    protocol: ProtocolChoice = "v2"
    compat: str = ""
    handshake_timeout_s: float = 10.0
    history: int = 1024
    v1_lease_expiry: V1LeaseExpiry = "hold"
    refused_retry_s: float = 30.0
    refused_retry_max_s: float = 600.0
    silent_peer_timeout_s: float | None = 30.0

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("layers: expected at least one cache-bearing layer, got none")
        names = [name for name, _ in self.layers]
        if len(set(names)) != len(names):
            raise ConfigError(f"layers: layer names must be unique, got {names}")
        if not 0 < self.lease_ms <= _MAX_LEASE_MS:
            raise ConfigError(f"lease_ms: expected 1..{_MAX_LEASE_MS}, got {self.lease_ms}")
        if self.read_failure_policy not in ("isolate", "raise"):
            raise ConfigError(
                f"read_failure_policy: expected 'isolate' or 'raise', "
                f"got {self.read_failure_policy!r}"
            )
        if self.protocol not in ("v2", "v1"):
            raise ConfigError(f"protocol: expected 'v2' or 'v1', got {self.protocol!r}")
        if not self.handshake_timeout_s > 0:
            raise ConfigError(f"handshake_timeout_s: expected > 0, got {self.handshake_timeout_s}")
        if self.history < 0:
            raise ConfigError(f"history: expected >= 0, got {self.history}")
        if self.v1_lease_expiry not in ("hold", "reopen"):
            raise ConfigError(
                f"v1_lease_expiry: expected 'hold' or 'reopen', got {self.v1_lease_expiry!r}"
            )
        if not self.refused_retry_s > 0:
            raise ConfigError(f"refused_retry_s: expected > 0, got {self.refused_retry_s}")
        if not self.refused_retry_max_s >= self.refused_retry_s:
            raise ConfigError(
                f"refused_retry_max_s: expected >= refused_retry_s ({self.refused_retry_s}), "
                f"got {self.refused_retry_max_s}"
            )
        if self.silent_peer_timeout_s is not None and not self.silent_peer_timeout_s > 0:
            raise ConfigError(
                f"silent_peer_timeout_s: expected > 0 or None, got {self.silent_peer_timeout_s}"
            )
        # Fail on a bad rank now, not at the first request.
        map_prefill_rank(self.p_rank, self.p_tp, 1)


@dataclass(frozen=True, slots=True)
class DecodeTarget:
    """A Decode engine as the rendezvous describes it: host, BASE port and TP size."""

    host: str
    base_port: int
    d_tp: int


Output: TypeAlias = ProducerOutput


@dataclass(slots=True)
class ProducerStats:
    """Counters for metrics. Peer input that changes nothing is counted here."""

    publications: int = 0
    replies: int = 0
    stale_replies: int = 0
    duplicate_replies: int = 0
    unknown_replies: int = 0
    malformed_frames: int = 0
    unexpected_messages: int = 0
    dropped: int = 0
    read_failures: int = 0
    isolated_failures: int = 0
    expired_leases: int = 0
    held_leases: int = 0  # expired toward a peer not told yet: storage kept closed
    unsafe_reopens: int = 0  # expired and reopened untold (v1_lease_expiry="reopen")
    connections_lost: int = 0
    handshake_retries: int = 0  # after a refusal's backoff, or to deliver held ABORTs
    aborts_sent: int = 0
    aborts_received: int = 0
    handshakes: int = 0
    handshake_timeouts: int = 0
    handshakes_refused: int = 0
    replays: int = 0
    resent: int = 0  # readiness sent again under its seq (a reconnect, a held publication)
    silent_peers: int = 0  # declared dead: nothing heard while they held storage
    protocol_violations: int = 0  # declared dead: input that no table allows


@dataclass(frozen=True, slots=True)
class PublicationView:
    """A live publication, for invariant checks.

    ``state`` is its layer-publication state. A "held" publication (lease run out, no
    ABORT out yet) and an "orphaned" one (peer declared dead, lease still running) name
    no requests any more (``ext_ids`` is empty) but still hold ``slots``.
    """

    conn: str
    layer_idx: int
    state: str
    seq: int | None
    slots: tuple[int, ...]
    ext_ids: tuple[str, ...]
    deadline: float


# -- internal records ----------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Gate:
    state: str = GATE_OPEN
    outstanding: int = 0


@dataclass(slots=True, eq=False)
class _Conn:
    name: str
    host: str
    port: int
    d_tp: int
    contributor: Contributor
    state: str = CONN_IDLE
    connected: bool = False
    caps: frozenset[str] = frozenset()
    next_seq: int = 0
    sent: dict[int, _Pub] = field(default_factory=dict)  # seq -> publication, send order
    queue: list[_Pub] = field(default_factory=list)  # waiting for the handshake
    pending_aborts: list[str] = field(default_factory=list)  # waiting for the handshake
    history: OrderedDict[int, tuple[int, str]] = field(default_factory=OrderedDict)
    handshake_token: int = -1
    refusals: int = 0  # consecutive refused handshakes
    retry_at: float = 0.0  # a refused connection is tried again from then on
    refusal: str = ""  # why the peer refused, for the requests failed meanwhile
    reconnect: bool = False  # declared dead: the next handshake starts with a Connect
    last_heard: float = float("-inf")  # now of the last frame from it (silent peers)


@dataclass(slots=True, eq=False)
class _Request:
    ext_id: str
    conn: _Conn
    state: str
    outstanding: int = 0  # live publications that name this request
    chunk: ReadReq | None = None  # this step's blocks
    aborted_toward_peer: bool = False  # an ABORT naming it was emitted (not just queued)
    code: ErrorCode = ErrorCode.UNKNOWN
    message: str = ""


@dataclass(slots=True, eq=False)
class _Pub:
    uid: int
    conn: _Conn
    layer_idx: int
    slots: tuple[int, ...]
    read_reqs: list[ReadReq]
    done_ids: list[str]
    requests: tuple[_Request, ...]
    deadline: float
    state: str = PUB_QUEUED
    seq: int | None = None  # key in conn.sent while on the wire
    sent_at: float = 0.0  # now of the last Send of its readiness
    abort_ids: list[str] = field(default_factory=list)  # held: the ABORT it waits for
    held_at: float = 0.0  # now when it was held (silent peers)


# -- the endpoint --------------------------------------------------------------------------


class ProducerEndpoint:
    """Sans-IO Prefill endpoint for one TP rank (see the module docstring)."""

    def __init__(self, config: ProducerConfig) -> None:
        self.config = config
        self.stats = ProducerStats()
        self._layer_names = [name for name, _ in config.layers]
        # Positions are ours; the wire carries each name's layer number (reference §5).
        self._wire_index = wire_layer_indices(self._layer_names)
        self._position_of_wire = {wire: i for i, wire in enumerate(self._wire_index)}
        layouts = [layout for _, layout in config.layers]
        self._layer_slots: list[tuple[int, ...]] = [
            (main,) if idx is None else (main, idx) for main, idx in assign_storage_slots(layouts)
        ]
        self._gates: dict[int, _Gate] = {
            slot: _Gate() for slots in self._layer_slots for slot in slots
        }
        self._last_layer = len(config.layers) - 1
        self._lease_s = config.lease_ms / 1000.0
        self._v1_only = config.protocol == "v1"
        blob = encode_layer_metadata(dict(config.layers))
        if self._v1_only:
            self._meta = MfMeta(p_session=config.session, encoded_layer_metadata=blob)
        else:
            self._meta = MfMeta(
                p_session=config.session,
                encoded_layer_metadata=blob,
                protocol_version=PROTOCOL_VERSION,
                capabilities=list(ALL_CAPABILITIES),
                compat=config.compat or None,
            )
        self._conns: dict[str, _Conn] = {}
        self._requests: dict[str, _Request] = {}
        self._pubs: dict[int, _Pub] = {}  # live publications by uid
        self._handshakes: dict[int, _Conn] = {}  # running handshakes by token
        self._timers: list[tuple[float, int]] = []  # (deadline, uid or token), lazy heap
        self._next_uid = 0
        self._pending_raise: dict[int, str] = {}  # slot -> failure to raise ("raise" policy)
        # The current step.
        self._step: dict[str, dict[str, _Request]] = {}  # conn -> ext id -> request
        self._step_count = 0  # chunks scheduled and not yet finished
        self._step_layers = 0  # layers written
        self._step_top = -1  # the highest layer written

    # -- caller inputs ---------------------------------------------------------------------

    def add_request(self, ext_req_id: str, target: DecodeTarget, now: float) -> list[Output]:
        """Register a request to publish to ``target``.

        The Decode rank and this rank's contributor identity come from the target's own
        TP size. Raises :class:`TopologyError` for a topology or port the rules refuse,
        :class:`LocalProtocolError` for an id already registered.
        """
        del now  # registration starts no deadline
        if ext_req_id in self._requests:
            raise LocalProtocolError(f"request {ext_req_id!r} is already registered")
        conn = self._conn_for(target)
        self._requests[ext_req_id] = _Request(ext_req_id, conn, PREFILL_REQUEST.initial)
        return []

    def schedule_chunk(self, chunk: Chunk, now: float) -> list[Output]:
        """Schedule a request's blocks of the current step (before its first layer).

        A chunk for a request that is already failing or aborting is ignored. Raises
        :class:`LocalProtocolError` for an unknown request, a chunk after the step's first
        layer, a second chunk of one request in a step, or a negative offset or block id.
        """
        del now  # scheduling starts no deadline
        ext_req_id = chunk.ext_req_id
        req = self._requests.get(ext_req_id)
        if req is None:
            raise LocalProtocolError(f"request {ext_req_id!r} is not registered")
        if self._step_layers:
            raise LocalProtocolError(
                f"request {ext_req_id!r}: chunks must be scheduled before the step's first "
                f"layer_written ({self._step_layers} layers are written already)"
            )
        if ext_req_id in self._step.get(req.conn.name, ()):
            raise LocalProtocolError(f"request {ext_req_id!r} is scheduled twice in one step")
        if chunk.main_start < 0 or chunk.indexer_start < 0:
            raise LocalProtocolError(
                f"request {ext_req_id!r}: start blocks must be >= 0, got "
                f"main {chunk.main_start}, indexer {chunk.indexer_start}"
            )
        main = list(chunk.main_block_ids)
        indexer = list(chunk.indexer_block_ids)
        if (main and min(main) < 0) or (indexer and min(indexer) < 0):
            raise LocalProtocolError(f"request {ext_req_id!r}: block ids must be >= 0")
        event = R_LOCAL_FINAL_CHUNK if chunk.final else R_LOCAL_CHUNK
        _REQUEST.fire(self, req, event, chunk, main, indexer)
        return []

    # The request machine's chunk effects: (req, chunk, main, indexer); ``ignore``: the
    # scheduler does not know we stopped, its chunks for an ending request are moot.

    def _fx_schedule(
        self, req: _Request, chunk: Chunk, main: list[int], indexer: list[int]
    ) -> None:
        if main or indexer:
            req.chunk = ReadReq(req.ext_id, main, indexer, chunk.main_start, chunk.indexer_start)
        self._step.setdefault(req.conn.name, {})[req.ext_id] = req
        self._step_count += 1

    def can_overwrite(self, layer_idx: int) -> bool:
        """Whether the storage layer ``layer_idx`` writes is free (all its gates open).

        Under policy "raise", a read failure recorded against that storage raises
        :class:`TransferError` here, once.
        """
        slots = self._slots_of(layer_idx)
        if self._pending_raise:
            failures = [self._pending_raise.pop(s) for s in slots if s in self._pending_raise]
            if failures:
                raise TransferError(f"layer {layer_idx}: " + "; ".join(failures))
        gates = self._gates
        return all(gates[s].state == GATE_OPEN for s in slots)

    def layer_written(self, layer_idx: int, now: float) -> list[Output]:
        """Layer ``layer_idx`` of the current step is in storage: publish it.

        One readiness per Decode endpoint with something in the step (its contributor
        identity from that endpoint's TP size; done ids on the last layer), each leased
        until ``now + lease``; the layer's gates close until every one has ended.
        Raises :class:`LocalProtocolError` if the storage is still in use (the runtime
        must wait for :meth:`can_overwrite`) or the layer is not after the step's last.
        """
        slots = self._slots_of(layer_idx)
        if layer_idx <= self._step_top:
            raise LocalProtocolError(
                f"layer {layer_idx} written after layer {self._step_top} in the same step; "
                "layers are written once each, in increasing order"
            )
        busy = [s for s in slots if self._gates[s].state != GATE_OPEN]
        if busy:
            raise LocalProtocolError(
                f"layer {layer_idx} was written while its storage slots {busy} are still "
                f"being read; wait for can_overwrite({layer_idx})"
            )
        self._step_layers += 1
        self._step_top = layer_idx
        for s in slots:
            self._pending_raise.pop(s, None)  # that storage holds new data now
        out: list[Output] = []
        last = layer_idx == self._last_layer
        deadline = now + self._lease_s
        pubs: list[_Pub] = []
        for reqs in self._step.values():
            read_reqs: list[ReadReq] = []
            done: list[str] = []
            named: list[_Request] = []
            for req in reqs.values():
                state = req.state
                if state not in REQ_PUBLISHING:
                    continue  # failing or aborting: stop publishing it
                chunk = req.chunk
                if chunk is not None:
                    read_reqs.append(chunk)
                if last and state == REQ_FINAL_SCHEDULED:
                    done.append(req.ext_id)
                    _REQUEST.fire(self, req, R_SEND_DONE)
                elif chunk is None:
                    continue
                named.append(req)
            if named:
                pubs.append(self._publish(layer_idx, slots, read_reqs, done, named, deadline))
        # Every publication holds the gates before any connection acts on its own, so a
        # refused connection releasing its share never reports a gate the others still hold.
        for pub in pubs:
            self._conn_publish(pub, now, out)
        return out

    def end_step(self, now: float) -> list[Output]:
        """The step is over. Requests whose chunk missed a layer fail (their data is
        incomplete on Decode); the step's chunks are forgotten."""
        del now  # ending a step starts no deadline
        out: list[Output] = []
        missing = len(self._layer_names) - self._step_layers
        for reqs in list(self._step.values()):
            for req in list(reqs.values()):
                req.chunk = None
                if missing and req.state in _STILL_READ:
                    self._fail(
                        req,
                        R_LOCAL_FAILURE,
                        ErrorCode.STEP_INCOMPLETE,
                        f"the step ended with {missing} of {len(self._layer_names)} layers "
                        "not written",
                    )
                    self._maybe_drain(req, out)
        self._step.clear()
        self._step_count = 0
        self._step_layers = 0
        self._step_top = -1
        return out

    def abort(self, ext_ids: Iterable[str], reason: str, now: float) -> list[Output]:
        """Stop publishing these requests and tell their v2 Decode endpoints why.

        Unknown (or already finished) ids are ignored. Each request finishes (aborted,
        with ``reason`` as its message) once the publications already out for it have
        ended.
        """
        del now
        out: list[Output] = []
        by_conn: dict[str, list[str]] = {}
        touched: list[_Request] = []
        for ext_id in ext_ids:
            req = self._requests.get(ext_id)
            if req is None:
                continue
            _REQUEST.fire(self, req, R_LOCAL_ABORT, reason, by_conn)
            touched.append(req)
        for name, ids in by_conn.items():
            self._send_abort(self._conns[name], ids, reason, out)
        for req in touched:
            self._maybe_drain(req, out)
        return out

    def connection_lost(self, conn: str, now: float) -> list[Output]:
        """The runtime's heartbeat declared Decode endpoint ``conn`` dead.

        Every publication out on it fails its requests now (``CONNECTION_LOST``); a v2
        peer is sent an ABORT for them, best effort, since it may come back. Their storage
        gates reopen only once their lease has run out as well (at once for a lease that
        ran out already), or when a reply comes after all: see "Dead peers" in the module
        docstring for why the lease is still required. Readiness that waited for the
        handshake is released, and the connection returns to idle, so the next
        publication starts a fresh handshake, preceded by a :class:`Connect` (the runtime
        may have replaced the DEALER); any refusal backoff is forgotten. Frames that still
        arrive on ``conn`` are handled as before. Raises :class:`LocalProtocolError` for a
        name this endpoint never opened.
        """
        c = self._conns.get(conn)
        if c is None:
            raise LocalProtocolError(f"connection {conn!r} is not a Decode endpoint of ours")
        self.stats.connections_lost += 1
        out: list[Output] = []
        message = f"the connection to Decode endpoint {conn} was lost"
        orphans: list[_Pub] = []
        # Held ones (lease ran out AND the peer is dead) end as they are met; what their
        # gates say goes out after the orphans' ABORT.
        reopened: list[Output] = []
        for pub in list(c.sent.values()):
            _PUB.fire(
                self,
                pub,
                P_LOCAL_CONNECTION_LOST,
                now,
                reopened,
                G_LOCAL_PEER_DEAD,
                G_LOCAL_LAST_PEER_DEAD,
                orphans,
            )
        if orphans and self._can_abort_now(c):
            ids = [r.ext_id for p in orphans for r in p.requests if not r.aborted_toward_peer]
            if ids:
                self._emit_abort(c, list(dict.fromkeys(ids)), "Prefill lost the connection", out)
        for pub in orphans:
            self._fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.CONNECTION_LOST, message, {})
        out.extend(reopened)
        for pub in orphans:  # the requests end now, the gates at the lease
            self._drain_pub(pub, out)
        _CONN.fire(self, c, C_LOCAL_CONNECTION_LOST, now, out, None, message)
        return out

    def _fx_reset(self, c: _Conn, now: float, out: list[Output], _pub: None, message: str) -> None:
        """Forget the handshake (the peer that comes back is a new process), fail what
        waited for it."""
        self._end_handshake(c)
        c.refusals, c.retry_at, c.refusal = 0, 0.0, ""
        c.reconnect = c.connected
        self._fail_queued(c, ErrorCode.CONNECTION_LOST, message, out)

    def _fx_orphan(
        self,
        pub: _Pub,
        _now: float,
        _out: list[Output],
        _one: str,
        _last: str,
        orphans: list[_Pub],
    ) -> None:
        """Peer dead, lease still running: its requests fail now, its gates wait."""
        orphans.append(pub)

    def connection_resumed(self, conn: str, now: float) -> list[Output]:
        """The connection to Decode endpoint ``conn`` broke and came back, to the same peer.

        The runtime calls this when its transport reconnected within the grace it gives a
        broken connection (ZMQ reconnects by itself; the peer keeps its state). Frames in
        flight either way may have been lost with the old connection: a readiness that
        never arrived, or a reply that was sent into it. Every publication still waiting
        for its reply on ``conn`` is sent again, under the seq it had and in seq order, to
        a peer with the ``resend`` capability: that peer answers a seq it has served from
        memory (and reads only one it never received), so nothing is read twice. Toward
        any other peer nothing is sent; its leases bound the wait. Nor is a live
        publication whose lease has run out (its lease timer ends it): Decode could start
        that read after its storage reopened. A held one is (only a reply frees it).
        Raises :class:`LocalProtocolError` for a name this endpoint never opened.
        """
        c = self._conns.get(conn)
        if c is None:
            raise LocalProtocolError(f"connection {conn!r} is not a Decode endpoint of ours")
        out: list[Output] = []
        self._resend(c, list(c.sent.values()), now, out)
        return out

    # -- peer input ------------------------------------------------------------------------

    def receive(
        self, conn: str, frame: Message | bytes | bytearray | memoryview, now: float
    ) -> list[Output]:
        """Handle one frame (or decoded message) from Decode endpoint ``conn``.

        Never raises for peer input: malformed, unexpected, unknown, stale and duplicate
        input is counted in :attr:`stats` and changes nothing. Input that no table allows
        (none does today: every reply, ACK and ABORT has its row) is a protocol violation:
        the peer is declared dead, as h2 closes a connection on one (a :class:`Disconnect`
        saying why, then what :meth:`connection_lost` does).
        """
        if isinstance(frame, bytes | bytearray | memoryview):
            try:
                msg = decode(frame)
            except RemoteProtocolError:
                self.stats.malformed_frames += 1
                return []
        else:
            msg = frame
        c = self._conns.get(conn)
        if c is None or not c.connected:  # not a connection we opened
            self.stats.unexpected_messages += 1
            return []
        if self.config.silent_peer_timeout_s is not None:  # (kept only where it is used)
            c.last_heard = now
        out: list[Output] = []
        try:
            if isinstance(msg, ReadDone):
                self._on_reply(c, msg.layer_idx, msg.seq, P_RECV_DONE, now, out, msg.failed)
            elif isinstance(msg, ReadFailed):
                self._on_read_failed(c, msg, now, out)
            elif isinstance(msg, Ack):
                self._on_ack(c, msg, now, out)
            elif isinstance(msg, Abort):
                self._on_abort(c, msg, out)
            else:
                self.stats.unexpected_messages += 1
        except RemoteProtocolError as exc:
            self.stats.protocol_violations += 1
            out.append(Disconnect(conn, f"protocol violation: {exc.message}"))
            out.extend(self.connection_lost(conn, now))
        return out

    # -- time ------------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """The earliest deadline (lease or handshake), or None when nothing is pending."""
        timers = self._timers
        while timers:
            _, uid = timers[0]
            if uid in self._pubs or uid in self._handshakes:
                return timers[0][0]
            heapq.heappop(timers)
        return None

    def handle_timer(self, now: float) -> list[Output]:
        """Handle every deadline at or before ``now``.

        An expired lease sends ABORT for the publication's requests to a v2 peer, THEN
        reopens the gates, then fails the requests. When no ABORT can go out now (a v1
        peer, or a handshake in progress) the requests fail and the publication is held:
        its gates stay closed (see the module docstring). An expired handshake releases
        the readiness queued on that connection.
        """
        out: list[Output] = []
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, uid = heapq.heappop(timers)
            pub = self._pubs.get(uid)
            if pub is not None:
                self._expire(pub, now, out)
                continue
            conn = self._handshakes.pop(uid, None)
            if conn is not None:
                self.stats.handshake_timeouts += 1
                message = (
                    f"handshake with {conn.name} timed out after "
                    f"{self.config.handshake_timeout_s} s"
                )
                _CONN.fire(self, conn, C_TIMER_HANDSHAKE_EXPIRED, now, out, None, message)
        return out

    def _fx_fail_queued(
        self, conn: _Conn, now: float, out: list[Output], _pub: None, message: str
    ) -> None:
        """The handshake timed out: release the readiness queued for it."""
        self._fail_queued(conn, ErrorCode.TIMEOUT, message, out)
        self._settle_held(conn, now, out)

    # -- views for invariant checks --------------------------------------------------------

    def gates(self) -> dict[int, tuple[str, int]]:
        """``{slot: (state, outstanding publications)}``."""
        return {slot: (g.state, g.outstanding) for slot, g in self._gates.items()}

    def layer_slots(self, layer_idx: int) -> tuple[int, ...]:
        """The storage slots layer ``layer_idx`` writes (main, then indexer if any)."""
        return self._slots_of(layer_idx)

    def requests(self) -> dict[str, str]:
        """``{ext_id: state}`` of every request not yet finished."""
        return {ext_id: req.state for ext_id, req in self._requests.items()}

    def publications(self) -> dict[int, PublicationView]:
        """Every live (not yet ended) publication."""
        return {
            uid: PublicationView(
                pub.conn.name,
                pub.layer_idx,
                pub.state,
                pub.seq,
                pub.slots,
                tuple(r.ext_id for r in pub.requests),
                pub.deadline,
            )
            for uid, pub in self._pubs.items()
        }

    def connections(self) -> dict[str, str]:
        """``{conn: handshake state}``."""
        return {name: c.state for name, c in self._conns.items()}

    def negotiated(self, conn: str) -> ConnectionView:
        """The protocol and capabilities negotiated on connection ``conn``.

        Raises :class:`LocalProtocolError` for a connection this endpoint never opened.
        """
        c = self._conns.get(conn)
        if c is None:
            raise LocalProtocolError(f"connection {conn!r} is not a Decode endpoint of ours")
        return ConnectionView.of(
            c.name, c.state, c.caps, v2_state=CONN_READY_V2, v1_state=CONN_READY_V1
        )

    def is_idle(self) -> bool:
        """True when no per-request state is left (no request, publication or chunk)."""
        return not self._requests and not self._pubs and not self._step_count

    # -- internals: requests and connections -----------------------------------------------

    def _slots_of(self, layer_idx: int) -> tuple[int, ...]:
        if not 0 <= layer_idx <= self._last_layer:
            raise LocalProtocolError(f"layer index {layer_idx} is outside [0, {self._last_layer}]")
        return self._layer_slots[layer_idx]

    def _conn_for(self, target: DecodeTarget) -> _Conn:
        contributor = map_prefill_rank(self.config.p_rank, self.config.p_tp, target.d_tp)
        port = decode_rank_port(target.base_port, contributor.d_rank, target.d_tp)
        name = f"{target.host}:{port}"
        conn = self._conns.get(name)
        if conn is None:
            conn = _Conn(name, target.host, port, target.d_tp, contributor)
            self._conns[name] = conn
        elif conn.d_tp != target.d_tp:
            raise TopologyError(
                f"Decode endpoint {name} was announced with TP size {conn.d_tp}, "
                f"now with {target.d_tp}"
            )
        return conn

    def _fx_send_abort(self, req: _Request, reason: str, by_conn: dict[str, list[str]]) -> None:
        """Our abort: record it and tell the peer (one ABORT per connection, by the caller)."""
        req.code, req.message = ErrorCode.ABORTED, reason
        by_conn.setdefault(req.conn.name, []).append(req.ext_id)

    def _fail(self, req: _Request, event: str, code: ErrorCode, message: str) -> None:
        _REQUEST.fire(self, req, event, code, message)

    def _fx_record_failure(self, req: _Request, code: ErrorCode, message: str) -> None:
        """The first reason to stop is the one reported (later ones stay: no effect)."""
        req.code, req.message = code, message

    def _maybe_drain(self, req: _Request, out: list[Output]) -> None:
        if req.outstanding or req.state not in _DRAINABLE:
            return
        _REQUEST.fire(self, req, R_LOCAL_DRAINED, out)

    def _fx_finish(self, req: _Request, out: list[Output]) -> None:
        """Drained: no publication names it any more; RequestFinished frees its blocks."""
        ok = req.state == REQ_COMPLETE
        del self._requests[req.ext_id]
        step = self._step.get(req.conn.name)
        if step is not None and step.pop(req.ext_id, None) is not None:
            self._step_count -= 1
        if ok:
            out.append(RequestFinished(req.ext_id, True, None, ""))
        else:
            out.append(RequestFinished(req.ext_id, False, req.code, req.message))

    def _send_abort(self, conn: _Conn, ext_ids: list[str], reason: str, out: list[Output]) -> None:
        """ABORT toward a v2 peer that understands it; queued while a handshake runs.

        A v1 peer (or a connection that never started a handshake) cannot be told. A
        queued ABORT does not count as sent: a lease that runs out meanwhile is held.
        """
        if self._can_abort_now(conn):
            self._emit_abort(conn, ext_ids, reason, out)
        elif conn.state == CONN_HANDSHAKING and not self._v1_only:
            conn.pending_aborts.extend(ext_ids)

    def _can_abort_now(self, conn: _Conn) -> bool:
        return conn.state == CONN_READY_V2 and CAP_ABORT in conn.caps

    def _abort_frees_storage(self, conn: _Conn) -> bool:
        """Whether an ABORT sent now makes a lapsed publication's storage free: only toward
        a peer whose reads the lease bounds (it starts none with less than half of the
        lease left and ends each by the deadline). A peer without ``lease`` may start a
        read it was sent long ago at any time: its storage waits for the reply."""
        return self._can_abort_now(conn) and CAP_LEASE in conn.caps

    def _emit_abort(self, conn: _Conn, ext_ids: list[str], reason: str, out: list[Output]) -> None:
        out.append(Send(conn.name, Abort(ext_ids=list(ext_ids), reason=reason)))
        self.stats.aborts_sent += 1
        for ext_id in ext_ids:
            req = self._requests.get(ext_id)
            if req is not None:  # a held lease's requests are finished already
                req.aborted_toward_peer = True

    def _start_handshake(self, conn: _Conn, now: float, out: list[Output]) -> None:
        if not conn.connected or conn.reconnect:
            conn.connected, conn.reconnect = True, False
            out.append(Connect(conn.name, conn.host, conn.port))
        meta = self._meta
        if meta.protocol_version is not None:
            # Readiness seqs are consecutive per connection; say where they resume.
            meta = msgspec.structs.replace(meta, first_seq=conn.next_seq)
        out.append(Send(conn.name, meta))
        self.stats.handshakes += 1
        token = self._uid()
        conn.handshake_token = token
        self._handshakes[token] = conn
        heapq.heappush(self._timers, (now + self.config.handshake_timeout_s, token))

    def _end_handshake(self, conn: _Conn) -> None:
        self._handshakes.pop(conn.handshake_token, None)

    def _on_ack(self, conn: _Conn, ack: Ack, now: float, out: list[Output]) -> None:
        if not ack.is_v1 and ack.error_code:
            event = C_RECV_ACK_REFUSED
        elif ack.is_v1 or self._v1_only:
            event = C_RECV_ACK_V1
        else:
            event = C_RECV_ACK_V2
        _CONN.fire(self, conn, event, now, out, None, ack, error=RemoteProtocolError)

    def _fx_count_stray_ack(self, conn: _Conn, *_args: object) -> None:
        """An ACK no handshake waits for (a duplicate, or after a timeout): counted."""
        self.stats.dropped += 1

    def _fx_refused(self, conn: _Conn, now: float, out: list[Output], _pub: None, ack: Ack) -> None:
        """Refused: back off (doubling per refusal), fail the readiness queued for it."""
        self._end_handshake(conn)
        self.stats.handshakes_refused += 1
        conn.caps = frozenset()
        cfg = self.config
        conn.refusals += 1
        backoff = min(
            cfg.refused_retry_s * 2.0 ** min(conn.refusals - 1, 32), cfg.refused_retry_max_s
        )
        conn.retry_at = now + backoff
        conn.refusal = (
            f"Decode endpoint {conn.name} refused the handshake "
            f"(code {ack.error_code}): {ack.error or 'no reason given'}"
        )
        self._fail_queued(conn, ErrorCode.INCOMPATIBLE, conn.refusal, out)
        self._settle_held(conn, now, out)

    def _fx_flush(self, conn: _Conn, now: float, out: list[Output], _pub: None, ack: Ack) -> None:
        """Ready: send the readiness queued for the handshake, then the ABORTs."""
        self._end_handshake(conn)
        conn.refusals = 0
        if conn.state == CONN_READY_V2:
            conn.caps = frozenset(ack.capabilities or ()) & frozenset(ALL_CAPABILITIES)
        else:
            conn.caps = frozenset()
        # A publication whose lease ran out while the handshake ran is expired, not sent: it
        # would carry lease_ms 0, so the Decode could start reading it on arrival while our
        # lease timer, already due, reopens its storage for the next layer.
        for pub in [p for p in conn.queue if int((p.deadline - now) * 1000) <= 0]:
            self.stats.expired_leases += 1
            _PUB.fire(self, pub, P_LOCAL_LEASE_LAPSED, now, out, None, None)
        queue, conn.queue = conn.queue, []
        for pub in queue:
            self._send(pub, now, out)
        aborts, conn.pending_aborts = conn.pending_aborts, []
        if aborts and self._can_abort_now(conn):
            self._emit_abort(conn, aborts, "aborted by Prefill", out)
        self._settle_held(conn, now, out, told=aborts)

    def _settle_held(
        self, conn: _Conn, now: float, out: list[Output], told: Iterable[str] = ()
    ) -> None:
        """A handshake ended: deliver the ABORTs held publications wait for, if we can.

        Toward a peer that can be told now, the ABORT goes out, THEN their gates reopen.
        Otherwise, under "reopen", they reopen untold (unsafe); under "hold" they stay, and
        a connection left idle by a timeout tries a new handshake at once (the ABORT is the
        only way out short of a reply or the peer's declared death). ``told``: ids an ABORT
        emitted by this same handshake named already.
        """
        held = [p for p in conn.sent.values() if p.state == PUB_HELD and p.abort_ids]
        if not held:
            return
        if self._can_abort_now(conn) and not self._abort_frees_storage(conn):
            # A peer without leases: told to stop, the storage waits for its replies.
            ids = [i for p in held for i in p.abort_ids if i not in set(told)]
            for p in held:
                p.abort_ids = []
            if ids:
                self._emit_abort(conn, list(dict.fromkeys(ids)), "lease expired", out)
            return
        if self._can_abort_now(conn):
            skip = set(told)
            ids = [i for p in held for i in p.abort_ids if i not in skip]
            if ids:
                reason = "lease expired while the handshake ran"
                self._emit_abort(conn, list(dict.fromkeys(ids)), reason, out)
            event, one, last = P_LOCAL_ABORT_SENT, G_LOCAL_ABORT_SENT, G_LOCAL_LAST_ABORT_SENT
        elif self.config.v1_lease_expiry == "reopen":
            self.stats.unsafe_reopens += len(held)
            event, one, last = (
                P_LOCAL_REOPEN_UNSAFE,
                G_LOCAL_REOPEN_UNSAFE,
                G_LOCAL_LAST_REOPEN_UNSAFE,
            )
        else:
            self._retry_for_held_aborts(conn, now, out)
            return
        for pub in held:
            _PUB.fire(self, pub, event, now, out, one, last)

    def _retry_for_held_aborts(self, conn: _Conn, now: float, out: list[Output]) -> None:
        """Start a handshake for held ABORTs on an idle connection whose peer can take them."""
        if conn.state == CONN_IDLE and CAP_ABORT in conn.caps:
            self.stats.handshake_retries += 1
            _CONN.fire(self, conn, C_LOCAL_HELD_ABORTS, now, out, None)

    def _fail_queued(self, conn: _Conn, code: ErrorCode, message: str, out: list[Output]) -> None:
        """Release the readiness that never left: nothing can read it, the gates reopen."""
        queue, conn.queue = conn.queue, []
        conn.pending_aborts = []
        for pub in queue:  # (release needs no time: 0.0 stands for ``now``)
            _PUB.fire(
                self,
                pub,
                P_LOCAL_RELEASE,
                0.0,
                out,
                G_LOCAL_RELEASE,
                G_LOCAL_LAST_RELEASE,
                code,
                message,
            )

    def _fx_release(
        self,
        pub: _Pub,
        _now: float,
        out: list[Output],
        one: str,
        last: str,
        code: ErrorCode,
        message: str,
    ) -> None:
        """Never left (the handshake failed): nothing can read it, the gates reopen."""
        self._fail_requests(pub, R_LOCAL_FAILURE, code, message, {})
        self._end_pub(pub, out, one, last)

    def _on_abort(self, conn: _Conn, msg: Abort, out: list[Output]) -> None:
        self.stats.aborts_received += 1
        for ext_id in msg.ext_ids:
            req = self._requests.get(ext_id)
            if req is None or req.conn is not conn:
                continue  # finished already, or not this peer's request to abort
            _REQUEST.fire(self, req, R_RECV_ABORT, conn, msg, error=RemoteProtocolError)
            self._maybe_drain(req, out)

    def _fx_stop(self, req: _Request, conn: _Conn, msg: Abort) -> None:
        """The Decode aborted it: stop publishing it (nothing to tell the peer)."""
        req.code = ErrorCode.ABORTED
        req.message = f"aborted by Decode {conn.name}: {msg.reason}"

    # -- internals: publications -----------------------------------------------------------

    def _uid(self) -> int:
        uid = self._next_uid
        self._next_uid += 1
        return uid

    def _publish(
        self,
        layer_idx: int,
        slots: tuple[int, ...],
        read_reqs: list[ReadReq],
        done: list[str],
        named: list[_Request],
        deadline: float,
    ) -> _Pub:
        uid = self._uid()
        pub = _Pub(uid, named[0].conn, layer_idx, slots, read_reqs, done, tuple(named), deadline)
        self._pubs[uid] = pub
        for req in named:
            req.outstanding += 1
        for s in slots:
            gate = self._gates[s]
            _GATE.fire(self, gate, G_LOCAL_PUBLISH, s, None)
            gate.outstanding += 1
        heapq.heappush(self._timers, (deadline, uid))
        self.stats.publications += 1
        return pub

    def _conn_publish(self, pub: _Pub, now: float, out: list[Output]) -> None:
        conn = pub.conn
        event = C_LOCAL_PUBLISH
        if conn.state == CONN_REFUSED and now >= conn.retry_at:
            event = C_LOCAL_PUBLISH_RETRY  # the backoff has passed: try a fresh MF_META
            self.stats.handshake_retries += 1
        _CONN.fire(self, conn, event, now, out, pub)

    # The connection machine's publish effects: (conn, now, out, pub or None).

    def _fx_conn_send(self, conn: _Conn, now: float, out: list[Output], pub: _Pub) -> None:
        self._send(pub, now, out)

    def _fx_conn_release(self, conn: _Conn, now: float, out: list[Output], pub: _Pub) -> None:
        """Refused, backoff running: nothing will be read, fail it at once."""
        conn.queue.append(pub)
        self._fail_queued(
            conn,
            ErrorCode.INCOMPATIBLE,
            f"{conn.refusal}; next handshake attempt in {conn.retry_at - now:.1f} s",
            out,
        )

    def _fx_send_meta(
        self, conn: _Conn, now: float, out: list[Output], pub: _Pub | None, *_rest: object
    ) -> None:
        """Start a handshake; the publication (if any) waits for it in this queue."""
        self._start_handshake(conn, now, out)
        if pub is not None:
            conn.queue.append(pub)

    def _fx_queue(self, conn: _Conn, now: float, out: list[Output], pub: _Pub | None) -> None:
        """A handshake runs: the publication (if any) waits for it in this queue."""
        if pub is not None:
            conn.queue.append(pub)

    def _send(self, pub: _Pub, now: float, out: list[Output]) -> None:
        """Put a publication on the wire (first time or replay) with a fresh seq."""
        _PUB.fire(self, pub, P_SEND_READINESS, now, out, None, None)

    def _fx_send(self, pub: _Pub, now: float, out: list[Output], _one: None, _last: None) -> None:
        if pub.state == PUB_REPLAYED:
            self.stats.replays += 1
        conn = pub.conn
        seq = conn.next_seq
        conn.next_seq += 1
        pub.seq = seq
        pub.sent_at = now
        conn.sent[seq] = pub
        out.append(Send(conn.name, self._readiness(pub, now)))

    def _readiness(self, pub: _Pub, now: float) -> ReadReadyBatch:
        """The readiness of ``pub`` as it goes out now (its seq, what is left of its lease)."""
        conn = pub.conn
        caps = conn.caps
        read_reqs = pub.read_reqs
        done = pub.done_ids
        if any(r.state not in _STILL_READ for r in pub.requests):
            # Some stopped while this waited for the handshake: do not publish them.
            live = {r.ext_id for r in pub.requests if r.state in _STILL_READ}
            read_reqs = [r for r in read_reqs if r.ext_req_id in live]
            done = [d for d in done if d in live]
        contributor = conn.contributor
        return ReadReadyBatch(
            layer_idx=self._wire_index[pub.layer_idx],
            layer_name=self._layer_names[pub.layer_idx],
            read_reqs=read_reqs,
            done_ext_ids=done,
            group_member_idx=contributor.group_member_idx,
            tp_ratio=contributor.tp_ratio,
            seq=pub.seq if CAP_SEQ in caps else None,
            lease_ms=_lease_ms_left(pub, now) if CAP_LEASE in caps else None,
        )

    def _resend(self, conn: _Conn, pubs: list[_Pub], now: float, out: list[Output]) -> None:
        """Send ``pubs`` again under their seqs, in order, if ``conn``'s peer has ``resend``
        and the connection is ready; skip a live one whose lease has run out."""
        if CAP_RESEND not in conn.caps or conn.state != CONN_READY_V2:
            return
        for pub in pubs:
            if pub.state != PUB_HELD and CAP_LEASE in conn.caps and _lease_ms_left(pub, now) == 0:
                continue  # the peer could start it after the lease timer reopened the storage
            _PUB.fire(self, pub, P_LOCAL_RESEND, now, out, None, None)

    def _fx_resend(self, pub: _Pub, now: float, out: list[Output], _one: None, _last: None) -> None:
        """Sent again under the same seq (the peer answers a repeated seq from memory)."""
        self.stats.resent += 1
        out.append(Send(pub.conn.name, self._readiness(pub, now)))

    def _forget_seq(self, pub: _Pub) -> None:
        """Move a publication's seq from the wire map into the bounded history."""
        seq = pub.seq
        if seq is None:
            return
        conn = pub.conn
        del conn.sent[seq]
        pub.seq = None
        limit = self.config.history
        if limit:
            history = conn.history
            history[seq] = (pub.layer_idx, pub.state)
            if len(history) > limit:
                history.popitem(last=False)

    def _find(self, conn: _Conn, layer_idx: int, seq: int | None) -> _Pub | str | None:
        """The live publication a reply answers, else the state it ended in, else None."""
        if seq is not None and CAP_SEQ in conn.caps:
            pub = conn.sent.get(seq)
            if pub is not None:
                return pub if pub.layer_idx == layer_idx else None
            ended = conn.history.get(seq)
            return ended[1] if ended is not None and ended[0] == layer_idx else None
        # No seq (v1 peer): the oldest publication of that layer on this connection.
        for pub in conn.sent.values():
            if pub.layer_idx == layer_idx:
                return pub
        for ended_layer, state in reversed(conn.history.values()):
            if ended_layer == layer_idx:
                return state
        return None

    def _on_read_failed(self, conn: _Conn, msg: ReadFailed, now: float, out: list[Output]) -> None:
        if (
            msg.code == ErrorCode.UNKNOWN_SESSION
            and CAP_RECONNECT in conn.caps
            and conn.state in (CONN_READY_V2, CONN_HANDSHAKING)
        ):
            event = P_RECV_UNKNOWN_SESSION
        else:
            event = P_RECV_FAILED
        self._on_reply(conn, msg.layer_idx, msg.seq, event, now, out, None, msg)

    def _on_reply(
        self,
        conn: _Conn,
        wire_layer: int,
        seq: int | None,
        event: str,
        now: float,
        out: list[Output],
        failed: list[FailedRequest] | None = None,
        read_failed: ReadFailed | None = None,
    ) -> None:
        position = self._position_of_wire.get(wire_layer, -1)  # -1: no layer of ours
        found = self._find(conn, position, seq)
        if found is None:
            self.stats.unknown_replies += 1
            return
        if isinstance(found, str):  # ended: the table says duplicate or stale
            _PUB.react(self, None, found, event, error=RemoteProtocolError)
            return
        self.stats.replies += 1
        _PUB.fire(
            self,
            found,
            event,
            now,
            out,
            G_RECV_REPLY,
            G_RECV_LAST_REPLY,
            event,
            failed,
            read_failed,
            error=RemoteProtocolError,
        )

    def _fx_count_duplicate(self, _pub: None) -> None:
        """A reply for a publication answered already (or superseded by a replay)."""
        self.stats.duplicate_replies += 1

    def _fx_count_stale(self, _pub: None) -> None:
        """A reply for a publication that ended without one."""
        self.stats.stale_replies += 1

    # The publication machine's other effects: (pub, now, out, one, last, *input context),
    # ``one`` / ``last`` the gate inputs by which ending it now counts it off its gates.

    def _fx_release_held(
        self, pub: _Pub, _now: float, out: list[Output], one: str, last: str, *_rest: object
    ) -> None:
        """Held or orphaned: its requests ended already; now its storage is free too."""
        self._end_pub(pub, out, one, last)

    def _fx_requeue(self, pub: _Pub, now: float, out: list[Output], *_rest: object) -> None:
        """The Decode lost our handshake, read nothing: replay after a new handshake."""
        self._forget_seq(pub)
        _CONN.fire(self, pub.conn, C_RECV_UNKNOWN_SESSION, now, out, pub)

    def _fx_done(
        self,
        pub: _Pub,
        now: float,
        out: list[Output],
        one: str,
        last: str,
        _event: str,
        failed: list[FailedRequest] | None,
        _read_failed: None,
    ) -> None:
        conn = pub.conn
        out.append(LayerReplied(conn.name, pub.layer_idx, now - pub.sent_at, True))
        isolated = {f.ext_req_id: f for f in failed} if failed else {}
        if isolated:
            self.stats.isolated_failures += len(isolated)
        self._fail_requests(pub, R_RECV_FAILURE, ErrorCode.UNKNOWN, "", isolated)
        self._end_pub(pub, out, one, last)

    def _fx_fail(
        self,
        pub: _Pub,
        now: float,
        out: list[Output],
        one: str,
        last: str,
        event: str,
        _failed: None,
        read_failed: ReadFailed,
    ) -> None:
        conn = pub.conn
        out.append(LayerReplied(conn.name, pub.layer_idx, now - pub.sent_at, False))
        self.stats.read_failures += 1
        code = _error_code(read_failed.code, ErrorCode.TRANSFER_FAILED)
        message = read_failed.error or f"read failed ({code.name})"
        self._fail_requests(
            pub,
            R_RECV_FAILURE,
            code,
            f"layer {pub.layer_idx} read by {conn.name} failed: {message}",
            {},
        )
        if event == P_RECV_UNKNOWN_SESSION:
            # The replay met an unknown session too: hand-shake again for later layers.
            _CONN.fire(self, conn, C_RECV_UNKNOWN_SESSION, now, out, None)
        self._end_pub(pub, out, one, last)

    def _fail_requests(
        self,
        pub: _Pub,
        event: str,
        code: ErrorCode,
        message: str,
        only: dict[str, FailedRequest],
    ) -> None:
        """Record a failure on the publication's requests (all of them, or ``only``).

        ``only`` empty and ``message`` empty means nothing failed.
        """
        failed_any = False
        if only:
            for req in pub.requests:
                entry = only.get(req.ext_id)
                if entry is not None:
                    failed_any = True
                    self._fail(
                        req,
                        event,
                        _error_code(entry.code, ErrorCode.UNKNOWN),
                        f"layer {pub.layer_idx}: Decode {pub.conn.name} could not serve it: "
                        f"{entry.message or _error_code(entry.code, ErrorCode.UNKNOWN).name}",
                    )
        elif message:
            failed_any = True
            for req in pub.requests:
                self._fail(req, event, code, message)
        if failed_any and self.config.read_failure_policy == "raise":
            reason = message or f"requests failed on {pub.conn.name}"
            for s in pub.slots:
                self._pending_raise.setdefault(s, reason)

    def _end_pub(self, pub: _Pub, out: list[Output], one: str, last: str) -> None:
        """A publication ended: count it off its gates, then off its requests."""
        self._forget_seq(pub)
        del self._pubs[pub.uid]
        for s in pub.slots:
            gate = self._gates[s]
            gate.outstanding -= 1
            event = one if gate.outstanding else last
            _GATE.fire(self, gate, event, s, out)
        self._drain_pub(pub, out)

    def _fx_reopen(self, _gate: _Gate, slot: int, out: list[Output]) -> None:
        out.append(GateOpened(slot))

    def _drain_pub(self, pub: _Pub, out: list[Output]) -> None:
        requests, pub.requests = pub.requests, ()
        pub.read_reqs, pub.done_ids = [], []
        for req in requests:
            req.outstanding -= 1
            self._maybe_drain(req, out)

    def _expire(self, pub: _Pub, now: float, out: list[Output]) -> None:
        """A lease ran out. Order of outputs: ABORT, THEN reopened gates, then finished
        requests. Without an ABORT to send now the publication is held instead (or, under
        v1_lease_expiry="reopen" toward a peer that can never be told, reopened untold)."""
        conn = pub.conn
        if pub.state == PUB_HELD:  # held, and silent_peer_timeout_s has passed since
            self._check_silence(pub, now, out)
            return
        if pub.state == PUB_ORPHANED:
            # The peer was declared dead before; now its lease has run out as well.
            self._mark_expired(pub)
            _PUB.fire(
                self,
                pub,
                P_TIMER_LEASE_EXPIRED,
                now,
                out,
                G_LOCAL_PEER_DEAD,
                G_LOCAL_LAST_PEER_DEAD,
                (),
            )
            return
        self.stats.expired_leases += 1
        ids = [r.ext_id for r in pub.requests if not r.aborted_toward_peer]
        if pub.seq is None or (
            CAP_LEASE in conn.caps and (not ids or self._abort_frees_storage(conn))
        ):
            # Never on the wire; or, toward a peer the lease bounds, every request told
            # already or the ABORT goes out now.
            event = P_TIMER_LEASE_EXPIRED
        elif CAP_ABORT in conn.caps or self.config.v1_lease_expiry == "hold":
            event = P_TIMER_LEASE_EXPIRED_UNTOLD
        else:
            event = P_TIMER_LEASE_EXPIRED_UNSAFE
        _PUB.fire(self, pub, event, now, out, None, None, ids)

    def _lease_message(self, pub: _Pub) -> str:
        return (
            f"layer {pub.layer_idx}: no reply from {pub.conn.name} within {self.config.lease_ms} ms"
        )

    # The lease effects: (pub, now, out, None, None, ids of its requests not told yet).

    def _fx_expire_unsent(self, pub: _Pub, _now: float, out: list[Output], *_rest: object) -> None:
        """Never sent (or refused unread): nothing can be reading it."""
        pub.conn.queue.remove(pub)
        message = self._lease_message(pub)
        self._fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
        self._end_pub(pub, out, G_LOCAL_RELEASE, G_LOCAL_LAST_RELEASE)

    def _fx_expire_abort(
        self, pub: _Pub, _now: float, out: list[Output], _one: None, _last: None, ids: list[str]
    ) -> None:
        """ABORT, THEN the reopened gates, then the finished requests."""
        if ids:
            self._emit_abort(pub.conn, ids, f"lease of layer {pub.layer_idx} expired", out)
        message = self._lease_message(pub)
        self._fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
        self._mark_expired(pub)
        self._end_pub(pub, out, G_LOCAL_ABORT_SENT, G_LOCAL_LAST_ABORT_SENT)

    def _fx_expire_untold(self, pub: _Pub, _now: float, out: list[Output], *_rest: object) -> None:
        """UNSAFE (v1_lease_expiry="reopen"): reopen without telling the peer."""
        message = self._lease_message(pub)
        self._fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
        self._mark_expired(pub)
        self.stats.unsafe_reopens += 1
        self._end_pub(pub, out, G_LOCAL_REOPEN_UNSAFE, G_LOCAL_LAST_REOPEN_UNSAFE)

    def _fx_hold(
        self, pub: _Pub, now: float, out: list[Output], _one: None, _last: None, ids: list[str]
    ) -> None:
        """No ABORT can go out now: the requests fail, the gates stay closed."""
        conn = pub.conn
        message = self._lease_message(pub)
        self._fail_requests(pub, R_LOCAL_FAILURE, ErrorCode.LEASE_EXPIRED, message, {})
        self._mark_expired(pub)
        self.stats.held_leases += 1
        if self.config.silent_peer_timeout_s is not None:
            pub.held_at = now
            heapq.heappush(self._timers, (now + self.config.silent_peer_timeout_s, pub.uid))
        self._drain_pub(pub, out)  # its requests end now; the gates wait
        if self._can_abort_now(conn) or (CAP_ABORT in conn.caps and not ids):
            # A peer without leases: told to stop, its storage waits for the reply.
            if ids:
                self._emit_abort(conn, ids, f"lease of layer {pub.layer_idx} expired", out)
        else:
            pub.abort_ids = ids
            self._retry_for_held_aborts(conn, now, out)
        # Ask for that reply, which alone frees the storage: the readiness may never
        # have arrived (a peer with ``resend`` serves an unseen seq, now empty, and
        # answers one it saw, or one lost in a gap, from memory).
        self._resend(conn, [pub], now, out)

    def _check_silence(self, pub: _Pub, now: float, out: list[Output]) -> None:
        """A held publication's silence bound came: declare its peer dead if nothing at all
        came from it for that long (since it was held); else wait that long after its last
        frame (it answers, just not this one yet)."""
        timeout = self.config.silent_peer_timeout_s
        assert timeout is not None
        conn = pub.conn
        silent_since = max(conn.last_heard, pub.held_at)
        if now < silent_since + timeout:
            heapq.heappush(self._timers, (silent_since + timeout, pub.uid))
            return
        self.stats.silent_peers += 1
        reason = f"nothing heard for {timeout:.1f} s while it held storage"
        out.append(Disconnect(conn.name, reason))
        out.extend(self.connection_lost(conn.name, now))

    def _mark_expired(self, pub: _Pub) -> None:
        """Tell the publication's gates that its lease ran out (they stay closed)."""
        for s in pub.slots:
            gate = self._gates[s]
            _GATE.fire(self, gate, G_TIMER_LEASE_EXPIRED, s, None)


def _lease_ms_left(pub: _Pub, now: float) -> int:
    """What is left of ``pub``'s lease, as a readiness carries it (0: run out)."""
    return max(0, int((pub.deadline - now) * 1000))


def _error_code(value: int | None, default: ErrorCode) -> ErrorCode:
    """A wire code as an :class:`ErrorCode`; unknown numbers (a newer peer) keep ``default``."""
    if value is None:
        return default
    try:
        return ErrorCode(value)
    except ValueError:
        return default


# -- the tables drive the action: each declared effect bound to its handler ----------------

_GATE: Final = STORAGE_GATE.bind({NO_EFFECT: no_effect, EFFECT_REOPEN: ProducerEndpoint._fx_reopen})
_REQUEST: Final = PREFILL_REQUEST.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_SCHEDULE: ProducerEndpoint._fx_schedule,
        EFFECT_IGNORE: no_effect,
        EFFECT_RECORD_FAILURE: ProducerEndpoint._fx_record_failure,
        EFFECT_SEND_ABORT: ProducerEndpoint._fx_send_abort,
        EFFECT_STOP: ProducerEndpoint._fx_stop,
        EFFECT_FINISH: ProducerEndpoint._fx_finish,
    }
)
_PUB: Final = LAYER_PUBLICATION.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_SEND: ProducerEndpoint._fx_send,
        EFFECT_RESEND: ProducerEndpoint._fx_resend,
        EFFECT_DONE: ProducerEndpoint._fx_done,
        EFFECT_FAIL: ProducerEndpoint._fx_fail,
        EFFECT_REQUEUE: ProducerEndpoint._fx_requeue,
        EFFECT_RELEASE: ProducerEndpoint._fx_release,
        EFFECT_EXPIRE_ABORT: ProducerEndpoint._fx_expire_abort,
        EFFECT_EXPIRE_UNSENT: ProducerEndpoint._fx_expire_unsent,
        EFFECT_EXPIRE_UNTOLD: ProducerEndpoint._fx_expire_untold,
        EFFECT_HOLD: ProducerEndpoint._fx_hold,
        EFFECT_ORPHAN: ProducerEndpoint._fx_orphan,
        EFFECT_RELEASE_HELD: ProducerEndpoint._fx_release_held,
        EFFECT_COUNT_DUPLICATE: ProducerEndpoint._fx_count_duplicate,
        EFFECT_COUNT_STALE: ProducerEndpoint._fx_count_stale,
    }
)
_CONN: Final = CONNECTION_HANDSHAKE.bind(
    {
        EFFECT_SEND_META: ProducerEndpoint._fx_send_meta,
        EFFECT_QUEUE: ProducerEndpoint._fx_queue,
        EFFECT_SEND: ProducerEndpoint._fx_conn_send,
        EFFECT_RELEASE: ProducerEndpoint._fx_conn_release,
        EFFECT_FLUSH: ProducerEndpoint._fx_flush,
        EFFECT_REFUSED: ProducerEndpoint._fx_refused,
        EFFECT_FAIL_QUEUED: ProducerEndpoint._fx_fail_queued,
        EFFECT_RESET: ProducerEndpoint._fx_reset,
        EFFECT_COUNT_STRAY_ACK: ProducerEndpoint._fx_count_stray_ack,
    }
)
