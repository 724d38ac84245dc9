"""Configuration of the P/D proxy and its command line.

The flags ``--host --port --prefiller-hosts --prefiller-ports --decoder-hosts
--decoder-ports`` keep the meaning they have in the deployment guide's proxy, so existing
launch scripts work unchanged; the other flags bound what the proxy may hold or wait for.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from rd2h_protocol.errors import ConfigError

_WILDCARD_NAMES = frozenset({"", "*"})


def _bare_host(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_wildcard(host: str) -> bool:
    """True for an address that means "every interface" (``0.0.0.0``, ``::`` and spellings)."""
    bare = _bare_host(host.strip())
    if bare in _WILDCARD_NAMES:
        return True
    try:
        return ipaddress.ip_address(bare).is_unspecified
    except ValueError:
        return False  # a host name, not an address literal


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback address literals."""
    bare = _bare_host(host.strip())
    if bare.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def http_base(host: str, port: int) -> str:
    """``http://host:port`` with an IPv6 literal in brackets."""
    bare = _bare_host(host)
    try:
        if isinstance(ipaddress.ip_address(bare), ipaddress.IPv6Address):
            return f"http://[{bare}]:{port}"
    except ValueError:
        pass
    return f"http://{bare}:{port}"


@dataclass(frozen=True, slots=True)
class Backend:
    """One vLLM OpenAI server (a Prefill or a Decode node)."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("a backend host must not be empty")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"backend port must be in 1..65535, got {self.port}")

    @property
    def base_url(self) -> str:
        """Root URL of the server, e.g. ``http://10.0.0.5:8100``."""
        return http_base(self.host, self.port)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Everything the proxy needs; validated on construction (:class:`ConfigError`).

    ``metaserver_url`` defaults to ``http://<host>:<port>/v1/metaserver``: Decode nodes post
    their rendezvous there, so it must be an address they can reach. That is why a wildcard
    ``host`` is refused unless ``metaserver_url`` names the reachable address explicitly.
    """

    host: str
    port: int
    prefillers: tuple[Backend, ...]
    decoders: tuple[Backend, ...]
    metaserver_url: str | None = None
    #: Prefill dispatches running at once; more wait for a slot.
    max_concurrent_dispatches: int = 64
    #: Bound on one Prefill dispatch, waiting for a slot included (seconds). A dispatch is
    #: the whole prompt's prefill on one Prefill node (one token, no streaming): its queue
    #: there, the prefill of a long prompt, and the wait for one of the
    #: ``max_concurrent_dispatches`` slots. On expiry the request fails with 504 (the client
    #: sees it unless Decode is already answering, which proves it got its KV).
    dispatch_timeout_s: float = 300.0
    #: How long the children of a request may take to post their rendezvous (seconds),
    #: counted from the client's request. Decode posts a child's rendezvous to
    #: /v1/metaserver only once its scheduler has admitted the request and allocated its KV
    #: blocks, so a loaded Decode node may queue it for minutes; nothing is dispatched to
    #: Prefill before the last child has posted. On expiry the request fails with 504.
    rendezvous_timeout_s: float = 600.0
    #: TCP connect timeout toward any backend (seconds).
    connect_timeout_s: float = 10.0
    #: Bound on one whole Decode exchange, streaming included (seconds): the rendezvous and
    #: the Prefill dispatch happen inside it, then a long generation may stream for up to an
    #: hour. It ends the exchange even while tokens are still flowing.
    decode_timeout_s: float = 3600.0
    #: Client requests handled at once; more are answered 503.
    max_inflight_requests: int = 4096
    #: Largest client request body accepted (bytes); a larger one is answered 413. At its
    #: peak the proxy holds about twice a text body per request: the raw bytes until they
    #: are decoded, then the decoded request plus one encoded copy for Decode or Prefill at
    #: a time (more for a long token-id list, whose decoded form outweighs its JSON).
    max_body_bytes: int = 64 << 20
    #: Bound on each node's answer to /reset_prefix_cache (seconds).
    reset_timeout_s: float = 30.0
    #: Time a client has to send a complete request head, the request line and headers
    #: (seconds), counted from the connection's accept or, on a kept-alive connection, from
    #: the first byte of the next request; then the connection is closed without an answer.
    #: Real clients send a head in one write, so 10 s is generous even over a slow link, and
    #: it frees a connection that trickles its head a byte at a time (slowloris) quickly.
    header_timeout_s: float = 10.0
    #: Time a client has to send the whole request body once its head is in (seconds). A
    #: deadline for the body, not an idle timer between chunks: a client trickling a byte
    #: now and then is cut as surely as one that stops. 60 s lets the largest body (64 MiB)
    #: arrive at 1.1 MB/s, far below any link a serving client uses. A late body is answered
    #: 408, then the connection is closed.
    body_timeout_s: float = 60.0
    #: Client TCP connections open at once, idle keep-alive ones and Decode's rendezvous
    #: posts included; more are answered 503 and closed at once. Twice
    #: ``max_inflight_requests``: each request in flight holds its client connection, and
    #: Decode must still reach /v1/metaserver for it, so legitimate load meets the 503 of
    #: ``max_inflight_requests`` first and the cap bounds only idle or hostile connections
    #: (and the file descriptors they cost). ``rd2h proxy`` raises its open-file soft limit
    #: to cover it at start.
    max_connections: int = 8192

    def __post_init__(self) -> None:
        if not self.prefillers:
            raise ConfigError("at least one Prefill node is required (--prefiller-ports)")
        if not self.decoders:
            raise ConfigError("at least one Decode node is required (--decoder-ports)")
        if self.metaserver_url is None:
            if is_wildcard(self.host):
                raise ConfigError(
                    f"--host {self.host!r} is a wildcard address. Decode nodes post their "
                    "rendezvous to http://<host>:<port>/v1/metaserver, so <host> must be an "
                    "address they can reach: pass this machine's concrete IP or host name "
                    "(or bind the wildcard and name the reachable URL with --metaserver-url)"
                )
            if not 1 <= self.port <= 65535:
                raise ConfigError(
                    f"--port must be in 1..65535 (it is part of the metaserver URL handed to "
                    f"Decode), got {self.port}"
                )
        elif not self.metaserver_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"--metaserver-url must be an http(s) URL, got {self.metaserver_url!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        for name in (
            "max_concurrent_dispatches",
            "max_inflight_requests",
            "max_body_bytes",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in (
            "dispatch_timeout_s",
            "rendezvous_timeout_s",
            "connect_timeout_s",
            "decode_timeout_s",
            "reset_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def metaserver(self) -> str:
        """The URL handed to Decode in kv_transfer_params."""
        if self.metaserver_url is not None:
            return self.metaserver_url
        return f"{http_base(self.host, self.port)}/v1/metaserver"

    def loopback_mismatch(self) -> list[str]:
        """Decode hosts that cannot reach a loopback metaserver (empty when all is well)."""
        if self.metaserver_url is not None or not is_loopback(self.host):
            return []
        return sorted({d.host for d in self.decoders if not is_loopback(d.host)})


def pair_backends(hosts: Sequence[str], ports: Sequence[int], role: str) -> tuple[Backend, ...]:
    """Zip host and port lists; one host may serve several ports."""
    flag = "prefiller" if role == "prefill" else "decoder"
    if len(hosts) == 1 and len(ports) > 1:
        hosts = list(hosts) * len(ports)
    if len(hosts) != len(ports):
        raise ConfigError(
            f"--{flag}-hosts has {len(hosts)} entries but --{flag}-ports has {len(ports)}: "
            "give one port per host (or a single host for all ports)"
        )
    return tuple(Backend(h, p) for h, p in zip(hosts, ports, strict=True))


def build_parser(prog: str = "rd2h proxy") -> argparse.ArgumentParser:
    """The command line of ``rd2h proxy``."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "OpenAI-compatible Prefill/Decode proxy: sends each request to a Decode node "
            "first, collects the Decode rendezvous on /v1/metaserver, then dispatches the "
            "request once to a Prefill node."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind; must be reachable")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--prefiller-hosts", nargs="+", default=["127.0.0.1"], metavar="HOST")
    p.add_argument("--prefiller-ports", nargs="+", type=int, required=True, metavar="PORT")
    p.add_argument("--decoder-hosts", nargs="+", default=["127.0.0.1"], metavar="HOST")
    p.add_argument("--decoder-ports", nargs="+", type=int, required=True, metavar="PORT")
    p.add_argument(
        "--metaserver-url",
        default=None,
        help="URL Decode posts rendezvous to (default http://HOST:PORT/v1/metaserver)",
    )
    p.add_argument("--max-concurrent-dispatches", type=int, default=64, metavar="N")
    p.add_argument("--dispatch-timeout", type=float, default=300.0, metavar="SECONDS")
    p.add_argument("--rendezvous-timeout", type=float, default=600.0, metavar="SECONDS")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS")
    p.add_argument("--decode-timeout", type=float, default=3600.0, metavar="SECONDS")
    p.add_argument("--max-inflight-requests", type=int, default=4096, metavar="N")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20, metavar="BYTES")
    p.add_argument("--reset-timeout", type=float, default=30.0, metavar="SECONDS")
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="time a client has to send a request's line and headers (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="time a client has to send a whole request body; then 408 (default 60)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=8192,
        metavar="N",
        help="client connections open at once; more are answered 503 (default 8192)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """Build and validate a :class:`ProxyConfig` from parsed arguments."""
    return ProxyConfig(
        host=args.host,
        port=args.port,
        prefillers=pair_backends(args.prefiller_hosts, args.prefiller_ports, "prefill"),
        decoders=pair_backends(args.decoder_hosts, args.decoder_ports, "decode"),
        metaserver_url=args.metaserver_url,
        max_concurrent_dispatches=args.max_concurrent_dispatches,
        dispatch_timeout_s=args.dispatch_timeout,
        rendezvous_timeout_s=args.rendezvous_timeout,
        connect_timeout_s=args.connect_timeout,
        decode_timeout_s=args.decode_timeout,
        max_inflight_requests=args.max_inflight_requests,
        max_body_bytes=args.max_body_bytes,
        reset_timeout_s=args.reset_timeout,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
    )
