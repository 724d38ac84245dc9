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
component: requests in plan order, blocks in request order. Component-major keeps the
descriptors of one length and one memory region together (easy for an engine that splits
a batch by region or size) and makes the per-component counts plain slices for metrics.
Backends must not depend on any other property of the order.

How it stays fast (64 requests x 256 blocks is the design size): the ids of all requests
and both id groups (main, indexer) are packed once into one int64 buffer (numpy arrays
are concatenated, all ranges are written by one cumulative sum, other sequences are
packed by struct in C, each object once); run starts are found with one vector
comparison over everything (``src`` or ``dst`` not ``+1`` from the previous block, or a
request starts); the run-start ids are gathered once, and each group's components (K and
V; indexer and scale) get their addresses in one broadcast multiply-add. No Python work
happens per block; per request only the id sequences are collected. Every layer of an
engine step reads the same ids, so when they are immutable (tuples, ranges: what the
Decode endpoint hands out) the id-only part (runs, run-start ids) is kept per thread,
with the run ids and lengths already multiplied by each set of block sizes, and later
layers only add their bases (see :func:`build_descriptors`, :func:`_scaled`): 24 bytes
kept per descriptor and size set (1.2 MB for a 64 x 256 random message; a model's layers
usually share one size set). Work buffers
are per-thread and reused (see ``_Scratch``); the returned address arrays are always
fresh (the two are rows of one new block), and the lengths, the same for every layer
with those block sizes, are the kept read-only row itself, with their exact sum worked
out once (``Descriptors.total_bytes``): a 64 x 256 random layer then writes 0.8 MB, not
1.2 MB, and sums no lengths. A small message still pays a fixed cost of a few dozen
numpy calls (tens of microseconds).

The module is over 600 lines because planning is one pipeline (pack, find runs, scale,
add bases) whose steps share the per-thread scratch and the kept runs; split, each part
would need the others' private types.

Because every block of a component has the same length, "addresses contiguous" is exactly
"ids step by +1" (for ``block_bytes > 0`` and no wrap-around, both of which are checked),
so the run breaks are computed on the ids.
"""

from __future__ import annotations

import functools
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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
    # The exact sum of ``lengths``, once known (planning sets it from the kept lengths).
    _total: int | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def total_bytes(self) -> int:
        """Bytes the read moves (sum of the lengths), exact."""
        if self._total is None:
            object.__setattr__(self, "_total", _exact_sum(self.lengths))
        assert self._total is not None
        return self._total

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
    arrays can build this directly and skip :func:`gather_ids`; any 1-d integer arrays
    are taken (and stored as int64).
    """

    src: I64Array
    dst: I64Array
    counts: I64Array

    def __post_init__(self) -> None:
        src, dst = _array_ids(self.src), _array_ids(self.dst)
        counts = _array_ids(self.counts)
        n = src.shape[0]
        if dst.shape[0] != n:
            raise LocalProtocolError(
                f"block ids: src has {n} ids, dst has {dst.shape[0]}", ErrorCode.MALFORMED
            )
        total = int(counts.sum())
        if total != n or (counts.size and int(counts.min()) < 0):
            raise LocalProtocolError(
                f"block ids: per-request counts must be >= 0 and sum to {n}, found sum {total}",
                ErrorCode.MALFORMED,
            )
        if n and min(int(src.min()), int(dst.min())) < 0:
            raise LocalProtocolError("block ids must be >= 0", ErrorCode.OUT_OF_RANGE)
        object.__setattr__(self, "src", src)
        object.__setattr__(self, "dst", dst)
        object.__setattr__(self, "counts", counts)


def _exact_sum(lengths: U64Array) -> int:
    """The exact sum of uint64 ``lengths``."""
    n = lengths.shape[0]
    if not n:
        return 0
    # A uint64 sum cannot wrap when n times the largest length fits: two passes, the usual
    # case. Otherwise the 32-bit halves are summed apart, which cannot wrap (for fewer than
    # 2**32 descriptors).
    if int(lengths.max()) * n < _U64_LIMIT:
        return int(lengths.sum(dtype=np.uint64))
    lo = int((lengths & np.uint64(0xFFFFFFFF)).sum(dtype=np.uint64))
    hi = int((lengths >> np.uint64(32)).sum(dtype=np.uint64))
    return (hi << 32) + lo


class _Scratch(threading.local):
    """Per-thread work buffers reused from one plan to the next.

    Fresh numpy temporaries of this size cost page faults on every call, and on hosts
    where faults are slow (VMs) those faults, not the arithmetic, dominate planning. The
    buffers only ever hold intermediate values: nothing returned to a caller is a view of
    them. Per thread, so concurrent planners never share one.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, npt.NDArray[Any]] = {}
        # id key -> (the id sequences, their runs); see build_descriptors
        self.runs: OrderedDict[tuple[object, ...], tuple[list[Sequence[int]], _Runs, int]] = (
            OrderedDict()
        )

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


_SCRATCH_MAX_ITEMS = 1 << 21
# Id sets whose runs each thread keeps (several Prefill peers may interleave), and the
# bytes they may hold in all: their arrays, their scaled tables and the Prefill ids they
# keep alive (an int and its slot each, at most 40 B: see _kept_bytes). A plan at the
# wire's limit (MAX_BLOCK_IDS_PER_READINESS ids, 2^19 descriptors) keeps about 28 MB, so
# it is planned and not kept; a 64 x 256 message keeps about 1.4 MB.
_RUNS_KEPT = 8
_RUNS_KEPT_BYTES = 24 << 20
_scratch = _Scratch()


def _array_ids(arr: npt.NDArray[Any]) -> I64Array:
    """One numpy id array as int64, refusing non-integers and values past int64."""
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
        raise LocalProtocolError(
            f"block ids must be an integer array, found {getattr(arr, 'dtype', type(arr))}",
            ErrorCode.MALFORMED,
        )
    if arr.ndim != 1:
        raise LocalProtocolError(
            f"block ids must be 1-d, found shape {arr.shape}", ErrorCode.MALFORMED
        )
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _I64_MAX:
        raise LocalProtocolError("block id beyond int64", ErrorCode.OUT_OF_RANGE)
    return arr.astype(np.int64, copy=False)


def _pack(seqs: list[Sequence[int]], out: I64Array) -> None:
    """Write the id sequences one after another into ``out`` (exactly their total length).

    No Python work per id: numpy arrays are concatenated; ranges (contiguous destinations)
    are written all together by one cumulative sum, whatever their number; other sequences
    are packed by struct in C (about twice as fast as ``np.fromiter``; unboxing the Python
    ints is the floor either way), and a sequence met again in the same call (one object
    serving main and indexer) is copied from its first packing instead.
    """
    if not out.shape[0]:
        return
    # (mypy does not narrow Sequence[int] to ndarray inside the comprehension)
    arrays = [cast("npt.NDArray[Any]", s) for s in seqs if isinstance(s, np.ndarray)]
    if len(arrays) == len(seqs):
        try:
            # "safe" casting takes any narrower integer type and refuses floats and uint64
            # (which could wrap); those, and arrays that are not 1-d, go the checked way.
            np.concatenate(arrays, out=out, casting="safe")
            return
        except (TypeError, ValueError):
            np.concatenate([_array_ids(a) for a in arrays], out=out)
            return
    at = 0
    raw = out.data  # a writable memoryview for struct
    ranges: list[tuple[int, int, int, int]] = []  # (at, first id, step, count)
    packed: dict[int, int] = {}  # id(seq) -> where it was packed (seqs keeps it alive)
    try:
        for seq in seqs:
            m = len(seq)
            if not m:
                continue
            if isinstance(seq, range):
                ranges.append((at, seq[0], seq[-1], m))
            elif isinstance(seq, np.ndarray):
                out[at : at + m] = _array_ids(seq)
            else:
                first = packed.setdefault(id(seq), at)
                if first == at:
                    struct.pack_into(f"{m}q", raw, at * 8, *seq)
                else:
                    out[at : at + m] = out[first : first + m]
            at += m
        if ranges:
            _fill_ranges(ranges, out)
    except (struct.error, OverflowError) as exc:
        raise LocalProtocolError(
            f"block ids must be int64 integers: {exc}", ErrorCode.OUT_OF_RANGE
        ) from exc


def _fill_ranges(ranges: list[tuple[int, int, int, int]], out: I64Array) -> None:
    """Write ``(at, first id, last id, count)`` ranges into ``out``, a few numpy calls in all.

    Values and positions are both cumulative sums of deltas: the step inside a range, the
    jump to the next range's first value (position) at its start. Every value lies between
    a range's first and last id, which must fit int64 (else ``OverflowError``), so nothing
    wraps.
    """
    cols = np.array(ranges, dtype=np.int64).T
    ats, firsts, lasts, counts = cols[0], cols[1], cols[2], cols[3]
    total = int(counts.sum())
    heads = np.cumsum(counts) - counts  # where each range starts in the range-only order
    vals: I64Array = _scratch.get("range_vals", total, np.int64)
    if bool((lasts - firsts == counts - 1).all()):  # every step is +1 (contiguous ids)
        vals.fill(1)
    else:
        # the exact step of each range (a one-id range has none: any value will do)
        steps = (lasts - firsts) // np.maximum(counts - 1, 1)
        vals[:] = np.repeat(steps, counts)
    vals[heads[1:]] = firsts[1:] - lasts[:-1]
    vals[0] = firsts[0]
    if total == out.shape[0]:  # only ranges: they fill ``out`` in order
        np.cumsum(vals, out=out)
        return
    np.cumsum(vals, out=vals)
    pos: I64Array = _scratch.get("range_pos", total, np.int64)
    pos.fill(1)
    pos[heads[1:]] = ats[1:] - (ats[:-1] + counts[:-1] - 1)
    pos[0] = ats[0]
    np.cumsum(pos, out=pos)
    out[pos] = vals


def _lengths(group: str, srcs: list[Sequence[int]], dsts: list[Sequence[int]]) -> I64Array:
    """Per-request id counts of one group; src and dst must pair up."""
    src_counts = np.fromiter(map(len, srcs), dtype=np.int64, count=len(srcs))
    dst_counts = np.fromiter(map(len, dsts), dtype=np.int64, count=len(dsts))
    if not np.array_equal(src_counts, dst_counts):
        bad = int(np.flatnonzero(src_counts != dst_counts)[0])
        raise LocalProtocolError(
            f"request #{bad}: {group} src has {int(src_counts[bad])} ids, "
            f"dst has {int(dst_counts[bad])}",
            ErrorCode.MALFORMED,
        )
    return src_counts


def _group_seqs(
    requests: Iterable[RequestRead], group: str
) -> tuple[list[Sequence[int]], list[Sequence[int]]]:
    if group == "main":
        return [r.main_src for r in requests], [r.main_dst for r in requests]
    if group == "indexer":
        return [r.indexer_src for r in requests], [r.indexer_dst for r in requests]
    raise ValueError(f"id group must be 'main' or 'indexer', not {group!r}")


def gather_ids(requests: Sequence[RequestRead], group: str) -> BlockIds:
    """Concatenate the ``group`` ids (``"main"`` or ``"indexer"``) of all ``requests``."""
    srcs, dsts = _group_seqs(requests, group)
    counts = _lengths(group, srcs, dsts)
    n = int(counts.sum())
    src, dst = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    _pack(srcs, src)
    _pack(dsts, dst)
    return BlockIds(src, dst, counts)


def _runs(src: I64Array, dst: I64Array, counts: I64Array) -> tuple[I64Array, U64Array]:
    """Start index and length (in blocks) of every mergeable run (results in scratch)."""
    n = src.shape[0]
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
    # Every request (and so every group) starts a new run; empty requests put their
    # boundary on the same index as the next one (harmless) or at n (dropped).
    bounds = np.cumsum(counts[:-1])
    brk[bounds[bounds < n]] = True
    k = int(np.count_nonzero(brk))
    starts: I64Array = _scratch.get("starts", k, np.int64)
    np.compress(brk, _scratch.arange(n), out=starts)
    blocks: U64Array = _scratch.get("blocks", k, np.uint64)
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


@functools.lru_cache(maxsize=1024)
def _columns(comps: tuple[ComponentAddrs, ...]) -> tuple[U64Array, U64Array]:
    """The block sizes of ``comps`` as a uint64 column ``(components, 1)``, and their src
    and dst bases as a ``(2, components, 1)`` block (src first).

    Cached: a layer's components are the same values message after message, and building
    tiny arrays is a noticeable part of planning a small message.
    """
    sizes = np.array([c.block_bytes for c in comps], dtype=np.uint64).reshape(-1, 1)
    bases = np.array(
        [[c.src_base for c in comps], [c.dst_base for c in comps]], dtype=np.uint64
    ).reshape(2, -1, 1)
    sizes.flags.writeable = bases.flags.writeable = False
    return sizes, bases


@dataclass(frozen=True, slots=True, eq=False)
class _Runs:
    """Everything planning derives from the ids alone (no address): kept between reads of
    the same ids (see :func:`build_descriptors`), so arrays are fresh and read-only.

    ``tops`` holds each group's largest src and dst id (-1 without ids), ``cuts`` where
    each group's runs start and end in the run arrays, ``blocks`` each run's length in
    blocks and ``run_src``/``run_dst`` its first ids. ``scaled`` keeps, per set of block
    sizes, what the descriptors of every layer with those sizes share and the exact sum
    of their lengths (see :func:`_scaled`).
    """

    tops: tuple[tuple[int, int], ...]
    cuts: tuple[int, ...]
    blocks: U64Array
    run_src: U64Array
    run_dst: U64Array
    scaled: dict[tuple[tuple[int, ...], ...], tuple[U64Array, int]] = field(default_factory=dict)


def _id_runs(sizes: Sequence[int], ids: I64Array, counts: I64Array) -> _Runs:
    """The runs of ``sizes`` id groups (id count per group, in output order).

    ``ids`` holds every group's src ids one after another, then every group's dst ids in
    the same layout; ``counts`` the per-request counts of all groups, in the same order.
    One run search covers all groups at once (a group starts with a request, so it
    starts a run).
    """
    n = sum(sizes)
    src, dst = ids[:n], ids[n:]
    if n and int(ids.min()) < 0:
        raise LocalProtocolError("block ids must be >= 0", ErrorCode.OUT_OF_RANGE)
    offsets = [0]
    tops = []
    for n_g in sizes:
        off = offsets[-1]
        top_src = int(src[off : off + n_g].max()) if n_g else -1
        top_dst = int(dst[off : off + n_g].max()) if n_g else -1
        tops.append((top_src, top_dst))
        offsets.append(off + n_g)
    if n:
        starts, blocks = _runs(src, dst, counts)
        # Which runs belong to which group: runs are in id order and never straddle groups.
        cuts = tuple(np.searchsorted(starts, offsets).tolist())
        # Kept arrays, so not scratch: one allocation for the three (see _descriptors).
        run_src, run_dst, kept = np.empty((3, starts.shape[0]), dtype=np.uint64)
        np.take(src, starts, out=run_src.view(np.int64), mode="clip")  # starts are in range
        np.take(dst, starts, out=run_dst.view(np.int64), mode="clip")
        kept[:] = blocks
        blocks = kept
    else:
        cuts = (0,) * len(offsets)
        run_src = run_dst = blocks = np.zeros(0, dtype=np.uint64)
    for arr in (blocks, run_src, run_dst):
        arr.flags.writeable = False
    return _Runs(tuple(tops), cuts, blocks, run_src, run_dst)


# Block-size sets whose scaled runs one _Runs keeps (the layers of a model share a few).
_SCALED_KEPT = 4


def _scaled(comps_of: Sequence[Sequence[ComponentAddrs]], runs: _Runs) -> tuple[U64Array, int]:
    """The descriptors of ``runs`` without the bases: a read-only ``(3, total)`` block of
    run src ids, run dst ids and run lengths, each times its component's block size, in
    output order; and the exact sum of the lengths (the last row).

    Every layer with the same block sizes shares it (layers differ in bases only), so it
    is kept in ``runs``: a later layer adds its bases in one pass per address array
    instead of a uint64 multiply and an add. No wrap: the callers' ``_check_fits``
    bounded ``base + (top + 1) * block_bytes`` by 2**64 for the largest id.
    """
    key = tuple(tuple(c.block_bytes for c in comps) for comps in comps_of)
    kept = runs.scaled.get(key)
    if kept is not None:
        return kept
    cuts = runs.cuts
    total = sum(len(comps) * (cuts[g + 1] - cuts[g]) for g, comps in enumerate(comps_of))
    table = np.empty((3, total), dtype=np.uint64)
    at = 0
    for g, comps in enumerate(comps_of):
        lo, hi = cuts[g], cuts[g + 1]
        if hi == lo:
            continue
        # All components of the group in one broadcast: a (components, runs) view of the
        # table, rows = components.
        size = _columns(tuple(comps))[0]
        span = slice(at, at + len(comps) * (hi - lo))
        at = span.stop
        for row, per_run in enumerate((runs.run_src, runs.run_dst, runs.blocks)):
            np.multiply(per_run[lo:hi], size, out=table[row, span].reshape(len(comps), hi - lo))
    table.flags.writeable = False
    if len(runs.scaled) >= _SCALED_KEPT:
        runs.scaled.clear()
    kept = runs.scaled[key] = (table, _exact_sum(table[2]))
    return kept


def _descriptors(comps_of: Sequence[Sequence[ComponentAddrs]], runs: _Runs) -> Descriptors:
    """The descriptors of ``runs`` for each group's components (``comps_of``, in order)."""
    for comps, (top_src, top_dst) in zip(comps_of, runs.tops, strict=True):
        for comp in comps:
            _check_fits(comp, top_src, top_dst)
    table, total = _scaled(comps_of, runs)
    # One allocation for the two address arrays (rows of one block): each of this size
    # costs page faults on every read, as malloc hands such blocks back to the OS. The
    # lengths are the kept row itself (read-only, the same for every layer).
    out = np.empty((2, table.shape[1]), dtype=np.uint64)
    cuts = runs.cuts
    counts_out: list[tuple[str, int]] = []
    at = 0
    for g, comps in enumerate(comps_of):
        k_g = cuts[g + 1] - cuts[g]
        for comp in comps:
            counts_out.append((comp.name, k_g))
        if not k_g:
            continue
        bases = _columns(tuple(comps))[1]
        span = slice(at, at + len(comps) * k_g)
        at = span.stop
        # Both address rows at once: a (side, components, runs) view, bases broadcast.
        shape = (2, len(comps), k_g)
        np.add(table[:2, span].reshape(shape), bases, out=out[:, span].reshape(shape))
    # Read-only, the block and so its rows: backends get views of these, nobody should
    # patch a planned read.
    out.flags.writeable = False
    remote, local = out
    desc = Descriptors(remote, local, table[2], tuple(counts_out))
    object.__setattr__(desc, "_total", total)
    return desc


def descriptors_from_ids(
    main: Sequence[ComponentAddrs],
    main_ids: BlockIds,
    indexer: Sequence[ComponentAddrs],
    indexer_ids: BlockIds,
) -> Descriptors:
    """Descriptors for pre-concatenated ids; see the module docstring for the rule and order.

    ``main_ids`` serves every component of ``main`` (K, V), ``indexer_ids`` every component
    of ``indexer`` (indexer, then the optional scale); a group without components is not
    read. Raises :class:`~rd2h_protocol.errors.LocalProtocolError` when an address would
    not fit in 64 bits or a block length is not positive.
    """
    used = [(c, ids) for c, ids in ((main, main_ids), (indexer, indexer_ids)) if c]
    n = sum(ids.src.shape[0] for _, ids in used)
    buf: I64Array = _scratch.get("ids", 2 * n, np.int64)
    if used:
        np.concatenate([ids.src for _, ids in used] + [ids.dst for _, ids in used], out=buf)
        counts = np.concatenate([ids.counts for _, ids in used])
    else:
        counts = np.zeros(0, dtype=np.int64)
    runs = _id_runs([ids.src.shape[0] for _, ids in used], buf, counts)
    return _descriptors([c for c, _ in used], runs)


_KEYED_KINDS: frozenset[type] = frozenset((tuple, range))


def _ids_key(seqs: list[Sequence[int]]) -> tuple[object, ...] | None:
    """A key naming ``seqs`` by identity (tuples) or value (ranges), or None when one of
    them could change (a list, an array): only immutable ids may be planned from a cache.
    """
    kinds = set(map(type, seqs))  # one pass in C; the usual plan holds tuples only
    if not kinds <= _KEYED_KINDS:
        return None
    if range not in kinds:
        return tuple(map(id, seqs))
    return tuple(seq if type(seq) is range else id(seq) for seq in seqs)


def build_descriptors(plan: ReadPlan) -> Descriptors:
    """All descriptors of ``plan`` (every request, every component) for ONE batched read.

    Id sequences may be lists, tuples, ranges or numpy integer arrays; when every request
    of a group holds numpy arrays they are concatenated without touching single ids. A
    group without components (e.g. ``plan.main == ()``) is not read, nor are its ids.

    Every layer of an engine step reads the same ids (into other addresses). When all the
    plan's ids are tuples or ranges (immutable; what the Decode endpoint hands out), what
    depends on the ids alone -- the runs and their first ids -- is kept per thread for a
    few id sets (holding the tuples, so their identity cannot be reused), and a later
    plan over the same ids only computes addresses.
    """
    comps_of: list[Sequence[ComponentAddrs]] = []
    names: list[str] = []
    srcs: list[Sequence[int]] = []
    dsts: list[Sequence[int]] = []
    for comps, group in ((plan.main, "main"), (plan.indexer, "indexer")):
        if not comps:
            continue
        g_src, g_dst = _group_seqs(plan.requests, group)
        comps_of.append(comps)
        names.append(group)
        srcs += g_src
        dsts += g_dst
    seqs = srcs + dsts
    key = _ids_key(seqs)
    cache = _scratch.runs
    if key is not None:
        key = (len(names), *key)  # requests per group: len(plan.requests) for every group
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            desc = _descriptors(comps_of, hit[1])  # (it may keep another scaled table)
            _trim_kept(cache)
            return desc
    per_group = len(plan.requests)
    counts = [
        _lengths(
            group,
            srcs[g * per_group : (g + 1) * per_group],
            dsts[g * per_group : (g + 1) * per_group],
        )
        for g, group in enumerate(names)
    ]
    sizes = [int(c.sum()) for c in counts]
    n = sum(sizes)
    buf: I64Array = _scratch.get("ids", 2 * n, np.int64)
    _pack(srcs, buf[:n])
    _pack(dsts, buf[n:])
    all_counts = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    runs = _id_runs(sizes, buf, all_counts)
    desc = _descriptors(comps_of, runs)
    if key is not None:
        cache[key] = (seqs, runs, n)  # the tuples stay alive while kept
        _trim_kept(cache)
    return desc


def _kept_bytes(runs: _Runs, ids: int) -> int:
    """Bytes one kept id set holds: its run arrays, its scaled tables and ``ids`` Prefill
    ids kept alive (an int object of at most 32 B and an 8 B slot each: an upper bound)."""
    held = runs.blocks.nbytes + runs.run_src.nbytes + runs.run_dst.nbytes + 40 * ids
    return held + sum(table.nbytes for table, _ in runs.scaled.values())


def _trim_kept(
    cache: OrderedDict[tuple[object, ...], tuple[list[Sequence[int]], _Runs, int]],
) -> None:
    """Forget the least recently used id sets beyond ``_RUNS_KEPT`` of them or
    ``_RUNS_KEPT_BYTES`` in all (the newest too, when it alone is over)."""
    while len(cache) > _RUNS_KEPT:
        cache.popitem(last=False)
    held = sum(_kept_bytes(r, n) for _, r, n in cache.values())
    while cache and held > _RUNS_KEPT_BYTES:
        _, (_, runs, ids) = cache.popitem(last=False)
        held -= _kept_bytes(runs, ids)
