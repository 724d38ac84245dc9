"""A hostile Prefill peer against a real Decode process: memory and a healthy peer's rounds.

A Decode worker runs in a child process (so its RSS is its own) on 127.0.0.1 at a run-time
port, with the default control options (ZMQ's queue bounded to one frame per peer:
``ControlOptions.peer_queued_frames``). This process runs a healthy Prefill worker, and a
third process one hostile DEALER that floods the Decode with one probe of the set:

- ``parked``: readiness frames of 16,384 unknown request ids each (parked by Decode);
- ``oversized``: frames one byte over the wire's limit (ZMQ_MAXMSGSIZE cuts them off);
- ``huge``: readiness frames of ~15 MB (7 requests of 1 M block ids, twice): within the
  wire's frame size, over its bound on block ids per readiness
  (``MAX_BLOCK_IDS_PER_READINESS``), so Decode refuses each from its list headers;
- ``churn``: handshakes of 4,096 layers, each with a new session;
- ``unknown_layers``: readiness frames for layers Decode does not have.

For each probe it prints the healthy peer's round trip (Decode ``add_request`` to its layer
read and the Prefill's storage writable again) quiet and during the flood, as medians and
their ratio, whether every round succeeded, and the child's peak RSS over its quiet RSS.

    python -m benchmarks.bench_hostile [--seconds 3] [--rounds 20] [--probe parked ...] [--pin]
    python -m benchmarks.bench_hostile --v1-liveness 500 --lease-ms 1000

The second measures how soon a live Decode speaking v1 acknowledges a layer, the figure
behind the default silent-peer window (``ProducerConfig.silent_peer_timeout_s``).

``tests/runtime/test_decode_flood.py`` runs the same machinery, shorter, with assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from benchmarks.bench_control_plane import NoopBackend
from rd2h_protocol.consumer import ConsumerConfig
from rd2h_protocol.producer import DecodeTarget, ProducerConfig
from rd2h_protocol.producer.config import ProtocolChoice
from rd2h_protocol.wire.codec import encode
from rd2h_protocol.wire.layout import (
    ComponentDest,
    DestinationLayout,
    LayerLayout,
    encode_layer_metadata,
)
from rd2h_protocol.wire.messages import (
    ALL_CAPABILITIES,
    MAX_BLOCKS_PER_REQUEST,
    MAX_FRAME_BYTES,
    MAX_REQUESTS_PER_BATCH,
    MfMeta,
    ReadReadyBatch,
    ReadReq,
)
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.prefill import PrefillWorker

HOST = "127.0.0.1"
LAYER = "model.layers.0.self_attn"
BLOCKS = 64
PROBES = ("parked", "oversized", "huge", "churn", "unknown_layers")
MiB = 1 << 20


def source_layout() -> LayerLayout:
    return LayerLayout(
        base_addrs=[0x1000_0000, 0x2000_0000],
        block_len=[64, 64],
        tensor_group_idx=[0, 0],
        num_blocks=BLOCKS,
    )


# -- the Decode child: JSON lines on stdin/stdout ---------------------------------------------


def _child() -> None:
    dest = DestinationLayout(
        main=(ComponentDest(0x5000_0000, 64, BLOCKS), ComponentDest(0x6000_0000, 64, BLOCKS)),
        indexer=None,
        scale=None,
    )
    config = ConsumerConfig(d_rank=0, d_tp=1, layers=[(LAYER, dest)])
    decode = DecodeWorker(config, NoopBackend(role="decode"), host=HOST)
    out = sys.stdout
    out.write(json.dumps({"port": decode.port, "pid": os.getpid()}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            reply: dict[str, Any] = {}
            if op == "add":
                decode.add_request(cmd["ext"], cmd["blocks"], [])
            elif op == "wait":
                outcome = decode.wait_finished(cmd["ext"], cmd["timeout"])
                reply = {
                    "ok": outcome is not None and outcome.ok,
                    "detail": repr(outcome) if outcome is not None else "timeout",
                }
            elif op == "release":
                reply = {"released": decode.release(cmd["ext"])}
            elif op == "stats":
                s = decode.control_stats
                reply = {
                    "frames_in": s.frames_in,
                    "dropped_over_budget": getattr(s, "dropped_over_budget", 0),
                    "healthy": decode.healthy,
                }
            elif op == "quit":
                break
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        decode.close()


# With --pin: the Decode child gets CPU 0 to itself; this process and the flooder share the
# others (a hostile peer on another host does not take the Decode's CPU).
_DECODE_CPUS: set[int] | None = None


def _pinned(argv: list[str], cpus: set[int] | None) -> list[str]:
    if cpus is None:
        return argv
    return ["taskset", "-c", ",".join(map(str, sorted(cpus))), *argv]


def pin(decode_cpus: set[int]) -> None:
    """Run the Decode child on ``decode_cpus`` and this process on the others."""
    global _DECODE_CPUS
    _DECODE_CPUS = decode_cpus
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)) - decode_cpus)


class DecodeChild:
    """The Decode child process and its command pipe."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            _pinned(
                [sys.executable, "-m", "benchmarks.bench_hostile", "--decode-child"],
                _DECODE_CPUS,
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        hello = self._line()
        self.port: int = hello["port"]
        self.pid: int = hello["pid"]
        self._lock = threading.Lock()

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the Decode child exited ({self.proc.wait(5)})")
        result: dict[str, Any] = json.loads(line)
        return result

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
            return self._line()

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


# -- the probes ---------------------------------------------------------------------------------


def _handshake(session: str, layouts: dict[str, LayerLayout] | None = None) -> bytes:
    return encode(
        MfMeta(
            p_session=session,
            encoded_layer_metadata=encode_layer_metadata(layouts or {LAYER: source_layout()}),
            protocol_version=2,
            capabilities=list(ALL_CAPABILITIES),
            first_seq=1,
        )
    )


def _readiness(seq: int, reqs: list[ReadReq], layer: str = LAYER) -> bytes:
    return encode(
        ReadReadyBatch(layer_idx=0, layer_name=layer, read_reqs=reqs, seq=seq, lease_ms=30_000)
    )


def probe_frames(probe: str) -> Callable[[int], list[bytes]]:
    """``probe``'s frame source: ``frames(i)`` gives the frames of its i-th step (the first
    step starts with a handshake where the probe needs a session)."""
    if probe == "parked":

        def parked(i: int) -> list[bytes]:
            reqs = [ReadReq(f"u{i}-{j}", [j % BLOCKS]) for j in range(MAX_REQUESTS_PER_BATCH)]
            head = [_handshake("hostile-parked")] if i == 0 else []
            return [*head, _readiness(i + 1, reqs)]

        return parked
    if probe == "oversized":
        big = b"\x93" + b"x" * MAX_FRAME_BYTES
        return lambda i: [big]
    if probe == "huge":
        ids = [j % BLOCKS for j in range(MAX_BLOCKS_PER_REQUEST)]  # one byte each
        reqs = [ReadReq(f"h{j}", ids, ids) for j in range(7)]
        frame = _readiness(1, reqs)
        assert len(frame) <= MAX_FRAME_BYTES, len(frame)

        def huge(i: int) -> list[bytes]:
            head = [_handshake("hostile-huge")] if i == 0 else []
            return [*head, _readiness(i + 1, reqs) if i else frame]

        return huge
    if probe == "churn":
        layouts = {f"model.layers.{n}.self_attn": source_layout() for n in range(4096)}
        blob = encode_layer_metadata(layouts)

        def churn(i: int) -> list[bytes]:
            return [
                encode(
                    MfMeta(
                        p_session=f"hostile-churn-{i}",
                        encoded_layer_metadata=blob,
                        protocol_version=2,
                        capabilities=list(ALL_CAPABILITIES),
                        first_seq=1,
                    )
                )
            ]

        return churn
    if probe == "unknown_layers":

        def unknown(i: int) -> list[bytes]:
            reqs = [ReadReq(f"l{i}-{j}", [1]) for j in range(1024)]
            head = [_handshake("hostile-layers")] if i == 0 else []
            return [*head, _readiness(i + 1, reqs, layer=f"model.layers.{1000 + i}.mlp")]

        return unknown
    raise ValueError(f"unknown probe {probe!r}; the probes are {', '.join(PROBES)}")


class Flooder:
    """One hostile DEALER, in a process of its own (a hostile peer is another host: on a
    thread here it would take this process's GIL from the healthy Prefill), sending
    ``probe``'s frames as fast as ZMQ takes them until the context exits."""

    def __init__(self, port: int, probe: str) -> None:
        self._args = [
            sys.executable,
            "-m",
            "benchmarks.bench_hostile",
            "--flood-child",
            probe,
            str(port),
        ]
        self._proc: subprocess.Popen[str] | None = None
        self.sent = 0
        self.sent_bytes = 0

    def __enter__(self) -> Flooder:
        self._proc = subprocess.Popen(
            self._args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != "flooding":
            raise RuntimeError(f"the flooder exited ({self._proc.wait(5)})")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            out, _ = self._proc.communicate("stop\n", timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate(timeout=5)
        if out.strip():
            counts = json.loads(out.strip().splitlines()[-1])
            self.sent, self.sent_bytes = counts["sent"], counts["sent_bytes"]


def _flood_child(probe: str, port: int) -> None:
    """The flooder's process: send until a line arrives on stdin, then print the counts."""
    frames = probe_frames(probe)
    stop = threading.Event()

    def wait_for_stop() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=wait_for_stop, daemon=True).start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"hostile")
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 10)
    sock.connect(f"tcp://{HOST}:{port}")
    print("flooding", flush=True)
    sent = sent_bytes = i = 0
    try:
        while not stop.is_set():
            for frame in frames(i):
                while not stop.is_set():
                    try:
                        sock.send(frame, zmq.NOBLOCK, copy=False)
                        break
                    except zmq.Again:
                        time.sleep(0.001)
                sent += 1
                sent_bytes += len(frame)
            with contextlib.suppress(zmq.Again):  # replies: read and forget
                while True:
                    sock.recv(zmq.NOBLOCK)
            i += 1
    finally:
        sock.close(0)
        ctx.term()
    print(json.dumps({"sent": sent, "sent_bytes": sent_bytes}), flush=True)


# -- one measurement ------------------------------------------------------------------------------


@dataclass
class ProbeResult:
    probe: str
    quiet_s: list[float]
    flood_s: list[float]
    failures: list[str]
    quiet_rss: int
    peak_rss: int
    sent: int = 0
    sent_bytes: int = 0
    dropped: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def rss_over_mb(self) -> float:
        return (self.peak_rss - self.quiet_rss) / 1e6

    @property
    def added_ms(self) -> float:
        """Median round trip during the flood minus the quiet median, in milliseconds."""
        return 1000 * (statistics.median(self.flood_s) - statistics.median(self.quiet_s))


class Pair:
    """The Decode child and a healthy in-process Prefill worker."""

    def __init__(self, lease_ms: int = 2_000, protocol: ProtocolChoice = "v2") -> None:
        self.child = DecodeChild()
        config = ProducerConfig(
            p_rank=0,
            p_tp=1,
            session="",
            layers=[(LAYER, source_layout())],
            lease_ms=lease_ms,
            protocol=protocol,
        )
        self.prefill = PrefillWorker(config, NoopBackend(role="prefill"))
        self._n = 0

    def close(self) -> None:
        self.prefill.close()
        self.child.close()

    def round(self, timeout: float = 5.0) -> tuple[float, str | None]:
        """One healthy request of one layer; (seconds, None) or (seconds, what failed)."""
        self._n += 1
        ext = f"good-{self._n}"
        blocks = [(2 * self._n) % BLOCKS, (2 * self._n + 1) % BLOCKS]
        start = time.monotonic()
        self.child.call("add", ext=ext, blocks=blocks)
        self.prefill.add_request(ext, DecodeTarget(HOST, self.child.port, 1))
        self.prefill.schedule_chunk(ext, blocks, [], 0, 0, True)
        self.prefill.layer_written(0)
        self.prefill.end_step()
        done = self.child.call("wait", ext=ext, timeout=timeout)
        writable = self.prefill.wait_writable(0, timeout)
        finished = self.prefill.wait_finished(ext, timeout)
        took = time.monotonic() - start
        self.child.call("release", ext=ext)
        if not done["ok"]:
            return took, f"Decode: {done['detail']}"
        if finished is None or not finished.ok:
            return took, f"Prefill: {finished!r}"
        if not writable:
            return took, "Prefill: storage not writable again"
        return took, None


@contextlib.contextmanager
def sampling(pid_rss: Callable[[], int], every_s: float = 0.005) -> Iterator[list[int]]:
    """Sample an RSS source on a thread; yields the list whose max is the peak."""
    samples: list[int] = [pid_rss()]
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            samples.append(pid_rss())
            stop.wait(every_s)

    t = threading.Thread(target=run, name="rss-sampler", daemon=True)
    t.start()
    try:
        yield samples
    finally:
        stop.set()
        t.join(5)
        samples.append(pid_rss())


def settle(pair: Pair, timeout: float = 20.0) -> None:
    """Wait until the Decode child has worked off a flood's backlog (up to its peers'
    ``peer_backlog_s`` of handler time): its RSS stops moving and a healthy round is fast
    again, so the next probe's quiet rounds are quiet."""
    deadline = time.monotonic() + timeout
    last = pair.child.rss()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = pair.child.rss()
        if abs(now - last) < MiB and pair.round()[0] < 0.010:
            return
        last = now


def measure(
    pair: Pair, probe: str, *, seconds: float, rounds: int, quiet_rounds: int
) -> ProbeResult:
    """Quiet rounds, then ``probe`` flooding for at least ``seconds`` while ``rounds``
    healthy rounds run; the child's peak RSS during the flood over its RSS just before."""
    quiet = [pair.round()[0] for _ in range(quiet_rounds)]
    quiet_rss = pair.child.rss()
    flood: list[float] = []
    failures: list[str] = []
    before = pair.child.call("stats")
    with sampling(pair.child.rss) as samples, Flooder(pair.child.port, probe) as flooder:
        start = time.monotonic()
        time.sleep(min(0.3, seconds / 4))  # let the flood build up first
        while len(flood) < rounds or time.monotonic() - start < seconds:
            took, failed = pair.round()
            flood.append(took)
            if failed is not None:
                failures.append(failed)
            if time.monotonic() - start > 4 * seconds + 30:
                break
    sent, sent_bytes = flooder.sent, flooder.sent_bytes  # counted when the flooder stopped
    after = pair.child.call("stats")
    settle(pair)
    return ProbeResult(
        probe,
        quiet,
        flood,
        failures,
        quiet_rss,
        max(samples),
        sent,
        sent_bytes,
        after["dropped_over_budget"] - before["dropped_over_budget"],
    )


def report(r: ProbeResult) -> str:
    q, f = statistics.median(r.quiet_s), statistics.median(r.flood_s)
    return (
        f"{r.probe:15s} round trip quiet {1000 * q:7.1f} ms  flood median {1000 * f:7.1f} ms "
        f"(x{f / q:5.2f}, +{r.added_ms:6.1f} ms) max {1000 * max(r.flood_s):7.1f} ms  "
        f"ok {len(r.flood_s) - len(r.failures)}/{len(r.flood_s)}  "
        f"RSS +{r.rss_over_mb:6.1f} MB over quiet  sent {r.sent} frames "
        f"{r.sent_bytes / 1e6:.0f} MB, dropped over budget {r.dropped}"
    )


def v1_liveness(rounds: int, lease_ms: int) -> None:
    """How long a live Decode speaking v1 takes to acknowledge a layer (its ACK is the only
    sign of life a v1 peer gives), against the silent-peer window a Prefill allows it before
    reusing held buffers (``ProducerConfig.silent_peer_timeout_s``: one lease by default)."""
    pair = Pair(lease_ms=lease_ms, protocol="v1")
    try:
        took = []
        for _ in range(rounds):
            seconds, failed = pair.round()
            if failed is not None:
                raise RuntimeError(f"a quiet v1 round failed: {failed}")
            took.append(seconds)
    finally:
        pair.close()
    took.sort()
    window = max(1.0, lease_ms / 1000)
    p99 = took[min(len(took) - 1, int(0.99 * len(took)))]
    print(
        f"v1 Decode, {rounds} layer rounds (admission, readiness, read, ACK): median "
        f"{1000 * statistics.median(took):.1f} ms, p99 {1000 * p99:.1f} ms, "
        f"max {1000 * took[-1]:.1f} ms; the default silent-peer "
        f"window at a {lease_ms} ms lease is {window:.1f} s, {window / took[-1]:.0f}x the "
        "slowest acknowledgement"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_hostile")
    parser.add_argument("--seconds", type=float, default=3.0, help="flood length per probe")
    parser.add_argument("--rounds", type=int, default=20, help="healthy rounds per flood")
    parser.add_argument("--lease-ms", type=int, default=2_000, help="healthy Prefill's lease")
    parser.add_argument("--probe", action="append", choices=PROBES, help="repeatable")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the Decode child on CPU 0 alone; this process and the flooder on the others",
    )
    parser.add_argument(
        "--v1-liveness",
        type=int,
        metavar="N",
        help="instead of the floods: N quiet rounds with the Prefill speaking v1, and how "
        "long a live v1 Decode took to acknowledge against the silent-peer window",
    )
    parser.add_argument("--decode-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--flood-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.decode_child:
        _child()
        return
    if args.flood_child:
        _flood_child(args.flood_child[0], int(args.flood_child[1]))
        return
    if args.pin:
        pin({0})
    if args.v1_liveness:
        v1_liveness(args.v1_liveness, args.lease_ms)
        return
    pair = Pair(lease_ms=args.lease_ms)
    try:
        for _ in range(5):  # warm up: the session, the first reads
            pair.round()
        for probe in args.probe or PROBES:
            r = measure(pair, probe, seconds=args.seconds, rounds=args.rounds, quiet_rounds=20)
            print(report(r), flush=True)
            for failure in r.failures[:3]:
                print(f"    failed: {failure}", flush=True)
    finally:
        pair.close()


if __name__ == "__main__":
    main()
