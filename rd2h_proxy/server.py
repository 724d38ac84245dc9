"""The aiohttp P/D proxy: Decode first, rendezvous on /v1/metaserver, Prefill once.

One :class:`ProxyServer` whose request flow, below, reads as a whole; the bodies at its
edges are :mod:`rd2h_proxy.bodies`, the application around it :mod:`rd2h_proxy.serving`.

Flow of one client request (the *parent*)
-----------------------------------------
1. ``POST /v1/completions`` or ``/v1/chat/completions`` arrives. Its X-Request-Id (or a
   fresh one) names the parent; the child ids Decode will use are derived from it
   (:mod:`rd2h_proxy.payloads`). The request goes to the least-loaded Decode node
   with ``kv_transfer_params`` asking for a remote prefill, naming our metaserver URL and
   declaring it idempotent (:data:`~rd2h_protocol.rendezvous.METASERVER_IDEMPOTENT_KEY`).
   Decode's answer (status, body, or an SSE stream chunk by chunk) goes back to the client.
2. Decode posts one rendezvous per child to ``POST /v1/metaserver``. The proxy records it
   and answers at once; an identical repeat (Decode re-posts when an answer was lost) is
   answered ``duplicate`` and changes nothing. The post that completes the set starts ONE
   background dispatch of the original request to the least-loaded Prefill node (one
   token, no streaming, the rendezvous as kv_transfer_params). Dispatches are bounded in
   number (a semaphore) and in time (a timeout that includes waiting for a slot).
3. If the dispatch fails, or the rendezvous does not arrive in time, the parent fails: if
   Decode has not sent any body bytes yet, the proxy drops the Decode exchange (vLLM then
   aborts the request and frees its blocks) and answers 502/504; otherwise the failure is
   only logged and counted (Decode evidently has its KV and is generating).
4. The parent's state is removed when the client exchange is over and no dispatch for it
   is running.

Hostile clients
---------------
Client connections go through a :class:`~rd2h_proxy.connections.ConnectionGuard`
(served by :func:`~rd2h_proxy.serving.start`): at most ``max_connections`` are open, and a
request head must be complete within ``header_timeout_s``. A body must arrive whole within
``body_timeout_s`` (else 408 and the connection is closed) and may not exceed
``max_body_bytes`` (413); a JSON body nested deeper than
:data:`~rd2h_proxy.payloads.MAX_JSON_DEPTH`, or made of more than
:data:`~rd2h_proxy.payloads.MAX_JSON_CONTAINERS` arrays and objects, is a 400. A body is
held once as bytes until it is decoded, then only as the decoded request plus one encoded
copy at a time for the backend it is being sent to.

Only connection failures (the request never left the proxy) are retried, on another node:
anything else may already have reached a backend, and repeating it could run the same
children twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final

import msgspec

from rd2h_protocol.errors import MissingExtra
from rd2h_protocol.rendezvous import (
    MAX_RENDEZVOUS_BYTES,
    MalformedRendezvous,
    parse_rendezvous_json,
)
from rd2h_proxy.balancer import LeastLoaded, Node
from rd2h_proxy.config import ProxyConfig
from rd2h_proxy.payloads import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    BadRequest,
    check_json_shape,
    check_request_id,
    child_ids,
    decode_body,
    decode_json_object,
    prefill_body,
)
from rd2h_proxy.phases import P_RECV_DISPATCH_FAILED, P_TIMER_RENDEZVOUS_EXPIRED
from rd2h_proxy.registry import (
    Outcome,
    Parent,
    ParentInFlight,
    Registry,
    RendezvousRefused,
    UnknownChild,
)

try:
    import aiohttp
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtra("aiohttp", "proxy") from exc

from rd2h_proxy.bodies import (
    CLIENT_GONE,
    BodyRefused,
    json_error,
    read_body,
    refuse,
    send_slices,
    stream_error,
)
from rd2h_proxy.connections import ConnectionGuard

log = logging.getLogger("rd2h.proxy")

# Errors meaning the request never reached the backend, so another node may be tried.
_NOT_SENT: Final[tuple[type[BaseException], ...]] = (
    aiohttp.ClientConnectorError,
    getattr(aiohttp, "ConnectionTimeoutError", aiohttp.ClientConnectorError),
)
_ERROR_TEXT_LIMIT: Final = 2000


@dataclass
class ProxyStats:
    """Counters of the proxy's life (served on /healthcheck and /stats)."""

    requests: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    requests_rejected: int = 0  # 400 (bad request), 409 (id in flight), 503 (overloaded)
    decode_errors: int = 0  # Decode answered >= 400 or could not be reached
    rendezvous_recorded: int = 0
    rendezvous_duplicate: int = 0
    rendezvous_unknown: int = 0
    rendezvous_malformed: int = 0
    rendezvous_refused: int = 0
    rendezvous_timeouts: int = 0
    dispatches_started: int = 0
    dispatches_ok: int = 0
    dispatches_failed: int = 0
    dispatches_timed_out: int = 0
    failures_after_first_byte: int = 0  # parent failed while Decode was already streaming
    body_timeouts: int = 0  # a request body did not arrive within body_timeout_s (408)


@dataclass
class _Relay:
    """What the relay has sent to the client so far (read by the failure path)."""

    stream: web.StreamResponse | None = None
    body_bytes: int = 0
    failed: bool = False  # the client got an error (status or final SSE error event)


class ProxyServer:
    """State and handlers of one proxy; build it with :func:`~rd2h_proxy.serving.create_app`."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.registry = Registry()
        self.stats = ProxyStats()
        self.prefill = LeastLoaded("prefill", config.prefillers)
        self.decode = LeastLoaded("decode", config.decoders)
        self.guard = ConnectionGuard(config.max_connections, config.header_timeout_s)
        self._slots = asyncio.Semaphore(config.max_concurrent_dispatches)
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._in_flight = 0
        self._dispatches_in_flight = 0

    # -- lifecycle -------------------------------------------------------------------------

    async def session_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup context: one client session; cancel dispatches on shutdown."""
        # limit=0: the proxy's own bounds (in-flight requests, dispatch slots) apply instead.
        connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        log.info(
            "proxy ready: %d Prefill, %d Decode nodes; metaserver %s",
            len(self.prefill.nodes),
            len(self.decode.nodes),
            self.config.metaserver,
        )
        try:
            yield
        finally:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy's client session is not running (app not started)")
        return self._session

    @property
    def idle(self) -> bool:
        """True when no parent, child, dispatch or client exchange is left (leak checks)."""
        return (
            len(self.registry) == 0
            and self.registry.child_count == 0
            and not self._tasks
            and self._in_flight == 0
            and self.prefill.in_flight == 0
            and self.decode.in_flight == 0
        )

    # -- client requests -------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._generate(request, CHAT_COMPLETIONS)

    async def _generate(self, request: web.Request, api: str) -> web.StreamResponse:
        self.stats.requests += 1
        if self._in_flight >= self.config.max_inflight_requests:
            self.stats.requests_rejected += 1
            return json_error(
                503,
                f"the proxy already handles {self._in_flight} requests; retry later",
                "overloaded",
            )
        self._in_flight += 1
        try:
            return await self._generate_admitted(request, api)
        finally:
            self._in_flight -= 1

    async def _generate_admitted(self, request: web.Request, api: str) -> web.StreamResponse:
        try:
            # The raw body lives only until it is decoded.
            body = decode_json_object(await self._read_body(request, self.config.max_body_bytes))
            header_id = request.headers.get("X-Request-Id")
            parent_id = check_request_id(header_id) if header_id else uuid.uuid4().hex
            children = child_ids(api, parent_id, body)
        except BodyRefused as exc:
            self.stats.requests_rejected += 1
            return await refuse(request, exc)
        except BadRequest as exc:
            self.stats.requests_rejected += 1
            return json_error(400, str(exc), "invalid_request_error")
        forwarded = {k: v for k, v in request.headers.items() if k.lower() in ("authorization",)}
        try:
            parent = self.registry.open(parent_id, api, body, forwarded, children, time.monotonic())
        except ParentInFlight as exc:
            self.stats.requests_rejected += 1
            conflict = json_error(409, str(exc), "conflict")
            conflict.headers["Retry-After"] = "1"
            return conflict
        loop = asyncio.get_running_loop()
        parent.timer = loop.call_later(
            self.config.rendezvous_timeout_s, self._rendezvous_expired, parent
        )
        relay = _Relay()
        try:
            response = await self._serve(request, parent, relay)
        finally:
            self.registry.close_client(parent)
        if relay.failed or response.status >= 400:
            self.stats.requests_failed += 1
        else:
            self.stats.requests_ok += 1
        return response

    async def _read_body(self, request: web.Request, limit: int) -> bytearray:
        """The request body (:func:`read_body`); one that came too slowly: ``body_timeouts``."""
        try:
            return await read_body(request, limit, self.config.body_timeout_s)
        except BodyRefused as exc:
            if exc.status == 408:  # the body did not arrive within body_timeout_s
                self.stats.body_timeouts += 1
            raise

    async def _serve(
        self, request: web.Request, parent: Parent, relay: _Relay
    ) -> web.StreamResponse:
        forward = asyncio.ensure_future(self._forward(request, parent, relay))
        failed = asyncio.ensure_future(parent.failed.wait())
        try:
            done, _ = await asyncio.wait({forward, failed}, return_when=asyncio.FIRST_COMPLETED)
            if forward in done:
                return forward.result()
            if relay.body_bytes > 0:
                # Decode is already answering, so it has its KV: let it finish.
                self.stats.failures_after_first_byte += 1
                log.warning(
                    "request %s: %s after Decode started answering; keeping the answer",
                    parent.parent_id,
                    parent.failure[1] if parent.failure else "failure",
                )
                return await forward
        finally:
            failed.cancel()
            if not forward.done():
                forward.cancel()
                await asyncio.gather(forward, return_exceptions=True)
        status, message = parent.failure or (502, "request failed")
        log.warning("request %s failed: %s", parent.parent_id, message)
        relay.failed = True
        if relay.stream is not None:
            await stream_error(relay.stream, status, message)
            return relay.stream
        return json_error(status, message, "upstream_error")

    async def _forward(
        self, request: web.Request, parent: Parent, relay: _Relay
    ) -> web.StreamResponse:
        """Send the request to a Decode node and relay its answer."""
        headers = {
            **parent.headers,
            "X-Request-Id": parent.parent_id,
            "Content-Type": "application/json",
        }
        timeout = aiohttp.ClientTimeout(
            total=self.config.decode_timeout_s, sock_connect=self.config.connect_timeout_s
        )
        tried: set[int] = set()
        last_error = "no Decode node configured"
        while (node := self.decode.acquire(exclude=tried)) is not None:
            try:
                async with self._post_json(
                    node.url + parent.api,
                    decode_body(parent.body, self.config.metaserver),
                    headers,
                    timeout,
                ) as resp:
                    return await self._relay(request, parent, resp, relay)
            except _NOT_SENT as exc:
                node.failures += 1
                tried.add(node.index)
                last_error = f"Decode {node.url} unreachable: {exc}"
                log.warning("request %s: %s", parent.parent_id, last_error)
            except asyncio.TimeoutError:
                node.failures += 1
                self.stats.decode_errors += 1
                return await self._relay_failed(
                    relay, 504, f"Decode {node.url} did not finish within the timeout"
                )
            except aiohttp.ClientError as exc:
                node.failures += 1
                self.stats.decode_errors += 1
                return await self._relay_failed(relay, 502, f"Decode {node.url} failed: {exc}")
            finally:
                self.decode.release(node)
        self.stats.decode_errors += 1
        return json_error(502, last_error, "upstream_error")

    def _post_json(
        self,
        url: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        timeout: aiohttp.ClientTimeout,
    ) -> contextlib.AbstractAsyncContextManager[aiohttp.ClientResponse]:
        """POST ``body`` as JSON. The encoded bytes are referenced only by the upload, so they
        are freed as soon as it is sent (a Decode exchange then streams for minutes)."""
        payload = msgspec.json.encode(body)
        return self.session.post(
            url,
            data=send_slices(payload),
            headers={**headers, "Content-Length": str(len(payload))},
            timeout=timeout,
        )

    async def _relay_failed(self, relay: _Relay, status: int, message: str) -> web.StreamResponse:
        log.warning("%s", message)
        relay.failed = True
        if relay.stream is not None:
            # Headers are out: the status cannot change, so end the stream with an error event.
            await stream_error(relay.stream, status, message)
            return relay.stream
        return json_error(status, message, "upstream_error")

    async def _relay(
        self,
        request: web.Request,
        parent: Parent,
        resp: aiohttp.ClientResponse,
        relay: _Relay,
    ) -> web.StreamResponse:
        content_type = resp.headers.get("Content-Type", "application/json")
        out_headers = {"Content-Type": content_type, "X-Request-Id": parent.parent_id}
        if resp.status >= 400 or not content_type.startswith("text/event-stream"):
            data = await resp.read()
            relay.body_bytes += len(data)
            if resp.status >= 400:
                self.stats.decode_errors += 1
                log.warning(
                    "request %s: Decode answered %d: %s",
                    parent.parent_id,
                    resp.status,
                    data[:_ERROR_TEXT_LIMIT].decode(errors="replace"),
                )
            return web.Response(status=resp.status, body=data, headers=out_headers)
        stream = web.StreamResponse(status=resp.status, headers=out_headers)
        stream.headers["Cache-Control"] = "no-cache"
        relay.stream = stream
        await stream.prepare(request)
        try:
            async for chunk in resp.content.iter_any():
                relay.body_bytes += len(chunk)
                await stream.write(chunk)
            await stream.write_eof()
        except CLIENT_GONE:
            # The client left; leaving the `async with` closes the Decode connection, which
            # makes vLLM abort the request and free its blocks.
            log.info("request %s: client went away during streaming", parent.parent_id)
        return stream

    def _rendezvous_expired(self, parent: Parent) -> None:
        parent.timer = None
        missing = [c for c in parent.children if c not in parent.posted]
        first = missing[0] if missing else None
        if self.registry.fail(
            parent,
            P_TIMER_RENDEZVOUS_EXPIRED,
            504,
            f"Decode did not post the rendezvous of {len(missing)} of "
            f"{len(parent.children)} child requests within "
            f"{self.config.rendezvous_timeout_s:g} s (first missing: {first!r})",
        ):
            self.stats.rendezvous_timeouts += 1

    # -- metaserver ------------------------------------------------------------------------

    async def metaserver(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/metaserver: record a child's rendezvous and answer at once."""
        try:
            data = await self._read_body(
                request, min(MAX_RENDEZVOUS_BYTES, self.config.max_body_bytes)
            )
        except BodyRefused as exc:
            self.stats.rendezvous_malformed += 1
            return await refuse(request, exc)
        try:
            check_json_shape(data, "the rendezvous body")
            rendezvous, raw = parse_rendezvous_json(bytes(data))
        except (BadRequest, MalformedRendezvous) as exc:
            self.stats.rendezvous_malformed += 1
            return json_error(400, str(exc), "invalid_request_error")
        # Normalised known fields over the raw object: keys a newer Decode adds pass through.
        params: dict[str, Any] = {**raw, **rendezvous.to_params()}
        try:
            parent, outcome = self.registry.record(rendezvous.request_id, params)
        except UnknownChild as exc:
            self.stats.rendezvous_unknown += 1
            return json_error(404, str(exc), "not_found")
        except RendezvousRefused as exc:
            self.stats.rendezvous_refused += 1
            return json_error(exc.status, str(exc), "conflict")
        if outcome is Outcome.DUPLICATE:
            self.stats.rendezvous_duplicate += 1
        else:
            self.stats.rendezvous_recorded += 1
        if outcome is Outcome.READY:
            self._keep(asyncio.ensure_future(self._dispatch(parent)))
        return web.json_response(
            {
                "status": outcome.value,
                "request_id": rendezvous.request_id,
                "posted": len(parent.posted),
                "expected": len(parent.children),
            }
        )

    def _keep(self, task: asyncio.Future[None]) -> None:
        assert isinstance(task, asyncio.Task)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- Prefill dispatch ------------------------------------------------------------------

    async def _dispatch(self, parent: Parent) -> None:
        """Send the original request to Prefill once; never raises."""
        self.stats.dispatches_started += 1
        self._dispatches_in_flight += 1
        try:
            await asyncio.wait_for(self._dispatch_once(parent), self.config.dispatch_timeout_s)
        except asyncio.TimeoutError:
            self.stats.dispatches_timed_out += 1
            self._dispatch_failed(
                parent,
                504,
                f"Prefill did not answer within {self.config.dispatch_timeout_s:g} s",
            )
        except _DispatchFailed as exc:
            self.stats.dispatches_failed += 1
            self._dispatch_failed(parent, 502, str(exc))
        except asyncio.CancelledError:
            raise  # shutdown
        except Exception as exc:  # never let a dispatch bug take the proxy down
            log.exception("request %s: Prefill dispatch crashed", parent.parent_id)
            self.stats.dispatches_failed += 1
            self._dispatch_failed(parent, 502, f"Prefill dispatch failed: {exc!r}")
        else:
            self.stats.dispatches_ok += 1
            self.registry.dispatch_succeeded(parent)
        finally:
            self._dispatches_in_flight -= 1
            self.registry.finish_dispatch(parent)

    def _dispatch_failed(self, parent: Parent, status: int, message: str) -> None:
        log.warning("request %s: %s", parent.parent_id, message)
        self.registry.fail(parent, P_RECV_DISPATCH_FAILED, status, message)

    async def _dispatch_once(self, parent: Parent) -> None:
        headers = {
            **parent.headers,
            "X-Request-Id": parent.parent_id,
            "Content-Type": "application/json",
        }
        timeout = aiohttp.ClientTimeout(sock_connect=self.config.connect_timeout_s)
        async with self._slots:
            tried: set[int] = set()
            last_error = "no Prefill node configured"
            while (node := self.prefill.acquire(exclude=tried)) is not None:
                try:
                    async with self._post_json(
                        node.url + parent.api,
                        prefill_body(parent.body, parent.children, parent.posted),
                        headers,
                        timeout,
                    ) as resp:
                        text = await resp.read()
                        if resp.status >= 400:
                            node.failures += 1
                            snippet = text[:_ERROR_TEXT_LIMIT].decode(errors="replace")
                            raise _DispatchFailed(
                                f"Prefill {node.url} answered {resp.status}: {snippet}"
                            )
                        return
                except _NOT_SENT as exc:
                    node.failures += 1
                    tried.add(node.index)
                    last_error = f"Prefill {node.url} unreachable: {exc}"
                    log.warning("request %s: %s", parent.parent_id, last_error)
                except aiohttp.ClientError as exc:
                    node.failures += 1
                    raise _DispatchFailed(f"Prefill {node.url} failed: {exc}") from None
                finally:
                    self.prefill.release(node)
            raise _DispatchFailed(last_error)

    # -- operations ------------------------------------------------------------------------

    async def healthcheck(self, request: web.Request) -> web.Response:
        """GET /healthcheck: liveness plus the main counters."""
        return web.json_response(
            {
                "status": "ok",
                "prefill_instances": len(self.prefill.nodes),
                "decode_instances": len(self.decode.nodes),
                "requests_in_flight": self._in_flight,
                "dispatches_in_flight": self._dispatches_in_flight,
                "stats": asdict(self.stats),
                "connections": asdict(self.guard.stats),
            }
        )

    async def stats_handler(self, request: web.Request) -> web.Response:
        """GET /stats: counters, per-node load and the size of the per-parent state."""
        return web.json_response(
            {
                "stats": asdict(self.stats),
                "connections": asdict(self.guard.stats),
                "requests_in_flight": self._in_flight,
                "dispatches_in_flight": self._dispatches_in_flight,
                "parents": len(self.registry),
                "children": self.registry.child_count,
                "nodes": [n.as_dict() for n in (*self.prefill.nodes, *self.decode.nodes)],
            }
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """POST /reset_prefix_cache: fan out to every node, report each node's result."""
        timeout = aiohttp.ClientTimeout(
            total=self.config.reset_timeout_s, sock_connect=self.config.connect_timeout_s
        )
        query = request.query_string
        nodes = (*self.prefill.nodes, *self.decode.nodes)
        results = await asyncio.gather(*(self._reset_one(n, query, timeout) for n in nodes))
        ok = all(r["ok"] for r in results)
        return web.json_response({"ok": ok, "results": list(results)}, status=200 if ok else 502)

    async def _reset_one(
        self, node: Node, query: str, timeout: aiohttp.ClientTimeout
    ) -> dict[str, Any]:
        url = node.url + "/reset_prefix_cache" + (f"?{query}" if query else "")
        result: dict[str, Any] = {"role": node.role, "url": node.url}
        try:
            async with self.session.post(url, timeout=timeout) as resp:
                text = await resp.text(errors="replace")
                result.update(status=resp.status, ok=resp.status < 400)
                if resp.status >= 400:
                    result["error"] = text[:_ERROR_TEXT_LIMIT]
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            result.update(status=None, ok=False, error=f"{type(exc).__name__}: {exc}")
        return result


class _DispatchFailed(Exception):
    """The Prefill dispatch failed; the message says where and how."""
