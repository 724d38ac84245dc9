"""Benchmark: a layer's control cost as a multiple of the socket floor, with a breakdown.

Run from the repository root::

    python -m benchmarks.bench_control_floor            # 1x16 and 64x256 layers
    python -m benchmarks.bench_control_floor --repeats 64
    python -m benchmarks.bench_control_floor --no-inline  # every read on the read worker

THE FLOOR is a bare pyzmq DEALER/ROUTER ping-pong on 127.0.0.1 (one thread per socket,
as the runtime has one I/O thread per socket set), with the frame sizes one layer's
readiness and its reply have on the wire (measured from the same run). Nothing can
answer a readiness faster than that.

THE LAYER is one :class:`~rd2h_runtime.prefill.PrefillWorker` and one
:class:`~rd2h_runtime.decode.DecodeWorker` in this process on real ZMQ sockets, with the
no-copy backend of ``benchmarks.bench_control_plane`` (the base class's checks run, the
engine moves nothing). That backend reads on the calling thread, as loopback and cma do,
so Decode's dispatcher reads a small plan itself, as it would on them (inline reads, see
``rd2h_runtime.decode``); ``--no-inline`` hands every plan to the read worker instead.
Two costs per layer:

* Decode round trip: the readiness frame handed to the Prefill socket -> its reply
  handed to the Prefill endpoint (the floor plus everything Decode does);
* publish -> gate reopen: ``layer_written`` -> ``wait_writable`` returns (what the
  Prefill compute thread sees).

The breakdown is timed by wrapping the workers' calls from outside (instance attributes
and the module's ``encode``; no worker code changes): Prefill publish (the endpoint's
``layer_written``: building and encoding the frame), Decode's frame handling (decode,
validate, the protocol's plan), descriptor planning, the engine call, the endpoint's
``read_finished``, encoding the reply, and Prefill's reply handling. Shapes: 1 request x
16 blocks and 64 requests x 256 blocks, random and contiguous destinations. Medians.

Goals (issue 13): 1x16 -- Decode round trip <= floor + 0.1 ms, publish -> gate reopen
<= 0.25 ms; 64x256 random -- Decode round trip <= 1.0 ms, publish -> gate <= 0.8 ms.

A last table compares the Decode endpoint's handling of one readiness (decode + plan +
descriptors) for a v1 Prefill (a layout without ``num_blocks``) and a v2 one.
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from benchmarks.bench_control_plane import LAYERS, Pair, decode_layers, prefill_layers
from benchmarks.bench_datapath import backend_layer_reader
from rd2h_protocol.consumer import ConsumerConfig, ConsumerEndpoint, StartRead
from rd2h_protocol.errors import ProtocolError
from rd2h_protocol.wire.codec import decode, encode
from rd2h_protocol.wire.layout import encode_layer_metadata
from rd2h_protocol.wire.messages import MfMeta, ReadReadyBatch, ReadReq
from rd2h_runtime.decode_reads import INLINE_READ_BYTES
from rd2h_runtime.planning import build_descriptors
from rd2h_runtime.transfer.base import BlockingCallRunner

HOST = "127.0.0.1"
SHAPES = ((1, 16), (64, 256))
GOALS = {  # (requests, blocks, contiguous) -> (decode round trip beyond floor | total, gate)
    (1, 16): ("floor+", 0.1e-3, 0.25e-3),
    (64, 256): ("total", 1.0e-3, 0.8e-3),
}


# -- the floor -----------------------------------------------------------------------------


def socket_floor(request_bytes: int, reply_bytes: int, repeats: int) -> float:
    """Median DEALER -> ROUTER -> DEALER round trip of frames of these sizes (seconds)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port(f"tcp://{HOST}")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{HOST}:{port}")
    reply = b"r" * reply_bytes
    payload = b"q" * request_bytes
    stop = b""

    def echo() -> None:
        while True:
            peer, frame = router.recv_multipart(copy=False)
            if len(frame) == 0:
                return
            router.send_multipart([peer, reply], copy=False)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    times = []
    try:
        for i in range(repeats + 20):
            t0 = time.perf_counter()
            dealer.send(payload, copy=False)
            dealer.recv(copy=False)
            if i >= 20:  # warm-up: connection, first allocations
                times.append(time.perf_counter() - t0)
        dealer.send(stop)
        thread.join(5.0)
    finally:
        dealer.close()
        router.close()
        ctx.term()
    return statistics.median(times)


def thread_handoffs(repeats: int) -> tuple[float, float]:
    """Median one-way hand-off between two threads of this process (seconds), by the two
    ways the runtime hands work over: (a loop blocked in ``zmq.Poller.poll`` woken through
    an inproc PAIR, as a socket loop is woken to send; a thread blocked on a
    ``queue.SimpleQueue``, as Decode's read worker and a gate waiter are woken). Each is
    half of a ping-pong's round trip: the cost of waking a blocked thread, GIL included."""
    ctx = zmq.Context()
    here, there = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    here.bind("inproc://handoff")
    there.connect("inproc://handoff")
    poller = zmq.Poller()
    poller.register(here, zmq.POLLIN)

    def pair_echo() -> None:
        echo_poller = zmq.Poller()
        echo_poller.register(there, zmq.POLLIN)
        while echo_poller.poll(5000):
            frame = there.recv()
            if not frame:  # the stop
                return
            there.send(frame)

    def pair_round_trip() -> None:
        here.send(b"w")
        poller.poll(5000)
        here.recv()

    echo = threading.Thread(target=pair_echo, daemon=True)
    echo.start()
    try:
        pair = median_call(pair_round_trip, repeats)
        here.send(b"")
        echo.join(5.0)
    finally:
        here.close()
        there.close()
        ctx.term()

    ahead: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def queue_echo() -> None:
        while (item := ahead.get(timeout=5.0)) is not None:
            back.put(item)

    def queue_round_trip() -> None:
        ahead.put(1)
        back.get(timeout=5.0)

    echo = threading.Thread(target=queue_echo, daemon=True)
    echo.start()
    queued = median_call(queue_round_trip, repeats)
    ahead.put(None)
    echo.join(5.0)
    return pair / 2, queued / 2


# -- the layer, instrumented from outside ----------------------------------------------------


class Probe:
    """Wraps callables and records, per layer, when they started and ended."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.sizes: dict[str, int] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        marks = self.marks

        def timed(*args: Any, **kwargs: Any) -> Any:
            marks[name + ">"] = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                marks[name + "<"] = time.perf_counter()

        return timed


def instrument(pair: Pair, probe: Probe) -> None:
    """Wrap the calls one layer passes through (instance attributes: no worker code
    changes); ``X>``/``X<`` marks when call X started/ended for the latest layer."""
    p, d = pair.prefill, pair.decode
    p_ep: Any = p._endpoint
    d_ep: Any = d._endpoint
    p_ep.layer_written = probe.wrap("P publish", p_ep.layer_written)
    p_ep.receive = probe.wrap("P reply", p_ep.receive)
    d_ep.receive = probe.wrap("D frame", d_ep.receive)
    d_ep.read_finished = probe.wrap("D read_finished", d_ep.read_finished)
    d._planner = probe.wrap("D plan", d._planner)
    backend: Any = d._backend
    backend.read = probe.wrap("D engine", backend.read)
    p_send, d_send = p._send, d._send

    def send_readiness(conn: str, payload: bytes) -> None:
        probe.marks["P send>"] = time.perf_counter()
        probe.sizes["readiness"] = len(payload)
        p_send(conn, payload)

    def send_reply(peer: bytes, payload: bytes) -> None:
        probe.marks["D send>"] = time.perf_counter()
        probe.sizes["reply"] = len(payload)
        d_send(peer, payload)

    p._send = send_readiness  # type: ignore[method-assign,assignment]
    d._send = send_reply  # type: ignore[method-assign,assignment]
    # the I/O threads: when a frame is handed to ZMQ (after the wake-up from the thread
    # that queued it), and when a readable socket is served
    client: Any = p._control
    server: Any = d._control
    flush_conn = client._flush_conn_locked

    def p_flush(c: Any) -> None:
        if c.outbox:
            probe.marks["P zmq send>"] = time.perf_counter()
        flush_conn(c)

    client._flush_conn_locked = p_flush
    server_flush = server._flush

    def d_flush() -> None:
        if server._outbox:
            probe.marks["D zmq send>"] = time.perf_counter()
        server_flush()

    server._flush = d_flush


# (label, from mark, to mark): one layer's path, in order, as consecutive intervals.
TIMELINE = (
    ("P publish: endpoint, encode", "P publish>", "P send>"),
    ("P hop: compute -> I/O (wake-up)", "P send>", "P zmq send>"),
    ("P->D: TCP, D poll, recv", "P zmq send>", "D frame>"),
    ("D frame: decode, validate, plan", "D frame>", "D frame<"),
    ("D hop: -> reader (none inline)", "D frame<", "D plan>"),
    ("D descriptors", "D plan>", "D plan<"),
    ("D checks before the engine", "D plan<", "D engine>"),
    ("D engine call (no-copy)", "D engine>", "D engine<"),
    ("D hop: engine -> read_finished", "D engine<", "D read_finished>"),
    ("D read_finished", "D read_finished>", "D read_finished<"),
    ("D encode reply", "D read_finished<", "D send>"),
    ("D hop: reader -> I/O (wake)", "D send>", "D zmq send>"),
    ("D->P: TCP, P poll, recv", "D zmq send>", "P reply>"),
    ("P reply handling", "P reply>", "P reply<"),
    ("P hop: I/O -> compute thread", "P reply<", "gate"),
)


def timed_step(pair: Pair, marks: dict[str, float], layer_done: Callable[[float], None]) -> None:
    """One engine step of every layer, each published and waited for in turn:
    ``layer_done(publish -> gate reopen)`` after each, while ``marks`` holds its marks."""
    for ext, main, idx in pair.chunks:
        pair.prefill.schedule_chunk(ext, main, idx, 0, 0, False)
    for layer in range(LAYERS):
        marks.clear()
        t0 = time.perf_counter()
        pair.prefill.layer_written(layer)
        if not pair.prefill.wait_writable(layer, 30.0):
            raise TimeoutError(f"no reply for layer {layer} within 30 s")
        marks["gate"] = time.perf_counter()
        layer_done(marks["gate"] - t0)
    pair.prefill.end_step()


def measure_layer(
    requests: int, blocks: int, contiguous: bool, repeats: int, *, inline: bool = True
) -> tuple[list[float], list[float], dict[str, float], dict[str, int]]:
    """Per-layer (Decode round trip, publish -> gate reopen) samples, the median of each
    TIMELINE interval, and the frame sizes. ``inline``: Decode's dispatcher reads small
    plans itself (the no-copy backend, like loopback and cma, reads on the calling thread:
    it gets their default bound); False: every plan goes to the read worker."""
    probe = Probe()
    pair = Pair(build_descriptors, requests, blocks, contiguous=contiguous, seed=0)
    pair.decode.inline_read_bytes = INLINE_READ_BYTES if inline else 0
    try:
        instrument(pair, probe)
        for _ in range(2):  # warm-up: handshake, first allocations, caches
            pair.step(range(LAYERS))
        round_trips: list[float] = []
        gates: list[float] = []
        parts: dict[str, list[float]] = defaultdict(list)
        marks = probe.marks

        def layer_done(gate: float) -> None:
            gates.append(gate)
            round_trips.append(marks["P reply>"] - marks["P send>"])
            for label, a, b in TIMELINE:
                parts[label].append(marks[b] - marks[a])

        while len(gates) < repeats:
            timed_step(pair, marks, layer_done)
        medians = {label: statistics.median(v) for label, v in parts.items()}
        return round_trips, gates, medians, dict(probe.sizes)
    finally:
        pair.close()


def inline_ab(requests: int, blocks: int, repeats: int) -> tuple[float, float, float, float]:
    """Median Decode round trip and publish -> gate reopen of one random layer shape with
    inline reads on and off, in ONE pair whose steps alternate between the two (in an
    ABBA order): (rtt on, rtt off, gate on, gate off). Separate runs of this machine
    differ by more than inline reads change (the floor itself moves 2x from one process to
    the next); alternating within one process compares like with like."""
    probe = Probe()
    pair = Pair(build_descriptors, requests, blocks, contiguous=False, seed=0)
    try:
        instrument(pair, probe)
        for _ in range(2):
            pair.step(range(LAYERS))
        rtts: dict[bool, list[float]] = {True: [], False: []}
        gates: dict[bool, list[float]] = {True: [], False: []}
        marks = probe.marks
        for n in range(2 * max(1, repeats // LAYERS)):
            inline = n % 4 in (0, 3)
            pair.decode.inline_read_bytes = INLINE_READ_BYTES if inline else 0

            def layer_done(gate: float, inline: bool = inline) -> None:
                gates[inline].append(gate)
                rtts[inline].append(marks["P reply>"] - marks["P send>"])

            timed_step(pair, marks, layer_done)
        med = statistics.median
        return med(rtts[True]), med(rtts[False]), med(gates[True]), med(gates[False])
    finally:
        pair.close()


# -- v1 vs v2 planning -----------------------------------------------------------------------


def handling(
    requests: int, blocks: int, repeats: int, *, num_blocks: bool, fast: bool = True
) -> float:
    """Median Decode handling of one readiness of a v1 session, layer after layer of the
    same step: ``receive`` (decode, validate, plan), descriptors, ``read_finished``.

    ``num_blocks``: the Prefill layout carries the v2 key; ``fast`` False forces the
    general decode path (how a layout without it was served before).
    """
    rng = random.Random(0)
    pool = requests * blocks * 2
    d_layers = decode_layers(pool)
    ep = ConsumerEndpoint(ConsumerConfig(d_rank=0, d_tp=1, layers=d_layers))
    if not fast:
        ep.read_frame = lambda frame, **_: decode(frame)
    layouts = {
        name: msgspec.structs.replace(layout, num_blocks=pool if num_blocks else None)
        for name, layout in prefill_layers(pool)
    }
    peer = b"prefill-0"
    meta = MfMeta(p_session="p0", encoded_layer_metadata=encode_layer_metadata(layouts))
    ep.receive(peer, encode(meta), 0.0)
    src, dst = list(range(pool)), list(range(pool))
    rng.shuffle(src)
    rng.shuffle(dst)
    entries = []
    for r in range(requests):
        ids = src[r * blocks : (r + 1) * blocks]
        ep.add_request(f"req-{r}", dst[r * blocks : (r + 1) * blocks], ids, 0.0)
        entries.append(ReadReq(f"req-{r}", ids, ids, 0, 0))
    names = [name for name, _ in d_layers]
    times = []
    for i in range(repeats + LAYERS):
        layer = i % LAYERS
        frame = encode(ReadReadyBatch(layer_idx=layer, layer_name=names[layer], read_reqs=entries))
        t0 = time.perf_counter()
        (start,) = [o for o in ep.receive(peer, frame, 0.0) if isinstance(o, StartRead)]
        build_descriptors(start.plan)
        ep.read_finished(start.plan.read_id, None, 0.0)
        if i >= LAYERS:  # warm-up: the first step
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def planning_v1_v2(
    requests: int, blocks: int, repeats: int
) -> list[tuple[str, float, float, float]]:
    """(shape, v1 layout before, v1 layout now, with num_blocks) medians."""
    return [
        (
            f"{requests}x{blocks}",
            handling(requests, blocks, repeats, num_blocks=False, fast=False),
            handling(requests, blocks, repeats, num_blocks=False),
            handling(requests, blocks, repeats, num_blocks=True),
        )
    ]


# -- per-read fixed cost of each backend ----------------------------------------------------


def thread_per_call(fn: Callable[[], object], deadline: float) -> None:
    """BASELINE: how BlockingCallRunner ran an engine call before, a new thread per call."""
    done = threading.Event()

    def target() -> None:
        try:
            fn()
        finally:
            done.set()

    threading.Thread(target=target, daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise TimeoutError


def median_call(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def runner_costs(repeats: int) -> tuple[float, float]:
    """(thread per call, persistent worker) median cost of running an empty engine call."""
    runner = BlockingCallRunner("bench")
    try:
        old = median_call(lambda: thread_per_call(lambda: None, time.monotonic() + 5), repeats)
        new = median_call(lambda: runner.run(lambda: None, time.monotonic() + 5, "x"), repeats)
    finally:
        runner.close()
    return old, new


def backend_fixed_costs(
    backends: Sequence[str], repeats: int
) -> list[tuple[str, str, float | str, float | str]]:
    """Per backend: median ``read()`` of 1 x 4 KiB and of 48 x 1 KiB (a 1x16 layer's
    K, V and indexer blocks) from a Prefill source process; the bytes are checked."""
    rows: list[tuple[str, str, float | str, float | str]] = []
    for name in backends:
        cells: list[float | str] = []
        try:
            for nbytes, chunk in ((4096, 4096), (48 * 1024, 1024)):
                with backend_layer_reader(name, nbytes, chunk=chunk, timeout_s=30.0) as (
                    read_layer,
                    verify,
                    _,
                ):
                    cells.append(median_call(read_layer, repeats))
                    if not verify():
                        raise AssertionError(f"{name} read wrong bytes")
        except (ProtocolError, ImportError, RuntimeError, AssertionError, OSError) as exc:
            rows.append(
                (name, f"n/a ({type(exc).__name__}: {str(exc).splitlines()[0][:70]})", "", "")
            )
            continue
        rows.append((name, "", cells[0], cells[1]))
    return rows


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--repeats", type=int, default=48, help="layers per shape (median)")
    ap.add_argument("--floor-repeats", type=int, default=2000)
    ap.add_argument(
        "--backends", nargs="*", default=["loopback", "cma", "nixl", "mooncake", "memfabric"]
    )
    ap.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    ap.add_argument(
        "--no-inline",
        action="store_true",
        help="Decode hands every plan to its read worker (no inline reads on the dispatcher)",
    )
    args = ap.parse_args(argv)

    print(
        "layer control cost against the socket floor (bare DEALER/ROUTER ping-pong, same "
        f"frame sizes), no-copy backend, {HOST}, medians of {args.repeats} layers; Decode "
        + ("reads every plan on its read worker" if args.no_inline else "reads small plans inline")
    )
    rows = []
    breakdowns = []
    missed = []
    for requests, blocks in SHAPES:
        for contiguous in (False, True):
            rts, gates, parts, sizes = measure_layer(
                requests, blocks, contiguous, args.repeats, inline=not args.no_inline
            )
            floor = socket_floor(sizes["readiness"], sizes["reply"], args.floor_repeats)
            rt, gate = statistics.median(rts), statistics.median(gates)
            shape = f"{requests}x{blocks} {'contig' if contiguous else 'random'}"
            rows.append((shape, sizes["readiness"], sizes["reply"], floor, rt, gate))
            breakdowns.append((shape, parts))
            kind, rt_goal, gate_goal = GOALS[(requests, blocks)]
            if contiguous and (requests, blocks) == (64, 256):
                continue  # the 64x256 goals name the random layer
            rt_ok = (rt - floor <= rt_goal) if kind == "floor+" else rt <= rt_goal
            if not rt_ok:
                missed.append(f"{shape}: Decode round trip")
            if gate > gate_goal:
                missed.append(f"{shape}: publish -> gate reopen")

    print(
        f"{'layer':<16}{'frame B':>9}{'reply B':>9}{'floor ms':>10}{'D rtt ms':>10}"
        f"{'x floor':>9}{'+floor ms':>10}{'gate ms':>9}{'x floor':>9}"
    )
    for shape, req_b, rep_b, floor, rt, gate in rows:
        print(
            f"{shape:<16}{req_b:>9}{rep_b:>9}{fmt_ms(floor):>10}{fmt_ms(rt):>10}"
            f"{rt / floor:>8.1f}x{fmt_ms(rt - floor):>10}{fmt_ms(gate):>9}{gate / floor:>8.1f}x"
        )
    print(
        "\nwhere a layer's time goes (ms, median of each interval; publish -> gate reopen is "
        "their sum, up to medians not adding)"
    )
    print(f"{'interval':<34}" + "".join(f"{shape:>16}" for shape, _ in breakdowns))
    for label, _, _ in TIMELINE:
        cells = "".join(f"{fmt_ms(parts[label]):>16}" for _, parts in breakdowns)
        print(f"{label:<34}{cells}")

    print(
        "\ninline reads on/off in one pair, steps alternating (medians of "
        f"{4 * args.repeats} layers each, ms; the 64x256 plan is over the inline bound)"
    )
    print(
        f"{'layer':<10}{'D rtt on':>10}{'off':>8}{'on/off':>8}{'gate on':>9}{'off':>8}{'on/off':>8}"
    )
    for requests, blocks in SHAPES:
        rt_on, rt_off, g_on, g_off = inline_ab(requests, blocks, 4 * args.repeats)
        print(
            f"{f'{requests}x{blocks}':<10}{fmt_ms(rt_on):>10}{fmt_ms(rt_off):>8}"
            f"{rt_on / rt_off:>7.2f}x{fmt_ms(g_on):>9}{fmt_ms(g_off):>8}{g_on / g_off:>7.2f}x"
        )

    print(
        "\nDecode handling of one random readiness of a v1 session (receive + "
        "descriptors + read_finished), ms: layout without num_blocks on the general decode "
        "path (before), on the fast path (now), and with the v2 num_blocks key"
    )
    print(f"{'layer':<10}{'no key, before':>16}{'no key, now':>13}{'num_blocks':>12}{'now/key':>9}")
    for shape, before, now, keyed in planning_v1_v2(1, 16, args.repeats) + planning_v1_v2(
        64, 256, args.repeats
    ):
        print(
            f"{shape:<10}{fmt_ms(before):>16}{fmt_ms(now):>13}{fmt_ms(keyed):>12}"
            f"{now / keyed:>8.2f}x"
        )

    print("\nper-read fixed cost of each backend (median read(), ms; bytes checked)")
    print(f"{'backend':<10}{'1 x 4 KiB':>11}{'48 x 1 KiB':>12}")
    for name, why, one, many in backend_fixed_costs(args.backends, args.repeats):
        if why:
            print(f"{name:<10}  {why}")
        else:
            assert isinstance(one, float) and isinstance(many, float)
            print(f"{name:<10}{fmt_ms(one):>11}{fmt_ms(many):>12}")
    old, new = runner_costs(args.floor_repeats // 4)
    print(
        f"engine-call runner (nixl, mooncake, memfabric), empty call: thread per call "
        f"{fmt_ms(old)} ms, persistent worker {fmt_ms(new)} ms ({old / new:.1f}x)"
    )

    pair_wake, queue_wake = thread_handoffs(args.floor_repeats // 4)
    print(
        f"\nthread hand-off, one way, bare (median): a loop woken through its inproc PAIR "
        f"{fmt_ms(pair_wake)} ms, a thread woken from a queue {fmt_ms(queue_wake)} ms. In a "
        "layer a woken thread also waits for the GIL until its waker blocks, so the layer's "
        "own hops (above) cost more. What a layer's transport alone costs, no work counted "
        "(its hops + its two socket legs, medians from the breakdown):"
    )
    for shape, parts in breakdowns:
        hops = sum(value for label, value in parts.items() if " hop: " in label)
        legs = sum(value for label, value in parts.items() if ": TCP," in label)
        print(
            f"  {shape:<16} hops {fmt_ms(hops)} + socket legs {fmt_ms(legs)} = "
            f"{fmt_ms(hops + legs)} ms"
        )
    print(
        "\ngoals: 1x16 D rtt <= floor + 0.100 ms and gate <= 0.250 ms; "
        "64x256 random D rtt <= 1.000 ms and gate <= 0.800 ms"
    )
    print("missed: " + ("; ".join(missed) if missed else "none"))
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
