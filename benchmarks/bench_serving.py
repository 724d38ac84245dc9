"""Benchmark: time to first token of real vLLM servers, rd2h against vLLM's NixlConnector.

Run from the repository root (``rd2h bench serving`` runs the same)::

    python -m benchmarks.bench_serving            # about 10 min on 2 idle cores
    python -m benchmarks.bench_serving --quick    # a ~3 min smoke run
    python -m benchmarks.bench_serving --rounds 3 --lengths 64 450 --json out.json
    python -m benchmarks.bench_serving --two-hosts          # across a limited link, ~7 min
    python -m benchmarks.bench_serving --two-hosts --quick  # its ~3-5 min smoke run

A random-weight Llama is built here (16 layers, hidden 384, 6 KV heads: 48 KiB of KV per
token in float32), big enough that a 450-token prefill takes a few hundred ms on one core.
Four configurations serve the same prompts (~64, ~256 and ~450 tokens, counted with the
model's tokenizer; greedy, ``ignore_eos``, 8 tokens each, streamed):

* ``plain``: one vLLM server, no connector (the single instance every token is checked
  against);
* ``nixl``: vLLM's own NixlConnector (``kv_both``, host buffers) Prefill + Decode behind
  ``vllm-router`` (the baseline);
* ``rd2h-pf``: rd2h Prefill + Decode (nixl backend) behind ``vllm-router``: the standard
  Prefill-first flow;
* ``rd2h-df``: rd2h Prefill + Decode behind ``rd2h proxy``: Decode first, the proxy
  dispatches Prefill once Decode posted its rendezvous.

Each server runs on a core of its own: Prefill (and the single instance) on core 0,
Decode on core 1, every thread of its process group pinned once at launch and again once
it is up (vLLM's CPU worker with NixlConnector moves its main thread to the last core).
Routers, the proxy and this client are not pinned. NIXL's progress thread sleeps 50 us
between passes in both rd2h's agents and NixlConnector's (``RD2H_BOUND_NIXL_PROGRESS``).

Blocks run on fresh servers, interleaved (``plain``, then per round rd2h-pf, nixl,
rd2h-df, nixl), so drift of a shared machine shows in the per-block table and hits both
sides alike; the ratios pool every block of a configuration. Per block: a warm-up (one
short and one long prompt, not timed), then per length ``--requests`` prompts one at a
time and ``--concurrency`` x ``--waves`` prompts with ``--concurrency`` in flight.
Every prompt is distinct (no prefix-cache hits). TTFT is the time from sending the
request to the first streamed chunk carrying a token; end-to-end the time to the last.

Checks: every completion's token ids (``return_token_ids``) equal the single instance's
(exit 1 otherwise), and Decode's ``vllm:prompt_tokens_by_source_total`` tells per cell how
many prompt tokens Decode received (``external_kv_transfer``) and computed itself
(``local_compute``). Where rd2h's Prefill does not yet hand ``kv_transfer_params`` to a
standard router, Decode recomputes the prompt and the rd2h-pf rows show it.

Also per cell, from what the servers expose on ``/metrics``: Prefill's mean prefill time
per request (``vllm:request_prefill_time_seconds``: first scheduled to first token, the
step time of a lone prompt) and queue time, and Decode's KV read rate while reading
(rd2h: ``vllm:rd2h_read_*``, where each plan of a batched read counts its byte share of
the batch's time; NixlConnector: ``vllm:nixl_*``, one transfer per request). Per block,
the first request of the fresh pair (the first warm-up prompt, of the shortest length)
against that block's warm TTFT p50 of the same length.

Goal: rd2h (both flows) TTFT p50 <= 1.0x NixlConnector's, per length and concurrency.

Two hosts (``--two-hosts``, root and iproute2; issue 23)
--------------------------------------------------------
Prefill runs in one network namespace, Decode in another, joined by a veth pair with
198.18.0.1 (Prefill) and 198.18.0.2 (Decode) (:mod:`rd2h_runtime.testing.netns`; both
namespaces are removed on exit, also on an error, SIGTERM or Ctrl-C). Both connectors
move the KV with UCX over TCP on that link (``UCX_TLS=tcp``, ``UCX_NET_DEVICES`` = each
side's veth end) and name the link addresses: ``VLLM_HOST_IP``, NixlConnector's
side-channel host ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (which Prefill also hands Decode as
``remote_host``), rd2h's ``advertise_host`` (Decode's control ports, Prefill's claim
port, the transfer engine). The link runs ``tc tbf`` on both ends' egress at each of
``--rates`` Mbit/s (0: no limit), changed on the live link between the rate sub-blocks
of a block; this kernel has no fq/fq_codel/netem, so the tbf queue is one FIFO where
control frames wait behind KV bytes.

Where the HTTP hops run: Prefill's HTTP server listens on 198.18.0.1; Decode's (on
127.0.0.1), the router, the proxy and this client run in Decode's namespace (the client's
thread enters it with :func:`~rd2h_runtime.testing.netns.thread_in_netns`; the children it
starts inherit it). So client -> router/proxy -> Decode and Decode's rendezvous post to
the proxy stay on Decode's loopback; router/proxy -> Prefill (the request, and Prefill's
answer, which queues in Prefill's egress FIFO behind KV bytes) crosses the limited link,
once per request in both flows, as do rd2h's control messages and every KV byte.

Blocks: the single instance (in Decode's namespace, core 0), then per round rd2h-df,
nixl (``--configs`` adds rd2h-pf: rd2h-pf, nixl, rd2h-df, nixl), each on fresh servers
that serve every rate in turn (in ``--rates`` order in even rounds, reversed in odd ones,
the same for both connectors of a round); prompts are distinct per rate. Ratios pool the
blocks per (rate, length, concurrency). Defaults: 2 rounds, ~256 and ~450 tokens;
``--quick``: 1 round, 3 sequential and 4 concurrent requests per length and rate.
Besides the /metrics above, a thread samples the bytes Decode's veth end received every
5 ms while a cell runs (:class:`LinkMeter`): bytes / busy time is each connector's KV rate
on the wire, the measure the read-rate goal uses. The goals of issue 23 are printed met /
missed; "never above 1.0x on one host" is the default run's goal.

Where a sequential request's TTFT goes, for every configuration: the client's mean TTFT
laid over vLLM's own per-request intervals on each server (queue, first step) with
:mod:`rd2h_vllm.serving.breakdown` (``CellResult.stages``); for rd2h's own stages (claim,
publish, read, reply, the scheduler noticing) run the servers with ``RD2H_TRACE_DIR`` and
``rd2h trace requests``. ``--json`` keeps every completion's TTFT, end-to-end time, tokens
and send time (``Result.sent_unix``, wall clock) and per cell the servers' /metrics deltas
(``CellResult.server``) and stages.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any, Final

import httpx

from benchmarks.serving_report import (
    CONFIGS,
    DECODE_CPUS,
    PREFILL_CPUS,
    Block,
    CellResult,
    cell_stages,
    goal_lines,
    goal_lines_two_hosts,
    machine_load,
    pool_rows,
    rate_label,
    render,
    token_check,
)
from benchmarks.serving_run import (
    Cell,
    LinkMeter,
    Progress,
    cpu_times,
    foreign_cores,
    idle_cores,
    own_cpu_s,
    plan_cells,
    prompt_sources,
    run_prompts,
    server_deltas,
    set_rate,
    settled_scrape,
    token_counter,
)
from rd2h_runtime.testing import netns
from rd2h_vllm.serving.client import (
    scrape,
)
from rd2h_vllm.serving.model import TinyModel, build_model
from rd2h_vllm.serving.processes import (
    HOST,
    ManagedProcess,
    ServerError,
    ServerSpec,
    VllmServer,
    start_proxy,
    stop_all,
)
from rd2h_vllm.serving.router import start_router

#: The model: 16 layers, hidden 384, head_dim 64, no GQA -> 48 KiB of KV per token (f32).
MODEL_OVERRIDES: Final = {
    "num_hidden_layers": 16,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
}
MAX_MODEL_LEN: Final = 1024
KV_CACHE_BYTES: Final = 256 << 20  # 5,461 tokens of 48 KiB: 4 x 450 in flight fit twice

ROUND: Final = ("rd2h-pf", "nixl", "rd2h-df", "nixl")

#: Two hosts: link rates in Mbit/s (0: no limit); at 1000 Mbit/s a 450-token prompt's
#: 21.6 MB of KV takes ~175 ms on the link, about 60% of its prefill on one core.
RATES: Final = (1000, 3000, 0)
TWO_HOST_CONFIGS: Final = ("rd2h-df", "nixl")


# -- prompts -------------------------------------------------------------------------------


# -- one streamed request ------------------------------------------------------------------


# -- a block: one configuration on fresh servers -------------------------------------------


def server_specs(
    config: str, model: TinyModel, hosts: netns.TwoHosts | None = None
) -> list[ServerSpec]:
    """The servers of ``config``: [single] or [Prefill, Decode]; with ``hosts``, Prefill
    in its namespace serving HTTP on its link address, Decode (and the single instance)
    in Decode's, both moving KV with UCX over TCP on the link (see the module docstring)."""
    common: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": KV_CACHE_BYTES}
    if config == "plain":
        single = ServerSpec(model, "plain", cpus=PREFILL_CPUS, **common)
        return [single if hosts is None else dataclasses.replace(single, netns=hosts.decode_ns)]
    if config == "nixl":
        specs = [
            ServerSpec(model, "nixl_connector", cpus=PREFILL_CPUS, **common),
            ServerSpec(model, "nixl_connector", cpus=DECODE_CPUS, **common),
        ]
    else:
        specs = [
            ServerSpec(model, "prefill", "nixl", cpus=PREFILL_CPUS, **common),
            ServerSpec(model, "decode", "nixl", cpus=DECODE_CPUS, **common),
        ]
    if hosts is None:
        return specs
    sides = (
        (hosts.prefill_ns, hosts.prefill_dev, hosts.prefill_ip, hosts.prefill_ip),
        (hosts.decode_ns, hosts.decode_dev, hosts.decode_ip, HOST),
    )
    placed = []
    for spec, (ns, dev, link_ip, http_host) in zip(specs, sides, strict=True):
        env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev, "VLLM_HOST_IP": link_ip}
        extra: dict[str, Any] = {}
        if config == "nixl":
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = link_ip
        else:
            extra["advertise_host"] = link_ip
        placed.append(
            dataclasses.replace(
                spec,
                netns=ns,
                host=http_host,
                env={**spec.env, **env},
                extra_config={**spec.extra_config, **extra},
            )
        )
    return placed


def run_block(
    index: int,
    config: str,
    model: TinyModel,
    warmup: Sequence[str],
    cells: Mapping[int | None, Sequence[Cell]],
    rates: Sequence[int | None],
    args: argparse.Namespace,
    log_dir: Path,
    progress: Progress,
    hosts: netns.TwoHosts | None = None,
) -> Block:
    """Start ``config`` fresh, warm it up, measure every cell at every rate (in order,
    the link's limit changed between them), stop it."""
    block = Block(index, config, rates=list(rates))
    label = f"b{index:02d}-{config}"
    progress.say(f"block {index}: {config}: starting servers")
    started = time.monotonic()
    specs = server_specs(config, model, hosts)
    if args.no_pin:
        specs = [dataclasses.replace(s, cpus=()) for s in specs]
    roles = ["single"] if config == "plain" else ["prefill", "decode"]
    servers: list[VllmServer] = []
    front: ManagedProcess | None = None
    try:
        set_rate(hosts, rates[0])
        for spec, role in zip(specs, roles, strict=True):
            servers.append(VllmServer(spec, log_dir, name=f"{label}-{role}"))
        for server in servers:
            server.wait_ready(args.timeout)
        url = servers[0].url
        if config in ("nixl", "rd2h-pf"):
            router = start_router(servers[:1], servers[1:], log_dir, name=f"{label}-router")
            front, url = router, router.url
        elif config == "rd2h-df":
            proxy = start_proxy(servers[:1], servers[1:], log_dir, name=f"{label}-proxy")
            front, url = proxy, proxy.url
        for server in servers:  # once more: threads started while it came up
            if server.spec.cpus:
                server.pin_cpus(server.spec.cpus)
        block.ready_s = time.monotonic() - started
        prefill, decode = servers[0], servers[-1]
        progress.say(f"block {index}: {config}: warm-up ({rate_label(rates[0])})")
        block.warmup = run_prompts(url, model.name, warmup[:1], args.max_tokens, 1)
        block.warmup += run_prompts(url, model.name, warmup[1:], args.max_tokens, 1)
        block.idle_cores = idle_cores(servers)
        everyone = [*servers, *([front] if front else [])]
        steal_all = busy_all = total_all = 0
        own_all = wall_all = 0.0
        for rate in rates:
            set_rate(hosts, rate)
            steal0, busy0, total0 = cpu_times()
            own0, wall0 = own_cpu_s(everyone), time.monotonic()
            for cell in cells[rate]:
                where = f" at {rate_label(rate)}" if rate is not None else ""
                progress.say(
                    f"block {index}: {config}: {cell.length} tokens, c={cell.concurrency}{where}"
                )
                p0 = scrape(prefill.url)
                before = scrape(decode.url) if decode is not prefill else p0
                meter = LinkMeter(hosts.decode_dev) if hosts and config != "plain" else None
                with meter or contextlib.nullcontext():
                    results = run_prompts(
                        url, model.name, cell.prompts, args.max_tokens, cell.concurrency
                    )
                expected = sum(r.prompt_tokens for r in results)
                after = settled_scrape(decode.url, before, expected)
                p1 = settled_scrape(prefill.url, p0, expected) if decode is not prefill else after
                ext, loc, hit = prompt_sources(before, after)
                deltas = server_deltas(p0, p1, before, after)
                laid = cell_stages(config, results, [(p0, p1), (before, after)])
                if meter is not None:
                    deltas["link_bytes"] = meter.total
                    deltas["link_busy_bytes"] = meter.busy_total
                    deltas["link_busy_s"] = meter.busy_s
                block.cells.append(
                    CellResult(
                        index,
                        config,
                        cell.length,
                        cell.concurrency,
                        results,
                        ext,
                        loc,
                        hit,
                        rate,
                        deltas,
                        laid,
                    )
                )
                progress.advance(len(cell.prompts))
                for r in results:
                    if r.error:
                        problems = "".join(
                            f"\n  {p.name}: {line[:300]}"
                            for p in everyone
                            for line in p.log_problems(3)
                        )
                        raise ServerError(f"{config}: request failed: {r.error}{problems}")
            steal1, busy1, total1 = cpu_times()
            own1, wall1 = own_cpu_s(everyone), time.monotonic()
            steal_all, busy_all = steal_all + steal1 - steal0, busy_all + busy1 - busy0
            total_all += total1 - total0
            own_all, wall_all = own_all + own1 - own0, wall_all + wall1 - wall0
            block.load[str(rate)] = (
                (steal1 - steal0) / max(1, total1 - total0),
                foreign_cores(busy1 - busy0, own1 - own0, wall1 - wall0),
            )
        block.steal = steal_all / max(1, total_all)
        block.foreign = foreign_cores(busy_all, own_all, wall_all)
    finally:
        progress.say(f"block {index}: {config}: stopping")
        procs: list[ManagedProcess] = [*([front] if front else []), *servers]
        for proc in procs:
            proc.terminate(grace_s=5.0)
        for proc in procs:
            proc.reap(wait=True)
    return block


# -- report --------------------------------------------------------------------------------


# -- main ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_serving",
        description=(__doc__ or "").split("\n\n")[0],
    )
    ap.add_argument("--quick", action="store_true", help="a ~3 min smoke run (1 round, fewer)")
    ap.add_argument("--rounds", type=int, help="rounds of rd2h-pf, nixl, rd2h-df, nixl (3; two "
                    "hosts: of rd2h-df, nixl, 2)")  # fmt: skip
    ap.add_argument("--lengths", type=int, nargs="+", help="prompt tokens (64 256 450; two "
                    "hosts: 256 450)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=6, help="sequential requests per length")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight together")
    ap.add_argument("--waves", type=int, default=2, help="concurrent requests = concurrency x N")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per completion")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS[1:], help="(default: all; two "
                    "hosts: rd2h-df nixl)")  # fmt: skip
    ap.add_argument("--two-hosts", action="store_true", help="Prefill and Decode in two network "
                    "namespaces joined by a rate-limited veth link (root, iproute2)")  # fmt: skip
    default_rates = " ".join(map(str, RATES))
    ap.add_argument("--rates", type=int, nargs="+", metavar="MBIT", help="two hosts: the link's "
                    f"rates in Mbit/s, 0 no limit (default {default_rates})")  # fmt: skip
    ap.add_argument("--no-pin", action="store_true", help="do not pin servers to cores")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write every measurement")
    ap.add_argument("--keep-logs", type=Path, metavar="DIR", help="keep server logs in DIR")
    ap.add_argument("--timeout", type=float, default=300.0, help="server start-up limit (s)")
    return ap


def settle_args(args: argparse.Namespace) -> None:
    """Fill the defaults that depend on the regime and on ``--quick``."""
    two = args.two_hosts
    if args.rates is not None and not two:
        raise SystemExit("--rates needs --two-hosts")
    if args.rates is None:
        args.rates = list(RATES)
    if args.quick:
        args.rounds = 1 if args.rounds is None else args.rounds
        args.lengths = args.lengths or ([256, 450] if two else [64, 450])
        args.requests = 3
        args.waves = 1
        quick_configs = list(TWO_HOST_CONFIGS) if two else ["rd2h-pf", "nixl", "rd2h-df"]
        args.configs = args.configs or quick_configs
    args.rounds = args.rounds if args.rounds is not None else (2 if two else 3)
    args.lengths = args.lengths or ([256, 450] if two else [64, 256, 450])
    args.configs = args.configs or list(TWO_HOST_CONFIGS if two else CONFIGS[1:])
    if any(r < 0 for r in args.rates) or len(set(args.rates)) != len(args.rates):
        raise SystemExit("--rates must be distinct and >= 0 (0: no limit)")


def schedule(args: argparse.Namespace) -> list[str]:
    """The blocks' configurations in order: plain, then the interleaved rounds (on two
    hosts with one rd2h flow: that flow, nixl per round)."""
    order = ["plain"]
    rd2h = [c for c in args.configs if c.startswith("rd2h")]
    round_ = [c for c in ROUND if c in args.configs]
    if args.two_hosts and len(rd2h) == 1 and "nixl" in args.configs:
        round_ = [rd2h[0], "nixl"]
    for _ in range(args.rounds):
        order += round_
    return order


def block_rates(args: argparse.Namespace, block: int, config: str) -> list[int | None]:
    """The rates a block measures, in order: as given in even rounds, reversed in odd ones
    (the same for every configuration of a round); one host: [None]."""
    if not args.two_hosts:
        return [None]
    if config == "plain":
        return list(args.rates)
    per_round = max(1, len(schedule(args)) - 1) // max(1, args.rounds)
    odd = ((block - 1) // max(1, per_round)) % 2 == 1
    return list(reversed(args.rates)) if odd else list(args.rates)


def missing_software() -> str | None:
    """What this benchmark needs and this environment lacks (None: nothing)."""
    import importlib.util

    from rd2h_vllm.serving.router import router_executable

    if importlib.util.find_spec("vllm") is None:
        return "vLLM (bash tools/install-vllm.sh)"
    try:
        router_executable()
    except ServerError:
        return "vllm-router (pip install vllm-router)"
    return None


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every block's cleanup


@contextlib.contextmanager
def regime(args: argparse.Namespace) -> Iterator[netns.TwoHosts | None]:
    """One host: nothing. Two hosts: the namespace pair, this thread in Decode's (so the
    router, the proxy and the client run there); everything started is stopped before the
    namespaces go, also on an error or a signal."""
    if not args.two_hosts:
        yield None
        return
    with netns.two_hosts() as hosts, netns.thread_in_netns(hosts.decode_ns):
        try:
            yield hosts
        finally:
            stop_all()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settle_args(args)
    if min(args.lengths) < 8 or max(args.lengths) > MAX_MODEL_LEN - args.max_tokens - 64:
        raise SystemExit(f"--lengths must be within 8..{MAX_MODEL_LEN - args.max_tokens - 64}")
    missing = missing_software()
    if missing is None and args.two_hosts:
        reason = netns.unavailable(need_tc=True)
        missing = None if reason is None else f"two hosts: {reason}"
    if missing is not None:
        print(f"rd2h bench serving: skipped, needs {missing}")
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    load_before = machine_load()
    started = time.monotonic()
    rates: list[int | None] = list(args.rates) if args.two_hosts else [None]
    with tempfile.TemporaryDirectory(prefix="rd2h-bench-serving-") as tmp:
        log_dir = args.keep_logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        model = build_model(Path(tmp) / "model", "llama", seed=0, overrides=MODEL_OVERRIDES)
        warmup, cells = plan_cells(
            args.lengths,
            args.requests,
            args.concurrency,
            args.waves,
            token_counter(model),
            rates,
        )
        order = schedule(args)
        per_block = sum(len(c.prompts) for rate in rates for c in cells[rate])
        progress = Progress(per_block * len(order))
        regime_text = (
            f"two hosts at {', '.join(rate_label(r) for r in rates)}; " if args.two_hosts else ""
        )
        print(
            f"rd2h bench serving: {regime_text}{len(order)} blocks ({', '.join(order)}), "
            f"{per_block} timed requests each; {load_before}",
            flush=True,
        )
        blocks: list[Block] = []
        try:
            with regime(args) as hosts, progress.running():
                for i, config in enumerate(order):
                    blocks.append(
                        run_block(
                            i,
                            config,
                            model,
                            warmup,
                            cells,
                            block_rates(args, i, config),
                            args,
                            log_dir,
                            progress,
                            hosts,
                        )
                    )
        except (ServerError, OSError, httpx.HTTPError, TimeoutError, RuntimeError) as exc:
            print(f"rd2h bench serving: FAILED: {exc}", file=sys.stderr)
            if args.keep_logs is None:
                print("(rerun with --keep-logs DIR to keep every log)", file=sys.stderr)
            return 1
    matched, mismatches = token_check(blocks)
    rows = pool_rows(blocks, matched)
    print(render(rows, blocks, args))
    if args.two_hosts:
        goal, missed = goal_lines_two_hosts(rows, blocks)
    else:
        goal, missed = goal_lines(rows)
    print()
    print("\n".join(goal))
    total = sum(r.n for r in rows)
    print(f"tokens match the single instance: {total - len(mismatches)}/{total}")
    for m in mismatches[:5]:
        print(f"  MISMATCH {m}"[:200])
    elapsed = time.monotonic() - started
    print(f"run time {elapsed:.0f} s; before: {load_before}; after: {machine_load()}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "args": {
                        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    },
                    "rows": [asdict(r) for r in rows],
                    "blocks": [asdict(b) for b in blocks],
                    "mismatches": mismatches,
                    "goal_missed": missed,
                },
                indent=1,
            )
        )
    if mismatches:
        return 1
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
