"""Which Prefill peers' input a Decode rank refused, as a rate-limited WARNING per peer.

The consumer endpoint counts refused or dropped input in its stats and takes no I/O;
:class:`~rd2h_runtime.decode.DecodeWorker` takes the counters before each frame and hands
them here after it, which logs what grew and whose input it was, at most once per peer per
:data:`REFUSAL_LOG_S`. Apart from the worker because it is bookkeeping of the log alone
(which peers were logged when), untouched by the worker's reads and lock discipline.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Final

from rd2h_protocol.consumer import ConsumerEndpoint

__all__ = ["REFUSALS", "REFUSAL_LOG_PEERS", "REFUSAL_LOG_S", "RefusalLog"]

# The Decode worker's logger: the warning is the worker's own.
log = logging.getLogger("rd2h_runtime.decode")

# ConsumerStats counters of peer input that was refused or dropped: logged per peer.
REFUSALS: Final = (
    "malformed_frames",
    "dropped",
    "unexpected_messages",
    "protocol_errors",
    "park_overflow",
    "park_budget_refusals",
    "sessions_forgotten",
    "refused_handshakes",
)
REFUSAL_LOG_S: Final = 10.0  # at most one such WARNING per peer this often
REFUSAL_LOG_PEERS: Final = 1024  # peers remembered for that


class RefusalLog:
    """The peers whose refused input was logged lately, and the refusals held back since."""

    def __init__(self) -> None:
        # peer -> (when its refused input was last logged, refusals held back since)
        self._logged: OrderedDict[bytes, tuple[float, int]] = OrderedDict()

    @staticmethod
    def counts(endpoint: ConsumerEndpoint) -> tuple[int, ...]:
        """The endpoint's :data:`REFUSALS` counters now."""
        stats = endpoint.stats
        return tuple(getattr(stats, name) for name in REFUSALS)

    def note(
        self, endpoint: ConsumerEndpoint, peer: bytes, before: tuple[int, ...], now: float
    ) -> None:
        """A rate-limited WARNING naming ``peer`` and what of its input was refused since
        ``before`` (at most one per peer per :data:`REFUSAL_LOG_S`; the ones held back are
        counted in it)."""
        after = self.counts(endpoint)
        if after == before:
            return
        what = [
            f"{name} +{a - b}" for name, a, b in zip(REFUSALS, after, before, strict=True) if a != b
        ]
        last, held_back = self._logged.get(peer, (-REFUSAL_LOG_S, 0))
        if now - last < REFUSAL_LOG_S:
            self._logged[peer] = (last, held_back + 1)
            return
        self._logged[peer] = (now, 0)
        self._logged.move_to_end(peer)
        while len(self._logged) > REFUSAL_LOG_PEERS:
            self._logged.popitem(last=False)
        log.warning(
            "refused input from Prefill peer %r (session %s): %s%s",
            peer,
            endpoint.session_of_peer(peer) or "none",
            ", ".join(what),
            f" ({held_back} more refused frames from it not logged)" if held_back else "",
        )
