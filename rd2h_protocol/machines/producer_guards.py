"""The guards the Prefill-side tables name (:mod:`rd2h_protocol.machines.producer`)."""

from __future__ import annotations

from typing import Final

from rd2h_protocol.machines.declare import Guard

__all__ = ["GUARDS"]

#: Every guard the Prefill tables name: what it says and the method that resolves it.
GUARDS: Final[dict[str, Guard]] = {
    # storage-slot gate
    "others_outstanding": Guard(
        "other publications against the storage are still outstanding",
        "ProducerEndpoint._end_pub (the gate's count)",
    ),
    "last_outstanding": Guard(
        "it was the last publication outstanding against the storage",
        "ProducerEndpoint._end_pub (the gate's count)",
    ),
    "v1_lease_expiry_reopen": Guard(
        'v1_lease_expiry="reopen" (unsafe: v1\'s liveness over safety)',
        "ProducerEndpoint._expire, ._settle_held",
    ),
    # layer publication
    "connection_ready": Guard(
        "its connection's handshake is done (ready_v1 or ready_v2)",
        "the connection table (send, flush): ProducerEndpoint._fx_conn_send, ._fx_flush",
    ),
    "lease_ms_left": Guard(
        "at least 1 ms of its lease is left (a fresh publication has all of it)",
        "ProducerEndpoint._fx_flush",
    ),
    "no_lease_ms_left": Guard(
        "less than 1 ms of its lease is left when the handshake ends",
        "ProducerEndpoint._fx_flush",
    ),
    "peer_has_lease": Guard(
        "the peer has the lease capability: its reads are bounded by the lease",
        "ProducerEndpoint._expire",
    ),
    "abort_goes_out_now_or_all_told": Guard(
        "every request was told already, or the ABORT goes out now (ready_v2 with abort)",
        "ProducerEndpoint._expire (._abort_frees_storage)",
    ),
    "abort_cannot_go_out_now": Guard(
        "not the two above: no ABORT that frees the storage can go out now",
        "ProducerEndpoint._expire",
    ),
    "peer_takes_abort_or_v1_hold": Guard(
        'the peer has the abort capability, or v1_lease_expiry="hold"',
        "ProducerEndpoint._expire",
    ),
    "peer_cannot_be_told": Guard(
        "the peer has no abort capability (v1)", "ProducerEndpoint._expire"
    ),
    "handshake_done_with_abort": Guard(
        "a handshake ended and the ABORT the held publication waits for went out",
        "ProducerEndpoint._settle_held",
    ),
    "handshake_done_without_abort": Guard(
        "a handshake ended and no ABORT can go out to the peer",
        "ProducerEndpoint._settle_held",
    ),
    "lease_expired": Guard(
        "its lease ran out already (it is held)", "ProducerEndpoint.connection_lost"
    ),
    # kept request (Prefill-first)
    "claim_usable": Guard(
        "the claiming Decode passes the topology rules and is not a known v1 peer",
        "ProducerEndpoint.claim",
    ),
    "claim_unusable": Guard(
        "the claiming Decode's topology is refused, or it speaks only v1 (no Prefill-first flow)",
        "ProducerEndpoint.claim",
    ),
    "lease_left": Guard(
        "some of its lease is left (a live one past it is not resent)",
        "ProducerEndpoint._resend",
    ),
    "peer_resend": Guard(
        "the peer has the resend capability and the connection is ready_v2",
        "ProducerEndpoint._resend",
    ),
    "peer_dead": Guard(
        "the runtime declared the peer dead while the lease ran (orphaned)",
        "ProducerEndpoint._expire",
    ),
    # Prefill request
    "last_layer": Guard(
        "the layer published is the last cache-bearing layer of the step",
        "ProducerEndpoint.layer_written",
    ),
    "none_outstanding": Guard(
        "no publication that named the request is outstanding",
        "ProducerEndpoint._maybe_drain",
    ),
    # connection handshake
    "backoff_elapsed": Guard(
        "the refusal's backoff has passed (now >= retry_at)", "ProducerEndpoint._conn_publish"
    ),
    "held_aborts_waiting": Guard(
        "held publications wait for an ABORT and the idle connection's peer takes ABORT",
        "ProducerEndpoint._retry_for_held_aborts",
    ),
    "peer_reconnects": Guard(
        "the peer has the reconnect capability: UNKNOWN_SESSION means it lost our handshake",
        "ProducerEndpoint._on_read_failed",
    ),
}
