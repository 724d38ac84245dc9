"""Where a request's time to first token goes, from what every vLLM server measures itself.

vLLM timestamps each request on each server (arrival at the API server, queued, first
scheduled to compute, first token, finished) and exports the intervals as Prometheus
histograms; the difference of two scrapes gives each interval's mean over the requests
that finished between them, for any connector: rd2h and NixlConnector alike, no
instrumentation needed. Two of them matter here:

* ``queue``: queued -> first scheduled to compute. On a Decode this is the KV wait:
  admission, the connector's load (Prefill's compute too, when Decode is asked first),
  and the scheduler noticing that the load finished.
* ``first step``: first scheduled -> first token (``vllm:request_prefill_time_seconds``):
  the prompt's compute on Prefill or a single server, the first decode step on Decode.

:func:`stages` lays a client's mean TTFT over them, per flow:

* ``single``: front end (API server, tokenizing, the client's HTTP), queue, compute;
* ``prefill-first`` (a router: Prefill answers first, then Decode is asked): Prefill's
  queue, compute, and front end (arrival -> queued, first token -> answer), the HTTP
  hops (client, router, both front ends), Decode's KV wait and first step;
* ``decode-first`` (``rd2h proxy``: Decode is asked first and Prefill runs while Decode
  waits): the HTTP hops, then Decode's KV wait split into Prefill's front end, queue and
  compute and the rest (the rendezvous, the proxy's dispatch to Prefill, the layers
  Prefill's compute did not hide, the scheduler noticing), then Decode's first step.

Means are only meaningful for requests run one at a time (with several in flight the
intervals overlap), and one slow request weighs on all of a cell's stages (they are
means, where TTFT tables show medians); intervals measured on two servers are durations,
so their clocks need not agree. A stage computed as a difference can come out slightly
negative from rounding and sampling; it is shown as measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rd2h_vllm.serving.client import E2E_TIME, PREFILL_TIME, QUEUE_TIME, TTFT, Metrics

__all__ = ["FLOWS", "ServerTimes", "mean_stages", "server_times", "stage_line", "stages"]

#: The flows :func:`stages` knows, by how the request reaches the servers.
FLOWS = ("single", "prefill-first", "decode-first")


@dataclass(frozen=True)
class ServerTimes:
    """One server's mean intervals (seconds) over the requests finished between two scrapes."""

    requests: int
    queue_s: float  # queued -> first scheduled
    first_step_s: float  # first scheduled -> first token
    ttft_s: float  # arrival -> first token
    e2e_s: float  # arrival -> finished

    @property
    def front_s(self) -> float:
        """Arrival -> queued (and first token -> its first chunk out): the API server."""
        return self.ttft_s - self.queue_s - self.first_step_s


def _mean(before: Metrics, after: Metrics, name: str) -> tuple[int, float]:
    (sum0, count0), (sum1, count1) = before.histogram(name), after.histogram(name)
    count = round(count1 - count0)
    return count, ((sum1 - sum0) / count if count > 0 else 0.0)


def server_times(before: Metrics, after: Metrics) -> ServerTimes | None:
    """The mean intervals of the requests a server finished between two scrapes of its
    ``/metrics``; None when none finished."""
    count, e2e = _mean(before, after, E2E_TIME)
    if count <= 0:
        return None
    return ServerTimes(
        requests=count,
        queue_s=_mean(before, after, QUEUE_TIME)[1],
        first_step_s=_mean(before, after, PREFILL_TIME)[1],
        ttft_s=_mean(before, after, TTFT)[1],
        e2e_s=e2e,
    )


def stages(
    flow: str,
    client_ttft_s: float,
    servers: Sequence[ServerTimes | None],
) -> list[tuple[str, float]]:
    """``(stage, seconds)`` laid over a client's mean TTFT, in the order a request meets
    them; they add up to ``client_ttft_s``. ``servers``: ``[single]`` or ``[Prefill,
    Decode]``. Raises ValueError for an unknown flow or a server with no request."""
    if flow not in FLOWS:
        raise ValueError(f"unknown flow {flow!r}: expected one of {', '.join(FLOWS)}")
    if any(s is None for s in servers):
        raise ValueError("a server finished no request between the scrapes")
    if flow == "single":
        (one,) = servers
        assert one is not None
        return [
            ("front end and HTTP", client_ttft_s - one.queue_s - one.first_step_s),
            ("queue", one.queue_s),
            ("compute (first step)", one.first_step_s),
        ]
    prefill, decode = servers
    assert prefill is not None and decode is not None
    p_work = prefill.queue_s + prefill.first_step_s
    if flow == "prefill-first":
        return [
            ("Prefill: queue", prefill.queue_s),
            ("Prefill: compute", prefill.first_step_s),
            ("Prefill: front end, answer", prefill.e2e_s - p_work),
            (
                "HTTP hops, front ends",
                client_ttft_s - prefill.e2e_s - decode.queue_s - decode.first_step_s,
            ),
            ("Decode: KV wait", decode.queue_s),
            ("Decode: first step", decode.first_step_s),
        ]
    return [
        ("HTTP hops, front ends", client_ttft_s - decode.queue_s - decode.first_step_s),
        ("Prefill: front end", prefill.front_s),
        ("Prefill: queue", prefill.queue_s),
        ("Prefill: compute", prefill.first_step_s),
        ("Decode: rest of KV wait", decode.queue_s - p_work - prefill.front_s),
        ("Decode: first step", decode.first_step_s),
    ]


def mean_stages(samples: Sequence[Sequence[tuple[str, float]]]) -> list[tuple[str, float]]:
    """The mean of each stage over ``samples`` of one flow (e.g. one per block), in order."""
    if not samples:
        return []
    names = [name for name, _ in samples[0]]
    return [(name, sum(dict(s)[name] for s in samples) / len(samples)) for name in names]


def stage_line(stages_s: Sequence[tuple[str, float]]) -> str:
    """``stage ms | stage ms | ... = total ms`` for a table row."""
    parts = [f"{name} {value * 1e3:.1f}" for name, value in stages_s]
    return " | ".join(parts) + f" = {sum(v for _, v in stages_s) * 1e3:.1f} ms"
