"""What a model world is made of: its configuration, requests, frames and memory layout.

:class:`WorldConfig` says what one world is (topology, timing, peers, the fault budgets
of the explorer); :class:`RequestSpec` is one request of it. The rest is what
:class:`~rd2h_protocol.checker.world.World` keeps per request, per Prefill rank and per
read, the frames on its network, and where its block ids and storage addresses live: in
ranges of their own, so that the symmetry reduction of
:mod:`~rd2h_protocol.checker.canonical` can tell a block id from any other number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, NamedTuple, TypeAlias

from rd2h_protocol.plan import ReadPlan
from rd2h_protocol.producer import ProtocolChoice, V1LeaseExpiry
from rd2h_protocol.wire.layout import DestinationLayout, LayerLayout
from rd2h_protocol.wire.messages import ALL_CAPABILITIES, Message

__all__ = ["Frame", "RequestSpec", "WorldConfig", "layer_name"]

HOST: Final = "127.0.0.1"
BASE_PORT: Final = 20000
PORTS_PER_ENGINE: Final = 16
#: Block ids: Prefill main blocks from ``1 << 20``, Prefill indexer blocks
#: ``INDEXER_ID_OFFSET`` above them (another KV-cache group in vLLM), Decode blocks from
#: ``3 << 20``: three disjoint ranges, above every other number a state holds (layer
#: indices, seqs, uids, lease milliseconds, codes), so that the symmetry reduction can
#: tell a block id from anything else (see :mod:`rd2h_protocol.checker.canonical`).
FIRST_PREFILL_BLOCK: Final = 1 << 20
INDEXER_ID_OFFSET: Final = 1 << 20
FIRST_DECODE_BLOCK: Final = 3 << 20
NUM_PREFILL_BLOCKS: Final = 1 << 22
NUM_DECODE_BLOCKS: Final = 1 << 23
#: Address space per component and per storage (or Decode layer): room for every block.
_COMPONENT_SPAN: Final = 1 << 32
COMPONENTS: Final = ("k", "v", "indexer", "scale")
BLOCK_LEN: Final = (64, 64, 16, 4)
#: The smallest step of time the model takes (after a read's start_by, before a bound).
TICK: Final = 0.001
#: The suffix of the endpoint names of the claim exchange (Prefill-first): a Decode rank's
#: claim client and a Prefill incarnation's claim port, each a connection of its own.
CLAIMS: Final = "#claims"
#: The frame kinds of the claim exchange (JSON frames of :mod:`rd2h_protocol.claim`).
CLAIM_KINDS: Final = frozenset({"Claim", "ClaimAnswer"})
#: What a failed read leaves in the first destination block it touched.
GARBAGE: Final = ("garbage",)

Addr: TypeAlias = tuple[str, str]  # ("P", session) or ("D", "host:port")
Action: TypeAlias = tuple[object, ...]
Value: TypeAlias = tuple[object, ...]
ReplyKey: TypeAlias = tuple[int, int, bytes, int | str]  # engine, rank, peer, seq or layer


class Frame(NamedTuple):
    """One frame in flight. ``deliver_by`` bounds a readiness's delivery (half its lease)."""

    src: Addr
    dst: Addr
    data: bytes
    sent_at: float
    deliver_by: float | None
    kind: str


@dataclass(frozen=True)
class RequestSpec:
    """A request of the model: its Decode engine and its chunks (blocks per chunk)."""

    ext_id: str
    engine: int
    chunks: tuple[int, ...]


@dataclass(frozen=True)
class WorldConfig:
    """The topology, timing and fault budgets of one model world.

    ``engines`` lists the Decode TP size of each Decode engine (each must divide
    ``p_tp``). Layer ``L`` lives in storage ``L % n_storages`` (a reuse ring when there
    are fewer storages than layers). ``requests`` are created at the start (``upfront``:
    also registered on both sides at time 0, in order). ``budgets`` bounds the faults the
    explorer may inject (``drop`` a Decode->Prefill frame, ``dup`` any frame but a
    readiness, ``abort`` on either side, ``prefill_abort``, ``release`` early,
    ``read_fail``, ``kill`` an endpoint, ``break`` a connection (everything in flight on
    it is lost both ways and it comes back: see
    :meth:`~rd2h_protocol.checker.world.World.break_connection`), and ``lose`` a readiness:
    a fault beyond what the protocol claims to survive, for experiments);
    :mod:`rd2h_protocol.checker.stateful` ignores it. ``tick`` (explorer): time moves in
    steps of this many seconds, and only once every due timer fired; use a power of two so
    that time arithmetic stays exact and states that differ only by a shift of time merge.
    ``auto_release``: Decode releases a request the moment it finished on every rank (a
    release before that is then a fault, within the ``release`` budget). ``warmup``: run
    one request per engine to the end first, so that every connection has its handshake.
    ``late_decode``: requests (of ``upfront``) that Decode allocates only later, as an
    action: the rendezvous outran the Decode worker, so their readiness may be parked.

    Peers: ``prefill_protocol`` is every Prefill rank's ``ProducerConfig.protocol`` ("v1"
    speaks v1 on the wire: no seq, no lease, no ABORT), ``v1_lease_expiry`` its
    ``ProducerConfig.v1_lease_expiry`` (``silent_peer_timeout_s`` its own, off here by
    default so that "hold" is proved as such), and ``decode_capabilities`` every Decode rank's
    ``ConsumerConfig.capabilities``. A Decode without ``abort`` is never told to stop,
    one without ``lease`` gets readiness without a lease (it may start a read at any
    time), one without ``seq`` gets readiness without seq (a lost one goes unnoticed).
    The empty set is the closest model of a v1 Decode: Prefill then speaks the v1 shapes
    (readiness without seq or lease, no ABORT) and the Decode answers in v1 shapes; what
    differs from a real v1 Decode is the handshake (its ACK is v2-shaped, with an empty
    capability list, so a refusal would say why) and that it still isolates a failed
    request inside a batch (a v1 Decode fails the whole layer); neither changes what
    Prefill may do with its storage.

    ``expect``: the invariants this configuration breaks by design (e.g. ``("S1",)`` for
    ``v1_lease_expiry="reopen"`` toward a Decode that cannot be told): the explorer then
    explores past each violating state (without expanding it) and the configuration
    passes only if it finds exactly these (see :func:`~rd2h_protocol.checker.explore.explore`).

    Prefill-first (:mod:`rd2h_protocol.claim`): ``prefill_first`` names requests (of
    ``requests``) that a standard router sends to Prefill first, with no Decode named.
    Every Prefill rank computes its prompt in ordinary steps (its layers written, nothing
    published: no Decode is registered for it) and then keeps it
    (``ProducerEndpoint.keep_request``) for ``claim_timeout_s`` (its
    ``ProducerConfig.claim_timeout_s``). Once every rank kept it, the router has
    Prefill's answer and Decode may allocate the request (``decode_add``): each Decode
    rank then sends a claim to each Prefill rank that serves it, over a channel of its
    own (the claim ports, :data:`CLAIMS`); the rank answers, and publishes every layer at
    once when it accepts. A refused answer makes Decode fail the request (a local abort
    on every rank of its engine); a claim or answer that never comes leaves Decode to
    its load timeout (``kv_load_timeout_s``: the runtime's claim client answers a claim
    left unanswered with a refusal too, only later than that in the model's timing, so
    it is not modelled). A claim is a Decode->Prefill frame: ``drop`` loses it
    ("Decode never comes"), ``dup`` delivers it twice ("Decode comes twice"). Keeping
    needs one storage per layer (``n_storages == n_layers``).

    ``duplicate_on_delivery`` (explorer): a ``dup`` delivers the frame and queues a copy
    behind everything its connection holds then, instead of queueing the copy at any
    earlier instant (a reduction: "Duplicates made on delivery" in
    :mod:`~rd2h_protocol.checker.canonical` says what it leaves unexplored).
    """

    p_tp: int = 2
    engines: tuple[int, ...] = (1, 2)
    n_layers: int = 3
    n_storages: int = 2
    requests: tuple[RequestSpec, ...] = ()
    upfront: bool = False
    lease_ms: int = 1000
    handshake_timeout_s: float = 0.6
    park_timeout_s: float = 0.3
    kv_load_timeout_s: float = 4.0
    max_read_retries: int = 1
    fifo: bool = True
    idle_steps: bool = False
    budgets: tuple[tuple[str, int], ...] = ()
    tick: float | None = None
    auto_release: bool = False
    warmup: bool = False
    late_decode: tuple[str, ...] = ()
    prefill_protocol: ProtocolChoice = "v2"
    v1_lease_expiry: V1LeaseExpiry = "hold"
    decode_capabilities: tuple[str, ...] = ALL_CAPABILITIES
    silent_peer_timeout_s: float | None = None
    expect: tuple[str, ...] = ()
    duplicate_on_delivery: bool = True
    prefill_first: tuple[str, ...] = ()
    claim_timeout_s: float = 120.0


@dataclass(slots=True)
class Req:
    spec: RequestSpec
    pmain: list[int]
    pidx: list[int]
    dmain: list[int]
    didx: list[int]
    engine_gen: int
    decode_added: bool = False
    prefill_added: bool = False
    decode_aborted: bool = False
    released: bool = False
    finished: bool = False
    load_error: bool = False
    abandoned: bool = False
    kept_ranks: int = 0  # Prefill-first: Prefill ranks that kept it (all: the router knows)


@dataclass(slots=True)
class Rank:
    session: str
    next_layer: int = 0
    chunks: dict[str, int] = field(default_factory=dict)  # ext id -> chunks scheduled
    # Prefill-first requests whose prompt this incarnation computes, not kept yet: ext id
    # -> chunks computed (no Decode is registered for them: nothing is scheduled).
    computing: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Read:
    plan: ReadPlan
    start_by: float | None
    layer: int


def layer_name(layer: int) -> str:
    """The name of layer ``layer`` (the same on both sides)."""
    return f"model.layers.{layer}.self_attn"


def prefill_bases(storage: int) -> tuple[int, ...]:
    base = (storage + 1) << 40
    return tuple(base + i * _COMPONENT_SPAN for i in range(len(COMPONENTS)))


def decode_bases(layer: int) -> tuple[int, ...]:
    base = (layer + 1) << 48
    return tuple(base + i * _COMPONENT_SPAN for i in range(len(COMPONENTS)))


def frame_kind(msg: Message) -> str:
    return type(msg).__name__


@dataclass
class Static:
    """What a world derives from its config once and never changes (shared by snapshots)."""

    prefill_layers: list[tuple[str, LayerLayout]]
    decode_layers: list[tuple[str, DestinationLayout]]
    layer_index: dict[str, int]
    conn_rank: dict[str, tuple[int, int]]
    # Every permutation of the interchangeable requests, as a renaming (see fingerprint).
    renamings: list[dict[object, object]] | None = None
