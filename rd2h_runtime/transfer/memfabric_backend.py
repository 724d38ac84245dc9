"""MemFabric backend (``pip install 'rd2h[memfabric]'``): the Ascend production data path.

Reference behaviour this follows (section 4 of reference-behaviour.md): one engine per
process, bound to one role (``"Prefill"``/``"Decode"``), one device and one hostname; the
session id is ``"<host>:<rpc port>"``; Prefill registers its KV regions once. The data path
is chosen by ``memfabric_transfer_protocol`` (``sdma`` default and ``device_rdma`` on A3,
``device_urma`` on A5), identical on both sides; an invalid value stops start-up.

Start-up (memfabric-hybrid 1.3): ``initialize(store_url, host, role, device, op_type,
store_server_role="Prefill")`` picks the RPC port itself (``get_rpc_port()`` returns 0 before
it), so the session is built after initialisation. Releases that hand out the port before
initialisation (``get_rpc_port() > 0``) get ``"<host>:<port>"`` as their unique id instead.
``store_url`` defaults to ``tcp://<host>``; the Prefill side serves the config store.

One engine per process, refused with a :class:`ConfigError` naming the live one: unlike
NIXL agents and Mooncake engines (several of which share a process, Prefill and Decode
included), MemFabric's role and device are process-wide state. Its C API
(``include/smem/host/smem_trans.h``, 1.3) takes them in ``smem_trans_init(config)``, which
"all processes need to call ... before creating a trans object", and undoes it with the
process-wide ``smem_trans_uninit``; ``smem_trans_create`` then only adds a store URL and a
unique id. A second engine would re-initialise (or, closing, tear down) the first one's
role and device under it. Untested on an NPU here: these hosts have none.

MemFabric needs an Ascend NPU and its driver. Without them its ``initialize`` fails; the
error raised then says so rather than passing on a bare ``-1``.
"""

from __future__ import annotations

import os
import threading
from typing import Any, ClassVar, Final

from rd2h_protocol.errors import ConfigError, TransferError
from rd2h_runtime.transfer.base import BlockingCallRunner, TransferBackend, U64Array

__all__ = [
    "ASCEND_DRIVER_FILES",
    "MAX_REGISTER_REGIONS",
    "PROTOCOLS",
    "MemfabricBackend",
    "ascend_driver_present",
    "check_region_budget",
    "data_op_type_name",
]

#: memfabric_transfer_protocol value -> name of the engine's TransDataOpType member
PROTOCOLS: Final[dict[str, str]] = {
    "sdma": "SDMA",
    "device_rdma": "DEVICE_RDMA",
    "device_urma": "DEVICE_URMA",
}
#: Most merged regions one Prefill registers (the HCCL registration limit in production).
MAX_REGISTER_REGIONS: Final = 256
#: Files the Ascend driver installs; MemFabric reads its version from them.
ASCEND_DRIVER_FILES: Final = ("/usr/local/Ascend/driver/version.info", "/etc/ascend_install.info")
_ENGINE_ROLES: Final = {"prefill": "Prefill", "decode": "Decode"}
# How long close() waits for a timed-out engine call before leaving the engine alive.
_CLOSE_WAIT_S: Final = 5.0

# The one live engine of this process (MemFabric binds role, device and host per process).
_active: MemfabricBackend | None = None
_active_lock = threading.Lock()


def data_op_type_name(protocol: str) -> str:
    """The engine's data operation type for a ``memfabric_transfer_protocol`` value.

    Raises :class:`ConfigError` listing the valid values.
    """
    key = str(protocol).strip().lower()
    if key not in PROTOCOLS:
        raise ConfigError(
            f"memfabric_transfer_protocol must be one of {', '.join(PROTOCOLS)} "
            f"(sdma or device_rdma on A3, device_urma on A5); got {protocol!r}"
        )
    return PROTOCOLS[key]


def check_region_budget(regions: list[tuple[int, int]], limit: int = MAX_REGISTER_REGIONS) -> None:
    """:class:`ConfigError` when more merged regions than ``limit`` would be registered."""
    if len(regions) > limit:
        raise ConfigError(
            f"MemFabric registers at most {limit} merged memory regions per process; "
            f"got {len(regions)} after merging adjacent ones (register whole KV-cache "
            "tensors rather than blocks)"
        )


def ascend_driver_present() -> bool:
    """Whether an Ascend NPU driver is installed (the files MemFabric reads exist)."""
    return any(os.path.exists(path) for path in ASCEND_DRIVER_FILES)


class MemfabricBackend(TransferBackend):
    """Batched reads through ``memfabric_hybrid.TransferEngine``."""

    name: ClassVar[str] = "memfabric"
    option_names: ClassVar[tuple[str, ...]] = (
        "protocol",
        "device_id",
        "store_url",
        "store_server_role",
        "max_regions",
    )

    def __init__(
        self,
        *,
        role: str,
        host: str = "127.0.0.1",
        protocol: str = "sdma",
        device_id: int = 0,
        store_url: str | None = None,
        store_server_role: str = "Prefill",
        max_regions: int = MAX_REGISTER_REGIONS,
        **options: Any,
    ) -> None:
        global _active
        self._check_options(options)
        super().__init__(role=role, host=host)
        # Validate everything that does not need the engine before touching it.
        op_name = data_op_type_name(protocol)
        if store_server_role not in _ENGINE_ROLES.values():
            raise ConfigError(
                f"store_server_role must be 'Prefill' or 'Decode'; got {store_server_role!r}"
            )
        self.protocol = str(protocol).strip().lower()
        self.device_id = int(device_id)
        self._max_regions = int(max_regions)
        self._engine: Any = None
        self._runner = BlockingCallRunner("memfabric")
        import memfabric_hybrid as mf

        with _active_lock:
            if _active is not None and not _active.closed:
                raise ConfigError(
                    "one MemFabric engine per process (MemFabric binds role and device "
                    "process-wide in smem_trans_init): this process already has one bound to "
                    f"role {_active.role}, device {_active.device_id}, host {_active.host}; "
                    "run the other role in a process of its own, or use nixl or mooncake"
                )
            _active = self
        try:
            self._session = self._start(
                mf, op_name, store_url or f"tcp://{host}", store_server_role
            )
        except BaseException:
            self._release_slot()
            raise

    def _start(self, mf: Any, op_name: str, store_url: str, store_server_role: str) -> str:
        engine = mf.TransferEngine()
        engine_role = _ENGINE_ROLES[self.role]
        op_type = getattr(mf.TransDataOpType, op_name)
        early_port = int(engine.get_rpc_port())
        unique_id = f"{self.host}:{early_port}" if early_port > 0 else self.host
        kwargs: dict[str, Any] = {}
        if "store_server_role" in (engine.initialize.__doc__ or ""):
            kwargs["store_server_role"] = store_server_role
        ret = engine.initialize(
            store_url, unique_id, engine_role, self.device_id, op_type, **kwargs
        )
        if ret != 0:
            detail = ""
            try:
                detail = str(mf.get_and_clear_last_err_msg() or "")
            except Exception:
                detail = ""  # the message is a courtesy; the code below is what matters
            where = (
                f"initialize(store_url={store_url!r}, role={engine_role}, "
                f"device={self.device_id}, protocol={self.protocol}) returned {ret}"
            )
            if not ascend_driver_present():
                raise TransferError(
                    f"MemFabric cannot start: no Ascend NPU driver on this host (none of "
                    f"{', '.join(ASCEND_DRIVER_FILES)} exists). MemFabric needs an Ascend NPU "
                    f"with its driver installed; on other hosts use the nixl or mooncake "
                    f"backend. Engine said: {where}{': ' + detail if detail else ''}",
                    int(ret),
                )
            raise TransferError(f"MemFabric {where}{': ' + detail if detail else ''}", int(ret))
        self._engine = engine
        port = early_port if early_port > 0 else int(engine.get_rpc_port())
        return f"{self.host}:{port}"

    @property
    def session_id(self) -> str:
        return self._session

    def _register(self, regions: list[tuple[int, int]]) -> None:
        if self.role == "prefill" and len(self._local):
            raise ConfigError(
                "MemFabric Prefill registers its regions once; pass every region in one "
                "register() call"
            )
        check_region_budget([*self._local.regions, *regions], self._max_regions)
        ret = self._engine.batch_register_memory([a for a, _ in regions], [n for _, n in regions])
        if ret != 0:
            raise TransferError(
                f"MemFabric batch_register_memory of {len(regions)} region(s) returned {ret}",
                int(ret),
            )

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        engine = self._engine
        dst, src, size = local.tolist(), remote.tolist(), lengths.tolist()

        def call() -> None:
            ret = engine.batch_transfer_sync_read(session, dst, src, size)
            if ret != 0:
                raise TransferError(
                    f"MemFabric batch_transfer_sync_read from {session!r} returned {ret} "
                    f"({len(size)} descriptors, protocol {self.protocol})",
                    int(ret),
                )

        self._runner.run(call, deadline, f"MemFabric read from {session!r}")

    def quiesce(self, timeout_s: float) -> bool:
        return self._runner.wait_idle(timeout_s)

    def _close(self) -> None:
        engine, self._engine = self._engine, None
        try:
            if engine is not None and self._runner.wait_idle(_CLOSE_WAIT_S):
                engine.destroy()
                engine.unInitialize()
        finally:
            self._release_slot()

    def _release_slot(self) -> None:
        global _active
        with _active_lock:
            if _active is self:
                _active = None
