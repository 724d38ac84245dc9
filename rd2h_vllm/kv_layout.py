"""vLLM's KV caches as block arrays: what one block id covers, read from the tensors.

Theory of operation
-------------------
RD2H moves whole vLLM blocks. For every tensor vLLM hands the connector
(``register_kv_caches``) we need the *block arrays* it holds: a base address, the bytes
one block id covers, and the stride between consecutive blocks (equal to those bytes, so
block ``b`` starts at ``base + b * block_bytes``). Nothing is assumed about the attention
backend: the block arrays are read from the tensor's shape and strides.

* The **block dimension** is the dimension whose size is ``num_blocks`` times a whole
  number ``s`` (``s`` > 1 when the attention kernel uses blocks smaller than vLLM's: then
  ``s`` consecutive kernel blocks form one vLLM block). Among such dimensions, the one
  with the largest stride that passes the checks below is taken.
* Dimensions with a SMALLER stride lie inside a block: together they must fit within one
  kernel-block stride (a block is one contiguous stripe; padding inside it is copied too).
* Dimensions with a LARGER stride separate **components**: each index into them is its
  own block array (the older ``[2, num_blocks, ...]`` form gives K and V). Each must step
  over at least a whole block array, so components never overlap.

What vLLM 0.32 hands a connector, and what it becomes:

==================================================  ==========================  ==========
backend / model                                     tensor shape (per layer)    components
==================================================  ==========================  ==========
CPU attention, FlashAttention, FlashInfer (any      ``[num_blocks, ...]`` with  1 (K and V
stride order): K and V side by side in each block   K and V inside the block    per block)
older split form                                    ``[2, num_blocks, ...]``    2 (K, V)
vllm-ascend                                         ``(K, V)`` pair of tensors  2 (K, V)
MLA (DeepSeek V2/V3): one latent cache              ``[num_blocks, bs, 576]``   1
DeepSeek V3.2 indexer (name contains "indexer")     ``[num_blocks, bs, 132]``   1
==================================================  ==========================  ==========
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rd2h_protocol.errors import ConfigError
from rd2h_protocol.wire.layout import ComponentDest


def _dims(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """``(size, stride)`` of every dimension that has more than one element."""
    pairs = zip(tensor.shape, tensor.stride(), strict=True)
    return [(size, stride) for size, stride in pairs if size > 1]


def _span(dims: Sequence[tuple[int, int]]) -> int:
    """Elements from the first to one past the last element the dimensions reach."""
    return 1 + sum((size - 1) * stride for size, stride in dims)


def _try_block_dim(
    tensor: torch.Tensor, dims: list[tuple[int, int]], which: int, num_blocks: int
) -> tuple[ComponentDest, ...] | str:
    """The block arrays when dimension ``which`` is the block dimension, or why not."""
    size, stride = dims[which]
    per_block = size // num_blocks  # kernel blocks per vLLM block
    inner = [d for i, d in enumerate(dims) if i != which and d[1] < stride]
    outer = [d for i, d in enumerate(dims) if i != which and d[1] >= stride]
    if _span(inner) > stride:
        return (
            f"the dimensions inside a block reach {_span(inner)} elements but blocks are "
            f"{stride} elements apart (a block is not one contiguous stripe)"
        )
    array_elems = size * stride
    element = tensor.element_size()
    bases = [tensor.data_ptr()]
    for out_size, out_stride in sorted(outer, key=lambda d: d[1]):
        if out_stride < array_elems:
            return (
                f"a dimension of stride {out_stride} elements lies across the blocks "
                f"(blocks span {array_elems} elements)"
            )
        bases = [b + i * out_stride * element for i in range(out_size) for b in bases]
        array_elems = out_stride * out_size
    block_bytes = stride * element * per_block
    return tuple(ComponentDest(base, block_bytes, num_blocks) for base in sorted(bases))


def block_arrays(tensor: torch.Tensor, num_blocks: int, what: str) -> tuple[ComponentDest, ...]:
    """The block arrays of one KV-cache tensor (see the module docstring), in address order.

    Raises :class:`ConfigError` naming ``what``, the shape and the strides when no
    dimension can be the block dimension.
    """
    if num_blocks < 1:
        raise ConfigError(f"{what}: num_blocks must be >= 1, got {num_blocks}")
    dims = _dims(tensor)
    if num_blocks == 1:
        # Every dimension could be "the blocks"; the whole tensor is then one block.
        nbytes = _span(dims) * tensor.element_size()
        if _span(dims) != tensor.numel():
            raise ConfigError(f"{what}: a one-block cache must be contiguous")
        return (ComponentDest(tensor.data_ptr(), nbytes, 1),)
    candidates = sorted(
        (i for i, (size, _) in enumerate(dims) if size % num_blocks == 0),
        key=lambda i: dims[i][1],
        reverse=True,
    )
    reasons: list[str] = []
    for which in candidates:
        found = _try_block_dim(tensor, dims, which, num_blocks)
        if isinstance(found, tuple):
            return found
        reasons.append(f"dimension of size {dims[which][0]}: {found}")
    why = "; ".join(reasons) if reasons else f"no dimension is a multiple of {num_blocks}"
    raise ConfigError(
        f"{what}: cannot find its blocks in shape {tuple(tensor.shape)} with strides "
        f"{tuple(tensor.stride())} ({num_blocks} blocks): {why}"
    )


def cache_arrays(value: Any, num_blocks: int, what: str) -> tuple[ComponentDest, ...]:
    """The block arrays of one ``kv_caches`` entry: a tensor, or a tuple/list of tensors
    (vllm-ascend's ``(K, V)``), each read with :func:`block_arrays`, in the given order."""
    if isinstance(value, torch.Tensor):
        return block_arrays(value, num_blocks, what)
    if (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(t, torch.Tensor) for t in value)
    ):
        return tuple(
            array
            for i, t in enumerate(value)
            for array in block_arrays(t, num_blocks, f"{what}[{i}]")
        )
    raise ConfigError(
        f"{what}: expected a tensor or a tuple of tensors, got {type(value).__name__}"
    )


def check_layer_compact(layout: Any, kv_cache_tensors: Sequence[Any]) -> None:
    """Refuse a KV cache whose layers interleave inside each block (a cross-layer layout).

    ``layout`` is vLLM's resolved ``KVCacheLayout`` (None when unknown) and
    ``kv_cache_tensors`` its ``KVCacheConfig.kv_cache_tensors``: layer ``l``'s page of
    block ``b`` starts at ``offset + l * layer_stride + b * block_stride``. In a
    block-outermost layout one block holds every layer's page, so a layer's blocks are
    not one stripe each and reading one layer would copy (and overwrite) the others.
    RD2H moves one layer at a time, as soon as it is computed.
    """
    problems: list[str] = []
    if getattr(layout, "is_layer_compact", True) is False:
        problems.append(f"the layout {getattr(layout, 'name', layout)} keeps blocks outermost")
    for tensor in kv_cache_tensors:
        layers = list(getattr(tensor, "layers", ()))
        layer_stride = getattr(tensor, "layer_stride", None)
        block_stride = getattr(tensor, "block_stride", None)
        if len(layers) < 2 or layer_stride is None or block_stride is None:
            continue
        if layer_stride < block_stride:
            problems.append(
                f"{layers[0]!r} and {len(layers) - 1} more layers share each block "
                f"(layer stride {layer_stride} B, block stride {block_stride} B)"
            )
            break  # one group's tensors say it; the others say the same
    if problems:
        problem = "; ".join(problems)
        raise ConfigError(
            f"vLLM's KV cache interleaves layers inside each block ({problem}); RD2H moves "
            "one layer at a time. Use a layer-compact layout: set VLLM_KV_CACHE_LAYOUT="
            "LBHNC (or LBNHC, LHBNC) on both servers"
        )


def describe(arrays: Sequence[ComponentDest]) -> str:
    """``"2 x 4096 B"`` style summary of a layer's block arrays, for logs."""
    sizes = sorted({a.block_bytes for a in arrays})
    if len(sizes) == 1:
        return f"{len(arrays)} x {sizes[0]} B/block"
    return " + ".join(f"{a.block_bytes} B" for a in arrays) + " per block"


__all__ = ["block_arrays", "cache_arrays", "check_layer_compact", "describe"]
