"""The trace files of :mod:`rd2h_runtime.trace`, as the checker and the tools read them.

What a trace record says of an endpoint output or a frame (:func:`summarize_output`,
:func:`frame_summary`: the writer records these, a replay recomputes them and compares),
and the reading of trace files as plain JSON lines into one :class:`Stream` per worker
(:func:`load_streams`). Needs nothing but the protocol core: the replay
(:mod:`~rd2h_protocol.checker.replay`) and ``rd2h trace`` (:mod:`rd2h_app.timeline`) read
traces without the runtime.
"""

from __future__ import annotations

import base64
import collections
import glob
import json
import os
import sys
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from rd2h_protocol.wire.codec import decode, encode
from rd2h_protocol.wire.messages import Abort, ReadDone, ReadFailed, ReadReadyBatch

__all__ = [
    "MARKS_ROLE",
    "MAX_IDS",
    "Stream",
    "expand",
    "frame_summary",
    "load_or_say",
    "load_streams",
    "summarize_output",
]

#: Request ids named in one summary; the rest are counted (``nids``).
MAX_IDS: Final = 8
#: The role of a stream that holds only marks (nothing to replay).
MARKS_ROLE: Final = "marks"


def _ids(ids: Sequence[str]) -> dict[str, Any]:
    return {"ids": list(ids[:MAX_IDS]), "nids": len(ids)}


def _msg_fields(msg: Any) -> dict[str, Any]:
    """What a timeline shows of a control message (type, layer, seq, request ids)."""
    out: dict[str, Any] = {"msg": type(msg).__name__}
    if isinstance(msg, ReadReadyBatch):
        out.update(layer=msg.layer_idx, seq=msg.seq, **_ids([r.ext_req_id for r in msg.read_reqs]))
    elif isinstance(msg, ReadDone):
        out.update(layer=msg.layer_idx, seq=msg.seq)
        if msg.failed:
            out.update(_ids([f.ext_req_id for f in msg.failed]))
    elif isinstance(msg, ReadFailed):
        out.update(layer=msg.layer_idx, seq=msg.seq, code=msg.code)
    elif isinstance(msg, Abort):
        out.update(_ids(list(msg.ext_ids)))
    return out


def frame_summary(payload: bytes, *, fields: bool = True) -> dict[str, Any]:
    """Size, CRC-32 and (``fields``, when it decodes) the message fields of one frame.

    The writer records size and CRC only (decoding a 64-request readiness costs more than
    a millisecond); :func:`load_streams` adds the fields when it reads a trace.
    """
    out: dict[str, Any] = {"n": len(payload), "crc": zlib.crc32(payload)}
    if not fields:
        return out
    try:
        out.update(_msg_fields(decode(payload)))
    except Exception:  # a malformed frame is traced as it came
        out["msg"] = "?"
    return out


def summarize_output(out: Any, payload: bytes | None = None) -> dict[str, Any]:
    """One endpoint output (producer or consumer) as a JSON-able summary.

    Deterministic in the output alone, so that a replay can compare summaries.
    ``payload``: the encoded frame of a message output, when the caller has it.
    """
    kind = type(out).__name__
    if kind in ("Send", "Reply", "SendAbort"):
        if payload is None:
            payload = encode(out.msg)
        rec: dict[str, Any] = {"o": kind.lower()}
        if kind == "Send":
            rec["conn"] = out.conn
        else:
            rec["peer"] = out.peer.hex()
        rec.update(_msg_fields(out.msg), n=len(payload), crc=zlib.crc32(payload))
        return rec
    if kind == "StartRead":
        plan = out.plan
        return {
            "o": "start_read",
            "read_id": plan.read_id,
            "layer": plan.layer_name,
            "bytes": plan.total_bytes,
            "start_by": out.start_by,
            "finish_by": out.finish_by,
            **_ids([r.ext_req_id for r in plan.requests]),
        }
    if kind == "GateOpened":
        return {"o": "gate_opened", "slot": out.slot}
    if kind == "LayerReplied":
        return {
            "o": "replied",
            "conn": out.conn,
            "layer": out.layer_idx,
            "rt": out.round_trip_s,
            "ok": out.ok,
        }
    if kind == "RequestFinished":
        code = out.code.name if out.code is not None else None
        return {"o": "finished", "id": out.ext_req_id, "ok": out.ok, "code": code}
    if kind == "RequestFailed":
        return {"o": "failed", "id": out.ext_req_id, "code": out.code.name}
    if kind == "RequestDone":
        return {"o": "done", "id": out.ext_req_id}
    if kind == "Releasable":
        return {"o": "releasable", "id": out.ext_req_id}
    if kind == "Connect":
        return {"o": "connect", "conn": out.conn, "host": out.host, "port": out.port}
    if kind == "Disconnect":
        return {"o": "disconnect", "conn": out.conn}
    return {"o": kind}


@dataclass
class Stream:
    """The records of one worker's trace (all parts found, in order)."""

    header: dict[str, Any]
    records: list[dict[str, Any]]
    paths: list[str]
    parts: list[int]

    @property
    def role(self) -> str:
        return str(self.header["role"])

    @property
    def rank(self) -> int:
        return int(self.header["rank"])

    @property
    def domain(self) -> tuple[str, str]:
        return (str(self.header.get("host", "")), str(self.header.get("boot", "")))

    @property
    def label(self) -> str:
        return f"{self.role} r{self.rank} (pid {self.header.get('pid')})"

    @property
    def complete(self) -> bool:
        """Every part from the first one is here (a replay needs that)."""
        return self.parts == list(range(len(self.parts)))


def expand(paths: Iterable[str]) -> list[str]:
    """Files as given; directories replaced by the ``*.ndjson`` files in them."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted(glob.glob(os.path.join(p, "*.ndjson")))
        else:
            out.append(p)
    return out


def load_streams(paths: Iterable[str]) -> list[Stream]:
    """Read trace files (or directories of them) and join the parts of each worker."""
    parts: dict[str, list[tuple[int, str, dict[str, Any], list[dict[str, Any]]]]] = (
        collections.defaultdict(list)
    )
    for path in expand(paths):
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        if not lines:
            continue
        header = json.loads(lines[0])
        if header.get("k") != "hdr":
            raise ValueError(f"{path}: the first line is not a trace header")
        records = []
        for n, line in enumerate(lines[1:], start=2):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                if n == len(lines) and not line.endswith("\n"):
                    break  # a line being written (a live trace) or cut by a kill
                raise ValueError(f"{path}:{n}: not JSON ({exc})") from exc
            rec["_line"] = f"{os.path.basename(path)}:{n}"
            inp = rec.get("in")
            if inp is not None and "msg" not in inp:
                # The writer leaves decoding the frame to here (it is not cheap).
                frame = base64.b64decode(rec["a"]["frame"])
                inp.update(frame_summary(frame))
            records.append(rec)
        parts[header["stream"]].append((int(header.get("part", 0)), path, header, records))
    streams = []
    for key in sorted(parts):
        items = sorted(parts[key], key=lambda x: x[0])
        streams.append(
            Stream(
                header=items[0][2],
                records=[r for item in items for r in item[3]],
                paths=[item[1] for item in items],
                parts=[item[0] for item in items],
            )
        )
    return streams


def load_or_say(prog: str, paths: Iterable[str]) -> list[Stream] | None:
    """:func:`load_streams` for command ``prog``: None, said on stderr, when the traces
    cannot be read or there are none."""
    try:
        streams = load_streams(paths)
    except (OSError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    if not streams:
        print(f"{prog}: no trace files found", file=sys.stderr)
        return None
    return streams
