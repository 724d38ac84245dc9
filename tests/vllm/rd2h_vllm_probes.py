"""Connector classes for tests that need vLLM to resolve a connector class by config.

vLLM's stats and Prometheus plumbing (``KVConnectorLogging``, ``KVConnectorProm``,
``MultiConnector``) look the connector CLASS up from ``--kv-transfer-config`` and call its
class methods; they never instantiate it. :class:`Rd2hStatsProbe` is such a class with
rd2h's metrics class methods, selected with
``{"kv_connector": "Rd2hStatsProbe", "kv_connector_module_path": "rd2h_vllm_probes"}``.

:class:`SfaRemoteD2HConnector` here is a scheduler-only stand-in until the real
connector (rd2h_vllm.connector) exists: a real vLLM Scheduler instantiates it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from rd2h_vllm.config import from_vllm_config
from rd2h_vllm.metrics import Rd2hMetricsMixin
from rd2h_vllm.scheduler import Poster, SchedulerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

PROBE_MODULE = "rd2h_vllm_probes"


class Rd2hStatsProbe(Rd2hMetricsMixin, KVConnectorBase_V1):
    """Only the class-level metrics hooks of the real connector (never instantiated)."""


class SfaRemoteD2HConnector(Rd2hMetricsMixin, KVConnectorBase_V1, SupportsHMA):
    """Scheduler-only stand-in: rd2h's real scheduler half, no worker half.

    Selected with ``"kv_connector": "SfaRemoteD2HConnector", "kv_connector_module_path":
    "rd2h_vllm_probes"`` (the same mechanism a deployment uses to pick a connector
    module), so a real vLLM ``Scheduler`` drives :class:`rd2h_vllm.scheduler.SchedulerSide`
    through the real KV Connector V1 entry points. Tests set :attr:`poster` first.
    """

    poster: ClassVar[Poster | None] = None

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        assert role == KVConnectorRole.SCHEDULER, "scheduler-only probe"
        config = from_vllm_config(vllm_config, device_type="cpu")
        self.side = SchedulerSide(
            config, kv_cache_config, poster=type(self).poster, host="127.0.0.1"
        )

    # Scheduler side: the real thing.
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.side.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.side.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.side.request_finished(request, block_ids)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.side.get_kv_connector_stats()

    # Worker side: never reached in scheduler-only tests.
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        raise AssertionError("scheduler-only probe: no worker side")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise AssertionError("scheduler-only probe: no worker side")

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        raise AssertionError("scheduler-only probe: no worker side")

    def wait_for_save(self) -> None:
        raise AssertionError("scheduler-only probe: no worker side")
