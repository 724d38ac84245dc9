"""Read planning: turn one message's :class:`~rd2h_protocol.plan.ReadPlan` into descriptors.

A descriptor is one ``(remote address, local address, length)`` triple of a backend's
batched read. The rule (reference behaviour, section 2 "Descriptors"): block ``pid`` of a
component lies at ``src_base + pid * block_bytes`` on Prefill and block ``did`` goes to
``dst_base + did * block_bytes`` on Decode; within one component of one request,
consecutive blocks whose remote AND local addresses are both contiguous merge into one
descriptor. Runs never merge across requests or components. Every request of the message
goes into the same descriptor arrays, so the backend issues ONE batched read.

Order of the output (component-major): all K descriptors, then all V, then the indexer,
then the scale -- i.e. ``plan.main`` then ``plan.indexer`` in their tuple order. Inside a
component: requests in plan order, blocks in request order. Component-major keeps
descriptors of one length and one memory region together, which is what batched engines
handle best (and it makes the per-component counts plain slices for metrics). Backends
must not depend on any other property of the order.

How it stays fast (64 requests x 256 blocks is the design size): the ids of all requests
are concatenated once per id group (main, indexer); run starts are found with one vector
comparison (``src`` or ``dst`` not ``+1`` from the previous block, or a request starts);
K and V share the main group's runs and the indexer and scale share the indexer group's
runs, so each component costs only a gather, a multiply and an add over its runs. No
Python work happens per block; per request only the id sequences are collected.

Because every block of a component has the same length, "addresses contiguous" is exactly
"ids step by +1" (for ``block_bytes > 0`` and no wrap-around, both of which are checked),
so the run breaks are computed on the ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import numpy.typing as npt

from rd2h_protocol.errors import ErrorCode, LocalProtocolError
from rd2h_protocol.plan import ComponentAddrs, ReadPlan, RequestRead

__all__ = [
    "BlockIds",
    "Descriptors",
    "build_descriptors",
    "descriptors_from_ids",
    "gather_ids",
]

U64Array = npt.NDArray[np.uint64]
I64Array = npt.NDArray[np.int64]

_U64_LIMIT = 1 << 64
_I64_MAX = (1 << 63) - 1


@dataclass(frozen=True, slots=True, eq=False)
class Descriptors:
    """The descriptor arrays of one batched read (read-only ``uint64`` arrays, equal length).

    ``component_counts`` gives, in output order, each component's name and how many
    descriptors it contributed (zero included), so ``component_slice`` can cut the arrays
    per component for metrics.
    """

    remote_addrs: U64Array
    local_addrs: U64Array
    lengths: U64Array
    component_counts: tuple[tuple[str, int], ...]

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def total_bytes(self) -> int:
        """Bytes the read moves (sum of the lengths), exact."""
        # A plain uint64 sum could wrap; summing the 32-bit halves apart cannot (for fewer
        # than 2**32 descriptors).
        lo = int((self.lengths & np.uint64(0xFFFFFFFF)).sum(dtype=np.uint64))
        hi = int((self.lengths >> np.uint64(32)).sum(dtype=np.uint64))
        return (hi << 32) + lo

    def component_slice(self, name: str) -> slice:
        """The slice of the arrays holding component ``name``'s descriptors."""
        start = 0
        for comp, count in self.component_counts:
            if comp == name:
                return slice(start, start + count)
            start += count
        raise KeyError(name)


@dataclass(frozen=True, slots=True, eq=False)
class BlockIds:
    """One id group (main or indexer) of all requests of a message, concatenated.

    ``src[i]`` is read into ``dst[i]``; ``counts[r]`` is how many of the ids belong to
    request ``r`` (requests in plan order, zero allowed). Callers that already hold numpy
    arrays can build this directly and skip :func:`gather_ids`.
    """

    src: I64Array
    dst: I64Array
    counts: I64Array

    def __post_init__(self) -> None:
        n = self.src.shape[0]
        if self.src.ndim != 1 or self.dst.shape != (n,) or self.counts.ndim != 1:
            raise LocalProtocolError(
                f"block ids: expected 1-d src/dst of equal length, found shapes "
                f"{self.src.shape} and {self.dst.shape} (counts {self.counts.shape})",
                ErrorCode.MALFORMED,
            )
        total = int(self.counts.sum())
        if total != n or (self.counts.size and int(self.counts.min()) < 0):
            raise LocalProtocolError(
                f"block ids: per-request counts must be >= 0 and sum to {n}, found sum {total}",
                ErrorCode.MALFORMED,
            )
        if n and min(int(self.src.min()), int(self.dst.min())) < 0:
            raise LocalProtocolError("block ids must be >= 0", ErrorCode.OUT_OF_RANGE)


def _to_i64(seqs: list[Sequence[int]], total: int) -> I64Array:
    """Concatenate id sequences into one int64 array, with no Python work per id if possible."""
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    if all(isinstance(s, np.ndarray) for s in seqs):
        arrays = [s for s in seqs if isinstance(s, np.ndarray)]  # narrows the type for mypy
        cat = np.concatenate(arrays)
        if cat.dtype.kind not in "iu":
            raise LocalProtocolError(
                f"block ids must be integers, found dtype {cat.dtype}", ErrorCode.MALFORMED
            )
        if cat.dtype.kind == "u" and int(cat.max()) > _I64_MAX:
            raise LocalProtocolError("block id too large", ErrorCode.OUT_OF_RANGE)
        return cat.astype(np.int64, copy=False)
    try:
        # fromiter over one chain unboxes the ints in C; cheaper than one asarray per request.
        return np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=total)
    except (OverflowError, ValueError, TypeError) as exc:
        raise LocalProtocolError(
            f"block ids must be int64 integers: {exc}", ErrorCode.OUT_OF_RANGE
        ) from exc


def gather_ids(requests: Iterable[RequestRead], group: str) -> BlockIds:
    """Concatenate the ``group`` ids (``"main"`` or ``"indexer"``) of all ``requests``."""
    if group == "main":
        pairs = [(r.main_src, r.main_dst) for r in requests]
    elif group == "indexer":
        pairs = [(r.indexer_src, r.indexer_dst) for r in requests]
    else:
        raise ValueError(f"id group must be 'main' or 'indexer', not {group!r}")
    srcs = [p[0] for p in pairs]
    dsts = [p[1] for p in pairs]
    src_counts = np.fromiter(map(len, srcs), dtype=np.int64, count=len(srcs))
    dst_counts = np.fromiter(map(len, dsts), dtype=np.int64, count=len(dsts))
    if not np.array_equal(src_counts, dst_counts):
        bad = int(np.flatnonzero(src_counts != dst_counts)[0])
        raise LocalProtocolError(
            f"request #{bad}: {group} src has {int(src_counts[bad])} ids, "
            f"dst has {int(dst_counts[bad])}",
            ErrorCode.MALFORMED,
        )
    total = int(src_counts.sum())
    return BlockIds(_to_i64(srcs, total), _to_i64(dsts, total), src_counts)


def _runs(ids: BlockIds) -> tuple[I64Array, U64Array]:
    """Start index and length (in blocks) of every mergeable run of ``ids``."""
    src, dst = ids.src, ids.dst
    n = src.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64)
    brk = np.empty(n, dtype=np.bool_)
    brk[0] = True
    # A run continues only while BOTH sides step by exactly one block.
    np.not_equal(src[1:], src[:-1] + 1, out=brk[1:])
    brk[1:] |= dst[1:] != dst[:-1] + 1
    # Every request starts a new run; empty requests put their boundary on the same index
    # as the next one (harmless) or at n (dropped).
    bounds = np.cumsum(ids.counts[:-1])
    brk[bounds[bounds < n]] = True
    starts = np.flatnonzero(brk)
    blocks = np.diff(starts, append=n).astype(np.uint64)
    return starts.astype(np.int64, copy=False), blocks


def _check_fits(comp: ComponentAddrs, max_src: int, max_dst: int) -> None:
    """Refuse a component whose blocks have no length or whose addresses pass 2**64.

    ``max_src``/``max_dst`` are the group's largest ids (-1 when it has none).
    """
    if comp.block_bytes <= 0:
        raise LocalProtocolError(
            f"component {comp.name}: block_bytes must be > 0, found {comp.block_bytes}",
            ErrorCode.OUT_OF_RANGE,
        )
    for side, base, top in (("src", comp.src_base, max_src), ("dst", comp.dst_base, max_dst)):
        if base < 0 or base >= _U64_LIMIT:
            raise LocalProtocolError(
                f"component {comp.name}: {side}_base {base} is not a uint64",
                ErrorCode.OUT_OF_RANGE,
            )
        if base + (top + 1) * comp.block_bytes > _U64_LIMIT:
            raise LocalProtocolError(
                f"component {comp.name}: {side} block {top} of {comp.block_bytes} B "
                f"from base {base:#x} ends beyond the 64-bit address space",
                ErrorCode.OUT_OF_RANGE,
            )


def descriptors_from_ids(
    main: Sequence[ComponentAddrs],
    main_ids: BlockIds,
    indexer: Sequence[ComponentAddrs],
    indexer_ids: BlockIds,
) -> Descriptors:
    """Descriptors for pre-concatenated ids; see the module docstring for the rule and order.

    ``main_ids`` serves every component of ``main`` (K, V), ``indexer_ids`` every component
    of ``indexer`` (indexer, then the optional scale). Raises
    :class:`~rd2h_protocol.errors.LocalProtocolError` when an address would not fit in
    64 bits or a block length is not positive.
    """
    remote: list[U64Array] = []
    local: list[U64Array] = []
    lengths: list[U64Array] = []
    counts: list[tuple[str, int]] = []
    for comps, ids in ((main, main_ids), (indexer, indexer_ids)):
        if not comps:
            continue
        n = ids.src.shape[0]
        max_src = int(ids.src.max()) if n else -1
        max_dst = int(ids.dst.max()) if n else -1
        starts, blocks = _runs(ids)
        # Gather once per group; K/V (and indexer/scale) reuse these id arrays.
        src_u = ids.src[starts].astype(np.uint64)
        dst_u = ids.dst[starts].astype(np.uint64)
        for comp in comps:
            _check_fits(comp, max_src, max_dst)
            bb = np.uint64(comp.block_bytes)
            # No wrap possible: _check_fits bounded base + (max id + 1) * bb by 2**64.
            remote.append(src_u * bb + np.uint64(comp.src_base))
            local.append(dst_u * bb + np.uint64(comp.dst_base))
            lengths.append(blocks * bb)
            counts.append((comp.name, int(starts.shape[0])))
    out = [_concat(parts) for parts in (remote, local, lengths)]
    for arr in out:
        # Read-only: backends get views of these, nobody should patch a planned read.
        arr.flags.writeable = False
    return Descriptors(out[0], out[1], out[2], tuple(counts))


def _concat(parts: list[U64Array]) -> U64Array:
    if not parts:
        return np.zeros(0, dtype=np.uint64)
    return np.concatenate(parts)


def build_descriptors(plan: ReadPlan) -> Descriptors:
    """All descriptors of ``plan`` (every request, every component) for ONE batched read.

    Id sequences may be lists, tuples, ranges or numpy integer arrays; when every request
    of a group holds numpy arrays they are concatenated without touching single ids.
    """
    return descriptors_from_ids(
        plan.main,
        gather_ids(plan.requests, "main"),
        plan.indexer,
        gather_ids(plan.requests, "indexer"),
    )
