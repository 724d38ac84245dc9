"""What configures one Decode endpoint, what it counts, and the type of what it outputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from rd2h_protocol.errors import ConfigError
from rd2h_protocol.events import ConsumerOutput
from rd2h_protocol.wire.layout import DestinationLayout
from rd2h_protocol.wire.messages import ALL_CAPABILITIES


@dataclass(frozen=True)
class ConsumerConfig:
    """Configuration of one Decode TP rank's endpoint.

    ``layers`` is this rank's ordered list of ``(layer name, destination)``: a readiness
    is served by its layer NAME, and its ``layer_idx`` is checked against that name.
    ``compat`` is compared with a v2
    Prefill's MF_META ``compat`` (when both are set); a mismatch refuses the handshake.
    ``kv_load_timeout_s``: a request waiting for KV with no progress for that long fails.
    ``max_parked`` / ``park_timeout_s`` bound the readiness (and aborts) kept for requests
    not known yet, and so do ``max_parked_bytes`` (the bytes of memory they hold: a
    parked readiness keeps its entries packed as msgpack, about its frame's size, plus
    each request id it names and an index entry per awaited id; see
    :mod:`rd2h_protocol.consumer.parking`) and ``max_parked_bytes_per_session`` (one
    Prefill session's share of it, so that a flood from one peer leaves room for the
    others); a readiness beyond a bound is served at once, its unknown requests failing
    alone. ``max_read_retries``: retries of a batched read that failed with a
    transient error. ``max_retired``: how many recently finished request ids are
    remembered, so a late readiness for them is refused at once instead of parked.
    ``max_sessions``: Prefill sessions kept (beyond it, the least recently bound session
    of the connection that holds the most goes). ``max_session_bytes`` bounds the bytes
    the sessions hold in all, and ``max_session_bytes_per_peer`` what the sessions one
    connection opened hold: a session's record, the decoded layouts of this rank's layers
    (only those are kept, whatever the handshake lists), its validated layers, its reply
    memory (at most 1 MiB) and its last readiness entries while they are kept (see
    :mod:`rd2h_protocol.consumer.held`). Beyond a connection's budget its own kept entries
    go first, then its least recently bound sessions, nobody else's; beyond the total,
    those of the connections that hold the most. A forgotten session's Prefill (v2) is
    told UNKNOWN_SESSION and hand-shakes again. The defaults keep one peer's sessions
    within 16 MiB (the entries of the largest legal readiness,
    :data:`~rd2h_protocol.wire.messages.MAX_BLOCK_IDS_PER_READINESS` ids, are charged at
    most 11 MiB, and fit) and all within 64 MiB.
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
    max_session_bytes_per_peer: int = 16 << 20
    max_parked_bytes: int = 64 << 20
    max_parked_bytes_per_session: int = 16 << 20
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
            "max_parked_bytes",
            "max_parked_bytes_per_session",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_parked_bytes_per_session > self.max_parked_bytes:
            raise ConfigError(
                "max_parked_bytes_per_session must not exceed max_parked_bytes, got "
                f"{self.max_parked_bytes_per_session} > {self.max_parked_bytes}"
            )
        if self.max_session_bytes_per_peer > self.max_session_bytes:
            raise ConfigError(
                "max_session_bytes_per_peer must not exceed max_session_bytes, got "
                f"{self.max_session_bytes_per_peer} > {self.max_session_bytes}"
            )
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
    entries_dropped: int = 0  # kept readiness entries forgotten beyond a session budget
    park_budget_refusals: int = 0  # beyond max_parked_bytes(_per_session)
    block_id_refusals: int = 0  # readiness over MAX_BLOCK_IDS_PER_READINESS (also malformed)
