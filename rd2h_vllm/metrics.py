"""RD2H's transfer statistics as vLLM KV-connector stats and Prometheus metrics.

Theory of operation
-------------------
vLLM 0.32 moves connector stats like this (all in vLLM's own code):

1. every worker's connector returns a ``KVConnectorStats`` from
   ``get_kv_connector_stats()`` (it hands over what it collected and starts afresh);
2. ``KVOutputAggregator.aggregate`` merges the TP workers' objects with
   ``aggregate()``; the scheduler merges its own connector's stats the same way;
3. ``Scheduler.make_stats`` ships ``stats.to_dict()`` (plain JSON-like data) to the
   front-end in ``SchedulerStats.kv_connector_stats``;
4. there the connector CLASS rebuilds an object with ``build_kv_connector_stats(data)``
   for the periodic log line (``aggregate`` then ``reduce``), and the object returned by
   its ``build_prom_metrics(...)`` gets ``observe(data, engine_idx)`` for Prometheus.
   Inside a MultiConnector the data is nested under the child class NAME, which vLLM
   resolves through its connector registry (see :mod:`rd2h_vllm.plugin`).

:class:`Rd2hKVConnectorStats` is that object; :class:`Rd2hMetricsMixin` gives the
connector class the two class methods of step 4; :class:`Rd2hPromMetrics` registers the
``vllm:rd2h_*`` series. What is recorded (required-departures.md item 15): per layer the
bytes, descriptors and duration of each batched read; Prefill's wait on the slot-reuse
gate; failures by :class:`~rd2h_protocol.errors.ErrorCode` name; expired leases; aborts
sent and received; and any other endpoint counter as a named protocol event
(:class:`CounterDelta` turns the endpoints' cumulative ``stats`` into increments).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from rd2h_protocol.errors import ErrorCode

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

# Keys of the data dict (the wire form between vLLM processes: str keys, ints, floats).
LAYER_READS: Final = "layer_reads"  # {layer: [reads, bytes, descriptors]}
READ_SECONDS: Final = "read_seconds"  # {layer: [seconds, ...]} one per batched read
GATE_WAIT_SECONDS: Final = "gate_wait_seconds"  # [seconds, ...]
FAILURES: Final = "failures"  # {ErrorCode name: count}
EXPIRED_LEASES: Final = "expired_leases"
ABORTS_SENT: Final = "aborts_sent"
ABORTS_RECEIVED: Final = "aborts_received"
EVENTS: Final = "protocol_events"  # {endpoint counter name: count}

_SCALARS: Final = (EXPIRED_LEASES, ABORTS_SENT, ABORTS_RECEIVED)

#: Endpoint counters that have a series of their own instead of a protocol event.
_DEDICATED_COUNTERS: Final = {
    "expired_leases": EXPIRED_LEASES,
    "aborts_sent": ABORTS_SENT,
    "aborts_received": ABORTS_RECEIVED,
}


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {
        LAYER_READS: {},
        READ_SECONDS: {},
        GATE_WAIT_SECONDS: [],
        FAILURES: {},
        EVENTS: {},
    }
    data.update(dict.fromkeys(_SCALARS, 0))
    return data


def _code_name(code: ErrorCode | int | str) -> str:
    if isinstance(code, str):
        return code
    return ErrorCode(code).name


@dataclass
class Rd2hKVConnectorStats(KVConnectorStats):
    """RD2H's counters and observations for one interval (see the module docstring).

    ``data`` holds only str-keyed dicts, lists of numbers and ints, so it crosses vLLM's
    process boundaries unchanged; :meth:`aggregate` sums counters and concatenates
    observations, so merging TP workers and intervals is order independent.
    """

    def __post_init__(self) -> None:
        # A rebuilt object (build_kv_connector_stats) gets the data it was shipped with,
        # filled up with whatever keys an older sender did not know.
        base = _empty()
        base.update(self.data)
        self.data = base

    # -- recording ---------------------------------------------------------------------

    def record_read(self, layer: str, nbytes: int, descriptors: int, seconds: float) -> None:
        """One batched read of ``layer``: bytes moved, descriptors, wall time."""
        reads = self.data[LAYER_READS].setdefault(layer, [0, 0, 0])
        reads[0] += 1
        reads[1] += int(nbytes)
        reads[2] += int(descriptors)
        self.data[READ_SECONDS].setdefault(layer, []).append(float(seconds))

    def record_gate_wait(self, seconds: float) -> None:
        """Prefill's compute path waited ``seconds`` for a storage slot's gate."""
        self.data[GATE_WAIT_SECONDS].append(float(seconds))

    def record_failure(self, code: ErrorCode | int | str, count: int = 1) -> None:
        """``count`` failures (request or read) with ``code``."""
        failures = self.data[FAILURES]
        name = _code_name(code)
        failures[name] = failures.get(name, 0) + int(count)

    def record_expired_leases(self, count: int = 1) -> None:
        """Publications whose lease ran out without a reply (Prefill)."""
        self.data[EXPIRED_LEASES] += int(count)

    def record_aborts(self, *, sent: int = 0, received: int = 0) -> None:
        """ABORT messages sent and received."""
        self.data[ABORTS_SENT] += int(sent)
        self.data[ABORTS_RECEIVED] += int(received)

    def record_counters(self, delta: Mapping[str, int]) -> None:
        """Add increments of endpoint counters (``CounterDelta.take`` output).

        ``expired_leases``, ``aborts_sent`` and ``aborts_received`` feed their own series;
        every other non-zero counter becomes a protocol event of that name.
        """
        events = self.data[EVENTS]
        for name, count in delta.items():
            if not count:
                continue
            if name in _DEDICATED_COUNTERS:
                self.data[_DEDICATED_COUNTERS[name]] += int(count)
            else:
                events[name] = events.get(name, 0) + int(count)

    # -- KVConnectorStats --------------------------------------------------------------

    def reset(self) -> None:
        self.data = _empty()

    def take(self) -> Rd2hKVConnectorStats | None:
        """What ``get_kv_connector_stats`` returns: this interval's stats (None when
        nothing happened), leaving this object empty for the next interval."""
        if self.is_empty():
            return None
        taken = Rd2hKVConnectorStats(data=self.data)
        self.reset()
        return taken

    def is_empty(self) -> bool:
        data = self.data
        return not (
            data[LAYER_READS]
            or data[GATE_WAIT_SECONDS]
            or data[FAILURES]
            or data[EVENTS]
            or any(data[key] for key in _SCALARS)
        )

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = other.data
        mine = self.data
        for layer, (reads, nbytes, descs) in theirs.get(LAYER_READS, {}).items():
            acc = mine[LAYER_READS].setdefault(layer, [0, 0, 0])
            acc[0] += reads
            acc[1] += nbytes
            acc[2] += descs
        for layer, seconds in theirs.get(READ_SECONDS, {}).items():
            mine[READ_SECONDS].setdefault(layer, []).extend(seconds)
        mine[GATE_WAIT_SECONDS].extend(theirs.get(GATE_WAIT_SECONDS, ()))
        for key in (FAILURES, EVENTS):
            for name, count in theirs.get(key, {}).items():
                mine[key][name] = mine[key].get(name, 0) + count
        for key in _SCALARS:
            mine[key] += theirs.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's periodic "KV Transfer metrics" log line."""
        data = self.data
        reads = sum(r[0] for r in data[LAYER_READS].values())
        nbytes = sum(r[1] for r in data[LAYER_READS].values())
        descs = sum(r[2] for r in data[LAYER_READS].values())
        read_s = sum(sum(s) for s in data[READ_SECONDS].values())
        waits = data[GATE_WAIT_SECONDS]
        return {
            "RD2H reads": reads,
            "RD2H read MB": round(nbytes / 2**20, 3),
            "RD2H descriptors": descs,
            "RD2H avg read ms": round(read_s / reads * 1e3, 3) if reads else 0.0,
            "RD2H read MB/s": round(nbytes / 2**20 / read_s, 3) if read_s > 0 else 0.0,
            "RD2H gate waits": len(waits),
            "RD2H max gate wait ms": round(max(waits) * 1e3, 3) if waits else 0.0,
            "RD2H failures": sum(data[FAILURES].values()),
            "RD2H expired leases": data[EXPIRED_LEASES],
            "RD2H aborts sent": data[ABORTS_SENT],
            "RD2H aborts received": data[ABORTS_RECEIVED],
        }


class CounterDelta:
    """Turns an endpoint's cumulative ``stats`` (a dataclass of ints) into increments."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, stats: object) -> dict[str, int]:
        """Each int field's increase since the previous call (the first call: its value)."""
        current = {
            f.name: value
            for f in dataclasses.fields(stats)  # type: ignore[arg-type]
            if isinstance(value := getattr(stats, f.name), int) and not isinstance(value, bool)
        }
        delta = {name: value - self._last.get(name, 0) for name, value in current.items()}
        self._last = current
        return {name: n for name, n in delta.items() if n}


# Histogram buckets: a layer read is sub-millisecond (small) to seconds (a long prompt on
# a slow link); a gate wait is usually zero and anything past a second is a stall.
READ_SECONDS_BUCKETS: Final = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
GATE_WAIT_BUCKETS: Final = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


class Rd2hPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:rd2h_*`` Prometheus series, labelled per engine (and layer / code)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        self.read_bytes = counter(
            name="vllm:rd2h_read_bytes",
            documentation="Bytes RD2H read from Prefill, per layer.",
            labelnames=[*labelnames, "layer"],
        )
        self.read_descriptors = counter(
            name="vllm:rd2h_read_descriptors",
            documentation="Transfer descriptors of RD2H's batched reads, per layer.",
            labelnames=[*labelnames, "layer"],
        )
        self.read_seconds = histogram(
            name="vllm:rd2h_read_seconds",
            documentation="Time of one RD2H layer read, per layer (an engine read of several "
            "layers shares its time among them by bytes).",
            buckets=list(READ_SECONDS_BUCKETS),
            labelnames=[*labelnames, "layer"],
        )
        self.gate_wait_seconds = histogram(
            name="vllm:rd2h_gate_wait_seconds",
            documentation="Prefill compute time spent waiting for a storage slot to be read.",
            buckets=list(GATE_WAIT_BUCKETS),
            labelnames=list(labelnames),
        )
        self.failures = counter(
            name="vllm:rd2h_failures",
            documentation="RD2H request and read failures, by error code.",
            labelnames=[*labelnames, "code"],
        )
        self.expired_leases = counter(
            name="vllm:rd2h_expired_leases",
            documentation="RD2H publications whose lease expired without a reply.",
            labelnames=list(labelnames),
        )
        self.aborts = counter(
            name="vllm:rd2h_aborts",
            documentation="RD2H ABORT messages, by direction (sent, received).",
            labelnames=[*labelnames, "direction"],
        )
        self.protocol_events = counter(
            name="vllm:rd2h_protocol_events",
            documentation="Other RD2H endpoint events (stale or duplicate replies, drops...).",
            labelnames=[*labelnames, "event"],
        )

    def _labels(self, engine_idx: int, *extra: object) -> list[object]:
        return [*self.per_engine_labelvalues[engine_idx], *extra]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = Rd2hKVConnectorStats(data=dict(transfer_stats_data)).data  # fill missing keys
        for layer, (_, nbytes, descs) in data[LAYER_READS].items():
            self.read_bytes.labels(*self._labels(engine_idx, layer)).inc(nbytes)
            self.read_descriptors.labels(*self._labels(engine_idx, layer)).inc(descs)
        for layer, seconds in data[READ_SECONDS].items():
            child = self.read_seconds.labels(*self._labels(engine_idx, layer))
            for value in seconds:
                child.observe(value)
        gate = self.gate_wait_seconds.labels(*self._labels(engine_idx))
        for value in data[GATE_WAIT_SECONDS]:
            gate.observe(value)
        for code, count in data[FAILURES].items():
            self.failures.labels(*self._labels(engine_idx, code)).inc(count)
        if data[EXPIRED_LEASES]:
            self.expired_leases.labels(*self._labels(engine_idx)).inc(data[EXPIRED_LEASES])
        for direction, key in (("sent", ABORTS_SENT), ("received", ABORTS_RECEIVED)):
            if data[key]:
                self.aborts.labels(*self._labels(engine_idx, direction)).inc(data[key])
        for event, count in data[EVENTS].items():
            self.protocol_events.labels(*self._labels(engine_idx, event)).inc(count)


class Rd2hMetricsMixin:
    """The two class methods vLLM calls on the connector CLASS (step 4 of the module
    docstring). ``SfaRemoteD2HConnector`` inherits them."""

    stats_class: ClassVar[type[Rd2hKVConnectorStats]] = Rd2hKVConnectorStats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Rebuild stats shipped as ``to_dict()`` data (or a fresh empty object)."""
        return cls.stats_class(data=dict(data) if data is not None else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """Register the ``vllm:rd2h_*`` series (vLLM calls this once per front-end)."""
        return Rd2hPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
