"""A Prefill/Decode deployment on this host: vLLM servers with RD2H and ``rd2h proxy``.

:class:`PDCluster` launches its Prefill and Decode servers together (their vLLM imports
overlap), waits for them, then starts the proxy in front of them. Servers may be shared
between clusters (a second Prefill in front of the same Decode, for another TP size):
a cluster stops only the servers it launched itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from rd2h_vllm.serving.processes import (
    ProxyProcess,
    ServerError,
    ServerSpec,
    VllmServer,
    start_proxy,
)


class PDCluster:
    """Prefill servers, Decode servers and the proxy in front of them.

    ``prefill`` and ``decode`` hold specs to launch or servers already running (borrowed,
    never stopped here). Call :meth:`launch` early (it only starts processes) and
    :meth:`wait_ready` when the cluster is needed; :meth:`stop` stops what was launched.
    """

    def __init__(
        self,
        name: str,
        prefill: Sequence[ServerSpec | VllmServer],
        decode: Sequence[ServerSpec | VllmServer],
        log_dir: Path,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.name = name
        self.log_dir = log_dir
        self.start_timeout_s = start_timeout_s
        self._wanted = (list(prefill), list(decode))
        self.prefill: list[VllmServer] = []
        self.decode: list[VllmServer] = []
        self.owned: list[VllmServer] = []
        self.proxy: ProxyProcess | None = None
        self.launched_at: float | None = None
        self.ready_s = 0.0

    def _server(self, item: ServerSpec | VllmServer, index: int) -> VllmServer:
        if isinstance(item, VllmServer):
            return item
        server = VllmServer(item, self.log_dir, name=f"{self.name}-{item.role}{index}")
        self.owned.append(server)
        return server

    def launch(self) -> PDCluster:
        """Start every server process this cluster owns (does not wait)."""
        if self.launched_at is None:
            self.launched_at = time.monotonic()
            prefill, decode = self._wanted
            try:
                self.prefill = [self._server(s, i) for i, s in enumerate(prefill)]
                self.decode = [self._server(s, i) for i, s in enumerate(decode)]
            except BaseException:
                self.stop()
                raise
        return self

    def wait_ready(self) -> PDCluster:
        """Launch if needed, wait for every server, then start the proxy."""
        self.launch()
        if self.proxy is not None:
            return self
        try:
            for server in [*self.decode, *self.prefill]:
                if not server.alive():
                    raise server.fail("is not running")
                server.wait_ready(self.start_timeout_s)
            self.proxy = start_proxy(
                self.prefill, self.decode, self.log_dir, name=f"{self.name}-proxy"
            )
        except BaseException:
            self.stop()
            raise
        assert self.launched_at is not None
        self.ready_s = time.monotonic() - self.launched_at
        return self

    @property
    def url(self) -> str:
        """The proxy's base URL (clients send their requests here)."""
        if self.proxy is None:
            raise ServerError(f"cluster {self.name} is not ready")
        return self.proxy.url

    def check_alive(self) -> None:
        """Raise :class:`ServerError` (with the log tail) if a process of it died."""
        for proc in [*self.prefill, *self.decode, *([self.proxy] if self.proxy else [])]:
            if not proc.alive():
                raise proc.fail("died")

    def stop(self) -> None:
        """Stop the proxy and every server this cluster launched."""
        if self.proxy is not None:
            self.proxy.stop(grace_s=5.0)
        for server in self.owned:
            server.stop()

    def __enter__(self) -> PDCluster:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
