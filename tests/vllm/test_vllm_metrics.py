"""rd2h_vllm.metrics read back through vLLM's own stats aggregation and Prometheus plumbing."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from conftest import VllmConfigFactory
from prometheus_client import REGISTRY
from rd2h_vllm_probes import PROBE_MODULE, Rd2hStatsProbe
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorStats,
)
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from rd2h_protocol.errors import ErrorCode
from rd2h_vllm.metrics import CounterDelta, Rd2hKVConnectorStats

PROBE: dict[str, Any] = {
    "kv_connector": "Rd2hStatsProbe",
    "kv_role": "kv_consumer",
    "kv_connector_module_path": PROBE_MODULE,
}
LABELS = ["model_name", "engine"]
ENGINE0 = {"model_name": "tiny", "engine": "0"}
L0, L1 = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"


@dataclass
class FakeEndpointStats:
    """The shape of an endpoint's ``stats``: cumulative ints."""

    stale_replies: int = 0
    duplicate_replies: int = 0
    expired_leases: int = 0
    aborts_sent: int = 0
    aborts_received: int = 0
    closed: bool = False  # not a counter: ignored


@pytest.fixture
def prom_registry() -> Iterator[None]:
    unregister_vllm_metrics()  # type: ignore[no-untyped-call]
    yield
    unregister_vllm_metrics()  # type: ignore[no-untyped-call]


def worker_stats(rank: int) -> Rd2hKVConnectorStats:
    """One TP worker's interval: two layers read, a failure, counters."""
    stats = Rd2hKVConnectorStats()
    stats.record_read(L0, nbytes=1000 * (rank + 1), descriptors=10, seconds=0.002)
    stats.record_read(L1, nbytes=3000, descriptors=30, seconds=0.004)
    stats.record_read(L1, nbytes=1000, descriptors=5, seconds=0.001)
    stats.record_failure(ErrorCode.DESTINATION_RANGE)
    stats.record_gate_wait(0.010 * (rank + 1))
    delta = CounterDelta()
    endpoint = FakeEndpointStats(stale_replies=2, expired_leases=1, aborts_sent=1)
    stats.record_counters(delta.take(endpoint))
    return stats


def model_runner_output(stats: Rd2hKVConnectorStats | None) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=[],
        req_id_to_index={},
        kv_connector_output=KVConnectorOutput(kv_connector_stats=stats),
    )


def aggregated_payload() -> dict[str, Any]:
    """Two workers -> vLLM's KVOutputAggregator -> to_dict -> msgpack (process hop)."""
    outputs: list[ModelRunnerOutput | None] = [
        model_runner_output(worker_stats(r).take()) for r in (0, 1)
    ]
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs)
    assert merged is not None and merged.kv_connector_output is not None
    stats = merged.kv_connector_output.kv_connector_stats
    assert isinstance(stats, Rd2hKVConnectorStats)
    payload: dict[str, Any] = msgspec.msgpack.decode(msgspec.msgpack.encode(stats.to_dict()))
    return payload


def test_counter_delta_reports_increments_of_int_fields() -> None:
    delta = CounterDelta()
    stats = FakeEndpointStats(stale_replies=3)
    assert delta.take(stats) == {"stale_replies": 3}
    stats.stale_replies, stats.aborts_received = 5, 1
    assert delta.take(stats) == {"stale_replies": 2, "aborts_received": 1}
    assert delta.take(stats) == {}


def test_take_hands_over_the_interval_and_empty_is_none() -> None:
    stats = Rd2hKVConnectorStats()
    assert stats.is_empty() and stats.take() is None
    stats.record_aborts(received=2)
    taken = stats.take()
    assert taken is not None and taken.data["aborts_received"] == 2
    assert stats.is_empty()
    stats.record_read(L0, 1, 1, 0.1)
    stats.reset()
    assert stats.is_empty()


def test_workers_aggregate_through_vllm_and_reduce_for_the_log_line() -> None:
    payload = aggregated_payload()
    assert payload["layer_reads"] == {L0: [2, 3000, 20], L1: [4, 8000, 70]}
    assert payload["failures"] == {"DESTINATION_RANGE": 2}
    assert payload["protocol_events"] == {"stale_replies": 4}
    assert (payload["expired_leases"], payload["aborts_sent"], payload["aborts_received"]) == (
        2,
        2,
        0,
    )
    assert sorted(payload["gate_wait_seconds"]) == [0.01, 0.02]

    # The front-end's periodic log: the connector class rebuilds and accumulates intervals.
    logging_ = KVConnectorLogging(KVTransferConfig(**PROBE))
    logging_.observe(payload)
    logging_.observe(payload)
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))  # type: ignore[no-untyped-call]
    assert len(lines) == 1
    line = lines[0]
    for expected in (
        "RD2H reads=12",
        f"RD2H read MB={round(22000 / 2**20, 3)}",
        "RD2H descriptors=180",
        "RD2H failures=4",
        "RD2H expired leases=4",
        "RD2H aborts sent=4",
        "RD2H gate waits=4",
        "RD2H max gate wait ms=20.0",
    ):
        assert expected in line, (expected, line)
    # 12 reads took 2 * 2 * (0.002 + 0.004 + 0.001) s
    assert f"RD2H avg read ms={round(0.028 / 12 * 1e3, 3)}" in line


def test_prometheus_series_read_back(
    make_vllm_config: VllmConfigFactory, prom_registry: None
) -> None:
    prom = KVConnectorProm(make_vllm_config(PROBE), LABELS, {0: ["tiny", "0"]})
    payload = aggregated_payload()
    prom.observe(payload, engine_idx=0)

    def sample(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {**ENGINE0, **labels})

    assert sample("vllm:rd2h_read_bytes_total", layer=L0) == 3000
    assert sample("vllm:rd2h_read_bytes_total", layer=L1) == 8000
    assert sample("vllm:rd2h_read_descriptors_total", layer=L1) == 70
    assert sample("vllm:rd2h_read_seconds_count", layer=L1) == 4
    assert sample("vllm:rd2h_read_seconds_sum", layer=L1) == pytest.approx(0.010)
    assert sample("vllm:rd2h_gate_wait_seconds_count") == 2
    assert sample("vllm:rd2h_failures_total", code="DESTINATION_RANGE") == 2
    assert sample("vllm:rd2h_expired_leases_total") == 2
    assert sample("vllm:rd2h_aborts_total", direction="sent") == 2
    assert sample("vllm:rd2h_aborts_total", direction="received") is None  # never observed
    assert sample("vllm:rd2h_protocol_events_total", event="stale_replies") == 4


def test_inside_a_multiconnector_stats_are_rebuilt_by_class_name(
    make_vllm_config: VllmConfigFactory,
    prom_registry: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # MultiConnector finds children's stats classes by NAME in vLLM's registry: what the
    # plugin entry point provides for the real connector.
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory.register_connector("Rd2hStatsProbe", PROBE_MODULE, "Rd2hStatsProbe")
    payload = aggregated_payload()
    multi = MultiKVConnectorStats(data={"Rd2hStatsProbe": Rd2hKVConnectorStats(data=payload)})
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(multi.to_dict()))
    rebuilt = MultiConnector.build_kv_connector_stats(data=wire)
    assert isinstance(rebuilt, MultiKVConnectorStats)
    ours = rebuilt["Rd2hStatsProbe"]
    assert isinstance(ours, Rd2hKVConnectorStats)
    assert ours.reduce()["RD2H reads"] == 6

    multi_config = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"connectors": [PROBE]},
    }
    prom = KVConnectorProm(make_vllm_config(multi_config), LABELS, {0: ["tiny", "0"]})
    prom.observe(wire, engine_idx=0)
    assert REGISTRY.get_sample_value("vllm:rd2h_read_bytes_total", {**ENGINE0, "layer": L1}) == 8000


def test_build_kv_connector_stats_without_data_is_empty() -> None:
    stats = Rd2hStatsProbe.build_kv_connector_stats()
    assert isinstance(stats, Rd2hKVConnectorStats) and stats.is_empty()
    # Data from an older sender lacking keys is filled up, not refused.
    partial = Rd2hStatsProbe.build_kv_connector_stats(data={"aborts_sent": 3})
    assert isinstance(partial, Rd2hKVConnectorStats)
    assert partial.reduce()["RD2H aborts sent"] == 3 and partial.reduce()["RD2H reads"] == 0
