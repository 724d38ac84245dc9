"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

:func:`two_hosts` creates a Prefill namespace and a Decode namespace, each holding one end
of a veth pair with its own address from 198.18.0.0/15 (the benchmarking range, RFC 2544:
never routed, so nothing here can clash with a real network), and removes all of it on
exit, also on an error or Ctrl-C. Names carry this process's id and a counter, so
concurrent runs never share one, and namespaces a killed earlier run left behind are swept
first. :class:`TwoHosts` cuts and restores the link (``ip link set ... down/up``) and
rate-limits it (``tc qdisc ... tbf``).

A process enters a namespace with :func:`enter_netns` (as ``ip netns exec`` does) or, for
an engine that must talk over the link, :func:`enter_host` (which also keeps UCX on it);
commands run in one through :meth:`TwoHosts.command`; :func:`thread_in_netns` moves only
the calling thread's network namespace for a while (clients, and the children that thread
starts). The two-host tests (tests/runtime/test_two_hosts.py), the data-path benchmarks'
``--netns`` and the serving benchmark's ``--two-hosts`` use this.

Creating and entering namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and
iproute2; :func:`unavailable` says why it cannot be done here.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import os
import re
import shutil
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "DECODE_IP",
    "PREFILL_IP",
    "PREFIX",
    "NamespacesUnavailable",
    "TwoHosts",
    "enter_host",
    "enter_netns",
    "interface_of",
    "leftovers",
    "thread_in_netns",
    "two_hosts",
    "unavailable",
]

PREFILL_IP = "198.18.0.1"
DECODE_IP = "198.18.0.2"
_PREFIX_LEN = 30
#: Every namespace and device made here starts with this (plus this process's id).
PREFIX = f"rd2h{os.getpid()}"
NETNS_DIR = "/var/run/netns"
_OURS = re.compile(r"rd2h(\d+)-\d+-(prefill|decode)")
_counter = itertools.count()

_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_RDONLY = 1
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2
_SIOCGIFADDR = 0x8915


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be made here (no root, no iproute2, or creation failed)."""


def _run(args: Sequence[str], timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    """Run a command; raise :class:`RuntimeError` with its output when it fails."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        out = (proc.stderr or proc.stdout).strip()
        raise RuntimeError(f"`{' '.join(args)}` failed ({proc.returncode}): {out}")
    return proc


def unavailable(need_tc: bool = False) -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    for tool in ("ip", "tc") if need_tc else ("ip",):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


@dataclass(frozen=True)
class TwoHosts:
    """Names and addresses of one Prefill/Decode namespace pair."""

    prefill_ns: str
    decode_ns: str
    prefill_dev: str
    decode_dev: str
    prefill_ip: str = PREFILL_IP
    decode_ip: str = DECODE_IP

    def set_link(self, up: bool) -> None:
        """Cut (``up=False``) or restore the link: both ends go down (or up)."""
        state = "up" if up else "down"
        for ns, dev in ((self.decode_ns, self.decode_dev), (self.prefill_ns, self.prefill_dev)):
            _run(["ip", "-n", ns, "link", "set", "dev", dev, state])

    def limit(self, rate: str, burst: str, latency: str) -> None:
        """A token-bucket limit (``tc ... tbf``) on both ends' egress."""
        for ns, dev in ((self.prefill_ns, self.prefill_dev), (self.decode_ns, self.decode_dev)):
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                  "rate", rate, "burst", burst, "latency", latency])  # fmt: skip

    def unlimit(self) -> None:
        """Remove the limit from both ends (back to the device's default queue)."""
        for ns, dev in ((self.prefill_ns, self.prefill_dev), (self.decode_ns, self.decode_dev)):
            if "tbf" in self.qdisc(ns, dev):
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])

    def qdisc(self, ns: str, dev: str) -> str:
        return _run(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout.strip()

    def command(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``ns`` (with that namespace's /sys)."""
        return ["ip", "netns", "exec", ns, *argv]


def _make(hosts: TwoHosts) -> None:
    _run(["ip", "netns", "add", hosts.prefill_ns])
    _run(["ip", "netns", "add", hosts.decode_ns])
    _run(["ip", "link", "add", hosts.prefill_dev, "type", "veth", "peer", "name", hosts.decode_dev])
    for ns, dev, ip in (
        (hosts.prefill_ns, hosts.prefill_dev, hosts.prefill_ip),
        (hosts.decode_ns, hosts.decode_dev, hosts.decode_ip),
    ):
        _run(["ip", "link", "set", "dev", dev, "netns", ns])
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/{_PREFIX_LEN}", "dev", dev])
        _run(["ip", "-n", ns, "link", "set", "dev", "lo", "up"])
        _run(["ip", "-n", ns, "link", "set", "dev", dev, "up"])


def _remove(hosts: TwoHosts) -> list[str]:
    """Remove the pair and both namespaces (whatever of them exists); the errors, if any."""
    errors = []
    # The veth first: a namespace still held by a process (an engine not reaped yet) lives
    # on after `ip netns del`, and so would a device inside it.
    for ns, dev in ((hosts.prefill_ns, hosts.prefill_dev), (hosts.decode_ns, hosts.decode_dev)):
        if _exists(ns) and dev in _run(["ip", "-n", ns, "-o", "link", "show"]).stdout:
            with contextlib.suppress(RuntimeError):
                _run(["ip", "-n", ns, "link", "del", "dev", dev])
    for dev in (hosts.prefill_dev, hosts.decode_dev):  # still in the root namespace
        if dev in _run(["ip", "-o", "link", "show"]).stdout:
            try:
                _run(["ip", "link", "del", "dev", dev])
            except RuntimeError as exc:
                errors.append(str(exc))
    for ns in (hosts.prefill_ns, hosts.decode_ns):
        if _exists(ns):
            try:
                _run(["ip", "netns", "del", ns])
            except RuntimeError as exc:
                errors.append(str(exc))
    return errors


def _exists(ns: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, ns))


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """A fresh Prefill/Decode namespace pair, removed on exit (also when creation failed).

    Raises :class:`NamespacesUnavailable` when they cannot be made here, and
    :class:`RuntimeError` on exit when they could not all be removed.
    """
    reason = unavailable()
    if reason is not None:
        raise NamespacesUnavailable(reason)
    _sweep()
    n = next(_counter)
    hosts = TwoHosts(
        prefill_ns=f"{PREFIX}-{n}-prefill",
        decode_ns=f"{PREFIX}-{n}-decode",
        prefill_dev=f"{PREFIX}p{n}",  # at most 15 characters: rd2h + 7-digit pid + p + n
        decode_dev=f"{PREFIX}d{n}",
    )
    try:
        try:
            _make(hosts)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            raise NamespacesUnavailable(f"could not create network namespaces: {exc}") from exc
        yield hosts
    finally:
        errors = _remove(hosts)
        if errors:
            raise RuntimeError(f"could not remove the namespaces: {errors}")


def _sweep() -> None:
    """Remove namespaces a killed earlier run left behind (its process no longer exists);
    their veth ends go with them."""
    if not os.path.isdir(NETNS_DIR):
        return
    for ns in os.listdir(NETNS_DIR):
        match = _OURS.fullmatch(ns)
        if match is None or int(match[1]) == os.getpid():
            continue
        try:
            os.kill(int(match[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(RuntimeError):
                _run(["ip", "netns", "del", ns])
        except PermissionError:
            pass  # alive


def leftovers() -> list[str]:
    """Namespaces and devices of this process still present."""
    found = (
        [ns for ns in os.listdir(NETNS_DIR) if ns.startswith(PREFIX)]
        if os.path.isdir(NETNS_DIR)
        else []
    )
    links = _run(["ip", "-o", "link", "show"]).stdout
    found += [
        line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if PREFIX in line
    ]
    return found


# -- entering a namespace ---------------------------------------------------------------------


def _libc_check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_netns(name: str) -> None:
    """Move this process into the named network namespace, as ``ip netns exec`` does.

    Call it before any socket, ZMQ context or transfer engine exists, on the main thread:
    the namespace is per thread, and threads started afterwards inherit it. Like ``ip netns
    exec``, it also gives the process a mount namespace of its own with a sysfs of the new
    network namespace on /sys (UCX finds its network devices in /sys/class/net). Needs
    root (CAP_SYS_ADMIN).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        _libc_check(libc.setns(fd, _CLONE_NEWNET), f"setns({name})")
    finally:
        os.close(fd)
    _libc_check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # Nothing mounted or unmounted from here on may propagate back to the host's mounts.
    _libc_check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    flags = _MS_RDONLY if os.statvfs("/sys").f_flag & os.ST_RDONLY else 0
    libc.umount2(b"/sys", _MNT_DETACH)  # not mounted is fine
    _libc_check(libc.mount(name.encode(), b"/sys", b"sysfs", flags, None), "mount sysfs /sys")


@contextlib.contextmanager
def thread_in_netns(name: str) -> Iterator[None]:
    """Run the calling thread in the named network namespace until the block ends.

    Only the network namespace changes (no mount namespace, so a process with other
    threads may do it): sockets made inside belong to that namespace for good, and threads
    and child processes started inside inherit it. On exit the thread returns to the
    namespace it was in. Needs root (CAP_SYS_ADMIN).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open(
        f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY | os.O_CLOEXEC
    )
    try:
        fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            _libc_check(libc.setns(fd, _CLONE_NEWNET), f"setns({name})")
        finally:
            os.close(fd)
        try:
            yield
        finally:
            _libc_check(libc.setns(home, _CLONE_NEWNET), "setns(back)")
    finally:
        os.close(home)


def interface_of(host: str) -> str | None:
    """The network interface holding the IPv4 address ``host`` here, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == host:
                return name
    return None


def enter_host(netns: str, host: str) -> None:
    """Start-up of an engine in a namespace: enter it, keep UCX on the link of ``host``.

    UCX sees the other namespace's engine on the same machine and would use shared memory
    with it, past the link; TCP over the interface of ``host`` is what two hosts would use.
    """
    enter_netns(netns)
    os.environ["UCX_TLS"] = "tcp"
    device = interface_of(host)
    if device is None:
        raise RuntimeError(f"no interface holds {host} in network namespace {netns}")
    os.environ["UCX_NET_DEVICES"] = device
