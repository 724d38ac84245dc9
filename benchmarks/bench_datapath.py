"""Data-path benchmark: a backend's batched read of one KV "layer" against memcpy.

Run ``python benchmarks/bench_datapath.py`` (``--help`` for sizes, backends, repeats). For
each layer size (default 20 MiB and 256 MiB, the two ends of per-layer KV volume) it times:

* ``memcpy``: ``numpy.copyto`` of the layer between two buffers of this process, the
  ceiling any copy on this machine can reach;
* each backend's ``read()`` of the whole layer from a Prefill source in ANOTHER process
  (``rd2h_runtime.tools.check_read.prefill_source``; ``loopback`` reads in-process), as one
  batched read of ``--chunk``-byte descriptors, exactly as Decode issues it.

Every sample is one full layer; the report gives the median of ``--repeats`` samples after
one warm-up (connection set-up, page faults), GB/s = 1e9 bytes/s, and the ratio to memcpy
measured in the same run. The bytes of the last sample are checked against the source's
pattern so a fast wrong read cannot pass.

:func:`measure` takes any zero-argument callable that moves one layer, so the same numbers
can be produced "through our runtime" (Decode's read worker, planning included) and set
beside the raw backend ones: ``measure("runtime", lambda: worker.read_layer(...), nbytes)``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from rd2h_protocol.errors import ProtocolError
from rd2h_runtime.tools.check_read import pattern, prefill_source
from rd2h_runtime.transfer import create_backend

MIB = 1 << 20
DEFAULT_LAYERS = (20 * MIB, 256 * MIB)
DEFAULT_BACKENDS = ("loopback", "cma", "nixl", "mooncake", "memfabric")


@dataclass(frozen=True)
class Measurement:
    """Timings of one candidate moving ``nbytes`` per sample."""

    label: str
    nbytes: int
    samples: tuple[float, ...]
    descriptors: int = 1

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)

    @property
    def gb_per_s(self) -> float:
        """Median throughput in GB/s (1e9 bytes per second)."""
        return self.nbytes / self.median_s / 1e9


def measure(
    label: str,
    move_once: Callable[[], object],
    nbytes: int,
    *,
    repeats: int = 5,
    warmup: int = 1,
    descriptors: int = 1,
) -> Measurement:
    """Time ``move_once`` (which moves ``nbytes``) ``repeats`` times after ``warmup`` runs."""
    for _ in range(warmup):
        move_once()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        move_once()
        samples.append(time.perf_counter() - t0)
    return Measurement(label, nbytes, tuple(samples), descriptors)


def measure_memcpy(nbytes: int, *, repeats: int = 5) -> Measurement:
    """The baseline: ``numpy.copyto`` between two ``nbytes`` buffers of this process."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    result = measure("memcpy", lambda: np.copyto(dst, src), nbytes, repeats=repeats)
    if not (dst == 1).all():
        raise AssertionError("memcpy baseline copied wrong bytes")
    return result


@contextlib.contextmanager
def backend_layer_reader(
    backend: str, nbytes: int, *, chunk: int = MIB, timeout_s: float = 120.0
) -> Iterator[tuple[Callable[[], None], Callable[[], bool], int]]:
    """Yield ``(read_layer, verify, descriptors)`` for ``backend`` against a live source.

    ``read_layer()`` is one batched read of the whole source into a registered destination;
    ``verify()`` checks the destination against the source's pattern.
    """
    with prefill_source(backend, nbytes, timeout_s=timeout_s) as source:
        dest = np.zeros(nbytes, dtype=np.uint8)
        offs = np.arange(0, nbytes, chunk, dtype=np.uint64)
        lengths = np.minimum(np.uint64(chunk), np.uint64(nbytes) - offs)
        remote = np.uint64(source.addr) + offs
        local = np.uint64(dest.ctypes.data) + offs
        with create_backend(backend, role="decode") as reader:
            reader.register([(dest.ctypes.data, dest.nbytes)])

            def read_layer() -> None:
                reader.read(source.session, remote, local, lengths, timeout_s=timeout_s)

            def verify() -> bool:
                return bool(np.array_equal(dest, pattern(nbytes, source.seed)))

            yield read_layer, verify, int(offs.shape[0])


def measure_backend(
    backend: str, nbytes: int, *, chunk: int = MIB, repeats: int = 5
) -> Measurement:
    """Median batched-read throughput of ``backend`` for one ``nbytes`` layer."""
    with backend_layer_reader(backend, nbytes, chunk=chunk) as (read_layer, verify, count):
        result = measure(backend, read_layer, nbytes, repeats=repeats, descriptors=count)
        if not verify():
            raise AssertionError(f"{backend} read wrong bytes")
        return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--layer-mib", type=int, nargs="+", default=[n // MIB for n in DEFAULT_LAYERS]
    )
    parser.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS))
    parser.add_argument("--chunk", type=int, default=MIB, help="bytes per descriptor")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    rows: list[tuple[str, int, str, str, str, str]] = []
    for mib in args.layer_mib:
        nbytes = mib * MIB
        base = measure_memcpy(nbytes, repeats=args.repeats)
        rows.append(
            ("memcpy", mib, "1", f"{base.median_s * 1e3:.2f}", f"{base.gb_per_s:.2f}", "1.00")
        )
        for name in args.backends:
            try:
                m = measure_backend(name, nbytes, chunk=args.chunk, repeats=args.repeats)
            except (ProtocolError, ImportError, RuntimeError, AssertionError) as exc:
                reason = str(exc).splitlines()[0][:100]
                rows.append((name, mib, "-", "-", "n/a", f"({type(exc).__name__}: {reason})"))
                continue
            ratio = m.gb_per_s / base.gb_per_s
            rows.append(
                (name, mib, str(m.descriptors), f"{m.median_s * 1e3:.2f}",
                 f"{m.gb_per_s:.2f}", f"{ratio:.2f}")
            )  # fmt: skip
    print(
        f"batched read of one layer, {args.chunk}-byte descriptors, median of "
        f"{args.repeats} (GB/s = 1e9 B/s; ratio = backend / memcpy in this run)"
    )
    header = ("candidate", "layer MiB", "descs", "median ms", "GB/s", "ratio vs memcpy")
    print(
        f"{header[0]:<10} {header[1]:>9} {header[2]:>6} {header[3]:>10} {header[4]:>7}  {header[5]}"
    )
    for row in rows:
        print(f"{row[0]:<10} {row[1]:>9} {row[2]:>6} {row[3]:>10} {row[4]:>7}  {row[5]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
