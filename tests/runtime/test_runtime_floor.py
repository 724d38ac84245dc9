"""The runtime's floor: it imports neither its testing helpers, nor anything above it, nor
an HTTP stack.

``lint-imports`` (the contracts of ``[tool.importlinter]`` in pyproject.toml) states the
rule for every import written down; this test checks what a fresh interpreter actually
loads, imports made by name included.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUNTIME_PROPER = (
    "rd2h_runtime",
    "rd2h_runtime.claims",
    "rd2h_runtime.connection_health",
    "rd2h_runtime.control",
    "rd2h_runtime.decode",
    "rd2h_runtime.decode_reads",
    "rd2h_runtime.decode_refusals",
    "rd2h_runtime.prefill",
    "rd2h_runtime.regions",
    "rd2h_runtime.worker",
    "rd2h_runtime.planning",
    "rd2h_runtime.planning_addresses",
    "rd2h_runtime.transfer",
    "rd2h_runtime.trace",
)
ABOVE_OR_BESIDE = ("rd2h_runtime.testing", "rd2h_app", "rd2h_proxy", "rd2h_vllm")
HTTP_AND_UI = ("aiohttp", "httpx", "rich", "matplotlib")


def test_runtime_proper_loads_nothing_above_it_and_no_http_stack() -> None:
    code = (
        "import json, sys\n"
        + "".join(f"import {name}\n" for name in RUNTIME_PROPER)
        + "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    offending = [
        m
        for m in loaded
        for top in ABOVE_OR_BESIDE + HTTP_AND_UI
        if m == top or m.startswith(top + ".")
    ]
    assert offending == []


def test_the_import_contracts_hold() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout
