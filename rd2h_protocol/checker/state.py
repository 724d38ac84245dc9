"""The state of a model world: what it is made of, set up once, and the endpoints built.

:class:`WorldState` is the bottom layer of :class:`~rd2h_protocol.checker.world.World`
(the layers are listed there). Its ``__init__`` sets every attribute of a world's state
(the endpoints, the frames in flight, the reads under way, the memory model and what the
checks remember), which all layers above share. It also builds endpoints and their
configurations, one configuration object per world configuration, rank and session (so
that snapshots share them), and the layouts every layer of a configuration has. It is
apart from :mod:`~rd2h_protocol.checker.core`, which makes the state move (requests, the
compute path, outputs and their checks), because none of this changes after a world is
made, other than the endpoints a fault replaces.
"""

from __future__ import annotations

from rd2h_protocol.checker.model import (
    BASE_PORT,
    BLOCK_LEN,
    FIRST_DECODE_BLOCK,
    FIRST_PREFILL_BLOCK,
    HOST,
    NUM_DECODE_BLOCKS,
    NUM_PREFILL_BLOCKS,
    PORTS_PER_ENGINE,
    Frame,
    Rank,
    Read,
    ReplyKey,
    Req,
    Static,
    Value,
    WorldConfig,
    decode_bases,
    layer_name,
    prefill_bases,
)
from rd2h_protocol.completion import CrossRankCompletion
from rd2h_protocol.consumer import (
    ConsumerConfig,
    ConsumerEndpoint,
)
from rd2h_protocol.producer import (
    DecodeTarget,
    ProducerConfig,
    ProducerEndpoint,
)
from rd2h_protocol.wire.layout import ComponentDest, DestinationLayout, LayerLayout

__all__ = ["WorldState"]
_STATICS: dict[int, Static] = {}


def _destination(parts: list[ComponentDest]) -> DestinationLayout:
    """K, V, indexer, scale (in BLOCK_LEN's order) as one layer's destination."""
    k, v, indexer, scale = parts
    return DestinationLayout((k, v), indexer, scale)


def _static_of(cfg: WorldConfig) -> Static:
    static = _STATICS.get(id(cfg))
    if static is not None:
        return static
    prefill = [
        (
            layer_name(layer),
            LayerLayout(
                base_addrs=list(prefill_bases(layer % cfg.n_storages)),
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
                    for base, size in zip(decode_bases(layer), BLOCK_LEN, strict=True)
                ]
            ),
        )
        for layer in range(cfg.n_layers)
    ]
    conn_rank = {
        WorldState.conn_name(e, d): (e, d)
        for e, d_tp in enumerate(cfg.engines)
        for d in range(d_tp)
    }
    static = Static(prefill, decode, {name: i for i, (name, _) in enumerate(decode)}, conn_rank)
    _CONFIGS.setdefault((id(cfg), "W", 0, None), cfg)  # keeps cfg, so its id stays its own
    _STATICS[id(cfg)] = static
    return static


# Endpoint configurations by (id of the world config, side, rank, session or TP size).
# The world config they hang off is kept alive with them, so its id is never reused.
_CONFIGS: dict[tuple[int, str, int, object], ProducerConfig | ConsumerConfig | WorldConfig] = {}


class WorldState:
    """The attributes of a model world's state, and how its endpoints are built.

    See the module docstring. Only :class:`~rd2h_protocol.checker.world.World` is meant
    to be built.
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
        self.ranks: list[Rank] = []
        self.producers: list[ProducerEndpoint] = []
        self._gens: list[int] = []
        for p in range(cfg.p_tp):
            self._gens.append(0)
            self.ranks.append(Rank(f"p{p}.0"))
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
        self.reads: dict[tuple[int, int, int], Read] = {}
        self.pmem: dict[tuple[str, int], tuple[int, int, frozenset[str]]] = {}
        self.dmem: dict[tuple[int, int, int, int], Value] = {}
        self._version = 0
        # Requests and what the checks remember.
        self.reqs: dict[str, Req] = {}
        self._powner: dict[int, tuple[str, int]] = {}
        self._next_pblock = FIRST_PREFILL_BLOCK
        self._next_dblock = FIRST_DECODE_BLOCK  # one range for every engine: ids stay unique
        self._terminal: dict[tuple[int, int, str], str] = {}
        self._delivered: dict[tuple[int, int, str], set[int]] = {}
        # Readiness delivered and not answered yet, by what the reply will echo: its seq, or
        # (v1 shapes) its layer; (member, done ids) in the order they arrived.
        self._readiness: dict[ReplyKey, list[tuple[int, tuple[str, ...]]]] = {}
        self._released: set[tuple[int, int, str]] = set()
        self._prefill_finished: set[tuple[str, str]] = set()
        self._aborted_to: set[tuple[str, str, str]] = set()
        # Prefill-first: requests kept on a Prefill incarnation and not finished there
        # (session, ext id) -> claimed; claims a Decode rank waits to have answered
        # (engine, Decode rank, ext id, Prefill session).
        self._kept: dict[tuple[str, str], bool] = {}
        self._claims: set[tuple[int, int, str, str]] = set()

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
                claim_timeout_s=self.cfg.claim_timeout_s,
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
