"""The Prefill endpoint's public types.

Its configuration (:class:`ProducerConfig`), the Decode engines it publishes to
(:class:`DecodeTarget`), what every input returns a list of (:data:`Output`), its counters
(:class:`ProducerStats`) and the view of a live publication that invariant checks read
(:class:`PublicationView`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from rd2h_protocol.errors import ConfigError
from rd2h_protocol.events import ProducerOutput
from rd2h_protocol.topology import map_prefill_rank
from rd2h_protocol.wire.layout import LayerLayout

ReadFailurePolicy: TypeAlias = Literal["isolate", "raise"]
ProtocolChoice: TypeAlias = Literal["v2", "v1"]
V1LeaseExpiry: TypeAlias = Literal["hold", "reopen"]

_MAX_LEASE_MS: Final = (1 << 32) - 1  # lease_ms is a uint32 on the wire


#: ``silent_peer_timeout_s`` that follows the lease (the default; see ProducerConfig).
SILENT_FROM_LEASE: Final = -1.0
#: The shortest silence that declares a peer holding storage dead, whatever the lease.
SILENT_FLOOR_S: Final = 1.0


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
    storage closed until that peer replies or is declared dead (package docstring);
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
    lasts. The default, :data:`SILENT_FROM_LEASE`, is resolved here to one lease, and
    never less than :data:`SILENT_FLOOR_S`: a live Decode answers a readiness within
    milliseconds of its read, so one that stayed silent through a whole lease and then
    a second one is dead or wedged, and the storage it held waits two leases in all
    (the README's Limitations give the figures). A resolved value is a plain number:
    ``dataclasses.replace`` with another ``lease_ms`` keeps it (pass the sentinel again).

    ``claim_timeout_s``: how long a Prefill-first request is kept for the Decode that will
    claim it (:meth:`ProducerEndpoint.keep_request`); then it finishes unread and its
    blocks may be freed (a router that dropped the second step, a client gone).
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
    silent_peer_timeout_s: float | None = -1.0  # SILENT_FROM_LEASE: resolved below
    claim_timeout_s: float = 120.0

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
        if self.silent_peer_timeout_s == SILENT_FROM_LEASE:
            window = max(self.lease_ms / 1000.0, SILENT_FLOOR_S)
            object.__setattr__(self, "silent_peer_timeout_s", window)
        if self.silent_peer_timeout_s is not None and not self.silent_peer_timeout_s > 0:
            raise ConfigError(
                f"silent_peer_timeout_s: expected > 0 or None, got {self.silent_peer_timeout_s}"
            )
        if not self.claim_timeout_s > 0:
            raise ConfigError(f"claim_timeout_s: expected > 0, got {self.claim_timeout_s}")
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
    # What silent peers cost the others: publications they held past their lease until
    # declared dead, and the seconds those held their storage closed (summed over them).
    silent_held_publications: int = 0
    silent_held_s: float = 0.0
    protocol_violations: int = 0  # declared dead: input that no table allows
    kept: int = 0  # Prefill-first requests kept for a Decode's claim
    claimed: int = 0  # ... claimed by a Decode and published
    unclaimed: int = 0  # ... whose claim window ran out: freed unread
    claims_refused: int = 0  # claims answered with a refusal (unknown, twice, unusable)


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
