"""A connector class for tests that need vLLM to resolve a connector class by config.

vLLM's stats and Prometheus plumbing (``KVConnectorLogging``, ``KVConnectorProm``,
``MultiConnector``) look the connector CLASS up from ``--kv-transfer-config`` and call its
class methods; they never instantiate it. :class:`Rd2hStatsProbe` is such a class with
rd2h's metrics class methods, selected with
``{"kv_connector": "Rd2hStatsProbe", "kv_connector_module_path": "rd2h_vllm_probes"}``.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from rd2h_vllm.metrics import Rd2hMetricsMixin

PROBE_MODULE = "rd2h_vllm_probes"


class Rd2hStatsProbe(Rd2hMetricsMixin, KVConnectorBase_V1):
    """Only the class-level metrics hooks of the real connector (never instantiated)."""
