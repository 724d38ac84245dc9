"""``rd2h trace check FILES``: replay recorded traces against fresh sans-IO endpoints.

Each worker's trace (:mod:`rd2h_runtime.trace`) starts with the endpoint's configuration.
The check builds a fresh :class:`~rd2h_protocol.producer.ProducerEndpoint` (Prefill) or
:class:`~rd2h_protocol.consumer.ConsumerEndpoint` (Decode) from it, feeds it the recorded
calls with their recorded ``now``, and compares the outputs, summarised the same way, with
the recorded ones. It reports the first divergence, and on the way checks that

- the recorded ``now`` never goes backwards (calls are recorded under the worker's lock in
  the order they ran; a record out of place shows here or as a divergence),
- no ``layer_written`` goes into a storage whose gate is not open (Prefill), and the
  storage-gate invariant S1 holds after every call
  (:func:`~rd2h_protocol.checker.invariants.check_storage_gates`).

The traces are read as plain JSON lines (:mod:`~rd2h_protocol.checker.traces`): a replay
needs the protocol core alone, not the runtime that wrote them.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from rd2h_protocol.checker.invariants import InvariantViolation, check_storage_gates
from rd2h_protocol.checker.traces import MARKS_ROLE, Stream, load_or_say, summarize_output
from rd2h_protocol.consumer import ConsumerConfig, ConsumerEndpoint
from rd2h_protocol.errors import ErrorCode, TransferError
from rd2h_protocol.events import Chunk
from rd2h_protocol.producer import DecodeTarget, ProducerConfig, ProducerEndpoint

__all__ = ["ReplayResult", "main", "replay"]


@dataclass
class ReplayResult:
    label: str
    calls: int
    divergence: str | None  # None: every output matched

    @property
    def ok(self) -> bool:
        return self.divergence is None


def _norm(value: Any) -> Any:
    """Summaries as they come back from JSON (tuples as lists, same floats)."""
    return json.loads(msgspec.json.encode(value))


def _error(d: dict[str, Any] | None) -> TransferError | None:
    if d is None:
        return None
    code = d.get("code")
    return TransferError(
        d["message"],
        d.get("backend_code"),
        transient=bool(d.get("transient")),
        code=ErrorCode[code] if code else None,
    )


def _producer_call(ep: ProducerEndpoint, op: str, a: dict[str, Any], t: float) -> list[Any]:
    if op == "add_request":
        return ep.add_request(a["ext_req_id"], DecodeTarget(*a["target"]), t)
    if op in ("schedule_chunk", "claim"):
        chunk = Chunk(
            ext_req_id=a["ext_req_id"],
            main_block_ids=a["main_block_ids"],
            indexer_block_ids=a["indexer_block_ids"],
            main_start=a["main_start_block"],
            indexer_start=a["indexer_start_block"],
            final=a["final"],
        )
        if op == "claim":
            return ep.claim(a["ext_req_id"], DecodeTarget(*a["target"]), chunk, t)
        return ep.schedule_chunk(chunk, t)
    if op == "keep_request":
        return ep.keep_request(a["ext_req_id"], t)
    if op == "layer_written":
        return ep.layer_written(a["layer_idx"], t)
    if op == "end_step":
        return ep.end_step(t)
    if op == "abort":
        return ep.abort(a["ext_ids"], a["reason"], t)
    if op == "receive":
        return ep.receive(a["conn"], base64.b64decode(a["frame"]), t)
    if op == "handle_timer":
        return ep.handle_timer(t)
    if op == "can_overwrite":  # recorded only when it raised (the "raise" policy)
        ep.can_overwrite(a["layer_idx"])
        return []
    if op == "connection_lost":
        return ep.connection_lost(a["conn"], t)
    if op == "connection_resumed":
        return ep.connection_resumed(a["conn"], t)
    raise ValueError(f"unknown Prefill call {op!r}")


def _consumer_call(ep: ConsumerEndpoint, op: str, a: dict[str, Any], t: float) -> list[Any]:
    if op == "add_request":
        return ep.add_request(a["ext_req_id"], a["main_block_ids"], a["indexer_block_ids"], t)
    if op == "abort":
        return ep.abort(a["ext_ids"], a["reason"], t)
    if op == "release":
        return ep.release(a["ext_req_id"], t)
    if op == "receive":
        return ep.receive(base64.b64decode(a["peer"]), base64.b64decode(a["frame"]), t)
    if op == "handle_timer":
        return ep.handle_timer(t)
    if op == "read_finished":
        return ep.read_finished(a["read_id"], _error(a.get("error")), t)
    raise ValueError(f"unknown Decode call {op!r}")


def _gate_open(ep: ProducerEndpoint, layer_idx: int) -> bool:
    """Whether every storage slot of the layer is open (read without changing anything:
    ``can_overwrite`` itself may raise a pending read failure once)."""
    gates = ep.gates()
    return all(gates[slot][0] == "open" for slot in ep.layer_slots(layer_idx))


def replay(stream: Stream) -> ReplayResult:
    """Replay one worker's trace; the first divergence, if any."""
    label = stream.label
    if not stream.complete:
        return ReplayResult(label, 0, f"cannot replay: parts {stream.parts} (the first is gone)")
    config: dict[str, Any] = stream.header["config"]
    producer: ProducerEndpoint | None = None
    consumer: ConsumerEndpoint | None = None
    if stream.role == "prefill":
        producer = ProducerEndpoint(msgspec.convert(config, ProducerConfig))
    else:
        consumer = ConsumerEndpoint(msgspec.convert(config, ConsumerConfig))
    session = str(config.get("session", ""))
    last_t = float("-inf")
    calls = 0
    for rec in stream.records:
        if rec.get("k") != "call":
            continue
        calls += 1
        op, t, a = rec["op"], rec["t"], rec.get("a") or {}
        where = f"{rec.get('_line', '?')} (call {calls}, {op} at t={t})"
        if t < last_t:
            return ReplayResult(
                label,
                calls,
                f"{where}: time goes backwards by {(last_t - t) * 1e3:.3f} ms "
                "(a record out of order)",
            )
        last_t = t
        error: BaseException | None = None
        outs: list[Any] = []
        try:
            if producer is not None:
                if op == "layer_written" and not _gate_open(producer, a["layer_idx"]):
                    return ReplayResult(
                        label,
                        calls,
                        f"{where}: layer {a['layer_idx']} written into a storage "
                        "whose gate is not open",
                    )
                outs = _producer_call(producer, op, a, t)
            else:
                assert consumer is not None
                outs = _consumer_call(consumer, op, a, t)
        except ValueError as exc:
            if str(exc).startswith("unknown"):
                return ReplayResult(label, calls, f"{where}: {exc}")
            error = exc
        except Exception as exc:
            error = exc
        recorded_error = rec.get("e")
        if error is not None or recorded_error is not None:
            got = type(error).__name__ if error is not None else None
            want = recorded_error.get("error") if recorded_error else None
            if got != want:
                return ReplayResult(
                    label, calls, f"{where}: recorded error {want}, replay raised {got} ({error})"
                )
            continue
        got_o = _norm([summarize_output(o) for o in outs])
        want_o = rec.get("o", [])
        if got_o != want_o:
            first = next(
                (i for i, (g, w) in enumerate(zip(got_o, want_o, strict=False)) if g != w),
                min(len(got_o), len(want_o)),
            )
            return ReplayResult(
                label,
                calls,
                f"{where}: outputs differ at output {first}: recorded "
                f"{want_o[first] if first < len(want_o) else '(none)'}, replay "
                f"{got_o[first] if first < len(got_o) else '(none)'} "
                f"({len(want_o)} recorded, {len(got_o)} replayed)",
            )
        if producer is not None:
            try:
                check_storage_gates(session, producer)
            except InvariantViolation as exc:
                return ReplayResult(label, calls, f"{where}: {exc}")
    return ReplayResult(label, calls, None)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rd2h trace check",
        description="Replay rd2h protocol traces against fresh sans-IO endpoints built from "
        "the recorded configuration; report the first divergence of each.",
    )
    p.add_argument("files", nargs="+", help="trace files or directories of them")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    streams = load_or_say("rd2h trace check", args.files)
    if streams is None:
        return 1
    streams = [s for s in streams if s.role != MARKS_ROLE]  # marks: nothing to replay
    bad = 0
    for stream in streams:
        result = replay(stream)
        if result.ok:
            print(f"{result.label}: {result.calls} calls replayed, outputs identical")
        else:
            bad += 1
            print(f"{result.label}: DIVERGED: {result.divergence}")
    print(f"{len(streams) - bad}/{len(streams)} traces replay without divergence")
    return 1 if bad else 0
