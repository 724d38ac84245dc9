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
layers only add their bases (see :func:`build_descriptors` and
:mod:`rd2h_runtime.planning_addresses`): 24 bytes kept per descriptor and size set (a
model's layers usually share one size set). Work buffers are per-thread and reused (see
``_Scratch``); the returned address arrays are always fresh (the two are rows of one new
block), and the lengths, the same for every layer with those block sizes, are the kept
read-only row itself, with their exact sum worked out once
(``Descriptors.total_bytes``), so a later layer writes two rows instead of three and sums
no lengths. A small message still pays a fixed cost of a few dozen numpy calls. See
benchmarks/bench_planning.py for the figures.

This module packs the ids and finds their runs (everything that touches ids or the
per-thread work buffers, and the per-thread cache of kept runs);
:mod:`rd2h_runtime.planning_addresses` turns runs into addresses.

Because every block of a component has the same length, "addresses contiguous" is exactly
"ids step by +1" (for ``block_bytes > 0`` and no wrap-around, both of which are checked),
so the run breaks are computed on the ids.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from rd2h_protocol.errors import ErrorCode, LocalProtocolError
from rd2h_protocol.plan import ComponentAddrs, ReadPlan, RequestRead
from rd2h_runtime.planning_addresses import (
    Descriptors,
    I64Array,
    Runs,
    U64Array,
    descriptors_of_runs,
)

__all__ = [
    "BlockIds",
    "Descriptors",
    "build_descriptors",
    "descriptors_from_ids",
    "gather_ids",
]

_I64_MAX = (1 << 63) - 1


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
        self.runs: OrderedDict[tuple[object, ...], tuple[list[Sequence[int]], Runs, int]] = (
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
# wire's limit (MAX_BLOCK_IDS_PER_READINESS ids, 2^19 descriptors) would hold more than
# the budget, so it is planned and not kept; a design-size message fits several times.
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
    are packed by struct in C (faster than ``np.fromiter``; unboxing the Python ints is
    the floor either way; see benchmarks/bench_planning.py), and a sequence met again in
    the same call (one object serving main and indexer) is copied from its first packing
    instead.
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


def _id_runs(sizes: Sequence[int], ids: I64Array, counts: I64Array) -> Runs:
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
        # Kept arrays, so not scratch: one allocation for the three (see descriptors_of_runs).
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
    return Runs(tuple(tops), cuts, blocks, run_src, run_dst)


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
    return descriptors_of_runs([c for c, _ in used], runs)


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
            desc = descriptors_of_runs(comps_of, hit[1])  # (it may keep another scaled table)
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
    desc = descriptors_of_runs(comps_of, runs)
    if key is not None:
        cache[key] = (seqs, runs, n)  # the tuples stay alive while kept
        _trim_kept(cache)
    return desc


def _kept_bytes(runs: Runs, ids: int) -> int:
    """Bytes one kept id set holds: its run arrays, its scaled tables and ``ids`` Prefill
    ids kept alive (an int object of at most 32 B and an 8 B slot each: an upper bound)."""
    held = runs.blocks.nbytes + runs.run_src.nbytes + runs.run_dst.nbytes + 40 * ids
    return held + sum(table.nbytes for table, _ in runs.scaled.values())


def _trim_kept(
    cache: OrderedDict[tuple[object, ...], tuple[list[Sequence[int]], Runs, int]],
) -> None:
    """Forget the least recently used id sets beyond ``_RUNS_KEPT`` of them or
    ``_RUNS_KEPT_BYTES`` in all (the newest too, when it alone is over)."""
    while len(cache) > _RUNS_KEPT:
        cache.popitem(last=False)
    held = sum(_kept_bytes(r, n) for _, r, n in cache.values())
    while cache and held > _RUNS_KEPT_BYTES:
        _, (_, runs, ids) = cache.popitem(last=False)
        held -= _kept_bytes(runs, ids)
