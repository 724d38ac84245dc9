"""``rd2h demo``: an end-to-end Prefill/Decode KV-cache transfer on this machine.

Starts a Prefill engine (TP 4) and a Decode engine (TP 2) as two processes on 127.0.0.1,
each TP rank with its own transfer backend (nixl by default) and control sockets, over
synthetic KV caches shaped like a sparse-attention model (K/V, an indexer with its own
block size, a LIC8 scale; scaled down). Requests run in waves through the real protocol:
chunked prefill (the last chunk carries a partial block), a reuse ring of Prefill layer
buffers (a buffer is overwritten only once every Decode reader acknowledged the layer it
held), Decode's per-rank shares and contributor groups. Decode checks every destination
byte against what Prefill wrote; the command exits non-zero on any mismatch or failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rd2h_app.progress import progress_bar
from rd2h_protocol.errors import ProtocolError
from rd2h_runtime.testing.child_engines import EngineProcess
from rd2h_runtime.testing.engines import DecodeResult, DecodeSpec, PrefillSpec
from rd2h_runtime.testing.synthetic import RequestSpec, SyntheticModel, chunk_steps

BACKENDS = ("nixl", "mooncake", "memfabric", "cma")
MIB = 1 << 20


@dataclass
class DemoReport:
    """What one demo run did and measured (``--json`` prints it as is)."""

    backend: str
    protocol: str
    prefill_tp: int
    decode_tp: int
    requests: int
    layers: int
    buffers: int | None
    chunks_per_request: int
    bytes_moved: int = 0
    busiest_rank_read_seconds: float = 0.0  # Decode ranks read in parallel
    wall_seconds: float = 0.0
    round_trip_ms: list[float] = field(default_factory=list)
    gate_waits: int = 0
    gate_wait_seconds: float = 0.0
    verified: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.verified == self.requests and not self.failures

    def percentile(self, q: float) -> float:
        """The ``q``-quantile of the round trips, in ms (0 when none)."""
        data = sorted(self.round_trip_ms)
        if not data:
            return 0.0
        if len(data) == 1:
            return data[0]
        return statistics.quantiles(data, n=100, method="inclusive")[round(q * 100) - 1]

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "round_trip_ms"}
        out.update(
            ok=self.ok,
            round_trips=len(self.round_trip_ms),
            round_trip_p50_ms=self.percentile(0.50),
            round_trip_p99_ms=self.percentile(0.99),
            gb_per_s=_rate(self.bytes_moved, self.wall_seconds),
            read_gb_per_s=_rate(self.bytes_moved, self.busiest_rank_read_seconds),
        )
        return out


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rd2h demo",
        description="End-to-end Prefill -> Decode KV-cache transfer on this machine, "
        "every destination byte verified.",
    )
    p.add_argument("--backend", choices=BACKENDS, default="nixl", help="transfer backend")
    p.add_argument("--prefill-tp", type=int, default=4, help="Prefill TP size (default 4)")
    p.add_argument("--decode-tp", type=int, default=2, help="Decode TP size (default 2)")
    p.add_argument("--requests", type=int, default=16, help="requests to move (default 16)")
    p.add_argument("--wave", type=int, default=4, help="requests in flight together")
    p.add_argument("--layers", type=int, default=8, help="cache-bearing layers (default 8)")
    p.add_argument(
        "--buffers",
        type=int,
        default=3,
        help="physical Prefill layer buffers the layers cycle through (0: one per layer)",
    )
    p.add_argument("--tokens", type=int, default=1000, help="prompt tokens per request")
    p.add_argument("--chunk-tokens", type=int, default=384, help="tokens per prefill chunk")
    p.add_argument("--k-bytes", type=int, default=1024, help="K bytes per token (default 1024)")
    p.add_argument("--v-bytes", type=int, default=128, help="V bytes per token (default 128)")
    p.add_argument(
        "--scattered",
        action="store_true",
        help="allocate blocks shuffled (many small descriptors) instead of in runs",
    )
    p.add_argument("--v1", action="store_true", help="speak protocol v1 (the existing wire)")
    p.add_argument("--lease-ms", type=int, default=30_000, help="readiness lease (v2)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per wave")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--trace",
        metavar="DIR",
        help="write every rank's protocol trace into DIR (then: rd2h trace DIR)",
    )
    p.add_argument(
        "--vllm",
        action="store_true",
        help="instead: two tiny real vLLM servers (Prefill, Decode) and rd2h proxy, "
        "tokens compared with a single-instance run (rd2h demo --vllm --help)",
    )
    return p


def make_model(args: argparse.Namespace) -> SyntheticModel:
    """A scaled-down sparse-attention cache: 16-token main blocks, 64-token indexer blocks."""
    main_tokens, indexer_tokens = 16, 64
    blocks_needed = args.wave * (-(-args.tokens // main_tokens) + -(-args.tokens // indexer_tokens))
    return SyntheticModel(
        num_layers=args.layers,
        main_block_tokens=main_tokens,
        indexer_block_tokens=indexer_tokens,
        k_block_len=args.k_bytes * main_tokens // 2,
        k_scale=2,
        v_block_len=args.v_bytes * main_tokens // 2,
        v_scale=2,
        indexer_block_len=128 * indexer_tokens,  # 128 B per token
        indexer_scale=1,
        scale_block_len=4 * indexer_tokens,  # LIC8 scale: 4 B per token
        num_buffers=args.buffers or None,
        num_blocks=max(64, blocks_needed),
    )


def check_args(args: argparse.Namespace) -> None:
    for name in ("prefill_tp", "decode_tp", "requests", "wave", "layers", "tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"rd2h demo: --{name.replace('_', '-')} must be >= 1")
    if args.chunk_tokens < 1 or args.buffers < 0:
        raise SystemExit("rd2h demo: --chunk-tokens must be >= 1 and --buffers >= 0")
    if args.prefill_tp < args.decode_tp or args.prefill_tp % args.decode_tp:
        raise SystemExit("rd2h demo: --prefill-tp must be a multiple of --decode-tp")
    if args.k_bytes < 1 or args.v_bytes < 1:
        raise SystemExit("rd2h demo: --k-bytes and --v-bytes must be >= 1")


def waves(items: Sequence[RequestSpec], size: int) -> Iterator[Sequence[RequestSpec]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def run(args: argparse.Namespace) -> DemoReport:
    model = make_model(args)
    steps = chunk_steps(model, args.tokens, args.chunk_tokens)
    report = DemoReport(
        backend=args.backend,
        protocol="v1" if args.v1 else "v2",
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        requests=args.requests,
        layers=args.layers,
        buffers=args.buffers or None,
        chunks_per_request=len(steps),
    )
    requests = [
        RequestSpec(f"demo-{i:04d}", args.tokens, args.chunk_tokens) for i in range(args.requests)
    ]
    compat = "" if args.v1 else model.compat()
    decode_spec = DecodeSpec(
        model=model,
        d_tp=args.decode_tp,
        backend=args.backend,
        num_blocks=model.num_blocks,
        contiguous=not args.scattered,
        compat=compat or None,
        read_timeout_s=max(1.0, args.lease_ms / 1000 / 4),
        trace_dir=args.trace,
    )
    prefill_spec = PrefillSpec(
        model=model,
        p_tp=args.prefill_tp,
        backend=args.backend,
        lease_ms=args.lease_ms,
        protocol="v1" if args.v1 else "v2",
        compat=compat,
        contiguous=not args.scattered,
        gate_timeout_s=args.timeout,
        trace_dir=args.trace,
    )
    decode = EngineProcess("decode", decode_spec, timeout=args.timeout)
    try:
        prefill = EngineProcess("prefill", prefill_spec, timeout=args.timeout)
        try:
            target = decode.target()
            start = time.monotonic()
            with progress_bar(len(requests), not args.json) as advance:
                for wave in waves(requests, args.wave):
                    run_wave(decode, prefill, target, wave, args.timeout, report, advance)
            report.wall_seconds = time.monotonic() - start
            collect(decode.call("state"), prefill.call("state"), report)
        finally:
            prefill.close()
    finally:
        decode.close()
    return report


def run_wave(
    decode: EngineProcess,
    prefill: EngineProcess,
    target: Any,
    wave: Sequence[RequestSpec],
    timeout: float,
    report: DemoReport,
    advance: Any,
) -> None:
    """One wave: Decode allocates, Prefill computes and publishes, Decode verifies."""
    ids = [r.ext_id for r in wave]
    decode.call("add", list(wave))
    prefill.call("add", list(wave), target)
    prefill.call("start")
    deadline = time.monotonic() + timeout
    for ext in ids:
        left = max(0.1, deadline - time.monotonic())
        result: DecodeResult = decode.call("wait", [ext], left, timeout=left + 5)[ext]
        if not result.terminal:
            report.failures.append(f"{ext}: not finished on every Decode rank in time")
        elif not result.ok:
            report.failures.append(f"{ext}: failed on Decode ({', '.join(map(str, result.codes))})")
        elif result.mismatches:
            bad = result.mismatches[0]
            report.failures.append(
                f"{ext}: {len(result.mismatches)}+ blocks differ, first: layer {bad.layer} "
                f"{bad.component} logical block {bad.logical_block}"
            )
        else:
            report.verified += 1
        advance()
    if not prefill.call("join", max(0.1, deadline - time.monotonic())):
        report.failures.append("Prefill compute did not finish in time")
    finished = prefill.call("wait", ids, max(0.1, deadline - time.monotonic()))
    for ext, per_rank in finished.items():
        if any(f is None for f in per_rank):
            report.failures.append(f"{ext}: Prefill never finished it")
    prefill.call("release", ids)
    decode.call("release", ids)


def collect(
    decode_state: dict[str, Any], prefill_state: dict[str, Any], report: DemoReport
) -> None:
    """Sum the engines' counters into the report; any engine error is a failure."""
    for m in decode_state["metrics"]:
        report.bytes_moved += m["read_bytes"]
    report.busiest_rank_read_seconds = max(m["read_s"] for m in decode_state["metrics"])
    for m in prefill_state["metrics"]:
        report.gate_waits += m["gate_waits"]
        report.gate_wait_seconds += m["gate_wait_s"]
    report.round_trip_ms = [t * 1000 for rank in prefill_state["round_trips"] for t in rank]
    for state, role in ((decode_state, "Decode"), (prefill_state, "Prefill")):
        report.failures += [f"{role}: {e}" for e in state["errors"]]
        report.failures += [f"{role}: {e.splitlines()[-1]}" for e in state.get("run_errors", [])]
        if not all(state["idle"]):
            report.failures.append(f"{role}: per-request state left behind")


def render(report: DemoReport) -> str:
    """The summary table, at most 80 columns wide."""
    mib = report.bytes_moved / MIB
    read_rate = _rate(report.bytes_moved, report.busiest_rank_read_seconds)
    ring = f"on {report.buffers} shared Prefill buffers" if report.buffers else "own buffers"
    rows = [
        ("requests", f"{report.requests} ({report.chunks_per_request} prefill chunks each)"),
        ("layers", f"{report.layers} {ring}"),
        ("bytes moved", f"{mib:,.1f} MiB in {report.wall_seconds:.2f} s wall"),
        ("read throughput", f"{read_rate:.2f} GB/s over the busiest rank's read time"),
        (
            "control round trip",
            f"p50 {report.percentile(0.5):.2f} ms, p99 {report.percentile(0.99):.2f} ms "
            f"({len(report.round_trip_ms)} layer messages)",
        ),
        (
            "Prefill gate wait",
            f"{report.gate_waits} waits, {report.gate_wait_seconds * 1000:.1f} ms in all",
        ),
    ]
    title = (
        f"rd2h demo: Prefill TP {report.prefill_tp} -> Decode TP {report.decode_tp}, "
        f"{report.backend}, protocol {report.protocol}"
    )
    lines = [title, "-" * min(80, len(title))]
    lines += [f"  {name:<19} {value}" for name, value in rows]
    lines += [f"  FAILED: {f}"[:80] for f in report.failures[:10]]
    lines.append(f"verified: {report.verified}/{report.requests} requests byte-exact")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    rest = list(sys.argv[1:] if argv is None else argv)
    if "--vllm" in rest:
        rest.remove("--vllm")
        # Imported on use: only --vllm needs the serving harness (and httpx).
        from rd2h_app.vllm_demo import main as vllm_main

        return vllm_main(rest)
    args = build_parser().parse_args(rest)
    check_args(args)
    try:
        report = run(args)
    except (ProtocolError, ImportError, RuntimeError, TimeoutError) as exc:
        print(f"rd2h demo: FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(render(report))
    if args.trace:
        out = os.path.join(args.trace, "timeline.json")
        print(
            f"traces: {args.trace}; timeline: rd2h trace {args.trace} -o {out}; "
            f"replay check: rd2h trace check {args.trace}",
            file=sys.stderr if args.json else sys.stdout,
        )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
