"""Imports point one way: rd2h_protocol and rd2h_runtime never import vLLM (or torch)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    import rd2h_protocol, rd2h_runtime
    for pkg in (rd2h_protocol, rd2h_runtime):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not info.name.endswith("__main__"):  # a __main__ runs a CLI on import
                importlib.import_module(info.name)
    leaked = sorted({m.split(".")[0] for m in sys.modules} & {"vllm", "torch"})
    print(",".join(leaked))
    """
)


def test_protocol_and_runtime_import_without_vllm() -> None:
    # A fresh interpreter: this test process has vLLM loaded already (conftest).
    result = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=50, check=True
    )
    assert result.stdout.strip() == "", f"imported by rd2h_protocol/rd2h_runtime: {result.stdout}"
