"""RD2H as vllm-ascend's layerwise buffer-reuse provider, on real vLLM objects.

On Ascend ``"kv_connector": "MultiConnector"`` is vllm-ascend's ``AscendMultiConnector``.
vllm-ascend cannot be installed here (its build needs the Ascend toolchain), so
:class:`AscendRuleMultiConnector` applies its rule around the children vLLM's own
MultiConnector builds from the configuration:

* a child is a buffer-reuse PROVIDER when it has a true ``is_producer``, a non-None
  ``connector_worker``, a true ``supports_layerwise_buffer_reuse`` and a callable
  ``wait_for_layer_reuse``; the other children keep their configured order after them;
* with a provider, every child that has ``set_external_slot_release_waiter`` is handed a
  waiter calling each provider's ``wait_for_layer_reuse(layer_idx)``; a child whose
  setter does not return False is a SINK;
* ``wait_for_layer_load``: only the non-providers when a sink exists (the store owns the
  layer-entry wait), else providers first; ``save_kv_layer`` and ``on_kv_cache_written``:
  providers first.

:class:`StoreStandIn` behaves as AscendStore's layerwise offload with ONE buffer for every
layer (``layerwise_num_shared_buffers`` 1): before it loads a layer into the buffer it
calls the waiter with the layer's NUMBER, then overwrites the whole buffer. Prefill's
caches are the same: both layers of the model write one tensor. Decode's reads are held
until the store is about to reuse a buffer RD2H has published, so the reuse provably
comes while Decode has not read the layer yet; the bytes Decode holds at the end show
whether the store waited for Decode's reply.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import torch
from conftest import VllmConfigFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.request import RequestStatus
from vllm_metaserver_harness import MetaServer
from vllm_pd_harness import (
    MAIN,
    build_engine,
    engines,
    free_port_block,
    run_until,
    start_remote_prefill,
    status,
    wrap_in,
)

from rd2h_protocol.errors import ConfigError, TransferError
from rd2h_protocol.topology import layer_number
from rd2h_runtime.transfer import TransferBackend
from rd2h_runtime.transfer.base import U64Array
from rd2h_runtime.transfer.nixl_backend import NixlBackend
from rd2h_vllm.connector import SfaRemoteD2HConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

#: What the store "loads" into the shared buffer when it reuses it.
STORE_FILL = 0xEE
#: Longest a Decode read waits to be let go.
HOLD_S = 5.0


def is_reuse_provider(connector: object) -> bool:
    """AscendMultiConnector's rule for a layerwise buffer-reuse provider."""
    return bool(
        getattr(connector, "is_producer", False)
        and getattr(connector, "connector_worker", None) is not None
        and getattr(connector, "supports_layerwise_buffer_reuse", False)
        and callable(getattr(connector, "wait_for_layer_reuse", None))
    )


class AscendRuleMultiConnector(MultiConnector):
    """vLLM's MultiConnector under AscendMultiConnector's provider rule and call order."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.providers = [c for c in self._connectors if is_reuse_provider(c)]
        self.others = [c for c in self._connectors if all(c is not p for p in self.providers)]
        self.sink_configured = False
        if not self.providers:
            return
        for connector in self._connectors:
            setter = getattr(connector, "set_external_slot_release_waiter", None)
            if callable(setter) and setter(self._wait_for_external_slot_release) is not False:
                self.sink_configured = True

    def _wait_for_external_slot_release(self, layer_idx: int) -> None:
        for provider in self.providers:
            provider.wait_for_layer_reuse(layer_idx)

    def wait_for_layer_load(self, layer_name: str) -> None:
        first = [] if self.sink_configured else self.providers
        for connector in [*first, *self.others]:
            connector.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        for connector in [*self.providers, *self.others]:
            connector.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def on_kv_cache_written(self, layer_name: str = "") -> None:
        for connector in [*self.providers, *self.others]:
            hook = getattr(connector, "on_kv_cache_written", None)
            if callable(hook):
                hook(layer_name)


@dataclass(frozen=True)
class Entry:
    """The store at a layer's entry, just before it overwrites the shared buffer."""

    layer: int
    waited: bool  # it called the slot-release waiter
    closed_before: bool  # RD2H's gate of the layer's storage was closed when it arrived
    open_after: bool  # ... and open when it went on to overwrite the buffer
    at: float  # time.monotonic() when it went on


@dataclass(frozen=True)
class Hook:
    """The store in ``save_kv_layer`` / ``on_kv_cache_written``."""

    name: str
    layer: int
    rd2h_published: bool  # RD2H had already published the layer (closed its gate)


@dataclass
class StoreMetadata(KVConnectorMetadata):
    """Nothing to tell the workers."""


class StoreStandIn(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. ``kv_connector_extra_config.accept_waiter`` (default
    True) is what its ``set_external_slot_release_waiter`` answers."""

    log: ClassVar[list[Entry | Hook]] = []

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.accept_waiter = bool(extra.get("accept_waiter", True))
        self.waiter: Callable[[int], None] | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.rd2h: SfaRemoteD2HConnector | None = None  # set by the test
        #: Called once RD2H's gate was seen closed at a layer entry (lets Decode read).
        self.on_closed_gate: Callable[[], None] = lambda: None

    def set_external_slot_release_waiter(self, waiter: Callable[[int], None]) -> bool:
        if self.accept_waiter:
            self.waiter = waiter
        return self.accept_waiter

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.buffers = dict(kv_caches)

    def _gate_open(self, layer: int) -> bool:
        assert self.rd2h is not None and self.rd2h.prefill is not None
        prefill = self.rd2h.prefill
        return prefill.worker.can_overwrite(prefill.storage_layer(layer))

    # -- worker side -----------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = layer_number(layer_name)
        assert layer is not None
        closed_before = not self._gate_open(layer)
        if closed_before:
            self.on_closed_gate()
        if self.waiter is not None:
            self.waiter(layer)
        open_after = self._gate_open(layer)
        self.log.append(
            Entry(layer, self.waiter is not None, closed_before, open_after, time.monotonic())
        )
        # The reuse: load this layer into the buffer the previous layer's KV is in.
        self.buffers[layer_name].view(torch.uint8).fill_(STORE_FILL)

    def _record(self, name: str, layer_name: str) -> None:
        assert self.rd2h is not None and self.rd2h.prefill is not None
        prefill = self.rd2h.prefill
        idx = prefill.layer_index(layer_name)
        assert idx is not None
        self.log.append(Hook(name, idx, idx in prefill.published()))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._record("save_kv_layer", layer_name)

    def on_kv_cache_written(self, layer_name: str = "") -> None:
        self._record("on_kv_cache_written", layer_name)

    def wait_for_save(self) -> None:
        return None

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return StoreMetadata()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None


class HeldNixl(NixlBackend):
    """NIXL whose reads wait until :attr:`release` is set (at most ``HOLD_S``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.release = threading.Event()
        self.read_ends: list[float] = []

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        if not self.release.wait(HOLD_S):
            raise TransferError(f"read held for {HOLD_S} s: nobody let Decode read")
        super()._read(session, remote, local, lengths, deadline)
        self.read_ends.append(time.monotonic())


class HeldReadDecode(SfaRemoteD2HConnector):
    """The real connector whose Decode reads wait for :class:`HeldNixl`'s release."""

    backend: HeldNixl

    def create_backend(self, role: str) -> TransferBackend:
        self.backend = HeldNixl(role=role, host=self._host())
        return self.backend


STORE = {
    "kv_connector": StoreStandIn.__name__,
    "kv_connector_module_path": StoreStandIn.__module__,
    "kv_role": "kv_producer",
}


def one_buffer(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every main layer writes the first layer's tensor (a reuse ring of one buffer)."""
    return {name: caches[MAIN[0]] for name in MAIN}


@pytest.fixture(autouse=True)
def clean_log() -> Iterator[list[Entry | Hook]]:
    StoreStandIn.log.clear()
    yield StoreStandIn.log
    StoreStandIn.log.clear()


def child(connector: MultiConnector, cls: type[Any]) -> Any:
    [found] = [c for c in connector.sub_connectors if isinstance(c, cls)]
    return found


@pytest.mark.parametrize("accept_waiter", [True, False], ids=["store-waits", "store-declines"])
def test_rd2h_is_the_reuse_provider_and_the_store_reuses_only_after_decode_read(
    make_vllm_config: VllmConfigFactory,
    server: MetaServer,
    clean_log: list[Entry | Hook],
    accept_waiter: bool,
) -> None:
    decode = build_engine(
        make_vllm_config, "kv_consumer", kv_port=free_port_block(1), worker_cls=HeldReadDecode
    )
    prefill = build_engine(
        make_vllm_config,
        "kv_producer",
        wrap=wrap_in(AscendRuleMultiConnector, STORE, accept_waiter=accept_waiter),
        worker_cls=AscendRuleMultiConnector,
        map_caches=one_buffer,
    )
    # The store waits: on_kv_cache_written is the first publication. It declines: RD2H's
    # own layer-entry wait protects the buffer, and save_kv_layer publishes.
    prefill.cache_written_hook = accept_waiter
    with engines(prefill, decode):
        composite = prefill.workers[0]
        assert isinstance(composite, AscendRuleMultiConnector)
        rd2h, store = prefill.rd2h(), child(composite, StoreStandIn)
        # RD2H is selected as the provider (the store is listed first), the store is not.
        assert composite.providers == [rd2h]
        assert composite.others == [store]
        assert composite.sink_configured is accept_waiter
        # Both layers really write one storage on Prefill.
        assert prefill.caches[0][MAIN[0]] is prefill.caches[0][MAIN[1]]
        store.rd2h = rd2h
        held = decode.rd2h().backend
        assert isinstance(held, HeldNixl)
        if accept_waiter:
            # Decode reads only once the store has arrived at a buffer RD2H published.
            store.on_closed_gate = held.release.set
        else:
            held.release.set()  # RD2H's own wait would block on the held read

        prompt = list(range(60))
        d_req = start_remote_prefill(prefill, decode, server, "cmpl-as-0", prompt)
        run_until([prefill, decode], lambda: status(d_req) == RequestStatus.RUNNING)
        # Every byte Decode holds is what Prefill computed, though the store overwrote the
        # buffer of layer 0 with its fill to load layer 1.
        assert decode.mismatches("cmpl-as-0", decode.block_ids(d_req.request_id)[0]) == []
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)

    entries = [e for e in clean_log if isinstance(e, Entry)]
    assert [e.layer for e in entries] == [0, 1]
    # Whoever waited, the store overwrote a buffer only once RD2H's gate was open.
    assert all(e.open_after for e in entries)
    if accept_waiter:
        # The store's reuse for layer 1 arrived while Decode could not have read layer 0,
        # went through RD2H's gate (by layer number) and went on only after Decode's read.
        assert all(e.waited for e in entries)
        layer1 = entries[1]
        assert layer1.closed_before
        assert held.read_ends and held.read_ends[0] < layer1.at
    else:
        # RD2H's layer-entry wait ran before the store's: the gate was already open.
        assert not any(e.waited or e.closed_before for e in entries)
    # RD2H published each layer before the store's hooks for it ran.
    hooks = [h for h in clean_log if isinstance(h, Hook)]
    names = {"on_kv_cache_written", "save_kv_layer"} if accept_waiter else {"save_kv_layer"}
    assert {h.name for h in hooks} == names
    assert sorted({h.layer for h in hooks}) == [0, 1]
    assert all(h.rd2h_published for h in hooks)


def test_scheduler_side_and_decode_are_never_providers(
    make_vllm_config: VllmConfigFactory,
) -> None:
    decode = build_engine(make_vllm_config, "kv_consumer", kv_port=free_port_block(1))
    prefill = build_engine(make_vllm_config, "kv_producer")
    with engines(prefill, decode):
        assert is_reuse_provider(prefill.rd2h())
        assert prefill.rd2h().connector_worker is prefill.rd2h()
        # The scheduler-side connector exists before any worker half: no provider there.
        assert prefill.connector.connector_worker is None
        assert not is_reuse_provider(prefill.connector)
        assert not is_reuse_provider(decode.rd2h())
        # RD2H takes no waiter itself: it never waits on its own gate through a sibling.
        assert not hasattr(prefill.rd2h(), "set_external_slot_release_waiter")


def renumbered(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The caches of a model whose cache-bearing layers are numbered 3 and 5 (its other
    layers hold no KV cache)."""
    return {
        name.replace(f"layers.{i}.", f"layers.{2 * i + 3}."): caches[name]
        for i, name in enumerate(MAIN)
    }


@pytest.mark.parametrize(
    "unknown", [0, 1, 2, 4, -1, "model.layers.4.self_attn.attn", "lm_head"], ids=repr
)
def test_waits_take_layer_numbers_and_refuse_unknown_layers(
    make_vllm_config: VllmConfigFactory, unknown: str | int
) -> None:
    prefill = build_engine(make_vllm_config, "kv_producer", map_caches=renumbered)
    with engines(prefill):
        rd2h = prefill.rd2h()
        assert rd2h.prefill is not None
        assert rd2h.prefill.layer_names == [
            "model.layers.3.self_attn.attn",
            "model.layers.5.self_attn.attn",
        ]
        # The numbers and names of the layers it holds pass (nothing is published yet).
        for layer in (3, 5, "model.layers.3.self_attn.attn", "model.layers.5.self_attn.attn"):
            rd2h.wait_for_layer_send(layer)
        rd2h.wait_for_layer_reuse(3)
        rd2h.wait_for_layer_reuse(5)
        assert rd2h.prefill.storage_layer(5) == 1
        # A list position, a negative index or another model's layer is refused loudly.
        with pytest.raises(ConfigError, match=r"has no KV cache on this Prefill.*\[3, 5\]"):
            rd2h.wait_for_layer_send(unknown)
        if isinstance(unknown, int):
            with pytest.raises(ConfigError, match="has no KV cache on this Prefill"):
                rd2h.wait_for_layer_reuse(unknown)
