"""Start-up errors through the connector itself: constructor and register_kv_caches.

vLLM builds the connector from the user's --kv-transfer-config; a bad configuration must
stop start-up there with ONE message that says what to change (rd2h_vllm.config holds the
rules, tested in depth in test_vllm_config.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from conftest import VllmConfigFactory
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm_pd_harness import FAST_METASERVER, MAIN, allocate, free_port_block, kv_setup

from rd2h_protocol.errors import ConfigError
from rd2h_vllm.config import CONNECTOR_MODULE, CONNECTOR_NAME
from rd2h_vllm.connector import SfaRemoteD2HConnector
from rd2h_vllm.destinations import VllmCacheDestinations
from rd2h_vllm.worker import SingleRank, split_kv_caches


def transfer(role: str, kv_port: int = 20050, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_port": kv_port,
        "kv_connector_extra_config": {"transfer_backend": "nixl", **FAST_METASERVER, **extra},
    }


def build(
    make_vllm_config: VllmConfigFactory,
    kv_transfer: dict[str, Any],
    role: KVConnectorRole = KVConnectorRole.WORKER,
    **config: Any,
) -> SfaRemoteD2HConnector:
    layout = config.pop("layout", KVCacheLayout.LBHNC)
    vllm_config = make_vllm_config(kv_transfer, **config)
    kv_cache_config = kv_setup(vllm_config, layout=layout).workers[0]
    connector = KVConnectorFactory.create_connector(vllm_config, role, kv_cache_config)
    assert isinstance(connector, SfaRemoteD2HConnector)
    return connector


def own_caches(connector: SfaRemoteD2HConnector) -> dict[str, torch.Tensor]:
    """The KV caches vLLM allocates for the connector's KV-cache configuration."""
    return allocate(connector._kv_cache_config)


@pytest.mark.parametrize(
    ("kv_transfer", "config", "expected"),
    [
        (transfer("kv_producer", transfer_backend="rdma"), {}, "transfer_backend='rdma'"),
        (
            transfer("kv_consumer", memfabric_transfer_protocol="pcie"),
            {},
            "memfabric_transfer_protocol",
        ),
        (
            transfer("kv_producer"),
            {"additional_config": {"sparse_kv_offload_config": {"enabled": True}}},
            "remove sparse_kv_offload_config from Prefill",
        ),
        (transfer("kv_consumer", kv_port=65535), {"tp": 2}, "does not leave room"),
        (transfer("kv_producer", peer_tp_size=4), {"tp": 2}, "Prefill TP must be a multiple"),
        ({**transfer("kv_consumer"), "kv_role": "kv_both"}, {}, "kv_both"),
        (transfer("kv_producer", trace_dir=""), {}, "trace_dir"),
        (transfer("kv_consumer", trace_dir=7), {}, "trace_dir"),
    ],
)
def test_bad_configuration_stops_the_constructor(
    make_vllm_config: VllmConfigFactory,
    kv_transfer: dict[str, Any],
    config: dict[str, Any],
    expected: str,
) -> None:
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=expected):
            build(make_vllm_config, kv_transfer, role, **config)


def test_every_problem_in_one_message(make_vllm_config: VllmConfigFactory) -> None:
    bad = transfer("kv_producer", transfer_backend="rdma", lease_ms=0, tpyo=1)
    with pytest.raises(ConfigError) as info:
        build(make_vllm_config, bad)
    text = str(info.value)
    assert "3 problems" in text
    assert "transfer_backend" in text and "lease_ms" in text and "tpyo" in text


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
@pytest.mark.parametrize(
    "layout", [KVCacheLayout.BLHNC, KVCacheLayout.BLNHC, KVCacheLayout.BHLNC], ids=str
)
def test_a_block_outermost_layout_is_refused_at_registration(
    make_vllm_config: VllmConfigFactory, role: str, layout: KVCacheLayout
) -> None:
    """vLLM packs every layer's page into each block: RD2H, which moves one layer at a
    time, refuses to start and says which layout to set."""
    connector = build(make_vllm_config, transfer(role), layout=layout)
    connector.bind_tp_group(SingleRank())
    with pytest.raises(ConfigError, match=f"{layout.name}.*VLLM_KV_CACHE_LAYOUT=LBHNC"):
        connector.register_kv_caches(own_caches(connector))
    assert connector.prefill is None and connector.decode is None


def test_blocks_that_are_not_stripes_are_refused_at_registration(
    make_vllm_config: VllmConfigFactory,
) -> None:
    connector = build(make_vllm_config, transfer("kv_producer"))
    connector.bind_tp_group(SingleRank())
    caches = own_caches(connector)
    good = caches[MAIN[1]]
    # Blocks half a page apart: each block would overlap the next one.
    caches[MAIN[1]] = good.as_strided(good.shape, (good.stride(0) // 2, *good.stride()[1:]))
    with pytest.raises(ConfigError) as info:
        connector.register_kv_caches(caches)
    text = str(info.value)
    assert MAIN[1] in text and str(tuple(good.shape)) in text
    assert str((good.stride(0) // 2, *good.stride()[1:])) in text
    assert connector.prefill is None


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_layer_hooks_before_registration_fail_at_once(
    make_vllm_config: VllmConfigFactory, role: str
) -> None:
    """A forward pass before register_kv_caches (an integration that never forwarded it)
    fails on its first layer, saying what to do, instead of Decode timing out later."""
    connector = build(make_vllm_config, transfer(role))
    cache = own_caches(connector)[MAIN[0]]
    hooks = [
        ("save_kv_layer", lambda: connector.save_kv_layer(MAIN[0], cache, None)),
        ("wait_for_layer_load", lambda: connector.wait_for_layer_load(MAIN[0])),
        ("on_kv_cache_written", lambda: connector.on_kv_cache_written(MAIN[0])),
        ("wait_for_layer_send", lambda: connector.wait_for_layer_send(0)),
        ("wait_for_layer_send", lambda: connector.wait_for_layer_reuse(0)),
    ]
    for name, call in hooks:
        with pytest.raises(
            ConfigError,
            match=f"{name} was called before register_kv_caches.*call register_kv_caches",
        ):
            call()
    assert connector.prefill is None and connector.decode is None


def test_decode_with_sparse_offload_needs_a_destination_provider(
    make_vllm_config: VllmConfigFactory,
) -> None:
    sparse = {"sparse_kv_offload_config": {"enabled": True}}
    connector = build(make_vllm_config, transfer("kv_consumer"), additional_config=sparse)
    connector.bind_tp_group(SingleRank())
    caches = own_caches(connector)
    with pytest.raises(ConfigError, match="set_destination_provider"):
        connector.register_kv_caches(caches)
    # With vllm-ascend's manager bound (any provider here), registration goes through.
    num_blocks = connector._kv_cache_config.num_blocks
    provider = VllmCacheDestinations(split_kv_caches(caches, num_blocks), num_blocks)
    connector.set_destination_provider(provider)
    try:
        connector.register_kv_caches(caches)
        assert connector.destinations is provider
    finally:
        connector.shutdown()


def test_tp_without_vllm_group_is_refused(make_vllm_config: VllmConfigFactory) -> None:
    connector = build(make_vllm_config, transfer("kv_producer"), tp=2)
    with pytest.raises(ConfigError, match="TP group is not initialised"):
        connector.register_kv_caches(own_caches(connector))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_trace_dir_turns_on_the_protocol_trace(
    make_vllm_config: VllmConfigFactory, role: str, tmp_path: Any
) -> None:
    """kv_connector_extra_config.trace_dir reaches the rank's worker: it writes its trace
    there, starting with a header that names its role and holds its endpoint config."""
    trace_dir = tmp_path / "trace"
    kv = transfer(role, kv_port=free_port_block(1), trace_dir=str(trace_dir))
    connector = build(make_vllm_config, kv)
    connector.bind_tp_group(SingleRank())
    try:
        connector.register_kv_caches(own_caches(connector))
    finally:
        connector.shutdown()
    [path] = list(trace_dir.glob("*.ndjson"))
    header = json.loads(path.read_text().splitlines()[0])
    want = "prefill" if role == "kv_producer" else "decode"
    assert header["k"] == "hdr" and header["role"] == want and header["rank"] == 0
    assert header["config"]["layers"]
