"""Layer layouts: the MF_META inner payload (§1), layout checks and storage slots (§2)."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rd2h_protocol.errors import (
    ErrorCode,
    FrameTooLarge,
    LayoutMismatch,
    LocalProtocolError,
    MalformedFrame,
    RemoteProtocolError,
    ValueOutOfRange,
)
from rd2h_protocol.plan import ComponentAddrs
from rd2h_protocol.wire.layout import (
    MAX_LAYERS,
    MAX_NUM_BLOCKS,
    ComponentDest,
    DestinationLayout,
    InvalidLayout,
    LayerLayout,
    assign_storage_slots,
    check_destination_range,
    check_source_blocks,
    decode_layer_metadata,
    encode_layer_metadata,
    validate_layer,
)
from rd2h_protocol.wire.messages import MAX_FRAME_BYTES

K_BASE, V_BASE, IDX_BASE, SCALE_BASE = 0x7F00_0000_0000, 0x7F10_0000_0000, 0x100_0000, 0x200_0000


def _layout(tensors: int = 4, **overrides: Any) -> LayerLayout:
    """A layer with K, V and optionally indexer and scale (kernel block 64 tokens, scale 2)."""
    fields: dict[str, Any] = {
        "base_addrs": [K_BASE, V_BASE, IDX_BASE, SCALE_BASE][:tensors],
        "block_len": [512, 64, 128, 4][:tensors],
        "block_size_scale": [2, 2, 2, 2][:tensors],
        "tensor_group_idx": [0, 0, 1, 1][:tensors],
    }
    fields.update(overrides)
    return LayerLayout(**fields)


def _v1_dict(**overrides: Any) -> dict[str, Any]:
    """A layout value exactly as a v1 Prefill builds it (keys in v1 order)."""
    value: dict[str, Any] = {
        "base_addrs": [K_BASE, V_BASE, IDX_BASE],
        "block_len": [512, 64, 128],
        "block_size_scale": [2, 2, 2],
        "tensor_group_idx": [0, 0, 1],
        "main_tensor_count": 2,
        "has_indexer": True,
    }
    value.update(overrides)
    return value


def _dest(tensors: int = 4, **overrides: ComponentDest | None) -> DestinationLayout:
    parts: dict[str, ComponentDest | None] = {
        "k": ComponentDest(0x1000, 1024, 50),
        "v": ComponentDest(0x2000, 128, 50),
        "indexer": ComponentDest(0x3000, 256, 50) if tensors > 2 else None,
        "scale": ComponentDest(0x4000, 8, 50) if tensors > 3 else None,
    }
    parts.update(overrides)
    k, v = parts.pop("k"), parts.pop("v")
    assert k is not None and v is not None
    return DestinationLayout(main=(k, v), **parts)


# -- MF_META inner payload: fields, defaults, derived sizes --------------------------------


def test_block_bytes_is_block_len_times_block_size_scale() -> None:
    layout = _layout()
    assert [layout.block_bytes(i) for i in range(4)] == [1024, 128, 256, 8]
    assert layout.main_block_bytes == (1024, 128)
    assert layout.indexer_block_bytes == 256
    assert layout.scale_block_bytes == 8


def test_missing_block_size_scale_defaults_to_all_one() -> None:
    blob = msgpack.packb({"l0": {k: v for k, v in _v1_dict().items() if k != "block_size_scale"}})
    layout = decode_layer_metadata(blob)["l0"]
    assert layout.block_size_scale == [1, 1, 1]
    assert layout.main_block_bytes == (512, 64)


def test_missing_main_tensor_count_defaults_to_two() -> None:
    value = {k: v for k, v in _v1_dict().items() if k != "main_tensor_count"}
    layout = decode_layer_metadata(msgpack.packb({"l0": value}))["l0"]
    assert layout.main_tensor_count == 2
    assert layout.main_bases == (K_BASE, V_BASE)


@pytest.mark.parametrize(("tensors", "expected"), [(2, False), (3, True), (4, True)])
def test_missing_has_indexer_defaults_to_more_tensors_than_main(
    tensors: int, expected: bool
) -> None:
    value = {
        "base_addrs": [K_BASE, V_BASE, IDX_BASE, SCALE_BASE][:tensors],
        "block_len": [1] * tensors,
        "tensor_group_idx": [0] * tensors,
    }
    layout = decode_layer_metadata(msgpack.packb({"l0": value}))["l0"]
    assert layout.has_indexer is expected
    assert layout.has_indexer_tensor is expected


def test_scale_present_iff_more_than_main_plus_one_tensors() -> None:
    assert not _layout(2).has_scale
    assert not _layout(3).has_scale
    assert _layout(4).has_scale
    assert _layout(3).scale_block_bytes is None
    assert _layout(2).indexer_block_bytes is None


def test_bases_and_groups_split_main_from_indexer() -> None:
    full = _layout(4)
    assert full.main_bases == (K_BASE, V_BASE)
    assert full.indexer_bases == (IDX_BASE, SCALE_BASE)
    assert (full.main_group, full.indexer_group) == (0, 1)
    main_only = _layout(2)
    assert main_only.indexer_bases == ()
    assert main_only.indexer_group is None


# -- construction checks ------------------------------------------------------------------


@pytest.mark.parametrize("key", ["block_len", "block_size_scale", "tensor_group_idx"])
def test_lists_must_match_base_addrs_length(key: str) -> None:
    with pytest.raises(InvalidLayout, match=f"^{key}: expected 3 entries") as info:
        _layout(3, **{key: [1, 1]})
    assert info.value.key == key
    assert info.value.code == ErrorCode.MALFORMED


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("base_addrs", [-1, 0]),
        ("base_addrs", [1 << 64, 0]),
        ("block_len", [0, 1]),
        ("block_size_scale", [1, 0]),
        ("tensor_group_idx", [0, 1 << 16]),
    ],
)
def test_list_entries_must_be_in_range(key: str, bad: list[int]) -> None:
    fields: dict[str, Any] = {
        "base_addrs": [1, 2],
        "block_len": [1, 1],
        "tensor_group_idx": [0, 0],
        key: bad,
    }
    with pytest.raises(InvalidLayout, match=f"^{key}: entry") as info:
        LayerLayout(**fields)
    assert info.value.code == ErrorCode.OUT_OF_RANGE


@pytest.mark.parametrize("count", [0, 17])
def test_main_tensor_count_must_be_in_range(count: int) -> None:
    with pytest.raises(InvalidLayout, match=r"^main_tensor_count"):
        _layout(2, main_tensor_count=count, has_indexer=False)


@pytest.mark.parametrize("tensors", [1, 5])
def test_base_addrs_hold_main_plus_at_most_indexer_and_scale(tensors: int) -> None:
    with pytest.raises(InvalidLayout, match=f"^base_addrs: .* got {tensors}"):
        LayerLayout(
            base_addrs=list(range(tensors)),
            block_len=[1] * tensors,
            tensor_group_idx=[0] * tensors,
        )


@pytest.mark.parametrize(("tensors", "flag"), [(2, True), (3, False)])
def test_has_indexer_must_agree_with_tensors(tensors: int, flag: bool) -> None:
    with pytest.raises(InvalidLayout, match=r"^has_indexer"):
        _layout(tensors, has_indexer=flag)


def test_num_blocks_must_be_in_range() -> None:
    assert _layout(num_blocks=MAX_NUM_BLOCKS).num_blocks == MAX_NUM_BLOCKS
    with pytest.raises(InvalidLayout, match=r"^num_blocks: expected") as info:
        _layout(num_blocks=-1)
    assert info.value.code == ErrorCode.OUT_OF_RANGE


def test_num_blocks_must_keep_tensors_inside_address_space() -> None:
    top = (1 << 64) - 1024  # exactly one 1024-byte block fits below 2**64
    assert _layout(2, base_addrs=[top, 0], num_blocks=1).num_blocks == 1
    with pytest.raises(InvalidLayout, match=r"^num_blocks: tensor 0"):
        _layout(2, base_addrs=[top, 0], num_blocks=2)


# -- encode -------------------------------------------------------------------------------


def test_encode_v1_shape_equals_v1_prefill_bytes() -> None:
    """Without num_blocks our blob is byte for byte what a v1 Prefill sends."""
    layers = {"model.layers.0.self_attn": _layout(3), "model.layers.1.self_attn": _layout(2)}
    v1 = {
        "model.layers.0.self_attn": _v1_dict(),
        "model.layers.1.self_attn": _v1_dict(
            base_addrs=[K_BASE, V_BASE],
            block_len=[512, 64],
            block_size_scale=[2, 2],
            tensor_group_idx=[0, 0],
            has_indexer=False,
        ),
    }
    assert encode_layer_metadata(layers) == msgpack.packb(v1)


def test_encode_keys_in_v1_order_then_num_blocks() -> None:
    blob = encode_layer_metadata({"l0": _layout(4, num_blocks=77)})
    value = msgpack.unpackb(blob)["l0"]
    assert list(value) == [
        "base_addrs",
        "block_len",
        "block_size_scale",
        "tensor_group_idx",
        "main_tensor_count",
        "has_indexer",
        "num_blocks",
    ]
    assert value["num_blocks"] == 77


def test_v1_decode_accepts_our_output() -> None:
    """A v1 Decode reads our blob with plain msgpack and key lookups."""
    blob = encode_layer_metadata({"l0": _layout(4, num_blocks=9)})
    meta = msgpack.unpackb(blob)["l0"]
    block_bytes = [n * s for n, s in zip(meta["block_len"], meta["block_size_scale"], strict=True)]
    assert meta["base_addrs"] == [K_BASE, V_BASE, IDX_BASE, SCALE_BASE]
    assert block_bytes == [1024, 128, 256, 8]
    assert meta["main_tensor_count"] == 2 and meta["has_indexer"] is True
    assert len(meta["base_addrs"]) > meta["main_tensor_count"] + 1  # scale present


def test_encode_rechecks_mutated_layout_and_names_the_layer() -> None:
    layout = _layout(3)
    layout.block_len.append(1)
    with pytest.raises(InvalidLayout, match=r"^block_len: layer 'model.layers.3'"):
        encode_layer_metadata({"model.layers.3": layout})


def test_encode_refuses_too_many_layers_and_long_names() -> None:
    layout = _layout(2)
    with pytest.raises(LocalProtocolError, match="layers exceed"):
        encode_layer_metadata({str(i): layout for i in range(MAX_LAYERS + 1)})
    with pytest.raises(LocalProtocolError, match="layer name of 5000"):
        encode_layer_metadata({"x" * 5000: layout})


# -- decode -------------------------------------------------------------------------------


def test_decode_round_trips_v1_and_v2() -> None:
    layers = {"a": _layout(2), "b": _layout(3), "c": _layout(4, num_blocks=1000)}
    assert decode_layer_metadata(encode_layer_metadata(layers)) == layers


def test_decode_v1_blob_has_no_num_blocks() -> None:
    layout = decode_layer_metadata(msgpack.packb({"l0": _v1_dict()}))["l0"]
    assert layout.num_blocks is None
    assert layout == _layout(3)


def test_decode_ignores_unknown_keys() -> None:
    blob = msgpack.packb({"l0": _v1_dict(future_key=[1, 2, 3])})
    assert decode_layer_metadata(blob)["l0"] == _layout(3)


def test_decode_accepts_full_uint64_addresses() -> None:
    top = (1 << 64) - 1
    value = _v1_dict(base_addrs=[top, top - 1], block_len=[1, 1])
    value.update(block_size_scale=[1, 1], tensor_group_idx=[0, 0], has_indexer=False)
    assert decode_layer_metadata(msgpack.packb({"l0": value}))["l0"].main_bases == (top, top - 1)


@pytest.mark.parametrize(
    ("blob", "error", "match"),
    [
        (b"\xc1", MalformedFrame, "undecodable msgpack"),
        (msgpack.packb([1, 2]), MalformedFrame, "Expected `object`, got `array`"),
        (msgpack.packb({1: _v1_dict()}), MalformedFrame, "Expected `str`"),
        (msgpack.packb({"x" * 5000: _v1_dict()}), FrameTooLarge, "length <= 4096"),
        (msgpack.packb({"l0": 5}), MalformedFrame, "^layer 'l0': Expected `object`"),
        (msgpack.packb({"l0": {}}), MalformedFrame, "missing required field `base_addrs`"),
        (
            msgpack.packb({"l0": _v1_dict(block_len=[0, 1, 1])}),
            ValueOutOfRange,
            r"^layer 'l0': Expected `int` >= 1 - at `\$.block_len\[0\]`",
        ),
        (
            msgpack.packb({"l0": _v1_dict(num_blocks=1 << 40)}),
            ValueOutOfRange,
            "num_blocks",
        ),
        (
            msgpack.packb({"l0": _v1_dict(block_len=[1] * 19)}),
            FrameTooLarge,
            "length <= 18",
        ),
        (
            msgpack.packb({"l0": _v1_dict(tensor_group_idx=[0, 0])}),
            MalformedFrame,
            "^layer 'l0': tensor_group_idx: expected 3 entries",
        ),
        (
            msgpack.packb({"l0": _v1_dict(has_indexer=False)}),
            MalformedFrame,
            "^layer 'l0': has_indexer",
        ),
        (
            msgpack.packb({"l0": _v1_dict(base_addrs=[(1 << 64) - 1, 0, 0], num_blocks=2)}),
            ValueOutOfRange,
            "^layer 'l0': num_blocks: tensor 0",
        ),
    ],
    ids=[
        "not-msgpack",
        "not-a-map",
        "non-str-layer-name",
        "long-layer-name",
        "value-not-a-map",
        "missing-base-addrs",
        "block-len-zero",
        "num-blocks-too-big",
        "too-many-tensors",
        "inconsistent-lengths",
        "has-indexer-disagrees",
        "tensor-past-address-space",
    ],
)
def test_decode_refuses_malformed_blobs(
    blob: bytes, error: type[RemoteProtocolError], match: str
) -> None:
    with pytest.raises(error, match=match):
        decode_layer_metadata(blob)


def test_decode_bounds_layer_count_and_blob_size() -> None:
    layer = _v1_dict()
    with pytest.raises(FrameTooLarge, match="length <= 4096"):
        decode_layer_metadata(msgpack.packb({str(i): layer for i in range(MAX_LAYERS + 1)}))
    with pytest.raises(FrameTooLarge, match="bytes exceeds"):
        decode_layer_metadata(bytes(MAX_FRAME_BYTES + 1))


# Room at the top so that 16 blocks of the largest block still end inside 2**64.
_addr = st.integers(0, (1 << 64) - (1 << 31))


@st.composite
def layouts(draw: st.DrawFn) -> LayerLayout:
    tensors = draw(st.integers(2, 4))
    n_list = st.lists
    return LayerLayout(
        base_addrs=draw(n_list(_addr, min_size=tensors, max_size=tensors)),
        block_len=draw(n_list(st.integers(1, 1 << 20), min_size=tensors, max_size=tensors)),
        block_size_scale=draw(
            st.none() | n_list(st.integers(1, 64), min_size=tensors, max_size=tensors)
        ),
        tensor_group_idx=draw(n_list(st.integers(0, 3), min_size=tensors, max_size=tensors)),
        num_blocks=draw(st.none() | st.integers(0, 16)),
    )


@given(st.dictionaries(st.text(max_size=40), layouts(), max_size=6))
def test_encode_decode_round_trip(layers: dict[str, LayerLayout]) -> None:
    assert decode_layer_metadata(encode_layer_metadata(layers)) == layers


@given(st.binary(max_size=512))
def test_decode_of_random_bytes_raises_only_remote_errors(blob: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_layer_metadata(blob)


_json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@given(
    layers=st.dictionaries(st.text(max_size=10), layouts(), min_size=1, max_size=3),
    key=st.sampled_from(
        [
            "base_addrs",
            "block_len",
            "block_size_scale",
            "tensor_group_idx",
            "main_tensor_count",
            "has_indexer",
            "num_blocks",
        ]
    ),
    value=_json_like,
)
def test_decode_of_mutated_blobs_raises_only_remote_errors(
    layers: dict[str, LayerLayout], key: str, value: object
) -> None:
    body = msgpack.unpackb(encode_layer_metadata(layers))
    name = next(iter(body))
    body[name][key] = value
    try:
        decoded = decode_layer_metadata(msgpack.packb(body))
    except RemoteProtocolError as exc:
        assert f"layer {name!r}" in exc.message  # the error names the layer
    else:
        # Whatever we accept, we can send on unchanged.
        assert decode_layer_metadata(encode_layer_metadata(decoded)) == decoded


@given(
    layers=st.dictionaries(st.text(max_size=10), layouts(), min_size=1, max_size=3),
    data=st.data(),
)
def test_decode_of_corrupted_bytes_raises_only_remote_errors(
    layers: dict[str, LayerLayout], data: st.DataObject
) -> None:
    blob = bytearray(encode_layer_metadata(layers))
    pos = data.draw(st.integers(0, len(blob) - 1))
    blob[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    with contextlib.suppress(RemoteProtocolError):
        decode_layer_metadata(bytes(blob[:cut]))


# -- layout checks before any byte moves ---------------------------------------------------


def test_validate_layer_returns_main_then_indexer_and_scale() -> None:
    main, indexer = validate_layer("l5", _layout(4), _dest(4))
    assert main == (
        ComponentAddrs("k", K_BASE, 0x1000, 1024),
        ComponentAddrs("v", V_BASE, 0x2000, 128),
    )
    assert indexer == (
        ComponentAddrs("indexer", IDX_BASE, 0x3000, 256),
        ComponentAddrs("scale", SCALE_BASE, 0x4000, 8),
    )


def test_validate_layer_without_indexer_or_scale() -> None:
    assert validate_layer("l5", _layout(2), _dest(2))[1] == ()
    main, indexer = validate_layer("l5", _layout(3), _dest(3))
    assert [c.name for c in indexer] == ["indexer"]
    assert len(main) == 2


def test_combined_kv_layout_validates_one_main_component() -> None:
    # vLLM 0.32's caches: one block array holds K and V side by side (or an MLA latent).
    src = LayerLayout(
        base_addrs=[K_BASE, IDX_BASE],
        block_len=[4096, 256],
        tensor_group_idx=[0, 1],
        main_tensor_count=1,
    )
    assert src.has_indexer and not src.has_scale
    dst = DestinationLayout(
        main=(ComponentDest(0x1000, 4096, 50),), indexer=ComponentDest(0x3000, 256, 50)
    )
    main, indexer = validate_layer("model.layers.3", src, dst)
    assert main == (ComponentAddrs("kv", K_BASE, 0x1000, 4096),)
    assert indexer == (ComponentAddrs("indexer", IDX_BASE, 0x3000, 256),)
    # It round-trips through the MF_META inner blob with its count.
    assert decode_layer_metadata(encode_layer_metadata({"l": src}))["l"] == src


def test_v1_split_kv_peer_against_a_combined_destination_is_refused() -> None:
    # A v1 Prefill (K and V as two tensors) must not write half-blocks into one KV block.
    src = _layout(2)
    combined = DestinationLayout(main=(ComponentDest(0x1000, 1024 + 128, 50),))
    with pytest.raises(LayoutMismatch) as info:
        validate_layer("model.layers.0", src, combined)
    assert (info.value.component, info.value.prefill, info.value.decode) == (
        "main_tensor_count",
        2,
        1,
    )
    assert "Prefill has 2, Decode has 1" in str(info.value)


def test_destination_layout_needs_main_and_an_indexer_under_a_scale() -> None:
    with pytest.raises(LocalProtocolError, match="main components"):
        DestinationLayout(main=())
    with pytest.raises(LocalProtocolError, match="scale needs an indexer"):
        DestinationLayout(main=(ComponentDest(0, 1, 1),), scale=ComponentDest(0, 1, 1))


def test_layout_check_main_tensor_count_two() -> None:
    src = LayerLayout(
        base_addrs=[1, 2, 3], block_len=[1] * 3, tensor_group_idx=[0] * 3, main_tensor_count=3
    )
    with pytest.raises(LayoutMismatch) as info:
        validate_layer("l1", src, _dest(2))
    assert (info.value.layer, info.value.component) == ("l1", "main_tensor_count")
    assert (info.value.prefill, info.value.decode) == (3, 2)


@pytest.mark.parametrize(
    ("component", "dest", "prefill", "decode"),
    [
        ("k", {"k": ComponentDest(0x1000, 512, 50)}, 1024, 512),
        ("v", {"v": ComponentDest(0x2000, 64, 50)}, 128, 64),
        ("indexer", {"indexer": ComponentDest(0x3000, 128, 50)}, 256, 128),
        ("scale", {"scale": ComponentDest(0x4000, 4, 50)}, 8, 4),
        ("indexer", {"indexer": None, "scale": None}, "present", "absent"),
        ("scale", {"scale": None}, "present", "absent"),
    ],
    ids=[
        "k-length",
        "v-length",
        "indexer-length",
        "scale-length",
        "indexer-presence",
        "scale-presence",
    ],
)
def test_layout_check_lengths_and_presence_equal(
    component: str, dest: dict[str, ComponentDest | None], prefill: object, decode: object
) -> None:
    with pytest.raises(LayoutMismatch) as info:
        validate_layer("model.layers.7", _layout(4), _dest(4, **dest))
    err = info.value
    assert (err.layer, err.component, err.prefill, err.decode) == (
        "model.layers.7",
        component,
        prefill,
        decode,
    )
    assert err.code == ErrorCode.LAYOUT_MISMATCH


def test_layout_check_decode_has_extra_indexer_or_scale() -> None:
    with pytest.raises(LayoutMismatch, match="indexer: Prefill has 'absent'"):
        validate_layer("l", _layout(2), _dest(3))
    with pytest.raises(LayoutMismatch, match="scale: Prefill has 'absent'"):
        validate_layer("l", _layout(3), _dest(4))


# -- destination ranges and source ids ----------------------------------------------------


def test_decode_destination_must_fit_allocation() -> None:
    assert check_destination_range("r1", "main", 3, 4, 7) == (3, 7)
    assert check_destination_range("r1", "main", 7, 0, 7) == (7, 7)
    with pytest.raises(ValueOutOfRange, match=r"'r1', indexer: blocks \[5, 8\)") as info:
        check_destination_range("r1", "indexer", 5, 3, 7)
    assert info.value.code == ErrorCode.DESTINATION_RANGE


@pytest.mark.parametrize(("start", "count"), [(-1, 2), (0, -1)])
def test_decode_destination_refuses_negative_offsets(start: int, count: int) -> None:
    with pytest.raises(ValueOutOfRange):
        check_destination_range("r1", "main", start, count, 10)


def test_source_block_ids_must_lie_in_num_blocks() -> None:
    check_source_blocks("l0", "main", [0, 5, 9], 10)
    check_source_blocks("l0", "main", [10**9], None)  # v1 layout: nothing to check against
    with pytest.raises(ValueOutOfRange, match=r"'l0', indexer: Prefill block id 10 .*\[0, 10\)"):
        check_source_blocks("l0", "indexer", [0, 10], 10)


# -- storage slots ------------------------------------------------------------------------


def test_storage_slots_first_seen_order_one_numbering() -> None:
    a = _layout(3, base_addrs=[1, 2, 3])
    b = _layout(3, base_addrs=[4, 5, 6])
    no_idx = _layout(2, base_addrs=[7, 8])
    assert assign_storage_slots([a, b, no_idx]) == [(0, 1), (2, 3), (4, None)]


def test_storage_slots_shared_by_reuse_ring() -> None:
    # A ring of two buffers reused by four layers: layers 0/2 and 1/3 share storage.
    ring = [_layout(4, base_addrs=[10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4]) for i in (0, 1)]
    layers = [ring[0], ring[1], ring[0], ring[1]]
    assert assign_storage_slots(layers) == [(0, 1), (2, 3), (0, 1), (2, 3)]


def test_storage_slots_main_and_indexer_tracked_independently() -> None:
    # Main storage reused while the indexer has its own buffer per layer, and vice versa.
    shared_main = [_layout(3, base_addrs=[1, 2, 100 + i]) for i in range(3)]
    assert assign_storage_slots(shared_main) == [(0, 1), (0, 2), (0, 3)]
    shared_idx = [_layout(3, base_addrs=[10 + i, 20 + i, 99]) for i in range(3)]
    assert assign_storage_slots(shared_idx) == [(0, 1), (2, 1), (3, 1)]
    assert assign_storage_slots([]) == []


def test_storage_slot_of_indexer_includes_scale_address() -> None:
    with_scale = _layout(4, base_addrs=[1, 2, 3, 4])
    other_scale = _layout(4, base_addrs=[1, 2, 3, 5])
    assert assign_storage_slots([with_scale, other_scale]) == [(0, 1), (0, 2)]
