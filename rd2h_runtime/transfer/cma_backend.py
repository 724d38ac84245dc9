"""Same-host backend: Decode copies straight out of Prefill's memory with the kernel's
cross-memory attach (``process_vm_readv(2)``), no transfer engine in between.

When Prefill and Decode run on one machine, a read needs no network stack and no staging:
one system call moves up to ``IOV_MAX`` (1024) descriptors, each copied once, by the
kernel, from Prefill's address space into Decode's. There is nothing to install (Linux
only) and nothing runs in the background: when :meth:`read` returns, no byte can still
arrive, so :meth:`quiesce` has nothing to wait for.

The session id a Prefill publishes (MF_META carries it) names the process and what it
registered: ``cma:<boot id>:<pid>:<start time>:<region>,<region>...`` with each region
``<hex address>+<hex length>``. Decode refuses a session from another boot (another host,
or the same host rebooted), from a process that is gone or whose pid now names another
process (its start time differs), and any descriptor outside the published regions,
before a byte moves. So, as with the engines that register memory, Decode can read only
what Prefill registered; the session id is bounded (4096 characters in MF_META), which
bounds the regions to about 150 after merging (vLLM allocates its KV cache in a few large
tensors; the rd2h engines register one region per storage).

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
import os
import time
from pathlib import Path
from typing import Any, ClassVar, Final, NoReturn

import numpy as np

from rd2h_protocol.errors import TransferError
from rd2h_runtime.transfer.base import RegionSet, TransferBackend, U64Array

__all__ = ["CmaBackend"]

_PREFIX: Final = "cma:"
_IOV_MAX: Final = 1024  # descriptors per system call (the kernel's UIO_MAXIOV)
_CALL_BYTES: Final = 32 << 20  # bytes per system call, between two deadline checks
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
    option_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, role: str, host: str = "127.0.0.1", **options: Any) -> None:
        self._check_options(options)
        super().__init__(role=role, host=host)
        if not Path("/proc/self/stat").exists():
            raise TransferError("the cma backend needs Linux (/proc and process_vm_readv)")
        self._libc = _libc()
        self._boot = _boot_id()
        self._pid = os.getpid()
        self._start = _start_time(self._pid)
        self._peers: dict[str, tuple[int, str, RegionSet]] = {}  # pid, start time, regions
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

    def _peer(self, session: str) -> tuple[int, RegionSet]:
        """The pid and regions a session names, checked to be a live process of this boot."""
        known = self._peers.get(session)
        if known is None:
            known = self._parse(session)
            self._peers[session] = known
        pid, start, regions = known
        if _start_time(pid) != start:
            self._peers.pop(session, None)
            raise TransferError(f"cma session {session[:60]!r}...: process {pid} is gone")
        return pid, regions

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
        pid, regions = self._peer(session)
        bad = regions.first_outside(remote, lengths)
        if bad >= 0:
            raise TransferError(
                f"remote range {int(remote[bad]):#x}+{int(lengths[bad])} (descriptor {bad}) "
                f"is outside the regions cma session of pid {pid} registered"
            )
        count = lengths.shape[0]
        local_iov = np.empty((count, 2), dtype=np.uint64)
        local_iov[:, 0], local_iov[:, 1] = local, lengths
        remote_iov = np.empty((count, 2), dtype=np.uint64)
        remote_iov[:, 0], remote_iov[:, 1] = remote, lengths
        ends = np.cumsum(lengths, dtype=np.uint64)
        start = 0
        while start < count:
            # One call: at most _IOV_MAX descriptors and about _CALL_BYTES (a longer single
            # descriptor alone), so the deadline is checked every few milliseconds.
            before = int(ends[start - 1]) if start else 0
            stop = int(np.searchsorted(ends, before + _CALL_BYTES, side="right"))
            stop = min(max(stop, start + 1), start + _IOV_MAX, count)
            want = int(ends[stop - 1]) - before
            done = self._libc.process_vm_readv(
                pid,
                local_iov[start:stop].ctypes.data,
                stop - start,
                remote_iov[start:stop].ctypes.data,
                stop - start,
                0,
            )
            if done != want:
                self._failed(pid, done, want, start, lengths)
            start = stop
            if time.monotonic() > deadline:
                raise TransferError(
                    f"cma read timed out after {start} of {count} descriptors", transient=True
                )

    def _failed(self, pid: int, done: int, want: int, start: int, lengths: U64Array) -> NoReturn:
        if done < 0:
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
            raise TransferError(f"cma read failed: {os.strerror(code)}{hint}", code)
        # A short read stops at the first descriptor the kernel could not copy.
        offsets = np.cumsum(lengths[start:], dtype=np.uint64)
        failed = start + int(np.searchsorted(offsets, done, side="right"))
        raise TransferError(
            f"cma read of process {pid} stopped after {done} of {want} bytes, at descriptor "
            f"{failed}: its memory is not mapped there any more"
        )

    def _close(self) -> None:
        self._peers.clear()
