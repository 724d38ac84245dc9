"""A small OpenAI completions client and a Prometheus ``/metrics`` reader.

Completions are greedy (temperature 0, ``ignore_eos``, a fixed ``max_tokens``) and ask
for ``return_token_ids`` (vLLM 0.32), so runs are compared token by token, not by text.
:func:`stream_and_abort` reads a few events of a streamed completion and drops the
connection, which is how vLLM's server learns that a client went away (it aborts the
request). :class:`Metrics` is one scrape of a server's ``/metrics``, summed over labels.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

import httpx

#: The vLLM 0.32 series read here (Prometheus names; counters end in ``_total``).
RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"
KV_USAGE: Final = "vllm:kv_cache_usage_perc"  # a fraction, 0..1
PROMPT_TOKENS: Final = "vllm:prompt_tokens_total"
PROMPT_TOKENS_BY_SOURCE: Final = "vllm:prompt_tokens_by_source_total"  # label source
#: RD2H's own series (rd2h_vllm.metrics).
RD2H_READ_BYTES: Final = "vllm:rd2h_read_bytes_total"  # label layer
RD2H_READ_SECONDS_SUM: Final = "vllm:rd2h_read_seconds_sum"
RD2H_READ_SECONDS_COUNT: Final = "vllm:rd2h_read_seconds_count"
RD2H_FAILURES: Final = "vllm:rd2h_failures_total"  # label code
RD2H_ABORTS: Final = "vllm:rd2h_aborts_total"  # label direction: sent, received
#: vLLM's per-request timings (histograms: ``_sum`` seconds and ``_count`` requests).
PREFILL_TIME: Final = "vllm:request_prefill_time_seconds"  # first scheduled -> first token
QUEUE_TIME: Final = "vllm:request_queue_time_seconds"  # arrival -> first scheduled
TTFT: Final = "vllm:time_to_first_token_seconds"  # the engine's own view
E2E_TIME: Final = "vllm:e2e_request_latency_seconds"  # arrival -> finished
#: vLLM NixlConnector's transfers on the reading side (histograms, one sample per transfer).
NIXL_XFER_TIME: Final = "vllm:nixl_xfer_time_seconds"
NIXL_BYTES: Final = "vllm:nixl_bytes_transferred"


class CompletionError(RuntimeError):
    """A completion request answered with an error status or a malformed body (status 0:
    no answer at all)."""

    def __init__(self, status: int, body: str) -> None:
        head = f"HTTP {status}" if status else "no answer"
        super().__init__(f"{head}: {body[:6000]}")
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True)
class Completion:
    """One choice of a completion: the generated token ids and text."""

    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    finish_reason: str | None
    seconds: float


def completion_body(
    model: str, prompt: str, max_tokens: int, stream: bool = False
) -> dict[str, Any]:
    """The JSON body of a greedy, fixed-length completion request."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


def complete(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int = 16,
    timeout_s: float = 120.0,
    extra: Mapping[str, Any] | None = None,
) -> Completion:
    """POST one greedy completion to ``base_url/v1/completions`` and parse its choice."""
    body = {**completion_body(model, prompt, max_tokens), **(extra or {})}
    start = time.monotonic()
    resp = httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
    if resp.status_code != 200:
        raise CompletionError(resp.status_code, resp.text)
    try:
        data = resp.json()
        choice = data["choices"][0]
        return Completion(
            token_ids=tuple(choice["token_ids"]),
            text=choice["text"],
            prompt_tokens=int(data["usage"]["prompt_tokens"]),
            finish_reason=choice.get("finish_reason"),
            seconds=time.monotonic() - start,
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise CompletionError(resp.status_code, f"unexpected body ({exc}): {resp.text}") from exc


def complete_all(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int = 16,
    concurrency: int = 1,
    timeout_s: float = 120.0,
    extra: Mapping[str, Any] | None = None,
    on_done: Callable[[], None] | None = None,
) -> list[Completion]:
    """Complete every prompt, ``concurrency`` requests in flight; results in order.

    ``extra`` is merged into every request body; ``on_done`` is called after each.
    """

    def one(prompt: str) -> Completion:
        result = complete(base_url, model, prompt, max_tokens, timeout_s, extra)
        if on_done is not None:
            on_done()
        return result

    if concurrency <= 1:
        return [one(p) for p in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def stream_and_abort(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int = 200,
    events: int = 3,
    timeout_s: float = 120.0,
) -> int:
    """Stream a completion, drop the connection after ``events`` tokens; tokens seen.

    Raises :class:`CompletionError` when the stream ends (or fails) before that: the
    abort would then not happen mid-stream.
    """
    body = completion_body(model, prompt, max_tokens, stream=True)
    seen = 0
    with (
        httpx.Client(timeout=timeout_s) as client,
        client.stream("POST", f"{base_url}/v1/completions", json=body) as resp,
    ):
        if resp.status_code != 200:
            raise CompletionError(resp.status_code, resp.read().decode(errors="replace"))
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            seen += sum(len(c.get("token_ids") or ()) for c in event.get("choices", ()))
            if seen >= events:
                return seen  # leaving the with-blocks closes the connection mid-stream
    raise CompletionError(200, f"the stream ended after {seen} tokens, before the abort")


@dataclass(frozen=True, repr=False)
class Metrics:
    """One scrape of ``/metrics``: ``samples[name]`` lists ``(labels, value)`` pairs."""

    samples: Mapping[str, Sequence[tuple[Mapping[str, str], float]]]

    def __repr__(self) -> str:
        return f"Metrics({self.summary()})"

    def value(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over the samples whose labels include ``labels`` (0 if none)."""
        return sum(
            v
            for have, v in self.samples.get(name, ())
            if all(have.get(k) == want for k, want in labels.items())
        )

    @property
    def running(self) -> float:
        return self.value(RUNNING)

    @property
    def waiting(self) -> float:
        return self.value(WAITING)

    @property
    def kv_usage(self) -> float:
        return self.value(KV_USAGE)

    @property
    def idle(self) -> bool:
        """Nothing running, nothing waiting and no KV block in use."""
        return self.running == 0 and self.waiting == 0 and self.kv_usage == 0

    def prompt_tokens(self, source: str | None = None) -> float:
        """Prompt tokens, all or by ``source`` (local_compute, local_cache_hit,
        external_kv_transfer)."""
        if source is None:
            return self.value(PROMPT_TOKENS)
        return self.value(PROMPT_TOKENS_BY_SOURCE, source=source)

    @property
    def rd2h_read_bytes(self) -> float:
        return self.value(RD2H_READ_BYTES)

    @property
    def rd2h_reads(self) -> float:
        return self.value(RD2H_READ_SECONDS_COUNT)

    @property
    def rd2h_read_seconds(self) -> float:
        return self.value(RD2H_READ_SECONDS_SUM)

    @property
    def rd2h_failures(self) -> float:
        return self.value(RD2H_FAILURES)

    def rd2h_aborts(self, direction: str) -> float:
        """RD2H ABORT messages ``sent`` or ``received``."""
        return self.value(RD2H_ABORTS, direction=direction)

    def histogram(self, name: str) -> tuple[float, float]:
        """``(sum, count)`` of a histogram series (e.g. :data:`PREFILL_TIME`), over labels."""
        return self.value(f"{name}_sum"), self.value(f"{name}_count")

    def read_bytes_by_layer(self) -> dict[str, float]:
        """RD2H read bytes per ``layer`` label."""
        out: dict[str, float] = {}
        for labels, v in self.samples.get(RD2H_READ_BYTES, ()):
            layer = labels.get("layer", "")
            out[layer] = out.get(layer, 0.0) + v
        return out

    def summary(self) -> str:
        """A one-line view for logs and assertion messages."""
        return (
            f"running={self.running:g} waiting={self.waiting:g} kv_usage={self.kv_usage:g} "
            f"prompt_tokens={self.prompt_tokens():g} "
            f"(local_compute={self.prompt_tokens('local_compute'):g}, "
            f"local_cache_hit={self.prompt_tokens('local_cache_hit'):g}, "
            f"external_kv_transfer={self.prompt_tokens('external_kv_transfer'):g}) "
            f"rd2h_read_bytes={self.rd2h_read_bytes:g} rd2h_failures={self.rd2h_failures:g}"
        )


def parse_metrics(text: str) -> Metrics:
    """Parse Prometheus text exposition into :class:`Metrics`."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[Mapping[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return Metrics(samples)


def scrape(base_url: str, timeout_s: float = 10.0) -> Metrics:
    """GET ``base_url/metrics`` and parse it."""
    resp = httpx.get(f"{base_url}/metrics", timeout=timeout_s)
    resp.raise_for_status()
    return parse_metrics(resp.text)


def wait_idle(base_url: str, timeout_s: float = 30.0) -> Metrics:
    """Scrape until the server is idle (:attr:`Metrics.idle`); raise with the last view."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(base_url)
        if metrics.idle:
            return metrics
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url} not idle after {timeout_s} s: {metrics.summary()}")
        time.sleep(0.2)
