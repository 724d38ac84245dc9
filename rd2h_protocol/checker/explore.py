"""The model world of RD2H, and a bounded exhaustive explorer of its interleavings.

Theory of operation
-------------------
:class:`World` wires real :class:`~rd2h_protocol.producer.ProducerEndpoint` s (one per
Prefill TP rank) and :class:`~rd2h_protocol.consumer.ConsumerEndpoint` s (one per Decode
TP rank of every Decode engine) to three things it simulates:

* **the network**: an in-flight list of frames (bytes, through
  :func:`~rd2h_protocol.codec.encode` / :func:`~rd2h_protocol.codec.decode`). What the
  real transport (ZMQ DEALER/ROUTER over TCP) guarantees, and so what the model assumes:
  frames of one connection arrive in order (``WorldConfig.fifo``; frames of different
  connections interleave freely), a frame is never duplicated or corrupted, and frames are
  lost when a peer dies (its connections vanish) or a reconnect drops what was in the
  socket buffers. The model goes further than ZMQ on purpose, to prove robustness: frames
  may be dropped (the explorer drops Decode->Prefill frames, the state machine any frame
  but a readiness) or duplicated (any frame but a readiness) at any time. What the
  protocol does NOT claim to survive, and the model does only when asked (the ``lose``
  budget): a readiness is delivered exactly once (a duplicate read after its publication
  ended would read reused storage; a lost one lets Decode complete a request from its last
  layer alone when the layers live in different storages), and it arrives within half of
  its lease (``recv < sent + lease_ms / 2``: Decode starts a read only while half the
  lease is left since receipt, the protocol's only defence against clock-free reasoning
  going wrong). Time cannot pass that bound while such a frame is in flight.
* **memory**: every Prefill storage tensor holds what the last write put there
  (``(layer, version, owners)``); a read copies, per block, ``(layer, request, logical
  block, component)`` into the Decode destination it names (the K/V pool shared by the
  ranks of an engine, the rank-local indexer and scale). A read is executed atomically
  when the runtime runs it, and refused with ``LEASE_EXPIRED`` past its ``start_by`` (as
  the runtime must). So a read after reuse is not only forbidden by a state check but
  *detected*: Decode got the data of another layer, or of a freed request.
* **the runtime around the endpoints**: the Prefill compute path writes layer ``L`` of a
  step only when ``can_overwrite(L)`` and publishes it; Decode adds requests, aborts and
  releases them; timers fire; endpoints are killed and restarted.

Every input goes through :meth:`World.apply` (an action tuple) or one of the named
methods it dispatches to; the outputs are executed in order and checked as they come
(S1 at every read, S2 at every ``RequestDone`` and at cross-rank completion, S3 at every
``Releasable`` and every destination write), and :meth:`World.check` checks the state
invariants after every step. :meth:`World.settle` runs a fair scheduler (deliver
everything, finish every read, fire every timer, let time pass) until nothing is left;
:meth:`World.check_quiescent` then checks L1 and, after :meth:`World.release_all`,
:meth:`World.check_idle` checks B1. The invariants are those of
:mod:`rd2h_protocol.checker.invariants`; a breach raises :class:`InvariantViolation` naming one.

Subclasses can replace the network (:meth:`World.transmit`, :meth:`World.deliverable`) and
the executor of read plans (:meth:`World.execute_read`) with real transports;
:mod:`rd2h_protocol.checker.stateful` drives the world with hypothesis.

The explorer (``python -m rd2h_protocol.checker.explore``) runs a breadth-first search over every
interleaving of the enabled actions of small configurations (``CONFIGS``), with a budget
for each fault (dropped replies, aborts, early releases, read failures, kills). A state is
a pickle of the world (the endpoints are plain objects, shared configuration left out);
its fingerprint is the hash of a canonical form (see :func:`fingerprint`) in which what
never changes behaviour is left out (dict order, read ids, counters, texts, the history
of finished requests, a shift of every time), so that states reached along different
paths merge. Time moves in ticks once every due timer fired and no compute step is
possible (the network and reads may be slow; timers and compute are prompt). Breadth first
means the first violation found has a shortest trace, which it prints. A state with no
enabled action must satisfy L1 and B1 (no deadlock, nothing left behind).

Peers and expected violations: a configuration may model a v1 Prefill, a Decode with a
subset of the capabilities (none at all models a v1 Decode) and ``v1_lease_expiry``
(see :class:`WorldConfig`). Where an invariant does not hold by design (the
``does_not_hold`` of :mod:`rd2h_protocol.checker.invariants`), the configuration names it in
``expect``: the explorer records the first violation of each expected invariant with a
shortest trace, does not expand that state, and goes on; the configuration passes only
if it finds exactly its expected set (an exploration cut by ``--max-states`` may not find
them all yet) and nothing else. Any other violation stops it at once.

Symmetry reduction
------------------
Requests of the same engine with the same chunks (and both or neither allocated late on
Decode) are interchangeable: the model treats them alike (the endpoints and the world use
request ids as names only; they compare block ids only with bounds that every id of the
model meets and look at a request's own ids only for contiguity, and the ids of every
request are laid out alike: ascending on Prefill, descending on Decode), so a state ``s`` and the
state ``pi(s)`` in which such requests swap names (and block ``j`` of one becomes block
``j`` of the other) have the same futures up to that renaming, and ``pi(s)`` breaks an
invariant iff ``s`` does (the invariants name no particular request; the initial state
registers them in order, which the canonical form already disregards as dict order).
Exploring one state per orbit therefore reaches a state that breaks an invariant iff the
full exploration does. The fingerprint is the least hash of the canonical forms under
every permutation of each class (:func:`fingerprint`): equal fingerprints mean forms that
are equal up to a renaming, i.e. the same orbit. For the renaming to reach every
occurrence, the canonical form writes structs and readiness frames as data (not as
encoded bytes), every text that could embed an id is already left out of it, and block
ids live in ranges of their own (``FIRST_PREFILL_BLOCK``...) above every other number a
state holds (seqs and uids grow by a few per step; the explorer asserts its depth stays
far below), so an int is renamed only if it is a block id. The cost is one canonical
form per permutation (two for two requests).

It is off by default (``--symmetry`` turns it on; ``--compare-reduction`` measures both
ways in one run) because on these configurations it does not pay: the requests travel
together in the same batches, whose lists keep registration order (r0 before r1), so the
mirror of a reachable state is rarely itself reachable, and the merge happens only where a
fault treats the requests differently before they share a batch. Measured on a loaded
2-core machine: ``tp2-d1`` and ``tp2-d2`` (with a lost readiness only) 1.00x fewer states
for 1.4x the CPU time; ``faults``, ``reopen`` and ``no-abort`` 1.19x to 1.24x fewer states
(8356 against 9940, 8762 against 10717, 9773 against 12101) for 1.2x the CPU time. Sorting the
requests inside a batch in the canonical form would merge more, but would need the
endpoints to be provably insensitive to that order, which they are not written to be.

Partial-order reduction is NOT applied: every action reads or moves the shared clock
(deliveries and reads behave differently before and after a lease or timer expires), so
no action is independent of time passing, and an ample set would have to contain the
time step and with it, almost always, everything else.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import multiprocessing
import operator
import os
import pickle
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, NamedTuple, TypeAlias

import msgspec

import rd2h_protocol.completion as completion_module
import rd2h_protocol.consumer as consumer_module
import rd2h_protocol.plan as plan_module
import rd2h_protocol.producer as producer_module
from rd2h_protocol.checker.invariants import (
    InvariantViolation,
    check_done_on_rank,
    check_idle,
    check_quiescent,
    check_read_may_start,
    check_release,
    check_single_outcome,
    check_storage_gates,
)
from rd2h_protocol.codec import decode, encode
from rd2h_protocol.completion import CompletionStats, CrossRankCompletion, RankReport
from rd2h_protocol.consumer import (
    ConsumerConfig,
    ConsumerEndpoint,
    ConsumerStats,
    Releasable,
    Reply,
    RequestDone,
    RequestFailed,
    SendAbort,
    StartRead,
)
from rd2h_protocol.consumer import Output as ConsumerOutput
from rd2h_protocol.errors import ErrorCode, TransferError
from rd2h_protocol.layout import ComponentDest, DestinationLayout, LayerLayout
from rd2h_protocol.messages import (
    ALL_CAPABILITIES,
    Abort,
    Message,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
)
from rd2h_protocol.plan import ComponentAddrs, ReadPlan
from rd2h_protocol.producer import (
    DecodeTarget,
    Disconnect,
    ProducerConfig,
    ProducerEndpoint,
    ProducerStats,
    ProtocolChoice,
    PublicationView,
    RequestFinished,
    Send,
    V1LeaseExpiry,
)
from rd2h_protocol.producer import Output as ProducerOutput

__all__ = [
    "CONFIGS",
    "ExploreResult",
    "Frame",
    "InvariantViolation",
    "RequestSpec",
    "World",
    "WorldConfig",
    "explore",
    "main",
]

HOST: Final = "127.0.0.1"
BASE_PORT: Final = 20000
PORTS_PER_ENGINE: Final = 16
#: Block ids: Prefill main blocks from ``1 << 20``, Prefill indexer blocks
#: ``INDEXER_ID_OFFSET`` above them (another KV-cache group in vLLM), Decode blocks from
#: ``3 << 20``: three disjoint ranges, above every other number a state holds (layer
#: indices, seqs, uids, lease milliseconds, codes), so that the symmetry reduction can
#: tell a block id from anything else (see :func:`fingerprint`).
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
#: What a failed read leaves in the first destination block it touched.
GARBAGE: Final = ("garbage",)

Addr: TypeAlias = tuple[str, str]  # ("P", session) or ("D", "host:port")
Action: TypeAlias = tuple[object, ...]
Value: TypeAlias = tuple[object, ...]
_ReplyKey: TypeAlias = tuple[int, int, bytes, int | str]  # engine, rank, peer, seq or layer


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
    it is lost both ways and it comes back: see :meth:`World.break_connection`), and
    ``lose`` a readiness: a fault beyond what the protocol claims to survive, for
    experiments); :mod:`rd2h_protocol.checker.stateful` ignores it. ``tick`` (explorer): time moves
    in steps of this many seconds, and only once every due timer fired; use a power of two
    so that time arithmetic stays exact and states that differ only by a shift of time merge.
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
    passes only if it finds exactly these (see :func:`explore`).
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


@dataclass(slots=True)
class _Req:
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


@dataclass(slots=True)
class _Rank:
    session: str
    next_layer: int = 0
    chunks: dict[str, int] = field(default_factory=dict)  # ext id -> chunks scheduled


@dataclass(slots=True)
class _Read:
    plan: ReadPlan
    start_by: float | None
    layer: int


def layer_name(layer: int) -> str:
    """The name of layer ``layer`` (the same on both sides)."""
    return f"model.layers.{layer}.self_attn"


def _prefill_bases(storage: int) -> tuple[int, ...]:
    base = (storage + 1) << 40
    return tuple(base + i * _COMPONENT_SPAN for i in range(len(COMPONENTS)))


def _decode_bases(layer: int) -> tuple[int, ...]:
    base = (layer + 1) << 48
    return tuple(base + i * _COMPONENT_SPAN for i in range(len(COMPONENTS)))


def _frame_kind(msg: Message) -> str:
    return type(msg).__name__


@dataclass
class _Static:
    """What a world derives from its config once and never changes (shared by snapshots)."""

    prefill_layers: list[tuple[str, LayerLayout]]
    decode_layers: list[tuple[str, DestinationLayout]]
    layer_index: dict[str, int]
    conn_rank: dict[str, tuple[int, int]]
    # Every permutation of the interchangeable requests, as a renaming (see fingerprint).
    renamings: list[dict[object, object]] | None = None


_STATICS: dict[int, _Static] = {}


def _destination(parts: list[ComponentDest]) -> DestinationLayout:
    """K, V, indexer, scale (in BLOCK_LEN's order) as one layer's destination."""
    k, v, indexer, scale = parts
    return DestinationLayout((k, v), indexer, scale)


def _static_of(cfg: WorldConfig) -> _Static:
    static = _STATICS.get(id(cfg))
    if static is not None:
        return static
    prefill = [
        (
            layer_name(layer),
            LayerLayout(
                base_addrs=list(_prefill_bases(layer % cfg.n_storages)),
                block_len=list(BLOCK_LEN),
                tensor_group_idx=[0, 0, 1, 1],
                num_blocks=NUM_PREFILL_BLOCKS,
            ),
        )
        for layer in range(cfg.n_layers)
    ]
    decode = [
        (
            layer_name(layer),
            _destination(
                [
                    ComponentDest(base, size, NUM_DECODE_BLOCKS)
                    for base, size in zip(_decode_bases(layer), BLOCK_LEN, strict=True)
                ]
            ),
        )
        for layer in range(cfg.n_layers)
    ]
    conn_rank = {
        World.conn_name(e, d): (e, d) for e, d_tp in enumerate(cfg.engines) for d in range(d_tp)
    }
    static = _Static(prefill, decode, {name: i for i, (name, _) in enumerate(decode)}, conn_rank)
    _CONFIGS.setdefault((id(cfg), "W", 0, None), cfg)  # keeps cfg, so its id stays its own
    _STATICS[id(cfg)] = static
    return static


# Endpoint configurations by (id of the world config, side, rank, session or TP size).
# The world config they hang off is kept alive with them, so its id is never reused.
_CONFIGS: dict[tuple[int, str, int, object], ProducerConfig | ConsumerConfig | WorldConfig] = {}


class World:
    """Producers, consumers, a network and a memory model, checked after every step.

    See the module docstring. All methods take the world's own clock (``self.now``).
    """

    def __init__(self, cfg: WorldConfig) -> None:
        for d_tp in cfg.engines:
            if d_tp < 1 or cfg.p_tp % d_tp:
                raise ValueError(f"Decode TP {d_tp} must divide Prefill TP {cfg.p_tp}")
        self.cfg = cfg
        _CONFIGS.setdefault((id(cfg), "W", 0, None), cfg)
        self.now = 0.0
        self.budgets: dict[str, int] = dict(cfg.budgets)
        self.static = _static_of(cfg)
        # Prefill side.
        self.ranks: list[_Rank] = []
        self.producers: list[ProducerEndpoint] = []
        self._gens: list[int] = []
        for p in range(cfg.p_tp):
            self._gens.append(0)
            self.ranks.append(_Rank(f"p{p}.0"))
            self.producers.append(self._new_producer(p, f"p{p}.0"))
        # Decode side.
        self.consumers: dict[tuple[int, int], ConsumerEndpoint] = {}
        self.completions: list[CrossRankCompletion] = []
        self._engine_gens: list[int] = []
        self._reports: list[list[tuple[list[str], list[str]]]] = []
        for e, d_tp in enumerate(cfg.engines):
            self._engine_gens.append(0)
            self.completions.append(CrossRankCompletion(d_tp))
            self._reports.append([([], []) for _ in range(d_tp)])
            for d in range(d_tp):
                self.consumers[(e, d)] = self._new_consumer(d, d_tp)
        # Network, reads, memory.
        self.network: list[Frame] = []
        self.reads: dict[tuple[int, int, int], _Read] = {}
        self.pmem: dict[tuple[str, int], tuple[int, int, frozenset[str]]] = {}
        self.dmem: dict[tuple[int, int, int, int], Value] = {}
        self._version = 0
        # Requests and what the checks remember.
        self.reqs: dict[str, _Req] = {}
        self._powner: dict[int, tuple[str, int]] = {}
        self._next_pblock = FIRST_PREFILL_BLOCK
        self._next_dblock = FIRST_DECODE_BLOCK  # one range for every engine: ids stay unique
        self._terminal: dict[tuple[int, int, str], str] = {}
        self._delivered: dict[tuple[int, int, str], set[int]] = {}
        # Readiness delivered and not answered yet, by what the reply will echo: its seq, or
        # (v1 shapes) its layer; (member, done ids) in the order they arrived.
        self._readiness: dict[_ReplyKey, list[tuple[int, tuple[str, ...]]]] = {}
        self._released: set[tuple[int, int, str]] = set()
        self._prefill_finished: set[tuple[str, str]] = set()
        self._aborted_to: set[tuple[str, str, str]] = set()
        if cfg.warmup:
            # One request per engine, one after the other, run to the end: every connection
            # has its handshake.
            for e in range(len(cfg.engines)):
                self.new_request(RequestSpec(f"warmup{e}", e, (1,)))
                self.settle()
                self.check_quiescent()
        for spec in cfg.requests:
            self.new_request(spec)
        if cfg.upfront:
            for spec in cfg.requests:
                if spec.ext_id not in cfg.late_decode:
                    self.decode_add(spec.ext_id)
                self.prefill_add(spec.ext_id)

    # -- construction ----------------------------------------------------------------------

    def _new_producer(self, p_rank: int, session: str) -> ProducerEndpoint:
        # One config object per (world config, session), whichever branch builds it, so
        # that snapshots share it (see ``snapshot``).
        key = (id(self.cfg), "P", p_rank, session)
        config = _CONFIGS.get(key)
        if config is None:
            config = _CONFIGS[key] = ProducerConfig(
                p_rank=p_rank,
                p_tp=self.cfg.p_tp,
                session=session,
                layers=self.static.prefill_layers,
                lease_ms=self.cfg.lease_ms,
                handshake_timeout_s=self.cfg.handshake_timeout_s,
                protocol=self.cfg.prefill_protocol,
                v1_lease_expiry=self.cfg.v1_lease_expiry,
                silent_peer_timeout_s=self.cfg.silent_peer_timeout_s,
            )
        assert isinstance(config, ProducerConfig)
        return ProducerEndpoint(config)

    def _new_consumer(self, d_rank: int, d_tp: int) -> ConsumerEndpoint:
        key = (id(self.cfg), "D", d_rank, d_tp)
        config = _CONFIGS.get(key)
        if config is None:
            config = _CONFIGS[key] = ConsumerConfig(
                d_rank=d_rank,
                d_tp=d_tp,
                layers=self.static.decode_layers,
                capabilities=self.cfg.decode_capabilities,
                kv_load_timeout_s=self.cfg.kv_load_timeout_s,
                park_timeout_s=self.cfg.park_timeout_s,
                max_read_retries=self.cfg.max_read_retries,
            )
        assert isinstance(config, ConsumerConfig)
        return ConsumerEndpoint(config)

    @staticmethod
    def conn_name(engine: int, d_rank: int) -> str:
        """The Prefill side's name of Decode rank ``d_rank`` of engine ``engine``."""
        return f"{HOST}:{BASE_PORT + PORTS_PER_ENGINE * engine + d_rank}"

    def target(self, engine: int) -> DecodeTarget:
        """The rendezvous of Decode engine ``engine``."""
        return DecodeTarget(HOST, BASE_PORT + PORTS_PER_ENGINE * engine, self.cfg.engines[engine])

    def ratio(self, engine: int) -> int:
        """Prefill ranks per Decode rank of ``engine``."""
        return self.cfg.p_tp // self.cfg.engines[engine]

    def session_rank(self, session: str) -> int | None:
        """The Prefill rank whose live incarnation is ``session``."""
        for p, rank in enumerate(self.ranks):
            if rank.session == session:
                return p
        return None

    # -- requests --------------------------------------------------------------------------

    def new_request(self, spec: RequestSpec) -> None:
        """Create a request: Prefill and Decode block ids, nothing registered yet."""
        if spec.ext_id in self.reqs:
            raise ValueError(f"request {spec.ext_id!r} exists")
        total = sum(spec.chunks)
        start = self._next_pblock
        if start + total > FIRST_PREFILL_BLOCK + INDEXER_ID_OFFSET:
            raise ValueError("out of Prefill blocks")
        self._next_pblock += total
        pmain = list(range(start, start + total))
        pidx = [b + INDEXER_ID_OFFSET for b in pmain]
        for j in range(total):
            self._powner[pmain[j]] = (spec.ext_id, j)
            self._powner[pidx[j]] = (spec.ext_id, j)
        dstart = self._next_dblock
        if dstart + 2 * total > NUM_DECODE_BLOCKS:
            raise ValueError("out of Decode blocks")
        self._next_dblock += 2 * total
        # Decode ids in reverse logical order, so a wrong offset cannot go unnoticed.
        dmain = list(range(dstart + total - 1, dstart - 1, -1))
        didx = list(range(dstart + 2 * total - 1, dstart + total - 1, -1))
        self.reqs[spec.ext_id] = _Req(
            spec, pmain, pidx, dmain, didx, self._engine_gens[spec.engine]
        )

    def decode_add(self, ext: str) -> None:
        """Decode engine allocates the request's destinations on every rank."""
        req = self.reqs[ext]
        req.decode_added = True
        e = req.spec.engine
        for d in range(self.cfg.engines[e]):
            outs = self.consumers[(e, d)].add_request(ext, req.dmain, req.didx, self.now)
            self._consumer_outputs(e, d, outs)
        self._gather()

    def prefill_add(self, ext: str) -> None:
        """The proxy dispatches the request to Prefill: every live rank registers it."""
        req = self.reqs[ext]
        req.prefill_added = True
        for p, prod in enumerate(self.producers):
            self._producer_outputs(p, prod.add_request(ext, self.target(req.spec.engine), self.now))

    def prefill_abort(self, ext: str) -> None:
        """The Prefill scheduler aborts the request on every rank that holds it."""
        for p, prod in enumerate(self.producers):
            if ext in prod.requests():
                self._producer_outputs(p, prod.abort([ext], self.now))
        self._gather()

    def decode_abort(self, ext: str) -> None:
        """Decode aborts the request on every rank (before vLLM finishes it)."""
        req = self.reqs[ext]
        req.decode_aborted = True
        e = req.spec.engine
        for d in range(self.cfg.engines[e]):
            outs = self.consumers[(e, d)].abort([ext], "aborted by the model", self.now)
            self._consumer_outputs(e, d, outs)
        self._gather()

    def release(self, ext: str) -> None:
        """vLLM finishes the request on Decode (after its KV arrived, or a client abort)."""
        req = self.reqs[ext]
        req.released = True
        e = req.spec.engine
        for d in range(self.cfg.engines[e]):
            outs = self.consumers[(e, d)].release(ext, self.now)
            self._consumer_outputs(e, d, outs)
        self._gather()

    # -- Prefill compute -------------------------------------------------------------------

    def _step_chunks(self, p: int) -> list[tuple[str, int]]:
        """The chunks rank ``p`` schedules if it starts a step now."""
        rank = self.ranks[p]
        out = []
        for ext, state in self.producers[p].requests().items():
            k = rank.chunks.get(ext, 0)
            if state in ("registered", "sending") and k < len(self.reqs[ext].spec.chunks):
                out.append((ext, k))
        return out

    def can_write(self, p: int, *, idle: bool | None = None) -> bool:
        """Whether rank ``p`` may write its next layer now: its storage is free and it has
        work (a step under way, chunks to schedule, or ``idle`` steps allowed; default:
        the config's ``idle_steps``)."""
        rank = self.ranks[p]
        idle = self.cfg.idle_steps if idle is None else idle
        if rank.next_layer == 0 and not idle and not self._step_chunks(p):
            return False
        return self.producers[p].can_overwrite(rank.next_layer)

    def write_layer(self, p: int) -> None:
        """Rank ``p`` computes its next layer (starting a step at layer 0), then publishes it."""
        prod, rank = self.producers[p], self.ranks[p]
        layer = rank.next_layer
        if layer == 0:
            for ext, k in self._step_chunks(p):
                req = self.reqs[ext]
                start = sum(req.spec.chunks[:k])
                end = start + req.spec.chunks[k]
                final = k == len(req.spec.chunks) - 1
                prod.schedule_chunk(
                    ext, req.pmain[start:end], req.pidx[start:end], start, start, final
                )
                rank.chunks[ext] = k + 1
        self._version += 1
        owners = frozenset(prod.requests())
        for base in _prefill_bases(layer % self.cfg.n_storages):
            self.pmem[(rank.session, base)] = (layer, self._version, owners)
        self._producer_outputs(p, prod.layer_written(layer, self.now))
        rank.next_layer += 1
        if rank.next_layer == self.cfg.n_layers:
            rank.next_layer = 0
            self._producer_outputs(p, prod.end_step(self.now))
        self._gather()

    # -- the network -----------------------------------------------------------------------

    def transmit(self, frame: Frame) -> None:
        """Put ``frame`` on the network (override for another transport)."""
        self.network.append(frame)

    def deliverable(self) -> list[int]:
        """Indices of the frames that may be delivered now (heads of their connection)."""
        seen: set[tuple[Addr, Addr]] = set()
        out = []
        for i, f in enumerate(self.network):
            key = (f.src, f.dst)
            if self.cfg.fifo and key in seen:
                continue
            seen.add(key)
            out.append(i)
        return out

    def deliver(self, i: int) -> None:
        """Deliver in-flight frame ``i`` to its destination."""
        f = self.network.pop(i)
        if f.dst[0] == "D":
            e, d = self.static.conn_rank[f.dst[1]]
            peer = f.src[1].encode()
            if f.kind == "ReadReadyBatch":
                msg = decode(f.data)
                assert isinstance(msg, ReadReadyBatch)
                key = (e, d, peer, _reply_key(msg))
                self._readiness.setdefault(key, []).append(
                    (msg.group_member_idx, tuple(msg.done_ext_ids))
                )
            outs = self.consumers[(e, d)].receive_frame(peer, f.data, self.now)
            self._consumer_outputs(e, d, outs)
        else:
            p = self.session_rank(f.dst[1])
            assert p is not None, "frames to dead sessions are purged"
            self._producer_outputs(p, self.producers[p].receive(f.src[1], f.data, self.now))
        self._gather()

    def droppable(self) -> list[int]:
        """Deliverable frames the model may lose or duplicate (anything but a readiness)."""
        return [i for i in self.deliverable() if self.network[i].kind != "ReadReadyBatch"]

    def drop(self, i: int) -> None:
        """Lose in-flight frame ``i``."""
        del self.network[i]

    def duplicate(self, i: int) -> None:
        """Deliver frame ``i`` twice: a copy joins the end of its connection's queue."""
        self.network.append(self.network[i])

    def breakable(self) -> list[tuple[int, str]]:
        """(Prefill rank, Decode endpoint) connections with something to lose or resend."""
        out: list[tuple[int, str]] = []
        for p, prod in enumerate(self.producers):
            session = self.ranks[p].session
            busy = {v.conn for v in prod.publications().values()}
            for f in self.network:
                if session in (f.src[1], f.dst[1]):
                    busy.add(f.dst[1] if f.src[1] == session else f.src[1])
            out.extend((p, conn) for conn in sorted(busy) if conn in prod.connections())
        return out

    def break_connection(self, p: int, conn: str) -> None:
        """The connection between Prefill rank ``p`` and Decode endpoint ``conn`` breaks
        and ZMQ reconnects it within the runtime's grace (a peer stalled past the
        heartbeat timeout): every frame in flight on it is lost, both ways, and the
        producer is told it resumed. Nothing is sent on it in between: the runtime holds
        no frame back while ZMQ reconnects, so a readiness sent in that window could also
        overtake the resent ones (a gap Decode fails safely); that is not modelled."""
        session = self.ranks[p].session
        self.network = [f for f in self.network if {f.src[1], f.dst[1]} != {session, conn}]
        self._producer_outputs(p, self.producers[p].connection_resumed(conn, self.now))
        self._gather()

    # -- reads -----------------------------------------------------------------------------

    def finish_read(self, key: tuple[int, int, int], outcome: str = "ok") -> None:
        """The runtime runs read ``key`` (``ok``, ``fail`` or ``transient``) and reports it."""
        read = self.reads.pop(key)
        e, d, read_id = key
        error: TransferError | None
        if outcome == "ok":
            error = self.execute_read(e, d, read.plan, read.start_by, read.layer)
        else:
            error = TransferError(
                f"the model failed read {read_id}", 7, transient=outcome != "fail"
            )
            self._scribble(e, d, read.plan)
        outs = self.consumers[(e, d)].read_finished(read_id, error, self.now)
        self._consumer_outputs(e, d, outs)
        self._gather()

    def execute_read(
        self, engine: int, d_rank: int, plan: ReadPlan, start_by: float | None, layer: int
    ) -> TransferError | None:
        """Run ``plan`` against the memory model; return the error to report, if any.

        Refuses to start past ``start_by`` (``LEASE_EXPIRED``), fails against a Prefill
        session that died, and otherwise copies every block, checking each value it reads
        (S1: the right layer of a live request) and where it lands (S3, DATA). Override to
        move real bytes with a real backend.
        """
        if start_by is not None and self.now > start_by:
            err = TransferError("the read could not start before its lease margin ran out")
            err.code = ErrorCode.LEASE_EXPIRED
            return err
        if self.session_rank(plan.session) is None:
            return TransferError(f"Prefill session {plan.session} is gone", 3)
        for rr in plan.requests:
            req = self.reqs[rr.ext_req_id]
            for comp in plan.main:
                self._copy(engine, d_rank, -1, comp, (rr.main_src, rr.main_dst), req, layer, plan)
            for comp in plan.indexer:
                pair = (rr.indexer_src, rr.indexer_dst)
                self._copy(engine, d_rank, d_rank, comp, pair, req, layer, plan)
        return None

    def _copy(
        self,
        engine: int,
        d_rank: int,
        mem_rank: int,
        comp: ComponentAddrs,
        blocks: tuple[Sequence[int], Sequence[int]],
        req: _Req,
        layer: int,
        plan: ReadPlan,
    ) -> None:
        """Copy one component's blocks; ``mem_rank`` -1 is the engine's shared K/V pool."""
        ext = req.spec.ext_id
        src, dst = blocks
        dest_ids = req.dmain if mem_rank < 0 else req.didx
        if (engine, d_rank, ext) in self._released:
            raise InvariantViolation(
                "S3",
                f"read {plan.read_id} writes {ext}'s blocks after Decode rank {d_rank} "
                "released them",
            )
        stored = self.pmem.get((plan.session, comp.src_base))
        for s, blk in zip(src, dst, strict=True):
            if stored is None:
                raise InvariantViolation("S1", f"read {plan.read_id} reads storage never written")
            w_layer, version, owners = stored
            owner, j = self._powner.get(s, ("?", -1))
            value: Value = (w_layer, owner if owner in owners else None, j, comp.name)
            expected: Value = (
                layer,
                ext,
                dest_ids.index(blk) if blk in dest_ids else -2,
                comp.name,
            )
            if value[:2] != expected[:2]:
                raise InvariantViolation(
                    "S1",
                    f"read {plan.read_id} of layer {layer} for {ext} from {plan.session} got "
                    f"layer {w_layer} (write {version}) of "
                    f"{'a freed request' if value[1] is None else value[1]}: read after reuse",
                )
            if value != expected:
                raise InvariantViolation(
                    "DATA",
                    f"read {plan.read_id}: Prefill block {s} ({value}) lands in "
                    f"Decode block {blk} ({expected})",
                )
            self.dmem[(engine, mem_rank, comp.dst_base, blk)] = value

    def _scribble(self, engine: int, d_rank: int, plan: ReadPlan) -> None:
        """A failed read may have written part of its destinations: garbage in the first."""
        for rr in plan.requests:
            for comps, dst, rank in (
                (plan.main, rr.main_dst, -1),
                (plan.indexer, rr.indexer_dst, d_rank),
            ):
                if dst and comps:
                    if (engine, d_rank, rr.ext_req_id) in self._released:
                        raise InvariantViolation(
                            "S3", f"a failed read wrote {rr.ext_req_id}'s released blocks"
                        )
                    self.dmem[(engine, rank, comps[0].dst_base, dst[0])] = GARBAGE

    # -- time ------------------------------------------------------------------------------

    def timers(self) -> list[tuple[str, int, int]]:
        """Endpoints whose earliest deadline has passed: ``("P", p, 0)`` / ``("D", e, d)``."""
        out: list[tuple[str, int, int]] = []
        for p, prod in enumerate(self.producers):
            t = prod.get_timer()
            if t is not None and t <= self.now:
                out.append(("P", p, 0))
        for (e, d), cons in self.consumers.items():
            t = cons.get_timer()
            if t is not None and t <= self.now:
                out.append(("D", e, d))
        return out

    def fire_timer(self, which: tuple[str, int, int]) -> None:
        """Let one endpoint handle its expired deadlines."""
        side, a, b = which
        if side == "D":
            self._consumer_outputs(a, b, self.consumers[(a, b)].handle_timer(self.now))
        else:
            prod = self.producers[a]
            before = prod.publications()
            outs = prod.handle_timer(self.now)
            self._producer_outputs(a, outs)
            self._check_expiry_aborts(a, before)
        self._gather()

    def _check_expiry_aborts(self, p: int, before: Mapping[int, PublicationView]) -> None:
        """S1: a publication that ended by its lease on a ready v2 connection had its ABORT."""
        prod = self.producers[p]
        after = prod.publications()
        conns = prod.connections()
        session = self.ranks[p].session
        for uid, view in before.items():
            if uid in after:
                continue
            if view.state not in ("published", "replayed") or conns.get(view.conn) != "ready_v2":
                continue
            for ext in view.ext_ids:
                if (session, view.conn, ext) not in self._aborted_to:
                    raise InvariantViolation(
                        "S1",
                        f"{session} reopened the storage of layer {view.layer_idx} after "
                        f"its lease toward {view.conn} expired without an ABORT for {ext}",
                    )

    def next_time(self) -> float | None:
        """The next instant worth moving to, or None (nothing waits, or a bound forbids it).

        Candidates: every endpoint deadline, just after every read's ``start_by``, just
        before every readiness's delivery bound; time never reaches a delivery bound.
        """
        now = self.now
        candidates: list[float] = []
        for prod in self.producers:
            t = prod.get_timer()
            if t is not None and t > now:
                candidates.append(t)
        for cons in self.consumers.values():
            t = cons.get_timer()
            if t is not None and t > now:
                candidates.append(t)
        for read in self.reads.values():
            if read.start_by is not None and read.start_by + TICK > now:
                candidates.append(read.start_by + TICK)
        bounds = [f.deliver_by for f in self.network if f.deliver_by is not None]
        for b in bounds:
            if b - TICK > now:
                candidates.append(b - TICK)
        if not candidates:
            return None
        t = min(candidates)
        if bounds and t >= min(bounds):
            return None
        return t

    def waits_on_time(self) -> bool:
        """Whether some deadline or read lease lies ahead (time passing changes something)."""
        now = self.now
        endpoints: list[ProducerEndpoint | ConsumerEndpoint] = [
            *self.producers,
            *self.consumers.values(),
        ]
        for ep in endpoints:
            t = ep.get_timer()
            if t is not None and t > now:
                return True
        return any(r.start_by is not None and r.start_by >= now for r in self.reads.values())

    def advance(self, dt: float) -> None:
        """Let up to ``dt`` seconds pass (less if a readiness in flight bounds it)."""
        target = self.now + dt
        bounds = [f.deliver_by for f in self.network if f.deliver_by is not None]
        if bounds:
            target = min(target, min(bounds) - TICK)
        if target > self.now:
            self.now = target
        self._gather()

    def advance_to(self, t: float) -> None:
        """Move the clock to ``t`` (from :meth:`next_time`)."""
        assert t > self.now
        self.now = t
        self._gather()

    # -- faults ----------------------------------------------------------------------------

    def kill_decode(self, engine: int) -> None:
        """Decode engine ``engine`` dies (any TP rank takes the engine down) and restarts.

        Its frames vanish, its reads never run, its requests are abandoned (their clients
        see an error); Prefill learns through leases, UNKNOWN_SESSION and isolation.
        """
        conns = {self.conn_name(engine, d) for d in range(self.cfg.engines[engine])}
        self.network = [f for f in self.network if f.src[1] not in conns and f.dst[1] not in conns]
        self.reads = {k: r for k, r in self.reads.items() if k[0] != engine}
        self._engine_gens[engine] += 1
        d_tp = self.cfg.engines[engine]
        for d in range(d_tp):
            self.consumers[(engine, d)] = self._new_consumer(d, d_tp)
        self.completions[engine] = CrossRankCompletion(d_tp)
        self._reports[engine] = [([], []) for _ in range(d_tp)]
        self.dmem = {k: v for k, v in self.dmem.items() if k[0] != engine}
        for table in (self._terminal, self._delivered):
            for key in [k for k in table if k[0] == engine]:
                del table[key]
        self._readiness = {k: v for k, v in self._readiness.items() if k[0] != engine}
        self._released = {k for k in self._released if k[0] != engine}
        for req in self.reqs.values():
            if req.spec.engine == engine and not req.released:
                req.abandoned = True

    def kill_prefill(self, p: int) -> None:
        """Prefill rank ``p`` dies and restarts with a new session and no requests."""
        old = self.ranks[p].session
        self.network = [f for f in self.network if f.src[1] != old and f.dst[1] != old]
        self._gens[p] += 1
        session = f"p{p}.{self._gens[p]}"
        self.ranks[p] = _Rank(session)
        self.producers[p] = self._new_producer(p, session)
        self.pmem = {k: v for k, v in self.pmem.items() if k[0] != old}

    # -- outputs ---------------------------------------------------------------------------

    def _producer_outputs(self, p: int, outs: list[ProducerOutput]) -> None:
        session = self.ranks[p].session
        for o in outs:
            if isinstance(o, Send):
                msg = o.msg
                deliver_by = None
                if isinstance(msg, ReadReadyBatch):
                    if msg.lease_ms is not None:  # a peer without the lease: no bound
                        deliver_by = self.now + msg.lease_ms / 2000.0
                elif isinstance(msg, Abort):
                    for ext in msg.ext_ids:
                        self._aborted_to.add((session, o.conn, ext))
                self.transmit(
                    Frame(
                        ("P", session),
                        ("D", o.conn),
                        encode(msg),
                        self.now,
                        deliver_by,
                        _frame_kind(msg),
                    )
                )
            elif isinstance(o, Disconnect):
                # A fresh DEALER: nothing of the old connection arrives any more.
                conn = o.conn
                self.network = [f for f in self.network if {f.src[1], f.dst[1]} != {session, conn}]
            elif isinstance(o, RequestFinished):
                key = (session, o.ext_req_id)
                if key in self._prefill_finished:
                    raise InvariantViolation("B1", f"{session} finished {o.ext_req_id} twice")
                self._prefill_finished.add(key)

    def _consumer_outputs(self, e: int, d: int, outs: list[ConsumerOutput]) -> None:
        conn = self.conn_name(e, d)
        for o in outs:
            if isinstance(o, Reply | SendAbort):
                msg = o.msg
                if isinstance(msg, ReadDone | ReadFailed):
                    self._answered(e, d, o.peer, msg)
                session = o.peer.decode()
                if self.session_rank(session) is not None:
                    self.transmit(
                        Frame(
                            ("D", conn),
                            ("P", session),
                            encode(msg),
                            self.now,
                            None,
                            _frame_kind(msg),
                        )
                    )
            elif isinstance(o, StartRead):
                layer = self.static.layer_index[o.plan.layer_name]
                self.reads[(e, d, o.plan.read_id)] = _Read(o.plan, o.start_by, layer)
            elif isinstance(o, RequestDone):
                self._terminal_report(e, d, o.ext_req_id, "done")
                self._check_done_on_rank(e, d, o.ext_req_id)
                self._reports[e][d][0].append(o.ext_req_id)
            elif isinstance(o, RequestFailed):
                self._terminal_report(e, d, o.ext_req_id, "failed")
                self._reports[e][d][1].append(o.ext_req_id)
            elif isinstance(o, Releasable):
                self._check_releasable(e, d, o.ext_req_id)

    def _answered(self, e: int, d: int, peer: bytes, msg: ReadDone | ReadFailed) -> None:
        """A reply: the done signals of the readiness it answers count if its read succeeded."""
        key = (e, d, peer, _reply_key(msg))
        waiting = self._readiness.get(key)
        if not waiting:
            return
        member, done = waiting.pop(0)
        if not waiting:
            del self._readiness[key]
        if isinstance(msg, ReadDone):
            failed = {f.ext_req_id for f in msg.failed or ()}
            for ext in done:
                if ext not in failed:
                    self._delivered.setdefault((e, d, ext), set()).add(member)

    def _terminal_report(self, e: int, d: int, ext: str, what: str) -> None:
        key = (e, d, ext)
        check_single_outcome(self.conn_name(e, d), ext, self._terminal.get(key), what)
        self._terminal[key] = what

    def _check_done_on_rank(self, e: int, d: int, ext: str) -> None:
        """S2 on one rank: every contributor delivered its final layer; the indexer is whole."""
        members = self._delivered.get((e, d, ext), set())
        check_done_on_rank(self.conn_name(e, d), ext, members, self.ratio(e))
        req = self.reqs[ext]
        self._check_data(e, d, req, (2, 3), req.didx)

    def _check_data(
        self, e: int, rank: int, req: _Req, comps: tuple[int, ...], ids: list[int]
    ) -> None:
        ext = req.spec.ext_id
        for layer in range(self.cfg.n_layers):
            bases = _decode_bases(layer)
            for c in comps:
                for j, blk in enumerate(ids):
                    got = self.dmem.get((e, rank, bases[c], blk))
                    want = (layer, ext, j, COMPONENTS[c])
                    if got != want:
                        raise InvariantViolation(
                            "S2",
                            f"{ext} is done but Decode {COMPONENTS[c]} block {blk} of "
                            f"layer {layer} (rank {rank}) holds {got}, expected {want}",
                        )

    def _check_releasable(self, e: int, d: int, ext: str) -> None:
        writing = [
            rid
            for (re, rd, rid), read in self.reads.items()
            if (re, rd) == (e, d) and any(r.ext_req_id == ext for r in read.plan.requests)
        ]
        check_release(self.conn_name(e, d), ext, writing)
        self._released.add((e, d, ext))

    def _gather(self) -> None:
        """Every rank's terminal reports go through the cross-rank rule (as the worker does)."""
        for e, pending in enumerate(self._reports):
            if (
                not any(done or failed for done, failed in pending)
                and self.completions[e].is_idle()
            ):
                continue
            reports = [RankReport(tuple(done), tuple(failed)) for done, failed in pending]
            self._reports[e] = [([], []) for _ in pending]
            result = self.completions[e].update(reports, _identity, self.now)
            for ext in result.finished:
                req = self.reqs[ext]
                req.finished = True
                req.load_error = ext in result.load_errors
                if not req.load_error:
                    for d in range(self.cfg.engines[e]):
                        if self._terminal.get((e, d, ext)) != "done":
                            raise InvariantViolation(
                                "S2", f"{ext} finished without being done on rank {d}"
                            )
                    self._check_data(e, -1, req, (0, 1), req.dmain)
            if result.dropped:
                raise InvariantViolation("B1", f"cross-rank completion dropped {result.dropped}")
            if self.cfg.auto_release:
                for ext in result.finished:
                    if not self.reqs[ext].released:
                        self.release(ext)

    # -- invariants ------------------------------------------------------------------------

    def check(self) -> None:
        """The state invariants, after every step (the event checks ran as outputs came)."""
        for rank, prod in zip(self.ranks, self.producers, strict=True):
            check_storage_gates(rank.session, prod)
        for (e, d, rid), read in self.reads.items():
            if read.start_by is not None and self.now > read.start_by:
                continue  # it can only fail now
            src = self.session_rank(read.plan.session)
            if src is None:
                continue  # it can only fail now
            check_read_may_start(
                self.conn_name(e, d), rid, read.plan.session, self.producers[src], read.layer
            )
            for r in read.plan.requests:
                if (e, d, r.ext_req_id) in self._released:
                    raise InvariantViolation("S3", f"read {rid} targets released {r.ext_req_id}")
        for f in self.network:
            if f.deliver_by is not None and not (self.now < f.deliver_by or self.now == f.sent_at):
                raise AssertionError("the model let time pass a readiness's delivery bound")

    def quiet(self) -> bool:
        """Nothing in flight, nothing to read, no deadline pending."""
        return (
            not self.network and not self.reads and self.next_time() is None and not self.timers()
        )

    def check_quiescent(self) -> None:
        """L1, once everything settled: gates open, every request terminal on both sides."""
        if self.network or self.reads:
            raise InvariantViolation(
                "L1", f"{len(self.network)} frames, {len(self.reads)} reads left"
            )
        check_quiescent(self._producers_by_session(), self._consumers_by_name())
        for ext, req in self.reqs.items():
            if req.decode_added and not req.abandoned and not req.finished and not req.released:
                raise InvariantViolation("L1", f"{ext} is not finished across Decode ranks")

    def check_idle(self) -> None:
        """B1, after every request ended and was released: no per-request state anywhere."""
        completions = {str(e): comp for e, comp in enumerate(self.completions)}
        check_idle(self._producers_by_session(), self._consumers_by_name(), completions)

    def _producers_by_session(self) -> dict[str, ProducerEndpoint]:
        return {rank.session: prod for rank, prod in zip(self.ranks, self.producers, strict=True)}

    def _consumers_by_name(self) -> dict[str, ConsumerEndpoint]:
        return {self.conn_name(e, d): cons for (e, d), cons in self.consumers.items()}

    # -- the fair scheduler ----------------------------------------------------------------

    def settle(self, limit: int = 10_000) -> None:
        """Run everything to the end: register every request, deliver every frame, run every
        read, let every rank write, fire every timer, move time on; until nothing is left."""
        for _ in range(limit):
            for ext, req in self.reqs.items():
                if not req.decode_added and not req.abandoned and not req.released:
                    self.decode_add(ext)
                if not req.prefill_added:
                    self.prefill_add(ext)
            progressed = False
            while self.network:
                self.deliver(self.deliverable()[0])
                self.check()
                progressed = True
            for key in sorted(self.reads):
                self.finish_read(key)
                self.check()
                progressed = True
            for which in self.timers():
                self.fire_timer(which)
                self.check()
                progressed = True
            for p in range(len(self.producers)):
                if self.can_write(p, idle=False):
                    self.write_layer(p)
                    self.check()
                    progressed = True
            if progressed:
                continue
            t = self.next_time()
            if t is None:
                return
            self.advance_to(t)
        raise InvariantViolation("L1", f"no quiescence after {limit} rounds")

    def release_all(self) -> None:
        """vLLM finishes every request Decode still holds."""
        for ext, req in self.reqs.items():
            if req.decode_added and not req.released and not req.abandoned:
                self.release(ext)

    # -- actions (the explorer's interface) ------------------------------------------------

    def _budget(self, name: str) -> bool:
        return self.budgets.get(name, 0) > 0

    def actions(self) -> list[Action]:
        """Every action enabled now, in a fixed order, within the fault budgets."""
        acts: list[Action] = []
        for i in self.deliverable():
            acts.append(("deliver", i))
        if self._budget("lose"):  # beyond the model's assumptions: see WorldConfig
            acts.extend(
                ("lose", i) for i in self.deliverable() if self.network[i].kind == "ReadReadyBatch"
            )
        if self._budget("drop") or self._budget("dup"):
            for i in self.droppable():
                if self._budget("drop") and self.network[i].src[0] == "D":
                    acts.append(("drop", i))
                if self._budget("dup"):
                    acts.append(("dup", i))
        for key in sorted(self.reads):
            acts.append(("read", key, "ok"))
            if self._budget("read_fail"):
                acts.append(("read", key, "fail"))
                acts.append(("read", key, "transient"))
        for which in self.timers():
            acts.append(("timer", which))
        for p in range(len(self.producers)):
            if self.can_write(p):
                acts.append(("write", p))
        for ext, req in self.reqs.items():
            if not req.decode_added and not req.abandoned:
                acts.append(("decode_add", ext))
            if not req.prefill_added:
                acts.append(("prefill_add", ext))
            live = req.decode_added and not req.abandoned and not req.released
            if live and ((req.finished and not self.cfg.auto_release) or self._budget("release")):
                acts.append(("release", ext))
            may_abort = self._budget("abort") or self._budget("prefill_abort")
            if may_abort and any(ext in p.requests() for p in self.producers):
                acts.append(("prefill_abort", ext))
            if self._budget("abort") and live and not req.decode_aborted:
                acts.append(("decode_abort", ext))
        if self._budget("break"):
            acts.extend(("break", p, conn) for p, conn in self.breakable())
        if self._budget("kill"):
            acts.extend(("kill_decode", e) for e in range(len(self.cfg.engines)))
            acts.extend(("kill_prefill", p) for p in range(self.cfg.p_tp))
        t = self.next_tick() if self.cfg.tick is not None else self.next_time()
        if t is not None:
            acts.append(("advance", t))
        return acts

    def next_tick(self) -> float | None:
        """The explorer's next instant: one tick on, once no timer is due, while something
        still waits on time, and never onto a readiness's delivery bound."""
        assert self.cfg.tick is not None
        # Timers and the compute path are prompt: time moves on only once they are done.
        # The network and the transfer engine may be slow: frames and reads can wait.
        if self.timers() or not self.waits_on_time():
            return None
        if any(self.can_write(p, idle=False) for p in range(len(self.producers))):
            return None
        t = self.now + self.cfg.tick
        bounds = [f.deliver_by for f in self.network if f.deliver_by is not None]
        if bounds and t >= min(bounds):
            return None
        return t

    def apply(self, action: Action) -> None:
        """Perform one action (see :meth:`actions`), spending its budget, then check."""
        kind = action[0]
        if kind == "deliver":
            self.deliver(_int(action[1]))
        elif kind == "drop":
            self._spend("drop")
            self.drop(_int(action[1]))
        elif kind == "lose":
            self._spend("lose")
            self.drop(_int(action[1]))
        elif kind == "dup":
            self._spend("dup")
            self.duplicate(_int(action[1]))
        elif kind == "read":
            key = action[1]
            assert isinstance(key, tuple)
            outcome = str(action[2])
            if outcome != "ok":
                self._spend("read_fail")
            self.finish_read((_int(key[0]), _int(key[1]), _int(key[2])), outcome)
        elif kind == "timer":
            which = action[1]
            assert isinstance(which, tuple)
            self.fire_timer((str(which[0]), _int(which[1]), _int(which[2])))
        elif kind == "write":
            self.write_layer(_int(action[1]))
        elif kind == "decode_add":
            self.decode_add(str(action[1]))
        elif kind == "prefill_add":
            self.prefill_add(str(action[1]))
        elif kind == "release":
            ext = str(action[1])
            if not self.reqs[ext].finished:
                self._spend("release")
            self.release(ext)
        elif kind == "prefill_abort":
            self._spend("prefill_abort" if self._budget("prefill_abort") else "abort")
            self.prefill_abort(str(action[1]))
        elif kind == "decode_abort":
            self._spend("abort")
            self.decode_abort(str(action[1]))
        elif kind == "break":
            self._spend("break")
            self.break_connection(_int(action[1]), str(action[2]))
        elif kind == "kill_decode":
            self._spend("kill")
            self.kill_decode(_int(action[1]))
        elif kind == "kill_prefill":
            self._spend("kill")
            self.kill_prefill(_int(action[1]))
        elif kind == "advance":
            t = action[1]
            assert isinstance(t, float)
            self.advance_to(t)
        else:
            raise ValueError(f"unknown action {action!r}")
        self.check()

    def _spend(self, name: str) -> None:
        if self.budgets.get(name, 0) <= 0:
            raise ValueError(f"no {name} budget left")
        self.budgets[name] -= 1

    def describe(self, action: Action) -> str:
        """A readable line for ``action`` in the current state (for traces)."""
        kind = action[0]
        if kind in ("deliver", "drop", "dup", "lose"):
            f = self.network[_int(action[1])]
            return f"t={self.now:.3f} {kind} {f.src[1]} -> {f.dst[1]}: {_summary(decode(f.data))}"
        if kind == "read":
            key = action[1]
            assert isinstance(key, tuple)
            read = self.reads[(_int(key[0]), _int(key[1]), _int(key[2]))]
            reqs = ",".join(r.ext_req_id for r in read.plan.requests)
            return (
                f"t={self.now:.3f} read {key} of layer {read.layer} from {read.plan.session} "
                f"for [{reqs}] -> {action[2]}"
            )
        if kind == "write":
            p = _int(action[1])
            return (
                f"t={self.now:.3f} {self.ranks[p].session} writes layer {self.ranks[p].next_layer}"
            )
        if kind == "advance":
            return (
                f"t={self.now:.3f} time passes to {action[1]:.3f}"
                if isinstance(action[1], float)
                else ""
            )
        return f"t={self.now:.3f} {' '.join(str(a) for a in action)}"

    # -- snapshots -------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The whole state as bytes (a pickle); equal states give equal bytes, mostly.

        Counters that never influence behaviour are left out (they come back as zeros),
        configurations and layouts are shared rather than copied, and frames are grouped by
        connection (their order across connections means nothing), so that states reached
        along different paths merge and a snapshot stays small.
        """
        self.network.sort(key=_connection_of)
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = _DISPATCH
        pickler.dump(self)
        return buf.getvalue()


# -- snapshot support: what a state pickle leaves out or shares ---------------------------

# Objects shared by every snapshot instead of copied into each: index -> object.
_SHARED: list[object] = []
_SHARED_INDEX: dict[object, int] = {}  # ("id", id) or (type name, encoded value) -> index
_SHARED_BY_ID: dict[int, int] = {}  # id of a shared object -> index (they live forever)


def _shared(index: int) -> object:
    return _SHARED[index]


def _share(key: object, obj: object) -> int:
    index = _SHARED_INDEX.get(key)
    if index is None:
        index = _SHARED_INDEX[key] = len(_SHARED)
        _SHARED.append(obj)
    shared = _SHARED[index]
    _SHARED_BY_ID[id(shared)] = index
    return index


def _by_identity(obj: object) -> tuple[Callable[..., object], tuple[object, ...]]:
    # Configurations are created once per world and never change: share them. The
    # registry keeps them alive, so an id is never reused for another object.
    index = _SHARED_BY_ID.get(id(obj))
    if index is None or _SHARED[index] is not obj:
        index = _share(("id", id(obj)), obj)
    return _shared, (index,)


def _by_content(obj: object) -> tuple[Callable[..., object], tuple[object, ...]]:
    # Layouts decoded from each handshake are equal but distinct objects: share by value.
    # Once shared, an object is found by its id (snapshots hand back the shared one).
    index = _SHARED_BY_ID.get(id(obj))
    if index is None or _SHARED[index] is not obj:
        index = _share((type(obj).__name__, msgspec.msgpack.encode(obj)), obj)
    return _shared, (index,)


def _fresh(obj: object) -> tuple[Callable[..., object], tuple[object, ...]]:
    return type(obj), ()


_Reducer: TypeAlias = Callable[[Any], tuple[Callable[..., object], tuple[object, ...]]]


def _positional(cls: type) -> _Reducer | None:
    """A reducer that rebuilds a plain dataclass with its own ``__init__`` (fast, unlike
    the generic path of slotted dataclasses), or None when ``__init__`` cannot do it."""
    if not dataclasses.is_dataclass(cls) or hasattr(cls, "__post_init__"):
        return None
    fields = dataclasses.fields(cls)
    if not fields or any(not f.init for f in fields):
        return None
    get = operator.attrgetter(*(f.name for f in fields))
    if len(fields) == 1:
        return lambda obj: (cls, (get(obj),))
    return lambda obj: (cls, get(obj))


class _DispatchTable(dict[type, _Reducer]):
    """The snapshot pickler's reducers; a struct class made at run time (the consumer
    builds bounded decoders that way) cannot be looked up by name, so it is written as its
    nearest importable base class."""

    def __missing__(self, cls: type) -> _Reducer:
        if issubclass(cls, type):
            raise KeyError(cls)  # classes are pickled by name
        if not issubclass(cls, msgspec.Struct) or _importable(cls):
            # The default way, remembered: a miss costs an exception every time.
            self[cls] = _default_reduce
            return _default_reduce
        base = next(c for c in cls.__mro__[1:] if _importable(c))

        def reducer(obj: Any) -> tuple[Callable[..., object], tuple[object, ...]]:
            return _make_struct, (base, msgspec.structs.asdict(obj))

        self[cls] = reducer
        return reducer


def _default_reduce(obj: Any) -> tuple[Callable[..., object], tuple[object, ...]]:
    reduced: tuple[Callable[..., object], tuple[object, ...]] = obj.__reduce_ex__(
        pickle.HIGHEST_PROTOCOL
    )
    return reduced


def _importable(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    return module is not None and getattr(module, cls.__qualname__, None) is cls


def _make_struct(cls: type, fields: dict[str, object]) -> object:
    return cls(**fields)


def _dispatch_table() -> dict[type, _Reducer]:
    table = _DispatchTable(
        {
            ProducerConfig: _by_identity,
            ConsumerConfig: _by_identity,
            WorldConfig: _by_identity,
            _Static: _by_identity,
            MfMeta: _by_content,
            LayerLayout: _by_content,
            DestinationLayout: _by_content,
            ProducerStats: _fresh,
            ConsumerStats: _fresh,
            CompletionStats: _fresh,
        }
    )
    for module in (producer_module, consumer_module, completion_module, plan_module):
        for value in vars(module).values():
            if isinstance(value, type) and value not in table:
                reducer = _positional(value)
                if reducer is not None:
                    table[value] = reducer
    for cls in (_Req, _Rank, _Read, RequestSpec):
        reducer = _positional(cls)
        assert reducer is not None
        table[cls] = reducer
    return table


_DISPATCH: Final = _dispatch_table()


def _connection_of(frame: Frame) -> tuple[Addr, Addr]:
    return frame.src, frame.dst


# -- canonical fingerprints ---------------------------------------------------------------
#
# Two states reached along different paths are often the same state written differently:
# dicts filled in another order, read ids handed out in another order, a lazy timer heap
# laid out differently, counters, and every time shifted by the same amount. The
# fingerprint is the hash of a canonical form that leaves those out: dicts and sets sorted,
# read ids and uid counters dropped (they are labels), derived caches and configuration
# skipped, times measured from now, and references between an endpoint's own records
# written as the name or id they stand for (which also breaks the cycles).

_Canon: TypeAlias = object

# Attributes left out of the canonical form, by class (module.qualname): configuration,
# derived caches, counters and labels that never change what happens next.
_SKIP: Final[dict[str, frozenset[str]]] = {
    "rd2h_protocol.checker.explore.World": frozenset(
        {
            "cfg",
            "static",
            "_powner",
            "_version",
            "_next_pblock",
            "_next_dblock",
            "reads",
            "pmem",
            "network",
            "dmem",
            "ranks",
            "_terminal",
            "_delivered",
            "_prefill_finished",
            "_aborted_to",
        }
    ),
    "rd2h_protocol.producer.ProducerEndpoint": frozenset(
        {
            "config",
            "stats",
            "_layer_names",
            "_layer_slots",
            "_last_layer",
            "_lease_s",
            "_v1_only",
            "_meta",
            "_next_uid",
            "_timers",
        }
    ),
    "rd2h_protocol.consumer.ConsumerEndpoint": frozenset(
        {
            "config",
            "stats",
            "_layers",
            "_caps",
            "_main_limit",
            "_indexer_limit",
            "_next_read_id",
            "_next_park_id",
            "_out",
            "_aborts",
            "_reads",
            "_entry_cache",
        }
    ),
    # history only tells a stale reply from a duplicate one (a counter); next_seq is a label.
    "rd2h_protocol.producer._Conn": frozenset({"history", "next_seq", "refusal"}),
    "rd2h_protocol.producer._Pub": frozenset({"sent_at"}),  # for latency metrics only
    # Failure texts are reported, never acted on.
    "rd2h_protocol.producer._Request": frozenset({"message"}),
    "rd2h_protocol.consumer._Request": frozenset({"fail_message"}),
    # The reply memory is written by _canon_world, only where it can still be asked.
    "rd2h_protocol.consumer._Session": frozenset({"validated", "remembered", "remembered_bytes"}),
    # A request's spec and block ids never change; its key says which request it is.
    "rd2h_protocol.checker.explore._Req": frozenset({"spec", "pmain", "pidx", "dmain", "didx"}),
    "rd2h_protocol.completion.ContributorSet": frozenset({"duplicates"}),
    "rd2h_protocol.completion.CrossRankCompletion": frozenset(
        {"stats", "world_size", "max_unmapped", "unmapped_timeout_s", "collect_timeout_s"}
    ),
}
# Attributes that hold references to records kept elsewhere: written as their key.
_REFS: Final[dict[str, dict[str, str]]] = {
    "rd2h_protocol.producer._Pub": {"conn": "name", "requests": "ext_id"},
    "rd2h_protocol.producer._Request": {"conn": "name"},
    "rd2h_protocol.consumer._Readiness": {"accepted": "ext_id", "in_plan": "ext_id"},
}
_ATOMIC: Final = frozenset({str, int, bytes, bool, type(None)})
_NOW: list[float] = [0.0]  # the instant times are measured from, while canonicalising
# The renaming of request ids and block ids applied while canonicalising (symmetry), and
# whether structs are written as data (so that renaming reaches inside them) or as bytes.
_RENAME: dict[object, object] = {}
_STRUCTS_AS_DATA: list[bool] = [False]
_HANDLERS: dict[type, Callable[[Any], _Canon]] = {}
_SHARED_FORMS: dict[int, _Canon] = {}  # forms of shared immutable objects (layouts), by id


def _canon(obj: object) -> _Canon:
    """The canonical form of ``obj``: plain, hashable, free of order and labels."""
    t = type(obj)
    if t in _ATOMIC:
        return _RENAME.get(obj, obj) if _RENAME else obj
    if t is float:
        # Behaviour depends on differences of times only: measure them from now.
        return obj - _NOW[0]  # type: ignore[operator]
    # The common containers inline (this runs a few hundred times per state).
    if t is tuple or t is list:
        return tuple([_canon(x) for x in obj]) if obj else ()  # type: ignore[attr-defined]
    if t is dict:
        return _canon_map(obj) if obj else _EMPTY_MAP
    if t is set or t is frozenset:
        return _canon_set(obj) if obj else _EMPTY_SET
    handler = _HANDLERS.get(t)
    if handler is None:
        handler = _HANDLERS[t] = _handler_for(t)
    return handler(obj)


_EMPTY_MAP: Final = ("{}", ())
_EMPTY_SET: Final = ("set", ())


def _sorted(items: list[_Canon]) -> tuple[_Canon, ...]:
    try:
        return tuple(sorted(items))  # type: ignore[type-var]
    except TypeError:
        return tuple(sorted(items, key=repr))


def _canon_seq(obj: Any) -> _Canon:
    return tuple([_canon(x) for x in obj])


def _canon_map(obj: Any) -> _Canon:
    return ("{}", _sorted([(_canon(k), _canon(v)) for k, v in obj.items()]))


def _canon_set(obj: Any) -> _Canon:
    return ("set", _sorted([_canon(x) for x in obj]))


def _canon_struct(obj: Any) -> _Canon:
    if _STRUCTS_AS_DATA[0]:
        return _canon(msgspec.to_builtins(obj, builtin_types=(bytes,)))
    return msgspec.msgpack.encode(obj)


def _canon_shared_struct(obj: Any) -> _Canon:
    # Layouts are shared between snapshots (see _DISPATCH) and never change.
    form = _SHARED_FORMS.get(id(obj))
    if form is None:
        _share(("form", id(obj)), obj)  # keep it alive: its id stays its own
        form = _SHARED_FORMS[id(obj)] = msgspec.msgpack.encode(obj)
    return form


def _canon_plan(plan: Any) -> _Canon:
    # read_id is a label; the components follow from the layer.
    return ("plan", plan.session, plan.layer_name, _canon(plan.requests))


def _canon_world(world: Any) -> _Canon:
    state = _canon_vars(world)
    reads = _sorted([((e, d), _canon(r)) for (e, d, _), r in world.reads.items()])
    # Write versions are for the traces only: what a block holds is (layer, owners).
    pmem = _sorted([(k, (v[0], _canon(v[2]))) for k, v in world.pmem.items()])
    network = tuple([_canon_frame(f) for f in sorted(world.network, key=_connection_of)])
    # What the checks remember about a request matters only while it lives: once Decode
    # released (or abandoned) it and every Prefill rank finished it, its history is moot.
    live_decode = {x for x, r in world.reqs.items() if not r.released and not r.abandoned}
    live_prefill = {x for prod in world.producers for x in prod.requests()}
    dblocks = {
        (r.spec.engine, b) for x in live_decode for r in (world.reqs[x],) for b in r.dmain + r.didx
    }
    memory = _sorted(
        [_canon(item) for item in world.dmem.items() if (item[0][0], item[0][3]) in dblocks]
    )
    records = tuple(
        _sorted([_canon(item) for item in table.items() if item[0][2] in live_decode])
        for table in (world._terminal, world._delivered)
    )
    aborted = _sorted([_canon(k) for k in world._aborted_to if k[2] in live_prefill])
    # Decode's reply memory (seq -> reply) matters only for a seq that can still reach it:
    # one Prefill still holds (and may resend) or one in flight. Prefill never resends an
    # ended publication and never reuses a seq, and the model stays far below the memory's
    # bounds, so what Decode remembers of any other seq changes nothing that follows.
    askable = {
        (prod.config.session, v.conn, v.seq)
        for prod in world.producers
        for v in prod.publications().values()
    }
    for f in world.network:
        if f.kind == "ReadReadyBatch":
            msg = decode(f.data)
            assert isinstance(msg, ReadReadyBatch)
            askable.add((f.src[1], f.dst[1], msg.seq))
    remembered = _sorted(
        [
            (conn, name, seq, _canon(reply))
            for (e, d), cons in world.consumers.items()
            for conn in (World.conn_name(e, d),)
            for name, session in cons._sessions.items()
            for seq, reply in session.remembered.items()
            if (name, conn, seq) in askable
        ]
    )
    ranks = tuple(
        (
            rank.session,
            rank.next_layer,
            _sorted([_canon(c) for c in rank.chunks.items() if c[0] in live]),
        )
        for rank, prod in zip(world.ranks, world.producers, strict=True)
        for live in (prod.requests(),)
    )
    return (state, reads, pmem, network, memory, records, aborted, ranks, remembered)


def _canon_frame(frame: Frame) -> _Canon:
    """A frame as what its receiver acts on: texts (reasons, error messages) and the send
    time of frames without a delivery bound change nothing."""
    head = (frame.src, frame.dst)
    if frame.kind == "Abort":
        msg = decode(frame.data)
        assert isinstance(msg, Abort)
        return (head, "abort", _canon(msg.ext_ids))
    if frame.kind == "ReadFailed":
        failed = decode(frame.data)
        assert isinstance(failed, ReadFailed)
        return (head, "failed", failed.layer_idx, failed.seq, failed.code)
    if frame.kind == "ReadDone":
        done = decode(frame.data)
        assert isinstance(done, ReadDone)
        isolated = _canon([(f.ext_req_id, f.code) for f in done.failed or ()])
        return (head, "done", done.layer_idx, done.seq, isolated)
    deliver_by = None if frame.deliver_by is None else frame.deliver_by - _NOW[0]
    if frame.kind == "ReadReadyBatch" and _STRUCTS_AS_DATA[0]:
        return (head, _canon_struct(decode(frame.data)), deliver_by)
    return (head, frame.data, deliver_by)


def _canon_producer(prod: Any) -> _Canon:
    live = set(prod._pubs) | set(prod._handshakes)
    # The timer heap is lazy: only its live entries matter, in deadline order.
    timers = tuple(sorted((t - _NOW[0], uid) for t, uid in prod._timers if uid in live))
    return (_canon_vars(prod), timers)


def _canon_consumer(cons: Any) -> _Canon:
    return (_canon_vars(cons), _sorted([_canon(rd) for rd in cons._reads.values()]))


_VAR_NAMES: dict[type, tuple[frozenset[str], tuple[str, ...]]] = {}


def _canon_vars(obj: object) -> tuple[_Canon, ...]:
    own = vars(obj)
    cls = type(obj)
    cached = _VAR_NAMES.get(cls)
    keys = own.keys()
    if cached is None or cached[0] != keys:
        skip = _skip_of(cls)
        cached = _VAR_NAMES[cls] = (frozenset(keys), tuple(a for a in sorted(own) if a not in skip))
    return tuple([_canon(own[a]) for a in cached[1]])


def _skip_of(cls: type) -> frozenset[str]:
    for klass in cls.__mro__:
        skip = _SKIP.get(f"{klass.__module__}.{klass.__qualname__}")
        if skip is not None:
            return skip
    return frozenset()


def _handler_for(t: type) -> Callable[[Any], _Canon]:
    """Build (once per type) the function that canonicalises values of type ``t``."""
    if issubclass(t, World):
        return _canon_world
    if issubclass(t, ProducerEndpoint):
        return _canon_producer
    if issubclass(t, ConsumerEndpoint):
        return _canon_consumer
    if issubclass(t, tuple | list | deque):  # NamedTuples too
        return _canon_seq
    if issubclass(t, dict):
        return _canon_map
    if issubclass(t, set | frozenset):
        return _canon_set
    if issubclass(t, int):  # IntEnum
        return int
    if t in (LayerLayout, DestinationLayout):
        return _canon_shared_struct
    if issubclass(t, msgspec.Struct):
        return _canon_struct
    if t is ReadPlan:
        return _canon_plan
    name = f"{t.__module__}.{t.__qualname__}"
    refs = _REFS.get(name, {})
    slots: list[str] = []
    for klass in reversed(t.__mro__):
        declared = klass.__dict__.get("__slots__", ())
        slots.extend([declared] if isinstance(declared, str) else declared)
    if not slots:
        return lambda obj: (t.__qualname__, _canon_vars(obj))
    skip = _skip_of(t)
    attrs = [a for a in dict.fromkeys(slots) if a not in skip and a != "__weakref__"]
    plain = [a for a in attrs if a not in refs]
    referring = [(a, refs[a]) for a in attrs if a in refs]
    qualname = t.__qualname__

    get_plain = operator.attrgetter(*plain) if len(plain) > 1 else None

    def handler(obj: Any) -> _Canon:
        fields: list[_Canon] = [qualname]
        if get_plain is not None:
            fields.extend([_canon(v) for v in get_plain(obj)])
        elif plain:
            fields.append(_canon(getattr(obj, plain[0])))
        for attr, key in referring:
            value = getattr(obj, attr)
            if isinstance(value, list | tuple):
                fields.append(tuple([_canon(getattr(v, key)) for v in value]))
            else:
                fields.append(_canon(getattr(value, key)))
        return tuple(fields)

    return handler


def fingerprint(world: World, *, symmetry: bool = False) -> int:
    """A hash of ``world``'s canonical form: equal for states that behave the same, up to
    a permutation of interchangeable requests (``symmetry``; see the module docstring):
    the least hash of the forms under every such permutation.

    Python's hash of the form (64 bits): within one process it is stable, and over a
    million states the chance that two different states collide is about 1e-7.
    """
    _NOW[0] = world.now
    static = world.static
    if static.renamings is None:
        static.renamings = _renamings(world)
    if not symmetry or len(static.renamings) == 1:
        return hash(_canon(world))
    _STRUCTS_AS_DATA[0] = True
    try:
        best = None
        for renaming in static.renamings:
            _RENAME.update(renaming)
            h = hash(_canon(world))
            _RENAME.clear()
            best = h if best is None else min(best, h)
    finally:
        _RENAME.clear()
        _STRUCTS_AS_DATA[0] = False
    assert best is not None
    return best


def _renamings(world: World) -> list[dict[object, object]]:
    """Every permutation of the interchangeable requests (same engine, same chunks, both
    allocated late on Decode or neither) as a renaming of their ids and of their block ids
    (block ``j`` of a request to block ``j`` of its image); the identity first, as ``{}``."""
    cfg = world.cfg
    classes: dict[tuple[object, ...], list[str]] = {}
    for spec in cfg.requests:
        key = (spec.engine, spec.chunks, spec.ext_id in cfg.late_decode)
        classes.setdefault(key, []).append(spec.ext_id)
    groups = [ids for ids in classes.values() if len(ids) > 1]
    renamings: list[dict[object, object]] = []
    for images in itertools.product(*(itertools.permutations(ids) for ids in groups)):
        renaming: dict[object, object] = {}
        for ids, image in zip(groups, images, strict=True):
            for src, dst in zip(ids, image, strict=True):
                if src != dst:
                    a, b = world.reqs[src], world.reqs[dst]
                    renaming[src] = dst
                    for blocks, to in ((a.pmain, b.pmain), (a.pidx, b.pidx)):
                        renaming.update(zip(blocks, to, strict=True))
                    for blocks, to in ((a.dmain, b.dmain), (a.didx, b.didx)):
                        renaming.update(zip(blocks, to, strict=True))
        renamings.append(renaming)
    return renamings


def _reply_key(msg: ReadReadyBatch | ReadDone | ReadFailed) -> int | str:
    """What a reply echoes of its readiness: the seq, or (v1 shapes) the layer."""
    return msg.seq if msg.seq is not None else f"layer {msg.layer_idx}"


def _identity(ext: str) -> str:
    return ext


def _int(value: object) -> int:
    assert isinstance(value, int)
    return value


def _summary(msg: Message) -> str:
    if isinstance(msg, ReadReadyBatch):
        ids = [r.ext_req_id for r in msg.read_reqs]
        return (
            f"read_ready_batch layer {msg.layer_idx} seq {msg.seq} member {msg.group_member_idx} "
            f"reqs {ids} done {msg.done_ext_ids}"
        )
    if isinstance(msg, ReadDone):
        failed = [(f.ext_req_id, ErrorCode(f.code).name) for f in msg.failed or ()]
        return f"read_done layer {msg.layer_idx} seq {msg.seq}" + (
            f" failed {failed}" if failed else ""
        )
    if isinstance(msg, ReadFailed):
        code = ErrorCode(msg.code).name if msg.code is not None else "?"
        return f"read_failed layer {msg.layer_idx} seq {msg.seq} {code}"
    if isinstance(msg, Abort):
        return f"abort {msg.ext_ids}"
    return type(msg).__name__.lower()


# -- the explorer --------------------------------------------------------------------------


def _two_requests(
    engines: Sequence[int], chunks: tuple[int, ...] = (2,)
) -> tuple[RequestSpec, ...]:
    return tuple(RequestSpec(f"r{i}", e, chunks) for i, e in enumerate(engines))


# The explorer's worlds: time in 1/2 s ticks (see WorldConfig.tick), every connection
# handshaken first, Decode releasing a request as soon as it finished everywhere. Every
# configuration has faults: a lost readiness and leases that expire (time passes while
# frames and reads wait) everywhere, and as many more as the complete exploration of all
# of them affords (tools/run-tests.sh states the budget; what each fault costs, in states:
# tp2-d2 has 18342 with a lost readiness alone, 30967 with a dropped reply too, 49448 with
# a kill instead, and more than 60000 with an abort instead).
_EXPLORED: Final = WorldConfig(
    p_tp=2,
    engines=(1,),
    n_layers=2,
    n_storages=1,
    upfront=True,
    lease_ms=1000,
    handshake_timeout_s=0.5,
    park_timeout_s=0.5,
    kv_load_timeout_s=2.0,
    tick=0.5,
    auto_release=True,
    warmup=True,
    # A readiness lost on a live connection (ZMQ drops queued frames at a high-water mark
    # or a reconnect) in every configuration: Decode must never complete over the hole.
    budgets=(("lose", 1), ("drop", 1)),
)

# Peers of other versions or capabilities: one Prefill rank, one Decode rank, two
# storages (a lost readiness of layer 0 is then not held up by layer 1's gate).
_PEERS: Final = replace(_EXPLORED, p_tp=1, n_storages=2, requests=_two_requests((0, 0)))
# Every fault but a duplicate or a failed read, where the state space stays small.
_MANY_FAULTS: Final = (("lose", 1), ("drop", 1), ("abort", 1), ("kill", 1))


def _without(*capabilities: str) -> tuple[str, ...]:
    return tuple(c for c in ALL_CAPABILITIES if c not in capabilities)


#: The configurations ``python -m rd2h_protocol.checker.explore`` checks, by name.
CONFIGS: Final[dict[str, WorldConfig]] = {
    # 2 Prefill ranks -> 1 Decode rank (ratio 2): both contributors must report.
    "tp2-d1": replace(_EXPLORED, requests=_two_requests((0, 0))),
    # 2 Prefill ranks -> 2 Decode ranks (ratio 1): the main pool is split over the ranks.
    "tp2-d2": replace(_EXPLORED, engines=(2,), requests=_two_requests((0, 0))),
    # One Prefill rank, one Decode rank, with faults: a dropped reply and an abort; no
    # reuse ring, so both layers of a step can be outstanding at once.
    "faults": replace(_PEERS, budgets=(("lose", 1), ("drop", 1), ("abort", 1))),
    # A connection breaks and ZMQ reconnects it (a Decode stalled past the heartbeat
    # timeout): whatever was in flight on it is lost both ways, and Prefill resends every
    # unanswered readiness under its seq; Decode answers a seq it saw from memory.
    "reconnect": replace(_PEERS, budgets=(("break", 1), ("drop", 1), ("lose", 1))),
    # The rendezvous outruns the Decode worker: readiness naming r1 waits in the park
    # while readiness naming r0 alone may be served first (pipelined layers, a Prefill
    # abort).
    "parking": replace(
        _EXPLORED,
        p_tp=1,
        n_storages=2,
        kv_load_timeout_s=1.0,
        requests=_two_requests((0, 0)),
        late_decode=("r1",),
        budgets=(("lose", 1), ("drop", 1), ("prefill_abort", 1)),
    ),
    # Two Decode engines reading the same Prefill storage (one request each): the gate
    # must wait for both publications of a layer.
    "two-engines": replace(_EXPLORED, p_tp=1, engines=(1, 1), requests=_two_requests((0, 1))),
    # The handshake itself: MF_META and ACK race the lease and the handshake timeout.
    "handshake": replace(
        _EXPLORED,
        p_tp=1,
        warmup=False,
        requests=_two_requests((0,)),
        budgets=_MANY_FAULTS,
    ),
    # A v1 Prefill (no seq, no lease, no ABORT) toward rd2h's Decode. A lost readiness
    # is invisible to Decode (S2) and, never answered, holds its storage (L1): both are
    # stated in rd2h_protocol.checker.invariants as where those invariants do not hold.
    "v1-prefill": replace(_PEERS, prefill_protocol="v1", expect=("S2", "L1")),
    # A Decode that answers like v1 (no capability): Prefill speaks the v1 shapes to it,
    # with the same two limits.
    "v1-decode": replace(_PEERS, decode_capabilities=(), expect=("S2", "L1")),
    # A v2 Decode that cannot be told to stop: an expired lease is held until it replies.
    # The held publication is resent once (Decode serves it, or answers a seq it lost in a
    # gap from memory); if the Decode dies meanwhile, its storage stays held until the
    # runtime declares the peer dead, which the model does not do (L1).
    "no-abort": replace(
        _PEERS, decode_capabilities=_without("abort"), budgets=_MANY_FAULTS, expect=("L1",)
    ),
    # A v2 Decode that gets no lease: it may start a read whenever the readiness arrives, so
    # an expired publication is told (ABORT) but held until the reply, and resent once to
    # ask for it; a lost readiness whose answer to that resend is dropped too stays held
    # (L1).
    "no-lease": replace(_PEERS, decode_capabilities=_without("lease"), expect=("L1",)),
    # A Decode that answers like v1, declared dead once it held storage and stayed silent
    # for silent_peer_timeout_s: no storage is held for good (L1), at the price stated in
    # the invariants: a Decode that is slow rather than dead may read reused storage (S1).
    "silent-v1-decode": replace(
        _PEERS, decode_capabilities=(), silent_peer_timeout_s=1.0, expect=("S1", "S2")
    ),
    # v1's own behaviour toward a Decode that can neither be told to stop nor bounded by a
    # lease: the storage reopens at lease expiry while that Decode may still read it.
    "reopen": replace(
        _PEERS,
        v1_lease_expiry="reopen",
        decode_capabilities=_without("abort", "lease"),
        budgets=_MANY_FAULTS,
        expect=("S1",),
    ),
}


_FAULTS: Final = (
    "drop",
    "dup",
    "abort",
    "prefill_abort",
    "release",
    "read_fail",
    "kill",
    "break",
    "lose",
)


@dataclass
class ExploreResult:
    """What one exploration found: counts, and the first violation of each invariant
    found (``found``: name -> (violation, a shortest trace to it))."""

    name: str
    expect: frozenset[str] = frozenset()
    states: int = 0
    transitions: int = 0
    depth: int = 0
    final_states: int = 0
    complete: bool = True
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    found: dict[str, tuple[InvariantViolation, list[str]]] = field(default_factory=dict)

    @property
    def unexpected(self) -> list[str]:
        """Invariants broken that the configuration does not expect to break."""
        return [name for name in self.found if name not in self.expect]

    @property
    def missing(self) -> list[str]:
        """Expected breaks a complete exploration did not find (a bounded one may not)."""
        return sorted(self.expect - set(self.found)) if self.complete else []

    @property
    def passed(self) -> bool:
        """No unexpected violation and, if complete, every expected one found."""
        return not self.unexpected and not self.missing

    @property
    def violation(self) -> InvariantViolation | None:
        """The unexpected violation that stopped the exploration, if any."""
        unexpected = self.unexpected
        return self.found[unexpected[0]][0] if unexpected else None

    @property
    def trace(self) -> list[str]:
        """A shortest trace to :attr:`violation` (empty without one)."""
        unexpected = self.unexpected
        return self.found[unexpected[0]][1] if unexpected else []

    def record(self, violation: InvariantViolation, trace: list[str]) -> bool:
        """Remember ``violation`` (the first of its name only); True if it is expected."""
        self.found.setdefault(violation.name, (violation, trace))
        return violation.name in self.expect


def explore(
    name: str,
    cfg: WorldConfig,
    *,
    max_states: int = 1_000_000,
    world: Callable[[WorldConfig], World] = World,
    symmetry: bool = False,
) -> ExploreResult:
    """Breadth-first search over every interleaving of ``cfg``'s enabled actions.

    Stops at the first violation of an invariant that ``cfg.expect`` does not name (its
    trace is a shortest one) or after ``max_states`` distinct states (``complete`` is
    then False). A state that breaks an expected invariant is recorded (the first of each
    name, with a shortest trace) and not expanded; the search goes on around it.
    ``symmetry``: merge states that differ by a permutation of interchangeable requests
    (see :func:`fingerprint`).
    """
    started, cpu_started = time.perf_counter(), time.process_time()
    result = ExploreResult(name, frozenset(cfg.expect))
    try:
        root = world(cfg)
        root.check()
    except InvariantViolation as exc:
        result.record(exc, ["(while building the initial state)"])
        result.seconds = time.perf_counter() - started
        result.cpu_seconds = time.process_time() - cpu_started
        return result
    data = root.snapshot()
    fp = fingerprint(root, symmetry=symmetry)
    parents: dict[int, tuple[int, str] | None] = {fp: None}
    frontier: list[tuple[int, bytes]] = [(fp, data)]

    def trace_to(node: int) -> list[str]:
        steps: list[str] = []
        entry = parents[node]
        while entry is not None:
            node, label = entry
            steps.append(label)
            entry = parents[node]
        return steps[::-1]

    stop = False
    while frontier and not stop:
        successors: list[tuple[int, bytes]] = []
        for fp, data in frontier:
            state: World = pickle.loads(data)
            acts = state.actions()
            if not acts:
                result.final_states += 1
                try:
                    state.check_quiescent()
                    state.check_idle()
                except InvariantViolation as exc:
                    stop = not result.record(exc, [*trace_to(fp), "(no action left)"])
                    if stop:
                        break
                continue
            for n, act in enumerate(acts):
                label = state.describe(act)
                # The last action may consume the parent itself: one copy fewer.
                child: World = state if n == len(acts) - 1 else pickle.loads(data)
                result.transitions += 1
                try:
                    child.apply(act)
                except InvariantViolation as exc:
                    stop = not result.record(exc, [*trace_to(fp), label])
                except Exception as exc:  # an endpoint that raises is a bug too
                    crash = InvariantViolation("CRASH", f"{type(exc).__name__}: {exc}")
                    stop = not result.record(crash, [*trace_to(fp), label])
                else:
                    child_fp = fingerprint(child, symmetry=symmetry)
                    if child_fp in parents:
                        continue
                    parents[child_fp] = (fp, label)
                    successors.append((child_fp, child.snapshot()))
                    if len(parents) >= max_states:
                        result.complete = False
                        stop = True
                if stop:
                    break
            if stop:
                break
        if stop:
            break
        frontier = successors
        if frontier:
            result.depth += 1
            # Seqs and uids grow by a few per step: far below the block ids (FIRST_*_BLOCK).
            assert result.depth < 1 << 16, "too deep for the symmetry reduction's renaming"
    result.states = len(parents)
    result.seconds = time.perf_counter() - started
    result.cpu_seconds = time.process_time() - cpu_started
    return result


def _explore_star(job: tuple[str, WorldConfig, int, bool]) -> ExploreResult:
    name, cfg, max_states, symmetry = job
    return explore(name, cfg, max_states=max_states, symmetry=symmetry)


def _report(result: ExploreResult, max_states: int) -> None:
    if result.violation is not None:
        status = "stopped at a violation"
    elif result.complete:
        status = "complete"
    else:
        status = f"stopped at --max-states {max_states}"
    print(
        f"{result.name}: {result.states} distinct states, {result.transitions} transitions, "
        f"depth {result.depth}, {result.final_states} final states, {status}, "
        f"{result.seconds:.1f} s ({result.cpu_seconds:.1f} s CPU)"
    )
    if result.expect:
        found = sorted(set(result.found) & result.expect)
        print(
            f"  expected to break {', '.join(sorted(result.expect))}: "
            f"found {', '.join(found) or 'none'}"
            + (f", MISSING {', '.join(result.missing)}" if result.missing else "")
        )
    for inv, (violation, trace) in result.found.items():
        label = "expected violation" if inv in result.expect else "VIOLATION"
        print(f"{label} {violation} after {len(trace)} steps:")
        for i, step in enumerate(trace, 1):
            print(f"  {i:3d}. {step}")
    sys.stdout.flush()


def _report_reduction(reduced: ExploreResult, plain: ExploreResult) -> None:
    print(
        f"{reduced.name}: symmetry reduction {reduced.states} states in "
        f"{reduced.cpu_seconds:.1f} s CPU, without {plain.states} states in "
        f"{plain.cpu_seconds:.1f} s CPU: states x{plain.states / reduced.states:.2f}, "
        f"CPU time x{plain.cpu_seconds / max(reduced.cpu_seconds, 1e-9):.2f}"
        + ("" if reduced.complete and plain.complete else " (bounded by --max-states)"),
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rd2h_protocol.checker.explore [--config NAME ...] [--max-states N] [--jobs N]``.

    Configurations run in parallel processes (``--jobs``); results print in order.
    """
    parser = argparse.ArgumentParser(
        prog="python -m rd2h_protocol.checker.explore",
        description="Explore every interleaving of small RD2H configurations and check the "
        "invariants (rd2h_protocol.checker.invariants) in every state.",
    )
    parser.add_argument(
        "--config",
        action="append",
        choices=sorted(CONFIGS),
        help="configuration to explore (repeatable; default: all)",
    )
    parser.add_argument(
        "--max-states",
        type=int,
        default=1_000_000,
        help="stop a configuration after this many distinct states (default: %(default)s)",
    )
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="FAULT=N",
        help="set a fault budget of the chosen configurations (drop, dup, abort, "
        "prefill_abort, release, read_fail, kill, lose); repeatable",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="configurations explored at once, one process each (default: one per CPU)",
    )
    parser.add_argument(
        "--symmetry",
        action="store_true",
        help="merge states that differ by a permutation of interchangeable requests",
    )
    parser.add_argument(
        "--compare-reduction",
        action="store_true",
        help="explore every chosen configuration with and without the symmetry reduction "
        "and print the ratios of states and of CPU time",
    )
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    args = parser.parse_args(argv)
    overrides: dict[str, int] = {}
    for item in args.budget:
        fault, _, count = item.partition("=")
        if fault not in _FAULTS or not count.isdigit():
            parser.error(f"--budget expects FAULT=N with FAULT in {', '.join(_FAULTS)}: {item!r}")
        overrides[fault] = int(count)
    if args.list:
        for name, cfg in CONFIGS.items():
            print(f"{name}: {cfg}")
        return 0
    names = args.config or list(CONFIGS)
    cfgs = [CONFIGS[name] for name in names]
    if overrides:
        cfgs = [replace(c, budgets=tuple({**dict(c.budgets), **overrides}.items())) for c in cfgs]
    ways = (True, False) if args.compare_reduction else (args.symmetry,)
    work = [
        (name, cfg, args.max_states, symmetry)
        for name, cfg in zip(names, cfgs, strict=True)
        for symmetry in ways
    ]
    jobs = min(len(work), args.jobs or os.cpu_count() or 1)
    total_states = 0
    failed = 0
    incomplete = 0
    with contextlib.ExitStack() as stack:
        results: Iterator[ExploreResult] = map(_explore_star, work)
        if jobs > 1:
            pool = stack.enter_context(multiprocessing.get_context("fork").Pool(jobs))
            results = pool.imap(_explore_star, work)  # in order, each as soon as it can
        for _ in names:
            result = next(results)
            _report(result, args.max_states)
            if args.compare_reduction:
                _report_reduction(result, next(results))
            total_states += result.states
            incomplete += not result.complete
            failed += not result.passed
    print(
        f"explored {len(names)} configurations, {total_states} states, "
        f"incomplete={incomplete} violations={failed}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    # Run the imported module, not this __main__ copy: snapshots name classes by module.
    from rd2h_protocol.checker.explore import main as _main

    sys.exit(_main())
