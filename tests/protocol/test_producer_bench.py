"""The Prefill machines benchmark runs, and its table path agrees with the Machine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def test_bench_machines_runs_small(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_machines.py"
    spec = importlib.util.spec_from_file_location("bench_machines", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--transitions", "50", "--repeats", "1", "--requests", "3", "--steps", "2"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out
    assert out.count("x\n") == 4  # one ratio per Prefill machine
    for phase in ("layer_written", "encode", "receive", "total"):
        assert f"\n{phase} " in out
