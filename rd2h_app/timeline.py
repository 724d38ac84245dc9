"""``rd2h trace``: merge protocol traces into a timeline; ``rd2h trace check``: replay them.

Over 600 lines: one pipeline (load, link, offsets, timeline, summary, PNG), stage by stage.

``rd2h trace FILES_OR_DIRS... [-o timeline.json]`` reads the NDJSON traces of every rank
of both roles (:mod:`rd2h_runtime.trace`), puts them on one clock, writes Chrome
trace-event JSON (open it in https://ui.perfetto.dev or chrome://tracing) with one process
per rank, and prints a text summary.

Clocks: traces taken on one host since one boot share ``time.monotonic()`` (a *clock
domain*: host name and boot id in each header). Between domains the offset is estimated
from request/reply pairs, NTP style: a frame sent by one side and received by the other
is matched by its CRC-32 and size; with ``fwd`` the smallest receive-minus-send delay of
Prefill -> Decode frames (readiness) and ``back`` that of Decode -> Prefill frames
(replies), Decode's clock is ahead of Prefill's by ``(fwd - back) / 2``. The offsets used
are printed.

Tracks (Chrome ``pid`` = one rank, ``tid``): 1 control (instants: a readiness published
or received, a reply sent or received, a gate opened), 2 gate wait (``X`` events: a
``wait_writable`` that waited), 3 reads (``B``/``E`` pairs: one batched read, from the
start of the engine read to its end).
"""

from __future__ import annotations

import argparse
import base64
import bisect
import collections
import importlib
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rd2h_protocol.checker.traces import Stream, load_or_say, load_streams
from rd2h_protocol.wire.codec import decode
from rd2h_protocol.wire.messages import ReadReadyBatch

__all__ = [
    "Stream",
    "Timeline",
    "build_timeline",
    "load_or_say",
    "load_streams",
    "main",
    "percentile",
    "pyplot",
    "save_png",
    "say_png",
]

TRACK_CONTROL = 1
TRACK_GATE = 2
TRACK_READS = 3


# -- links and frame pairs -----------------------------------------------------------------------


@dataclass
class Link:
    """One control connection: Prefill ``p`` (its DEALER ``conn``) to Decode ``d`` (which
    sees it as ROUTER peer ``peer``, hex). Found from the handshake: the MF_META frame names
    Prefill's session, and the same bytes left ``p`` on ``conn`` and reached ``d`` from
    ``peer``."""

    p: Stream
    conn: str
    d: Stream
    peer: str


@dataclass
class Pair:
    """One frame matched on both sides (times on each side's own clock)."""

    sent: float
    received: float
    send_rec: dict[str, Any]
    send_idx: int  # which output of send_rec
    recv_rec: dict[str, Any]


def _peer_hex(rec: dict[str, Any]) -> str:
    return base64.b64decode(rec["a"]["peer"]).hex()


def find_links(streams: Sequence[Stream]) -> list[Link]:
    by_session = {str(s.header["config"].get("session")): s for s in streams if s.role == "prefill"}
    links: dict[tuple[int, str, int, str], Link] = {}
    for d in streams:
        if d.role != "decode":
            continue
        for rec in d.records:
            if rec.get("op") != "receive" or rec.get("in", {}).get("msg") != "MfMeta":
                continue
            try:
                msg = decode(base64.b64decode(rec["a"]["frame"]))
            except Exception:
                continue
            p = by_session.get(str(getattr(msg, "p_session", "")))
            if p is None:
                continue
            key = (rec["in"]["crc"], rec["in"]["n"])
            for prec in p.records:
                conn = next(
                    (
                        o["conn"]
                        for o in prec.get("o") or ()
                        if o["o"] == "send" and (o["crc"], o["n"]) == key
                    ),
                    None,
                )
                if conn is not None:
                    peer = _peer_hex(rec)
                    links.setdefault((id(p), conn, id(d), peer), Link(p, conn, d, peer))
                    break
    return list(links.values())


def _match(
    sends: list[tuple[int, int, float, dict[str, Any], int]],
    recvs: list[tuple[int, int, float, dict[str, Any]]],
) -> list[Pair]:
    """The k-th send of some bytes with the k-th receipt of the same bytes (one
    connection delivers in order)."""
    by_key: dict[tuple[int, int], list[tuple[float, dict[str, Any], int]]] = (
        collections.defaultdict(list)
    )
    for crc, n, t, rec, i in sends:
        by_key[(crc, n)].append((t, rec, i))
    seen: collections.Counter[tuple[int, int]] = collections.Counter()
    out = []
    for crc, n, t, rec in recvs:
        key = (crc, n)
        k = seen[key]
        seen[key] += 1
        cands = by_key.get(key, [])
        if k < len(cands):
            ts, srec, i = cands[k]
            out.append(Pair(ts, t, srec, i, rec))
    return out


def link_pairs(link: Link) -> tuple[list[Pair], list[Pair]]:
    """Frames Prefill -> Decode and Decode -> Prefill on one link, matched."""
    p_sends, d_sends = [], []
    for rec in link.p.records:
        for i, o in enumerate(rec.get("o") or ()):
            if o["o"] == "send" and o["conn"] == link.conn:
                p_sends.append((o["crc"], o["n"], rec["t"], rec, i))
    for rec in link.d.records:
        for i, o in enumerate(rec.get("o") or ()):
            if o["o"] in ("reply", "send_abort") and o["peer"] == link.peer:
                d_sends.append((o["crc"], o["n"], rec["t"], rec, i))
    d_recvs = [
        (rec["in"]["crc"], rec["in"]["n"], rec["t"], rec)
        for rec in link.d.records
        if rec.get("op") == "receive" and "in" in rec and _peer_hex(rec) == link.peer
    ]
    p_recvs = [
        (rec["in"]["crc"], rec["in"]["n"], rec["t"], rec)
        for rec in link.p.records
        if rec.get("op") == "receive" and "in" in rec and rec["a"]["conn"] == link.conn
    ]
    return _match(p_sends, d_recvs), _match(d_sends, p_recvs)


# -- clock offsets ------------------------------------------------------------------------------


def estimate_offsets(
    streams: Sequence[Stream], pairs: Sequence[tuple[Link, list[Pair], list[Pair]]]
) -> tuple[dict[tuple[str, str], float], list[str]]:
    """Per clock domain: seconds to subtract to get the reference clock; and what was used.

    The reference is the first Prefill stream's domain (the first stream's without one).
    """
    notes: list[str] = []
    domains = list(dict.fromkeys(s.domain for s in streams))
    if not domains:
        return {}, notes
    ref = next((s.domain for s in streams if s.role == "prefill"), domains[0])
    # Pairwise estimates between domains: a -> b -> [off_b - off_a].
    edges: dict[tuple[str, str], dict[tuple[str, str], list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for link, fwd_pairs, back_pairs in pairs:
        if not fwd_pairs or not back_pairs:
            continue
        fwd = min(x.received - x.sent for x in fwd_pairs)
        back = min(x.received - x.sent for x in back_pairs)
        est = (fwd - back) / 2
        p, d = link.p, link.d
        if p.domain == d.domain:
            notes.append(
                f"  {p.label} <-> {d.label}: same clock; smallest one-way delays "
                f"{fwd * 1e3:.3f} / {back * 1e3:.3f} ms over {len(fwd_pairs)}/{len(back_pairs)} "
                f"frames (estimate {est * 1e3:+.3f} ms)"
            )
            continue
        notes.append(
            f"  {p.label} <-> {d.label}: {d.label} ahead by {est * 1e3:+.3f} ms "
            f"({len(fwd_pairs)}/{len(back_pairs)} frames)"
        )
        edges[p.domain][d.domain].append(est)
        edges[d.domain][p.domain].append(-est)
    offsets = {ref: 0.0}
    todo = [ref]
    while todo:
        a = todo.pop()
        for b, ests in edges[a].items():
            if b not in offsets:
                offsets[b] = offsets[a] + statistics.median(ests)
                todo.append(b)
    head = []
    for dom in domains:
        host = dom[0] or "?"
        if dom == ref:
            head.append(f"  clock of {host} (boot {dom[1][:8]}): reference, offset 0")
        elif dom in offsets:
            head.append(
                f"  clock of {host} (boot {dom[1][:8]}): offset {offsets[dom] * 1e3:+.3f} ms"
            )
        else:
            offsets[dom] = 0.0
            head.append(f"  clock of {host} (boot {dom[1][:8]}): no frame pairs, offset 0 (!)")
    return offsets, head + notes


# -- timeline -----------------------------------------------------------------------------------


@dataclass
class Transfer:
    """One readiness as it went: publish, receipt, read, reply, gate (reference clock)."""

    layer: int
    ids: list[str]
    publish: float | None
    received: float
    read_start: float | None = None
    read_end: float | None = None
    reply: float | None = None
    gate_open: float | None = None


@dataclass
class Timeline:
    events: list[dict[str, Any]]
    transfers: list[Transfer]
    waits: list[tuple[str, int, float, float]]  # (rank label, layer, start, seconds)
    notes: list[str]
    origin: float
    streams: list[Stream] = field(default_factory=list)
    #: Seconds to subtract from a clock domain's times to get the reference clock.
    offsets: dict[tuple[str, str], float] = field(default_factory=dict)


def percentile(data: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``data`` (nearest rank); NaN when empty."""
    data = sorted(data)
    if not data:
        return float("nan")
    k = min(len(data) - 1, max(0, round(q * (len(data) - 1))))
    return data[k]


def _meta(pid: int, tid: int, what: str, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": what, "pid": pid, "tid": tid, "ts": 0, "args": {"name": name}}


def _instant(pid: int, ts: float, name: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    ev: dict[str, Any] = {"ph": "i", "s": "t", "name": name, "pid": pid, "tid": TRACK_CONTROL}
    ev["ts"] = ts
    if args:
        ev["args"] = args
    return ev


def build_timeline(streams: Sequence[Stream]) -> Timeline:
    """Chrome trace events and per-readiness transfers of a set of traces."""
    pairs = [(link, *link_pairs(link)) for link in find_links(streams)]
    offsets, notes = estimate_offsets(streams, pairs)

    def clock(s: Stream) -> float:
        return offsets.get(s.domain, 0.0)

    starts = []
    for s in streams:
        for r in s.records:
            t = r.get("t", r.get("t0"))
            if t is not None:
                starts.append(t - clock(s))
    origin = min(starts) if starts else 0.0

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events: list[dict[str, Any]] = []
    gate_opens: dict[int, list[float]] = collections.defaultdict(list)  # id(stream) -> times
    waits: list[tuple[str, int, float, float]] = []
    for pid, s in enumerate(streams, start=1):
        off = clock(s)
        events.append(_meta(pid, 0, "process_name", s.label))
        for tid, name in (
            (TRACK_CONTROL, "control"),
            (TRACK_GATE, "gate wait"),
            (TRACK_READS, "reads"),
        ):
            events.append(_meta(pid, tid, "thread_name", name))
        for rec in s.records:
            kind = rec.get("k")
            if kind == "gate":
                t0, t1 = rec["t0"] - off, rec["t1"] - off
                events.append(
                    {
                        "ph": "X",
                        "name": f"gate wait L{rec['layer']}",
                        "pid": pid,
                        "tid": TRACK_GATE,
                        "ts": us(t0),
                        "dur": round((t1 - t0) * 1e6, 3),
                        "args": {"layer": rec["layer"], "ok": rec["ok"]},
                    }
                )
                waits.append((s.label, rec["layer"], t0, t1 - t0))
            elif kind == "read":
                t0, t1 = rec["t0"] - off, rec["t1"] - off
                args = {"read_id": rec["read_id"], "bytes": rec["bytes"], "ok": rec["ok"]}
                name = f"read {rec['layer']}"
                # A complete event: the plans of one batched read share its interval.
                events.append(
                    {
                        "ph": "X",
                        "name": name,
                        "pid": pid,
                        "tid": TRACK_READS,
                        "ts": us(t0),
                        "dur": round(max(t1 - t0, 0.0) * 1e6, 3),
                        "args": args,
                    }
                )
            elif kind == "mark":
                args = {k: v for k, v in rec.items() if k not in ("k", "t", "what", "_line")}
                events.append(_instant(pid, us(rec["t"] - off), str(rec["what"]), args))
            elif kind == "call":
                t = rec["t"] - off
                inp = rec.get("in")
                if inp is not None:
                    what = "readiness" if inp.get("msg") == "ReadReadyBatch" else inp.get("msg")
                    args = {k: v for k, v in inp.items() if k != "crc"}
                    events.append(_instant(pid, us(t), f"{what} L{inp.get('layer', '-')} in", args))
                for o in rec.get("o") or ():
                    if o["o"] in ("send", "reply", "send_abort"):
                        what = "publish" if o.get("msg") == "ReadReadyBatch" else o.get("msg")
                        args = {k: v for k, v in o.items() if k not in ("o", "crc")}
                        events.append(_instant(pid, us(t), f"{what} L{o.get('layer', '-')}", args))
                    elif o["o"] == "gate_opened":
                        gate_opens[id(s)].append(t)
                        events.append(_instant(pid, us(t), f"gate open slot {o['slot']}"))
    for times in gate_opens.values():
        times.sort()
    transfers = _transfers(pairs, offsets, gate_opens)
    return Timeline(events, transfers, waits, notes, origin, list(streams), offsets)


def _transfers(
    pairs: Sequence[tuple[Link, list[Pair], list[Pair]]],
    offsets: dict[tuple[str, str], float],
    gate_opens: dict[int, list[float]],
) -> list[Transfer]:
    """Follow each readiness: its read is the first one of its layer that Decode started at
    or after its receipt (a read may serve several contributors' readiness); its reply the
    one for its layer and seq on the same connection (in order, without seq); its gate
    opening the first on Prefill at or after that reply arrived."""
    # Per Decode stream: layer name -> [(start time, read record)] of the reads it started.
    starts: dict[int, dict[str, list[tuple[float, dict[str, Any]]]]] = {}
    for link, _, _ in pairs:
        d = link.d
        if id(d) in starts:
            continue
        reads = {r["read_id"]: r for r in d.records if r.get("k") == "read"}
        by_layer: dict[str, list[tuple[float, dict[str, Any]]]] = collections.defaultdict(list)
        for rec in d.records:
            for o in rec.get("o") or () if rec.get("k") == "call" else ():
                if o["o"] == "start_read" and o["read_id"] in reads:
                    by_layer[o["layer"]].append((rec["t"], reads[o["read_id"]]))
        starts[id(d)] = by_layer
    transfers: list[Transfer] = []
    for link, fwd, back in pairs:
        p_off, d_off = offsets.get(link.p.domain, 0.0), offsets.get(link.d.domain, 0.0)
        replies: dict[tuple[Any, Any], list[Pair]] = collections.defaultdict(list)
        for pair in back:
            o = pair.send_rec["o"][pair.send_idx]
            if o.get("msg") in ("ReadDone", "ReadFailed"):
                replies[(o.get("layer"), o.get("seq"))].append(pair)
        opens = gate_opens.get(id(link.p), [])
        for pair in fwd:
            inp = pair.recv_rec["in"]
            if inp.get("msg") != "ReadReadyBatch":
                continue
            try:
                msg = decode(base64.b64decode(pair.recv_rec["a"]["frame"]))
            except Exception:
                continue
            if not isinstance(msg, ReadReadyBatch):
                continue
            ids = [r.ext_req_id for r in msg.read_reqs]
            tr = Transfer(msg.layer_idx, ids, pair.sent - p_off, pair.received - d_off)
            transfers.append(tr)
            answered = replies.get((msg.layer_idx, msg.seq))
            reply = answered.pop(0) if answered else None
            if reply is not None:
                tr.reply = reply.sent - d_off
                j = bisect.bisect_left(opens, reply.received - p_off)
                if j < len(opens):
                    tr.gate_open = opens[j]
            if reply is not None and reply.send_rec is pair.recv_rec:
                continue  # answered on receipt: nothing of it for this rank to read
            layer_reads = starts[id(link.d)].get(msg.layer_name, [])
            i = bisect.bisect_left([t for t, _ in layer_reads], pair.received)
            if i < len(layer_reads):
                read = layer_reads[i][1]
                tr.read_start, tr.read_end = read["t0"] - d_off, read["t1"] - d_off
    return transfers


def summary(tl: Timeline, wait_ms: float = 10.0, top: int = 5) -> str:
    """The text summary: per layer percentiles, slowest requests, long gate waits."""
    lines = ["clock offsets used:", *tl.notes, ""]
    by_layer: dict[int, list[Transfer]] = collections.defaultdict(list)
    for tr in tl.transfers:
        by_layer[tr.layer].append(tr)
    lines.append(
        f"{'layer':>5} {'reads':>6}  {'publish->read start ms':>23}  {'read ms':>15}  "
        f"{'reply->gate open ms':>19}"
    )
    lines.append(
        f"{'':>5} {'':>6}  {'p50':>11} {'p99':>11}  {'p50':>7} {'p99':>7}  {'p50':>9} {'p99':>9}"
    )
    for layer in sorted(by_layer):
        trs = by_layer[layer]
        wait = [
            (t.read_start - t.publish) * 1e3
            for t in trs
            if t.read_start is not None and t.publish is not None
        ]
        read = [
            (t.read_end - t.read_start) * 1e3
            for t in trs
            if t.read_end is not None and t.read_start is not None
        ]
        gate = [
            (t.gate_open - t.reply) * 1e3
            for t in trs
            if t.gate_open is not None and t.reply is not None
        ]
        lines.append(
            f"{layer:>5} {len(trs):>6}  "
            f"{percentile(wait, 0.5):>11.3f} {percentile(wait, 0.99):>11.3f}  "
            f"{percentile(read, 0.5):>7.3f} {percentile(read, 0.99):>7.3f}  "
            f"{percentile(gate, 0.5):>9.3f} {percentile(gate, 0.99):>9.3f}"
        )
    spans: dict[str, list[float]] = {}
    for tr in tl.transfers:
        end = tr.reply if tr.reply is not None else tr.read_end
        start = tr.publish if tr.publish is not None else tr.received
        if end is None:
            continue
        for ext in tr.ids:
            lo_hi = spans.setdefault(ext, [start, end])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], start), max(lo_hi[1], end)
    slowest = sorted(spans.items(), key=lambda kv: kv[1][1] - kv[1][0], reverse=True)[:top]
    lines += ["", f"slowest requests (first publish -> last reply), {len(spans)} in all:"]
    lines += [f"  {ext:<24} {(hi - lo) * 1e3:10.3f} ms" for ext, (lo, hi) in slowest]
    long_waits = sorted((w for w in tl.waits if w[3] * 1e3 > wait_ms), key=lambda w: -w[3])
    lines += [
        "",
        f"gate waits longer than {wait_ms:g} ms: {len(long_waits)} (of {len(tl.waits)} waits)",
    ]
    lines += [
        f"  {label:<28} layer {layer:>3} at {(t0 - tl.origin) * 1e3:10.3f} ms: {dur * 1e3:.3f} ms"
        for label, layer, t0, dur in long_waits[: top * 2]
    ]
    return "\n".join(lines)


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on its file-only backend; None when matplotlib is not installed
    (``pip install 'rd2h[timeline]'``)."""
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return None


def save_png(plt: Any, fig: Any, path: str) -> None:
    """Lay out ``fig``, write it to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def say_png(written: bool, path: str) -> None:
    """Tell where the PNG went, or that it was skipped."""
    print(f"png: {path}" if written else "png: skipped (matplotlib is not installed)")


def write_png(tl: Timeline, path: str) -> bool:
    """A PNG of the timeline when matplotlib is installed; False when it is not."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * len(tl.streams)))
    for ev in tl.events:
        if ev["ph"] == "X" and ev["tid"] == TRACK_READS:
            ax.plot([ev["ts"] / 1e3], [ev["pid"] + 0.3], "|", color="tab:blue")
        elif ev["ph"] == "X":
            ax.barh(ev["pid"], ev["dur"] / 1e3, left=ev["ts"] / 1e3, color="tab:red", height=0.3)
        elif ev["ph"] == "i" and ev["name"].startswith("publish"):
            ax.plot([ev["ts"] / 1e3], [ev["pid"] - 0.3], "|", color="tab:green")
    ax.set_yticks(range(1, len(tl.streams) + 1), [s.label for s in tl.streams])
    ax.set_xlabel("ms")
    patches = importlib.import_module("matplotlib.patches")
    ax.legend(
        handles=[
            patches.Patch(color="tab:green", label="readiness published (Prefill)"),
            patches.Patch(color="tab:red", label="waiting for a storage gate (Prefill)"),
            patches.Patch(color="tab:blue", label="batched read starts (Decode)"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=3,
        frameon=False,
    )
    save_png(plt, fig, path)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rd2h trace",
        description="Merge rd2h protocol traces (every rank, both roles) into a Chrome "
        "trace-event timeline and print a summary. 'rd2h trace check FILES' replays them; "
        "'rd2h trace requests FILES' breaks each request's transfer into stages.",
    )
    p.add_argument("files", nargs="+", help="trace files or directories of them")
    p.add_argument("-o", "--output", default="rd2h-timeline.json", help="timeline JSON to write")
    p.add_argument("--png", help="also draw the timeline into this PNG (needs matplotlib)")
    p.add_argument("--wait-ms", type=float, default=10.0, help="list gate waits longer than this")
    p.add_argument("--top", type=int, default=5, help="how many slowest requests to list")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in and args_in[0] == "check":
        from rd2h_protocol.checker.replay import main as check_main

        return check_main(args_in[1:])
    if args_in and args_in[0] == "requests":
        from rd2h_app.breakdown import main as requests_main

        return requests_main(args_in[1:])
    args = build_parser().parse_args(args_in)
    streams = load_or_say("rd2h trace", args.files)
    if streams is None:
        return 1
    tl = build_timeline(streams)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": tl.events, "displayTimeUnit": "ms"}, f)
    print(summary(tl, args.wait_ms, args.top))
    print(
        f"\ntimeline: {args.output} ({len(tl.events)} events, {len(streams)} ranks); "
        "open it in https://ui.perfetto.dev or chrome://tracing"
    )
    if args.png:
        say_png(write_png(tl, args.png), args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
