"""A small layerwise store connector that records what a multi-connector makes it do.

Selected with ``{"kv_connector": "FakeLayerwiseStore", "kv_connector_module_path":
"rd2h_fake_store"}`` inside a multi-connector's ``connectors`` list. It behaves like a
layerwise Prefill offload that reuses ONE physical buffer for every layer: before a
layer is written it must reuse the buffer of the layer before (in this step, or the last
layer of the previous step), so it calls the slot-reuse waiter it was handed for that
layer, then checks with RD2H that the storage really is free. It also checks, at each
hook, that RD2H already ran: at layer entry RD2H's own storage is writable, after the
write RD2H has already published the layer.

Everything it observes goes to :attr:`FakeLayerwiseStore.log` (one list per process;
tests clear it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from rd2h_vllm.connector import SfaRemoteD2HConnector


@dataclass
class StoreMetadata(KVConnectorMetadata):
    """Nothing to tell the workers."""


class FakeLayerwiseStore(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. ``kv_connector_extra_config.hit_tokens``: how many
    prompt tokens its lookup claims (0 by default)."""

    log: ClassVar[list[tuple[Any, ...]]] = []

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.hit_tokens = int(extra.get("hit_tokens", 0))
        self.waiter: Callable[[str | int], None] | None = None
        self.rd2h: SfaRemoteD2HConnector | None = None  # set by the test
        self._last_layer: str | None = None

    # The multi-connector hands its slot-reuse waiter here.
    def set_slot_reuse_waiter(self, waiter: Callable[[str | int], None]) -> bool:
        self.waiter = waiter
        return True

    def _rd2h_writable(self, layer_name: str) -> bool | None:
        """Whether RD2H's storage of the layer is free now (None: not linked to RD2H)."""
        if self.rd2h is None or self.rd2h.prefill is None:
            return None
        idx = self.rd2h.prefill.layer_index(layer_name)
        assert idx is not None
        return self.rd2h.prefill.worker.can_overwrite(idx)

    def _rd2h_published(self, layer_name: str) -> bool | None:
        """Whether RD2H published the layer in this step (None: not linked to RD2H)."""
        if self.rd2h is None or self.rd2h.prefill is None:
            return None
        return self.rd2h.prefill.layer_index(layer_name) in self.rd2h.prefill.published()

    # -- worker side -----------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.log.append(("store.wait_for_layer_load", layer_name, self._rd2h_writable(layer_name)))
        previous, self._last_layer = self._last_layer, layer_name
        if previous is None or previous == layer_name:
            return
        # One shared buffer: writing this layer overwrites the previous layer's KV.
        if self.waiter is None:
            self.log.append(("store.no_waiter", previous))
            return
        self.waiter(previous)
        self.log.append(("store.reuse", previous, self._rd2h_writable(previous)))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.log.append(("store.save_kv_layer", layer_name, self._rd2h_published(layer_name)))

    def on_kv_cache_written(self, layer_name: str = "") -> None:
        self.log.append(("store.on_kv_cache_written", layer_name, self._rd2h_published(layer_name)))

    def wait_for_save(self) -> None:
        return None

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        hit = max(0, min(self.hit_tokens, request.num_prompt_tokens - 1) - num_computed_tokens)
        return hit, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.log.append(
            ("store.update_state_after_alloc", blocks.get_block_ids(), num_external_tokens)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return StoreMetadata()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None


class PlainConnector(FakeLayerwiseStore):
    """A third child: no waiter setter, never chosen; records its allocation calls."""

    def set_slot_reuse_waiter(self, waiter: Callable[[str | int], None]) -> bool:
        return False  # declines the waiter

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.log.append(
            ("plain.update_state_after_alloc", blocks.get_block_ids(), num_external_tokens)
        )
