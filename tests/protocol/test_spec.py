"""The generated protocol reference (python -m rd2h_protocol.spec) stays in sync and readable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec.inspect as mi
import pytest

from rd2h_protocol import spec
from rd2h_protocol.checker.invariants import INVARIANTS
from rd2h_protocol.wire.messages import MESSAGE_TYPES, ReadReadyBatch

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_specs_match_the_code() -> None:
    assert spec.check(ROOT / "specs", spec.render_all()) == []


def test_check_reports_a_diff_and_main_fails_on_a_stale_folder(tmp_path: Path) -> None:
    assert spec.main(["--out", str(tmp_path)]) == 0
    assert spec.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "wire.md").write_text("stale\n", encoding="utf-8")
    (tmp_path / "api.md").unlink()
    assert spec.main(["--check", "--out", str(tmp_path)]) == 1
    diffs = spec.check(tmp_path, spec.render_all())
    assert any("wire.md (generated)" in line for line in diffs)
    assert any("api.md (on disk)" in line for line in diffs)


def test_wire_tables_list_every_field_with_the_version_that_added_it() -> None:
    wire = spec.render_wire()
    for cls in MESSAGE_TYPES.values():
        assert f"`{cls.__name__}`" in wire
    assert "| 7 | `seq` | int (>=0, <=9223372036854775807) or nil | `None` | v2 |" in wire
    assert "| 6 | `tp_ratio` | int (>=0, <=4294967295) | `1` | v1 |" in wire
    assert "| 4 | `done_ext_ids` | array<str (len<=4096)> (len<=16384) | `[]` | v1 |" in wire
    assert "`ReadReq` (nested array)" in wire


def test_every_machine_gets_a_mermaid_diagram_and_its_full_table() -> None:
    machines = spec.all_machines()
    text = spec.render_machines(machines)
    assert text.count("stateDiagram-v2") == len(machines) >= 8
    for machine in machines:
        assert f"## {machine.name}" in text
        assert f"    [*] --> {machine.initial}" in text
        rows = [line for line in text.splitlines() if line.startswith("| ")]
        for (state, event), (_, dest) in machine.table.items():
            assert any(f"| {state} | `{event}` |" in r and r.endswith(f"| {dest} |") for r in rows)
    data = json.loads(spec.render_machines_json(machines))
    assert [m["name"] for m in data] == [m.name for m in machines]


def test_invariants_and_api_are_rendered() -> None:
    text = spec.render_invariants()
    for inv in INVARIANTS:
        assert f"**{inv.name}** ({inv.kind})" in text
        assert inv.assumptions and all(f"assumes: {a}" in text for a in inv.assumptions)
        assert all(f"does not hold: {d}" in text for d in inv.does_not_hold)
    api = spec.render_api()
    assert "- `decode(frame: " in api
    assert "- `ProducerEndpoint`: " in api
    assert "- `PROTOCOL_VERSION`: constant: `2`" in api


@pytest.mark.parametrize(
    ("annotation", "rendered"),
    [
        (bool, "bool"),
        (float, "float"),
        (bytes, "bin"),
        (ReadReadyBatch, "ReadReadyBatch"),
    ],
)
def test_type_rendering(annotation: object, rendered: str) -> None:
    assert spec.render_type(mi.type_info(annotation)) == rendered


def test_module_entry_point_checks_the_repository_specs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rd2h_protocol.spec", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout
    assert "up to date" in proc.stdout
