"""Transfer backends: one small interface, several engines, imported only when created.

    from rd2h_runtime.transfer import create_backend

    with create_backend("nixl", role="prefill") as prefill:
        prefill.register([(addr, nbytes)])
        publish(prefill.session_id)          # e.g. in MF_META
    ...
    with create_backend("nixl", role="decode") as decode:
        decode.register([(dst_addr, dst_nbytes)])
        decode.read(session, remote_addrs, local_addrs, lengths, timeout_s=5.0)

Backends: ``loopback`` (in-process memmove, tests), ``nixl`` (UCX), ``mooncake`` (TCP or
RDMA), ``memfabric`` (Ascend NPUs, the production path). Importing this package loads none
of the engines.
"""

from rd2h_runtime.transfer.base import (
    BACKENDS,
    RegionSet,
    TransferBackend,
    create_backend,
    merge_regions,
)

__all__ = ["BACKENDS", "RegionSet", "TransferBackend", "create_backend", "merge_regions"]
