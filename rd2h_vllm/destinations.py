"""Where Decode puts the KV it pulls: the destination-provider interface and its bindings.

Theory of operation
-------------------
Decode reads every layer of a request into destinations it owns. Per main layer (in
model order: a position in :attr:`DestinationProvider.layer_names` is the ``layer_idx``
of the wire) the connector needs the base address and bytes per vLLM block of each main
block array (K and V, or one array holding both), the optional sparse-attention indexer
and LIC8 scale destinations, and how many blocks each holds.
:meth:`DestinationProvider.layouts` turns that into the
:class:`~rd2h_protocol.wire.layout.DestinationLayout` list the Decode endpoint validates
Prefill's MF_META against (``ConsumerConfig.layers``).

Bindings:

* :class:`VllmCacheDestinations` (ordinary hosts): vLLM's own KV cache, the blocks its
  scheduler allocated to the request, read in place, so vLLM's attention reads exactly
  what Prefill computed. Every TP rank has its own cache, so each rank reads all main
  blocks of its requests (``main_shared`` False).
* :class:`SparseOffloadDestinations`: vllm-ascend's ``SparseKVOffloadManager``, duck-typed
  (no import of vllm-ascend): its ordered ``offload_layer_names``, the per-layer K and V
  global addresses ``gvas_k_bases`` / ``gvas_v_bases`` of its TP-shared pinned host pool,
  ``cpu_block_lens`` (K, V bytes per block) and ``kv_cache_config.num_blocks``. The
  indexer and scale are vLLM's ``kv_caches`` entries whose name contains "indexer",
  matched to a main layer by ``layers.N`` (:func:`match_indexer_caches`). Main K/V lives
  in a pool SHARED by the Decode TP ranks (each rank writes a disjoint share of the
  blocks, reference-behaviour.md §2, ``main_shared`` True); the indexer (and scale) is
  rank-local, a full copy on every rank. Its sparse-offload attention reads that pool.

There is no generic host pool: KV that no attention backend reads would let Decode run
on blocks that were never written.

:func:`device_events` gives the one abstraction for "this layer's scatter has finished"
on NPU (torch_npu), CUDA, or none (CPU kernels are synchronous).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import torch

from rd2h_protocol.errors import ConfigError
from rd2h_protocol.topology import layer_number
from rd2h_protocol.wire.layout import ComponentDest, DestinationLayout


def tensor_destination(tensor: torch.Tensor, num_blocks: int, what: str) -> ComponentDest:
    """A whole tensor whose leading dimension is blocks, as a destination component.

    The tensor must be contiguous (a block is one contiguous stripe) and its size a
    multiple of ``num_blocks``.
    """
    if not tensor.is_contiguous():
        raise ConfigError(f"{what}: the destination tensor must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    if num_blocks < 1 or nbytes % num_blocks:
        raise ConfigError(
            f"{what}: {nbytes} bytes do not divide into {num_blocks} blocks "
            f"(shape {tuple(tensor.shape)}, dtype {tensor.dtype})"
        )
    return ComponentDest(
        base=int(tensor.data_ptr()), block_bytes=nbytes // num_blocks, num_blocks=num_blocks
    )


def _as_tensors(value: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    return tuple(value)


def match_indexer_caches(
    kv_caches: Mapping[str, Any], main_layers: Sequence[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Pair vLLM's indexer cache entries with the main layers they belong to.

    An entry whose name contains "indexer" belongs to the main layer with the same
    ``layers.N``; its value is the indexer tensor, or a tuple ``(indexer, scale)`` when a
    LIC8 scale follows the indexer. Main layers without an indexer are absent from the
    result. Raises :class:`ConfigError` for an indexer without ``layers.N``, with no main
    layer of that number, or two indexers for one layer.
    """
    by_number: dict[int, str] = {}
    for name in main_layers:
        number = layer_number(name)
        if number is not None:
            by_number[number] = name
    found: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for name, value in kv_caches.items():
        if "indexer" not in name:
            continue
        number = layer_number(name)
        if number is None or number not in by_number:
            raise ConfigError(
                f"indexer cache {name!r} matches no main layer by 'layers.N' "
                f"(main layers: {list(main_layers)[:4]}...)"
            )
        main = by_number[number]
        if main in found:
            raise ConfigError(f"two indexer caches belong to main layer {main!r}: one is {name!r}")
        tensors = _as_tensors(value)
        if not 1 <= len(tensors) <= 2:
            raise ConfigError(
                f"indexer cache {name!r}: expected an indexer tensor or (indexer, scale), "
                f"got {len(tensors)} tensors"
            )
        found[main] = (tensors[0], tensors[1] if len(tensors) == 2 else None)
    return found


class DestinationProvider(ABC):
    """Decode's destinations for the KV of every main layer (see the module docstring)."""

    @property
    @abstractmethod
    def layer_names(self) -> Sequence[str]:
        """Main layer names in model order; a name's position is its wire ``layer_idx``."""

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Blocks each destination component holds (destination ids lie below it)."""

    #: Whether the Decode TP ranks share one main pool (each rank then writes a disjoint
    #: share of the main blocks) or each rank has its own (it reads all of them).
    main_shared: bool = True

    @abstractmethod
    def main(self, layer: str) -> tuple[ComponentDest, ...]:
        """The main block arrays of ``layer`` (K and V, or one combined KV), addresses
        valid on this rank."""

    def indexer(self, layer: str) -> tuple[ComponentDest, ComponentDest | None] | None:
        """Rank-local indexer of ``layer`` and its optional LIC8 scale; None without one."""
        return None

    def layout(self, layer: str) -> DestinationLayout:
        """The :class:`DestinationLayout` of ``layer``."""
        main = self.main(layer)
        indexer = self.indexer(layer)
        if indexer is None:
            return DestinationLayout(main=main)
        return DestinationLayout(main=main, indexer=indexer[0], scale=indexer[1])

    def layouts(self) -> list[tuple[str, DestinationLayout]]:
        """Every main layer with its layout, in order (``ConsumerConfig.layers``)."""
        return [(name, self.layout(name)) for name in self.layer_names]


# -- vllm-ascend's SparseKVOffloadManager ----------------------------------------------------

_MANAGER_ATTRS: Final = (
    "offload_layer_names",
    "gvas_k_bases",
    "gvas_v_bases",
    "cpu_block_lens",
    "kv_cache_config",
)


class SparseOffloadDestinations(DestinationProvider):
    """Destinations owned by vllm-ascend's ``SparseKVOffloadManager`` (duck-typed).

    ``manager`` must have run ``register_kv_caches`` (that is when it fills the
    attributes read here); ``kv_caches`` is the dict vLLM hands the connector's
    ``register_kv_caches``, searched for the indexer (and scale) tensors.
    """

    def __init__(self, manager: Any, kv_caches: Mapping[str, Any]) -> None:
        missing = [attr for attr in _MANAGER_ATTRS if not hasattr(manager, attr)]
        if missing:
            raise ConfigError(
                f"the sparse KV offload manager {type(manager).__name__} lacks {missing}: "
                "it must be vllm-ascend's SparseKVOffloadManager after register_kv_caches "
                "(sparse_kv_offload_config.enabled on Decode)"
            )
        names = list(manager.offload_layer_names)
        counts = {
            "gvas_k_bases": len(manager.gvas_k_bases),
            "gvas_v_bases": len(manager.gvas_v_bases),
            "cpu_block_lens": len(manager.cpu_block_lens),
        }
        wrong = {key: n for key, n in counts.items() if n != len(names)}
        if wrong:
            raise ConfigError(
                f"the sparse KV offload manager describes {len(names)} layers but has {wrong}"
            )
        self._names = names
        self._num_blocks = int(manager.kv_cache_config.num_blocks)
        self._main = {
            name: (
                ComponentDest(int(k_base), int(k_len), self._num_blocks),
                ComponentDest(int(v_base), int(v_len), self._num_blocks),
            )
            for name, k_base, v_base, (k_len, v_len) in zip(
                names,
                manager.gvas_k_bases,
                manager.gvas_v_bases,
                manager.cpu_block_lens,
                strict=True,
            )
        }
        self._indexer = {
            name: (
                tensor_destination(idx, self._num_blocks, f"indexer of {name}"),
                None
                if scale is None
                else tensor_destination(scale, self._num_blocks, f"indexer scale of {name}"),
            )
            for name, (idx, scale) in match_indexer_caches(kv_caches, names).items()
        }

    @property
    def layer_names(self) -> Sequence[str]:
        return self._names

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def main(self, layer: str) -> tuple[ComponentDest, ...]:
        return self._main[layer]

    def indexer(self, layer: str) -> tuple[ComponentDest, ComponentDest | None] | None:
        return self._indexer.get(layer)


# -- vLLM's own KV cache ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LayerCaches:
    """One main (cache-bearing) layer's block arrays as vLLM allocated them.

    ``main`` is ``(K, V)`` or one combined array (see :mod:`rd2h_vllm.kv_layout`);
    ``indexer`` and ``scale`` are the optional sparse-attention indexer and LIC8 scale.
    ``device`` is the caches' device type ("cpu", "cuda", "npu").
    """

    name: str
    main: tuple[ComponentDest, ...]
    indexer: ComponentDest | None = None
    scale: ComponentDest | None = None
    device: str = "cpu"

    def arrays(self) -> tuple[ComponentDest, ...]:
        """Every block array of the layer: main ones, then indexer and scale."""
        return (*self.main, *(a for a in (self.indexer, self.scale) if a is not None))


class VllmCacheDestinations(DestinationProvider):
    """Decode's destinations are vLLM's own KV cache: what its attention reads.

    The blocks vLLM's scheduler allocated to a Decode request are read in place (the
    transfer backend registers the caches). Each TP rank holds its own full copy of its
    KV (``main_shared`` False), so every rank reads every main block of its requests.
    """

    main_shared = False

    def __init__(self, layers: Sequence[LayerCaches], num_blocks: int) -> None:
        if not layers:
            raise ConfigError("vLLM handed the connector no cache-bearing layer")
        self._layers = {layer.name: layer for layer in layers}
        self._names = [layer.name for layer in layers]
        self._num_blocks = num_blocks

    @property
    def layer_names(self) -> Sequence[str]:
        return self._names

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def main(self, layer: str) -> tuple[ComponentDest, ...]:
        return self._layers[layer].main

    def indexer(self, layer: str) -> tuple[ComponentDest, ComponentDest | None] | None:
        caches = self._layers[layer]
        if caches.indexer is None:
            return None
        return caches.indexer, caches.scale


# -- "scatter finished" device events -------------------------------------------------------


class ScatterEvent(Protocol):
    """A point in the device stream: the KV written before it is visible once it is done."""

    def query(self) -> bool:
        """True once the device passed the event (never blocks)."""

    def synchronize(self) -> None:
        """Block the calling thread until the device passed the event."""


class _DoneEvent:
    """CPU: kernels run synchronously, so the scatter is finished when recorded."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE: Final = _DoneEvent()


class DeviceEvents:
    """Records "scatter finished" events on the current stream of one device type."""

    def __init__(self, device_type: str, event_cls: Any | None) -> None:
        self.device_type = device_type
        self._event_cls = event_cls

    def record(self) -> ScatterEvent:
        """An event recorded now on the current stream (already done on CPU)."""
        if self._event_cls is None:
            return _DONE
        event = self._event_cls()
        event.record()
        event_typed: ScatterEvent = event
        return event_typed


def device_events(device_type: str) -> DeviceEvents:
    """The event source for ``device_type``: "npu" (torch_npu), "cuda", or "cpu".

    torch_npu is imported only here and only for "npu"; a missing torch_npu is a
    :class:`ConfigError` saying so.
    """
    if device_type == "cpu":
        return DeviceEvents("cpu", None)
    if device_type == "cuda":
        return DeviceEvents("cuda", torch.cuda.Event)
    if device_type == "npu":
        try:
            importlib.import_module("torch_npu")  # registers torch.npu
        except ImportError as exc:
            raise ConfigError(
                "device type 'npu' needs torch_npu, which is not importable: install "
                "vllm-ascend's torch_npu or run on a CUDA/CPU platform"
            ) from exc
        return DeviceEvents("npu", getattr(torch, "npu").Event)  # noqa: B009 (added by torch_npu)
    raise ConfigError(f"no scatter events for device type {device_type!r}: use npu, cuda or cpu")
