"""rd2h_vllm.destinations: provider interface, both bindings, and scatter events."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rd2h_protocol.errors import ConfigError, LayoutMismatch
from rd2h_protocol.layout import ComponentDest, DestinationLayout, LayerLayout, validate_layer
from rd2h_runtime.transfer.loopback import LoopbackBackend
from rd2h_vllm.destinations import (
    DeviceEvents,
    HostPoolDestinations,
    LayerSpec,
    SparseOffloadDestinations,
    device_events,
    layer_number,
    match_indexer_caches,
    tensor_destination,
)

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
        k=ComponentDest(manager.gvas_k_bases[0], k_len, NUM_BLOCKS),
        v=ComponentDest(manager.gvas_v_bases[0], v_len, NUM_BLOCKS),
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


SPECS = [
    LayerSpec(MAIN[0], k_block_bytes=256, v_block_bytes=64),
    LayerSpec(MAIN[1], k_block_bytes=256, v_block_bytes=64, indexer_block_bytes=32),
    LayerSpec(
        MAIN[2], k_block_bytes=256, v_block_bytes=64, indexer_block_bytes=32, scale_block_bytes=8
    ),
]


def test_host_pool_layouts_match_its_tensors() -> None:
    pool = HostPoolDestinations(SPECS, NUM_BLOCKS)
    assert pool.pinned is torch.cuda.is_available()
    for spec in SPECS:
        layout = pool.layout(spec.name)
        assert layout.k == ComponentDest(pool.tensor(spec.name, "k").data_ptr(), 256, NUM_BLOCKS)
        assert layout.v == ComponentDest(pool.tensor(spec.name, "v").data_ptr(), 64, NUM_BLOCKS)
        assert (layout.indexer is None) == (spec.indexer_block_bytes is None)
        assert (layout.scale is None) == (spec.scale_block_bytes is None)
        assert pool.tensor(spec.name, "k").shape == (NUM_BLOCKS, 256)
    # Main components are disjoint stripes of one pool.
    spans = sorted(
        (d.base, d.base + d.block_bytes * d.num_blocks)
        for name in pool.layer_names
        for d in pool.main(name)
    )
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    pool.close()


@pytest.mark.parametrize(
    ("layers", "num_blocks", "expected"),
    [
        (SPECS, 0, "at least one block"),
        ([], 4, "at least one layer"),
        ([SPECS[0], SPECS[0]], 4, "unique"),
    ],
)
def test_host_pool_refusals(layers: list[LayerSpec], num_blocks: int, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        HostPoolDestinations(layers, num_blocks)


def test_layer_spec_refusals() -> None:
    with pytest.raises(ConfigError, match=">= 1"):
        LayerSpec("x", k_block_bytes=0, v_block_bytes=1)
    with pytest.raises(ConfigError, match="needs an indexer"):
        LayerSpec("x", k_block_bytes=1, v_block_bytes=1, scale_block_bytes=4)


def test_a_real_read_lands_in_the_host_pool_blocks() -> None:
    """Prefill tensors -> loopback read at the provider's addresses -> pool tensors."""
    pool = HostPoolDestinations(SPECS, NUM_BLOCKS)
    name = MAIN[2]
    layout = pool.layout(name)
    src = {
        "k": torch.randint(0, 255, (4, 256), dtype=torch.uint8),
        "v": torch.randint(0, 255, (4, 64), dtype=torch.uint8),
        "indexer": torch.randint(0, 255, (4, 32), dtype=torch.uint8),
        "scale": torch.randint(0, 255, (4, 8), dtype=torch.uint8),
    }
    prefill_layout = LayerLayout(
        base_addrs=[src[c].data_ptr() for c in ("k", "v", "indexer", "scale")],
        block_len=[256, 64, 32, 8],
        tensor_group_idx=[0, 0, 1, 1],
        has_indexer=True,
    )
    main, indexer = validate_layer(name, prefill_layout, layout)
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
        prefill.register([(t.data_ptr(), t.numel()) for t in src.values()])
        dests = [layout.k, layout.v, layout.indexer, layout.scale]
        decode.register([(d.base, d.block_bytes * d.num_blocks) for d in dests if d is not None])
        decode.read(prefill.session_id, remote, local, lengths, timeout_s=10)
    for component, tensor in src.items():
        dest = pool.tensor(name, component)
        for p, d in zip(p_ids, d_ids, strict=True):
            assert torch.equal(dest[d], tensor[p]), (component, p, d)
        untouched = [b for b in range(NUM_BLOCKS) if b not in d_ids]
        assert int(dest[untouched].sum()) == 0
    pool.close()


def test_shared_host_pool_is_one_pool_across_processes(tmp_path: Path) -> None:
    """Two TP ranks (processes) map one pool: what rank 1 writes, rank 0 reads."""
    path = tmp_path / "rd2h-pool"
    rank0 = HostPoolDestinations(SPECS, NUM_BLOCKS, shared_path=path)
    child = textwrap.dedent(
        f"""
        import ctypes, sys
        from rd2h_vllm.destinations import HostPoolDestinations, LayerSpec
        specs = [LayerSpec(n, k_block_bytes=k, v_block_bytes=v, indexer_block_bytes=i,
                           scale_block_bytes=s) for n, k, v, i, s in {
            [
                (
                    s.name,
                    s.k_block_bytes,
                    s.v_block_bytes,
                    s.indexer_block_bytes,
                    s.scale_block_bytes,
                )
                for s in SPECS
            ]
        }]
        rank1 = HostPoolDestinations(specs, {NUM_BLOCKS}, shared_path={str(path)!r})
        k, v = rank1.main({MAIN[1]!r})
        # Rank 1 writes its share (block 6 of K) through ITS OWN address of the pool.
        ctypes.memset(k.base + 6 * k.block_bytes, 0xAB, k.block_bytes)
        idx, _ = rank1.indexer({MAIN[1]!r})
        ctypes.memset(idx.base, 0xCD, idx.block_bytes)  # rank-local: rank 0 must not see it
        rank1.close()
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=50)
    k_view = rank0.tensor(MAIN[1], "k")
    assert bool((k_view[6] == 0xAB).all())
    assert int(k_view[:6].sum()) == 0 and int(k_view[7:].sum()) == 0
    assert int(rank0.tensor(MAIN[1], "indexer").sum()) == 0
    rank0.close(unlink=True)
    assert not path.exists()


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
