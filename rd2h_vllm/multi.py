"""A MultiConnector that composes RD2H with a layerwise store connector safely.

Theory of operation
-------------------
On Prefill, RD2H may share physical KV buffers with a layerwise store connector
(AscendStore's layerwise offload reuses a few buffers for every layer). Two rules keep a
buffer from being overwritten while a Decode still reads it (reference-behaviour.md §4):

1. RD2H runs FIRST in ``wait_for_layer_load`` (its slot-reuse wait happens before any
   sibling can write the layer's storage), in ``save_kv_layer`` and in
   ``on_kv_cache_written`` (RD2H closes the storage's gate by publishing the layer
   before a sibling publishes work that could let the buffer be reused).
2. The store connector gets RD2H's waiter: before it reuses a buffer it calls
   :meth:`Rd2hMultiConnector.wait_for_layer_send` (handed over through the store's
   ``set_slot_reuse_waiter(waiter)``, or vllm-ascend's name for it,
   ``set_external_slot_release_waiter(waiter)``; a setter returning False declines).
   The waiter takes a layer name or the layer's NUMBER (the N of ``layers.N``, what
   vllm-ascend's stores pass); a layer RD2H holds no KV cache of raises.

On the scheduler side, a connector that sets ``requires_full_blocks_on_update_after_alloc``
(RD2H on Prefill) receives the request's full blocks and external token count in
``update_state_after_alloc`` even when another connector was chosen for the lookup; any
other connector that was not chosen receives an empty block list and 0 tokens, as in
vllm-ascend's multi-connector.

A "slot provider" is any child with a callable ``wait_for_layer_send`` (RD2H); providers
keep their configured order among themselves, and so do the other children.

Select it with ``"kv_connector": "Rd2hMultiConnector", "kv_connector_module_path":
"rd2h_vllm.multi"`` and the usual ``kv_connector_extra_config.connectors`` list. This is
for plain vLLM; on Ascend vllm-ascend's own ``AscendMultiConnector`` (``"MultiConnector"``
there) applies the same two rules to RD2H as its buffer-reuse provider (see
:mod:`rd2h_vllm.connector`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

__all__ = ["WAITER_SETTERS", "Rd2hMultiConnector", "is_slot_provider"]

#: Setter names a store connector may expose to receive the slot-reuse waiter.
WAITER_SETTERS = ("set_slot_reuse_waiter", "set_external_slot_release_waiter")


def is_slot_provider(connector: object) -> bool:
    """Whether ``connector`` protects storage reuse (RD2H): has ``wait_for_layer_send``."""
    return callable(getattr(connector, "wait_for_layer_send", None))


class Rd2hMultiConnector(MultiConnector):
    """vLLM's MultiConnector with RD2H's ordering rules (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._providers: list[KVConnectorBase_V1] = [
            c for c in self._connectors if is_slot_provider(c)
        ]
        self._others: list[KVConnectorBase_V1] = [
            c for c in self._connectors if not is_slot_provider(c)
        ]
        self.waiter_handed_to: list[KVConnectorBase_V1] = []
        if self._providers and role == KVConnectorRole.WORKER:
            for connector in self._others:
                for name in WAITER_SETTERS:
                    setter = getattr(connector, name, None)
                    if callable(setter):
                        if setter(self.wait_for_layer_send) is not False:
                            self.waiter_handed_to.append(connector)
                        break

    @property
    def ordered_connectors(self) -> list[KVConnectorBase_V1]:
        """Slot providers first, then the others, each in configured order."""
        return [*self._providers, *self._others]

    # -- worker side -----------------------------------------------------------------------

    def wait_for_layer_send(self, layer: str | int) -> None:
        """The slot-reuse waiter: every provider's storage of ``layer`` may be reused."""
        for provider in self._providers:
            provider.wait_for_layer_send(layer)  # type: ignore[attr-defined]

    def wait_for_layer_load(self, layer_name: str) -> None:
        for connector in self.ordered_connectors:
            connector.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        for connector in self.ordered_connectors:
            connector.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def on_kv_cache_written(self, layer_name: str = "") -> None:
        """vllm-ascend's cache-written hook, providers first (children without it skip)."""
        for connector in self.ordered_connectors:
            hook = getattr(connector, "on_kv_cache_written", None)
            if callable(hook):
                hook(layer_name)

    # -- scheduler side --------------------------------------------------------------------

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        chosen = self._requests_to_connector.get(request.request_id, -1)
        empty = blocks.new_empty()
        for i, connector in enumerate(self._connectors):
            full = i == chosen or bool(
                getattr(connector, "requires_full_blocks_on_update_after_alloc", False)
            )
            connector.update_state_after_alloc(
                request, blocks if full else empty, num_external_tokens if full else 0
            )
