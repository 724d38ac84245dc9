"""Benchmark: the Prefill machines' table path, and one layer's publication round trip.

Run from the repository root (or anywhere once rd2h is installed)::

    python -m benchmarks.bench_machines                  # defaults, well under 20 s
    python -m benchmarks.bench_machines --requests 8 --steps 5 --repeats 3

Part 1, cost per transition. For each Prefill machine a cycle of allowed inputs is run
through the dict table (:meth:`MachineSpec.step`), through the table bound to handlers
as the endpoint fires it (:meth:`BoundMachine.fire`: lookup, state store, handler call;
no-op handlers here, so the column is the dispatch alone) and, as the BASELINE measured
in the same run, through the ``transitions.Machine`` built from the SAME declaration
(``model.trigger``). Medians of interleaved repeats, and the table/Machine ratio.

Part 2, one whole layer for ``--requests`` requests on one v2 Decode connection: the
endpoint's ``layer_written`` (readiness built, gates closed, lease set), ``encode`` of the
readiness frame, and ``receive`` of the Decode's READ_DONE frame (decoded, correlated by
seq, gates reopened). Each step schedules a fresh chunk of ``--blocks`` main and indexer
blocks per request (outside the timing) and writes every layer; medians over all layers
of all steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from rd2h_protocol.events import Chunk
from rd2h_protocol.machines.declare import MachineSpec, no_effect
from rd2h_protocol.machines.producer import (
    CONNECTION_HANDSHAKE,
    LAYER_PUBLICATION,
    PREFILL_REQUEST,
    STORAGE_GATE,
)
from rd2h_protocol.producer import (
    DecodeTarget,
    ProducerConfig,
    ProducerEndpoint,
    Send,
)
from rd2h_protocol.wire.codec import encode
from rd2h_protocol.wire.layout import LayerLayout
from rd2h_protocol.wire.messages import ALL_CAPABILITIES, Ack, ReadDone, ReadReadyBatch

# A cycle of allowed inputs per machine: (start state, inputs that lead back to it).
CYCLES: tuple[tuple[MachineSpec, str, tuple[str, ...]], ...] = (
    (STORAGE_GATE, "open", ("LOCAL_PUBLISH", "LOCAL_PUBLISH", "RECV_REPLY", "RECV_LAST_REPLY")),
    (LAYER_PUBLICATION, "replied", ("RECV_DONE", "RECV_FAILED")),  # late replies, counted
    (PREFILL_REQUEST, "sending", ("LOCAL_CHUNK",)),
    (CONNECTION_HANDSHAKE, "ready_v2", ("RECV_UNKNOWN_SESSION", "RECV_ACK_V2")),
)


def _check_cycle(spec: MachineSpec, start: str, inputs: Sequence[str]) -> None:
    state = start
    for event in inputs:
        state = spec.step(state, event)[1]
    if state != start:
        raise SystemExit(f"{spec.name}: cycle from {start} ends in {state}")


def table_walk(spec: MachineSpec, start: str, inputs: Sequence[str], n: int) -> Callable[[], str]:
    """``n`` transitions through the table, as the endpoint takes them."""
    events = (list(inputs) * (n // len(inputs) + 1))[:n]
    step = spec.step

    def run() -> str:
        state = start
        for event in events:
            state = step(state, event)[1]
        return state

    return run


class _Record:
    __slots__ = ("state",)

    def __init__(self, state: str) -> None:
        self.state = state


def fire_walk(spec: MachineSpec, start: str, inputs: Sequence[str], n: int) -> Callable[[], str]:
    """The same ``n`` transitions fired through the table bound to (no-op) handlers."""
    events = (list(inputs) * (n // len(inputs) + 1))[:n]
    fire = spec.bind(dict.fromkeys(spec.effects, no_effect)).fire
    record = _Record(start)

    def run() -> str:
        record.state = start
        for event in events:
            fire(None, record, event)
        return record.state

    return run


def machine_walk(spec: MachineSpec, start: str, inputs: Sequence[str], n: int) -> Callable[[], str]:
    """BASELINE: the same ``n`` transitions through a ``transitions.Machine``."""
    events = (list(inputs) * (n // len(inputs) + 1))[:n]
    machine = spec.build_machine()
    model = machine.models[0]

    def run() -> str:
        machine.set_state(start)
        trigger = model.trigger
        for event in events:
            trigger(event)
        return str(model.state)

    return run


def interleaved_medians(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each function, timed in turn within every repeat."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _layers(n: int) -> list[tuple[str, LayerLayout]]:
    out = []
    for i in range(n):
        base = 0x7F00_0000_0000 + i * (1 << 32)
        layout = LayerLayout(
            base_addrs=[base, base + (1 << 30), base + (2 << 30)],
            block_len=[1024, 128, 128],
            tensor_group_idx=[0, 0, 1],
        )
        out.append((f"model.layers.{i}.self_attn", layout))
    return out


def layer_round_trips(
    requests: int, blocks: int, n_layers: int, steps: int
) -> dict[str, list[float]]:
    """Seconds per layer for each phase, over ``steps`` steps of ``n_layers`` layers."""
    conn = "127.0.0.1:20000"
    ep = ProducerEndpoint(
        ProducerConfig(p_rank=0, p_tp=1, session="bench", layers=_layers(n_layers))
    )
    ids = [f"cmpl-{i:08d}-0" for i in range(requests)]
    for ext_id in ids:
        ep.add_request(ext_id, DecodeTarget("127.0.0.1", 20000, 1), 0.0)
    ack = encode(Ack(protocol_version=2, capabilities=list(ALL_CAPABILITIES)))
    phases: dict[str, list[float]] = {"layer_written": [], "encode": [], "receive": []}
    now = 1.0
    handshaken = False
    for step in range(steps + 1):  # step 0 warms up (and handshakes), not timed
        start = step * blocks
        for r, ext_id in enumerate(ids):
            block_ids = list(range(r * 4096 + start, r * 4096 + start + blocks))
            ep.schedule_chunk(
                Chunk(
                    ext_req_id=ext_id,
                    main_block_ids=block_ids,
                    indexer_block_ids=block_ids,
                    main_start=start,
                    indexer_start=start,
                    final=False,
                ),
                0.0,
            )
        for layer in range(n_layers):
            now += 0.001
            assert ep.can_overwrite(layer)
            t0 = time.perf_counter()
            out = ep.layer_written(layer, now)
            t1 = time.perf_counter()
            if not handshaken:
                out = ep.receive(conn, ack, now)
                handshaken = True
            msgs = [o.msg for o in out if isinstance(o, Send)]
            t2 = time.perf_counter()
            frames = [encode(m) for m in msgs]
            t3 = time.perf_counter()
            replies = []
            for m in msgs:
                assert isinstance(m, ReadReadyBatch) and len(m.read_reqs) == requests
                replies.append(encode(ReadDone(layer_idx=m.layer_idx, seq=m.seq)))
            t4 = time.perf_counter()
            for reply in replies:
                ep.receive(conn, reply, now)
            t5 = time.perf_counter()
            assert frames and ep.can_overwrite(layer)
            if step:
                phases["layer_written"].append(t1 - t0)
                phases["encode"].append(t3 - t2)
                phases["receive"].append(t5 - t4)
        ep.end_step(now)
    phases["total"] = [sum(p) for p in zip(*phases.values(), strict=True)]
    return phases


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0 (1 if a table/Machine ratio is under --min-ratio)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--transitions", type=int, default=4000, help="per timed walk")
    ap.add_argument("--repeats", type=int, default=7, help="timed walks per path (median)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=16, help="main and indexer blocks per chunk")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--min-ratio", type=float, default=0.0)
    args = ap.parse_args(argv)
    ok = True

    n = args.transitions
    print(f"cost per transition, {n} transitions per walk, median of {args.repeats}")
    print(f"{'machine':<24}{'table':>10}{'fire':>10}{'transitions':>14}{'ratio':>8}")
    for spec, start, inputs in CYCLES:
        _check_cycle(spec, start, inputs)
        table_fn = table_walk(spec, start, inputs, n)
        fire_fn = fire_walk(spec, start, inputs, n)
        machine_fn = machine_walk(spec, start, inputs, n)
        if not table_fn() == fire_fn() == machine_fn():
            print(f"MISMATCH: {spec.name}: table, fire and Machine end in different states")
            ok = False
            continue
        table_s, fire_s, machine_s = interleaved_medians(
            [table_fn, fire_fn, machine_fn], args.repeats
        )
        ratio = machine_s / table_s
        print(
            f"{spec.name:<24}{table_s / n * 1e9:>8.0f}ns{fire_s / n * 1e9:>8.0f}ns"
            f"{machine_s / n * 1e9:>12.0f}ns{ratio:>7.1f}x"
        )
        ok = ok and ratio >= args.min_ratio

    phases = layer_round_trips(args.requests, args.blocks, args.layers, args.steps)
    samples = len(phases["total"])
    print(
        f"\none layer, {args.requests} requests x {args.blocks} main + {args.blocks} indexer "
        f"blocks, one v2 connection, median of {samples} layers"
    )
    for name, values in phases.items():
        med = statistics.median(values)
        per_req = med / args.requests
        print(f"{name:<16}{med * 1e6:>9.1f} us  ({per_req * 1e9:>6.0f} ns per request)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
