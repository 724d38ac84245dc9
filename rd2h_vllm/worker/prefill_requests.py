"""What Prefill's worker half keeps per request, and which blocks of a request go out.

:class:`~rd2h_vllm.worker.prefill.PrefillSide` keeps Prefill-first requests for their
Decode's claim (:class:`KeptRequest`) and prompt-list children waiting to be aborted
toward their Decode (:class:`PendingAbort`), and sends, at each step or at a claim, the
blocks :func:`request_chunk` picks. These are plain data and pure functions of the step's
metadata and the KV-cache groups; they are apart from :mod:`rd2h_vllm.worker.prefill`
because they need none of its threads, its worker or its request machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from rd2h_protocol.events import Chunk
from rd2h_protocol.producer import DecodeTarget
from rd2h_protocol.topology import chunk_block_range
from rd2h_vllm.metadata import CacheGroups, SendAbort
from rd2h_vllm.metadata import DecodeTarget as DecodeEngine

__all__ = ["KeptRequest", "PendingAbort", "endpoint_target", "request_chunk"]


def endpoint_target(engine: DecodeEngine) -> DecodeTarget:
    """The producer endpoint's view of a Decode engine (host, base port, TP size)."""
    return DecodeTarget(engine.host, engine.base_port, engine.tp_size)


@dataclass(frozen=True, slots=True)
class PendingAbort:
    """A prompt-list child to abort toward its Decode once a publication reached it."""

    child: SendAbort
    target: DecodeTarget
    give_up_at: float  # Decode's load timeout has failed the child by then


@dataclass(slots=True)
class KeptRequest:
    """A Prefill-first request: its final step's blocks, kept for the Decode that claims
    them (see :meth:`~rd2h_vllm.worker.prefill.PrefillSide.end_step`)."""

    req_id: str
    ext_id: str
    main_block_ids: list[int]
    indexer_block_ids: list[int] | None
    num_tokens: int
    kept: bool = False  # the endpoint keeps it
    refusal: str = ""  # why the endpoint would not keep it
    ended: bool = False  # the endpoint finished it (read, unclaimed) or never kept it
    vllm_finished: bool = False  # vLLM listed it finished: its blocks wait for us


def request_chunk(
    groups: CacheGroups,
    ext_id: str,
    main_ids: list[int],
    indexer_ids: list[int] | None,
    *,
    cached_tokens: int,
    transferred_tokens: int,
    computed_tokens: int,
    final: bool,
) -> Chunk:
    """The blocks of a request that go out now: past what Decode holds (its prefix
    hit) and what earlier steps sent, up to what is computed, per KV-cache group
    (``groups``; one group holding main and indexer: the same ids, the same range)."""

    def blocks(group: int, allocated: int) -> tuple[int, int]:
        return chunk_block_range(
            remote_cached_tokens=cached_tokens,
            transferred_tokens=transferred_tokens,
            computed_tokens=computed_tokens,
            block_size=groups.block_sizes[group],
            allocated_blocks=allocated,
            final=final,
        )

    ms, me = blocks(groups.main, len(main_ids))
    indexer: list[int] = []
    i_start = 0
    if indexer_ids is not None and groups.indexer is not None:
        i_start, i_end = blocks(groups.indexer, len(indexer_ids))
        indexer = indexer_ids[i_start:i_end]
    elif indexer_ids is not None:
        indexer, i_start = indexer_ids[ms:me], ms
    return Chunk(
        ext_req_id=ext_id,
        main_block_ids=main_ids[ms:me],
        indexer_block_ids=indexer,
        main_start=ms,
        indexer_start=i_start,
        final=final,
    )
