"""Data-path benchmark: a backend's batched read of one KV "layer" against memcpy, in pairs.

Run ``python benchmarks/bench_datapath.py`` (``--help`` for sizes, backends, threads,
repeats). For each layer size (default 20 MiB and 256 MiB, the two ends of per-layer KV
volume) and each backend it times, sample by sample:

* ``memcpy``: libc ``memcpy`` (``ctypes.memmove``, which releases the GIL) of the layer
  between two buffers of this process. With ``--threads N`` the layer is cut into N equal
  parts copied at once by N threads, so a read split over N threads is set beside a memcpy
  split over N threads (the ``threads`` column is N for both), never a single-thread one;
* the backend's ``read()`` of the whole layer from a Prefill source in ANOTHER process
  (``rd2h_runtime.testing.check_read.prefill_source``; ``loopback`` reads in-process), as one
  batched read of ``--chunk``-byte descriptors, exactly as Decode issues it. The cma
  backend runs with ``threads=N``; the other backends have no such setting and run once,
  beside a one-thread memcpy.

Cache conditions, the same for both (``--cache``): ``cold`` (default) writes a buffer of
twice the last-level cache before EVERY timed sample, memcpy's and the backend's alike, so
both copy from DRAM into DRAM. Cold is the default because a 20 MiB layer fits this
machine's 32 MiB L3: a warm memcpy then copies partly cache to cache (it swung from 12.7
to 26.4 GB/s in three runs), while a backend's source, written by another process, was
cached or not by chance; and a Prefill's layer is in practice written well before Decode
reads it. ``warm`` skips the eviction for both (after a first untimed pair).

Pairing: each memcpy sample is taken back to back with a backend sample, the order
alternating pair by pair, so a noisy neighbour on a shared machine slows both alike. The
ratio column is the median over pairs of (memcpy time / backend time), i.e. backend speed
as a fraction of memcpy's; its interquartile range shows how steady it was. The two GB/s
columns are each side's own median (GB/s = 1e9 B/s). On a loaded machine a 2 ms sample
often waits for a CPU: the ``cpu ratio`` column takes the same ratio from the calling
thread's CPU time (``time.thread_time``; a kernel copy counts as system time), which
leaves that wait out. It is shown only where the calling thread does the whole copy
(loopback, and cma with one thread): an engine's own threads, or a pool's, are not it.
The bytes of the last read are checked against the source's pattern, so a fast wrong read
cannot pass.

:func:`measure_pairs` takes any two zero-argument callables that each move one layer, so
the same figures can be produced "through our runtime" (Decode's read worker, planning
included) against memcpy.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rd2h_protocol.errors import ProtocolError
from rd2h_runtime.testing.check_read import pattern, prefill_source
from rd2h_runtime.transfer import create_backend

MIB = 1 << 20
DEFAULT_LAYERS = (20 * MIB, 256 * MIB)
DEFAULT_BACKENDS = ("loopback", "cma", "nixl", "mooncake", "memfabric")
# Backends whose read copies on the calling thread (the engines copy on threads of their own).
CALLER_COPIES = ("loopback", "cma")
FALLBACK_LLC = 32 * MIB  # when sysfs does not say


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache sysfs lists for cpu0, else :data:`FALLBACK_LLC`."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": MIB}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=FALLBACK_LLC)


def cache_evictor(cold: bool) -> Callable[[], None]:
    """What runs before each timed sample: writes 2x the LLC when ``cold``, else nothing."""
    if not cold:
        return lambda: None
    flood = np.zeros(2 * last_level_cache_bytes(), dtype=np.uint8)

    def evict() -> None:
        flood[:] += 1

    return evict


@dataclass(frozen=True)
class Samples:
    """Seconds per call: wall clock, and CPU time of the calling thread."""

    wall: tuple[float, ...]
    cpu: tuple[float, ...]


@dataclass(frozen=True)
class PairedMeasurement:
    """Back-to-back samples of a baseline and a candidate, each moving ``nbytes``."""

    label: str
    nbytes: int
    threads: int
    descriptors: int
    baseline: Samples
    candidate: Samples

    @property
    def baseline_gb_per_s(self) -> float:
        return self.nbytes / statistics.median(self.baseline.wall) / 1e9

    @property
    def candidate_gb_per_s(self) -> float:
        return self.nbytes / statistics.median(self.candidate.wall) / 1e9

    @property
    def ratio_quartiles(self) -> tuple[float, float, float]:
        """Quartiles over pairs of baseline wall time / candidate wall time."""
        return _quartiles(self.baseline.wall, self.candidate.wall)

    @property
    def cpu_ratio_quartiles(self) -> tuple[float, float, float]:
        """The same from the calling thread's CPU time: what a copy on that thread alone
        takes without waiting for a CPU (meaningless when other threads do the copy)."""
        return _quartiles(self.baseline.cpu, self.candidate.cpu)


def _quartiles(baseline: Sequence[float], candidate: Sequence[float]) -> tuple[float, float, float]:
    ratios = [b / c for b, c in zip(baseline, candidate, strict=True)]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return q1, median, q3


def measure_pairs(
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    *,
    evict: Callable[[], None],
    repeats: int,
) -> tuple[Samples, Samples]:
    """Time ``baseline`` and ``candidate`` back to back ``repeats`` times after one untimed
    pair (page faults, connections); which goes first alternates; ``evict`` runs before
    each timed call. Returns the baseline's and the candidate's samples, pair by pair."""
    baseline()
    candidate()
    wall: tuple[list[float], list[float]] = ([], [])
    cpu: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats):
        order = ((0, baseline), (1, candidate)) if i % 2 == 0 else ((1, candidate), (0, baseline))
        for side, move_once in order:
            evict()
            c0, t0 = time.thread_time(), time.perf_counter()
            move_once()
            wall[side].append(time.perf_counter() - t0)
            cpu[side].append(time.thread_time() - c0)
    return Samples(tuple(wall[0]), tuple(cpu[0])), Samples(tuple(wall[1]), tuple(cpu[1]))


@contextlib.contextmanager
def parallel_memcpy(nbytes: int, threads: int) -> Iterator[Callable[[], None]]:
    """Yield a function that copies ``nbytes`` between two buffers with ``threads`` threads
    (the caller copies the first part, a persistent pool the others); the copy is checked."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    bounds = [nbytes * k // threads for k in range(threads + 1)]
    parts = [
        (dst.ctypes.data + lo, src.ctypes.data + lo, hi - lo)
        for lo, hi in itertools.pairwise(bounds)
    ]
    with ThreadPoolExecutor(max(1, threads - 1), thread_name_prefix="bench-memcpy") as pool:

        def copy() -> None:
            others = [pool.submit(ctypes.memmove, *part) for part in parts[1:]]
            ctypes.memmove(*parts[0])
            for done in others:
                done.result()

        yield copy
    if not (dst == 1).all():
        raise AssertionError("memcpy baseline copied wrong bytes")


@contextlib.contextmanager
def backend_layer_reader(
    backend: str,
    nbytes: int,
    *,
    chunk: int = MIB,
    timeout_s: float = 120.0,
    options: dict[str, Any] | None = None,
) -> Iterator[tuple[Callable[[], None], Callable[[], bool], int]]:
    """Yield ``(read_layer, verify, descriptors)`` for ``backend`` against a live source.

    ``read_layer()`` is one batched read of the whole source into a registered destination;
    ``verify()`` checks the destination against the source's pattern. ``options`` go to
    the reading backend only.
    """
    with prefill_source(backend, nbytes, timeout_s=timeout_s) as source:
        dest = np.zeros(nbytes, dtype=np.uint8)
        offs = np.arange(0, nbytes, chunk, dtype=np.uint64)
        lengths = np.minimum(np.uint64(chunk), np.uint64(nbytes) - offs)
        remote = np.uint64(source.addr) + offs
        local = np.uint64(dest.ctypes.data) + offs
        with create_backend(backend, role="decode", **(options or {})) as reader:
            reader.register([(dest.ctypes.data, dest.nbytes)])

            def read_layer() -> None:
                reader.read(source.session, remote, local, lengths, timeout_s=timeout_s)

            def verify() -> bool:
                return bool(np.array_equal(dest, pattern(nbytes, source.seed)))

            yield read_layer, verify, int(offs.shape[0])


def measure_backend(
    backend: str,
    nbytes: int,
    *,
    threads: int,
    evict: Callable[[], None],
    chunk: int = MIB,
    repeats: int = 15,
) -> PairedMeasurement:
    """``backend``'s batched read of one ``nbytes`` layer paired with a ``threads``-thread
    memcpy (cma reads with ``threads``; other backends must be given 1)."""
    options = {"threads": threads} if backend == "cma" else {}
    with (
        parallel_memcpy(nbytes, threads) as memcpy,
        backend_layer_reader(backend, nbytes, chunk=chunk, options=options) as (
            read_layer,
            verify,
            count,
        ),
    ):
        base, cand = measure_pairs(memcpy, read_layer, evict=evict, repeats=repeats)
        if not verify():
            raise AssertionError(f"{backend} read wrong bytes")
    return PairedMeasurement(backend, nbytes, threads, count, base, cand)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--layer-mib", type=int, nargs="+", default=[n // MIB for n in DEFAULT_LAYERS]
    )
    parser.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS))
    parser.add_argument("--chunk", type=int, default=MIB, help="bytes per descriptor")
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[1, 2],
        help="cma's copy threads to compare, each beside a memcpy on as many threads",
    )  # fmt: skip
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold")
    parser.add_argument("--repeats", type=int, default=15, help="pairs per row")
    args = parser.parse_args(argv)
    evict = cache_evictor(args.cache == "cold")

    rows: list[tuple[str, ...]] = []
    for mib in args.layer_mib:
        for name in args.backends:
            for threads in args.threads if name == "cma" else [1]:
                try:
                    m = measure_backend(
                        name, mib * MIB, threads=threads, evict=evict, chunk=args.chunk,
                        repeats=args.repeats,
                    )  # fmt: skip
                except (ProtocolError, ImportError, RuntimeError, AssertionError) as exc:
                    reason = str(exc).splitlines()[0][:90]
                    rows.append((name, str(mib), "-", str(threads), "-", "n/a",
                                 f"({type(exc).__name__}: {reason})", ""))  # fmt: skip
                    continue
                q1, median, q3 = m.ratio_quartiles
                cpu = "-"
                if name in CALLER_COPIES and threads == 1:
                    c1, c2, c3 = m.cpu_ratio_quartiles
                    cpu = f"{c2:.2f} [{c1:.2f}-{c3:.2f}]"
                rows.append(
                    (name, str(mib), str(m.descriptors), str(threads),
                     f"{m.baseline_gb_per_s:.2f}", f"{m.candidate_gb_per_s:.2f}",
                     f"{median:.2f} [{q1:.2f}-{q3:.2f}]", cpu)
                )  # fmt: skip
    print(
        f"batched read of one layer, {args.chunk}-byte descriptors, {args.cache} caches, "
        f"{args.repeats} pairs per row (GB/s = 1e9 B/s, wall-clock medians; ratio = median "
        "over pairs of backend speed / memcpy speed on as many threads [quartiles]; cpu "
        "ratio = the same from the calling thread's CPU time, where that thread copies all)"
    )
    header = ("candidate", "layer MiB", "descs", "threads", "memcpy", "GB/s", "ratio", "cpu ratio")
    widths = (10, 9, 6, 7, 7, 7, 18)
    for row in (header, *rows):
        cells = [f"{row[0]:<{widths[0]}}"]
        cells += [f"{cell:>{width}}" for cell, width in zip(row[1:7], widths[1:], strict=True)]
        print(" ".join(cells) + f"  {row[7]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
