"""The scheduler side of the connector: per-request bookkeeping and the worker metadata.

Each step's metadata is made of the types in :mod:`rd2h_vllm.metadata` (with the
worker-side contract); the rendezvous posting seam is :mod:`rd2h_vllm.rendezvous_posts`.

Theory of operation
-------------------
vLLM 0.32's scheduler drives a connector like this (vllm/v1/core/sched/scheduler.py):

* A waiting request is first offered to ``get_num_new_matched_tokens(request,
  num_computed_tokens)`` (``num_computed_tokens`` = its block-aligned LOCAL prefix hit).
  It may be asked more than once for one request, so it must not change state.
* If blocks could be allocated, ``update_state_after_alloc(request, blocks,
  num_external_tokens)`` follows, with ALL the request's blocks (cached and new, every
  KV-cache group) and the external token count the scheduler accepted. It is called only
  on this waiting -> scheduled path; later chunks of a running request allocate without
  it, so Prefill reads a request's current blocks from
  ``scheduler_output.kv_connector_block_state`` at metadata time instead.
* An asynchronous load (``(n, True)``) puts the request in WAITING_FOR_REMOTE_KVS. It
  leaves that state when every worker listed it in ``finished_recving`` (vLLM's
  KVOutputAggregator counts one report per worker), failed or not; a failed load also
  lists its blocks in ``invalid_block_ids`` (from ``get_block_ids_with_load_errors``).
* ``build_connector_meta(scheduler_output)`` runs once per step at the end of
  ``schedule()``, BEFORE the scheduled requests' ``num_computed_tokens`` advance; its
  result reaches every worker as ``scheduler_output.kv_connector_metadata``.
* ``update_connector_output(output)`` sees the workers' aggregated output first thing in
  ``update_from_output``.
* ``request_finished`` (``request_finished_all_groups`` with HMA) is called once when a
  request ends (finished or aborted). Returning True keeps its blocks until the id shows
  up in a later ``finished_sending`` or ``finished_recving``. A request aborted while in
  WAITING_FOR_REMOTE_KVS is kept by vLLM itself until ``finished_recving``.

Decode (kv_consumer): a request whose ``kv_transfer_params`` say ``do_remote_prefill``
reports its remaining prompt tokens as matched asynchronously; after allocation its
destination block ids are recorded (they never leave Decode), its rendezvous is queued
and ``do_remote_prefill`` is cleared. :meth:`SchedulerSide.build_connector_meta` hands the
worker the new destinations (:class:`LoadSpec`) and only THEN posts the rendezvous, so
the worker knows the destinations no later than Prefill can learn of the request. The
post is retried only as :mod:`rd2h_vllm.metaserver` allows: a metaserver that declares
itself idempotent in ``kv_transfer_params`` (``rd2h proxy``) may get a repeat, any other
(the existing example proxy) gets a delivered post once. A rendezvous that cannot be
delivered becomes a :class:`LoadFailure` in a later step's metadata: the worker fails the
request, reports its blocks as load errors and lists it in ``finished_recving`` once no
read of it is in flight. ``request_finished`` cancels the request's post if it is still
pending (an example proxy answers only after its Prefill dispatch) and delays the free of
a request whose load is still in progress (required-departures.md item 5).

Prefill (kv_producer): a request whose ``kv_transfer_params`` say ``do_remote_decode``
picks its own rendezvous (:func:`~rd2h_protocol.rendezvous.params_for_child`, so the
children of a prompt list each find theirs). Every step that computes some of its
prompt adds a :class:`SendSpec`: its current block ids per group, the tokens Decode
already holds, the tokens already published and the tokens computed once this step has
run, and whether this step finishes the prompt. The worker turns that into block ranges
with :func:`~rd2h_protocol.topology.chunk_block_range`. A prompt-list child without a
usable batch entry of its own is still computed, but its KV has nowhere to go: a
:class:`SendAbort` names it and the Decode engine of the list's top-level rendezvous
(child 0's; every child runs there), and the worker aborts it toward that Decode. A v2
Decode fails the child at once; a v1 Decode, which has no ABORT message, still fails it
on its load timeout. ``request_finished`` keeps the blocks of a request that published
anything until the workers list it in ``finished_sending`` (every Decode read of it is
over), because vLLM may hand freed blocks to another request (and zero them) before the
next forward pass.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rd2h_protocol.claim import (
    CLAIM_VERSION,
    KeptSource,
    is_kept_params,
    is_prefill_first,
    kept_params,
    kept_source_from_params,
)
from rd2h_protocol.errors import ConfigError, ErrorCode, ProtocolError
from rd2h_protocol.rendezvous import (
    BATCH_PARAMS_KEY,
    METASERVER_IDEMPOTENT_KEY,
    METASERVER_KEY,
    Rendezvous,
    params_for_child,
    rendezvous_from_params,
)
from rd2h_protocol.topology import external_request_id
from rd2h_runtime.trace import open_marks
from rd2h_vllm.config import Rd2hConfig
from rd2h_vllm.metadata import (
    CacheGroups,
    DecodeTarget,
    LoadFailure,
    LoadSpec,
    Rd2hConnectorMetadata,
    SendAbort,
    SendSpec,
    decode_target,
)
from rd2h_vllm.metaserver import PostResult
from rd2h_vllm.metrics import Rd2hKVConnectorStats
from rd2h_vllm.rendezvous_posts import Poster, QueuedPost, post_failure

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


# -- the scheduler side ---------------------------------------------------------------------


@dataclass
class _SendState:
    request: Request
    ext_id: str
    target: DecodeTarget | None  # None: Prefill-first (kept for the Decode that claims it)
    remote_cached_tokens: int
    transferred_tokens: int = 0
    published: bool = False  # a SendSpec went to the workers
    final_sent: bool = False
    finished: bool = False  # request_finished returned True; waiting for finished_sending


class SchedulerSide:
    """The connector's scheduler half for one role (see the module docstring).

    ``poster`` is required on Decode; ``host`` is the address posted in rendezvous, and
    on Prefill the one its Prefill-first answers name (default:
    ``config.advertise_host``, else vLLM's ``get_ip()``).
    """

    def __init__(
        self,
        config: Rd2hConfig,
        kv_cache_config: KVCacheConfig,
        *,
        poster: Poster | None = None,
        host: str | None = None,
    ) -> None:
        self.config = config
        self.groups = CacheGroups.from_kv_cache_config(kv_cache_config)
        self.stats = Rd2hKVConnectorStats()
        if config.is_consumer and poster is None:
            raise ConfigError("Decode's scheduler side needs a rendezvous poster")
        if host is None:
            host = config.advertise_host
        if host is None:
            from vllm.utils.network_utils import get_ip

            host = get_ip()
        self._poster = poster
        self._host = host or ""
        # Decode
        self._loading: dict[str, LoadSpec] = {}
        self._new_loads: list[LoadSpec] = []
        self._to_post: list[QueuedPost] = []
        # Shared with the poster's thread (its done callbacks): posts still pending by
        # req_id, and the failures they ended with.
        self._posts_lock = threading.Lock()
        self._posting: dict[str, concurrent.futures.Future[PostResult]] = {}
        self._failures: list[LoadFailure] = []
        # Prefill
        self._sending: dict[str, _SendState] = {}
        self._new_send_aborts: list[SendAbort] = []
        # With tracing on: this side's marks (`rd2h trace requests` joins them with the
        # workers' traces), and the loaded requests whose first step is not scheduled yet.
        self._marks = open_marks(
            config.trace_dir, "decode scheduler" if config.is_consumer else "prefill scheduler"
        )
        self._unscheduled: dict[str, str] = {}

    # -- introspection (tests, invariant checks) ---------------------------------------

    def loading(self) -> dict[str, LoadSpec]:
        """Decode requests whose load is not yet reported finished by every worker."""
        return dict(self._loading)

    def posting(self) -> set[str]:
        """Decode requests whose rendezvous post has not ended yet."""
        with self._posts_lock:
            return set(self._posting)

    def sending(self) -> dict[str, bool]:
        """Prefill requests tracked, with whether their blocks are held after finishing."""
        return {req_id: state.finished for req_id, state in self._sending.items()}

    def is_idle(self) -> bool:
        """No per-request state left (every map has drained)."""
        return not (
            self._loading
            or self._new_loads
            or self._to_post
            or self.posting()
            or self._sending
            or self._new_send_aborts
        )

    # -- vLLM hooks ----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Decode: the prompt tokens not held locally, loaded asynchronously. No side effect."""
        if not self.config.is_consumer:
            return 0, False
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if not params.get(METASERVER_KEY) and not is_kept_params(params):
            # Nobody can tell Prefill, nor is a Prefill keeping the KV: compute locally.
            logger.warning(
                "request %s asks for a remote prefill but its kv_transfer_params name "
                "neither %r (rd2h proxy, Decode-first) nor %r (an rd2h Prefill's answer "
                "behind a standard router; was Prefill run with another connector?); "
                "computing it locally",
                request.request_id,
                METASERVER_KEY,
                "rd2h_claim_version",
            )
            self.stats.record_failure(ErrorCode.MALFORMED)
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Decode: record destinations and queue the rendezvous. Prefill: take the
        request's rendezvous."""
        params = request.kv_transfer_params
        if not params:
            return
        if self.config.is_consumer:
            if not params.get("do_remote_prefill"):
                return
            if params.get(METASERVER_KEY):
                self._decode_after_alloc(request, blocks, num_external_tokens, params)
            elif is_kept_params(params):
                self._claim_after_alloc(request, blocks, num_external_tokens, params)
            spec = self._loading.get(request.request_id)
            if spec is not None:
                self._mark("admitted", spec.req_id, spec.ext_id)
        elif params.get("do_remote_decode") and request.request_id not in self._sending:
            if is_prefill_first(params):
                self._keep_after_alloc(request)
            else:
                self._prefill_after_alloc(request, params)
            state = self._sending.get(request.request_id)
            if state is not None:
                self._mark("admitted", request.request_id, state.ext_id)

    def _decode_after_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
        params: dict[str, Any],
    ) -> None:
        req_id = request.request_id
        ext_id = external_request_id(req_id)
        local_tokens = request.num_prompt_tokens - num_external_tokens
        # Clear first: a later lookup of this request (preemption) must not start again.
        params["do_remote_prefill"] = False
        rendezvous = Rendezvous(
            request_id=ext_id,
            remote_engine_id=self.config.engine_id,
            remote_host=self._host,
            remote_port=self._base_port,
            remote_tp_size=self.config.tp_size,
            remote_cached_tokens=local_tokens,
        )
        # Posted even when nothing is to be loaded (a full local hit): the proxy waits for
        # every child's rendezvous before it dispatches the prompt to Prefill.
        self._to_post.append(
            QueuedPost(
                req_id=req_id,
                url=str(params[METASERVER_KEY]),
                rendezvous=rendezvous,
                idempotent=params.get(METASERVER_IDEMPOTENT_KEY) is True,
            )
        )
        if num_external_tokens <= 0:
            return
        main, indexer = self.groups.split(blocks.get_block_ids())
        spec = LoadSpec(
            req_id=req_id,
            ext_id=ext_id,
            main_block_ids=main,
            indexer_block_ids=indexer,
            local_tokens=local_tokens,
            num_tokens=num_external_tokens,
        )
        self._loading[req_id] = spec
        self._new_loads.append(spec)

    def _claim_after_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
        params: dict[str, Any],
    ) -> None:
        """Decode, Prefill-first: load from the Prefill that kept the request; the worker
        claims it there. Unusable parameters fail the load (``kv_load_failure_policy``
        then decides) with a WARNING naming the field at fault."""
        req_id = request.request_id
        failure: str | None = None
        source: KeptSource | None = None
        try:
            source = kept_source_from_params(params)
            self.config.check_peer(source.remote_tp_size)
        except ProtocolError as exc:
            failure = exc.message
        params["do_remote_prefill"] = False  # a later lookup (preemption) must not start again
        if num_external_tokens <= 0:
            return
        local_tokens = request.num_prompt_tokens - num_external_tokens
        main, indexer = self.groups.split(blocks.get_block_ids())
        if source is not None and failure is None:
            if source.remote_num_tokens != request.num_prompt_tokens:
                failure = (
                    f"kv_transfer_params.remote_num_tokens={source.remote_num_tokens}: Prefill "
                    f"computed that many prompt tokens, this request has "
                    f"{request.num_prompt_tokens} (another tokenizer or prompt?)"
                )
            elif source.rd2h_claim_version < CLAIM_VERSION:
                failure = (
                    f"kv_transfer_params.rd2h_claim_version={source.rd2h_claim_version}: "
                    f"this Decode claims with version {CLAIM_VERSION}"
                )
        ext_id = source.remote_request_id if source is not None else external_request_id(req_id)
        spec = LoadSpec(
            req_id=req_id,
            ext_id=ext_id,
            main_block_ids=main,
            indexer_block_ids=indexer,
            local_tokens=local_tokens,
            num_tokens=num_external_tokens,
            source=source if failure is None else None,
        )
        self._loading[req_id] = spec
        self._new_loads.append(spec)
        if failure is not None:
            logger.warning("request %s: cannot load its KV from Prefill: %s", req_id, failure)
            with self._posts_lock:
                self._failures.append(
                    LoadFailure(
                        req_id=req_id,
                        ext_id=ext_id,
                        code=int(ErrorCode.MALFORMED),
                        message=f"unusable Prefill-first kv_transfer_params: {failure}",
                    )
                )

    def _keep_after_alloc(self, request: Request) -> None:
        """Prefill, Prefill-first: computed with no Decode named; kept once computed."""
        req_id = request.request_id
        self._sending[req_id] = _SendState(
            request=request,
            ext_id=external_request_id(req_id),
            target=None,
            remote_cached_tokens=0,
        )

    @property
    def _base_port(self) -> int:
        assert self.config.base_port is not None  # set for every config
        return self.config.base_port

    def _prefill_after_alloc(self, request: Request, params: dict[str, Any]) -> None:
        req_id = request.request_id
        ext_id = external_request_id(req_id)
        try:
            rendezvous = params_for_child(params, ext_id)
            self.config.check_peer(rendezvous.remote_tp_size)
        except ProtocolError as exc:
            # Prefill still computes the request (the client gets its token).
            logger.error("request %s: no usable rendezvous: %s", req_id, exc)
            self.stats.record_failure(exc.code)
            self._abort_prompt_list_child(req_id, ext_id, params, exc)
            return
        self._sending[req_id] = _SendState(
            request=request,
            ext_id=ext_id,
            target=decode_target(rendezvous),
            remote_cached_tokens=rendezvous.remote_cached_tokens,
        )

    def _abort_prompt_list_child(
        self, req_id: str, ext_id: str, params: dict[str, Any], error: ProtocolError
    ) -> None:
        """Queue an abort of a prompt-list child that has no usable batch entry of its own.

        Every child of a prompt list runs on the Decode engine the list's top-level
        rendezvous names (child 0's), so the worker aborts the child toward that engine and
        a v2 Decode fails it at once instead of on its load timeout (a v1 Decode cannot be
        told). Without a batch map, or with a top-level rendezvous this Prefill cannot use
        either, no Decode can be named: it fails the child on its own deadline.
        """
        if BATCH_PARAMS_KEY not in params:
            return
        try:
            top_level = rendezvous_from_params(params)
            self.config.check_peer(top_level.remote_tp_size)
        except ProtocolError as exc:
            logger.error(
                "request %s: the prompt list's top-level rendezvous is unusable too (%s); "
                "Decode fails child %s on its load timeout",
                req_id,
                exc,
                ext_id,
            )
            return
        self._new_send_aborts.append(
            SendAbort(
                req_id=req_id,
                ext_id=ext_id,
                target=decode_target(top_level),
                message=error.message,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Rd2hConnectorMetadata:
        """This step's metadata; Decode then posts the rendezvous queued this step."""
        meta = Rd2hConnectorMetadata()
        if self.config.is_consumer:
            if self._unscheduled:
                for new in scheduler_output.scheduled_new_reqs:
                    ext_id = self._unscheduled.pop(new.req_id, None)
                    if ext_id is not None:
                        self._mark("scheduled", new.req_id, ext_id)
            meta.loads, self._new_loads = self._new_loads, []
            with self._posts_lock:
                failures, self._failures = self._failures, []
            meta.load_failures = [f for f in failures if f.req_id in self._loading]
            for failure in meta.load_failures:
                self.stats.record_failure(failure.code)
            self._post_queued()
        else:
            meta.sends = self._prefill_sends(scheduler_output)
            meta.send_aborts, self._new_send_aborts = self._new_send_aborts, []
        return meta

    def _post_queued(self) -> None:
        assert self._poster is not None
        queued, self._to_post = self._to_post, []
        for post in queued:
            future = self._poster.post(post.url, post.rendezvous, idempotent=post.idempotent)
            with self._posts_lock:
                self._posting[post.req_id] = future
            # Runs at once, on this thread, if the post is already over.
            future.add_done_callback(self._on_posted(post.req_id, post.rendezvous.request_id))

    def _cancel_post(self, req_id: str) -> None:
        """Forget a finished request's rendezvous: unposted, or its post still pending."""
        self._to_post = [post for post in self._to_post if post.req_id != req_id]
        with self._posts_lock:
            future = self._posting.pop(req_id, None)
        if future is not None:
            future.cancel()

    def _on_posted(
        self, req_id: str, ext_id: str
    ) -> Callable[[concurrent.futures.Future[PostResult]], None]:
        def done(future: concurrent.futures.Future[PostResult]) -> None:
            # Usually runs on the poster's thread: only hand the outcome over.
            failure = post_failure(req_id, ext_id, future)
            with self._posts_lock:
                if self._posting.get(req_id) is not future:
                    return  # cancelled by request_finished: the request is over
                del self._posting[req_id]
                if failure is not None:
                    self._failures.append(failure)

        return done

    def _prefill_sends(self, scheduler_output: SchedulerOutput) -> list[SendSpec]:
        sends: list[SendSpec] = []
        block_state = scheduler_output.kv_connector_block_state
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._sending.get(req_id)
            if state is None or state.final_sent or state.finished:
                continue
            request = state.request
            prompt = request.num_prompt_tokens
            computed = min(request.num_computed_tokens + scheduled, prompt)
            block_ids = block_state.get_block_ids(req_id) if block_state is not None else None
            if block_ids is None:
                continue  # vLLM offered no block state: nothing to publish this step
            main, indexer = self.groups.split(block_ids)
            final = computed >= prompt
            sends.append(
                SendSpec(
                    req_id=req_id,
                    ext_id=state.ext_id,
                    target=state.target,
                    remote_cached_tokens=state.remote_cached_tokens,
                    transferred_tokens=state.transferred_tokens,
                    computed_tokens=computed,
                    final=final,
                    main_block_ids=main,
                    indexer_block_ids=indexer,
                )
            )
            smallest = self.groups.smallest_block_size
            state.transferred_tokens = computed // smallest * smallest
            state.published = True
            state.final_sent = final
        return sends

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget requests every worker reported finished."""
        for req_id in connector_output.finished_recving or ():
            spec = self._loading.pop(req_id, None)
            if spec is not None and self._marks is not None:
                self._mark("loaded", req_id, spec.ext_id)
                self._unscheduled[req_id] = spec.ext_id
        for req_id in connector_output.finished_sending or ():
            self._sending.pop(req_id, None)

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM must keep the request's blocks (see the module docstring)."""
        req_id = request.request_id
        if self.config.is_consumer:
            self._unscheduled.pop(req_id, None)
            self._cancel_post(req_id)
            # vLLM keeps a request aborted in WAITING_FOR_REMOTE_KVS on its own; saying so
            # here as well makes the rule hold in every state: no free while a read may
            # still write. Either way the release is the workers' finished_recving.
            return req_id in self._loading, None
        state = self._sending.get(req_id)
        if state is None:
            return False, None
        if not state.published or (state.target is None and not state.final_sent):
            # Nothing went out; a Prefill-first request the workers never kept is
            # dropped by them when vLLM lists it finished.
            del self._sending[req_id]
            return False, None
        state.finished = True
        self._mark("answered", req_id, state.ext_id)
        if state.target is not None:
            return True, None
        # Prefill-first: the router hands these to Decode, which claims the KV here.
        return True, kept_params(
            KeptSource(
                remote_engine_id=self.config.engine_id or "rd2h-prefill",
                remote_host=self._host,
                remote_port=self._base_port,
                remote_tp_size=self.config.tp_size,
                remote_request_id=state.ext_id,
                remote_num_tokens=state.request.num_prompt_tokens,
                rd2h_claim_version=CLAIM_VERSION,
            )
        )

    def _mark(self, what: str, req_id: str, ext_id: str) -> None:
        """A trace mark of this request (when tracing is on)."""
        if self._marks is not None:
            self._marks.mark(what, time.monotonic(), req=req_id, ext=ext_id)

    def close(self) -> None:
        """Write the marks still queued (tracing on)."""
        if self._marks is not None:
            self._marks.close()

    def get_kv_connector_stats(self) -> Rd2hKVConnectorStats | None:
        """Scheduler-side stats of the interval (rendezvous failures), then reset."""
        return self.stats.take()
