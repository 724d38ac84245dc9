"""`rd2h demo`: the README's main command, run small, through the real CLI entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rd2h_app import demo

SMALL = [
    "--prefill-tp", "2", "--decode-tp", "1", "--requests", "3", "--wave", "2",
    "--layers", "4", "--buffers", "2", "--tokens", "200", "--chunk-tokens", "80",
    "--k-bytes", "64", "--v-bytes", "16", "--timeout", "60",
]  # fmt: skip


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rd2h_app.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["nixl", "mooncake", "cma"])
def test_demo_moves_and_verifies_every_request(backend: str) -> None:
    proc = run_cli(*SMALL, "--backend", backend, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)  # stdout holds the JSON report and nothing else
    assert report["ok"] is True
    assert report["verified"] == report["requests"] == 3
    assert report["chunks_per_request"] == 3  # 200 tokens in 80-token chunks
    assert report["bytes_moved"] > 0
    assert report["round_trips"] > 0
    assert report["failures"] == []


@pytest.mark.timeout(180)
def test_demo_v1_prints_the_summary_table_within_80_columns() -> None:
    proc = run_cli(*SMALL, "--backend", "mooncake", "--v1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].endswith("protocol v1")
    assert lines[-1] == "verified: 3/3 requests byte-exact"
    assert all(len(line) <= 80 for line in lines), lines


def test_demo_refuses_a_topology_it_cannot_run() -> None:
    with pytest.raises(SystemExit, match="multiple of --decode-tp"):
        demo.main(["--prefill-tp", "3", "--decode-tp", "2"])


def test_report_percentiles_and_failure_make_the_run_fail() -> None:
    report = demo.DemoReport("nixl", "v2", 2, 1, 2, 4, 2, 3, round_trip_ms=[1.0, 2.0, 3.0])
    report.verified = 2
    assert report.ok
    assert report.percentile(0.5) == pytest.approx(2.0)
    report.failures.append("r1: failed on Decode")
    assert not report.ok
    assert "FAILED: r1" in demo.render(report)
