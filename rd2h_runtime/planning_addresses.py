"""Planning's second half: from the runs of a message's ids to descriptor addresses.

:mod:`rd2h_runtime.planning` packs the ids of a message and finds their runs
(:class:`Runs`: everything that depends on the ids alone); this module turns those runs
into :class:`Descriptors` for each layer's components: it checks that every address fits
in 64 bits, multiplies the runs by the block sizes once per set of sizes (kept in the
runs, as a model's layers share a few sets) and adds each layer's bases. It is apart
because it never touches ids or the per-thread work buffers: it works on the kept,
read-only run arrays only, which is what lets later layers reuse them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from rd2h_protocol.errors import ErrorCode, LocalProtocolError
from rd2h_protocol.plan import ComponentAddrs

__all__ = ["Descriptors", "I64Array", "Runs", "U64Array", "descriptors_of_runs"]

U64Array = npt.NDArray[np.uint64]
I64Array = npt.NDArray[np.int64]

_U64_LIMIT = 1 << 64


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
class Runs:
    """Everything planning derives from the ids alone (no address): kept between reads of
    the same ids (see :func:`rd2h_runtime.planning.build_descriptors`), so arrays are
    fresh and read-only.

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


# Block-size sets whose scaled runs one Runs keeps (the layers of a model share a few).
_SCALED_KEPT = 4


def _scaled(comps_of: Sequence[Sequence[ComponentAddrs]], runs: Runs) -> tuple[U64Array, int]:
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


def descriptors_of_runs(comps_of: Sequence[Sequence[ComponentAddrs]], runs: Runs) -> Descriptors:
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
