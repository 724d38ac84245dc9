"""``rd2h bench``: run the benchmarks in ``benchmarks/`` and print their ratio tables.

Each ``benchmarks/bench_*.py`` is a script with ``main(argv) -> int`` that measures ours
against a baseline in the same run; this command runs them one after another in this
process (or only those named) and reports which failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def default_dir() -> Path:
    """``benchmarks/`` of the source checkout this package runs from, else of the cwd."""
    beside = Path(__file__).resolve().parent.parent / "benchmarks"
    return beside if beside.is_dir() else Path.cwd() / "benchmarks"


def discover(folder: Path) -> dict[str, Path]:
    """Benchmark name (``codec`` for ``bench_codec.py``) -> script path."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(folder.glob("bench_*.py"))}


def run_one(path: Path, argv: Sequence[str]) -> int:
    spec = importlib.util.spec_from_file_location(f"rd2h_bench_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load benchmark {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result: int = module.main(list(argv))
    return result


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
    for name in chosen:
        print(f"\n=== {name} ({found[name].name}) ===", flush=True)
        start = time.perf_counter()
        try:
            code = run_one(found[name], [])
        except Exception as exc:  # report and go on with the others
            print(f"{name}: {type(exc).__name__}: {exc}")
            code = 1
        print(f"--- {name}: exit {code} in {time.perf_counter() - start:.1f} s", flush=True)
        if code:
            failed.append(name)
    summary = f"{len(chosen) - len(failed)} ok, {len(failed)} failed"
    print(f"\n{summary}: {', '.join(failed)}" if failed else f"\n{summary}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
