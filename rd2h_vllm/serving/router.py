"""``vllm-router`` (vLLM's Rust router) in front of Prefill and Decode vLLM servers.

The standard Prefill-first flow, as users run it::

    vllm-router --vllm-pd-disaggregation --prefill http://P --decode http://D

The router sends each request to Prefill first (``max_tokens`` 1, ``kv_transfer_params``
``{"do_remote_decode": true}``), then to Decode with the ``kv_transfer_params`` Prefill
answered, and streams Decode's answer back. It serves vLLM's own NixlConnector, and
RD2H's connector in its Prefill-first mode.

Settings besides the deployment's own: a free Prometheus port per router (its default,
29000, is one port for every router on the host), worker health checked every second
at start-up (default: every 30 s), and the log level (``warning`` by default: the router
logs every request at ``info``). Retries and the circuit breaker keep their defaults,
as a deployment has them. The router answers ``/readiness`` with 200 once it has a
healthy Prefill and Decode; :func:`start_router` waits for it.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from rd2h_vllm.serving.processes import HOST, ManagedProcess, ServerError, VllmServer, free_port

#: The router's answer once its workers are healthy (503 before).
READY_PATH: Final = "/readiness"


def router_executable() -> str:
    """The ``vllm-router`` script of this interpreter's environment, else the one on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.is_file():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise ServerError("vllm-router is not installed (pip install vllm-router)")
    return found


def router_command(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    port: int,
    prometheus_port: int,
    log_level: str = "warning",
    extra_args: Sequence[str] = (),
    executable: str = "vllm-router",
) -> list[str]:
    """The ``vllm-router`` command line in P/D mode on ``HOST:port``."""
    cmd = [executable, "--vllm-pd-disaggregation"]
    for url in prefill_urls:
        cmd += ["--prefill", url]
    for url in decode_urls:
        cmd += ["--decode", url]
    cmd += [
        "--host",
        HOST,
        "--port",
        str(port),
        "--prometheus-host",
        HOST,
        "--prometheus-port",
        str(prometheus_port),
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        log_level,
    ]
    return [*cmd, *extra_args]


class RouterProcess(ManagedProcess):
    """``vllm-router`` in P/D mode in front of ``prefillers`` and ``decoders``."""

    def __init__(
        self,
        prefillers: Sequence[VllmServer],
        decoders: Sequence[VllmServer],
        log_dir: Path,
        extra_args: Sequence[str] = (),
        name: str = "router",
        log_level: str = "warning",
    ) -> None:
        self.port = free_port()
        self.prometheus_port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        cmd = router_command(
            [s.url for s in prefillers],
            [s.url for s in decoders],
            self.port,
            self.prometheus_port,
            log_level=log_level,
            extra_args=extra_args,
            executable=router_executable(),
        )
        super().__init__(name, cmd, log_dir / f"{name}.log")


def start_router(
    prefillers: Sequence[VllmServer],
    decoders: Sequence[VllmServer],
    log_dir: Path,
    timeout_s: float = 60.0,
    name: str = "router",
    extra_args: Sequence[str] = (),
) -> RouterProcess:
    """Start ``vllm-router`` (log ``<name>.log``) and wait for its ``/readiness``."""
    router = RouterProcess(prefillers, decoders, log_dir, extra_args=extra_args, name=name)
    try:
        router.wait_http(router.url + READY_PATH, time.monotonic() + timeout_s)
    except BaseException:
        router.stop(grace_s=2.0)
        raise
    return router
