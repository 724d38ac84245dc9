"""``rd2h trace requests``: where each request's KV transfer spent its time, stage by stage.

Joins, per request, what the traces of both roles hold (:mod:`rd2h_runtime.trace`; all
on the reference clock of :func:`~rd2h_app.timeline.build_timeline`):

* the vLLM connector's scheduler marks (a stream of role ``marks`` per server): Decode's
  ``admitted`` (blocks allocated, the load arranged), ``loaded`` (every worker reported the
  load finished) and ``scheduled`` (its first step scheduled); Prefill's ``admitted`` and
  ``answered`` (the request finished on Prefill);
* the endpoints' calls: Decode's ``add_request`` (the worker registers the load) and the
  ``read_finished`` that finished the request; Prefill's ``claim`` (Prefill-first);
* each readiness as it went (:class:`~rd2h_app.timeline.Transfer`): published,
  received, read, replied.

A request answered by Prefill and then claimed by Decode is Prefill-first (a router's
flow); any other is Decode-first (``rd2h proxy``). Each flow has its stages, in the order
a request meets them; a stage whose two moments are not both in the traces is left out
for that request. Run the servers with ``RD2H_TRACE_DIR`` (or the connector's
``trace_dir``) set, send requests, stop the servers, then ``rd2h trace requests DIR``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from rd2h_app.timeline import (
    Timeline,
    build_timeline,
    load_or_say,
    percentile,
    pyplot,
    save_png,
    say_png,
)
from rd2h_protocol.checker.traces import MARKS_ROLE

__all__ = [
    "FLOW_STAGES",
    "RequestMoments",
    "StageRow",
    "main",
    "moments",
    "stage_rows",
    "write_png",
]

#: Per flow: (stage, from moment, to moment), in the order a request meets them.
FLOW_STAGES: dict[str, list[tuple[str, str, str]]] = {
    "prefill-first": [
        ("Prefill answered -> Decode admitted", "p_answered", "d_admitted"),
        ("Decode admitted -> load registered", "d_admitted", "d_add"),
        ("load registered -> claim at Prefill", "d_add", "p_claim"),
        ("claim -> first readiness at Decode", "p_claim", "first_received"),
        ("first readiness -> last read done", "first_received", "last_read_end"),
        ("last read done -> request done", "last_read_end", "d_done"),
        ("request done -> scheduler noticed", "d_done", "d_loaded"),
        ("scheduler noticed -> first step", "d_loaded", "d_scheduled"),
    ],
    "decode-first": [
        ("Decode admitted -> Prefill admitted", "d_admitted", "p_admitted"),
        ("Prefill admitted -> first layer published", "p_admitted", "first_publish"),
        ("first -> last layer published", "first_publish", "last_publish"),
        ("last layer published -> last read done", "last_publish", "last_read_end"),
        ("last read done -> request done", "last_read_end", "d_done"),
        ("request done -> scheduler noticed", "d_done", "d_loaded"),
        ("scheduler noticed -> first step", "d_loaded", "d_scheduled"),
    ],
}
_TOTAL = {
    "prefill-first": ("p_answered", "d_scheduled"),
    "decode-first": ("d_admitted", "d_scheduled"),
}

# Marks, by (the stream's source role, what) -> moment.
_MARKS = {
    ("decode", "admitted"): "d_admitted",
    ("decode", "loaded"): "d_loaded",
    ("decode", "scheduled"): "d_scheduled",
    ("prefill", "admitted"): "p_admitted",
    ("prefill", "answered"): "p_answered",
}


@dataclass
class RequestMoments:
    """One request's moments (reference clock, seconds), by name."""

    ext_id: str
    at: dict[str, float]

    @property
    def flow(self) -> str:
        return "prefill-first" if "p_claim" in self.at else "decode-first"


@dataclass(frozen=True)
class StageRow:
    """One stage over the requests of a flow: how many had it, median and p90 (ms)."""

    flow: str
    stage: str
    count: int
    p50_ms: float
    p90_ms: float


def _first(at: dict[str, float], name: str, t: float) -> None:
    if name not in at or t < at[name]:
        at[name] = t


def _last(at: dict[str, float], name: str, t: float) -> None:
    if name not in at or t > at[name]:
        at[name] = t


def moments(tl: Timeline) -> list[RequestMoments]:
    """Every request named in the traces, with the moments they hold of it."""
    found: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for s in tl.streams:
        off = tl.offsets.get(s.domain, 0.0)
        source = str((s.header.get("config") or {}).get("source", ""))
        for rec in s.records:
            kind = rec.get("k")
            if kind == "mark" and s.role == MARKS_ROLE and rec.get("ext"):
                name = _MARKS.get((source.split(" ")[0], str(rec.get("what"))))
                if name is not None:
                    _first(found[str(rec["ext"])], name, rec["t"] - off)
            elif kind == "call":
                t = rec["t"] - off
                op = rec.get("op")
                ext = (rec.get("a") or {}).get("ext_req_id")
                if s.role == "decode" and op == "add_request" and ext:
                    _first(found[ext], "d_add", t)
                elif s.role == "prefill" and op == "claim" and ext:
                    _first(found[ext], "p_claim", t)
                if s.role == "decode":
                    for o in rec.get("o") or ():
                        if o.get("o") == "done":
                            _first(found[o["id"]], "d_done", t)
    for tr in tl.transfers:
        for ext in tr.ids:
            at = found[ext]
            if tr.publish is not None:
                _first(at, "first_publish", tr.publish)
                _last(at, "last_publish", tr.publish)
            _first(at, "first_received", tr.received)
            if tr.read_end is not None:
                _last(at, "last_read_end", tr.read_end)
    return [RequestMoments(ext, at) for ext, at in found.items()]


def stage_rows(requests: Sequence[RequestMoments]) -> list[StageRow]:
    """Per flow with requests, each stage's count, median and p90, then the total."""
    rows: list[StageRow] = []
    for flow, stages in FLOW_STAGES.items():
        mine = [r for r in requests if r.flow == flow]
        if not mine:
            continue
        start, end = _TOTAL[flow]
        for stage, a, b in [*stages, (f"total: {start} -> {end}", start, end)]:
            spans = [(r.at[b] - r.at[a]) * 1e3 for r in mine if a in r.at and b in r.at]
            if spans:
                rows.append(
                    StageRow(
                        flow, stage, len(spans), statistics.median(spans), percentile(spans, 0.9)
                    )
                )
    return rows


def render(rows: Sequence[StageRow]) -> str:
    """The stage table, one block per flow."""
    lines: list[str] = []
    width = max((len(r.stage) for r in rows), default=10)
    flow = None
    for r in rows:
        if r.flow != flow:
            flow = r.flow
            lines += [
                "",
                f"{flow}:",
                f"  {'stage':<{width}}  {'n':>4}  {'p50 ms':>8}  {'p90 ms':>8}",
            ]
        lines.append(f"  {r.stage:<{width}}  {r.count:>4}  {r.p50_ms:>8.3f}  {r.p90_ms:>8.3f}")
    return "\n".join(lines).strip("\n")


def write_png(requests: Sequence[RequestMoments], path: str) -> bool:
    """A PNG of one request per flow (the one with the median total), its stages laid end
    to end on a time axis (those the traces hold); False when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    shown: list[tuple[str, RequestMoments]] = []
    for flow, (start, end) in _TOTAL.items():
        whole = [r for r in requests if r.flow == flow and start in r.at and end in r.at]
        if whole:
            whole.sort(key=lambda r: r.at[end] - r.at[start])
            shown.append((flow, whole[len(whole) // 2]))
    fig, axes = plt.subplots(
        max(1, len(shown)), 1, figsize=(12, 2.4 * len(shown) or 2.4), squeeze=False
    )
    if not shown:
        axes[0, 0].set_title("no request with the first and last moment of its flow's stages")
    colors = plt.get_cmap("tab10").colors
    for (flow, r), ax in zip(shown, axes[:, 0], strict=True):
        origin = r.at[_TOTAL[flow][0]]
        for n, (stage, a, b) in enumerate(FLOW_STAGES[flow]):
            if a not in r.at or b not in r.at:
                continue  # not in these traces (e.g. no scheduler marks of that server)
            left, width = (r.at[a] - origin) * 1e3, (r.at[b] - r.at[a]) * 1e3
            ax.barh(0, width, left=left, color=colors[n % len(colors)], height=0.6,
                    label=f"{stage}: {width:.1f} ms")  # fmt: skip
        total = (r.at[_TOTAL[flow][1]] - origin) * 1e3
        ax.set_title(f"{flow}: request {r.ext_id[-32:]}, {total:.1f} ms", fontsize=9)
        ax.set_yticks([])
        ax.set_xlabel("ms")
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
    save_png(plt, fig, path)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rd2h trace requests",
        description="Per-request stages of the KV transfer (admission, claim or rendezvous, "
        "publish, read, reply, the scheduler noticing, the first step), joined from the "
        "traces of both roles and the connector's scheduler marks; medians over requests.",
    )
    p.add_argument("files", nargs="+", help="trace files or directories of them")
    p.add_argument("--png", help="also draw one request per flow into this PNG (matplotlib)")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    streams = load_or_say("rd2h trace requests", args.files)
    if streams is None:
        return 1
    requests = moments(build_timeline(streams))
    rows = stage_rows(requests)
    if not rows:
        print("rd2h trace requests: no request found in the traces", file=sys.stderr)
        return 1
    print(render(rows))
    if args.png:
        say_png(write_png(requests, args.png), args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
