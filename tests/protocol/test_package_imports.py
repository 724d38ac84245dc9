"""What ``import rd2h_protocol`` loads: the sans-IO core needs msgspec and nothing else.

The model checker (rd2h_protocol.checker), hypothesis and transitions serve the tests, the
docs generator and ``MachineSpec.build_machine``; the core must never pull them in, so that
another connector can reuse it with msgspec alone. Checked in a fresh interpreter, since
this test process has imported everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys
before = set(sys.modules)
import {module}
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _loaded_by(module: str) -> list[str]:
    """The modules ``import module`` loads in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded: list[str] = json.loads(proc.stdout)
    return loaded


def _third_party(modules: list[str]) -> set[str]:
    tops = {m.partition(".")[0] for m in modules}
    return {t for t in tops if t not in sys.stdlib_module_names and t != "rd2h_protocol"}


def test_importing_the_core_loads_neither_the_checker_nor_its_tools() -> None:
    loaded = _loaded_by("rd2h_protocol")
    assert "rd2h_protocol" in loaded
    for name in ("rd2h_protocol.checker", "hypothesis", "transitions"):
        offending = [m for m in loaded if m == name or m.startswith(name + ".")]
        assert not offending, f"import rd2h_protocol loaded {offending}"


def test_the_only_third_party_module_the_core_loads_is_msgspec() -> None:
    # msgspec itself may load optional helpers (typing_extensions where installed): those
    # are msgspec's, not the core's.
    by_msgspec = _third_party(_loaded_by("msgspec")) - {"msgspec"}
    by_core = _third_party(_loaded_by("rd2h_protocol"))
    assert "msgspec" in by_core
    assert sorted(by_core - by_msgspec) == ["msgspec"]
