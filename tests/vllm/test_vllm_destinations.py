"""rd2h_vllm.destinations: provider interface, both bindings, and scatter events.

VllmCacheDestinations is tested on KV caches vLLM itself configures and allocates
(tests/vllm/vllm_pd_harness.py: ``kv_setup``, ``allocate``); the SparseKVOffloadManager
binding on a duck-typed stand-in (vllm-ascend is not installed here).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import VllmConfigFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_pd_harness import (
    BLOCK,
    FAST_METASERVER,
    INDEXER,
    INDEXER_BLOCK,
    INDEXER_BYTES,
    MAIN_BLOCK_BYTES,
    KvSetup,
    allocate,
    free_port_block,
    kv_setup,
)
from vllm_pd_harness import MAIN as VLLM_MAIN
from vllm_pd_harness import NUM_BLOCKS as VLLM_NUM_BLOCKS

from rd2h_protocol.errors import ConfigError, LayoutMismatch
from rd2h_protocol.wire.layout import ComponentDest, DestinationLayout, LayerLayout, validate_layer
from rd2h_runtime.regions import destination_regions
from rd2h_runtime.transfer import TransferBackend
from rd2h_runtime.transfer.base import merge_regions
from rd2h_runtime.transfer.loopback import LoopbackBackend
from rd2h_vllm.config import CONNECTOR_MODULE, CONNECTOR_NAME
from rd2h_vllm.connector import SfaRemoteD2HConnector
from rd2h_vllm.destinations import (
    DeviceEvents,
    SparseOffloadDestinations,
    VllmCacheDestinations,
    device_events,
    layer_number,
    match_indexer_caches,
    tensor_destination,
)
from rd2h_vllm.metadata import CacheGroups
from rd2h_vllm.worker import SingleRank, prefill_layouts, split_kv_caches

NUM_BLOCKS = 8
MAIN = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def test_layer_number() -> None:
    assert layer_number("model.layers.12.self_attn.attn") == 12
    assert layer_number("layers.3") == 3
    assert layer_number("model.layers.7.self_attn.indexer.k_cache") == 7
    assert layer_number("model.mylayers.3.attn") is None
    assert layer_number("lm_head") is None


def test_tensor_destination_reads_base_and_block_bytes() -> None:
    t = torch.zeros((NUM_BLOCKS, 4, 16), dtype=torch.bfloat16)
    dest = tensor_destination(t, NUM_BLOCKS, "k")
    assert dest == ComponentDest(t.data_ptr(), 4 * 16 * 2, NUM_BLOCKS)
    with pytest.raises(ConfigError, match="contiguous"):
        tensor_destination(t.transpose(0, 1), NUM_BLOCKS, "k")
    with pytest.raises(ConfigError, match="do not divide into 3 blocks"):
        tensor_destination(t, 3, "k")


def test_match_indexer_caches_pairs_by_layer_number() -> None:
    idx0 = torch.zeros((NUM_BLOCKS, 32), dtype=torch.uint8)
    idx2 = torch.zeros((NUM_BLOCKS, 32), dtype=torch.uint8)
    scale2 = torch.zeros((NUM_BLOCKS, 4), dtype=torch.float32)
    kv_caches = {
        MAIN[0]: torch.zeros(1),
        "model.layers.0.self_attn.indexer.k_cache": idx0,
        MAIN[1]: torch.zeros(1),
        MAIN[2]: torch.zeros(1),
        "model.layers.2.self_attn.indexer.k_cache": (idx2, scale2),
    }
    found = match_indexer_caches(kv_caches, MAIN)
    assert set(found) == {MAIN[0], MAIN[2]}
    assert found[MAIN[0]][0] is idx0 and found[MAIN[0]][1] is None
    assert found[MAIN[2]][0] is idx2 and found[MAIN[2]][1] is scale2


@pytest.mark.parametrize(
    ("kv_caches", "expected"),
    [
        ({"indexer.k_cache": torch.zeros(1)}, "matches no main layer"),
        ({"model.layers.9.indexer": torch.zeros(1)}, "matches no main layer"),
        (
            {
                "model.layers.1.a.indexer": torch.zeros(1),
                "model.layers.1.b.indexer": torch.zeros(1),
            },
            "two indexer caches",
        ),
        ({"model.layers.1.indexer": (torch.zeros(1),) * 3}, "got 3 tensors"),
    ],
)
def test_match_indexer_caches_refusals(kv_caches: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        match_indexer_caches(kv_caches, MAIN)


def fake_manager(num_layers: int = 3) -> SimpleNamespace:
    """What SparseKVOffloadManager exposes after register_kv_caches (duck-typed binding)."""
    return SimpleNamespace(
        offload_layer_names=MAIN[:num_layers],
        gvas_k_bases=[0x7F00_0000_0000 + i * 0x10_0000 for i in range(num_layers)],
        gvas_v_bases=[0x7F10_0000_0000 + i * 0x10_0000 for i in range(num_layers)],
        cpu_block_lens=[(512 * 64 * 2, 64 * 64 * 2)] * num_layers,
        kv_cache_config=SimpleNamespace(num_blocks=NUM_BLOCKS),
    )


def test_sparse_offload_binding_builds_layouts_prefill_validates() -> None:
    manager = fake_manager()
    idx = torch.zeros((NUM_BLOCKS, 64, 128), dtype=torch.uint8)
    scale = torch.zeros((NUM_BLOCKS, 64), dtype=torch.float16)
    provider = SparseOffloadDestinations(
        manager, {**dict.fromkeys(MAIN, torch.zeros(1)), "model.layers.1.indexer": (idx, scale)}
    )
    assert list(provider.layer_names) == MAIN
    assert provider.num_blocks == NUM_BLOCKS
    layouts = dict(provider.layouts())
    k_len, v_len = manager.cpu_block_lens[0]
    assert layouts[MAIN[0]] == DestinationLayout(
        main=(
            ComponentDest(manager.gvas_k_bases[0], k_len, NUM_BLOCKS),
            ComponentDest(manager.gvas_v_bases[0], v_len, NUM_BLOCKS),
        ),
    )
    assert layouts[MAIN[1]].indexer == ComponentDest(idx.data_ptr(), 64 * 128, NUM_BLOCKS)
    assert layouts[MAIN[1]].scale == ComponentDest(scale.data_ptr(), 64 * 2, NUM_BLOCKS)
    # A Prefill layout with the same block sizes passes the protocol's own check...
    src = LayerLayout(
        base_addrs=[0x1000, 0x2000, 0x3000, 0x4000],
        block_len=[k_len, v_len, 64 * 128, 64 * 2],
        tensor_group_idx=[0, 0, 1, 1],
        has_indexer=True,
    )
    main, indexer = validate_layer(MAIN[1], src, layouts[MAIN[1]])
    assert [c.name for c in main] == ["k", "v"] and [c.name for c in indexer] == [
        "indexer",
        "scale",
    ]
    # ...and one whose V blocks differ is refused naming the component.
    bad = LayerLayout(base_addrs=[1, 2], block_len=[k_len, v_len + 2], tensor_group_idx=[0, 0])
    with pytest.raises(LayoutMismatch, match="component v"):
        validate_layer(MAIN[0], bad, layouts[MAIN[0]])


def test_sparse_offload_binding_refuses_a_foreign_manager() -> None:
    with pytest.raises(ConfigError, match=r"lacks \['gvas_k_bases'"):
        SparseOffloadDestinations(SimpleNamespace(offload_layer_names=MAIN), {})
    manager = fake_manager()
    manager.gvas_v_bases = manager.gvas_v_bases[:2]
    with pytest.raises(ConfigError, match=r"describes 3 layers but has \{'gvas_v_bases': 2\}"):
        SparseOffloadDestinations(manager, {})


# -- vLLM's own KV cache ---------------------------------------------------------------------


def vllm_caches(
    make_vllm_config: VllmConfigFactory, indexer: str
) -> tuple[KvSetup, dict[str, torch.Tensor]]:
    """vLLM's KV-cache configuration for ``indexer`` and one worker's caches, as vLLM
    allocates them."""
    setup = kv_setup(make_vllm_config(), indexer)
    return setup, allocate(setup.workers[0])


@pytest.mark.parametrize("indexer", ["none", "shared", "group"])
def test_vllm_cache_destinations_are_vllms_own_blocks(
    make_vllm_config: VllmConfigFactory, indexer: str
) -> None:
    setup, caches = vllm_caches(make_vllm_config, indexer)
    num_blocks = setup.workers[0].num_blocks
    provider = VllmCacheDestinations(split_kv_caches(caches, num_blocks), num_blocks)
    # Every TP rank has its own KV cache: each reads all main blocks of its requests.
    assert provider.main_shared is False
    assert list(provider.layer_names) == VLLM_MAIN
    assert provider.num_blocks == num_blocks == VLLM_NUM_BLOCKS
    idx_page = (BLOCK if indexer == "shared" else INDEXER_BLOCK) * INDEXER_BYTES
    for layer, name in enumerate(VLLM_MAIN):
        layout = provider.layout(name)
        # ONE block array per layer (K and V side by side), at vLLM's view of the layer.
        assert layout.main == (
            ComponentDest(caches[name].data_ptr(), MAIN_BLOCK_BYTES, VLLM_NUM_BLOCKS),
        )
        if indexer == "none":
            assert layout.indexer is None
        else:
            view = caches[INDEXER[layer]]
            assert layout.indexer == ComponentDest(view.data_ptr(), idx_page, VLLM_NUM_BLOCKS)
        assert layout.scale is None
        # Block b of each destination is block b of vLLM's view (what attention reads).
        for block in (0, 1, VLLM_NUM_BLOCKS - 1):
            main = layout.main[0]
            assert main.base + block * main.block_bytes == caches[name][block].data_ptr()
    assert provider.layouts() == [(name, provider.layout(name)) for name in VLLM_MAIN]


def test_a_prefill_of_the_same_model_validates_and_a_v1_peer_is_refused(
    make_vllm_config: VllmConfigFactory,
) -> None:
    setup, decode_caches = vllm_caches(make_vllm_config, "group")
    _, prefill_caches = vllm_caches(make_vllm_config, "group")
    config = setup.workers[0]
    groups = CacheGroups.from_kv_cache_config(config)
    provider = VllmCacheDestinations(
        split_kv_caches(decode_caches, config.num_blocks), config.num_blocks
    )
    sources = dict(
        prefill_layouts(
            split_kv_caches(prefill_caches, config.num_blocks), groups, config.num_blocks
        )
    )
    for name in VLLM_MAIN:
        main, indexer = validate_layer(name, sources[name], provider.layout(name))
        assert [c.name for c in main] == ["kv"] and [c.name for c in indexer] == ["indexer"]
        assert main[0].dst_base == decode_caches[name].data_ptr()
        assert main[0].src_base == prefill_caches[name].data_ptr()
    # A v1 Prefill sends K and V as two components: refused naming both counts.
    half = MAIN_BLOCK_BYTES // 2
    v1 = LayerLayout(base_addrs=[0x1000, 0x2000], block_len=[half, half], tensor_group_idx=[0, 0])
    with pytest.raises(LayoutMismatch, match=r"main_tensor_count.*2.*1"):
        validate_layer(VLLM_MAIN[0], v1, DestinationLayout(main=provider.main(VLLM_MAIN[0])))


def test_vllm_cache_destinations_need_a_layer() -> None:
    with pytest.raises(ConfigError, match="no cache-bearing layer"):
        VllmCacheDestinations([], VLLM_NUM_BLOCKS)


def test_a_real_read_lands_in_vllms_cache_blocks(make_vllm_config: VllmConfigFactory) -> None:
    """Prefill's vLLM caches -> loopback read at the provider's addresses -> the blocks of
    Decode's vLLM caches, and nothing else."""
    setup, decode_caches = vllm_caches(make_vllm_config, "shared")
    _, prefill_caches = vllm_caches(make_vllm_config, "shared")
    config = setup.workers[0]
    nb = config.num_blocks
    groups = CacheGroups.from_kv_cache_config(config)
    provider = VllmCacheDestinations(split_kv_caches(decode_caches, nb), nb)
    name, idx_name = VLLM_MAIN[1], INDEXER[1]
    for cache in (prefill_caches[name], prefill_caches[idx_name]):
        cache.view(torch.uint8).copy_(torch.randint_like(cache.view(torch.uint8), 0, 255))
    [(_, src)] = [
        (n, lay)
        for n, lay in prefill_layouts(split_kv_caches(prefill_caches, nb), groups, nb)
        if n == name
    ]
    main, indexer = validate_layer(name, src, provider.layout(name))
    p_ids, d_ids = [0, 1, 3], [5, 2, 7]
    remote, local, lengths = [], [], []
    for comp in (*main, *indexer):
        for p, d in zip(p_ids, d_ids, strict=True):
            remote.append(comp.src_base + p * comp.block_bytes)
            local.append(comp.dst_base + d * comp.block_bytes)
            lengths.append(comp.block_bytes)
    with (
        LoopbackBackend(role="prefill") as prefill,
        LoopbackBackend(role="decode") as decode,
    ):
        prefill.register(
            [(t.data_ptr(), t.numel() * t.element_size()) for t in prefill_caches.values()]
        )
        decode.register(destination_regions(provider.layouts()))
        decode.read(prefill.session_id, remote, local, lengths, timeout_s=10)
    for layer in (name, idx_name):
        dest, source = decode_caches[layer], prefill_caches[layer]
        for p, d in zip(p_ids, d_ids, strict=True):
            assert torch.equal(dest[d].view(torch.uint8), source[p].view(torch.uint8)), (
                layer,
                p,
                d,
            )
        untouched = [b for b in range(nb) if b not in d_ids]
        assert not torch.any(dest[untouched].view(torch.uint8) != 0).item()
    for other in (VLLM_MAIN[0], INDEXER[0]):  # the other layer was not touched
        assert not torch.any(decode_caches[other].view(torch.uint8) != 0).item()


@pytest.mark.parametrize("indexer", ["none", "shared", "group"])
def test_decode_registers_exactly_its_vllm_cache(
    make_vllm_config: VllmConfigFactory, indexer: str
) -> None:
    """Decode's backend registers vLLM's KV cache allocation, nothing else (the groups of
    the "group" case alias one allocation: their regions merge)."""
    vllm_config = make_vllm_config(
        {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_consumer",
            "kv_port": free_port_block(1),
            "kv_connector_extra_config": {"transfer_backend": "nixl", **FAST_METASERVER},
        }
    )
    setup = kv_setup(vllm_config, indexer)
    caches = allocate(setup.workers[0])
    connector = LoopbackDecode(vllm_config, KVConnectorRole.WORKER, setup.workers[0])
    connector.bind_tp_group(SingleRank())
    try:
        connector.register_kv_caches(caches)
        provider = connector.destinations
        assert isinstance(provider, VllmCacheDestinations)
        assert connector.decode is not None
        registered = connector.decode.worker.backend.registered
        [storage] = {t.untyped_storage().data_ptr() for t in caches.values()}
        size = setup.workers[0].kv_cache_tensors[0].size  # vLLM's one backing allocation
        assert registered == [(storage, size)]
        assert registered == merge_regions(destination_regions(provider.layouts()))
    finally:
        connector.shutdown()


class LoopbackDecode(SfaRemoteD2HConnector):
    """The real connector on the in-process loopback backend."""

    def create_backend(self, role: str) -> TransferBackend:
        return LoopbackBackend(role=role, host="127.0.0.1")


def test_cpu_scatter_events_are_done_when_recorded() -> None:
    events = device_events("cpu")
    assert isinstance(events, DeviceEvents) and events.device_type == "cpu"
    event = events.record()
    assert event.query() is True
    event.synchronize()


def test_cuda_events_use_torch_cuda_events() -> None:
    events = device_events("cuda")
    assert events.device_type == "cuda"
    assert events._event_cls is torch.cuda.Event


def test_npu_events_need_torch_npu_and_unknown_devices_are_refused() -> None:
    try:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="needs torch_npu"):
            device_events("npu")
    else:  # on an Ascend host the binding must resolve the real class
        assert device_events("npu").device_type == "npu"
    with pytest.raises(ConfigError, match="use npu, cuda or cpu"):
        device_events("tpu")
