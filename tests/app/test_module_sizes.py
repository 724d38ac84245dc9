"""No module of the five packages is over 600 lines (issue 25): a module that grows past it
is split by concern, as the endpoints and the machines were."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rd2h_protocol", "rd2h_runtime", "rd2h_vllm", "rd2h_proxy", "rd2h_app")
MAX_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
    }
    assert len(sizes) > 100  # the packages were found
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
