"""``python -m rd2h_protocol.checker``: explore the configurations, report, exit 1 on a
violation.

Configurations run in parallel processes (``--jobs``, forked, so that each child shares
the parent's modules); results print in order, each with a shortest trace to any
violation, then one line of totals.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import replace

from rd2h_protocol.checker.configs import (
    CONFIGS,
    DESIGNED_STATES,
    FAULTS,
    VARIANT_STATES,
    max_states_of,
)
from rd2h_protocol.checker.explore import ExploreResult, Options, explore_star
from rd2h_protocol.checker.model import WorldConfig

__all__ = ["main"]


def _report(result: ExploreResult, max_states: int) -> None:
    if result.violation is not None:
        status = "stopped at a violation"
    elif result.complete:
        status = "complete"
    else:
        status = f"stopped at its bound of {max_states} states"
    print(
        f"{result.name}: {result.states} distinct states, {result.transitions} transitions, "
        f"depth {result.depth}, {result.final_states} final states, {status}, "
        f"{result.seconds:.1f} s ({result.cpu_seconds:.1f} s CPU)"
    )
    if result.expect:
        found = sorted(set(result.found) & result.expect)
        print(
            f"  expected to break {', '.join(sorted(result.expect))}: "
            f"found {', '.join(found) or 'none'}"
            + (f", MISSING {', '.join(result.missing)}" if result.missing else "")
        )
    for inv, (violation, trace) in result.found.items():
        label = "expected violation" if inv in result.expect else "VIOLATION"
        print(f"{label} {violation} after {len(trace)} steps:")
        for i, step in enumerate(trace, 1):
            print(f"  {i:3d}. {step}")
    sys.stdout.flush()


def _report_reduction(reduction: str, reduced: ExploreResult, plain: ExploreResult) -> None:
    print(
        f"{reduced.name}: {reduction} reduction {reduced.states} states, "
        f"{reduced.transitions} transitions in {reduced.cpu_seconds:.1f} s CPU, without "
        f"{plain.states} states, {plain.transitions} transitions in "
        f"{plain.cpu_seconds:.1f} s CPU: states x{plain.states / reduced.states:.2f}, "
        f"transitions x{plain.transitions / max(reduced.transitions, 1):.2f}, "
        f"CPU time x{plain.cpu_seconds / max(reduced.cpu_seconds, 1e-9):.2f}"
        + ("" if reduced.complete and plain.complete else " (bounded by --max-states)"),
        flush=True,
    )


# The reductions --compare-reduction measures (see rd2h_protocol.checker.canonical and,
# for sleep sets and inherited forms, rd2h_protocol.checker.explore).
_REDUCTIONS = ("symmetry", "duplicates", "sleep-sets", "inherited-forms")


def _variants(
    cfg: WorldConfig, options: Options, compare: str | None
) -> list[tuple[WorldConfig, Options]]:
    """How to explore ``cfg``: as asked, or (``compare``) with that reduction, then
    without."""
    if compare == "duplicates":
        return [
            (replace(cfg, duplicate_on_delivery=True), options),
            (replace(cfg, duplicate_on_delivery=False), options),
        ]
    if compare is not None:
        field = compare.replace("-", "_")
        return [(cfg, replace(options, **{field: True})), (cfg, replace(options, **{field: False}))]
    return [(cfg, options)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rd2h_protocol.checker [--config NAME ...] [--max-states N] [--jobs N]``.

    Configurations run in parallel processes (``--jobs``); results print in order.
    """
    parser = argparse.ArgumentParser(
        prog="python -m rd2h_protocol.checker",
        description="Explore every interleaving of small RD2H configurations and check the "
        "invariants (rd2h_protocol.checker.invariants) in every state.",
    )
    parser.add_argument(
        "--config",
        action="append",
        choices=sorted(CONFIGS),
        help="configuration to explore (repeatable; default: all)",
    )
    parser.add_argument(
        "--max-states",
        type=int,
        help="stop every configuration after this many distinct states (default: "
        f"{VARIANT_STATES} for a NAME+FAULT variant, fewer for prefill-first's, "
        f"{DESIGNED_STATES} for the others)",
    )
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="FAULT=N",
        help="set a fault budget of the chosen configurations (drop, dup, abort, "
        "prefill_abort, release, read_fail, kill, lose); repeatable",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="configurations explored at once, one process each (default: one per CPU)",
    )
    parser.add_argument(
        "--symmetry",
        action="store_true",
        help="merge states that differ by a permutation of interchangeable requests",
    )
    parser.add_argument(
        "--no-inherited-forms",
        action="store_true",
        help="build the canonical form of every endpoint of every state (the same states, "
        "more CPU)",
    )
    parser.add_argument(
        "--no-sleep-sets",
        action="store_true",
        help="take every enabled action in every state (no partial-order reduction; the "
        "same states, more transitions)",
    )
    parser.add_argument(
        "--compare-reduction",
        choices=_REDUCTIONS,
        help="explore every chosen configuration with and without this reduction and print "
        "the ratios of states, transitions and CPU time",
    )
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    args = parser.parse_args(argv)
    overrides: dict[str, int] = {}
    for item in args.budget:
        fault, _, count = item.partition("=")
        if fault not in FAULTS or not count.isdigit():
            parser.error(f"--budget expects FAULT=N with FAULT in {', '.join(FAULTS)}: {item!r}")
        overrides[fault] = int(count)
    if args.list:
        for name, cfg in CONFIGS.items():
            print(f"{name}: {cfg}")
        return 0
    names = args.config or list(CONFIGS)
    cfgs = [CONFIGS[name] for name in names]
    if overrides:
        cfgs = [replace(c, budgets=tuple({**dict(c.budgets), **overrides}.items())) for c in cfgs]
    bounds = [args.max_states or max_states_of(name) for name in names]
    asked = Options(
        symmetry=args.symmetry,
        sleep_sets=not args.no_sleep_sets,
        inherited_forms=not args.no_inherited_forms,
    )
    work = [
        (name, variant, bound, options)
        for name, cfg, bound in zip(names, cfgs, bounds, strict=True)
        for variant, options in _variants(cfg, asked, args.compare_reduction)
    ]
    jobs = min(len(work), args.jobs or os.cpu_count() or 1)
    total_states = 0
    failed = 0
    incomplete = 0
    with contextlib.ExitStack() as stack:
        results: Iterator[ExploreResult] = map(explore_star, work)
        if jobs > 1:
            pool = stack.enter_context(multiprocessing.get_context("fork").Pool(jobs))
            results = pool.imap(explore_star, work)  # in order, each as soon as it can
        for bound in bounds:
            result = next(results)
            _report(result, bound)
            if args.compare_reduction:
                _report_reduction(args.compare_reduction, result, next(results))
            total_states += result.states
            incomplete += not result.complete
            failed += not result.passed
    print(
        f"explored {len(names)} configurations, {total_states} states, "
        f"incomplete={incomplete} violations={failed}"
    )
    return 1 if failed else 0
