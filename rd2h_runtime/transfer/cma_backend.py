"""Same-host backend: Decode copies straight out of Prefill's memory with the kernel's
cross-memory attach (``process_vm_readv(2)``), no transfer engine in between.

When Prefill and Decode run on one machine, a read needs no network stack and no staging:
one system call moves up to ``IOV_MAX`` (1024) descriptors, each copied once, by the
kernel, from Prefill's address space into Decode's. A call that returns short (it copied
the descriptors before one it could not) is continued from the byte where it stopped; a
call that copies nothing is the error. There is nothing to install (Linux only), and when
:meth:`read` returns, no byte can still arrive, so :meth:`quiesce` has nothing to wait for.

Option ``threads`` (default 1): how many threads copy one read. With N > 1 a read of at
least 2 x 2 MiB is cut into up to N byte-balanced parts (a descriptor may be cut in two),
the calling thread copies one and a persistent pool of N - 1 threads, started once per
backend and ended by :meth:`close`, the others; the read returns when every part has
ended, failed or not. The default is 1: on the 2-vCPU machine this was measured on
(benchmarks/bench_datapath.py, cold caches, load ~7) two threads moved no more than one,
for cma as for memcpy (cma x2 2.8-3.0 GB/s at 20 MiB per read and 4.8-5.6 at 256 MiB;
x1 3.1-7.5 and 5.5), while one thread already reached 0.93-0.98 of a one-thread memcpy at
256 MiB. Where cores and memory channels are free, a few threads may pay: measure there.

The session id a Prefill publishes (MF_META carries it) names the process and what it
registered: ``cma:<boot id>:<pid>:<start time>:<region>,<region>...`` with each region
``<hex address>+<hex length>``. Decode refuses a session from another boot (another host,
or the same host rebooted), from a process that is gone or whose pid now names another
process (its start time differs), and any descriptor outside the published regions,
before a byte moves. So, as with the engines that register memory, Decode can read only
what Prefill registered; the session id is bounded (4096 characters in MF_META), which
bounds the regions to about 150 after merging (vLLM allocates its KV cache in a few large
tensors; the rd2h engines register one region per storage). Decode holds each Prefill
process by a pidfd (Linux >= 5.3), polled before every read and after it: a Prefill that
exited during a read fails that read, as its pid may have named another process by then.

Permission: the kernel lets a process read another's memory when it may ptrace it (same
user, or ``CAP_SYS_PTRACE``). Under Yama's ``ptrace_scope`` 1 (the default on Ubuntu) only
a parent may, so a Prefill backend declares every process of its user a permitted tracer
(``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``): any process of that user can then read
its memory, which it could also do through the transfer engines' registered memory.
``ptrace_scope`` 2 or 3 refuses; the error says so.

Any number of backends share one process, a Prefill and a Decode included (the kernel
copies within one address space just as well): tests/runtime/test_transfer_one_process.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import itertools
import os
import select
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, ClassVar, Final, NoReturn

import numpy as np

from rd2h_protocol.errors import ConfigError, TransferError
from rd2h_runtime.transfer.base import RegionSet, TransferBackend, U64Array

__all__ = ["CmaBackend"]

_PREFIX: Final = "cma:"
_IOV_MAX: Final = 1024  # descriptors per system call (the kernel's UIO_MAXIOV)
_IOVEC_BYTES: Final = 16  # one struct iovec: base and length, 64 bits each
_CALL_BYTES: Final = 32 << 20  # bytes per system call, between two deadline checks
DEFAULT_THREADS: Final = 1  # threads copying one read (see the module docstring)
_PART_MIN_BYTES: Final = 2 << 20  # a read is split only into parts at least this large
_MAX_SESSION_LEN: Final = 4096  # MF_META's bound on a name
_PR_SET_PTRACER: Final = 0x59616D61
_PR_SET_PTRACER_ANY: Final = ctypes.c_ulong(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return libc


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22),
    or None when there is no such process: with the pid, it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its end.
    return stat[stat.rindex(")") + 2 :].split()[19]


def _ptrace_scope() -> int | None:
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return None


class CmaBackend(TransferBackend):
    """Reads another process's registered memory on this host with ``process_vm_readv``."""

    name: ClassVar[str] = "cma"
    option_names: ClassVar[tuple[str, ...]] = ("threads",)

    def __init__(
        self,
        *,
        role: str,
        host: str = "127.0.0.1",
        threads: int = DEFAULT_THREADS,
        **options: Any,
    ) -> None:
        self._check_options(options)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"cma option threads must be an integer >= 1; got {threads!r}")
        super().__init__(role=role, host=host)
        if not Path("/proc/self/stat").exists():
            raise TransferError("the cma backend needs Linux (/proc and process_vm_readv)")
        self._libc = _libc()
        self._readv = self._libc.process_vm_readv
        self._threads = threads
        # The threads besides the caller's that copy parts of one read: started with the
        # first split read, reused by every later one, ended by close().
        self._pool = (
            futures.ThreadPoolExecutor(threads - 1, thread_name_prefix="rd2h-cma-copy")
            if threads > 1
            else None
        )
        self._boot = _boot_id()
        self._pid = os.getpid()
        self._start = _start_time(self._pid)
        self._peers: dict[str, _Peer] = {}
        self._peers_lock = threading.Lock()
        if self.role == "prefill" and _ptrace_scope() == 1:
            # Let Decode, not our parent, read us (see the module docstring).
            self._libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)

    @property
    def session_id(self) -> str:
        return self._session_naming(self._local)

    def _session_naming(self, regions: RegionSet) -> str:
        listed = ",".join(f"{addr:x}+{length:x}" for addr, length in regions.regions)
        return f"{_PREFIX}{self._boot}:{self._pid}:{self._start}:{listed}"

    def _register(self, regions: list[tuple[int, int]]) -> None:
        every = RegionSet(self._local.regions)
        every.add(regions)
        size = len(self._session_naming(every))
        if size > _MAX_SESSION_LEN:
            raise TransferError(
                f"cma: {len(every)} separate registered regions do not fit a session id "
                f"({size} > {_MAX_SESSION_LEN} characters); register fewer, larger regions "
                "or use the nixl backend"
            )

    def connect(self, session: str, *, timeout_s: float) -> None:
        self._ensure_open()
        self._peer(session)

    def _peer(self, session: str) -> _Peer:
        """The live process of this boot a session names, with the regions it published."""
        with self._peers_lock:
            peer = self._peers.get(session)
            if peer is None:
                peer = self._peers[session] = self._open(session)
            if peer.exited():
                del self._peers[session]
                peer.close()
                raise TransferError(f"cma session {session[:60]!r}...: process {peer.pid} is gone")
            return peer

    def _open(self, session: str) -> _Peer:
        pid, start, regions = self._parse(session)
        gone = TransferError(f"cma session {session[:60]!r}...: process {pid} is gone")
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise gone from None
        except OSError as exc:
            raise TransferError(
                f"cma: pidfd_open({pid}) failed ({exc}); the cma backend needs Linux >= 5.3"
            ) from exc
        # Opened first, checked second: if the pid names the process that published the
        # session now, the pidfd follows that process until it exits, whatever the pid
        # names later.
        if _start_time(pid) != start:
            os.close(pidfd)
            raise gone
        return _Peer(pid, regions, pidfd)

    def _parse(self, session: str) -> tuple[int, str, RegionSet]:
        fields = session.split(":")
        if len(fields) != 5 or not session.startswith(_PREFIX):
            raise TransferError(f"not a cma session id: {session[:80]!r}")
        _, boot, pid_text, start, listed = fields
        if boot != self._boot:
            raise TransferError(
                f"cma session of pid {pid_text} is from another host or boot ({boot}, ours "
                f"{self._boot}): cma reads only on one host; use nixl or mooncake across hosts"
            )
        try:
            pid = int(pid_text)
            regions = [
                (int(addr, 16), int(length, 16))
                for addr, length in (item.split("+") for item in listed.split(",") if item)
            ]
        except ValueError:
            raise TransferError(f"malformed cma session id: {session[:80]!r}") from None
        return pid, start, RegionSet(regions)

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        peer = self._peer(session)
        pid = peer.pid
        bad = peer.regions.first_outside(remote, lengths)
        if bad >= 0:
            raise TransferError(
                f"remote range {int(remote[bad]):#x}+{int(lengths[bad])} (descriptor {bad}) "
                f"is outside the regions cma session of pid {pid} registered"
            )
        layout = _Layout(remote, local, lengths)
        parts = max(1, min(self._threads, layout.total // _PART_MIN_BYTES))
        if self._pool is None or parts == 1:
            self._copy(pid, layout, 0, layout.total, deadline)
        else:
            self._copy_parts(self._pool, pid, layout, parts, deadline)
        if peer.exited():
            # Alive before the read and gone after: its pid may have named another process
            # during the read.
            raise TransferError(
                f"cma read of process {pid}: it exited during the read; the bytes read may "
                "not be its own"
            )

    def _copy_parts(
        self,
        pool: futures.ThreadPoolExecutor,
        pid: int,
        layout: _Layout,
        parts: int,
        deadline: float,
    ) -> None:
        """Copy the read as ``parts`` byte-balanced parts at once: this thread copies the
        first, the pool the others."""
        bounds = [layout.total * k // parts for k in range(parts + 1)]
        others = [
            pool.submit(self._copy, pid, layout, lo, hi, deadline)
            for lo, hi in itertools.pairwise(bounds[1:])
        ]
        try:
            self._copy(pid, layout, bounds[0], bounds[1], deadline)
        finally:
            # Every part has ended before read() returns, failed or not: no byte arrives
            # later (a part stops at the deadline too).
            futures.wait(others)
        for part in others:
            part.result()  # a pool part's TransferError

    def _copy(self, pid: int, layout: _Layout, lo: int, hi: int, deadline: float) -> None:
        """Copy bytes ``[lo, hi)`` of the read (its descriptors laid end to end) in as few
        calls as the limits allow. A call that copies less than asked is continued from
        the byte where it stopped; one that copies nothing is an error."""
        offset = lo
        while offset < hi:
            iov, local_iov, remote_iov, first = layout.call(offset, hi)
            count = iov.shape[1]
            done = self._readv(pid, local_iov, count, remote_iov, count, 0)
            if done <= 0:
                self._failed(pid, done, first, layout)
            offset += done
            if offset < hi and time.monotonic() > deadline:
                raise TransferError(
                    f"cma read timed out after {offset - lo} of {hi - lo} bytes of its part",
                    transient=True,
                )

    def _failed(self, pid: int, done: int, descriptor: int, layout: _Layout) -> NoReturn:
        where = (
            f"cma read of process {pid} failed at descriptor {descriptor} "
            f"({int(layout.remote[descriptor]):#x}+{int(layout.lengths[descriptor])})"
        )
        if done == 0:
            raise TransferError(f"{where}: the kernel copied nothing")
        code = ctypes.get_errno()
        hint = ""
        if code == errno.EPERM:
            hint = (
                f"; not allowed to read process {pid} (another user, or Yama "
                f"ptrace_scope {_ptrace_scope()}: the Prefill needs the same user and "
                "ptrace_scope <= 1)"
            )
        elif code == errno.ESRCH:
            hint = f"; process {pid} is gone"
        elif code == errno.EFAULT:
            hint = (
                "; the memory there (Prefill's, or our destination) is not mapped any more: "
                "was it freed after it was registered?"
            )
        raise TransferError(f"{where}: {os.strerror(code)}{hint}", code)

    def _close(self) -> None:
        with self._peers_lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class _Peer:
    """A Prefill process this backend reads from, held by a pidfd: the pidfd turns readable
    when that process exits, so a read checks it is alive with one poll, not /proc (which
    cost ~0.2 ms per read of a cold 20 MiB layer)."""

    __slots__ = ("_exit", "_guard", "_held", "pid", "pidfd", "regions")

    def __init__(self, pid: int, regions: RegionSet, pidfd: int) -> None:
        self.pid, self.regions, self.pidfd = pid, regions, pidfd
        self._exit = select.poll()
        self._exit.register(pidfd, select.POLLIN)
        # Reads of several threads poll while one may close: never poll a closed pidfd,
        # whose number another open() may have taken.
        self._guard = threading.Lock()
        self._held = True

    def exited(self) -> bool:
        """Whether the process has exited (or this handle was closed)."""
        with self._guard:
            return not self._held or bool(self._exit.poll(0))

    def close(self) -> None:
        with self._guard:
            if self._held:
                self._held = False
                os.close(self.pidfd)


class _Layout:
    """One read's descriptors laid end to end as a byte stream, cut into system calls."""

    __slots__ = ("address", "ends", "iov", "lengths", "remote", "total")

    def __init__(self, remote: U64Array, local: U64Array, lengths: U64Array) -> None:
        self.remote, self.lengths = remote, lengths
        self.ends = np.cumsum(lengths, dtype=np.uint64)  # stream offset after each descriptor
        self.total = int(self.ends[-1])
        self.iov = np.empty((2, lengths.shape[0], 2), dtype=np.uint64)  # local, remote
        self.iov[0, :, 0] = local
        self.iov[1, :, 0] = remote
        self.iov[:, :, 1] = lengths
        # Taken once: ``.ctypes`` costs ~2 us (~20 us from cold caches) each time.
        self.address: int = self.iov.ctypes.data

    def call(self, offset: int, hi: int) -> tuple[U64Array, int, int, int]:
        """The iovecs of one call moving bytes from ``offset`` on, up to ``hi``: at most
        ``_IOV_MAX`` descriptors and ``_CALL_BYTES`` (so the deadline is checked every few
        milliseconds), the first and last descriptor trimmed to the range. Returns (the
        iovecs, to hold while the call runs; the address of the local ones, of the remote
        ones; index of the first descriptor)."""
        ends, count = self.ends, self.ends.shape[0]
        first = 0 if offset == 0 else int(np.searchsorted(ends, offset, side="right"))
        end = min(hi, offset + _CALL_BYTES, int(ends[min(first + _IOV_MAX, count) - 1]))
        last = count - 1 if end == self.total else int(np.searchsorted(ends, end - 1, "right"))
        skip = offset - (int(ends[first]) - int(self.lengths[first]))
        cut = int(ends[last]) - end
        iov = self.iov[:, first : last + 1]
        if not (skip or cut):
            local = self.address + first * _IOVEC_BYTES
            return iov, local, local + count * _IOVEC_BYTES, first
        iov = iov.copy()  # trimmed: the whole read's iovecs stay as they are
        iov[:, 0, 0] += np.uint64(skip)
        iov[:, 0, 1] -= np.uint64(skip)
        iov[:, -1, 1] -= np.uint64(cut)
        local = iov.ctypes.data
        return iov, local, local + iov.shape[1] * _IOVEC_BYTES, first
