"""Faults on real sockets. Each ends with every Prefill gate open and every request
terminal on both sides within the lease + 1 s of the fault, a Decode "done" only for
requests whose every byte is right, no dead thread and no residual state.

Killed processes use nixl between child processes (SIGKILL, no cleanup); the rest run
both engines in this process on the loopback backend, with a ZMQ relay between them that
drops, duplicates or delays frames, or raw sockets that send malformed frames."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgpack
import pytest
import zmq

from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.producer import DecodeTarget
from rd2h_runtime.testing.child_engines import engine_process
from rd2h_runtime.testing.engines import (
    FAST_CONTROL,
    HOST,
    DecodeEngine,
    DecodeResult,
    DecodeSpec,
    PrefillEngine,
    PrefillSpec,
)
from rd2h_runtime.testing.synthetic import RequestSpec, SyntheticModel
from tests.runtime.e2e_harness import (
    Relay,
    all_gates_open,
    assert_clean,
    describe,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

RING = SyntheticModel(num_layers=8, num_buffers=3)
FLAT = SyntheticModel(num_layers=4)
LEASE_MS = 1000
LEASE_S = LEASE_MS / 1000
SLACK_S = 1.0  # "within the lease + 1 s"
WAIT_S = 15.0


def reqs(prefix: str, n: int = 3) -> list[RequestSpec]:
    return [RequestSpec(f"{prefix}-{i}", 90 + 70 * i) for i in range(n)]


def packb(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


Finished = dict[str, list[Any]]


def check_prefill(finished: Finished, deadline: float | None) -> dict[str, Any]:
    """Every request finished on every rank (by ``deadline``); returns {ext: first result}."""
    out = {}
    for ext, per_rank in finished.items():
        assert all(f is not None for f in per_rank), f"{ext} not finished on Prefill: {per_rank}"
        if deadline is not None:
            late = [at for _, at in per_rank if at > deadline]
            assert not late, f"{ext} finished {max(late) - deadline:.2f} s after the bound"
        out[ext] = per_rank[0][0]
    return out


def check_decode(results: dict[str, DecodeResult], deadline: float | None) -> None:
    """Every request terminal on every Decode rank (by ``deadline``); good bytes if done."""
    for ext, res in results.items():
        assert res.terminal, f"{ext} not terminal on Decode: {res}"
        if deadline is not None:
            assert res.at <= deadline, f"{ext} ended {res.at - deadline:.2f} s after the bound"
        if res.ok:
            assert res.mismatches == (), f"{ext} reported done with wrong bytes: {res}"


class Local:
    """Both engines in this process; Prefill reaches Decode directly or through a relay."""

    def __init__(
        self,
        prefill: PrefillSpec,
        decode: DecodeSpec,
        policy: Callable[[str, bytes], Sequence[float]] | None = None,
    ) -> None:
        self.stack = contextlib.ExitStack()
        self.decode = DecodeEngine(decode)
        self.stack.callback(self.decode.close)
        self.relay: Relay | None = None
        port = self.decode.base_port
        if policy is not None:
            self.relay = Relay(port, policy)
            self.stack.callback(self.relay.close)
            port = self.relay.port
        self.target = DecodeTarget(HOST, port, decode.d_tp)
        self.prefill = PrefillEngine(prefill)
        self.stack.callback(self.prefill.close)

    def add(self, decode_reqs: list[RequestSpec], prefill_reqs: list[RequestSpec]) -> None:
        self.decode.add(decode_reqs)
        self.prefill.add(prefill_reqs, self.target)

    def finish(self, ids: list[str]) -> None:
        """Release everything on Decode and check both engines are clean."""
        assert self.decode.release([i for i in ids if i in self.decode.ids])
        assert wait_until(lambda: all(self.prefill.state()["idle"]), WAIT_S)
        assert_clean(self.decode.state())
        assert_clean(self.prefill.state())


@pytest.fixture
def local() -> Iterator[list[Local]]:
    made: list[Local] = []
    yield made
    for item in made:
        item.stack.close()


# -- killed processes ------------------------------------------------------------------------


def test_decode_killed_mid_layer() -> None:
    # Decode dies as its 3rd read starts (layer 2 of 8, over a 3-buffer ring): Prefill's
    # leases expire, ABORTs go nowhere, the gates reopen and the compute path runs on.
    requests = reqs("kd")
    ids = [r.ext_id for r in requests]
    with (
        engine_process(
            "decode", DecodeSpec(RING, backend="nixl", read_delay_s=0.05, die_at_read=3)
        ) as dproc,
        engine_process("prefill", PrefillSpec(RING, backend="nixl", lease_ms=LEASE_MS)) as pproc,
    ):
        dproc.call("add", requests)
        pproc.call("add", requests, dproc.target())
        pproc.call("start")
        death = dproc.death(WAIT_S)
        assert death is not None, "Decode did not reach its 3rd read"
        assert pproc.call("join", WAIT_S)
        finished = check_prefill(pproc.call("wait", ids, WAIT_S), death[1] + LEASE_S + SLACK_S)
        assert all(not f.ok for f in finished.values()), finished
        # The lease ran out, or the broken connection was noticed first.
        codes = {f.code for f in finished.values()}
        assert codes <= {ErrorCode.LEASE_EXPIRED, ErrorCode.CONNECTION_LOST}, codes
        state = pproc.call("state")
        assert_clean(state)
        stats = state["stats"][0]
        assert stats["expired_leases"] + stats["connections_lost"] >= 1, stats


def test_prefill_killed_mid_layer() -> None:
    # Prefill dies right after publishing layer 1 of 4: the final layer never comes, so
    # Decode fails every request when its KV load times out (set to the lease).
    requests = reqs("kp")
    ids = [r.ext_id for r in requests]
    decode = DecodeSpec(FLAT, backend="nixl", kv_load_timeout_s=LEASE_S, read_timeout_s=0.4)
    prefill = PrefillSpec(FLAT, backend="nixl", lease_ms=LEASE_MS, die_after_layer=(0, 1))
    with engine_process("decode", decode) as dproc, engine_process("prefill", prefill) as pproc:
        dproc.call("add", requests)
        pproc.call("add", requests, dproc.target())
        pproc.post("start")  # it may die before it can answer
        death = pproc.death(WAIT_S)
        assert death is not None
        results = dproc.call("wait", ids, WAIT_S)
        check_decode(results, death[1] + LEASE_S + SLACK_S)
        assert not any(r.ok for r in results.values())
        assert dproc.call("release", ids)
        assert_clean(dproc.call("state"))


def test_decode_stalled_past_the_heartbeat_timeout_carries_on() -> None:
    # A loaded machine can stall a whole Decode process longer than the heartbeat timeout
    # (seen with vLLM servers on 2 cores). Prefill's heartbeat then drops the connection,
    # but ZMQ reconnects once Decode runs again, within the reconnect grace: the transfer
    # that was in flight finishes, every byte right, and nothing is declared lost.
    control = dataclasses.replace(FAST_CONTROL, reconnect_grace_s=10.0)
    stall_s = 3 * control.heartbeat_timeout_s
    warm, stalled = reqs("warm", 1), reqs("stall")
    ids = [r.ext_id for r in stalled]
    decode = DecodeSpec(RING, backend="nixl", read_delay_s=0.05, control=control)
    prefill = PrefillSpec(RING, backend="nixl", lease_ms=30_000, control=control)
    with engine_process("decode", decode) as dproc, engine_process("prefill", prefill) as pproc:
        # A first request shakes hands.
        dproc.call("add", warm)
        pproc.call("add", warm, dproc.target())
        assert pproc.call("run", WAIT_S) == []
        assert all(r.ok for r in dproc.call("wait", [warm[0].ext_id], WAIT_S).values())
        assert dproc.call("release", [warm[0].ext_id])
        pproc.call("release", [warm[0].ext_id])
        # Stop Decode while the others are in flight.
        dproc.call("add", stalled)
        pproc.call("add", stalled, dproc.target())
        pproc.call("start")
        time.sleep(0.2)
        os.kill(dproc.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(stall_s)
        finally:
            os.kill(dproc.proc.pid, signal.SIGCONT)
        assert pproc.call("join", WAIT_S)
        finished = check_prefill(pproc.call("wait", ids, WAIT_S), None)
        assert all(f.ok for f in finished.values()), finished
        results = dproc.call("wait", ids, WAIT_S)
        check_decode(results, None)
        assert all(r.ok for r in results.values()), results
        state = pproc.call("state")
        metrics = state["metrics"][0]
        assert metrics["disconnects"] >= 1, metrics  # the heartbeat did drop the connection
        assert metrics["reconnects"] >= 1, metrics
        assert state["stats"][0]["connections_lost"] == 0, state["stats"][0]
        assert dproc.call("release", ids)


# -- lost, repeated and late replies ------------------------------------------------------------


class ReplyFault:
    """A relay policy: passes everything except the replies it was told to mangle."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.fault_at: float | None = None
        self._seen = 0

    def __call__(self, direction: str, payload: bytes) -> Sequence[float]:
        msg = describe(payload)
        if direction != "down" or msg[0] not in (b"read_done", b"read_failed"):
            return [0.0]
        if self.mode == "duplicate":
            return [0.0, 0.0]
        if self.mode == "delay_short":
            return [0.3 * LEASE_S]
        if msg[1] != 1:  # the others mangle the first reply for layer 1 only
            return [0.0]
        self._seen += 1
        if self._seen > 1:
            return [0.0]
        self.fault_at = time.monotonic()
        if self.mode == "drop":
            return []
        assert self.mode == "delay_long"
        return [LEASE_S + 0.5]


@pytest.mark.parametrize("mode", ["drop", "duplicate", "delay_short", "delay_long"])
def test_lost_repeated_and_late_replies(mode: str, local: list[Local]) -> None:
    fault = ReplyFault(mode)
    pair = Local(
        PrefillSpec(RING, lease_ms=LEASE_MS),
        DecodeSpec(RING, read_delay_s=0.01),
        policy=fault,
    )
    local.append(pair)
    requests = reqs(mode)
    ids = [r.ext_id for r in requests]
    pair.add(requests, requests)
    assert pair.prefill.run(WAIT_S) == []
    bound = None if fault.fault_at is None else fault.fault_at + LEASE_S + SLACK_S
    finished = check_prefill(pair.prefill.wait(ids, WAIT_S), bound)
    results = pair.decode.wait(ids, WAIT_S)
    check_decode(results, bound)
    stats = pair.prefill.state()["stats"][0]
    if mode in ("duplicate", "delay_short"):
        assert all(f.ok for f in finished.values()), finished
        assert all(r.ok for r in results.values()), results
        if mode == "duplicate":
            # The second copy of the last reply may still be in flight when the requests
            # finish (the first copy finished them): wait for it.
            assert wait_until(
                lambda: pair.prefill.state()["stats"][0]["duplicate_replies"] == RING.num_layers,
                WAIT_S,
            ), pair.prefill.state()["stats"][0]
    else:
        assert fault.fault_at is not None
        assert stats["expired_leases"] == 1, stats
        assert all(f.code == ErrorCode.LEASE_EXPIRED for f in finished.values()), finished
        if mode == "delay_long":
            # The late reply arrives after the lease ended: ignored, counted.
            assert wait_until(
                lambda: (
                    pair.prefill.state()["stats"][0]["stale_replies"]
                    + pair.prefill.state()["stats"][0]["duplicate_replies"]
                    == 1
                ),
                WAIT_S,
            )
    pair.finish(ids)


# -- malformed frames, unknown requests, layouts ------------------------------------------------


def test_malformed_frames_to_decode_are_counted_and_answered_when_identifiable(
    local: list[Local],
) -> None:
    pair = Local(PrefillSpec(FLAT, lease_ms=LEASE_MS), DecodeSpec(FLAT))
    local.append(pair)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(f"tcp://{HOST}:{pair.decode.base_port}")
        name = FLAT.layer_name(0)
        sock.send(b"\xc1\xc1\xc1")  # not msgpack
        sock.send(packb((b"no_such_kind", 1)))
        sock.send_multipart([b"two", b"frames"])  # framing: dropped by the ROUTER
        # A readiness whose layer and seq can be read still gets its failure reply.
        sock.send(packb((b"read_ready_batch", 3, name, "not a list", [], 0, 1, 41)))
        reply = describe(sock.recv_multipart()[-1])
        assert reply[:2] == (b"read_failed", 3) and reply[3] == 41
        # A well-formed readiness before any handshake: UNKNOWN_SESSION, echoing the seq.
        sock.send(packb((b"read_ready_batch", 0, name, [], [], 0, 1, 42)))
        reply = describe(sock.recv_multipart()[-1])
        assert reply[:2] == (b"read_failed", 0)
        assert reply[3:] == (42, ErrorCode.UNKNOWN_SESSION)
    finally:
        sock.close(0)
        ctx.term()
    stats = pair.decode.state()["stats"][0]
    assert stats["malformed_frames"] == 3 and stats["unknown_session"] == 1, stats
    assert pair.decode.state()["metrics"][0]["handler_errors"] == 0
    # The same Decode still serves a real Prefill, byte for byte.
    requests = reqs("after")
    ids = [r.ext_id for r in requests]
    pair.add(requests, requests)
    assert pair.prefill.run(WAIT_S) == []
    assert all(f.ok for f in check_prefill(pair.prefill.wait(ids, WAIT_S), None).values())
    results = pair.decode.wait(ids, WAIT_S)
    check_decode(results, None)
    assert all(r.ok for r in results.values())
    pair.finish(ids)


@pytest.mark.parametrize("peer", ["v2", "v1"])
def test_malformed_replies_to_prefill_are_ignored_and_the_lease_frees_the_gates(
    peer: str,
) -> None:
    # A fake Decode: a raw ROUTER that acknowledges the handshake, then answers every
    # readiness with garbage only. Prefill counts it all and fails the requests when the
    # leases run out. A v2 peer is sent ABORT first, so the gates reopen then; a v1 peer
    # cannot be told, so its storage stays closed until it is gone (here: it closes its
    # socket and the connection breaks).
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port(f"tcp://{HOST}")
    prefill = PrefillEngine(PrefillSpec(FLAT, lease_ms=LEASE_MS))
    try:
        requests = reqs(f"garbage-{peer}")
        ids = [r.ext_id for r in requests]
        prefill.add(requests, DecodeTarget(HOST, port, 1))
        prefill.start()
        garbage = [
            b"\xc1",
            packb((b"read_done",)),
            packb((b"read_done", "one")),
            packb((b"read_done", 99, 12345)),  # well-formed, answers nothing we sent
            packb((b"ack", 2, ["seq"])),  # a second handshake reply out of turn
        ]
        ack = b"ACK" if peer == "v1" else packb((b"ack", 2, ["seq", "lease", "abort"]))
        first_readiness: float | None = None
        replied = 0
        deadline = time.monotonic() + WAIT_S
        while replied < FLAT.num_layers and time.monotonic() < deadline:
            if not router.poll(100):
                continue
            ident, payload = router.recv_multipart()
            msg = describe(payload)
            if msg[0] == b"mf_meta":
                router.send_multipart([ident, b"", ack])
            elif msg[0] == b"read_ready_batch":
                first_readiness = first_readiness or time.monotonic()
                for frame in garbage:
                    router.send_multipart([ident, b"", frame])
                replied += 1
        assert first_readiness is not None
        assert prefill.join(WAIT_S)
        bound = first_readiness + LEASE_S + SLACK_S
        finished = check_prefill(prefill.wait(ids, WAIT_S), bound)
        assert all(f.code == ErrorCode.LEASE_EXPIRED for f in finished.values())
        stats = prefill.state()["stats"][0]
        assert stats["malformed_frames"] >= 3 * FLAT.num_layers, stats
        assert stats["unknown_replies"] >= FLAT.num_layers, stats
        if peer == "v1":
            # Never answered, never told: it might still be reading, the gates must hold.
            assert not all_gates_open(prefill.state())
            # Once its connection is gone for good (not back within the grace), they open.
            router.close(0)
            gone = time.monotonic()
            bound_s = FAST_CONTROL.reconnect_grace_s + SLACK_S
            assert wait_until(lambda: all_gates_open(prefill.state()), bound_s), prefill.state()
            assert time.monotonic() - gone <= bound_s
        else:
            assert wait_until(lambda: all_gates_open(prefill.state()), bound - time.monotonic())
            aborts = []
            while router.poll(100):
                aborts.append(describe(router.recv_multipart()[-1]))
            assert any(a[0] == b"abort" for a in aborts), aborts
        assert_clean(prefill.state())
    finally:
        prefill.close()
        router.close(0)
        ctx.term()


def test_unknown_request_is_isolated_and_the_others_are_read(local: list[Local]) -> None:
    pair = Local(PrefillSpec(FLAT, lease_ms=LEASE_MS), DecodeSpec(FLAT, park_timeout_s=0.2))
    local.append(pair)
    known = reqs("known", 2)
    ghost = RequestSpec("ghost", 100)
    pair.add(known, [*known, ghost])
    start = time.monotonic()
    assert pair.prefill.run(WAIT_S) == []
    bound = start + LEASE_S + SLACK_S
    finished = check_prefill(pair.prefill.wait([r.ext_id for r in [*known, ghost]], WAIT_S), bound)
    assert not finished["ghost"].ok and finished["ghost"].code == ErrorCode.UNKNOWN_REQUEST
    assert all(finished[r.ext_id].ok for r in known), finished
    results = pair.decode.wait([r.ext_id for r in known], WAIT_S)
    check_decode(results, bound)
    assert all(r.ok for r in results.values())
    assert pair.decode.state()["stats"][0]["isolated_requests"] >= 1
    pair.finish([r.ext_id for r in known])


@pytest.mark.parametrize("kind", ["layout", "compat"])
def test_layout_mismatch_fails_the_requests_cleanly(kind: str, local: list[Local]) -> None:
    if kind == "layout":
        # Layer 1's destination has no LIC8 scale while Prefill's layout has one.
        decode = DecodeSpec(FLAT, mismatch_layer=1, kv_load_timeout_s=LEASE_S)
        prefill = PrefillSpec(FLAT, lease_ms=LEASE_MS)
        code = ErrorCode.LAYOUT_MISMATCH
    else:
        decode = DecodeSpec(FLAT, compat="model-a", kv_load_timeout_s=LEASE_S)
        prefill = PrefillSpec(FLAT, compat="model-b", lease_ms=LEASE_MS)
        code = ErrorCode.INCOMPATIBLE
    pair = Local(prefill, decode)
    local.append(pair)
    requests = reqs(kind)
    ids = [r.ext_id for r in requests]
    pair.add(requests, requests)
    start = time.monotonic()
    assert pair.prefill.run(WAIT_S) == []
    bound = start + LEASE_S + SLACK_S
    finished = check_prefill(pair.prefill.wait(ids, WAIT_S), bound)
    assert {f.code for f in finished.values()} == {code}, finished
    results = pair.decode.wait(ids, WAIT_S)
    check_decode(results, bound)
    assert not any(r.ok for r in results.values())
    if kind == "layout":
        assert {r.codes for r in results.values()} == {("LAYOUT_MISMATCH",)}
    else:  # the handshake was refused: nothing ever came, the KV load timed out
        assert {r.codes for r in results.values()} == {("TIMEOUT",)}
    pair.finish(ids)
