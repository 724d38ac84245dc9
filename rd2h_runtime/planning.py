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

import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

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


class _Scratch(threading.local):
    """Per-thread work buffers reused from one plan to the next.

    Fresh numpy temporaries of this size cost page faults on every call, and on hosts
    where faults are slow (VMs) those faults, not the arithmetic, dominate planning. The
    buffers only ever hold intermediate values: nothing returned to a caller is a view of
    them. Per thread, so concurrent planners never share one.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, npt.NDArray[Any]] = {}

    def get(self, name: str, n: int, dtype: type[np.generic]) -> npt.NDArray[Any]:
        """An uninitialised array of ``n`` items, reused while it fits."""
        if n > _SCRATCH_MAX_ITEMS:  # unusually big plans do not pin memory
            return np.empty(n, dtype=dtype)
        buf = self.buffers.get(name)
        if buf is None or buf.shape[0] < n:
            buf = np.empty(max(1024, 1 << (n - 1).bit_length()), dtype=dtype)
            self.buffers[name] = buf
        return buf[:n]

    def arange(self, n: int) -> I64Array:
        """``0 .. n-1`` (int64), kept between calls."""
        buf = self.buffers.get("arange")
        if buf is None or buf.shape[0] < n:
            buf = np.arange(max(1024, 1 << (n - 1).bit_length()), dtype=np.int64)
            if n <= _SCRATCH_MAX_ITEMS:
                self.buffers["arange"] = buf
        return buf[:n]


_SCRATCH_MAX_ITEMS = 1 << 20
_scratch = _Scratch()


def _array_ids(arr: npt.NDArray[Any]) -> I64Array:
    """One numpy id array as int64, refusing non-integers and values past int64."""
    if arr.dtype.kind not in "iu":
        raise LocalProtocolError(
            f"block ids must be integers, found dtype {arr.dtype}", ErrorCode.MALFORMED
        )
    if arr.ndim != 1:
        raise LocalProtocolError(
            f"block ids must be 1-d, found shape {arr.shape}", ErrorCode.MALFORMED
        )
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _I64_MAX:
        raise LocalProtocolError("block id beyond int64", ErrorCode.OUT_OF_RANGE)
    return arr.astype(np.int64, copy=False)


def _to_i64(seqs: list[Sequence[int]], total: int, scratch: str | None) -> I64Array:
    """Concatenate id sequences into one int64 array with no Python work per id.

    With ``scratch`` the result may live in that per-thread buffer (internal use only).
    """
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out = _scratch.get(scratch, total, np.int64) if scratch else np.empty(total, np.int64)
    # (mypy does not narrow Sequence[int] to ndarray inside the comprehension)
    arrays = [cast("npt.NDArray[Any]", s) for s in seqs if isinstance(s, np.ndarray)]
    if len(arrays) == len(seqs):
        try:
            # "safe" casting takes any narrower integer type and refuses floats and uint64
            # (which could wrap); those, and arrays that are not 1-d, go the checked way.
            return np.concatenate(arrays, out=out, casting="safe")
        except (TypeError, ValueError):
            return np.concatenate([_array_ids(a) for a in arrays])
    # Python sequences: struct packs a whole request's ints in C, about twice as fast as
    # np.fromiter over the same ints (the unboxing dominates either way).
    at = 0
    raw = out.data  # a writable memoryview for struct
    try:
        for seq in seqs:
            m = len(seq)
            if isinstance(seq, np.ndarray):
                out[at : at + m] = _array_ids(seq)
            elif isinstance(seq, range):  # a contiguous destination: no ints to unbox
                out[at : at + m] = np.arange(seq.start, seq.stop, seq.step, dtype=np.int64)
            elif m:
                struct.pack_into(f"{m}q", raw, at * 8, *seq)
            at += m
    except (struct.error, OverflowError) as exc:
        raise LocalProtocolError(
            f"block ids must be int64 integers: {exc}", ErrorCode.OUT_OF_RANGE
        ) from exc
    return out


def _gather(requests: Iterable[RequestRead], group: str, *, scratch: bool) -> BlockIds:
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
    return BlockIds(
        _to_i64(srcs, total, f"{group}_src" if scratch else None),
        _to_i64(dsts, total, f"{group}_dst" if scratch else None),
        src_counts,
    )


def gather_ids(requests: Iterable[RequestRead], group: str) -> BlockIds:
    """Concatenate the ``group`` ids (``"main"`` or ``"indexer"``) of all ``requests``."""
    return _gather(requests, group, scratch=False)


def _runs(ids: BlockIds, tag: str) -> tuple[I64Array, U64Array]:
    """Start index and length (in blocks) of every mergeable run of ``ids``.

    The results live in per-thread scratch named after ``tag``: use them before the next
    call with the same tag.
    """
    src, dst = ids.src, ids.dst
    n = src.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64)
    brk = _scratch.get("brk", n, np.bool_)
    step = _scratch.get("step", n - 1, np.int64)  # ids are >= 0: differences cannot wrap
    dst_brk = _scratch.get("dst_brk", n - 1, np.bool_)
    brk[0] = True
    # A run continues only while BOTH sides step by exactly one block.
    np.subtract(src[1:], src[:-1], out=step)
    np.not_equal(step, 1, out=brk[1:])
    np.subtract(dst[1:], dst[:-1], out=step)
    np.not_equal(step, 1, out=dst_brk)
    np.logical_or(brk[1:], dst_brk, out=brk[1:])
    # Every request starts a new run; empty requests put their boundary on the same index
    # as the next one (harmless) or at n (dropped).
    bounds = np.cumsum(ids.counts[:-1])
    brk[bounds[bounds < n]] = True
    k = int(np.count_nonzero(brk))
    starts: I64Array = _scratch.get(f"{tag}_starts", k, np.int64)
    np.compress(brk, _scratch.arange(n), out=starts)
    blocks: U64Array = _scratch.get(f"{tag}_blocks", k, np.uint64)
    np.subtract(starts[1:], starts[:-1], out=blocks[:-1], casting="unsafe")
    blocks[-1] = n - int(starts[-1])
    return starts, blocks


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
    groups: list[tuple[Sequence[ComponentAddrs], BlockIds, I64Array, U64Array]] = []
    for comps, ids in ((main, main_ids), (indexer, indexer_ids)):
        if not comps:
            continue
        n = ids.src.shape[0]
        max_src = int(ids.src.max()) if n else -1
        max_dst = int(ids.dst.max()) if n else -1
        for comp in comps:
            _check_fits(comp, max_src, max_dst)
        groups.append((comps, ids, *_runs(ids, f"g{len(groups)}")))

    total = sum(len(comps) * starts.shape[0] for comps, _, starts, _ in groups)
    remote = np.empty(total, dtype=np.uint64)
    local = np.empty(total, dtype=np.uint64)
    lengths = np.empty(total, dtype=np.uint64)
    counts: list[tuple[str, int]] = []
    at = 0
    for comps, ids, starts, blocks in groups:
        k = starts.shape[0]
        spans = [slice(at + j * k, at + (j + 1) * k) for j in range(len(comps))]
        at += len(comps) * k
        for side, out, base_of in (
            (ids.src, remote, _src_base),
            (ids.dst, local, _dst_base),
        ):
            # Gather the run-start ids once per group into the LAST component's span, derive
            # the other components' addresses from it, then scale that span in place: no
            # temporaries. No wrap: _check_fits bounded base + (max id + 1) * bb by 2**64.
            raw = out[spans[-1]]
            np.take(side, starts, out=raw.view(np.int64), mode="clip")  # starts are in range
            for comp, span in zip(comps, spans, strict=True):
                np.multiply(raw, np.uint64(comp.block_bytes), out=out[span])
                np.add(out[span], np.uint64(base_of(comp)), out=out[span])
        for comp, span in zip(comps, spans, strict=True):
            np.multiply(blocks, np.uint64(comp.block_bytes), out=lengths[span])
            counts.append((comp.name, k))
    for arr in (remote, local, lengths):
        # Read-only: backends get views of these, nobody should patch a planned read.
        arr.flags.writeable = False
    return Descriptors(remote, local, lengths, tuple(counts))


def _src_base(comp: ComponentAddrs) -> int:
    return comp.src_base


def _dst_base(comp: ComponentAddrs) -> int:
    return comp.dst_base


def build_descriptors(plan: ReadPlan) -> Descriptors:
    """All descriptors of ``plan`` (every request, every component) for ONE batched read.

    Id sequences may be lists, tuples, ranges or numpy integer arrays; when every request
    of a group holds numpy arrays they are concatenated without touching single ids.
    """
    return descriptors_from_ids(
        plan.main,
        _gather(plan.requests, "main", scratch=True),
        plan.indexer,
        _gather(plan.requests, "indexer", scratch=True),
    )
