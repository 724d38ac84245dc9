"""Benchmark: what the protocol trace costs per layer, off and on, in one run.

Run from the repository root::

    python -m benchmarks.bench_trace                     # 64 requests x 256 blocks
    python -m benchmarks.bench_trace --requests 8 --blocks 32 --repeats 4

The pair of :mod:`benchmarks.bench_control_plane` (a PrefillWorker and a DecodeWorker in
this process on real ZMQ sockets, a backend that moves nothing), built twice: tracing OFF
(no ``trace_dir``, ``RD2H_TRACE_DIR`` unset: the workers hold no tracer) and tracing ON
(``trace_dir`` a temporary directory: every endpoint call of both workers, the gate waits
and the reads are recorded and written by the tracers' writer threads). One sample is one
layer's whole control round trip as ``bench_control_plane`` times it (``layer_written`` ->
Decode -> reply -> ``wait_writable`` returns). The two pairs are timed in turn, a step
each, so that drift hits both alike. The report gives medians and the overhead of ON over
OFF; the goal is under 5% of a 64-request x 256-block layer's control time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

from benchmarks.bench_control_plane import LAYERS, NoopBackend, decode_layers, prefill_layers
from rd2h_protocol.consumer import ConsumerConfig
from rd2h_protocol.producer import DecodeTarget, ProducerConfig
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.trace import ENV_VAR, Tracer

HOST = "127.0.0.1"


class TracedPair:
    """One Prefill and one Decode rank on real sockets; traced when ``trace_dir`` is set."""

    def __init__(self, requests: int, blocks: int, trace_dir: str | None, seed: int) -> None:
        pool = requests * blocks * 2
        self.decode = DecodeWorker(
            ConsumerConfig(d_rank=0, d_tp=1, layers=decode_layers(pool)),
            NoopBackend(role="decode"),
            host=HOST,
            trace_dir=trace_dir,
        )
        self.prefill = PrefillWorker(
            ProducerConfig(p_rank=0, p_tp=1, session="", layers=prefill_layers(pool)),
            NoopBackend(role="prefill"),
            trace_dir=trace_dir,
        )
        rng = random.Random(seed)
        src_free, dst_free = list(range(pool)), list(range(pool))
        rng.shuffle(src_free)
        rng.shuffle(dst_free)
        target = DecodeTarget(HOST, self.decode.port, 1)
        self.chunks: list[tuple[str, list[int]]] = []
        for r in range(requests):
            ext = f"req-{r}"
            src = src_free[r * blocks : (r + 1) * blocks]
            dst = dst_free[r * blocks : (r + 1) * blocks]
            self.decode.add_request(ext, dst, dst)
            self.prefill.add_request(ext, target)
            self.chunks.append((ext, src))

    def step(self) -> list[float]:
        for ext, src in self.chunks:
            self.prefill.schedule_chunk(ext, src, src, 0, 0, False)
        out = []
        for layer in range(LAYERS):
            t0 = time.perf_counter()
            self.prefill.layer_written(layer)
            if not self.prefill.wait_writable(layer, 30.0):
                raise TimeoutError(f"no reply for layer {layer} within 30 s")
            out.append(time.perf_counter() - t0)
        self.prefill.end_step()
        return out

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


def record_cost_us(n: int = 20000) -> float:
    """What a traced thread pays per endpoint call: one :meth:`Tracer.call` (a deque
    append), in microseconds."""
    with tempfile.TemporaryDirectory(prefix="rd2h-trace-bench-") as tmp:
        tracer = Tracer(tmp, "prefill", 0, {"p_rank": 0})
        outputs: list[object] = []
        args = {"layer_idx": 3}
        try:
            t0 = time.perf_counter()
            for i in range(n):
                tracer.call("layer_written", float(i), args, outputs)
            elapsed = time.perf_counter() - t0
        finally:
            tracer.close()
    return elapsed / n * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--repeats", type=int, default=12, help="steps per candidate (4 layers each)")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    os.environ.pop(ENV_VAR, None)  # OFF must be off
    with tempfile.TemporaryDirectory(prefix="rd2h-trace-bench-") as tmp:
        pairs = {
            "off": TracedPair(args.requests, args.blocks, None, seed=1),
            "on": TracedPair(args.requests, args.blocks, tmp, seed=1),
        }
        samples: dict[str, list[float]] = {name: [] for name in pairs}
        traced = pairs["on"]
        tracers = [t for t in (traced.prefill._tracer, traced.decode._tracer) if t is not None]
        cpu0 = 0.0
        try:
            for i in range(args.warmup + args.repeats):
                if i == args.warmup:
                    for t in tracers:
                        t.flush()
                    cpu0 = sum(t.writer_cpu_s for t in tracers)
                order = list(pairs.items()) if i % 2 else list(reversed(pairs.items()))
                for name, pair in order:
                    times = pair.step()
                    if i >= args.warmup:
                        samples[name] += times
            for t in tracers:
                t.flush()
            writer_cpu = sum(t.writer_cpu_s for t in tracers) - cpu0
        finally:
            for pair in pairs.values():
                pair.close()
        trace_bytes = sum(
            os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.endswith(".ndjson")
        )
    off_ms = statistics.median(samples["off"]) * 1e3
    on_ms = statistics.median(samples["on"]) * 1e3
    overhead = (on_ms - off_ms) / off_ms * 100
    layers = len(samples["on"])
    record_us = record_cost_us()
    print(
        f"protocol trace cost per layer: {args.requests} requests x {args.blocks} blocks, "
        f"{layers} layer round trips per candidate"
    )
    for name in ("off", "on"):
        data = sorted(samples[name])
        p90 = data[int(0.9 * (len(data) - 1))] * 1e3
        mean = statistics.fmean(data) * 1e3
        med = statistics.median(data) * 1e3
        print(
            f"  tracing {name:<3}  median {med:8.3f} ms   mean {mean:8.3f} ms   p90 {p90:8.3f} ms"
        )
    mean_over = (statistics.fmean(samples["on"]) / statistics.fmean(samples["off"]) - 1) * 100
    print(f"  overhead of ON: median {overhead:+.1f}%, mean {mean_over:+.1f}% (goal < 5%)")
    per_layer_us = writer_cpu / max(1, layers) * 1e6
    print(
        f"  writer thread: {per_layer_us:.0f} us CPU per layer "
        f"({per_layer_us / 1e3 / off_ms * 100:.1f}% of the OFF median; off the protocol's "
        "threads, it competes for the GIL only)"
    )
    print(f"  recording one call (what a traced thread pays): {record_us:.2f} us")
    print(
        f"  trace written: {trace_bytes / 1e6:.1f} MB, {trace_bytes / max(1, layers) / 1e3:.0f} "
        "kB per layer (both workers)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
