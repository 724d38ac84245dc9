"""What both worker halves share: the TP group, reading vLLM's KV caches, Prefill layouts."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import torch

from rd2h_protocol.errors import (
    ConfigError,
)
from rd2h_protocol.topology import layer_number
from rd2h_protocol.wire.layout import ComponentDest, LayerLayout
from rd2h_vllm.config import Rd2hConfig
from rd2h_vllm.destinations import (
    LayerCaches,
    match_indexer_caches,
)
from rd2h_vllm.kv_layout import cache_arrays, describe
from rd2h_vllm.metadata import CacheGroups

if TYPE_CHECKING:
    from vllm.distributed.parallel_state import GroupCoordinator

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Version of how we derive layouts from vLLM's KV caches (part of the compat string).
LAYOUT_VERSION: Final = 1


# -- the TP group ----------------------------------------------------------------------------


class TpGroup(Protocol):
    """This worker's tensor-parallel rank and a gather over the TP CPU group."""

    @property
    def rank(self) -> int:
        """This worker's TP rank."""

    @property
    def size(self) -> int:
        """The TP world size."""

    def all_gather(self, obj: _T) -> list[_T]:
        """Every rank's ``obj``, indexed by rank (a collective: every rank calls it)."""


@dataclass(frozen=True, slots=True)
class SingleRank:
    """TP size 1, or one rank of a Prefill TP group simulated in one process: only
    Decode gathers, so a rank with ``size`` > 1 refuses to."""

    rank: int = 0
    size: int = 1

    def all_gather(self, obj: _T) -> list[_T]:
        if self.size != 1:
            raise ConfigError(f"SingleRank cannot gather over {self.size} ranks")
        return [obj]


class VllmTpGroup:
    """vLLM's TP group: ``all_gather_object`` over its CPU (gloo) process group."""

    def __init__(self, group: GroupCoordinator) -> None:
        self._group = group

    @property
    def rank(self) -> int:
        return int(self._group.rank_in_group)

    @property
    def size(self) -> int:
        return int(self._group.world_size)

    def all_gather(self, obj: _T) -> list[_T]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(out, obj, group=self._group.cpu_group)
        return out


def default_tp_group(config: Rd2hConfig) -> TpGroup:
    """vLLM's TP group when it is initialised, else a single rank (TP must be 1)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():  # type: ignore[no-untyped-call]
        group = VllmTpGroup(parallel_state.get_tp_group())
        if group.size != config.tp_size:
            raise ConfigError(
                f"vLLM's TP group has {group.size} ranks but tensor_parallel_size is "
                f"{config.tp_size}"
            )
        return group
    if config.tp_size != 1:
        raise ConfigError(
            f"tensor_parallel_size is {config.tp_size} but vLLM's TP group is not "
            "initialised: the worker side needs it to learn its rank"
        )
    return SingleRank()


# -- KV caches -> layouts ---------------------------------------------------------------------


def _single_array(value: Any, num_blocks: int, what: str) -> ComponentDest:
    arrays = cache_arrays(value, num_blocks, what)
    if len(arrays) != 1:
        raise ConfigError(f"{what}: expected one block array, found {len(arrays)}")
    return arrays[0]


def _device_of(value: Any) -> str:
    tensor = value if isinstance(value, torch.Tensor) else value[0]
    return str(tensor.device.type)


def split_kv_caches(kv_caches: Mapping[str, Any], num_blocks: int) -> list[LayerCaches]:
    """vLLM's ``kv_caches`` as main layers in model order (``layers.N``, then name), each
    with its block arrays read from the tensors (:mod:`rd2h_vllm.kv_layout`).

    Entries whose name contains "indexer" are the sparse-attention indexer (and optional
    LIC8 scale) of the main layer with the same ``layers.N``.
    """
    mains = [name for name in kv_caches if "indexer" not in name]
    if not mains:
        raise ConfigError("register_kv_caches got no main (non-indexer) KV cache")
    mains.sort(key=lambda n: (layer_number(n) if layer_number(n) is not None else -1, n))
    indexers = match_indexer_caches(kv_caches, mains)
    out: list[LayerCaches] = []
    for name in mains:
        main = cache_arrays(kv_caches[name], num_blocks, f"KV cache {name!r}")
        idx, scale = indexers.get(name, (None, None))
        out.append(
            LayerCaches(
                name,
                main,
                None if idx is None else _single_array(idx, num_blocks, f"indexer of {name!r}"),
                None if scale is None else _single_array(scale, num_blocks, f"scale of {name!r}"),
                device=_device_of(kv_caches[name]),
            )
        )
    return out


def layout_summary(layers: Sequence[LayerCaches]) -> str:
    """One line for the start-up log: layer count and the first layer's block arrays."""
    first = layers[0]
    parts = [f"{len(layers)} layers", f"main {describe(first.main)}"]
    if first.indexer is not None:
        parts.append(f"indexer {first.indexer.block_bytes} B/block")
    if first.scale is not None:
        parts.append(f"scale {first.scale.block_bytes} B/block")
    parts.append(f"{first.main[0].num_blocks} blocks on {first.device}")
    return ", ".join(parts)


def compat_string(
    *, model_type: str, kv_dtype: str, block_sizes: Sequence[int], num_layers: int
) -> str:
    """What both sides must agree on before any byte moves (the v2 handshake's ``compat``):
    how layouts are derived, the model family, the KV dtype, the KV-cache groups' block
    sizes and the number of cache-bearing layers. Built from configuration both sides
    have (not from tensors: a Decode with a destination provider may hold no main KV)."""
    return (
        f"rd2h-layout-{LAYOUT_VERSION};model={model_type};kv_dtype={kv_dtype};"
        f"block_sizes={','.join(map(str, block_sizes))};layers={num_layers}"
    )


def prefill_layouts(
    layers: Sequence[LayerCaches], groups: CacheGroups, num_blocks: int
) -> list[tuple[str, LayerLayout]]:
    """The MF_META layouts of Prefill's KV caches (base addresses, bytes per block)."""
    idx_group = groups.indexer if groups.indexer is not None else groups.main
    out: list[tuple[str, LayerLayout]] = []
    for layer in layers:
        arrays = layer.arrays()
        extra = len(arrays) - len(layer.main)
        out.append(
            (
                layer.name,
                LayerLayout(
                    base_addrs=[a.base for a in arrays],
                    block_len=[a.block_bytes for a in arrays],
                    tensor_group_idx=[groups.main] * len(layer.main) + [idx_group] * extra,
                    main_tensor_count=len(layer.main),
                    num_blocks=num_blocks,
                ),
            )
        )
    return out


# -- Prefill ---------------------------------------------------------------------------------
