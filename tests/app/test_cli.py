"""The `rd2h` command: dispatch, help, and `rd2h bench` discovery."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rd2h_app import bench, cli

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINT = "rd2h_app.cli:main"


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in ("demo", "check-read", "bench", "spec", "proxy"):
        assert f"  {name} " in out


def test_unknown_command_exits_2_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["launch"]) == 2
    assert "unknown command 'launch'" in capsys.readouterr().err


def test_subcommand_arguments_reach_the_module(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert {"codec", "planning", "machines", "control_plane"} <= set(listed)


def test_bench_refuses_unknown_names_and_empty_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(["nope"]) == 2
    assert "unknown benchmark(s) nope" in capsys.readouterr().out
    assert bench.main(["--dir", str(tmp_path)]) == 2
    assert "no bench_*.py" in capsys.readouterr().out


def test_bench_runs_the_named_scripts_and_reports_failures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "mybench"
    folder.mkdir()
    (folder / "bench_ok.py").write_text("import sys\nprint('ratio 12x')\nsys.exit(0)\n")
    (folder / "bench_bad.py").write_text("raise RuntimeError('boom')\n")
    assert bench.main(["--dir", str(folder), "ok"]) == 0
    assert bench.main(["--dir", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "--- bad: exit 1" in out
    assert "1 ok, 1 failed: bad" in out


def test_pyproject_declares_the_entry_point_that_exists() -> None:
    assert f'rd2h = "{ENTRY_POINT}"' in (ROOT / "pyproject.toml").read_text()
    assert importlib.metadata.EntryPoint("rd2h", ENTRY_POINT, "console_scripts").load() is cli.main


def test_console_script_is_installed() -> None:
    # An `rd2h` installed from another checkout may name another module path; then the
    # same entry point runs as `python -m`.
    exe = shutil.which("rd2h")
    installed = [
        e.value for e in importlib.metadata.entry_points(group="console_scripts", name="rd2h")
    ]
    command = (
        [exe] if exe and installed == [ENTRY_POINT] else [sys.executable, "-m", "rd2h_app.cli"]
    )
    proc = subprocess.run(
        [*command, "--help"], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT
    )
    assert proc.returncode == 0
    assert "usage: rd2h <command>" in proc.stdout


def test_bench_runs_the_data_path_across_namespaces_where_they_can_be_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench.netns, "unavailable", lambda: None)
    assert bench.variants("runtime_datapath") == [[], ["--netns", "--repeats", "15"]]
    assert bench.variants("codec") == [[]]
    monkeypatch.setattr(bench.netns, "unavailable", lambda: "network namespaces need root")
    assert bench.variants("runtime_datapath") == [[]]
