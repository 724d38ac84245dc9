"""rd2h_vllm.plugin: vLLM finds the connector by name through a general-plugin entry point."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

import rd2h_vllm.plugin as plugin
from rd2h_vllm.config import CONNECTOR_MODULE, CONNECTOR_NAME

ENTRY_POINT = "rd2h = rd2h_vllm.plugin:register"


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> type[object]:
    """vLLM's connector registry and our flag, restored after the test."""
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory._registry.pop(CONNECTOR_NAME, None)
    KVConnectorFactory._registry.pop(plugin.MULTI_CONNECTOR_NAME, None)
    monkeypatch.setattr(plugin, "_registered_by_us", False)
    monkeypatch.delenv(plugin.REPLACE_ENV, raising=False)
    return type("Marker", (), {})


@pytest.fixture
def fake_connector_module(monkeypatch: pytest.MonkeyPatch) -> type[object]:
    """A stand-in for rd2h_vllm.connector holding a class of the connector's name."""
    module = types.ModuleType(CONNECTOR_MODULE)

    def __init__(self: object, vllm_config: object, role: object, kv_cache_config: object) -> None:
        return None  # the V1 constructor signature vLLM checks for

    cls = type(CONNECTOR_NAME, (), {"__init__": __init__})
    setattr(module, CONNECTOR_NAME, cls)
    monkeypatch.setitem(sys.modules, CONNECTOR_MODULE, module)
    return cls


def test_vllm_discovers_and_runs_the_entry_point(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    clean_registry: type[object],
    fake_connector_module: type[object],
) -> None:
    # A distribution declaring exactly the entry point pyproject.toml must declare.
    dist = tmp_path / "rd2h_entry_point_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: rd2h-entry-point-probe\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(f"[{DEFAULT_PLUGINS_GROUP}]\n{ENTRY_POINT}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins["rd2h"] is plugin.register
    plugins["rd2h"]()
    # The guide's JSON now resolves to rd2h's class by name alone.
    ktc = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_consumer")
    assert KVConnectorFactory.get_connector_class(ktc) is fake_connector_module
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is fake_connector_module


def test_register_is_idempotent(
    clean_registry: type[object], fake_connector_module: type[object]
) -> None:
    plugin.register()
    plugin.register()  # vLLM may run plugins more than once per process
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is fake_connector_module


def test_a_name_taken_by_another_package_is_left_alone(
    clean_registry: type[object],
    fake_connector_module: type[object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    other = type(CONNECTOR_NAME, (), {})
    other_module = types.ModuleType("other_pkg_connector")
    setattr(other_module, CONNECTOR_NAME, other)
    sys.modules["other_pkg_connector"] = other_module
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "other_pkg_connector", CONNECTOR_NAME)
        with caplog.at_level(logging.WARNING, logger=plugin.__name__):
            plugin.register()
        assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is other
        assert f'"kv_connector_module_path": "{CONNECTOR_MODULE}"' in caplog.text
        # kv_connector_module_path still selects rd2h, ahead of the registry.
        ktc = KVTransferConfig(
            kv_connector=CONNECTOR_NAME,
            kv_role="kv_consumer",
            kv_connector_module_path=CONNECTOR_MODULE,
        )
        assert KVConnectorFactory.get_connector_class(ktc) is fake_connector_module
    finally:
        del sys.modules["other_pkg_connector"]


def test_replace_switch_takes_the_name_over(
    clean_registry: type[object],
    fake_connector_module: type[object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "other_pkg_connector", CONNECTOR_NAME)
    monkeypatch.setenv(plugin.REPLACE_ENV, "1")
    plugin.register()
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is fake_connector_module


def test_the_guides_json_builds_the_real_connector_by_name(
    clean_registry: type[object], make_vllm_config: Any
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_pd_harness import kv_setup

    from rd2h_vllm.connector import SfaRemoteD2HConnector

    plugin.register()
    guide = {  # the deployment guide's Decode JSON, unchanged: no module path
        "kv_connector": CONNECTOR_NAME,
        "kv_role": "kv_consumer",
        "kv_port": 20050,
        "kv_connector_extra_config": {"transfer_backend": "memfabric", "use_layerwise": True},
    }
    config = make_vllm_config(guide, attach_after=False)
    connector = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_setup(config).scheduler
    )
    assert isinstance(connector, SfaRemoteD2HConnector)
    try:
        assert type(connector) is SfaRemoteD2HConnector
        assert connector.config.transfer_backend == "memfabric"
        assert connector.config.base_port == 20050
    finally:
        connector.shutdown()


def test_the_ordering_multi_connector_is_registered_by_name(clean_registry: type[object]) -> None:
    from rd2h_vllm.multi import Rd2hMultiConnector

    plugin.register()
    plugin.register()
    found = KVConnectorFactory.get_connector_class_by_name(plugin.MULTI_CONNECTOR_NAME)
    assert found is Rd2hMultiConnector
