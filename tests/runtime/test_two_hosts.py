"""Prefill and Decode as two hosts: each engine in a network namespace of its own, with its
own address (198.18.0.1 and 198.18.0.2), joined by a veth pair; the KV moves over that
link with nixl (UCX over TCP: shared memory, which would bypass the link, is off) and
mooncake (TCP). Faults on the link:

- cut (``ip link set ... down``) for longer than a lease, then restored: every request ends
  terminal within the lease + 1 s of the cut, Prefill's storage gates reopen, no wrong byte,
  and new requests succeed once the link is back;
- rate-limited (``tc ... tbf``): every byte right, throughput measured against the rate;
- a Decode killed and restarted behind the same address: the requests in flight end
  terminal, then new requests succeed through the same Prefill;
- ``rd2h check-read`` between the two namespaces.

Each test makes its own namespaces (names carry this process's id) and removes them when
it ends, also on failure (:mod:`rd2h_runtime.testing.netns`). Needs root and iproute2: without
them the tests fail in CI and are skipped elsewhere. Run alone:
``UCX_MODULES=^ib python -m pytest -q -p no:cacheprovider tests/runtime/test_two_hosts.py -s``
(``-s`` shows the measured figures).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rd2h_protocol import ErrorCode
from rd2h_runtime.testing.child_engines import EngineProcess, engine_process
from rd2h_runtime.testing.engines import FAST_CONTROL, DecodeResult, DecodeSpec, PrefillSpec
from rd2h_runtime.testing.synthetic import RequestSpec, SyntheticModel
from tests.runtime import netns
from tests.runtime.e2e_harness import all_gates_open, assert_clean, wait_until
from tests.runtime.netns import TwoHosts, leftovers, two_hosts

pytestmark = pytest.mark.timeout(60)

BACKENDS = ["nixl", "mooncake"]
RING = SyntheticModel(num_layers=8, num_buffers=3)
# ~4 MiB per layer for a 1024-token request: long enough a transfer to measure a rate.
BIG = SyntheticModel(num_layers=4, k_block_len=32768)
LEASE_MS = 1000
LEASE_S = LEASE_MS / 1000
SLACK_S = 1.0  # "within the lease + 1 s"
WAIT_S = 15.0


def reqs(prefix: str, n: int = 3, tokens: int = 90) -> list[RequestSpec]:
    return [RequestSpec(f"{prefix}-{i}", tokens + 70 * i) for i in range(n)]


def ids_of(requests: list[RequestSpec]) -> list[str]:
    return [r.ext_id for r in requests]


@pytest.fixture
def hosts() -> Iterator[TwoHosts]:
    with two_hosts() as made:
        yield made
    assert not leftovers(), f"left behind: {leftovers()}"


@contextlib.contextmanager
def engines(
    hosts: TwoHosts, decode: DecodeSpec, prefill: PrefillSpec
) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    """Decode in its namespace on its address, Prefill in the other."""
    decode = dataclasses.replace(decode, host=hosts.decode_ip, netns=hosts.decode_ns)
    prefill = dataclasses.replace(prefill, host=hosts.prefill_ip, netns=hosts.prefill_ns)
    with engine_process("decode", decode) as dproc, engine_process("prefill", prefill) as pproc:
        target = dproc.target()
        assert target.host == hosts.decode_ip, target
        yield dproc, pproc


def rx_bytes(hosts: TwoHosts) -> int:
    """Bytes Decode's end of the link has received."""
    out = subprocess.run(
        ["ip", "-n", hosts.decode_ns, "-j", "-s", "link", "show", "dev", hosts.decode_dev],
        capture_output=True, text=True, check=True, timeout=10,
    ).stdout  # fmt: skip
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def check_prefill(finished: dict[str, list[Any]], bound: float | None) -> dict[str, Any]:
    """Every request finished on every Prefill rank (by ``bound``): {ext: RequestFinished}."""
    out = {}
    for ext, per_rank in finished.items():
        assert all(f is not None for f in per_rank), f"{ext} not finished on Prefill: {per_rank}"
        if bound is not None:
            late = max(at for _, at in per_rank) - bound
            assert late <= 0, f"{ext} finished on Prefill {late:.2f} s after the bound"
        out[ext] = per_rank[0][0]
    return out


def check_decode(results: dict[str, DecodeResult], bound: float | None) -> None:
    """Every request terminal on every Decode rank (by ``bound``); every byte right if done."""
    for ext, res in results.items():
        assert res.terminal, f"{ext} not terminal on Decode: {res}"
        if bound is not None:
            assert res.at <= bound, f"{ext} ended on Decode {res.at - bound:.2f} s after the bound"
        if res.ok:
            assert res.mismatches == (), f"{ext} reported done with wrong bytes: {res}"


def transfer_ok(dproc: EngineProcess, pproc: EngineProcess, requests: list[RequestSpec]) -> None:
    """Move the requests; every one done on both sides, every byte right, nothing left."""
    ids = ids_of(requests)
    dproc.call("add", requests)
    pproc.call("add", requests, dproc.target())
    assert pproc.call("run", WAIT_S) == []
    finished = check_prefill(pproc.call("wait", ids, WAIT_S), None)
    assert all(f.ok for f in finished.values()), finished
    results = dproc.call("wait", ids, WAIT_S)
    check_decode(results, None)
    assert all(r.ok for r in results.values()), results
    settle(dproc, pproc, ids)


def transfer_ok_after_restore(dproc: EngineProcess, pproc: EngineProcess) -> None:
    """Requests go through again once a cut link is back.

    The first round may still fail, safely: bytes TCP sent into the cut link are
    retransmitted on the kernel's exponential backoff (0.2, 0.4, 0.8, 1.6 s ...), so a
    readiness queued behind them can wait past its lease (LEASE_EXPIRED on Prefill, the
    request failed on Decode). The next round must be byte-exact.
    """
    first = reqs("after")
    ids = ids_of(first)
    dproc.call("add", first)
    pproc.call("add", first, dproc.target())
    assert pproc.call("run", WAIT_S) == []
    finished = check_prefill(pproc.call("wait", ids, WAIT_S), None)
    dproc.call("wait", ids, WAIT_S)
    codes = {f.code for f in finished.values() if not f.ok}
    assert codes <= {ErrorCode.LEASE_EXPIRED}, finished
    settle(dproc, pproc, ids)
    if codes:
        failed = sum(not f.ok for f in finished.values())
        print(f"first round after restoring: {failed} requests past their lease; again")
        transfer_ok(dproc, pproc, reqs("after-retry"))


def settle(dproc: EngineProcess, pproc: EngineProcess, ids: list[str]) -> None:
    """Release the requests on both sides; both engines end clean, every gate open."""
    assert dproc.call("release", ids)
    pproc.call("release", ids)
    assert wait_until(lambda: all(pproc.call("state")["idle"]), WAIT_S), pproc.call("state")
    assert_clean(pproc.call("state"))
    assert_clean(dproc.call("state"))


def reads_done(dproc: EngineProcess) -> int:
    return sum(m["reads"] + m["read_failures"] for m in dproc.call("state")["metrics"])


# -- (a) the link cut for longer than a lease ---------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_link_cut_longer_than_a_lease(backend: str, hosts: TwoHosts) -> None:
    # Reads are slowed (100 ms each: 8 layers take 0.8 s) so the cut lands while the batch
    # is being moved; Decode gives up on a request after a lease without progress.
    decode = DecodeSpec(
        RING, backend=backend, read_delay_s=0.1, kv_load_timeout_s=LEASE_S, read_timeout_s=0.4
    )
    prefill = PrefillSpec(RING, backend=backend, lease_ms=LEASE_MS)
    with engines(hosts, decode, prefill) as (dproc, pproc):
        transfer_ok(dproc, pproc, reqs("before", 1))  # connections made, link proven
        cut = reqs("cut")
        ids = ids_of(cut)
        dproc.call("add", cut)
        pproc.call("add", cut, dproc.target())
        before = reads_done(dproc)
        pproc.call("start")
        assert wait_until(lambda: reads_done(dproc) > before, WAIT_S, step=0.005)
        hosts.set_link(False)
        cut_at = time.monotonic()
        bound = cut_at + LEASE_S + SLACK_S
        try:
            # Everything must be over while the link is still down.
            time.sleep(max(0.0, bound + 0.3 - time.monotonic()))
            p_finished = pproc.call("wait", ids, 0.0)
            d_results = dproc.call("wait", ids, 0.0)
            p_state = pproc.call("state")
        finally:
            hosts.set_link(True)
        restored_at = time.monotonic()
        finished = check_prefill(p_finished, bound)
        check_decode(d_results, bound)
        assert not all(f.ok for f in finished.values()), "the cut came after the transfer"
        assert all_gates_open(p_state), p_state["gates"]
        p_end = max(at for per_rank in p_finished.values() for _, at in per_rank)
        d_end = max(r.at for r in d_results.values())
        codes = sorted({f.code.name if f.code else "ok" for f in finished.values()})
        print(
            f"\n{backend}: link down {restored_at - cut_at:.2f} s (lease {LEASE_S:.1f} s); "
            f"all terminal {p_end - cut_at:.3f} s after the cut on Prefill ({', '.join(codes)}), "
            f"{d_end - cut_at:.3f} s on Decode; bound {LEASE_S + SLACK_S:.1f} s"
        )
        assert pproc.call("join", WAIT_S)
        # A read the cut left hanging in the engine must end before its destination blocks
        # may be reused (mooncake cannot cancel one): wait for that, then release.
        assert dproc.call("quiesce", WAIT_S)
        quiet_at = time.monotonic()
        settle(dproc, pproc, ids)
        # The link is back: new requests go through, byte-exact.
        transfer_ok_after_restore(dproc, pproc)
        print(
            f"{backend}: Decode's engine idle {quiet_at - restored_at:.2f} s after restoring; "
            f"new requests done {time.monotonic() - restored_at:.2f} s after restoring"
        )


# -- (b) a rate-limited link ------------------------------------------------------------------

RATE_MBIT = 100


@pytest.mark.parametrize("backend", BACKENDS)
def test_rate_limited_link(backend: str, hosts: TwoHosts) -> None:
    netns.require(need_tc=True)
    decode = DecodeSpec(BIG, backend=backend, kv_load_timeout_s=20.0, read_timeout_s=10.0)
    prefill = PrefillSpec(BIG, backend=backend, lease_ms=30_000)
    with engines(hosts, decode, prefill) as (dproc, pproc):
        transfer_ok(dproc, pproc, reqs("warm", 1))  # connections made before the clock runs
        hosts.limit(f"{RATE_MBIT}mbit", "128kb", "200ms")
        assert "tbf" in hosts.qdisc(hosts.prefill_ns, hosts.prefill_dev)
        requests = reqs("limited", 2, tokens=1024)
        ids = ids_of(requests)
        dproc.call("add", requests)
        pproc.call("add", requests, dproc.target())
        metrics_before = dproc.call("state")["metrics"][0]
        rx_before = rx_bytes(hosts)
        start = time.monotonic()
        assert pproc.call("run", WAIT_S * 2) == []
        results = dproc.call("wait", ids, WAIT_S * 2)
        wall = max(r.at for r in results.values()) - start
        check_decode(results, None)
        assert all(r.ok for r in results.values()), results
        metrics = dproc.call("state")["metrics"][0]
        moved = metrics["read_bytes"] - metrics_before["read_bytes"]
        read_s = metrics["read_s"] - metrics_before["read_s"]
        on_wire = rx_bytes(hosts) - rx_before
        settle(dproc, pproc, ids)
    rate = RATE_MBIT * 1e6 / 8  # bytes per second
    print(
        f"\n{backend}: tbf {RATE_MBIT} Mbit/s: {moved / 2**20:.1f} MiB of KV "
        f"({on_wire / 2**20:.1f} MiB on the wire) in {wall:.2f} s wall = "
        f"{moved * 8 / wall / 1e6:.1f} Mbit/s ({moved / wall / rate:.0%} of the rate); "
        f"over the read time {read_s:.2f} s: {moved * 8 / read_s / 1e6:.1f} Mbit/s"
    )
    assert on_wire >= moved, "the KV did not cross the link"
    # The limit holds (the token bucket's burst aside), so the bytes did go through it...
    assert moved <= rate * wall * 1.05 + 256 * 1024, "faster than the link allows"
    # ...and the link is used, not merely survived (a generous floor for loaded machines).
    assert moved >= rate * wall * 0.25, "far below the configured rate"


# -- (c) a Decode restarted behind the same address ---------------------------------------------


@pytest.mark.parametrize("grace", ["short", "long"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_restarted_behind_the_same_address(
    backend: str, grace: str, hosts: TwoHosts
) -> None:
    # Decode SIGKILLs itself as its 3rd read starts; a new Decode binds the same address
    # and port at once. With the short reconnect grace Prefill declares the connection lost
    # about when the new Decode comes up; with a long one ZMQ reconnects to the new process
    # within the grace, so Prefill's connection "comes back" to a Decode that never saw its
    # session while the old requests are still in flight (their lease is 3 s).
    lease_ms = 3000
    lease_s = lease_ms / 1000
    control = FAST_CONTROL
    if grace == "long":
        control = dataclasses.replace(FAST_CONTROL, reconnect_grace_s=10.0)
    prefill = PrefillSpec(
        RING, backend=backend, lease_ms=lease_ms, control=control,
        host=hosts.prefill_ip, netns=hosts.prefill_ns,
    )  # fmt: skip
    first = DecodeSpec(
        RING, backend=backend, read_delay_s=0.05, die_at_read=3,
        host=hosts.decode_ip, netns=hosts.decode_ns,
    )  # fmt: skip
    old = reqs("killed")
    ids = ids_of(old)
    with engine_process("prefill", prefill) as pproc:
        with engine_process("decode", first) as dproc:
            target = dproc.target()
            dproc.call("add", old)
            pproc.call("add", old, target)
            pproc.call("start")
            death = dproc.death(WAIT_S)
            assert death is not None, "Decode did not reach its 3rd read"
            killed_at = death[1]
            dproc.proc.join(5)
        second = dataclasses.replace(first, die_at_read=None, port=target.base_port)
        with engine_process("decode", second) as dproc:
            up_at = time.monotonic()
            assert dproc.target() == target
            # The old requests: terminal within the lease + 1 s of the kill.
            assert pproc.call("join", WAIT_S)
            per_rank = pproc.call("wait", ids, WAIT_S)
            finished = check_prefill(per_rank, killed_at + lease_s + SLACK_S)
            assert not any(f.ok for f in finished.values()), finished
            ended_at = max(at for results in per_rank.values() for _, at in results)
            # Their storage: a connection declared lost fails its requests at once, but a
            # dead peer's storage reopens only when the lease of what it was sent runs out
            # (it may still be reading), so the gates open within a lease of the end.
            gates_open = wait_until(
                lambda: all_gates_open(pproc.call("state")),
                ended_at + lease_s + SLACK_S - time.monotonic(),
            )
            assert gates_open, pproc.call("state")["gates"]
            pproc.call("release", ids)
            # New requests through the same Prefill, to the new Decode.
            transfer_ok(dproc, pproc, reqs("restarted"))
            metrics = pproc.call("state")["metrics"][0]
    codes = sorted({f.code.name for f in finished.values() if f.code})
    print(
        f"\n{backend}, {grace} grace: new Decode up {up_at - killed_at:.2f} s after the kill; "
        f"old requests terminal {ended_at - killed_at:.2f} s after it ({', '.join(codes)}; "
        f"lease {lease_s:.1f} s); Prefill reconnects {metrics['reconnects']}"
    )
    if grace == "long" and up_at < ended_at:
        # The new Decode was up while the old requests were in flight: Prefill's connection
        # came back to it within the grace.
        assert metrics["reconnects"] >= 1, metrics


# -- (d) rd2h check-read across the namespaces -------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_read_across_namespaces(backend: str, hosts: TwoHosts) -> None:
    size = 8 << 20
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "UCX_TLS": "tcp"}
    env.setdefault("UCX_MODULES", "^ib")

    def check_read(ns: str, dev: str, *args: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "rd2h_app.cli", "check-read", "--backend", backend,
                "--size", str(size), "--timeout", "40", *args]  # fmt: skip
        return subprocess.Popen(
            hosts.command(ns, argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "UCX_NET_DEVICES": dev},
        )

    rx_before = rx_bytes(hosts)
    prefill = check_read(
        hosts.prefill_ns, hosts.prefill_dev, "--role", "prefill", "--host", hosts.prefill_ip
    )
    lines: queue.Queue[str | None] = queue.Queue()
    p_out: list[str] = []

    def pump() -> None:
        assert prefill.stdout is not None
        for line in prefill.stdout:
            p_out.append(line.rstrip("\n"))
            lines.put(line)
        lines.put(None)

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()

    def both() -> str:
        """Both sides' whole output (a list would be cut short in a failure report)."""
        pumping.join(5)  # Prefill's last lines
        return "\n".join(["Prefill:", *p_out, "Decode:", d_out])

    decode: subprocess.Popen[str] | None = None
    d_out = ""
    try:
        endpoint = ""
        deadline = time.monotonic() + 40
        while not endpoint and time.monotonic() < deadline:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"Prefill exited: {p_out}"
            if line.startswith("CONTROL "):
                endpoint = line.split()[1]
        assert endpoint.startswith(f"tcp://{hosts.prefill_ip}:"), endpoint
        port = endpoint.rsplit(":", 1)[1]
        decode = check_read(
            hosts.decode_ns, hosts.decode_dev,
            "--role", "decode", "--host", hosts.prefill_ip, "--port", port,
        )  # fmt: skip
        d_out, _ = decode.communicate(timeout=45)
        assert prefill.wait(15) == 0, both()
    finally:
        for proc in (decode, prefill):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(5)
    d_lines = d_out.strip().splitlines()
    shown = [line for line in d_lines if not line.startswith("RESULT ")][-3:]
    print("\n" + "\n".join(f"{backend} check-read, Decode: {line}" for line in shown))
    assert decode.returncode == 0, both()
    assert d_lines[-1].startswith(f"PASS: {backend}: {size} bytes verified"), both()
    assert p_out[-1].startswith("PASS: Decode reported"), both()
    assert rx_bytes(hosts) - rx_before >= size, "the check's bytes did not cross the link"


# -- the namespaces themselves -------------------------------------------------------------------


def test_namespaces_are_removed_when_a_test_fails() -> None:
    with pytest.raises(RuntimeError, match="boom"), two_hosts() as made:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert made.prefill_ns in listed and made.decode_ns in listed
        raise RuntimeError("boom")
    assert not leftovers()


def test_without_root_fails_in_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="need root"):
        netns.require()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="need root"):
        netns.require()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(pytest.skip.Exception, match=r"`ip` .* not installed"):
        netns.require()
