"""Parallel topology rules: request ids, TP maps, ports, chunk ranges and the split.

Theory of operation
-------------------
Prefill runs ``p_tp`` tensor-parallel ranks, Decode ``d_tp``; ``p_tp`` is a multiple of
``d_tp`` and the ``ratio = p_tp // d_tp`` Prefill ranks ``d_rank*ratio ..
d_rank*ratio + ratio - 1`` form the contributor group of Decode rank ``d_rank``: each of
them connects to that one Decode rank (:func:`map_prefill_rank`,
:func:`prefill_target_port`). Every Prefill rank holds the whole main KV of the layer,
so only member 0 of a group sends main KV; the Decode TP ranks split the main blocks of
every message among themselves with :func:`split_range` (rotated by the chunk's start
block so that small chunks spread over ranks), because they write one TP-shared pool.
Every Decode rank needs the WHOLE indexer in its own device memory, so the indexer is
not split across Decode ranks; instead the ``ratio`` members of the group each send a
disjoint share (:func:`indexer_share`) whose union is the full range.

A chunked prefill sends each block once: :func:`chunk_block_range` gives the blocks of a
KV-cache group that became complete (or, on the final chunk, exist at all) since the
tokens already transferred or already cached on Decode.

Everything here is a pure function of its arguments; violations raise
:class:`~rd2h_protocol.errors.TopologyError` naming the rule and the values.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from rd2h_protocol.errors import ConfigError, TopologyError

_LAYER_RE: Final = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_number(name: str) -> int | None:
    """The ``N`` of ``...layers.N...`` in a layer name, or None."""
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def wire_layer_index(name: str, position: int) -> int:
    """The ``layer_idx`` a readiness for layer ``name`` carries (reference §5).

    The existing implementation sends the number parsed from the layer's name
    (``layers.N``) and identifies the layer by NAME; cache-bearing layers need not be
    numbered 0..N-1 without gaps. A name without ``layers.N`` falls back to its position
    in the ordered cache-bearing layers.
    """
    number = layer_number(name)
    return position if number is None else number


def wire_layer_indices(names: Sequence[str]) -> list[int]:
    """:func:`wire_layer_index` of every layer of an ordered list; they must be unique."""
    indices = [wire_layer_index(name, i) for i, name in enumerate(names)]
    if len(set(indices)) != len(indices):
        seen: dict[int, str] = {}
        for name, index in zip(names, indices, strict=True):
            if index in seen:
                raise ConfigError(
                    f"layers {seen[index]!r} and {name!r} would both be layer {index} on the wire"
                )
            seen[index] = name
    return indices


#: Length of vLLM's internal request-id suffix (``-`` plus 8 hex digits).
REQUEST_ID_SUFFIX_LEN: Final = 9
MIN_PORT: Final = 1
MAX_PORT: Final = 65535


def external_request_id(req_id: str) -> str:
    """The id both sides use on the wire: ``req_id`` without vLLM's 9-character suffix.

    Ids of 9 characters or fewer carry no suffix and are kept unchanged.
    """
    return req_id[:-REQUEST_ID_SUFFIX_LEN] if len(req_id) > REQUEST_ID_SUFFIX_LEN else req_id


@dataclass(frozen=True, slots=True)
class Contributor:
    """Where a Prefill rank sends its readiness, and who it is to that Decode rank.

    ``d_rank`` is the Decode TP rank it talks to, ``group_member_idx`` its position among
    the ``tp_ratio`` Prefill ranks that feed that Decode rank.
    """

    d_rank: int
    group_member_idx: int
    tp_ratio: int


def map_prefill_rank(p_rank: int, p_tp: int, d_tp: int) -> Contributor:
    """Map Prefill TP rank ``p_rank`` onto a Decode endpoint with ``d_tp`` TP ranks.

    Requires ``p_tp >= 1``, ``d_tp >= 1``, ``p_tp >= d_tp``, ``p_tp % d_tp == 0`` and
    ``0 <= p_rank < p_tp``. Compute it per Decode endpoint from that endpoint's own
    ``d_tp`` (endpoints of one batch may differ).
    """
    if p_tp < 1:
        raise TopologyError(f"Prefill TP size must be >= 1, got p_tp={p_tp}")
    if d_tp < 1:
        raise TopologyError(f"Decode TP size must be >= 1, got d_tp={d_tp}")
    if p_tp < d_tp:
        raise TopologyError(
            f"Prefill TP size must be >= Decode TP size, got p_tp={p_tp} < d_tp={d_tp}"
        )
    if p_tp % d_tp:
        raise TopologyError(
            f"Prefill TP size must be a multiple of Decode TP size, got p_tp={p_tp}, d_tp={d_tp}"
        )
    if not 0 <= p_rank < p_tp:
        raise TopologyError(f"Prefill rank must lie in [0, {p_tp}), got p_rank={p_rank}")
    ratio = p_tp // d_tp
    return Contributor(d_rank=p_rank // ratio, group_member_idx=p_rank % ratio, tp_ratio=ratio)


def group_members(d_rank: int, p_tp: int, d_tp: int) -> range:
    """The Prefill ranks that contribute to Decode rank ``d_rank`` (member order)."""
    ratio = map_prefill_rank(0, p_tp, d_tp).tp_ratio
    if not 0 <= d_rank < d_tp:
        raise TopologyError(f"Decode rank must lie in [0, {d_tp}), got d_rank={d_rank}")
    return range(d_rank * ratio, (d_rank + 1) * ratio)


def _check_port(what: str, port: int) -> None:
    if not MIN_PORT <= port <= MAX_PORT:
        raise TopologyError(f"{what} must lie in [{MIN_PORT}, {MAX_PORT}], got {port}")


def decode_base_port(kv_port: int, global_dp_rank: int, d_tp: int) -> int:
    """Base port of the Decode DP rank ``global_dp_rank``: ``kv_port + global_dp_rank * d_tp``.

    Its TP rank ``r`` binds ``base + r``; the highest of them, ``base + d_tp - 1``, must
    be a valid port (<= 65535), and so must ``kv_port``.
    """
    _check_port("kv_port", kv_port)
    if global_dp_rank < 0:
        raise TopologyError(f"global DP rank must be >= 0, got global_dp_rank={global_dp_rank}")
    if d_tp < 1:
        raise TopologyError(f"Decode TP size must be >= 1, got d_tp={d_tp}")
    base = kv_port + global_dp_rank * d_tp
    highest = base + d_tp - 1
    if highest > MAX_PORT:
        raise TopologyError(
            f"the highest Decode port kv_port + global_dp_rank * d_tp + d_tp - 1 = "
            f"{kv_port} + {global_dp_rank} * {d_tp} + {d_tp - 1} = {highest} exceeds {MAX_PORT}"
        )
    return base


def decode_rank_port(base_port: int, d_rank: int, d_tp: int) -> int:
    """Port of Decode TP rank ``d_rank``: ``base_port + d_rank``, validated."""
    if d_tp < 1:
        raise TopologyError(f"Decode TP size must be >= 1, got d_tp={d_tp}")
    if not 0 <= d_rank < d_tp:
        raise TopologyError(f"Decode rank must lie in [0, {d_tp}), got d_rank={d_rank}")
    _check_port("Decode base port", base_port)
    port = base_port + d_rank
    _check_port(f"Decode port base_port + d_rank = {base_port} + {d_rank}", port)
    return port


def prefill_target_port(base_port: int, p_rank: int, p_tp: int, d_tp: int) -> int:
    """The Decode port Prefill rank ``p_rank`` connects to on an endpoint with ``d_tp`` ranks.

    ``base_port`` is the endpoint's base port (the rendezvous ``remote_port``).
    """
    contributor = map_prefill_rank(p_rank, p_tp, d_tp)
    return decode_rank_port(base_port, contributor.d_rank, d_tp)


def chunk_block_range(
    *,
    remote_cached_tokens: int,
    transferred_tokens: int,
    computed_tokens: int,
    block_size: int,
    allocated_blocks: int,
    final: bool,
) -> tuple[int, int]:
    """Blocks ``[start, end)`` of one KV-cache group that this Prefill step sends.

    ``start`` skips the blocks already on Decode (its prefix cache) or already sent
    (``transferred_tokens``, see :func:`transferred_tokens_before`). A non-final chunk
    sends only full blocks; the final one also sends the partial last block. ``end`` past
    ``allocated_blocks`` is an error; ``end`` never falls below ``start`` (an empty range).
    """
    if block_size < 1:
        raise TopologyError(f"block size must be >= 1, got block_size={block_size}")
    if computed_tokens < 0:
        raise TopologyError(f"computed tokens must be >= 0, got {computed_tokens}")
    if allocated_blocks < 0:
        raise TopologyError(f"allocated blocks must be >= 0, got {allocated_blocks}")
    start = max(remote_cached_tokens, transferred_tokens, 0) // block_size
    end = -(-computed_tokens // block_size) if final else computed_tokens // block_size
    if end > allocated_blocks:
        raise TopologyError(
            f"chunk ends at block {end} ({computed_tokens} computed tokens, block size "
            f"{block_size}, final={final}) but only {allocated_blocks} blocks are allocated"
        )
    return start, max(end, start)


def transferred_tokens_before(computed_before: int, block_sizes: Iterable[int]) -> int:
    """Tokens already sent before this step: ``computed_before`` rounded down to the
    smallest block size of the KV-cache groups (only full blocks of earlier chunks left).
    """
    smallest = min(block_sizes, default=0)
    if smallest < 1:
        raise TopologyError("block sizes must be a non-empty list of sizes >= 1")
    if computed_before < 0:
        raise TopologyError(f"computed tokens must be >= 0, got {computed_before}")
    return computed_before // smallest * smallest


def split_range(n: int, rank: int, size: int, start_block: int) -> tuple[int, int]:
    """Rank ``rank``'s share ``[start, end)`` of ``n`` items split over ``size`` ranks.

    The ranks are rotated by ``start_block`` so that the rank holding logical position 0
    is ``start_block % size``: chunks that start at different blocks give their (larger)
    first share to different ranks. The shares of ranks ``0..size-1`` are disjoint, their
    lengths differ by at most one, and their union is ``[0, n)``.
    """
    if n < 0:
        raise TopologyError(f"split length must be >= 0, got n={n}")
    if size < 1:
        raise TopologyError(f"split size must be >= 1, got size={size}")
    if not 0 <= rank < size:
        raise TopologyError(f"split rank must lie in [0, {size}), got rank={rank}")
    if start_block < 0:
        raise TopologyError(f"split start block must be >= 0, got start_block={start_block}")
    logical = (rank - start_block % size) % size
    q, r = divmod(n, size)
    start = logical * q + min(logical, r)
    return start, start + q + (logical < r)


def main_share(n: int, d_rank: int, d_tp: int, main_start: int, member: int) -> tuple[int, int]:
    """The main blocks ``[start, end)`` Decode rank ``d_rank`` reads from one readiness entry.

    Only contributor member 0 sends main KV (every Prefill rank holds all of it); the
    Decode ranks split its ``n`` blocks with :func:`split_range` rotated by the entry's
    ``main_start``. Any other member yields the empty range.
    """
    if member < 0:
        raise TopologyError(f"group member index must be >= 0, got {member}")
    if member:
        return 0, 0
    return split_range(n, d_rank, d_tp, main_start)


def indexer_share(n: int, member: int, ratio: int, indexer_start: int) -> tuple[int, int]:
    """Contributor ``member``'s share of ``n`` indexer blocks among ``ratio`` members.

    The scale follows the same ids. With ``ratio`` 1 it is the whole range.
    """
    return split_range(n, member, ratio, indexer_start)
