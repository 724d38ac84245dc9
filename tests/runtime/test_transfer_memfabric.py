"""MemFabric with the real installed package: configuration checks and the no-NPU error.

These hosts have no Ascend NPU, so the engine cannot start; what is tested is that the
failure is clear (it names the missing driver) and that everything checkable without an
NPU (protocol names, role, region budget, one engine per process) is checked first.
"""

from __future__ import annotations

import threading
from typing import Any

import memfabric_hybrid
import pytest

from rd2h_protocol.errors import ConfigError, TransferError
from rd2h_runtime.transfer import create_backend, merge_regions
from rd2h_runtime.transfer.memfabric_backend import (
    MAX_REGISTER_REGIONS,
    PROTOCOLS,
    ascend_driver_present,
    check_region_budget,
    data_op_type_name,
)


def test_protocol_names_map_to_real_engine_operation_types() -> None:
    assert set(PROTOCOLS) == {"sdma", "device_rdma", "device_urma"}
    members = memfabric_hybrid.TransDataOpType.__members__
    for protocol in PROTOCOLS:
        assert data_op_type_name(protocol) in members
    assert data_op_type_name(" SDMA ") == "SDMA"


@pytest.mark.parametrize("bad", ["rdma", "device-rdma", "", "hccs"])
def test_invalid_protocol_is_refused_listing_the_valid_values(bad: str) -> None:
    with pytest.raises(ConfigError, match="sdma, device_rdma, device_urma") as info:
        create_backend("memfabric", role="prefill", protocol=bad)
    assert repr(bad) in str(info.value)


def test_invalid_store_server_role_is_refused() -> None:
    with pytest.raises(ConfigError, match="store_server_role"):
        create_backend("memfabric", role="decode", store_server_role="decode")


def test_start_without_an_npu_says_what_is_missing() -> None:
    if ascend_driver_present():
        # On an Ascend host the engine may start; if it does not, the error must not
        # blame a driver that is there.
        try:
            with create_backend("memfabric", role="prefill") as backend:
                assert backend.session_id.startswith("127.0.0.1:")
        except TransferError as exc:
            assert "no Ascend NPU driver" not in str(exc)
        return
    for _ in range(2):  # a failed start must not keep the process-wide engine slot
        with pytest.raises(TransferError, match="no Ascend NPU driver on this host") as info:
            create_backend("memfabric", role="prefill", protocol="device_rdma")
        message = str(info.value)
        assert "role=Prefill" in message and "protocol=device_rdma" in message
        assert info.value.backend_code is not None and info.value.backend_code != 0
        assert not info.value.transient


def test_region_budget() -> None:
    regions = [(i * 4096, 1024) for i in range(MAX_REGISTER_REGIONS + 1)]
    check_region_budget(regions[:-1])
    with pytest.raises(ConfigError, match=f"at most {MAX_REGISTER_REGIONS} merged"):
        check_region_budget(regions)
    # adjacent blocks of one tensor merge into one region, well inside the budget
    blocks = [(i * 1024, 1024) for i in range(10 * MAX_REGISTER_REGIONS)]
    check_region_budget(merge_regions(blocks))


class _FakeEngine:
    """memfabric_hybrid.TransferEngine's calls as the backend makes them, with no NPU."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.closed = False

    def get_rpc_port(self) -> int:
        return 4242

    def initialize(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def batch_register_memory(self, addrs: list[int], sizes: list[int]) -> int:
        return 0

    def batch_transfer_sync_read(
        self, session: str, dst: list[int], src: list[int], size: list[int]
    ) -> int:
        self.threads.append(threading.get_ident())
        self.gate.wait(10)
        return 0

    def destroy(self) -> None:
        self.closed = True

    def unInitialize(self) -> None:
        pass


def test_reads_run_on_one_persistent_worker_with_the_same_deadline_semantics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = _FakeEngine()
    monkeypatch.setattr(memfabric_hybrid, "TransferEngine", lambda: engine)
    backend = create_backend("memfabric", role="decode")
    backend.register([(0x10000, 4096)])

    def read(timeout_s: float = 5.0) -> None:
        backend.read("127.0.0.1:1", [0x900000], [0x10000], [4096], timeout_s=timeout_s)

    for _ in range(5):
        read()
    assert len(set(engine.threads)) == 1 and threading.get_ident() not in engine.threads
    engine.gate.clear()
    with pytest.raises(TransferError, match="timed out") as info:
        read(0.05)
    assert not info.value.transient and not backend.quiesce(0.01)
    with pytest.raises(TransferError, match="still running") as busy:
        read()
    assert busy.value.transient
    engine.gate.set()
    assert backend.quiesce(5)
    read()
    assert len(set(engine.threads)) == 1  # the same thread after the timed-out call
    workers = [t for t in threading.enumerate() if t.name == "rd2h-memfabric-call"]
    backend.close()
    assert engine.closed
    for worker in workers:
        worker.join(5)
        assert not worker.is_alive()


def test_a_second_engine_in_one_process_is_refused_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memfabric_hybrid, "TransferEngine", _FakeEngine)
    first = create_backend("memfabric", role="prefill")
    try:
        with pytest.raises(ConfigError, match="one MemFabric engine per process") as info:
            create_backend("memfabric", role="decode")
        assert "smem_trans_init" in str(info.value) and "role prefill" in str(info.value)
    finally:
        first.close()
    create_backend("memfabric", role="decode").close()  # the slot is free once closed
