"""Golden v1 frames: what the existing implementation puts on the wire.

Each fixture under ``fixtures/`` is a literal Python tuple below packed the way v1 packs
it (``msgpack.packb(obj, use_bin_type=True)``), checked in as bytes so the wire format is
pinned even if a msgpack release changed its output. ``python
tests/protocol/test_golden_v1.py --write`` regenerates them; the first test checks the
checked-in bytes still equal the literals.

The tests prove, per v1 rule (reference-behaviour.md §1): every v1 message decodes, a
current-shape message re-encodes to the fixture byte for byte, and each shorter shape the
length guards allow decodes to the documented defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest

from rd2h_protocol import (
    ACK_V1,
    Ack,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadReq,
    decode,
    encode,
)

FIXTURES = Path(__file__).parent / "fixtures"

U64_MAX = (1 << 64) - 1

# MF_META inner map, as v1 builds it: one entry per Prefill main layer. Layer 0 has K, V,
# indexer and a LIC8 scale at the top of the 64-bit address space; layer 1 has K and V only.
INNER_FULL: dict[str, dict[str, Any]] = {
    "model.layers.0.self_attn": {
        "base_addrs": [
            U64_MAX - (4 << 30),
            U64_MAX - (3 << 30),
            U64_MAX - (2 << 30),
            U64_MAX - 4095,
        ],
        "block_len": [73728, 8192, 16384, 512],
        "block_size_scale": [1, 1, 1, 1],
        "tensor_group_idx": [0, 0, 1, 1],
        "main_tensor_count": 2,
        "has_indexer": True,
    },
    "model.layers.1.self_attn": {
        "base_addrs": [0x12C0_0000_0000, 0x12C8_0000_0000],
        "block_len": [36864, 4096],
        "block_size_scale": [2, 2],
        "tensor_group_idx": [0, 0],
        "main_tensor_count": 2,
        "has_indexer": False,
    },
}
# An older Prefill that sends only the keys every version had (read-side defaults apply).
INNER_MINIMAL: dict[str, dict[str, Any]] = {
    "model.layers.3.self_attn": {
        "base_addrs": [0x7F00_0000_0000, 0x7F10_0000_0000, 0x7F20_0000_0000],
        "block_len": [73728, 8192, 16384],
        "tensor_group_idx": [0, 0, 1],
    },
}


def _packb(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def _ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# Block ids that exercise every msgpack int width a v1 peer emits for them.
WIDE_IDS = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1]
# Longer than 31 characters: msgpack str8, not fixstr.
CHAT_ID = "chatcmpl-3f0c2a9e8b7d4c1a9f6e5d4c3b2a1908"

# name -> the literal v1 tuple (or raw bytes for the ACK frame).
GOLDEN: dict[str, Any] = {
    "mf_meta": (b"mf_meta", "10.20.30.40:30001", _packb(INNER_FULL)),
    "mf_meta_minimal_inner": (b"mf_meta", "decode-0:7000", _packb(INNER_MINIMAL)),
    "ack_raw": b"ACK",
    "read_ready_batch": (
        b"read_ready_batch",
        5,
        "model.layers.5.self_attn",
        [
            ("cmpl-abc-0", [10, 11, 12], [40, 41, 42], 0, 0),
            (CHAT_ID, WIDE_IDS, WIDE_IDS[::-1], 17, 3),
            ("cmpl-abc-1", [], [7, 8], 4, 2),  # nothing for this rank's main share
        ],
        ["cmpl-abc-0", CHAT_ID],
        1,
        2,
    ),
    # 20 requests (array16 list), 300 ids per list (array16 ids), ids up to 17 bits.
    "read_ready_batch_large": (
        b"read_ready_batch",
        60,
        "model.layers.60.self_attn",
        [
            (f"cmpl-big-{i}", _ids(i * 5000, 300), _ids(100_000 + i * 300, 300), i, 2 * i)
            for i in range(20)
        ],
        [f"cmpl-big-{i}" for i in range(0, 20, 3)],
        3,
        4,
    ),
    # A rank with nothing to read still receives the readiness (and must reply).
    "read_ready_batch_empty": (b"read_ready_batch", 0, "model.layers.0.self_attn", [], [], 0, 1),
    "read_req_2_fields": (
        b"read_ready_batch",
        2,
        "model.layers.2.self_attn",
        [("r2", [5, 6, 7])],
        [],
        0,
        1,
    ),
    "read_req_3_fields": (
        b"read_ready_batch",
        2,
        "model.layers.2.self_attn",
        [("r3", [5, 6, 7], [9, 10])],
        [],
        0,
        1,
    ),
    "read_req_4_fields": (
        b"read_ready_batch",
        2,
        "model.layers.2.self_attn",
        [("r4", [5, 6, 7], [9, 10], 12)],
        [],
        0,
        1,
    ),
    "read_ready_batch_4_fields": (
        b"read_ready_batch",
        7,
        "model.layers.7.self_attn",
        [("r", [1], [2], 0, 0)],
    ),
    "read_ready_batch_5_fields": (
        b"read_ready_batch",
        7,
        "model.layers.7.self_attn",
        [("r", [1], [2], 0, 0)],
        ["r"],
    ),
    "read_ready_batch_6_fields": (
        b"read_ready_batch",
        7,
        "model.layers.7.self_attn",
        [("r", [1], [2], 0, 0)],
        ["r"],
        0,
    ),
    "read_ready_batch_ratio_0": (
        b"read_ready_batch",
        7,
        "model.layers.7.self_attn",
        [("r", [1], [2], 0, 0)],
        ["r"],
        0,
        0,
    ),
    "read_done": (b"read_done", 5),
    "read_done_last_layer": (b"read_done", 95),
    "read_failed": (b"read_failed", 5, "memfabric batch read returned -5"),
    "read_failed_no_error": (b"read_failed", 5),
}


def golden_bytes(name: str) -> bytes:
    """The frame the literal ``GOLDEN[name]`` packs to."""
    obj = GOLDEN[name]
    return obj if isinstance(obj, bytes) else _packb(obj)


def fixture(name: str) -> bytes:
    """The checked-in frame ``name``."""
    return (FIXTURES / f"v1_{name}.bin").read_bytes()


def write_fixtures() -> None:
    """Regenerate every fixture file from ``GOLDEN`` (run this file with ``--write``)."""
    FIXTURES.mkdir(exist_ok=True)
    for name in GOLDEN:
        (FIXTURES / f"v1_{name}.bin").write_bytes(golden_bytes(name))


# Messages whose shape is the one v1 sends today: our encoding must be byte-identical.
CURRENT_SHAPE = [
    "mf_meta",
    "mf_meta_minimal_inner",
    "ack_raw",
    "read_ready_batch",
    "read_ready_batch_large",
    "read_ready_batch_empty",
    "read_done",
    "read_done_last_layer",
    "read_failed",
]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_fixture_file_matches_the_literal_packed_as_v1_does(name: str) -> None:
    assert fixture(name) == golden_bytes(name)


def test_every_fixture_file_has_a_literal() -> None:
    on_disk = {p.name.removeprefix("v1_").removesuffix(".bin") for p in FIXTURES.iterdir()}
    assert on_disk == set(GOLDEN)


@pytest.mark.parametrize("name", CURRENT_SHAPE)
def test_current_shape_v1_message_reencodes_byte_for_byte(name: str) -> None:
    frame = fixture(name)
    assert encode(decode(frame)) == frame


def test_mf_meta_decodes_session_and_keeps_inner_blob_verbatim() -> None:
    msg = decode(fixture("mf_meta"))
    assert msg == MfMeta(p_session="10.20.30.40:30001", encoded_layer_metadata=_packb(INNER_FULL))
    assert msg.protocol_version is None and msg.capabilities is None and msg.compat is None
    # The inner blob is a second msgpack document; addresses use the whole uint64 range.
    inner = msgpack.unpackb(msg.encoded_layer_metadata)
    assert inner["model.layers.0.self_attn"]["base_addrs"][3] == U64_MAX - 4095


def test_mf_meta_with_minimal_inner_map_decodes() -> None:
    msg = decode(fixture("mf_meta_minimal_inner"))
    assert isinstance(msg, MfMeta)
    assert msgpack.unpackb(msg.encoded_layer_metadata) == INNER_MINIMAL


def test_raw_ack_frame_decodes_to_the_v1_ack() -> None:
    msg = decode(fixture("ack_raw"))
    assert msg == ACK_V1
    assert isinstance(msg, Ack) and msg.is_v1
    assert fixture("ack_raw") == b"ACK"  # not msgpack: the three raw bytes


def test_read_ready_batch_decodes_every_v1_field() -> None:
    msg = decode(fixture("read_ready_batch"))
    assert msg == ReadReadyBatch(
        layer_idx=5,
        layer_name="model.layers.5.self_attn",
        read_reqs=[
            ReadReq("cmpl-abc-0", [10, 11, 12], [40, 41, 42], 0, 0),
            ReadReq(CHAT_ID, WIDE_IDS, WIDE_IDS[::-1], 17, 3),
            ReadReq("cmpl-abc-1", [], [7, 8], 4, 2),
        ],
        done_ext_ids=["cmpl-abc-0", CHAT_ID],
        group_member_idx=1,
        tp_ratio=2,
    )
    assert msg.seq is None and msg.lease_ms is None


def test_read_ready_batch_with_array16_lists_decodes() -> None:
    msg = decode(fixture("read_ready_batch_large"))
    assert isinstance(msg, ReadReadyBatch)
    assert len(msg.read_reqs) == 20
    assert msg.read_reqs[19] == ReadReq("cmpl-big-19", _ids(95000, 300), _ids(105700, 300), 19, 38)
    assert (msg.group_member_idx, msg.tp_ratio) == (3, 4)


def test_read_ready_batch_without_requests_decodes() -> None:
    msg = decode(fixture("read_ready_batch_empty"))
    assert isinstance(msg, ReadReadyBatch)
    assert msg.read_reqs == [] and msg.done_ext_ids == []


def test_read_req_2_fields_uses_same_ids_for_indexer() -> None:
    msg = decode(fixture("read_req_2_fields"))
    assert isinstance(msg, ReadReadyBatch)
    (req,) = msg.read_reqs
    assert req.main_block_ids == [5, 6, 7]
    assert req.indexer_ids == [5, 6, 7]
    assert (req.main_start_block, req.indexer_start_block) == (0, 0)


def test_read_req_3_fields_has_both_lists_and_zero_starts() -> None:
    msg = decode(fixture("read_req_3_fields"))
    assert isinstance(msg, ReadReadyBatch)
    assert msg.read_reqs == [ReadReq("r3", [5, 6, 7], [9, 10], 0, 0)]


def test_read_req_4_fields_takes_main_start_and_zero_indexer_start() -> None:
    msg = decode(fixture("read_req_4_fields"))
    assert isinstance(msg, ReadReadyBatch)
    assert msg.read_reqs == [ReadReq("r4", [5, 6, 7], [9, 10], 12, 0)]


def test_read_ready_batch_4_fields_has_no_done_ids_member_0_ratio_1() -> None:
    msg = decode(fixture("read_ready_batch_4_fields"))
    assert isinstance(msg, ReadReadyBatch)
    assert (msg.done_ext_ids, msg.group_member_idx, msg.tp_ratio) == ([], 0, 1)


def test_read_ready_batch_5_fields_has_member_0_ratio_1() -> None:
    msg = decode(fixture("read_ready_batch_5_fields"))
    assert isinstance(msg, ReadReadyBatch)
    assert (msg.done_ext_ids, msg.group_member_idx, msg.tp_ratio) == (["r"], 0, 1)


def test_read_ready_batch_6_fields_has_ratio_1() -> None:
    msg = decode(fixture("read_ready_batch_6_fields"))
    assert isinstance(msg, ReadReadyBatch)
    assert (msg.group_member_idx, msg.tp_ratio) == (0, 1)


def test_read_ready_batch_tp_ratio_0_reads_as_1() -> None:
    msg = decode(fixture("read_ready_batch_ratio_0"))
    assert isinstance(msg, ReadReadyBatch)
    assert msg.tp_ratio == 1
    # Re-encoding writes the normalised ratio, which a v1 peer reads the same way.
    assert encode(msg) == _packb((*GOLDEN["read_ready_batch_ratio_0"][:6], 1))


@pytest.mark.parametrize("name", ["read_done", "read_done_last_layer"])
def test_read_done_decodes_layer_and_no_v2_fields(name: str) -> None:
    msg = decode(fixture(name))
    assert msg == ReadDone(layer_idx=GOLDEN[name][1])
    assert msg.seq is None and msg.failed is None


def test_read_failed_decodes_error_text() -> None:
    msg = decode(fixture("read_failed"))
    assert msg == ReadFailed(layer_idx=5, error="memfabric batch read returned -5")
    assert msg.seq is None and msg.code is None


def test_read_failed_without_error_reads_empty_error() -> None:
    msg = decode(fixture("read_failed_no_error"))
    assert msg == ReadFailed(layer_idx=5, error="")
    # We always write the error field, as current v1 does.
    assert encode(msg) == _packb((b"read_failed", 5, ""))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/protocol/test_golden_v1.py --write")
    write_fixtures()
    print(f"wrote {len(GOLDEN)} fixtures to {FIXTURES}")
