"""rd2h_vllm.kv_layout on the KV caches vLLM itself lays out and allocates.

Every cache here comes from vLLM 0.32's own code: ``get_kv_cache_groups`` and
``get_kv_cache_config_from_groups`` place the layers (``KVCacheTensor``) for a resolved
``KVCacheLayout``, and ``allocate_kv_cache`` (``create_kv_cache_views``) hands out the
per-layer views a connector's ``register_kv_caches`` gets, with kernel block splitting
where vLLM supports it. The specs are the ones the models declare: a Llama-like
``FullAttentionSpec`` (several KV heads, K and V side by side), DeepSeek's MLA latent
(``MLAAttentionSpec``, one 576-wide latent per token) and DeepSeek V3.2's indexer cache
(``DeepseekV32IndexerCache.get_kv_cache_spec``: 132 uint8 per token), alone and together.

The property checked for every layer and vLLM block ``b``: every byte of block ``b`` of
vLLM's view lies inside the block-``b`` ranges of the block arrays ``block_arrays`` reads
from the tensor, and no array's block-``b`` range touches a byte of another block or of
another layer (padding bytes of no block may be covered: they are copied too).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import VllmConfigFactory
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    validate_kv_cache_layout,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    group_kernel_blocks,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from rd2h_protocol.errors import ConfigError
from rd2h_protocol.wire.layout import ComponentDest
from rd2h_vllm.kv_layout import block_arrays, cache_arrays, check_layer_compact, describe

NUM_BLOCKS = 6
NUM_LAYERS = 3
BLOCK = 32  # tokens per vLLM block; kernels may split it into 16-token kernel blocks
KERNEL = 16
LAYER_COMPACT = [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.LHBNC]
BLOCK_OUTERMOST = [KVCacheLayout.BLHNC, KVCacheLayout.BLNHC, KVCacheLayout.BHLNC]


def llama(layer: int) -> dict[str, KVCacheSpec]:
    """A Llama attention layer: 4 KV heads of 64, bf16 (K and V side by side)."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    return {f"model.layers.{layer}.self_attn.attn": spec}


def deepseek_mla(layer: int) -> dict[str, KVCacheSpec]:
    """DeepSeek V2/V3's MLA latent: one head of 512 + 64 (MLAAttention.get_kv_cache_spec)."""
    spec = MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16
    )
    return {f"model.layers.{layer}.self_attn.attn": spec}


def deepseek_v32_indexer(layer: int) -> dict[str, KVCacheSpec]:
    """DeepSeek V3.2's indexer cache: 128 fp8 values + one fp32 scale per 128, as uint8."""
    spec = MLAAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=128 + 128 // 128 * 4,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
    )
    return {f"model.layers.{layer}.self_attn.indexer.k_cache": spec}


def deepseek_v32(layer: int) -> dict[str, KVCacheSpec]:
    """A DeepSeek V3.2 layer: the MLA latent and its indexer (one KV-cache group)."""
    return {**deepseek_mla(layer), **deepseek_v32_indexer(layer)}


MODELS = {
    "llama": llama,
    "deepseek_mla": deepseek_mla,
    "deepseek_v32_indexer": deepseek_v32_indexer,
    "deepseek_v32": deepseek_v32,
}


def model_specs(model: str) -> dict[str, KVCacheSpec]:
    specs: dict[str, KVCacheSpec] = {}
    for layer in range(NUM_LAYERS):
        specs.update(MODELS[model](layer))
    return specs


def vllm_kv_cache_config(
    make_vllm_config: VllmConfigFactory, model: str, layout: KVCacheLayout
) -> KVCacheConfig:
    """vLLM's KVCacheConfig for ``model`` with ``layout`` resolved (raises vLLM's
    ValueError where vLLM cannot express the model in that layout)."""
    vllm_config = make_vllm_config()
    vllm_config.cache_config.kv_cache_layout = layout.name
    vllm_config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    groups = get_kv_cache_groups(vllm_config, model_specs(model))
    config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 30)
    assert config.num_blocks == NUM_BLOCKS
    return config


@dataclass(frozen=True)
class Allocated:
    """vLLM's allocation: the per-layer views and the one backing buffer under them."""

    caches: dict[str, torch.Tensor]
    base: int  # address of the backing buffer
    nbytes: int
    ratio: int  # kernel blocks per vLLM block


def allocate(config: KVCacheConfig, layout: KVCacheLayout, kernel: int | None) -> Allocated:
    kernel_sizes = None if kernel is None else [kernel] * len(config.kv_cache_groups)
    caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernel_sizes)
    [storage] = {
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in caches.values()
    }
    return Allocated(caches, storage[0], storage[1], 1 if kernel is None else BLOCK // kernel)


def byte_addresses(view: torch.Tensor, alloc: Allocated) -> torch.Tensor:
    """The buffer offset of every byte of ``view``, in the view's shape (last dim bytes)."""
    assert view.stride(-1) == 1  # vLLM's views keep the content dimension contiguous
    as_bytes = view.view(torch.uint8)
    offsets = torch.arange(alloc.nbytes, dtype=torch.int64)
    return offsets.as_strided(as_bytes.shape, as_bytes.stride(), as_bytes.data_ptr() - alloc.base)


def check_blocks(alloc: Allocated, arrays: dict[str, tuple[ComponentDest, ...]]) -> None:
    """The property in the module docstring, for every layer and block."""
    names = list(alloc.caches)
    owner = torch.full((alloc.nbytes,), -1, dtype=torch.int64)  # (layer, block) of a byte
    blocks: dict[tuple[int, int], torch.Tensor] = {}
    for i, name in enumerate(names):
        view = alloc.caches[name]
        assert view.shape[0] == NUM_BLOCKS * alloc.ratio
        grouped = group_kernel_blocks(byte_addresses(view, alloc), NUM_BLOCKS)
        for b in range(NUM_BLOCKS):
            where = grouped[b].reshape(-1)
            assert bool((owner[where] == -1).all()), f"vLLM's views overlap at {name} {b}"
            owner[where] = i * NUM_BLOCKS + b
            blocks[(i, b)] = where
    for i, name in enumerate(names):
        layer_arrays = arrays[name]
        assert all(a.num_blocks == NUM_BLOCKS for a in layer_arrays)
        for b in range(NUM_BLOCKS):
            where = blocks[(i, b)]
            covered = torch.zeros(where.shape, dtype=torch.bool)
            for a in layer_arrays:
                start = a.base - alloc.base + b * a.block_bytes
                end = start + a.block_bytes
                assert start >= 0 and end <= alloc.nbytes, (name, b)
                span = owner[start:end]
                strangers = span[(span != -1) & (span != i * NUM_BLOCKS + b)]
                assert strangers.numel() == 0, (
                    f"{name}: block {b}'s range of an array touches layer "
                    f"{names[int(strangers[0]) // NUM_BLOCKS]} block "
                    f"{int(strangers[0]) % NUM_BLOCKS}"
                )
                covered |= (where >= start) & (where < end)
            assert bool(covered.all()), f"{name}: block {b} not covered"


def expected_arrays(model: str, layout: KVCacheLayout, name: str) -> int:
    """How many block arrays a layer has: heads outside the blocks (LHBNC) are one array
    each; otherwise K and V side by side, the latent or the indexer make one."""
    if layout is KVCacheLayout.LHBNC and model == "llama" and "indexer" not in name:
        return 4
    return 1


def supported(model: str, layout: KVCacheLayout, kernel: int | None) -> bool:
    """Whether vLLM itself lays ``model`` out in ``layout`` with ``kernel`` blocks: mixed
    page sizes in one group need a block-compact layout (validate_kv_cache_layout), and a
    block splits into kernel blocks only when it is one dense page (create_kv_cache_views:
    under LHBNC only with one head)."""
    if model == "deepseek_v32" and not layout.is_block_compact:
        return False
    return not (kernel is not None and layout is KVCacheLayout.LHBNC and model == "llama")


@pytest.mark.parametrize("kernel", [None, KERNEL], ids=["blocks", "kernel-blocks"])
@pytest.mark.parametrize("layout", LAYER_COMPACT, ids=lambda x: x.name)
@pytest.mark.parametrize("model", list(MODELS))
def test_block_arrays_cover_each_vllm_block_and_nothing_else(
    make_vllm_config: VllmConfigFactory,
    model: str,
    layout: KVCacheLayout,
    kernel: int | None,
) -> None:
    if not supported(model, layout, kernel):
        # vLLM refuses it itself: no connector ever sees such caches.
        with pytest.raises(ValueError, match=r"VLLM_KV_CACHE_LAYOUT|KV cache layout"):
            allocate(vllm_kv_cache_config(make_vllm_config, model, layout), layout, kernel)
        return
    config = vllm_kv_cache_config(make_vllm_config, model, layout)
    check_layer_compact(layout, config.kv_cache_tensors)  # accepted: layers are compact
    alloc = allocate(config, layout, kernel)
    assert set(alloc.caches) == set(model_specs(model))
    arrays = {name: block_arrays(view, NUM_BLOCKS, name) for name, view in alloc.caches.items()}
    for name, found in arrays.items():
        assert len(found) == expected_arrays(model, layout, name), (name, describe(found))
        page = alloc.caches[name][0].numel() * alloc.caches[name].element_size()
        assert sum(a.block_bytes for a in found) == page * alloc.ratio, name
        assert cache_arrays(alloc.caches[name], NUM_BLOCKS, name) == found
    check_blocks(alloc, arrays)


def test_the_mla_latent_is_one_576_wide_array(make_vllm_config: VllmConfigFactory) -> None:
    config = vllm_kv_cache_config(make_vllm_config, "deepseek_v32", KVCacheLayout.LBHNC)
    alloc = allocate(config, KVCacheLayout.LBHNC, None)
    latent = alloc.caches["model.layers.0.self_attn.attn"]
    indexer = alloc.caches["model.layers.0.self_attn.indexer.k_cache"]
    assert tuple(latent.shape) == (NUM_BLOCKS, 1, BLOCK, 576) and latent.dtype == torch.bfloat16
    assert tuple(indexer.shape) == (NUM_BLOCKS, 1, BLOCK, 132) and indexer.dtype == torch.uint8
    assert block_arrays(latent, NUM_BLOCKS, "latent") == (
        ComponentDest(latent.data_ptr(), BLOCK * 576 * 2, NUM_BLOCKS),
    )
    assert block_arrays(indexer, NUM_BLOCKS, "indexer") == (
        ComponentDest(indexer.data_ptr(), BLOCK * 132, NUM_BLOCKS),
    )


def test_the_older_split_form_gives_k_and_v() -> None:
    kv = torch.zeros((2, NUM_BLOCKS, 16, 4, 64), dtype=torch.float16)
    block = 16 * 4 * 64 * 2
    expected = (
        ComponentDest(kv[0].data_ptr(), block, NUM_BLOCKS),
        ComponentDest(kv[1].data_ptr(), block, NUM_BLOCKS),
    )
    assert block_arrays(kv, NUM_BLOCKS, "kv") == expected
    assert describe(expected) == f"2 x {block} B/block"


def test_a_k_v_pair_gives_two_arrays_in_order() -> None:
    k = torch.zeros((NUM_BLOCKS, 16, 4, 64), dtype=torch.bfloat16)
    v = torch.zeros((NUM_BLOCKS, 16, 4, 32), dtype=torch.bfloat16)
    assert cache_arrays((k, v), NUM_BLOCKS, "kv") == (
        ComponentDest(k.data_ptr(), 16 * 4 * 64 * 2, NUM_BLOCKS),
        ComponentDest(v.data_ptr(), 16 * 4 * 32 * 2, NUM_BLOCKS),
    )
    with pytest.raises(ConfigError, match="expected a tensor or a tuple of tensors"):
        cache_arrays([k, "v"], NUM_BLOCKS, "kv")


@pytest.mark.parametrize("layout", BLOCK_OUTERMOST, ids=lambda x: x.name)
@pytest.mark.parametrize("model", ["llama", "deepseek_mla"])
def test_block_outermost_layouts_are_refused(
    make_vllm_config: VllmConfigFactory, model: str, layout: KVCacheLayout
) -> None:
    config = vllm_kv_cache_config(make_vllm_config, model, layout)
    with pytest.raises(ConfigError, match=f"{layout.name}.*VLLM_KV_CACHE_LAYOUT=LBHNC"):
        check_layer_compact(layout, config.kv_cache_tensors)
    # Unresolved layout: vLLM's tensor placement alone shows the layers sharing blocks.
    with pytest.raises(ConfigError, match=r"share each block.*VLLM_KV_CACHE_LAYOUT"):
        check_layer_compact(None, config.kv_cache_tensors)


def test_a_block_that_is_not_one_stripe_is_refused_naming_shape_and_strides(
    make_vllm_config: VllmConfigFactory,
) -> None:
    config = vllm_kv_cache_config(make_vllm_config, "llama", KVCacheLayout.LBHNC)
    view = allocate(config, KVCacheLayout.LBHNC, None).caches["model.layers.1.self_attn.attn"]
    strides = (view.stride(0) // 2, *view.stride()[1:])  # each block overlaps the next
    bad = view.as_strided(view.shape, strides)
    with pytest.raises(ConfigError) as info:
        block_arrays(bad, NUM_BLOCKS, "model.layers.1.self_attn.attn")
    text = str(info.value)
    assert "model.layers.1.self_attn.attn" in text
    assert f"shape {tuple(view.shape)}" in text and f"strides {strides}" in text
    # A dimension that is no multiple of the block count is named too.
    with pytest.raises(ConfigError, match=r"no dimension is a multiple of 5"):
        block_arrays(view[:, :1, :1], 5, "x")


@pytest.mark.parametrize("layout", LAYER_COMPACT, ids=lambda x: x.name)
def test_vllm_refuses_mixed_pages_in_several_groups_when_layers_are_compact(
    layout: KVCacheLayout,
) -> None:
    """Why tests/vllm/vllm_pd_harness.py's two-group case has equal pages: vLLM itself
    refuses a main group and an indexer group with different page sizes under every
    layout RD2H accepts (and accepts them when the pages are equal)."""
    [main] = llama(0).values()
    [indexer] = deepseek_v32_indexer(0).values()
    groups = [
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], main),
        KVCacheGroupSpec(["model.layers.0.self_attn.indexer.k_cache"], indexer),
    ]
    assert main.page_size_bytes != indexer.page_size_bytes
    with pytest.raises(ValueError, match="cannot express this model's mixed page sizes"):
        validate_kv_cache_layout(layout, groups)
    groups[1] = KVCacheGroupSpec(groups[1].layer_names, main)
    validate_kv_cache_layout(layout, groups)
