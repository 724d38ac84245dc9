"""Least-loaded choice among the nodes of one role, by in-flight count.

The load of a node is the number of requests the proxy has in flight on it (client
exchanges for Decode, dispatches for Prefill). Ties rotate, so equally loaded nodes take
turns instead of the first one taking everything. Everything runs on the event loop's
thread, so no lock is needed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from rd2h_proxy.config import Backend


@dataclass(eq=False, slots=True)
class Node:
    """One backend and its counters."""

    role: str
    index: int
    backend: Backend
    in_flight: int = 0
    total: int = 0
    failures: int = 0

    @property
    def url(self) -> str:
        """Root URL of the node."""
        return self.backend.base_url

    def as_dict(self) -> dict[str, object]:
        """Counters as JSON-ready values (for /stats)."""
        return {
            "role": self.role,
            "url": self.url,
            "in_flight": self.in_flight,
            "total": self.total,
            "failures": self.failures,
        }


class LeastLoaded:
    """Picks the node with the fewest requests in flight; ties go round-robin."""

    def __init__(self, role: str, backends: Sequence[Backend]) -> None:
        self.nodes: tuple[Node, ...] = tuple(
            Node(role=role, index=i, backend=b) for i, b in enumerate(backends)
        )
        self._cursor = 0

    def acquire(self, exclude: Collection[int] = ()) -> Node | None:
        """Take the least-loaded node not in ``exclude`` (indexes); ``None`` if none is left.

        The caller must :meth:`release` the node when its request is over.
        """
        n = len(self.nodes)
        best: Node | None = None
        for step in range(n):
            node = self.nodes[(self._cursor + step) % n]
            if node.index in exclude:
                continue
            if best is None or node.in_flight < best.in_flight:
                best = node
        if best is None:
            return None
        self._cursor = (best.index + 1) % n
        best.in_flight += 1
        best.total += 1
        return best

    def release(self, node: Node) -> None:
        """The request on ``node`` is over."""
        node.in_flight -= 1

    @property
    def in_flight(self) -> int:
        """Requests in flight over all nodes."""
        return sum(node.in_flight for node in self.nodes)
