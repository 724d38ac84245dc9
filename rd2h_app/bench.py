"""``rd2h bench``: run the benchmarks in ``benchmarks/`` and print their ratio tables.

Each ``benchmarks/bench_*.py`` is a script that measures ours against a baseline in the
same run; this command runs them one after another, each in its own process (or only
those named), and reports which failed. ``runtime_datapath`` runs twice where network
namespaces can be made (root, iproute2): on one host, then with ``--netns`` across a veth
pair between two namespaces (Prefill and Decode as two hosts), 15 samples per median.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rd2h_runtime.testing import netns


def default_dir() -> Path:
    """``benchmarks/`` of the source checkout this package runs from, else of the cwd."""
    beside = Path(__file__).resolve().parents[2] / "benchmarks"
    return beside if beside.is_dir() else Path.cwd() / "benchmarks"


def discover(folder: Path) -> dict[str, Path]:
    """Benchmark name (``codec`` for ``bench_codec.py``) -> script path."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(folder.glob("bench_*.py"))}


def variants(name: str) -> list[list[str]]:
    """The argument lists benchmark ``name`` runs with (one run each)."""
    if name == "runtime_datapath" and netns.unavailable() is None:
        # Reads over the veth swing +-30 % on a loaded machine: more samples per median.
        return [[], ["--netns", "--repeats", "15"]]
    return [[]]


def run_one(path: Path, argv: Sequence[str]) -> int:
    """Run one benchmark script as ``python -m <folder>.<script>`` from the folder's parent.

    A child process per benchmark, as their own docs run them: some start worker
    processes that must import the benchmark module by name, and none inherits another's
    threads, caches or warmed-up memory.
    """
    module = f"{path.parent.name}.{path.stem}"
    proc = subprocess.run(
        [sys.executable, "-m", module, *argv], cwd=path.parent.parent, check=False
    )
    return proc.returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rd2h bench", description=__doc__)
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--dir", type=Path, default=None, help="benchmarks folder")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    folder = args.dir or default_dir()
    found = discover(folder)
    if not found:
        print(f"rd2h bench: no bench_*.py in {folder} (run from a source checkout)")
        return 2
    if args.list:
        print("\n".join(found))
        return 0
    unknown = [n for n in args.names if n not in found]
    if unknown:
        print(f"rd2h bench: unknown benchmark(s) {', '.join(unknown)}; have {', '.join(found)}")
        return 2
    failed = []
    chosen = args.names or list(found)
    runs = [(name, extra) for name in chosen for extra in variants(name)]
    for name, extra in runs:
        label = " ".join([name, *extra])
        print(f"\n=== {label} ({found[name].name}) ===", flush=True)
        start = time.perf_counter()
        code = run_one(found[name], extra)
        print(f"--- {label}: exit {code} in {time.perf_counter() - start:.1f} s", flush=True)
        if code:
            failed.append(label)
    summary = f"{len(runs) - len(failed)} ok, {len(failed)} failed"
    print(f"\n{summary}: {', '.join(failed)}" if failed else f"\n{summary}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
