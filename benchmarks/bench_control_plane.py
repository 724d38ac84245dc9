"""Benchmark: the control-plane round trip of one layer message through the runtime.

Run from the repository root::

    python -m benchmarks.bench_control_plane             # 64 requests x 256 blocks
    python -m benchmarks.bench_control_plane --requests 8 --blocks 32 --repeats 8

A :class:`~rd2h_runtime.prefill.PrefillWorker` and a :class:`~rd2h_runtime.decode.DecodeWorker`
in this process, on real ZMQ sockets (127.0.0.1, ports chosen at run time), with a
transfer backend that moves no byte (:class:`NoopBackend`: the base class's argument and
region checks run, the engine does nothing). One readiness message names ``--requests``
requests of ``--blocks`` main and as many indexer blocks (K 1024 B, V 128 B, indexer
128 B per block). One sample is the whole round trip, timed on the Prefill side:
``layer_written`` (publish: encode, send) -> Decode (decode, validate, plan, descriptors,
backend read, reply) -> Prefill (reply, gate reopens) -> ``wait_writable`` returns.

Two candidates, timed in turn in the same run: OURS (the vectorised planner,
:func:`rd2h_runtime.planning.build_descriptors`) and BASELINE (the same runtime with the
plain per-request, per-block planner of ``benchmarks.bench_planning``, its descriptors
handed to the backend as arrays). Destinations random (nothing merges) and contiguous (one
run per request and component). The report gives medians and the ratio baseline / ours;
the goal is >= 10x.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from benchmarks.bench_planning import baseline_planner
from rd2h_protocol.consumer import ConsumerConfig
from rd2h_protocol.plan import ReadPlan
from rd2h_protocol.producer import DecodeTarget, ProducerConfig
from rd2h_protocol.wire.layout import ComponentDest, DestinationLayout, LayerLayout
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.planning import Descriptors, build_descriptors
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.transfer import TransferBackend
from rd2h_runtime.transfer.base import U64Array

HOST = "127.0.0.1"
LAYERS = 4
BLOCK_BYTES = {"k": 1024, "v": 128, "indexer": 128}
# Fake address spaces: NoopBackend never touches memory, so nothing is allocated.
_P_BASE = 0x7F00_0000_0000
_D_BASE = 0x5500_0000_0000
_SPAN = 1 << 36  # per component and layer, far more than any benchmark needs
_sessions = itertools.count()


class NoopBackend(TransferBackend):
    """A backend whose engine moves nothing: only the base class's checks run."""

    name: ClassVar[str] = "noop"

    def __init__(self, *, role: str, host: str = HOST, **options: Any) -> None:
        super().__init__(role=role, host=host)
        self._session = f"noop:{os.getpid()}:{next(_sessions)}"

    @property
    def session_id(self) -> str:
        return self._session

    def _register(self, regions: list[tuple[int, int]]) -> None:
        return None

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        return None

    def _close(self) -> None:
        return None


def baseline_descriptors(plan: ReadPlan) -> Descriptors:
    """BASELINE: the plain per-block planner, its triples turned into the arrays a batched
    read takes (what a runtime built on it would hand the backend)."""
    triples = baseline_planner(plan)
    cols = np.array(triples, dtype=np.uint64).reshape(-1, 3)
    return Descriptors(
        np.ascontiguousarray(cols[:, 0]),
        np.ascontiguousarray(cols[:, 1]),
        np.ascontiguousarray(cols[:, 2]),
        (),
    )


def _addr(base: int, layer: int, comp: int) -> int:
    return base + (layer * 3 + comp) * _SPAN


def prefill_layers(num_blocks: int) -> list[tuple[str, LayerLayout]]:
    return [
        (
            f"model.layers.{layer}.self_attn",
            LayerLayout(
                base_addrs=[_addr(_P_BASE, layer, c) for c in range(3)],
                block_len=list(BLOCK_BYTES.values()),
                tensor_group_idx=[0, 0, 1],
                num_blocks=num_blocks,
            ),
        )
        for layer in range(LAYERS)
    ]


def decode_layers(num_blocks: int) -> list[tuple[str, DestinationLayout]]:
    def dest(layer: int, comp: int, name: str) -> ComponentDest:
        return ComponentDest(_addr(_D_BASE, layer, comp), BLOCK_BYTES[name], num_blocks)

    return [
        (
            f"model.layers.{layer}.self_attn",
            DestinationLayout(
                main=(dest(layer, 0, "k"), dest(layer, 1, "v")), indexer=dest(layer, 2, "indexer")
            ),
        )
        for layer in range(LAYERS)
    ]


class Pair:
    """One Prefill rank and one Decode rank on real sockets, with noop backends."""

    def __init__(
        self, planner: Any, requests: int, blocks: int, *, contiguous: bool, seed: int
    ) -> None:
        pool = requests * blocks * 2
        self.decode = DecodeWorker(
            ConsumerConfig(d_rank=0, d_tp=1, layers=decode_layers(pool)),
            NoopBackend(role="decode"),
            host=HOST,
            planner=planner,
        )
        self.prefill = PrefillWorker(
            ProducerConfig(p_rank=0, p_tp=1, session="", layers=prefill_layers(pool)),
            NoopBackend(role="prefill"),
        )
        rng = random.Random(seed)
        self.chunks: list[tuple[str, list[int], list[int]]] = []
        src_free = list(range(pool))
        dst_free = list(range(pool))
        if not contiguous:
            rng.shuffle(src_free)
            rng.shuffle(dst_free)
        target = DecodeTarget(HOST, self.decode.port, 1)
        for r in range(requests):
            ext = f"req-{r}"
            src = src_free[r * blocks : (r + 1) * blocks]
            dst = dst_free[r * blocks : (r + 1) * blocks]
            self.decode.add_request(ext, dst, dst)
            self.prefill.add_request(ext, target)
            self.chunks.append((ext, src, src))

    def step(self, layers: Sequence[int]) -> list[float]:
        """One engine step (the same blocks again, not final; every layer must be written,
        else the endpoint fails the requests): time each layer's round trip."""
        for ext, main, idx in self.chunks:
            self.prefill.schedule_chunk(ext, main, idx, 0, 0, False)
        out = []
        for layer in layers:
            t0 = time.perf_counter()
            self.prefill.layer_written(layer)
            if not self.prefill.wait_writable(layer, 30.0):
                raise TimeoutError(f"no reply for layer {layer} within 30 s")
            out.append(time.perf_counter() - t0)
        self.prefill.end_step()
        return out

    def close(self) -> None:
        ids = [ext for ext, _, _ in self.chunks]
        self.prefill.abort(ids)
        self.prefill.close()
        self.decode.close()


def run_shape(
    requests: int, blocks: int, repeats: int, *, contiguous: bool, seed: int
) -> tuple[float, float, int]:
    """Median round trip of OURS and BASELINE for one destination shape, and descriptors."""
    ours = Pair(build_descriptors, requests, blocks, contiguous=contiguous, seed=seed)
    base = Pair(baseline_descriptors, requests, blocks, contiguous=contiguous, seed=seed)
    try:
        for pair in (ours, base):  # warm-up: handshake, first allocations
            pair.step(range(LAYERS))
        t_ours: list[float] = []
        t_base: list[float] = []
        # Interleave so that a noisy neighbour slows both alike.
        while len(t_ours) < repeats:
            t_ours += ours.step(range(LAYERS))
            t_base += base.step(range(LAYERS))
        m = ours.decode.metrics
        desc = m.descriptors // max(1, m.reads)
        b = base.decode.metrics
        print(
            f"  per message: ours plan {m.plan_s / m.reads * 1e3:.2f} ms read-call "
            f"{m.read_s / m.reads * 1e3:.2f} ms; baseline plan {b.plan_s / b.reads * 1e3:.2f} ms "
            f"read-call {b.read_s / b.reads * 1e3:.2f} ms"
        )
        return statistics.median(t_ours), statistics.median(t_base), desc
    finally:
        ours.close()
        base.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 1 if a ratio is under ``--min-ratio``, else 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=256, help="main (and indexer) blocks per request")
    ap.add_argument("--repeats", type=int, default=24, help="layer messages per candidate (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-ratio", type=float, default=0.0, help="exit 1 below this ratio")
    args = ap.parse_args(argv)

    print(
        f"control-plane round trip of one layer message: {args.requests} requests x "
        f"{args.blocks} blocks (K 1024 B, V 128 B, indexer 128 B), no-copy backend, "
        f"real ZMQ on {HOST}, median of {args.repeats}"
    )
    print(f"{'destinations':<13}{'descs':>7}{'ours':>11}{'baseline':>12}{'ratio':>8}")
    ok = True
    for contiguous in (False, True):
        ours, base, desc = run_shape(
            args.requests, args.blocks, args.repeats, contiguous=contiguous, seed=args.seed
        )
        ratio = base / ours
        shape = "contiguous" if contiguous else "random"
        print(f"{shape:<13}{desc:>7}{ours * 1e3:>9.2f}ms{base * 1e3:>10.2f}ms{ratio:>7.1f}x")
        ok = ok and ratio >= args.min_ratio
    print("goal: ratio >= 10x (baseline = same runtime, plain per-request planner)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
