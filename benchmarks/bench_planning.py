"""Benchmark: vectorised read planning against the plain per-request planner.

Run from the repository root (or anywhere once rd2h is installed)::

    python -m benchmarks.bench_planning            # 64 requests x 256 blocks, default
    python -m benchmarks.bench_planning --requests 8 --blocks 32 --repeats 3

One readiness message of ``--requests`` requests with ``--blocks`` main blocks and as many
indexer blocks each (K 1024 B, V 128 B, indexer 128 B per block), in three shapes: random
Prefill and Decode ids, contiguous Prefill ids with random destinations (in both nothing
merges) and contiguous ids on both sides (one run per request). For each shape it times,
in the same run, the BASELINE (the plain per-request loop below) and
:func:`rd2h_runtime.planning.build_descriptors` with the ids given as Python lists, as
numpy arrays and as tuples planned again (what every layer after the first of an engine
step costs: the Decode endpoint hands out tuples, whose runs the planner keeps), checks
that they give the same descriptors, and prints the medians and the speed-up ratios.
Goal: >= 10x on the planning step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

import numpy as np

from rd2h_protocol.plan import ComponentAddrs, ReadPlan, RequestRead
from rd2h_runtime.planning import build_descriptors

Triple = tuple[int, int, int]


def baseline_planner(plan: ReadPlan) -> list[Triple]:
    """BASELINE, not the library: the reference rule as a plain loop over every block.

    Same rule and order as rd2h_runtime.planning (component-major; within a component
    requests in plan order; merge while remote and local addresses are both contiguous).
    """
    out: list[Triple] = []
    for comps, group in ((plan.main, "main"), (plan.indexer, "indexer")):
        for comp in comps:
            for req in plan.requests:
                src: Sequence[int] = getattr(req, f"{group}_src")
                dst: Sequence[int] = getattr(req, f"{group}_dst")
                run: list[int] | None = None
                for pid, did in zip(src, dst, strict=True):
                    remote = comp.src_base + int(pid) * comp.block_bytes
                    local = comp.dst_base + int(did) * comp.block_bytes
                    if run is not None and remote == run[0] + run[2] and local == run[1] + run[2]:
                        run[2] += comp.block_bytes
                        continue
                    if run is not None:
                        out.append((run[0], run[1], run[2]))
                    run = [remote, local, comp.block_bytes]
                if run is not None:
                    out.append((run[0], run[1], run[2]))
    return out


# Bases like a real process's: high user-space addresses, K and V 1 GiB apart.
_P_BASE = 0x7F00_0000_0000
_D_BASE = 0x5500_0000_0000
_GIB = 1 << 30


SHAPES = {  # name: (Prefill ids contiguous, Decode ids contiguous)
    "random": (False, False),
    "dst-random": (True, False),
    "contiguous": (True, True),
}


FORMS = ("lists", "numpy", "tuples")  # how the ids are given; tuples: planned again


def make_plan(requests: int, blocks: int, *, shape: str, form: str, seed: int) -> ReadPlan:
    """A message's plan with the given shape and id form; the same seed gives the same ids."""
    rng = random.Random(seed)
    pool = requests * blocks * 2  # the caches have room for twice what is read
    src_contiguous, dst_contiguous = SHAPES[shape]

    def ids(start: int, contiguous: bool) -> Sequence[int]:
        if contiguous:
            values = list(range(start, start + blocks))
        else:
            values = rng.sample(range(pool), blocks)
        if form == "tuples":
            return tuple(values)
        # build_descriptors takes numpy id arrays as well; RequestRead types them as Sequence.
        return (
            cast("Sequence[int]", np.asarray(values, dtype=np.int64)) if form == "numpy" else values
        )

    reqs = []
    for r in range(requests):
        src, dst = r * blocks, pool - (r + 1) * blocks
        p_ids = partial(ids, src, src_contiguous)
        d_ids = partial(ids, dst, dst_contiguous)
        reqs.append(RequestRead(f"req-{r}", p_ids(), d_ids(), p_ids(), d_ids()))

    def comp(name: str, offset: int, block_bytes: int) -> ComponentAddrs:
        return ComponentAddrs(name, _P_BASE + offset, _D_BASE + offset, block_bytes)

    return ReadPlan(
        read_id=0,
        session="bench",
        layer_name="model.layers.0.self_attn",
        main=(comp("k", 0, 1024), comp("v", _GIB, 128)),
        indexer=(comp("indexer", 2 * _GIB, 128),),
        requests=tuple(reqs),
    )


def interleaved_medians(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each function, timed in turn within every repeat.

    Interleaving spreads a noisy neighbour's load over all contenders alike.
    """
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0, or 1 if outputs differ or a ratio is under --min-ratio."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=256, help="main (and indexer) blocks per request")
    ap.add_argument("--repeats", type=int, default=15, help="timed runs per planner (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--min-ratio", type=float, default=0.0, help="exit 1 if a lists-input ratio is below this"
    )
    args = ap.parse_args(argv)

    print(
        f"read planning: {args.requests} requests x {args.blocks} blocks "
        f"(K 1024 B, V 128 B, indexer 128 B), median of {args.repeats}"
    )
    print(f"{'ids':<11}{'input':<7}{'descs':>7}{'baseline':>12}{'vectorised':>12}{'ratio':>8}")
    ok = True
    for shape in SHAPES:
        for form in FORMS:
            plan = make_plan(args.requests, args.blocks, shape=shape, form=form, seed=args.seed)
            expected = baseline_planner(plan)
            got = build_descriptors(plan)
            columns = (got.remote_addrs.tolist(), got.local_addrs.tolist(), got.lengths.tolist())
            same = expected == list(zip(*columns, strict=True))
            if not same:
                print(f"MISMATCH: {shape} ids, {form}: vectorised != baseline")
                ok = False
                continue
            base, vec = interleaved_medians(
                [partial(baseline_planner, plan), partial(build_descriptors, plan)], args.repeats
            )
            ratio = base / vec
            print(
                f"{shape:<11}{form:<7}{len(got):>7}{base * 1e3:>10.2f}ms"
                f"{vec * 1e3:>10.3f}ms{ratio:>7.1f}x"
            )
            if form == "lists" and ratio < args.min_ratio:
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
