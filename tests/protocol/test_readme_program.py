"""The README's program that drives both endpoints runs, and uses only the public API."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_program() -> str:
    match = re.search(r"<!-- readme-program -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert match, "README.md lost its <!-- readme-program --> block"
    return match.group(1)


def test_readme_program_is_short_and_imports_only_the_package_root() -> None:
    program = readme_program()
    assert len(program.splitlines()) <= 40
    imports = re.findall(r"^(?:from|import) (\S+)", program, re.M)
    assert set(imports) == {"rd2h_protocol"}


def test_readme_program_moves_a_request_over_every_layer() -> None:
    done = subprocess.run(
        [sys.executable, "-c", readme_program()],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "read model.layers.0.attn [(1, 2, 3)]",
        "read model.layers.1.attn [(1, 2, 3)]",
    ]
