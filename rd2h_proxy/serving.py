"""How a :class:`~rd2h_proxy.server.ProxyServer` is served: the aiohttp application and
its routes, the guarded site, the open-file limit and the process that runs until a signal.

Apart from :mod:`rd2h_proxy.server` because it is the process's plumbing around the
handlers (routes, listening socket, signals, resource limits), while the server holds one
client request's flow from Decode to Prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Final

from rd2h_protocol.errors import MissingExtra
from rd2h_proxy.config import ProxyConfig
from rd2h_proxy.server import ProxyServer

try:
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtra("aiohttp", "proxy") from exc

from rd2h_proxy.connections import GuardedSite

__all__ = ["SERVER_KEY", "create_app", "raise_open_file_limit", "run", "start"]

log = logging.getLogger("rd2h.proxy")

#: How long an idle kept-alive client connection stays open (aiohttp's run_app default).
_KEEPALIVE_TIMEOUT_S: Final = 75.0

#: Where :func:`create_app` keeps the :class:`ProxyServer` of an application.
SERVER_KEY: Final = web.AppKey("rd2h_proxy_server", ProxyServer)


def create_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application; serve it with :func:`start` (or :func:`run`).

    The :class:`ProxyServer` is reachable as ``app[SERVER_KEY]``. Another runner serves it
    too, without the connection cap and header deadline (those need :func:`start`'s site);
    run it with ``handler_cancellation=True`` so a client that disconnects stops its Decode
    exchange.
    """
    server = ProxyServer(config)

    @web.middleware
    async def report_requests(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # aiohttp calls the application only once a request head is complete.
        server.guard.request_started(request.protocol)
        try:
            return await handler(request)
        finally:
            server.guard.request_finished(request.protocol)

    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[report_requests],
        handler_args={"keepalive_timeout": _KEEPALIVE_TIMEOUT_S},
    )
    app[SERVER_KEY] = server
    app.cleanup_ctx.append(server.session_ctx)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_post("/v1/metaserver", server.metaserver)
    app.router.add_get("/healthcheck", server.healthcheck)
    app.router.add_get("/stats", server.stats_handler)
    app.router.add_post("/reset_prefix_cache", server.reset_prefix_cache)
    return app


async def start(
    app: web.Application,
    *,
    host: str | None = None,
    port: int = 0,
    sock: socket.socket | None = None,
) -> web.AppRunner:
    """Serve a :func:`create_app` application on ``host:port`` (or a bound ``sock``).

    Its connections go through the application's guard (connection cap, header deadline).
    Stop it with ``await runner.cleanup()``.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = GuardedSite(runner, app[SERVER_KEY].guard, host=host, port=port, sock=sock)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def raise_open_file_limit(config: ProxyConfig) -> None:
    """Raise the soft open-file limit to what ``max_connections`` implies, as far as allowed.

    Each client request in flight also holds a Decode connection, a dispatch a Prefill one;
    a soft limit below that makes the proxy fail on EMFILE before the cap can refuse anyone.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return
    need = (
        config.max_connections
        + config.max_inflight_requests
        + config.max_concurrent_dispatches
        + 256  # listening socket, backend pools' idle connections, logs, the loop's own
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft < need:
        log.warning(
            "open-file limit %d is below the ~%d that --max-connections %d implies (client "
            "connections plus backend connections); lower --max-connections or raise the "
            "limit (ulimit -n)",
            soft,
            need,
            config.max_connections,
        )


async def _serve(config: ProxyConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows
            loop.add_signal_handler(signum, stop.set)
    runner = await start(create_app(config), host=config.host, port=config.port)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(config: ProxyConfig) -> None:
    """Serve until SIGINT or SIGTERM."""
    for host in config.loopback_mismatch():
        log.warning(
            "Decode host %s cannot reach the metaserver on loopback %s; use a reachable --host",
            host,
            config.host,
        )
    raise_open_file_limit(config)
    asyncio.run(_serve(config))
