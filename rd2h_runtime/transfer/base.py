"""The one interface every transfer backend implements, and the factory that builds them.

A backend moves bytes for Decode's batched read: ``read(session, remote, local, lengths)``
copies ``lengths[i]`` bytes from the peer's ``remote[i]`` into our ``local[i]``. The peer is
named by its ``session_id``, an opaque string the peer publishes (MF_META carries it).

What the base class does for every backend, so the engines stay small:

- input normalisation: addresses and lengths become read-only ``uint64`` arrays of equal
  length; zero-length descriptors are dropped; an empty batch is a no-op.
- the local safety check: every ``[local[i], local[i] + lengths[i])`` must lie inside a
  region this backend registered. Engines differ here (Mooncake's TCP transport would
  write into any mapped address), and Decode must only ever write into its destinations.
- the deadline: ``timeout_s`` becomes an absolute ``time.monotonic()`` deadline that the
  engine code checks; an expired read raises :class:`TransferError`.
- ``close()`` is idempotent and the backend is a context manager.

Every failure of a read surfaces as :class:`rd2h_protocol.errors.TransferError` with the
engine's own result code in ``backend_code`` (``None`` when the failure is ours, e.g. a
local range outside the registered regions). ``transient=True`` means retrying the same
read may succeed and nothing of the failed attempt can still write into local memory.

After a read timed out, the engine may, for some backends, still be writing into the
destination. :meth:`TransferBackend.quiesce` waits until that can no longer happen; a
caller must not hand destination memory back for reuse before it returns ``True``.
"""

from __future__ import annotations

import abc
import importlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Final, TypeVar

import numpy as np
import numpy.typing as npt

from rd2h_protocol.errors import ConfigError, MissingExtra, TransferError

__all__ = [
    "BACKENDS",
    "ROLES",
    "AddrLike",
    "RegionSet",
    "TransferBackend",
    "U64Array",
    "create_backend",
    "merge_regions",
    "normalise_role",
]

U64Array = npt.NDArray[np.uint64]
AddrLike = U64Array | Sequence[int]

ROLES: Final = ("prefill", "decode")

# name -> (module, class name, pip extra, engine module that extra installs). The module is
# imported only when the backend is created, so `import rd2h_runtime` never loads an engine.
BACKENDS: Final[dict[str, tuple[str, str, str | None, str | None]]] = {
    "loopback": ("rd2h_runtime.transfer.loopback", "LoopbackBackend", None, None),
    "cma": ("rd2h_runtime.transfer.cma_backend", "CmaBackend", None, None),
    "nixl": ("rd2h_runtime.transfer.nixl_backend", "NixlBackend", "nixl", "nixl"),
    "mooncake": (
        "rd2h_runtime.transfer.mooncake_backend",
        "MooncakeBackend",
        "mooncake",
        "mooncake",
    ),
    "memfabric": (
        "rd2h_runtime.transfer.memfabric_backend",
        "MemfabricBackend",
        "memfabric",
        "memfabric_hybrid",
    ),
}

_U64_MAX: Final = (1 << 64) - 1

T = TypeVar("T")


def normalise_role(role: str) -> str:
    """``"Prefill"``/``"prefill"`` -> ``"prefill"``; anything else is a :class:`ConfigError`."""
    value = str(role).strip().lower()
    if value not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
    return value


def create_backend(
    name: str, *, role: str, host: str = "127.0.0.1", **options: Any
) -> TransferBackend:
    """Build the transfer backend ``name`` for ``role`` (``"prefill"`` or ``"decode"``).

    ``host`` is the address peers use to reach this process (engines that listen bind or
    advertise it). ``options`` are backend specific; an unknown option is a
    :class:`ConfigError` listing the accepted ones. Raises :class:`ConfigError` for an unknown
    backend name and :class:`MissingExtra` (naming the pip extra) when the engine package is
    not installed.
    """
    key = str(name).strip().lower()
    if key not in BACKENDS:
        raise ConfigError(
            f"unknown transfer backend {name!r}; expected one of: {', '.join(sorted(BACKENDS))}"
        )
    module_name, class_name, extra, engine_module = BACKENDS[key]
    module = importlib.import_module(module_name)
    cls: type[TransferBackend] = getattr(module, class_name)
    try:
        return cls(role=normalise_role(role), host=host, **options)
    except ModuleNotFoundError as exc:
        # Only the engine package itself being absent means "install the extra"; a broken
        # install (a missing shared library, a dependency of the engine) keeps its own error.
        if extra is not None and engine_module is not None and _is_missing(exc, engine_module):
            raise MissingExtra(engine_module, extra) from exc
        raise


def _is_missing(exc: ModuleNotFoundError, module: str) -> bool:
    missing = exc.name or ""
    return missing == module or missing.startswith(module + ".")


def merge_regions(regions: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort ``(addr, length)`` regions and merge overlapping or touching ones.

    Zero-length regions are dropped. Raises :class:`ConfigError` for a negative address or
    length, or a region that runs past the 64-bit address space.
    """
    items: list[tuple[int, int]] = []
    for addr, length in regions:
        a, n = int(addr), int(length)
        if a < 0 or n < 0 or a + n > _U64_MAX + 1:
            raise ConfigError(
                f"memory region must have 0 <= addr and 0 <= length within 64 bits; "
                f"got addr={a:#x}, length={n}"
            )
        if n:
            items.append((a, n))
    items.sort()
    merged: list[tuple[int, int]] = []
    for a, n in items:
        if merged and a <= merged[-1][0] + merged[-1][1]:
            start, length = merged[-1]
            merged[-1] = (start, max(length, a + n - start))
        else:
            merged.append((a, n))
    return merged


class RegionSet:
    """Disjoint, sorted address ranges with a vectorised "are these ranges inside?" test."""

    __slots__ = ("_ends", "_starts")

    def __init__(self, regions: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: U64Array = np.zeros(0, dtype=np.uint64)
        self._ends: U64Array = np.zeros(0, dtype=np.uint64)
        self.add(regions)

    def add(self, regions: Iterable[tuple[int, int]]) -> None:
        """Add more regions (merged with the existing ones)."""
        merged = merge_regions([*self.regions, *regions])
        self._starts = np.array([a for a, _ in merged], dtype=np.uint64)
        # An end of exactly 2**64 does not fit in uint64; keep the inclusive last byte.
        self._ends = np.array([a + n - 1 for a, n in merged], dtype=np.uint64)

    @property
    def regions(self) -> list[tuple[int, int]]:
        """The merged ``(addr, length)`` regions, ascending."""
        return [
            (int(s), int(e) - int(s) + 1) for s, e in zip(self._starts, self._ends, strict=True)
        ]

    def __len__(self) -> int:
        return int(self._starts.shape[0])

    def first_outside(self, addrs: U64Array, lengths: U64Array) -> int:
        """Index of the first range ``[addrs[i], addrs[i] + lengths[i])`` not inside one region.

        ``-1`` when all are inside. ``lengths`` must be non-zero.

        Cheap for the usual batch, whose descriptors come in long stretches that all lie
        in one region (a planner emits one component, i.e. one destination, after the
        other): each chunk of ``_CHUNK`` ranges is first bounded as a whole by ``[its
        lowest address, its highest address + its longest length)``; a chunk whose bound
        lies inside one region is inside, with no per-range temporaries (which, at 10^5
        descriptors, cost more in page faults than in arithmetic). Only a chunk whose
        bound does not fit one region gets the exact per-range test.
        """
        n = addrs.shape[0]
        if n == 0:
            return -1
        if self._starts.shape[0] == 0:
            return 0
        if n <= _SMALL:  # a small batch: the exact test at once costs less than two passes
            inside = self._inside(addrs, addrs, lengths)
            return -1 if inside.all() else int(np.argmin(inside))
        heads = np.arange(0, n, _CHUNK)
        ok = self._inside(
            np.minimum.reduceat(addrs, heads),
            np.maximum.reduceat(addrs, heads),
            np.maximum.reduceat(lengths, heads),
        )
        for c in np.flatnonzero(~ok).tolist():
            lo = int(c) * _CHUNK
            a, ln = addrs[lo : lo + _CHUNK], lengths[lo : lo + _CHUNK]
            bad = np.flatnonzero(~self._inside(a, a, ln))
            if bad.shape[0]:
                return lo + int(bad[0])
        return -1

    def _inside(self, low: U64Array, high: U64Array, length: U64Array) -> npt.NDArray[np.bool_]:
        """Per i: ``[low[i], high[i] + length[i])`` lies inside one region (``low <= high``,
        ``length > 0``)."""
        idx = np.searchsorted(self._starts, low, side="right") - 1
        # idx -1 (low before every region) reads the last region's end: masked by idx >= 0.
        last = self._ends[idx]
        # low is at/after the start of region idx when idx >= 0 (searchsorted); the last
        # byte, high + length - 1, must be <= the region's last byte: written as a
        # subtraction so nothing overflows near 2**64 (high <= last is checked first; where
        # it fails the wrapped difference is masked by the &).
        inside: npt.NDArray[np.bool_] = (idx >= 0) & (high <= last) & (length - _ONE <= last - high)
        return inside


# Ranges bounded together by RegionSet.first_outside's fast test.
_CHUNK: Final = 1024
# Batches this small get the exact per-range test directly (see first_outside).
_SMALL: Final = 256
_ONE: Final = np.uint64(1)


def as_u64(values: AddrLike, what: str) -> U64Array:
    """``values`` as a 1-D ``uint64`` array (no copy when it already is one).

    Raises :class:`TransferError` for anything that is not a 1-D sequence of integers in
    ``[0, 2**64)``.
    """
    if isinstance(values, np.ndarray):
        if values.dtype == np.uint64 and values.ndim == 1:
            return values
        if values.ndim != 1 or values.dtype.kind not in "ui":
            raise TransferError(
                f"{what} must be a 1-D integer array; got dtype {values.dtype}, "
                f"shape {values.shape}"
            )
        if values.dtype.kind == "i" and values.size and int(values.min()) < 0:
            raise TransferError(f"{what} must not be negative")
        return values.astype(np.uint64)
    if any(not isinstance(v, (int, np.integer)) or isinstance(v, bool) for v in values):
        raise TransferError(f"{what} must hold integers only")
    try:
        return np.array(values, dtype=np.uint64).reshape(-1)
    except OverflowError as exc:
        raise TransferError(f"{what} must lie in [0, 2**64): {exc}") from exc


class TransferBackend(abc.ABC):
    """A transfer engine bound to one process and one role.

    Subclasses implement :attr:`session_id`, :meth:`_register`, :meth:`_read` and
    :meth:`_close`; the public methods here do the checks common to all engines.
    """

    name: ClassVar[str]
    #: options the constructor accepts besides role and host (for the error message)
    option_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, role: str, host: str = "127.0.0.1") -> None:
        self.role = normalise_role(role)
        self.host = host
        self._local = RegionSet()
        self._closed = False
        self._close_lock = threading.Lock()

    @classmethod
    def _check_options(cls, options: dict[str, Any]) -> None:
        unknown = sorted(set(options) - set(cls.option_names))
        if unknown:
            accepted = ", ".join(cls.option_names) or "none"
            raise ConfigError(
                f"unknown option(s) for transfer backend {cls.name!r}: {', '.join(unknown)}; "
                f"accepted: {accepted}"
            )

    # ----------------------------------------------------------------- interface
    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """What a peer passes to :meth:`read` to reach this backend's registered memory."""

    @property
    def registered(self) -> list[tuple[int, int]]:
        """The merged local regions registered so far."""
        return self._local.regions

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register local ``(addr, length)`` regions: memory peers read, or we read into.

        Registering memory that is already registered is harmless. Raises
        :class:`TransferError` when the engine refuses.
        """
        self._ensure_open()
        merged = merge_regions(regions)
        if merged:
            self._register(merged)
            self._local.add(merged)

    def read(
        self,
        session: str,
        remote_addrs: AddrLike,
        local_addrs: AddrLike,
        lengths: AddrLike,
        *,
        timeout_s: float,
    ) -> None:
        """Read ``lengths[i]`` bytes at the peer's ``remote_addrs[i]`` into ``local_addrs[i]``.

        Returns when every byte has arrived; raises :class:`TransferError` on any failure,
        or when the read has not finished within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + float(timeout_s)
        self._ensure_open()
        remote = as_u64(remote_addrs, "remote_addrs")
        local = as_u64(local_addrs, "local_addrs")
        length = as_u64(lengths, "lengths")
        if not remote.shape[0] == local.shape[0] == length.shape[0]:
            raise TransferError(
                "remote_addrs, local_addrs and lengths must have equal length; got "
                f"{remote.shape[0]}, {local.shape[0]}, {length.shape[0]}"
            )
        if not isinstance(session, str) or not session:
            raise TransferError(f"session must be a non-empty str, got {session!r}")
        if length.shape[0] and not int(length.min()):  # zero-length descriptors move nothing
            nonzero = length != 0
            remote, local, length = remote[nonzero], local[nonzero], length[nonzero]
        if length.shape[0] == 0:
            return
        bad = self._local.first_outside(local, length)
        if bad >= 0:
            raise TransferError(
                f"local range {int(local[bad]):#x}+{int(length[bad])} (descriptor {bad}) is "
                f"outside the registered regions of this {self.name} backend"
            )
        if time.monotonic() >= deadline:
            raise TransferError(
                f"{self.name} read not started: timeout_s={timeout_s} already elapsed",
                transient=True,
            )
        self._read(session, remote, local, length, deadline)

    def connect(self, session: str, *, timeout_s: float) -> None:
        """Get ready to read from ``session`` (its metadata loaded, a connection made), so
        that a first read's time is data movement only. Touches no remote memory; reads
        connect on their own when this was not called. Raises :class:`TransferError`."""
        self._ensure_open()

    def quiesce(self, timeout_s: float) -> bool:
        """Wait until no earlier read can still write into local memory; ``True`` if so."""
        return True

    def close(self) -> None:
        """Release the engine. Idempotent; reads after close raise :class:`TransferError`."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._close()
        finally:
            runner = getattr(self, "_runner", None)
            if isinstance(runner, BlockingCallRunner):
                runner.close()  # its worker thread ends (after a call still running, if any)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} role={self.role} host={self.host} {state}>"

    # ------------------------------------------------------------ engine hooks
    @abc.abstractmethod
    def _register(self, regions: list[tuple[int, int]]) -> None:
        """Register merged, non-empty regions with the engine."""

    @abc.abstractmethod
    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        """Do the checked, non-empty read; ``deadline`` is on ``time.monotonic()``."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release engine resources (called once)."""

    def _ensure_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.name} backend is closed")


class BlockingCallRunner:
    """Runs one blocking engine call at a time on a worker thread, with a deadline.

    For engines whose batched read is a synchronous C call with no cancel: the caller stops
    waiting at its deadline, but the call keeps running until the engine gives up. While it
    runs, new calls are refused (``TransferError(transient=True)``) and :meth:`wait_idle`
    tells when destination memory is safe again.

    The worker is ONE daemon thread per runner, started with the first call and kept for
    the next ones (a thread per call cost a thread start on every read); daemon, so a stuck
    engine call never blocks interpreter exit. It ends at :meth:`close` (after the call it
    runs, if any) or when the runner is garbage-collected; a call after :meth:`close`
    starts a new one.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._idle = threading.Event()
        self._idle.set()
        self._guard = threading.Lock()
        # The worker and its own job queue (each worker has one, so a stop meant for one
        # worker never reaches the next). The worker holds its queue, never the runner: a
        # dropped runner stops it (the finalizer reads the list when it runs).
        self._worker: list[tuple[threading.Thread, _Jobs]] = []
        weakref.finalize(self, _stop, self._worker)

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def run(self, fn: Callable[[], T], deadline: float, what: str) -> T:
        """Run ``fn`` and return its result; :class:`TransferError` if past ``deadline``."""
        box: dict[str, Any] = {}
        idle = self._idle

        def job() -> None:
            try:
                box["result"] = fn()
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc
            finally:
                idle.set()

        with self._guard:
            if not idle.is_set():
                raise TransferError(
                    f"{what}: an earlier {self._name} call that timed out is still running",
                    transient=True,
                )
            idle.clear()
            if not self._worker or not self._worker[0][0].is_alive():
                jobs: _Jobs = queue.SimpleQueue()
                worker = threading.Thread(
                    target=_work, args=(jobs,), name=f"rd2h-{self._name}-call", daemon=True
                )
                worker.start()
                self._worker[:] = [(worker, jobs)]
            self._worker[0][1].put(job)
        if not idle.wait(max(0.0, deadline - time.monotonic())):
            raise TransferError(
                f"{what}: timed out; the {self._name} engine call is still running and may "
                "still write into local memory (see quiesce())",
                transient=False,
            )
        if "error" in box:
            raise box["error"]
        result: T = box["result"]
        return result

    def wait_idle(self, timeout_s: float) -> bool:
        return self._idle.wait(max(0.0, float(timeout_s)))

    def close(self) -> None:
        """Let the worker thread end once its current call (if any) returns. Idempotent."""
        with self._guard:
            _stop(self._worker)


_Jobs = queue.SimpleQueue[Callable[[], None] | None]


def _stop(worker: list[tuple[threading.Thread, _Jobs]]) -> None:
    """Tell a runner's worker (if any) to end after its current call, and forget it."""
    for _, jobs in worker:
        jobs.put(None)
    worker.clear()


def _work(jobs: _Jobs) -> None:
    """A runner's worker thread: run jobs until told to stop (``None``)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        job()
        del job  # drop the call's closure (engine, arrays) while waiting for the next
