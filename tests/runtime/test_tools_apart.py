"""The runtime proper never imports its tools (``rd2h_runtime.tools``)."""

from __future__ import annotations

import subprocess
import sys

RUNTIME_PROPER = (
    "decode",
    "prefill",
    "worker",
    "planning",
    "control",
    "transfer",
    "proxy",
    "trace",
)


def test_runtime_proper_imports_no_tool() -> None:
    code = (
        "import sys\n"
        + "".join(f"import rd2h_runtime.{name}\n" for name in RUNTIME_PROPER)
        + "print(sorted(m for m in sys.modules if m.startswith('rd2h_runtime.tools')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
