"""The protocol trace: recorded by the workers, merged into a timeline, replayed.

``rd2h demo --trace`` (real processes, nixl) and in-process loopback engines record
traces; ``rd2h trace`` turns them into Chrome trace-event JSON that must be well formed;
``rd2h trace check`` replays them against fresh sans-IO endpoints without a divergence,
and reports a record planted out of order and a layer written into a closed storage.
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rd2h_app import breakdown, timeline
from rd2h_protocol.checker import replay as trace_check
from rd2h_protocol.producer import ProducerConfig, ProducerEndpoint
from rd2h_runtime import trace
from rd2h_runtime.testing.engines import DecodeEngine, DecodeSpec, PrefillEngine, PrefillSpec
from rd2h_runtime.testing.synthetic import RequestSpec, SyntheticModel

SMALL = [
    "--prefill-tp", "2", "--decode-tp", "1", "--requests", "3", "--wave", "2",
    "--layers", "4", "--buffers", "2", "--tokens", "200", "--chunk-tokens", "80",
    "--k-bytes", "64", "--v-bytes", "16", "--timeout", "60",
]  # fmt: skip


def run_loopback(trace_dir: Path, requests: int = 4, layers: int = 6) -> None:
    """Prefill TP 2 -> Decode TP 1 in this process (loopback), a ring of 2 buffers."""
    model = SyntheticModel(num_layers=layers, num_buffers=2)
    decode = DecodeEngine(DecodeSpec(model, trace_dir=str(trace_dir)))
    try:
        prefill = PrefillEngine(PrefillSpec(model, p_tp=2, trace_dir=str(trace_dir)))
        try:
            reqs = [RequestSpec(f"r{i}", 150, chunk_tokens=64) for i in range(requests)]
            decode.add(reqs)
            prefill.add(reqs, decode.target())
            assert prefill.run(30.0) == []
            ids = [r.ext_id for r in reqs]
            results = decode.wait(ids, 30.0)
            assert all(r.ok and not r.mismatches for r in results.values()), results
            finished = prefill.wait(ids, 30.0)
            assert all(f is not None and f[0].ok for per in finished.values() for f in per)
            prefill.release(ids)
            assert decode.release(ids)
        finally:
            prefill.close()
    finally:
        decode.close()


@pytest.fixture(scope="module")
def loopback_traces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    trace_dir = tmp_path_factory.mktemp("loopback-trace")
    run_loopback(trace_dir)
    yield trace_dir


def check_trace_events(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace-event format: every event has ph/ts/pid/tid, B/E pairs balance per
    track and never close what is not open, X events have a duration >= 0."""
    events = doc["traceEvents"]
    assert events
    open_: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
    for ev in sorted(
        (e for e in events if e["ph"] in "BE"), key=lambda e: (e["ts"], e["ph"] == "B")
    ):
        key = (ev["pid"], ev["tid"])
        if ev["ph"] == "B":
            open_[key].append(ev["name"])
        else:
            assert open_[key], f"E without B on track {key}: {ev}"
            assert open_[key].pop() == ev["name"]
    assert not any(open_.values()), open_
    for ev in events:
        assert {"ph", "ts", "pid", "tid"} <= set(ev), ev
        assert isinstance(ev["ts"], int | float) and ev["ts"] >= 0
        if ev["ph"] == "X":
            assert ev["dur"] >= 0
    return list(events)


@pytest.mark.timeout(180)
def test_demo_trace_builds_a_timeline_and_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace_dir = tmp_path / "trace"
    proc = subprocess.run(
        [sys.executable, "-m", "rd2h_app.cli", "demo", *SMALL, "--trace", str(trace_dir)],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"rd2h trace {trace_dir}" in proc.stdout  # the command to run next
    files = sorted(p.name for p in trace_dir.glob("*.ndjson"))
    assert [f.split("-")[:2] for f in files] == [
        ["decode", "r0"],
        ["prefill", "r0"],
        ["prefill", "r1"],
    ]
    out = tmp_path / "timeline.json"
    assert timeline.main([str(trace_dir), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "clock offsets used:" in text and "publish->read start" in text
    assert "slowest requests" in text and "gate waits longer than" in text
    events = check_trace_events(json.loads(out.read_text()))
    names = {e["name"] for e in events}
    assert any(n.startswith("publish L") for n in names)
    assert any(e["ph"] == "X" and e["name"].startswith("read ") for e in events)
    assert {e["pid"] for e in events} == {1, 2, 3}  # one process track per rank
    assert trace_check.main([str(trace_dir)]) == 0
    assert "3/3 traces replay without divergence" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_loopback_trace_timeline_summary_and_replay(
    loopback_traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    streams = timeline.load_streams([str(loopback_traces)])
    assert sorted((s.role, s.rank) for s in streams) == [
        ("decode", 0),
        ("prefill", 0),
        ("prefill", 1),
    ]
    tl = timeline.build_timeline(streams)
    check_trace_events({"traceEvents": tl.events})
    # Every readiness was answered and its publish found on Prefill; each was read, unless
    # answered on receipt (a contributor this Decode rank does not read from).
    assert len(tl.transfers) == 2 * 6 * 3  # 2 Prefill ranks x 6 layers x 3 chunks
    assert all(t.publish is not None and t.reply is not None for t in tl.transfers)
    assert all(t.gate_open is not None for t in tl.transfers)
    read = [t for t in tl.transfers if t.reply != t.received]
    assert len(read) >= 6 * 3 and all(t.read_end is not None for t in read)
    for t in read:
        assert t.publish is not None and t.read_start is not None and t.reply is not None
        assert t.publish <= t.received <= t.read_start <= t.reply
    ids = {i for t in tl.transfers for i in t.ids}
    assert ids == {"r0", "r1", "r2", "r3"}
    for result in map(trace_check.replay, streams):
        assert result.ok, result.divergence
        assert result.calls > 0
    png = tmp_path / "t.png"
    assert (
        timeline.main([str(loopback_traces), "-o", str(tmp_path / "t.json"), "--png", str(png)])
        == 0
    )
    out = capsys.readouterr().out
    # matplotlib comes with the test extra (rd2h[timeline]).
    assert f"png: {png}" in out and png.stat().st_size > 10_000, out


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _prefill_file(trace_dir: Path) -> Path:
    return sorted(trace_dir.glob("prefill-r0-*.ndjson"))[0]


def _dependent_pair(records: list[dict[str, Any]]) -> tuple[int, int]:
    """Two calls in the second half whose order matters, whatever the run's timing: on
    Decode a readiness that started read R and ``read_finished(R)``; on Prefill a layer's
    publication and the reply to it. (Two calls that merely differ may commute.)"""
    half = len(records) // 2
    for i, rec in enumerate(records[half:], half):
        outs = rec.get("o") or []
        if rec.get("op") == "receive" and "read_id" in str(outs):
            started = {o["read_id"] for o in outs if o.get("o") == "start_read"}
            for j, later in enumerate(records[i + 1 :], i + 1):
                if later.get("op") == "read_finished" and later["a"]["read_id"] in started:
                    return i, j
        if rec.get("op") == "layer_written" and any(o.get("o") == "send" for o in outs):
            layer = rec["a"]["layer_idx"]
            for j, later in enumerate(records[i + 1 :], i + 1):
                replied = [o for o in later.get("o") or [] if o.get("o") == "replied"]
                if later.get("op") == "receive" and any(o["layer"] == layer for o in replied):
                    return i, j
    raise AssertionError("no dependent pair of calls in the trace")


@pytest.mark.timeout(60)
def test_a_record_out_of_order_is_reported(
    loopback_traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for role in ("prefill", "decode"):
        [src] = sorted(loopback_traces.glob(f"{role}-r0-*.ndjson"))
        lines = _lines(src)
        i, j = _dependent_pair([json.loads(line) for line in lines])
        a_rec, b_rec = json.loads(lines[i]), json.loads(lines[j])
        # Swapped with their times, so the times stay in order: only the replay can tell.
        a_rec["t"], b_rec["t"] = b_rec["t"], a_rec["t"]
        swapped = list(lines)
        swapped[i], swapped[j] = json.dumps(b_rec), json.dumps(a_rec)
        # In order, but one record's time before its predecessor's.
        late = json.loads(lines[j])
        before = next(r for r in map(json.loads, reversed(lines[:j])) if r["k"] == "call")
        late["t"] = before["t"] - 0.001
        backwards = list(lines)
        backwards[j] = json.dumps(late)
        for planted_lines, line, says in (
            (swapped, i, "DIVERGED"),
            (backwards, j, "time goes backwards"),
        ):
            planted = tmp_path / src.name
            planted.write_text("\n".join(planted_lines) + "\n")
            assert trace_check.main([str(planted)]) == 1
            out = capsys.readouterr().out
            assert "DIVERGED" in out and says in out, out
            assert f"{src.name}:{line + 1} " in out, out


@pytest.mark.timeout(60)
def test_a_layer_written_into_a_closed_storage_is_reported(
    loopback_traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Plant a write before the reply that opened its storage's gate: the replay refuses it."""
    src = _prefill_file(loopback_traces)
    lines = _lines(src)
    recs = [json.loads(line) for line in lines]
    # A layer_written that had to wait: the gate record right before it.
    w = next(
        i
        for i, r in enumerate(recs)
        if r["k"] == "call" and r["op"] == "layer_written" and recs[i - 1]["k"] == "gate"
    )
    # The call that opened that storage's gate: the last gate_opened of its slot before.
    config = msgspec.convert(recs[0]["config"], ProducerConfig)
    slots = set(ProducerEndpoint(config).layer_slots(recs[w]["a"]["layer_idx"]))
    g = max(
        i
        for i, r in enumerate(recs[:w])
        if r["k"] == "call"
        and any(o["o"] == "gate_opened" and o["slot"] in slots for o in r.get("o", ()))
    )
    moved = dict(recs[w], t=recs[g]["t"])
    lines = [*lines[:g], json.dumps(moved), *lines[g:w], *lines[w + 1 :]]
    planted = tmp_path / src.name
    planted.write_text("\n".join(lines) + "\n")
    assert trace_check.main([str(planted)]) == 1
    out = capsys.readouterr().out
    assert "whose gate is not open" in out, out


@pytest.mark.timeout(60)
def test_clock_offsets_between_hosts_are_estimated(loopback_traces: Path) -> None:
    """Decode's trace moved to another 'host' 2.5 s ahead: the offset estimated from
    readiness/reply pairs undoes it, and the transfers keep their order."""
    streams = timeline.load_streams([str(loopback_traces)])
    skew = 2.5
    for s in streams:
        if s.role == "decode":
            s.header["boot"] = "another-boot"
            for r in s.records:
                for key in ("t", "t0", "t1"):
                    if key in r:
                        r[key] += skew
    tl = timeline.build_timeline(streams)
    [line] = [n for n in tl.notes if "another" in n]
    offset_ms = float(line.split("offset ")[1].split(" ms")[0])
    assert abs(offset_ms - skew * 1e3) < 50, line  # within the one-way delay asymmetry
    for t in tl.transfers:
        assert t.publish is not None
        assert t.received >= t.publish - 0.05
        if t.read_start is not None:
            assert t.read_start >= t.publish - 0.05


@pytest.mark.timeout(60)
def test_tracing_is_off_by_default_and_on_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(trace.ENV_VAR, raising=False)
    assert trace.open_tracer(None, "prefill", 0, {}) is None
    model = SyntheticModel(num_layers=2)
    engine = DecodeEngine(DecodeSpec(model))
    try:
        assert all(w._tracer is None for w in engine.workers)
    finally:
        engine.close()
    monkeypatch.setenv(trace.ENV_VAR, str(tmp_path / "env"))
    engine = DecodeEngine(DecodeSpec(model))
    engine.close()
    [path] = (tmp_path / "env").glob("decode-r0-*.ndjson")
    header = json.loads(_lines(path)[0])
    assert header["k"] == "hdr" and header["role"] == "decode" and header["part"] == 0


@pytest.mark.timeout(60)
def test_rotated_parts_are_joined_and_a_lost_first_part_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace, "DEFAULT_MAX_BYTES", 4096)
    run_loopback(tmp_path, requests=2, layers=3)
    parts = sorted(tmp_path.glob("prefill-r0-*.ndjson"))
    assert len(parts) > 2
    streams = timeline.load_streams([str(tmp_path)])
    for s in streams:
        assert s.complete and trace_check.replay(s).ok
    first = min(parts, key=lambda p: p.name.count("."))
    first.unlink()
    [s] = [s for s in timeline.load_streams([str(tmp_path)]) if s.label.startswith("prefill r0")]
    result = trace_check.replay(s)
    assert not result.ok and "cannot replay" in (result.divergence or "")


def requests_in(trace_dir: Path) -> list[breakdown.RequestMoments]:
    return breakdown.moments(timeline.build_timeline(timeline.load_streams([str(trace_dir)])))


@pytest.mark.timeout(60)
def test_trace_requests_joins_scheduler_marks_with_the_transfers(
    loopback_traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The loopback run's traces, and a scheduler's marks written by a real Tracer around
    # each request's transfer (tests/serving checks the vLLM connector's own marks).
    trace_dir = tmp_path / "traces"
    shutil.copytree(loopback_traces, trace_dir)
    found = {r.ext_id: r.at for r in requests_in(trace_dir)}
    assert sorted(found) == ["r0", "r1", "r2", "r3"]
    marks = trace.open_marks(str(trace_dir), "decode scheduler")
    assert marks is not None
    for ext, at in found.items():
        assert at["first_publish"] <= at["first_received"] <= at["last_read_end"] <= at["d_done"]
        marks.mark("admitted", at["first_publish"] - 0.004, req=f"cmpl-{ext}", ext=ext)
        marks.mark("loaded", at["d_done"] + 0.001, req=f"cmpl-{ext}", ext=ext)
        marks.mark("scheduled", at["d_done"] + 0.003, req=f"cmpl-{ext}", ext=ext)
    marks.close()
    png = tmp_path / "request.png"
    assert breakdown.main([str(trace_dir), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"png: {png}" in out and png.stat().st_size > 10_000, out
    rows = {r.stage: r for r in breakdown.stage_rows(requests_in(trace_dir))}
    assert "decode-first:" in out and "prefill-first:" not in out, out
    assert rows["request done -> scheduler noticed"].count == 4
    assert rows["request done -> scheduler noticed"].p50_ms == pytest.approx(1.0, abs=1e-6)
    assert rows["scheduler noticed -> first step"].p50_ms == pytest.approx(2.0, abs=1e-6)
    assert rows["first -> last layer published"].count == 4
    assert "Decode admitted -> Prefill admitted" not in rows  # no Prefill marks here
    assert rows["total: d_admitted -> d_scheduled"].p50_ms > 7.0
    # The marks stream is shown on the timeline and left out of the replay.
    assert timeline.main([str(trace_dir), "-o", str(tmp_path / "t.json")]) == 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(e["name"] == "scheduled" for e in events) == 4
    assert trace_check.main([str(trace_dir)]) == 0
    assert "3/3 traces replay without divergence" in capsys.readouterr().out


def test_trace_requests_says_when_no_request_is_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marks = trace.open_marks(str(tmp_path), "prefill scheduler")
    assert marks is not None
    marks.close()
    assert breakdown.main([str(tmp_path)]) == 1
    assert "no request found" in capsys.readouterr().err
