"""The memory regions a rank registers with its transfer backend, from its layouts:
Prefill's KV tensors (what Decode reads) and Decode's destinations (what its reads write).

Apart from the workers because they depend on the layouts alone: a worker registers them
by default, and whoever registers memory itself (the vLLM adapter's tests, a benchmark)
computes the same regions without building a worker.
"""

from __future__ import annotations

from collections.abc import Iterable

from rd2h_protocol.errors import ConfigError
from rd2h_protocol.wire.layout import DestinationLayout, LayerLayout

__all__ = ["destination_regions", "layout_regions"]


def layout_regions(layers: Iterable[tuple[str, LayerLayout]]) -> list[tuple[int, int]]:
    """The memory regions a set of Prefill layer layouts exposes: ``(addr, length)`` each.

    Every tensor of every layer spans ``num_blocks * block_bytes(i)`` bytes from its base
    address (layers of a reuse ring repeat the same regions; the backend merges them).
    Raises :class:`ConfigError` for a layout without ``num_blocks``: its extent is unknown,
    so the caller must name the regions itself.
    """
    regions: list[tuple[int, int]] = []
    for name, layout in layers:
        if layout.num_blocks is None:
            raise ConfigError(
                f"layer {name!r} has no num_blocks, so its memory extent is unknown; "
                "pass the regions to register explicitly"
            )
        for i, base in enumerate(layout.base_addrs):
            regions.append((base, layout.num_blocks * layout.block_bytes(i)))
    return regions


def destination_regions(layers: Iterable[tuple[str, DestinationLayout]]) -> list[tuple[int, int]]:
    """The memory regions of a set of Decode destinations: ``(addr, length)`` each."""
    regions: list[tuple[int, int]] = []
    for _, dst in layers:
        for comp in dst.components():
            regions.append((comp.base, comp.block_bytes * comp.num_blocks))
    return regions
