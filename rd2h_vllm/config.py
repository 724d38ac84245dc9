"""The connector's configuration: the deployment guide's JSON, parsed and checked once.

Theory of operation
-------------------
Users keep the deployment guide's ``--kv-transfer-config`` unchanged::

    {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_consumer", "kv_port": 20050,
     "kv_connector_extra_config": {"transfer_backend": "memfabric", "use_layerwise": true}}

or the same entry inside a ``MultiConnector``'s ``connectors`` list (the Prefill example).
Our v2 options live in the same ``kv_connector_extra_config`` (:data:`EXTRA_DEFAULTS`).
The sparse-offload switch lives in vLLM's ``--additional-config``
(``sparse_kv_offload_config.enabled``): Prefill must run without it, Decode with it when
the host is an Ascend NPU (elsewhere Decode reads into vLLM's own KV cache).

:func:`from_vllm_config` reads a real ``VllmConfig``; :func:`parse_config` takes the same
information as plain dicts (tests, tools). Both check EVERYTHING before answering and
raise ONE :class:`~rd2h_protocol.errors.ConfigError` listing every problem, each with the
change that fixes it, so a deployment is corrected in one round trip instead of one
restart per mistake.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

from rd2h_protocol.errors import ConfigError, TopologyError
from rd2h_protocol.topology import decode_base_port, map_prefill_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The name users put in ``kv_connector`` (the deployment guide's, unchanged).
CONNECTOR_NAME: Final = "SfaRemoteD2HConnector"
#: Where the connector class lives (for ``kv_connector_module_path`` and the plugin).
CONNECTOR_MODULE: Final = "rd2h_vllm.connector"
#: vLLM's own default ``kv_port`` (KVTransferConfig.kv_port).
DEFAULT_KV_PORT: Final = 14579

Role: TypeAlias = Literal["kv_producer", "kv_consumer"]
TransferBackend: TypeAlias = Literal["memfabric", "nixl", "mooncake"]
MemfabricProtocol: TypeAlias = Literal["sdma", "device_rdma", "device_urma"]
ReadFailurePolicy: TypeAlias = Literal["isolate", "raise"]
ProtocolChoice: TypeAlias = Literal["v2", "v1"]

ROLES: Final[tuple[Role, ...]] = ("kv_producer", "kv_consumer")
TRANSFER_BACKENDS: Final[tuple[TransferBackend, ...]] = ("memfabric", "nixl", "mooncake")
MEMFABRIC_PROTOCOLS: Final[tuple[MemfabricProtocol, ...]] = ("sdma", "device_rdma", "device_urma")
READ_FAILURE_POLICIES: Final[tuple[ReadFailurePolicy, ...]] = ("isolate", "raise")
PROTOCOLS: Final[tuple[ProtocolChoice, ...]] = ("v2", "v1")

#: Every key ``kv_connector_extra_config`` may hold, with its default. ``transfer_backend``
#: has none: the guide makes it required. The first three are the guide's (v1) keys.
EXTRA_DEFAULTS: Final[Mapping[str, object]] = {
    "transfer_backend": None,
    "memfabric_transfer_protocol": "sdma",
    "use_layerwise": True,
    # v2: leases, deadlines and failure policy (required-departures.md items 1, 4, 16).
    "lease_ms": 30_000,
    "kv_load_timeout_s": 120.0,
    "read_failure_policy": "isolate",
    "max_read_retries": 1,
    "handshake_timeout_s": 10.0,
    # Prefill: a Decode that holds storage past its lease and sends nothing for this long
    # is declared dead (null: hold until it replies or its connection goes; see
    # ProducerConfig.silent_peer_timeout_s for the trade-off).
    "silent_peer_timeout_s": 30.0,
    # Prefill, Prefill-first flow (a standard router): how long a computed request's blocks
    # are kept for the Decode that will claim them, before they are freed unread.
    "claim_timeout_s": 120.0,
    "protocol": "v2",
    # v2: the metaserver client (item 12).
    "metaserver_timeout_s": 5.0,
    "metaserver_max_attempts": 5,
    "metaserver_backoff_s": 0.1,
    "metaserver_backoff_max_s": 2.0,
    "metaserver_deadline_s": 30.0,
    "metaserver_response_timeout_s": 600.0,
    "legacy_metaserver_errors_delivered": False,
    # Optional start-up check of the peer's TP size (else checked per rendezvous).
    "peer_tp_size": None,
    # Decode: the host Prefill connects to, as posted in the rendezvous (default: vLLM's
    # get_ip(), which honours VLLM_HOST_IP).
    "advertise_host": None,
    # Both roles: write every rank's protocol trace (NDJSON) into this directory; null:
    # off, unless RD2H_TRACE_DIR is set (see rd2h_runtime.trace and `rd2h trace`).
    "trace_dir": None,
}

_MAX_LEASE_MS: Final = (1 << 32) - 1  # lease_ms is a uint32 on the wire


@dataclass(frozen=True, slots=True)
class MetaserverOptions:
    """How Decode posts a rendezvous (see :mod:`rd2h_vllm.metaserver` for the policy).

    ``timeout_s`` bounds each attempt to an idempotent metaserver (``rd2h proxy``), and
    the connect and send of a POST to any other; ``response_timeout_s`` bounds the wait for
    a non-idempotent metaserver's answer to a POST it received (the existing example proxy
    answers only once its Prefill dispatch is over). ``max_attempts``, ``backoff_*`` and
    ``deadline_s`` bound the retries. ``legacy_errors_delivered`` reproduces v1: any HTTP
    error status counts as delivered.
    """

    timeout_s: float = 5.0
    max_attempts: int = 5
    backoff_s: float = 0.1
    backoff_max_s: float = 2.0
    deadline_s: float = 30.0
    response_timeout_s: float = 600.0
    legacy_errors_delivered: bool = False


@dataclass(frozen=True, slots=True)
class Rd2hConfig:
    """The validated configuration of one RD2H connector instance (one engine, one role).

    ``base_port`` is this DP rank's base port (``kv_port + global_dp_rank * tp_size``; TP
    rank r binds ``base_port + r``): Decode's control ports, Prefill's claim ports (the
    Prefill-first flow: a Decode claims a kept request there).
    ``sparse_offload`` says whether vLLM-Ascend's sparse KV offload is enabled.
    """

    role: Role
    engine_id: str
    kv_port: int
    transfer_backend: TransferBackend
    memfabric_transfer_protocol: MemfabricProtocol
    use_layerwise: bool
    lease_ms: int
    kv_load_timeout_s: float
    read_failure_policy: ReadFailurePolicy
    max_read_retries: int
    handshake_timeout_s: float
    silent_peer_timeout_s: float | None
    claim_timeout_s: float
    protocol: ProtocolChoice
    metaserver: MetaserverOptions
    tp_size: int
    dp_size: int
    dp_rank: int
    base_port: int
    sparse_offload: bool
    device_type: str
    peer_tp_size: int | None
    advertise_host: str | None = None
    trace_dir: str | None = None

    @property
    def is_producer(self) -> bool:
        """Prefill: publishes its KV and waits for Decode's replies."""
        return self.role == "kv_producer"

    @property
    def is_consumer(self) -> bool:
        """Decode: owns the destinations, pulls the KV, binds the control ports."""
        return self.role == "kv_consumer"

    def check_peer(self, peer_tp_size: int) -> None:
        """Check a peer's TP size against ours (Prefill TP >= Decode TP, divisible).

        Raises :class:`ConfigError` saying which sizes would work.
        """
        p_tp, d_tp = (
            (self.tp_size, peer_tp_size) if self.is_producer else (peer_tp_size, self.tp_size)
        )
        problem = _topology_problem(p_tp, d_tp)
        if problem:
            raise ConfigError(problem)


def _topology_problem(p_tp: int, d_tp: int) -> str | None:
    try:
        map_prefill_rank(0, p_tp, d_tp)
    except TopologyError as exc:
        return (
            f"unsupported TP sizes Prefill {p_tp} / Decode {d_tp} ({exc.message}): "
            "Prefill TP must be a multiple of Decode TP (for example Prefill 8 with Decode "
            "1, 2, 4 or 8)"
        )
    return None


class _Problems:
    """Collects every problem so the one error lists them all."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def raise_if_any(self) -> None:
        if not self.items:
            return
        if len(self.items) == 1:
            raise ConfigError(f"invalid {CONNECTOR_NAME} configuration: {self.items[0]}")
        lines = "\n".join(f"  - {item}" for item in self.items)
        raise ConfigError(
            f"invalid {CONNECTOR_NAME} configuration ({len(self.items)} problems):\n{lines}"
        )


def _choice(
    problems: _Problems, key: str, value: object, choices: tuple[str, ...], hint: str = ""
) -> None:
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        problems.add(
            f"kv_connector_extra_config.{key}={value!r} is not supported; set it to one of "
            f"{allowed}{hint}"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


def _positive_number(problems: _Problems, key: str, value: object) -> float:
    if not _is_number(value) or not value > 0:  # type: ignore[operator]
        problems.add(f"kv_connector_extra_config.{key}={value!r}: set it to a number > 0")
        return 1.0
    return float(value)  # type: ignore[arg-type]


def _int_in(problems: _Problems, key: str, value: object, low: int, high: int) -> int:
    if not _is_int(value) or not low <= value <= high:  # type: ignore[operator]
        problems.add(
            f"kv_connector_extra_config.{key}={value!r}: set it to an integer in [{low}, {high}]"
        )
        return low
    return value  # type: ignore[return-value]


def _bool(problems: _Problems, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        problems.add(f"kv_connector_extra_config.{key}={value!r}: set it to true or false")
        return False
    return value


def _find_own_entry(kv_transfer: Mapping[str, Any], problems: _Problems) -> Mapping[str, Any]:
    """Our entry: the config itself, or our child of a MultiConnector-style wrapper."""
    if kv_transfer.get("kv_connector") == CONNECTOR_NAME:
        return kv_transfer
    extra = kv_transfer.get("kv_connector_extra_config") or {}
    children = extra.get("connectors") if isinstance(extra, Mapping) else None
    ours = [
        child
        for child in children or ()
        if isinstance(child, Mapping) and child.get("kv_connector") == CONNECTOR_NAME
    ]
    if len(ours) == 1:
        return ours[0]
    if len(ours) > 1:
        problems.add(
            f"{kv_transfer.get('kv_connector')} lists {len(ours)} {CONNECTOR_NAME} entries in "
            "kv_connector_extra_config.connectors; keep exactly one"
        )
    else:
        problems.add(
            f"kv_connector is {kv_transfer.get('kv_connector')!r}: set it to "
            f"{CONNECTOR_NAME!r}, or list a {CONNECTOR_NAME!r} entry in a MultiConnector's "
            "kv_connector_extra_config.connectors"
        )
    return {}


def parse_config(
    kv_transfer: Mapping[str, Any],
    *,
    parallel: Mapping[str, Any] | None = None,
    additional_config: Mapping[str, Any] | None = None,
    device_type: str = "cpu",
) -> Rd2hConfig:
    """Validate the connector's configuration given as plain dicts.

    ``kv_transfer`` is the ``--kv-transfer-config`` JSON object (ours, or a MultiConnector
    holding ours). ``parallel`` holds vLLM's ``tensor_parallel_size``,
    ``data_parallel_size``, ``data_parallel_rank`` (GLOBAL DP rank),
    ``pipeline_parallel_size``, ``prefill_context_parallel_size`` and
    ``decode_context_parallel_size`` (each defaults to 1, ranks to 0).
    ``additional_config`` is ``--additional-config``; ``device_type`` vLLM's platform
    device type ("npu" on Ascend). Raises one :class:`ConfigError` listing every problem.
    """
    problems = _Problems()
    entry = _find_own_entry(kv_transfer, problems)
    problems.raise_if_any()  # without our entry every other check would only add noise
    parallel = parallel or {}
    additional_config = additional_config or {}

    role = entry.get("kv_role", kv_transfer.get("kv_role"))
    if role not in ROLES:
        problems.add(
            f"kv_role={role!r} is not supported: set kv_role to 'kv_producer' on Prefill and "
            "'kv_consumer' on Decode (RD2H is disaggregated; 'kv_both' is not supported)"
        )
    raw_extra = entry.get("kv_connector_extra_config") or {}
    extra: dict[str, Any] = dict(raw_extra) if isinstance(raw_extra, Mapping) else {}
    if not isinstance(raw_extra, Mapping):
        problems.add(f"kv_connector_extra_config must be a JSON object, got {raw_extra!r}")
    unknown = sorted(set(extra) - set(EXTRA_DEFAULTS))
    if unknown:
        problems.add(
            f"kv_connector_extra_config has unknown keys {unknown}: remove them or fix their "
            f"spelling (known keys: {', '.join(EXTRA_DEFAULTS)})"
        )
    values = {**EXTRA_DEFAULTS, **extra}

    backend = values["transfer_backend"]
    if backend is None:
        problems.add(
            "kv_connector_extra_config.transfer_backend is missing: set it to 'memfabric' "
            "(Ascend), 'nixl' or 'mooncake'"
        )
    else:
        _choice(problems, "transfer_backend", backend, TRANSFER_BACKENDS)
    mf_protocol = values["memfabric_transfer_protocol"]
    _choice(
        problems,
        "memfabric_transfer_protocol",
        mf_protocol,
        MEMFABRIC_PROTOCOLS,
        " (sdma or device_rdma on A3, device_urma on A5; the same on Prefill and Decode)",
    )
    if "memfabric_transfer_protocol" in extra and backend in ("nixl", "mooncake"):
        problems.add(
            f"kv_connector_extra_config.memfabric_transfer_protocol applies to the memfabric "
            f"backend only, but transfer_backend is {backend!r}: remove "
            "memfabric_transfer_protocol or set transfer_backend to 'memfabric'"
        )
    use_layerwise = _bool(problems, "use_layerwise", values["use_layerwise"])
    lease_ms = _int_in(problems, "lease_ms", values["lease_ms"], 1, _MAX_LEASE_MS)
    kv_load_timeout_s = _positive_number(problems, "kv_load_timeout_s", values["kv_load_timeout_s"])
    policy = values["read_failure_policy"]
    _choice(problems, "read_failure_policy", policy, READ_FAILURE_POLICIES)
    max_read_retries = _int_in(problems, "max_read_retries", values["max_read_retries"], 0, 16)
    handshake_timeout_s = _positive_number(
        problems, "handshake_timeout_s", values["handshake_timeout_s"]
    )
    claim_timeout_s = _positive_number(problems, "claim_timeout_s", values["claim_timeout_s"])
    silent_peer_timeout_s = values["silent_peer_timeout_s"]
    if silent_peer_timeout_s is not None:
        silent_peer_timeout_s = _positive_number(
            problems, "silent_peer_timeout_s", silent_peer_timeout_s
        )
    protocol = values["protocol"]
    _choice(problems, "protocol", protocol, PROTOCOLS)

    metaserver = MetaserverOptions(
        timeout_s=_positive_number(
            problems, "metaserver_timeout_s", values["metaserver_timeout_s"]
        ),
        max_attempts=_int_in(
            problems, "metaserver_max_attempts", values["metaserver_max_attempts"], 1, 100
        ),
        backoff_s=_positive_number(
            problems, "metaserver_backoff_s", values["metaserver_backoff_s"]
        ),
        backoff_max_s=_positive_number(
            problems, "metaserver_backoff_max_s", values["metaserver_backoff_max_s"]
        ),
        deadline_s=_positive_number(
            problems, "metaserver_deadline_s", values["metaserver_deadline_s"]
        ),
        response_timeout_s=_positive_number(
            problems, "metaserver_response_timeout_s", values["metaserver_response_timeout_s"]
        ),
        legacy_errors_delivered=_bool(
            problems,
            "legacy_metaserver_errors_delivered",
            values["legacy_metaserver_errors_delivered"],
        ),
    )
    if metaserver.backoff_max_s < metaserver.backoff_s:
        problems.add(
            f"kv_connector_extra_config.metaserver_backoff_max_s={metaserver.backoff_max_s} is "
            f"below metaserver_backoff_s={metaserver.backoff_s}: raise it to at least "
            f"{metaserver.backoff_s}"
        )

    # Parallel layout: RD2H supports TP and DP, not PP or context parallelism.
    def size(key: str) -> int:
        value = parallel.get(key, 1)
        if not _is_int(value) or value < 1:
            problems.add(f"{key}={value!r}: must be an integer >= 1")
            return 1
        return int(value)

    tp_size = size("tensor_parallel_size")
    dp_size = size("data_parallel_size")
    for key, flag in (
        ("pipeline_parallel_size", "--pipeline-parallel-size"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
        ("decode_context_parallel_size", "--decode-context-parallel-size"),
    ):
        if size(key) != 1:
            problems.add(
                f"{key}={parallel[key]}: {CONNECTOR_NAME} supports tensor and data "
                f"parallelism only; set {flag} 1"
            )
    dp_rank = parallel.get("data_parallel_rank", 0)
    if not _is_int(dp_rank) or not 0 <= dp_rank < dp_size:
        problems.add(f"data_parallel_rank={dp_rank!r}: must lie in [0, {dp_size})")
        dp_rank = 0

    kv_port = entry.get("kv_port", kv_transfer.get("kv_port", DEFAULT_KV_PORT))
    base_port = DEFAULT_KV_PORT
    if not _is_int(kv_port):
        problems.add(f"kv_port={kv_port!r}: set it to an integer port number")
        kv_port = DEFAULT_KV_PORT
    else:
        # Both roles bind dp_size * tp_size consecutive ports from kv_port (Decode its
        # control ports, Prefill its claim ports); check the whole reservation (the last
        # DP rank's last TP rank), not only this rank's.
        try:
            decode_base_port(kv_port, dp_size - 1, tp_size)
            base_port = decode_base_port(kv_port, dp_rank, tp_size)
        except TopologyError as exc:
            highest = 65535 - dp_size * tp_size + 1
            problems.add(
                f"kv_port={kv_port} does not leave room for {dp_size} DP x {tp_size} TP "
                f"ports ({exc.message}): set kv_port between 1 and {max(highest, 1)}"
            )

    peer_tp = values["peer_tp_size"]
    if peer_tp is not None:
        if not _is_int(peer_tp) or peer_tp < 1:
            problems.add(f"kv_connector_extra_config.peer_tp_size={peer_tp!r}: an integer >= 1")
            peer_tp = None
        elif role in ROLES:
            p_tp, d_tp = (tp_size, peer_tp) if role == "kv_producer" else (peer_tp, tp_size)
            problem = _topology_problem(p_tp, d_tp)
            if problem:
                problems.add(problem)

    advertise_host = values["advertise_host"]
    if advertise_host is not None and (not isinstance(advertise_host, str) or not advertise_host):
        problems.add(
            f"kv_connector_extra_config.advertise_host={advertise_host!r}: set it to the host "
            "name or IP address Prefill can reach this Decode on"
        )
        advertise_host = None

    trace_dir = values["trace_dir"]
    if trace_dir is not None and (not isinstance(trace_dir, str) or not trace_dir):
        problems.add(
            f"kv_connector_extra_config.trace_dir={trace_dir!r}: a directory to write the "
            "protocol traces into, or null for no tracing"
        )
        trace_dir = None

    sparse = additional_config.get("sparse_kv_offload_config") or {}
    sparse_enabled = bool(sparse.get("enabled", False)) if isinstance(sparse, Mapping) else False
    if role == "kv_producer" and sparse_enabled:
        problems.add(
            "Prefill (kv_producer) runs with sparse_kv_offload_config enabled: remove "
            "sparse_kv_offload_config from Prefill's --additional-config (it is a Decode feature)"
        )
    if role == "kv_consumer" and device_type == "npu" and not sparse_enabled:
        problems.add(
            "Decode (kv_consumer) on Ascend runs without sparse KV offload: add "
            '--additional-config \'{"sparse_kv_offload_config": {"enabled": true, ...}}\' '
            "(its host pool is where RD2H writes the KV)"
        )

    problems.raise_if_any()
    engine_id = kv_transfer.get("engine_id") or entry.get("engine_id") or ""
    return Rd2hConfig(
        role=role,
        engine_id=str(engine_id),
        kv_port=kv_port,
        transfer_backend=backend,
        memfabric_transfer_protocol=mf_protocol,
        use_layerwise=use_layerwise,
        lease_ms=lease_ms,
        kv_load_timeout_s=kv_load_timeout_s,
        read_failure_policy=policy,
        max_read_retries=max_read_retries,
        handshake_timeout_s=handshake_timeout_s,
        silent_peer_timeout_s=silent_peer_timeout_s,
        claim_timeout_s=claim_timeout_s,
        protocol=protocol,
        metaserver=metaserver,
        tp_size=tp_size,
        dp_size=dp_size,
        dp_rank=dp_rank,
        base_port=base_port,
        sparse_offload=sparse_enabled,
        device_type=device_type,
        peer_tp_size=peer_tp,
        advertise_host=advertise_host,
        trace_dir=trace_dir,
    )


_PARALLEL_KEYS: Final = (
    "tensor_parallel_size",
    "data_parallel_size",
    "data_parallel_rank",
    "pipeline_parallel_size",
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
)


def from_vllm_config(vllm_config: VllmConfig, *, device_type: str | None = None) -> Rd2hConfig:
    """Validate the connector's configuration from a real ``VllmConfig``.

    Inside a MultiConnector vLLM hands each child a copy of the VllmConfig whose
    ``kv_transfer_config`` is that child's own entry, so this reads ours either way.
    ``device_type`` defaults to ``vllm.platforms.current_platform.device_type``.
    """
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise ConfigError(
            f"invalid {CONNECTOR_NAME} configuration: no --kv-transfer-config was given"
        )
    kv_transfer = {
        "kv_connector": ktc.kv_connector,
        "kv_role": ktc.kv_role,
        "kv_port": ktc.kv_port,
        "engine_id": ktc.engine_id,
        "kv_connector_extra_config": ktc.kv_connector_extra_config,
    }
    pc = vllm_config.parallel_config
    # data_parallel_rank is the GLOBAL DP rank (the port rule needs it, not the local one).
    parallel = {key: getattr(pc, key, 1 if key.endswith("_size") else 0) for key in _PARALLEL_KEYS}
    additional = vllm_config.additional_config
    if device_type is None:
        from vllm.platforms import current_platform

        device_type = str(current_platform.device_type)
    return parse_config(
        kv_transfer,
        parallel=parallel,
        additional_config=additional if isinstance(additional, Mapping) else {},
        device_type=device_type,
    )
