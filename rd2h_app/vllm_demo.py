"""``rd2h demo --vllm``: two tiny real vLLM servers and ``rd2h proxy`` on this machine.

Builds a tiny random-weight model in a temporary folder, starts a Prefill and a Decode
vLLM server with RD2H and the proxy in front of them, computes every prompt's
single-instance tokens straight on the Prefill server (no ``kv_transfer_params``; a
``cache_salt`` keeps those runs out of the prefix cache the P/D runs use), sends the same
prompts through the proxy and compares token ids. Exits 0 only if every prompt matches.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from rd2h_app.progress import progress_bar
from rd2h_vllm.serving.client import (
    Completion,
    CompletionError,
    Metrics,
    complete_all,
    scrape,
)
from rd2h_vllm.serving.cluster import PDCluster
from rd2h_vllm.serving.model import MODEL_KINDS, build_model, make_prompts
from rd2h_vllm.serving.processes import (
    BACKENDS,
    POLLING_PREFILL_NICE,
    ServerError,
    ServerSpec,
)

MIB = 1 << 20
#: Single-instance runs carry this salt, so their blocks never serve the P/D runs.
REFERENCE_SALT = "rd2h-single-instance"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rd2h demo --vllm",
        description="Prefill and Decode vLLM servers with RD2H and rd2h proxy on "
        "127.0.0.1, a tiny random-weight model built locally; every prompt's tokens "
        "through the proxy must equal the single-instance run's.",
    )
    p.add_argument("--backend", choices=BACKENDS, default="nixl", help="transfer backend")
    p.add_argument("--model", choices=MODEL_KINDS, default="llama", help="tiny model kind")
    p.add_argument("--prompts", type=int, default=10, help="prompts to compare (default 10)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight together")
    p.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        help="Prefill TP size (default 1; 2 works with --model deepseek, whose MLA cache is "
        "whole on every rank: RD2H refuses Llama's KV heads split over Prefill ranks)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and prompts seed")
    p.add_argument("--keep-logs", type=Path, metavar="DIR", help="write server logs to DIR")
    p.add_argument("--timeout", type=float, default=300.0, help="server start-up limit (s)")
    return p


@dataclass
class VllmDemoReport:
    """What one run did (rendered by :func:`render`)."""

    model: str
    backend: str
    prefill_tp: int
    prompts: int
    max_tokens: int
    startup_s: float = 0.0
    single_s: float = 0.0
    pd_s: float = 0.0
    prompt_tokens: int = 0
    matched: int = 0
    mismatches: list[str] = field(default_factory=list)
    decode: Metrics | None = None
    decode_before: Metrics | None = None

    @property
    def ok(self) -> bool:
        return self.matched == self.prompts and not self.mismatches


def _status(console: Any, text: str) -> contextlib.AbstractContextManager[Any]:
    """A spinner with ``text`` on a terminal (nothing otherwise)."""
    return console.status(text, spinner="dots") if console is not None else contextlib.nullcontext()


def run(args: argparse.Namespace, log_dir: Path, console: Any) -> VllmDemoReport:
    """Build, start, compare (see the module docstring); ``console`` None: no progress."""
    model = build_model(log_dir / "model", args.model, seed=args.seed)
    report = VllmDemoReport(
        model=f"{model.name} ({model.architecture}, {model.num_layers} layers)",
        backend=args.backend,
        prefill_tp=args.prefill_tp,
        prompts=args.prompts,
        max_tokens=args.max_tokens,
    )
    # A Prefill at TP > 1 polls on every CPU while it waits for Decode: niced once ready.
    nice = POLLING_PREFILL_NICE if args.prefill_tp > 1 else 0
    prefill = ServerSpec(model, "prefill", args.backend, tp=args.prefill_tp, ready_nice=nice)
    decode = ServerSpec(model, "decode", args.backend)
    cluster = PDCluster("demo", [prefill], [decode], log_dir, start_timeout_s=args.timeout)
    try:
        with _status(console, "starting vLLM Prefill, Decode and rd2h proxy (a minute or two)"):
            cluster.wait_ready()
        report.startup_s = cluster.ready_s
        prompts = make_prompts(args.prompts, seed=args.seed)
        d_url = cluster.decode[0].url
        report.decode_before = scrape(d_url)
        enabled = console is not None
        with progress_bar(len(prompts), enabled, "single instance") as advance:
            start = time.monotonic()
            reference = complete_all(
                cluster.prefill[0].url, model.name, prompts, args.max_tokens,
                extra={"cache_salt": REFERENCE_SALT}, on_done=advance,
            )  # fmt: skip
            report.single_s = time.monotonic() - start
        with progress_bar(len(prompts), enabled, "through the proxy") as advance:
            start = time.monotonic()
            try:
                got = complete_all(
                    cluster.url, model.name, prompts, args.max_tokens,
                    concurrency=args.concurrency, on_done=advance,
                )  # fmt: skip
            except CompletionError as exc:
                raise CompletionError(exc.status, f"{exc.body}{_problems(cluster)}") from exc
            except httpx.HTTPError as exc:
                raise CompletionError(0, f"{exc!r}{_problems(cluster)}") from exc
            report.pd_s = time.monotonic() - start
        report.decode = scrape(d_url)
    finally:
        with _status(console, "stopping the servers"):
            cluster.stop()
    compare(reference, got, report)
    return report


def _problems(cluster: PDCluster) -> str:
    """The servers' and the proxy's latest errors and RD2H warnings, for a failure."""
    procs = [*cluster.prefill, *cluster.decode, *([cluster.proxy] if cluster.proxy else [])]
    lines = [f"\n  {p.name}: {line[:500]}" for p in procs for line in p.log_problems()]
    return "".join(lines)


def compare(reference: Sequence[Completion], got: Sequence[Completion], report: Any) -> None:
    """Count equal token sequences; describe the first differing position of the others."""
    for i, (want, have) in enumerate(zip(reference, got, strict=True)):
        report.prompt_tokens += want.prompt_tokens
        if want.token_ids == have.token_ids:
            report.matched += 1
            continue
        at = next(
            (
                j
                for j, (a, b) in enumerate(zip(want.token_ids, have.token_ids, strict=False))
                if a != b
            ),
            min(len(want.token_ids), len(have.token_ids)),
        )
        report.mismatches.append(
            f"prompt {i}: differs at token {at}: single {list(want.token_ids)}, "
            f"P/D {list(have.token_ids)}"
        )


def render(report: VllmDemoReport) -> str:
    """The summary, at most 80 columns wide (mismatch lines are cut)."""
    rows = [
        ("model", report.model),
        ("servers ready", f"{report.startup_s:.1f} s (Prefill, Decode and proxy)"),
        (
            "prompts",
            f"{report.prompts} ({report.prompt_tokens} prompt tokens), "
            f"{report.max_tokens} tokens each, greedy",
        ),
        ("single instance", f"{report.single_s:.2f} s"),
        ("through the proxy", f"{report.pd_s:.2f} s"),
    ]
    if report.decode is not None and report.decode_before is not None:
        after, before = report.decode, report.decode_before
        nbytes = after.rd2h_read_bytes - before.rd2h_read_bytes
        reads = after.rd2h_reads - before.rd2h_reads
        external = after.prompt_tokens("external_kv_transfer") - before.prompt_tokens(
            "external_kv_transfer"
        )
        computed = after.prompt_tokens("local_compute") - before.prompt_tokens("local_compute")
        rows.append(("Decode read", f"{nbytes / MIB:.2f} MiB in {reads:g} layer reads"))
        rows.append(
            ("Decode prompt tokens", f"{external:g} from Prefill, {computed:g} computed itself")
        )
    title = f"rd2h demo --vllm: Prefill TP {report.prefill_tp} -> Decode TP 1, {report.backend}"
    lines = [title, "-" * len(title)]
    lines += [f"  {name:<21} {value}" for name, value in rows]
    lines += [f"  MISMATCH {m}"[:80] for m in report.mismatches[:5]]
    lines.append(f"tokens match: {report.matched}/{report.prompts}")
    return "\n".join(lines)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanup of every server


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1 or args.concurrency < 1 or args.prefill_tp < 1:
        raise SystemExit("rd2h demo --vllm: counts and sizes must be >= 1")
    signal.signal(signal.SIGTERM, _terminate)
    from rich.console import Console

    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="rd2h-demo-vllm-") as tmp:
        log_dir = args.keep_logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            report = run(args, log_dir, console if console.is_terminal else None)
        except (ServerError, CompletionError, TimeoutError, OSError, httpx.HTTPError) as exc:
            print(f"rd2h demo --vllm: FAILED: {exc}", file=sys.stderr)
            if args.keep_logs is None:
                print("(rerun with --keep-logs DIR to keep every log)", file=sys.stderr)
            return 1
    print(render(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
