"""rd2h_vllm.config: the deployment guide's JSON, unchanged, and the start-up refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from conftest import VllmConfigFactory

from rd2h_protocol.errors import ConfigError
from rd2h_vllm.config import (
    CONNECTOR_NAME,
    DEFAULT_KV_PORT,
    MetaserverOptions,
    from_vllm_config,
    parse_config,
)

# The deployment guide's Decode --kv-transfer-config, verbatim.
GUIDE_DECODE: dict[str, Any] = {
    "kv_connector": "SfaRemoteD2HConnector",
    "kv_role": "kv_consumer",
    "kv_port": 20050,
    "kv_connector_extra_config": {"transfer_backend": "memfabric", "use_layerwise": True},
}
GUIDE_DECODE_ADDITIONAL: dict[str, Any] = {
    "sparse_kv_offload_config": {
        "enabled": True,
        "topk_buffer_size": 4096,
        "dram_size_per_dp_GB": 128,
    }
}
# The deployment guide's Prefill --kv-transfer-config, verbatim (RD2H inside MultiConnector).
GUIDE_PREFILL: dict[str, Any] = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_producer",
    "kv_connector_extra_config": {
        "connectors": [
            {
                "kv_connector": "SfaRemoteD2HConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"transfer_backend": "memfabric"},
            },
            {
                "kv_connector": "AscendStoreConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {
                    "backend": "memcache",
                    "use_layerwise": True,
                    "layerwise_num_shared_buffers": 3,
                    "layerwise_independent_layers": [0],
                },
            },
        ]
    },
}


def decode_with(**extra: Any) -> dict[str, Any]:
    config = copy.deepcopy(GUIDE_DECODE)
    config["kv_connector_extra_config"].update(extra)
    return config


def problems_of(exc: pytest.ExceptionInfo[ConfigError]) -> str:
    return str(exc.value)


def test_guide_decode_json_parses_with_v1_and_v2_defaults() -> None:
    cfg = parse_config(
        GUIDE_DECODE,
        parallel={"tensor_parallel_size": 4, "data_parallel_size": 2, "data_parallel_rank": 1},
        additional_config=GUIDE_DECODE_ADDITIONAL,
        device_type="npu",
    )
    assert cfg.is_consumer and not cfg.is_producer
    assert cfg.transfer_backend == "memfabric"
    assert cfg.memfabric_transfer_protocol == "sdma"  # the guide's default
    assert cfg.use_layerwise is True
    assert cfg.kv_port == 20050
    assert cfg.base_port == 20050 + 1 * 4  # kv_port + global_dp_rank * tp_size
    assert cfg.sparse_offload is True
    assert (cfg.lease_ms, cfg.kv_load_timeout_s, cfg.read_failure_policy) == (
        30_000,
        120.0,
        "isolate",
    )
    assert cfg.protocol == "v2"
    assert cfg.metaserver == MetaserverOptions()
    assert cfg.metaserver.legacy_errors_delivered is False


def test_guide_prefill_multiconnector_json_finds_our_entry() -> None:
    cfg = parse_config(GUIDE_PREFILL, parallel={"tensor_parallel_size": 8}, device_type="npu")
    assert cfg.is_producer
    assert cfg.transfer_backend == "memfabric"
    assert cfg.base_port == cfg.kv_port  # Prefill TP rank r: claim port kv_port + r
    assert cfg.tp_size == 8


def test_v2_options_and_other_backends() -> None:
    cfg = parse_config(
        decode_with(
            transfer_backend="nixl",
            lease_ms=5000,
            kv_load_timeout_s=7.5,
            read_failure_policy="raise",
            protocol="v1",
            metaserver_max_attempts=3,
            metaserver_deadline_s=4.0,
            metaserver_response_timeout_s=90.0,
            legacy_metaserver_errors_delivered=True,
            advertise_host="10.0.0.7",
        )
    )
    assert cfg.advertise_host == "10.0.0.7"
    assert cfg.transfer_backend == "nixl"
    assert (cfg.lease_ms, cfg.kv_load_timeout_s, cfg.read_failure_policy) == (5000, 7.5, "raise")
    assert cfg.protocol == "v1"
    assert cfg.metaserver.max_attempts == 3
    assert cfg.metaserver.deadline_s == 4.0
    assert cfg.metaserver.response_timeout_s == 90.0
    assert cfg.metaserver.legacy_errors_delivered is True
    # Off Ascend, Decode may run without sparse offload (it reads into vLLM's KV cache).
    assert cfg.sparse_offload is False


def test_vllm_config_object_decode(make_vllm_config: VllmConfigFactory) -> None:
    vc = make_vllm_config(
        decode_with(memfabric_transfer_protocol="device_urma"),
        tp=2,
        dp=2,
        dp_rank=1,
        additional_config=GUIDE_DECODE_ADDITIONAL,
    )
    cfg = from_vllm_config(vc, device_type="npu")
    assert cfg.is_consumer
    assert cfg.memfabric_transfer_protocol == "device_urma"
    assert (cfg.tp_size, cfg.dp_size, cfg.dp_rank) == (2, 2, 1)
    assert cfg.base_port == 20050 + 2
    assert cfg.engine_id == vc.kv_transfer_config.engine_id  # type: ignore[union-attr]


def test_vllm_config_object_reads_the_platform(make_vllm_config: VllmConfigFactory) -> None:
    from vllm.platforms import current_platform

    vc = make_vllm_config(decode_with(transfer_backend="mooncake"))
    cfg = from_vllm_config(vc)
    assert cfg.device_type == str(current_platform.device_type)
    assert cfg.base_port == 20050


def test_vllm_config_default_kv_port(make_vllm_config: VllmConfigFactory) -> None:
    kv = decode_with()
    del kv["kv_port"]
    cfg = from_vllm_config(make_vllm_config(kv), device_type="cpu")
    assert cfg.kv_port == DEFAULT_KV_PORT


def test_vllm_config_without_kv_transfer_config(make_vllm_config: VllmConfigFactory) -> None:
    with pytest.raises(ConfigError, match="no --kv-transfer-config"):
        from_vllm_config(make_vllm_config(None), device_type="cpu")


@pytest.mark.parametrize(
    ("kv_transfer", "kwargs", "expected"),
    [
        (decode_with(transfer_backend="ucx"), {}, "transfer_backend='ucx' is not supported"),
        (
            decode_with(memfabric_transfer_protocol="rdma"),
            {},
            "memfabric_transfer_protocol='rdma' is not supported",
        ),
        (
            decode_with(transfer_backend="nixl", memfabric_transfer_protocol="sdma"),
            {},
            "applies to the memfabric backend only",
        ),
        ({**GUIDE_DECODE, "kv_role": "kv_both"}, {}, "'kv_both' is not supported"),
        (
            {**GUIDE_DECODE, "kv_connector_extra_config": {}},
            {},
            "transfer_backend is missing",
        ),
        (decode_with(use_layerwize=True), {}, "unknown keys ['use_layerwize']"),
        (decode_with(lease_ms=0), {}, "lease_ms=0"),
        (decode_with(kv_load_timeout_s=-1), {}, "kv_load_timeout_s=-1"),
        (decode_with(read_failure_policy="ignore"), {}, "read_failure_policy='ignore'"),
        (decode_with(protocol="v3"), {}, "protocol='v3'"),
        (decode_with(use_layerwise="yes"), {}, "use_layerwise='yes': set it to true or false"),
        (
            decode_with(metaserver_backoff_s=1.0, metaserver_backoff_max_s=0.5),
            {},
            "metaserver_backoff_max_s=0.5 is below",
        ),
        (decode_with(metaserver_max_attempts=0), {}, "metaserver_max_attempts=0"),
        (decode_with(advertise_host=""), {}, "advertise_host='': set it to the host"),
        ({**GUIDE_DECODE, "kv_port": "20050"}, {}, "kv_port='20050'"),
        (
            {**GUIDE_DECODE, "kv_port": 65535},
            {"parallel": {"tensor_parallel_size": 2}},
            "kv_port=65535 does not leave room for 1 DP x 2 TP",
        ),
        (
            {**GUIDE_DECODE, "kv_port": 65530},
            {"parallel": {"tensor_parallel_size": 4, "data_parallel_size": 2}},
            "set kv_port between 1 and 65528",
        ),
        (
            {**GUIDE_DECODE, "kv_connector": "NixlConnector"},
            {},
            "kv_connector is 'NixlConnector'",
        ),
        (
            decode_with(peer_tp_size=3),
            {"parallel": {"tensor_parallel_size": 2}},
            "unsupported TP sizes Prefill 3 / Decode 2",
        ),
        (
            decode_with(peer_tp_size=1),
            {"parallel": {"tensor_parallel_size": 2}},
            "unsupported TP sizes Prefill 1 / Decode 2",
        ),
        (
            GUIDE_DECODE,
            {"parallel": {"pipeline_parallel_size": 2}},
            "set --pipeline-parallel-size 1",
        ),
        (
            GUIDE_DECODE,
            {"parallel": {"decode_context_parallel_size": 2}},
            "set --decode-context-parallel-size 1",
        ),
        (
            GUIDE_DECODE,
            {"parallel": {"data_parallel_size": 2, "data_parallel_rank": 2}},
            "data_parallel_rank=2: must lie in [0, 2)",
        ),
        (
            GUIDE_PREFILL,
            {"additional_config": GUIDE_DECODE_ADDITIONAL},
            "remove sparse_kv_offload_config from Prefill",
        ),
        (GUIDE_DECODE, {"device_type": "npu"}, "Decode (kv_consumer) on Ascend runs without"),
    ],
)
def test_each_refusal_says_what_to_change(
    kv_transfer: dict[str, Any], kwargs: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(kv_transfer, **kwargs)
    message = problems_of(exc)
    assert message.startswith(f"invalid {CONNECTOR_NAME} configuration: ")
    assert expected in message


def test_multiconnector_with_two_entries_is_refused() -> None:
    config = copy.deepcopy(GUIDE_PREFILL)
    children = config["kv_connector_extra_config"]["connectors"]
    children.append(copy.deepcopy(children[0]))
    with pytest.raises(ConfigError, match="lists 2 SfaRemoteD2HConnector entries"):
        parse_config(config)


def test_all_problems_come_in_one_error() -> None:
    bad = decode_with(transfer_backend="ucx", memfabric_transfer_protocol="x", lease_ms=-5)
    bad["kv_role"] = "kv_both"
    with pytest.raises(ConfigError) as exc:
        parse_config(bad, parallel={"pipeline_parallel_size": 2})
    message = problems_of(exc)
    assert "(5 problems)" in message
    for expected in (
        "transfer_backend='ucx'",
        "memfabric_transfer_protocol='x'",
        "lease_ms=-5",
        "kv_role='kv_both'",
        "pipeline_parallel_size=2",
    ):
        assert expected in message


def test_peer_tp_size_accepted_when_divisible_and_checked_per_peer() -> None:
    prefill = parse_config(
        {
            "kv_connector": CONNECTOR_NAME,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"transfer_backend": "nixl", "peer_tp_size": 2},
        },
        parallel={"tensor_parallel_size": 8},
    )
    assert prefill.peer_tp_size == 2
    prefill.check_peer(4)
    with pytest.raises(ConfigError, match="Prefill 8 / Decode 3"):
        prefill.check_peer(3)
    decode = parse_config(GUIDE_DECODE, parallel={"tensor_parallel_size": 2})
    decode.check_peer(6)
    with pytest.raises(ConfigError, match="Prefill 1 / Decode 2"):
        decode.check_peer(1)
