"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

:func:`two_hosts` creates, for one test, a Prefill namespace and a Decode namespace, each
holding one end of a veth pair with its own address from 198.18.0.0/15 (the benchmarking
range, RFC 2544: never routed, so nothing here can clash with a real network), and removes
all of it when the test ends, also on failure. Names carry this process's id and a counter,
so concurrent runs and repeated tests never share one. :class:`TwoHosts` cuts and restores
the link (``ip link set ... down/up``) and rate-limits it (``tc qdisc ... tbf``).

Engines enter a namespace through ``DecodeSpec.netns`` / ``PrefillSpec.netns``
(:func:`rd2h_runtime.tools.engines.enter_netns`); commands run in one through
:meth:`TwoHosts.command` (``ip netns exec``).

Creating namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2. Where that
is missing, :func:`unavailable` says why, and :func:`require` fails the test in CI (the
``CI`` environment variable set: the suite runs as root there, so a missing capability is a
broken runner) and skips it elsewhere.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

__all__ = [
    "DECODE_IP",
    "PREFILL_IP",
    "PREFIX",
    "TwoHosts",
    "leftovers",
    "require",
    "two_hosts",
    "unavailable",
]

PREFILL_IP = "198.18.0.1"
DECODE_IP = "198.18.0.2"
_PREFIX_LEN = 30
#: Every namespace and device made here starts with this (plus this process's id).
PREFIX = f"rd2h{os.getpid()}"
_NETNS_DIR = "/var/run/netns"
_OURS = re.compile(r"rd2h(\d+)-\d+-(prefill|decode)")
_counter = itertools.count()


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


def require(need_tc: bool = False) -> None:
    """Fail (in CI) or skip (elsewhere) the calling test when namespaces cannot be made."""
    reason = unavailable(need_tc)
    if reason is not None:
        _refuse(reason)


def _refuse(reason: str) -> None:
    message = f"two-host tests cannot run: {reason}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set: its runner must allow this)", pytrace=False)
    pytest.skip(message)


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
    return os.path.exists(os.path.join(_NETNS_DIR, ns))


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """A fresh Prefill/Decode namespace pair, removed on exit (also when creation failed).

    Fails (CI) or skips (elsewhere) the test when namespaces cannot be made here.
    """
    require()
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
            _refuse(f"could not create network namespaces: {exc}")
        yield hosts
    finally:
        errors = _remove(hosts)
        assert not errors, f"could not remove the test's namespaces: {errors}"


def _sweep() -> None:
    """Remove namespaces a killed earlier run left behind (its process no longer exists);
    their veth ends go with them."""
    if not os.path.isdir(_NETNS_DIR):
        return
    for ns in os.listdir(_NETNS_DIR):
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
    """Namespaces and devices of this process still present (for the tests' own check)."""
    found = (
        [ns for ns in os.listdir(_NETNS_DIR) if ns.startswith(PREFIX)]
        if os.path.isdir(_NETNS_DIR)
        else []
    )
    links = _run(["ip", "-o", "link", "show"]).stdout
    found += [
        line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if PREFIX in line
    ]
    return found
