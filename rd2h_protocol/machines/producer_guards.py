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
        "PublicationEffects.end_pub (the gate's count)",
    ),
    "last_outstanding": Guard(
        "it was the last publication outstanding against the storage",
        "PublicationEffects.end_pub (the gate's count)",
    ),
    "v1_lease_expiry_reopen": Guard(
        'v1_lease_expiry="reopen" (unsafe: v1\'s liveness over safety)',
        "leases.fx_lease_ran_out",
    ),
    # layer publication
    "connection_ready": Guard(
        "its connection's handshake is done (ready_v1 or ready_v2)",
        "the connection table (send, flush): ConnectionEffects._fx_conn_send, ._fx_flush",
    ),
    "lease_ms_left": Guard(
        "at least 1 ms of its lease is left (a fresh publication has all of it)",
        "ConnectionEffects._fx_flush",
    ),
    "no_lease_ms_left": Guard(
        "less than 1 ms of its lease is left when the handshake ends",
        "ConnectionEffects._fx_flush",
    ),
    "peer_has_lease": Guard(
        "the peer has the lease capability: its reads are bounded by the lease",
        "leases.fx_lease_ran_out",
    ),
    "abort_goes_out_now_or_all_told": Guard(
        "every request was told already, or the ABORT goes out now (ready_v2 with abort)",
        "leases.fx_lease_ran_out (ConnectionEffects.abort_frees_storage)",
    ),
    "abort_cannot_go_out_now": Guard(
        "not the two above: no ABORT that frees the storage can go out now",
        "leases.fx_lease_ran_out",
    ),
    "peer_takes_abort_or_v1_hold": Guard(
        'the peer has the abort capability, or v1_lease_expiry="hold"',
        "leases.fx_lease_ran_out",
    ),
    "peer_cannot_be_told": Guard(
        "the peer has no abort capability (v1)", "leases.fx_lease_ran_out"
    ),
    "lease_expired": Guard("its lease ran out already (it is held)", "dead_peers.lose_connection"),
    # kept request (Prefill-first)
    "claim_usable": Guard(
        "the claiming Decode passes the topology rules and is not a known v1 peer",
        "KeptEffects.claim",
    ),
    "claim_unusable": Guard(
        "the claiming Decode's topology is refused, or it speaks only v1 (no Prefill-first flow)",
        "KeptEffects.claim",
    ),
    "no_lease_left": Guard(
        "the peer has the lease capability and none of its lease is left",
        "PublicationEffects.resend",
    ),
    "silence_bound": Guard(
        "silent_peer_timeout_s is set (only then has a held publication a deadline)",
        "leases.fx_hold (it arms that deadline)",
    ),
    "backoff_running": Guard(
        "the refusal's backoff has not passed (now < retry_at)",
        "ConnectionEffects.publish",
    ),
    "lease_left": Guard(
        "some of its lease is left (a live one past it is not resent)",
        "PublicationEffects.resend",
    ),
    "peer_resend": Guard(
        "the peer has the resend capability and the connection is ready_v2",
        "PublicationEffects.resend",
    ),
    "peer_dead": Guard(
        "the runtime declared the peer dead while the lease ran (orphaned)",
        "leases.fx_orphan_lease_ran_out (an orphaned publication's TIMER_DUE)",
    ),
    # Prefill request
    "last_layer": Guard(
        "the layer published is the last cache-bearing layer of the step",
        "ProducerEndpoint.layer_written",
    ),
    "none_outstanding": Guard(
        "no publication that named the request is outstanding",
        "RequestEffects.maybe_drain",
    ),
    # connection handshake
    "backoff_elapsed": Guard(
        "the refusal's backoff has passed (now >= retry_at)", "ConnectionEffects.publish"
    ),
    "peer_takes_abort": Guard(
        "the peer has the abort capability (as the last handshake said)",
        "ConnectionEffects.send_abort",
    ),
    "peer_lacks_abort": Guard(
        "the peer has no abort capability (as the last handshake said)",
        "ConnectionEffects.send_abort",
    ),
    "v2_endpoint": Guard(
        'this endpoint speaks v2 (protocol is not "v1": no ABORT goes out at all under v1)',
        "ConnectionEffects.send_abort",
    ),
    "peer_reconnects": Guard(
        "the peer has the reconnect capability: UNKNOWN_SESSION means it lost our handshake"
        " (on a connection that is ready_v2 or hand-shaking again: it can hand-shake anew)",
        "PublicationEffects.on_read_failed",
    ),
}
