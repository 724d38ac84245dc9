"""What the serving benchmark measures with (``benchmarks.bench_serving``).

Streamed requests timed from the client (:func:`stream_one`, :func:`run_prompts`), the
servers' ``/metrics`` between two scrapes (:func:`server_deltas`, :func:`prompt_sources`,
:func:`settled_scrape`), CPU time of process groups and of the machine (:func:`idle_cores`,
:func:`cpu_times`, :func:`own_cpu_s`, :func:`foreign_cores`), the bytes on the two-host link
(:class:`LinkMeter`), its rate limit (:func:`set_rate`) and a progress display
(:class:`Progress`); the prompts, of a length counted with the model's tokenizer
(:func:`make_prompt`) and the cells that send them (:func:`plan_cells`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving_report import TBF_BURST, TBF_LATENCY, Result
from rd2h_runtime.testing import netns
from rd2h_vllm.serving.client import (
    NIXL_BYTES,
    NIXL_XFER_TIME,
    PREFILL_TIME,
    QUEUE_TIME,
    Metrics,
    completion_body,
    scrape,
)
from rd2h_vllm.serving.model import WORDS, TinyModel
from rd2h_vllm.serving.processes import (
    ManagedProcess,
)


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


def foreign_cores(busy_jiffies: int, own_s: float, wall_s: float) -> float:
    """Cores kept busy by processes not of this benchmark, on average over ``wall_s``."""
    tick = os.sysconf("SC_CLK_TCK")
    return max(0.0, (busy_jiffies / tick - own_s) / max(wall_s, 1e-9))


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
