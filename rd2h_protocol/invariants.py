"""The safety and liveness properties the protocol guarantees, stated once.

The model-checking tests (:mod:`rd2h_protocol.testing`, :mod:`rd2h_protocol.explore`)
check them after every step; the docs generator prints them. Each entry is
``(name, kind, statement)``.
"""

from __future__ import annotations

from typing import Final

INVARIANTS: Final[tuple[tuple[str, str, str], ...]] = (
    (
        "S1",
        "safety",
        "A Prefill storage slot (main or indexer, identified by its base addresses) is open "
        "only if every readiness published against that storage has a terminal reply, or its "
        "lease expired AND either the abort was sent or the peer was declared dead: no Decode "
        "read can start after Prefill reuses the buffer. A peer that cannot receive an abort "
        "(v1) holds the gate until it replies or is declared dead.",
    ),
    (
        "S2",
        "safety",
        "A Decode request is done only if every contributor of every Decode rank delivered "
        "its final layer after successful reads; a request is never both done and failed.",
    ),
    (
        "S3",
        "safety",
        "Decode destination blocks are released only when the request is quiescent: no read "
        "that may write them is in flight or can still start.",
    ),
    (
        "L1",
        "liveness",
        "Once the network drains, time passes every lease and the runtime declares silent "
        "peers dead, every gate is open and every request is terminal, on both sides.",
    ),
    (
        "B1",
        "bound",
        "After all requests end, no per-request state remains in any endpoint.",
    ),
)
