"""Read plans: what the Decode endpoint asks the runtime to read, in block terms.

The endpoint decides WHICH blocks move (the contributor split, the TP split, the
destination offsets); the runtime decides HOW (descriptors, coalescing, the backend). A
plan is plain data with no addresses computed per block, so the runtime can turn a whole
message's plan into descriptor arrays at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ComponentAddrs:
    """Where one tensor component of a layer lives on each side.

    ``block_bytes`` is the size of one vLLM block of this component; Prefill and Decode
    agree on it (layout validation refuses a plan otherwise).
    """

    name: str  # "k", "v", "indexer" or "scale"
    src_base: int  # Prefill base address of the component's cache
    dst_base: int  # Decode base address of the component's destination
    block_bytes: int


@dataclass(frozen=True, slots=True)
class RequestRead:
    """One request's blocks in one read: Prefill ids and the Decode ids they land in.

    ``main_*`` apply to every main component (K and V), ``indexer_*`` to the indexer and
    the LIC8 scale, which follows the indexer ids. Paired sequences have equal length.
    Any sequence of ints will do (lists, tuples, ranges, integer arrays); the Decode
    endpoint hands out its own tuples and ranges, shared with later plans (one object may
    serve main and indexer): read them, never change them.
    """

    ext_req_id: str
    main_src: Sequence[int]
    main_dst: Sequence[int]
    indexer_src: Sequence[int]
    indexer_dst: Sequence[int]


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """One batched read for one readiness message.

    The runtime executes it and hands the outcome back to the endpoint with ``read_id``.
    """

    read_id: int
    session: str  # the Prefill transfer session to read from
    layer_name: str  # Decode's (local) name of the layer being filled
    main: tuple[ComponentAddrs, ...]  # K, V
    indexer: tuple[ComponentAddrs, ...]  # indexer, then the optional scale
    requests: tuple[RequestRead, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes this plan moves."""
        main_block = sum(c.block_bytes for c in self.main)
        idx_block = sum(c.block_bytes for c in self.indexer)
        return sum(
            len(r.main_src) * main_block + len(r.indexer_src) * idx_block for r in self.requests
        )
