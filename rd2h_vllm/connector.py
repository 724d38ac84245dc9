"""``SfaRemoteD2HConnector``: RD2H as a vLLM KV Connector V1, both roles, both sides.

Theory of operation
-------------------
vLLM builds the connector twice per engine: once in the scheduler process
(``KVConnectorRole.SCHEDULER``) and once per worker (``KVConnectorRole.WORKER``). The
class is thin glue; every decision lives elsewhere:

* configuration: :func:`rd2h_vllm.config.from_vllm_config` (the deployment guide's JSON,
  checked at construction: a bad configuration fails start-up with one message);
* scheduler side, both roles: :class:`rd2h_vllm.scheduler.SchedulerSide` (Decode's async
  match, destinations and rendezvous; Prefill's chunk bookkeeping; delayed frees);
* worker side: :class:`rd2h_vllm.worker.PrefillSide` (kv_producer: chunk scheduling,
  slot-reuse wait, per-layer publication, ``finished_sending``) or
  :class:`rd2h_vllm.worker.DecodeSide` (kv_consumer: destinations, reads, cross-rank
  completion, ``finished_recving`` / ``failed_recving`` / load errors), both created in
  :meth:`SfaRemoteD2HConnector.register_kv_caches`, when the KV caches exist.

Hooks for integrations (all optional, called before ``register_kv_caches``):
:meth:`~SfaRemoteD2HConnector.set_destination_provider` (vllm-ascend's
``SparseKVOffloadManager`` through :class:`~rd2h_vllm.destinations.SparseOffloadDestinations`;
without one Decode reads into vLLM's own KV cache,
:class:`~rd2h_vllm.destinations.VllmCacheDestinations`),
:meth:`~SfaRemoteD2HConnector.bind_tp_group` (a TP group other than vLLM's), and
:meth:`~SfaRemoteD2HConnector.create_backend` (override to supply a transfer backend).

For a layerwise store connector the Prefill side exposes
:meth:`~SfaRemoteD2HConnector.wait_for_layer_send`, the slot-reuse waiter, and
:meth:`~SfaRemoteD2HConnector.on_kv_cache_written`, vllm-ascend's earliest "this layer's
KV is in the cache" hook (same path as ``save_kv_layer``; a layer publishes once). Two
multi-connectors compose them:

* :class:`rd2h_vllm.multi.Rd2hMultiConnector` (plain vLLM), and
* vllm-ascend's ``AscendMultiConnector`` (what ``"kv_connector": "MultiConnector"`` is on
  Ascend). It makes a child its layerwise buffer-reuse PROVIDER when the child has a
  true ``is_producer``, a non-None ``connector_worker``, ``supports_layerwise_buffer_reuse``
  and a callable ``wait_for_layer_reuse(layer_idx)``; it runs providers first in
  ``save_kv_layer`` and ``on_kv_cache_written``, hands every child that has
  ``set_external_slot_release_waiter`` a waiter calling ``wait_for_layer_reuse`` with the
  layer NUMBER (the N of ``layers.N``), and once a store accepted that waiter it skips the
  providers' ``wait_for_layer_load`` (the store waits before it writes a layer's buffer),
  else it runs them first there too. The Prefill worker side meets that rule; RD2H itself
  takes no waiter, so it never waits on its own gate through a sibling.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from rd2h_protocol.errors import ConfigError
from rd2h_runtime.control import ControlOptions
from rd2h_runtime.transfer import TransferBackend, create_backend
from rd2h_vllm.config import Rd2hConfig, from_vllm_config
from rd2h_vllm.destinations import DestinationProvider, VllmCacheDestinations, device_events
from rd2h_vllm.kv_layout import check_layer_compact
from rd2h_vllm.metadata import CacheGroups, Rd2hConnectorMetadata
from rd2h_vllm.metaserver import RendezvousPoster
from rd2h_vllm.metrics import Rd2hKVConnectorStats, Rd2hMetricsMixin
from rd2h_vllm.scheduler import SchedulerSide
from rd2h_vllm.worker import (
    DecodeSide,
    PrefillSide,
    TpGroup,
    compat_string,
    default_tp_group,
    layout_summary,
    split_kv_caches,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

__all__ = ["SfaRemoteD2HConnector"]


class SfaRemoteD2HConnector(Rd2hMetricsMixin, KVConnectorBase_V1, SupportsHMA):
    """RD2H's KV Connector V1 (see the module docstring).

    ``kv_role`` "kv_producer" is Prefill (publishes its KV layer by layer), "kv_consumer"
    is Decode (pulls it into its destinations). Configuration errors raise
    :class:`~rd2h_protocol.errors.ConfigError` from the constructor.
    """

    _cache_hit_source = CacheHitSource.P2P
    #: Control-socket tuning for both roles (None: the runtime's defaults).
    control_options: ControlOptions | None = None
    #: vllm-ascend's AscendMultiConnector: Prefill's storage gates protect layer buffers a
    #: layerwise store reuses (see the module docstring for the whole selection rule).
    supports_layerwise_buffer_reuse: ClassVar[bool] = True

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        if kv_cache_config is None:
            raise ConfigError("SfaRemoteD2HConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        super().__init__(vllm_config, role, kv_cache_config)
        self.config: Rd2hConfig = from_vllm_config(vllm_config)
        self.groups = CacheGroups.from_kv_cache_config(kv_cache_config)
        # A multi-connector must hand us the request's full block lists on Prefill even
        # when another connector was chosen for lookup (rd2h_vllm.multi).
        self.requires_full_blocks_on_update_after_alloc = (
            role == KVConnectorRole.SCHEDULER and self.config.is_producer
        )
        self.scheduler: SchedulerSide | None = None
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self._poster: RendezvousPoster | None = None
        self._tp: TpGroup | None = None
        self._destinations: DestinationProvider | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self.config.is_consumer:
                self._warn_failure_policy(vllm_config)
                self._poster = RendezvousPoster(self.config.metaserver)
            try:
                self.scheduler = SchedulerSide(
                    self.config, kv_cache_config, poster=self._poster, host=self._host()
                )
            except BaseException:
                if self._poster is not None:
                    self._poster.close()
                raise

    @staticmethod
    def _warn_failure_policy(vllm_config: VllmConfig) -> None:
        """Say once what a failed transfer does to a request under vLLM's failure policy."""
        ktc = vllm_config.kv_transfer_config
        policy = getattr(ktc, "kv_load_failure_policy", "fail")
        if policy != "recompute":
            logger.warning(
                "RD2H Decode: kv_load_failure_policy is %r, so a request whose KV transfer "
                'fails ends with an error; add "kv_load_failure_policy": "recompute" to '
                "--kv-transfer-config to have vLLM recompute it locally instead",
                policy,
            )

    # -- integration hooks -------------------------------------------------------------------

    @property
    def is_producer(self) -> bool:
        """Prefill (kv_producer); vllm-ascend's multi-connector reads this attribute."""
        return self.config.is_producer

    @property
    def connector_worker(self) -> SfaRemoteD2HConnector | None:
        """vllm-ascend's mark of a worker-side connector, which AscendMultiConnector needs
        (with ``is_producer``) to pick this one as its buffer-reuse provider when it is
        built, before ``register_kv_caches``: this connector itself on the worker side
        (whose halves that call builds), None on the scheduler side."""
        return self if self.role == KVConnectorRole.WORKER else None

    def bind_tp_group(self, group: TpGroup) -> None:
        """Use ``group`` for this worker's TP rank and the Decode completion gather."""
        self._tp = group

    def set_destination_provider(self, provider: DestinationProvider) -> None:
        """Decode: where the pulled KV goes (default: vLLM's own KV cache)."""
        self._destinations = provider

    def create_backend(self, role: str) -> TransferBackend:
        """The transfer backend of this worker (``role`` "prefill" or "decode")."""
        options: dict[str, Any] = {}
        if self.config.transfer_backend == "memfabric":
            options["protocol"] = self.config.memfabric_transfer_protocol
            if self.config.device_type == "npu":
                options["device_id"] = int(getattr(torch, "npu").current_device())  # noqa: B009
        return create_backend(self.config.transfer_backend, role=role, host=self._host(), **options)

    def _host(self) -> str:
        if self.config.advertise_host is not None:
            return self.config.advertise_host
        from vllm.utils.network_utils import get_ip

        return str(get_ip())

    # -- worker side: set-up -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build this worker's half from its KV caches (layouts or destinations)."""
        if self.prefill is not None or self.decode is not None:
            raise ConfigError("register_kv_caches was called twice")
        tp = self._tp if self._tp is not None else default_tp_group(self.config)
        self._tp = tp
        num_blocks = self._kv_cache_config.num_blocks
        check_layer_compact(self._kv_cache_layout(), self._kv_cache_config.kv_cache_tensors)
        provided = self._destinations if self.config.is_consumer else None
        # A Decode with a destination provider may keep no main KV of its own.
        layers = [] if provided is not None else split_kv_caches(kv_caches, num_blocks)
        num_layers = len(provided.layer_names) if provided is not None else len(layers)
        compat = compat_string(
            model_type=str(getattr(self._vllm_config.model_config.hf_config, "model_type", "")),
            kv_dtype=self._kv_dtype(),
            block_sizes=self.groups.block_sizes,
            num_layers=num_layers,
        )
        backend = self.create_backend("prefill" if self.config.is_producer else "decode")
        try:
            if self.config.is_producer:
                self.prefill = PrefillSide(
                    self.config,
                    self.groups,
                    layers,
                    num_blocks,
                    tp=tp,
                    backend=backend,
                    # The caches' own device says where the scatter runs.
                    events=device_events(layers[0].device),
                    compat=compat,
                    host=self._host(),
                    control_options=self.control_options,
                )
                logger.info(
                    "RD2H Prefill TP rank %d/%d: %s backend, protocol %s, KV %s",
                    tp.rank,
                    tp.size,
                    self.config.transfer_backend,
                    self.config.protocol,
                    layout_summary(layers),
                )
                return
            destinations = self._destinations
            if destinations is None:
                if self.config.sparse_offload:
                    raise ConfigError(
                        "sparse_kv_offload_config is enabled but no destination provider was "
                        "set: bind vllm-ascend's SparseKVOffloadManager with "
                        "set_destination_provider(SparseOffloadDestinations(manager, "
                        "kv_caches)) before register_kv_caches, or disable "
                        "sparse_kv_offload_config to read into vLLM's own KV cache"
                    )
                destinations = VllmCacheDestinations(layers, num_blocks)
            self.decode = DecodeSide(
                self.config,
                self.groups,
                destinations,
                tp=tp,
                backend=backend,
                host=self._host(),
                port=self.config.base_port + tp.rank,
                compat=compat,
                # vLLM 0.32 refuses block-level load errors with several KV-cache groups.
                report_block_errors=len(self._kv_cache_config.kv_cache_groups) == 1,
                control_options=self.control_options,
            )
            logger.info(
                "RD2H Decode TP rank %d/%d listening on %s:%d: %s backend, destination %s%s",
                tp.rank,
                tp.size,
                self._host(),
                self.config.base_port + tp.rank,
                self.config.transfer_backend,
                type(destinations).__name__,
                f", KV {layout_summary(layers)}" if layers else "",
            )
        except BaseException:
            backend.close()
            raise

    def _kv_cache_layout(self) -> Any:
        """vLLM's resolved KV cache layout, or None where this vLLM has none."""
        resolve = getattr(self._vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
        try:
            return resolve() if resolve is not None else None
        except ValueError:  # not resolved yet (tests that build configs by hand)
            return None

    def _kv_dtype(self) -> str:
        """The KV cache dtype from configuration ("auto" means the model's dtype)."""
        cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
        if cache_dtype == "auto":
            return str(self._vllm_config.model_config.dtype)
        return cache_dtype

    @property
    def destinations(self) -> DestinationProvider | None:
        """Decode's destinations once registered."""
        return self.decode.destinations if self.decode is not None else self._destinations

    # -- worker side: the step ---------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, Rd2hConnectorMetadata)
        if self.prefill is not None:
            self.prefill.bind(connector_metadata)
        elif self.decode is not None:
            self.decode.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to start: Decode's reads are driven by Prefill's readiness (the
        destinations were registered at ``bind_connector_metadata``)."""
        return None

    def _registered_prefill(self, hook: str) -> PrefillSide | None:
        """Prefill's worker half (None on Decode); ``hook`` before ``register_kv_caches``
        raises at once (else Decode would wait its whole load timeout for nothing)."""
        if self.prefill is None and self.decode is None:
            raise ConfigError(
                f"SfaRemoteD2HConnector.{hook} was called before register_kv_caches, so RD2H "
                "holds no KV cache to publish or protect: call register_kv_caches(kv_caches) "
                "on this worker-side connector first (a multi-connector must forward it to "
                "every child)"
            )
        return self.prefill

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Prefill: the slot-reuse wait before the layer's KV is written (a layer without
        a KV cache of its own has nothing to wait for)."""
        prefill = self._registered_prefill("wait_for_layer_load")
        if prefill is not None:
            idx = prefill.layer_index(layer_name)
            if idx is not None:
                prefill.wait_writable(idx)

    def wait_for_layer_send(self, layer: str | int) -> None:
        """Prefill: block until the storage of ``layer`` may be overwritten; the waiter a
        layerwise store calls before it reuses a buffer. ``layer`` is a layer name or a
        layer NUMBER (the N of ``layers.N``); one this Prefill holds no KV cache of raises
        :class:`~rd2h_protocol.errors.ConfigError`. Decode has nothing to wait for."""
        prefill = self._registered_prefill("wait_for_layer_send")
        if prefill is not None:
            prefill.wait_writable(prefill.storage_layer(layer))

    def wait_for_layer_reuse(self, layer_idx: int) -> None:
        """vllm-ascend's name for the waiter (AscendMultiConnector calls it with the layer
        number): :meth:`wait_for_layer_send`."""
        self.wait_for_layer_send(layer_idx)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Prefill: the layer's KV is in the cache: publish it."""
        prefill = self._registered_prefill("save_kv_layer")
        if prefill is not None:
            prefill.layer_written(layer_name)

    def on_kv_cache_written(self, layer_name: str = "") -> None:
        """vllm-ascend's hook after a layer's cache write: same as ``save_kv_layer``."""
        prefill = self._registered_prefill("on_kv_cache_written")
        if prefill is not None and layer_name:
            prefill.layer_written(layer_name)

    def wait_for_save(self) -> None:
        """Prefill: the step's forward pass is over."""
        if self.prefill is not None:
            self.prefill.end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Sends whose reads are all over; loads finished (or failed) on every rank."""
        results = KVConnectorTransferResults()
        if self.prefill is not None:
            results.finished_sending = self.prefill.get_finished(finished_req_ids)
        elif self.decode is not None:
            results.finished_recving, results.failed_recving = self.decode.get_finished(
                finished_req_ids
            )
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Main and indexer blocks of loads that failed (one KV-cache group only)."""
        return self.decode.take_load_errors() if self.decode is not None else set()

    def get_kv_connector_stats(self) -> Rd2hKVConnectorStats | None:
        if self.scheduler is not None:
            return self.scheduler.get_kv_connector_stats()
        if self.prefill is not None:
            return self.prefill.take_stats()
        if self.decode is not None:
            return self.decode.take_stats()
        return None

    def shutdown(self) -> None:
        """Close sockets, threads, backends and the metaserver client."""
        for part in (self.prefill, self.decode):
            if part is not None:
                part.close()
        if self._poster is not None:
            self._poster.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # -- scheduler side ----------------------------------------------------------------------

    def _side(self) -> SchedulerSide:
        if self.scheduler is None:
            raise ConfigError("scheduler-side call on a worker-side connector")
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._side().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every group: RD2H moves the request's own blocks of main and indexer groups."""
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._side().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._side().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._side().request_finished(request, block_ids)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Per-layer waits and publications cannot be captured in a CUDA graph."""
        return True
