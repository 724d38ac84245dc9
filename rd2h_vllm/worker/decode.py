"""The Decode half of the worker-side connector (kv_consumer); see :mod:`rd2h_vllm.worker`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from rd2h_protocol.claim import CLAIM_VERSION, Claim, ClaimAnswer
from rd2h_protocol.completion import CrossRankCompletion, RankReport
from rd2h_protocol.consumer import ConsumerConfig
from rd2h_protocol.errors import (
    ErrorCode,
    ProtocolError,
)
from rd2h_protocol.machines import NO_EFFECT, no_effect
from rd2h_protocol.topology import map_prefill_rank
from rd2h_runtime.claims import ClaimClient
from rd2h_runtime.control import ControlOptions
from rd2h_runtime.decode import DecodeWorker, Outcome
from rd2h_runtime.decode_reads import ReadRecord
from rd2h_runtime.transfer import TransferBackend
from rd2h_vllm.config import Rd2hConfig
from rd2h_vllm.destinations import (
    DestinationProvider,
)
from rd2h_vllm.metadata import CacheGroups, LoadSpec, Rd2hConnectorMetadata
from rd2h_vllm.metrics import CounterDelta, Rd2hKVConnectorStats
from rd2h_vllm.request_machines import (
    EFFECT_ABORT,
    EFFECT_RELEASE,
    EFFECT_REPORT_LOCAL,
    L_LOCAL_ADD_FAILED,
    L_LOCAL_ADDED,
    L_LOCAL_COMPLETED,
    L_LOCAL_DUPLICATE,
    L_LOCAL_FAIL,
    L_LOCAL_QUIESCENT,
    LOAD_FINISHED,
    LOAD_NEW,
    LOAD_RELEASE_PENDING,
    LOAD_RELEASED,
    VLLM_LOAD,
)
from rd2h_vllm.worker.common import (
    TpGroup,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Load:
    """One Decode request as the worker side tracks it."""

    spec: LoadSpec
    state: str = LOAD_NEW  # of VLLM_LOAD, changed only by firing _LOAD
    failed: bool = False  # the completion rule's verdict: it failed on some rank


class DecodeSide:
    """The Decode (kv_consumer) worker half (see the module docstring)."""

    def __init__(
        self,
        config: Rd2hConfig,
        groups: CacheGroups,
        destinations: DestinationProvider,
        *,
        tp: TpGroup,
        backend: TransferBackend,
        host: str,
        port: int,
        compat: str,
        report_block_errors: bool,
        control_options: ControlOptions | None = None,
    ) -> None:
        self.config = config
        self.groups = groups
        self.destinations = destinations
        self._tp = tp
        self._host = host
        self._control_options = control_options
        self._report_blocks = report_block_errors
        self.stats = Rd2hKVConnectorStats()
        self._counters = CounterDelta()
        self._lock = threading.Lock()
        self._outcomes: list[Outcome] = []
        self._reads: list[ReadRecord] = []
        self._loads: dict[str, _Load] = {}
        self._by_ext: dict[str, str] = {}
        self._error_blocks: set[int] = set()
        # Prefill-first: the claims of kept requests (opened on first use), and the
        # refusals their answers brought (from the client's thread).
        self._claims: ClaimClient | None = None
        self._refused: list[tuple[str, str, int]] = []  # (ext id, why, code)
        #: Loads reported failed by the last get_finished: req_id -> (main, indexer) ids.
        self.last_failed: dict[str, tuple[list[int], list[int]]] = {}
        self.completion = CrossRankCompletion(tp.size)
        # A read must end well within half the Prefill lease (see DecodeWorker).
        read_timeout_s = max(0.1, min(10.0, 0.4 * config.lease_ms / 1000.0))
        self.worker = DecodeWorker(
            ConsumerConfig(
                d_rank=tp.rank,
                d_tp=config.tp_size,
                layers=destinations.layouts(),
                compat=compat,
                kv_load_timeout_s=config.kv_load_timeout_s,
                max_read_retries=config.max_read_retries,
                main_shared=destinations.main_shared,
            ),
            backend,
            host=host,
            port=port,
            control_options=control_options,
            read_timeout_s=read_timeout_s,
            on_outcome=self._on_outcome,
            on_read=self._on_read,
            trace_dir=config.trace_dir,
        )

    # -- introspection ---------------------------------------------------------------------

    def loading(self) -> dict[str, bool]:
        """``{req_id: finished on every rank}`` of every load still tracked."""
        return {r: load.state in LOAD_FINISHED for r, load in self._loads.items()}

    def is_idle(self) -> bool:
        """Nothing tracked here, in the completion rule or in the endpoint."""
        return not self._loads and self.completion.is_idle() and self.worker.is_idle()

    # -- the step ----------------------------------------------------------------------------

    def bind(self, meta: Rd2hConnectorMetadata) -> None:
        """Register new destinations; abort loads whose rendezvous failed."""
        now = time.monotonic()
        for spec in meta.loads:
            if spec.req_id not in self._loads:
                self._add(spec, now)
        for failure in meta.load_failures:
            load = self._loads.get(failure.req_id)
            if load is not None:
                _LOAD.fire(self, load, L_LOCAL_FAIL, failure.message)

    def _add(self, spec: LoadSpec, now: float) -> None:
        indexer = spec.indexer_block_ids if spec.indexer_block_ids is not None else []
        load = _Load(spec)
        self._loads[spec.req_id] = load
        if spec.ext_id in self._by_ext:
            # Two live loads under one external id: Prefill could not tell them apart.
            # Every rank sees the same metadata, so each fails this one on its own (the
            # cross-rank rule, keyed by external id, would confuse it with the other).
            other = self._by_ext[spec.ext_id]
            logger.error(
                "request %s: external id %r is already loading for request %s",
                spec.req_id,
                spec.ext_id,
                other,
            )
            self.stats.record_failure(ErrorCode.UNKNOWN_REQUEST)
            load.failed = True
            _LOAD.fire(self, load, L_LOCAL_DUPLICATE)
            return
        self._by_ext[spec.ext_id] = spec.req_id
        try:
            self.worker.add_request(spec.ext_id, spec.main_block_ids, indexer)
        except ProtocolError as exc:
            _LOAD.fire(self, load, L_LOCAL_ADD_FAILED, exc)
            return
        _LOAD.fire(self, load, L_LOCAL_ADDED)
        if spec.source is not None:
            self._claim(spec)

    def _claim(self, spec: LoadSpec) -> None:
        """Prefill-first: ask each Prefill rank that serves this rank for the kept KV (its
        destinations are registered already, so the readiness finds them)."""
        source = spec.source
        assert source is not None
        if self._claims is None:
            self._claims = ClaimClient(
                self._on_claim_answer,
                answer_timeout_s=self.config.handshake_timeout_s,
                options=self._control_options,
                name=f"claims-d{self._tp.rank}",
            )
        claim = Claim(
            version=CLAIM_VERSION,
            request_id=spec.ext_id,
            engine_id=self.config.engine_id,
            host=self._host,
            port=self.config.base_port,
            tp_size=self.config.tp_size,
            cached_tokens=spec.local_tokens,
            num_tokens=spec.local_tokens + spec.num_tokens,
        )
        p_tp = source.remote_tp_size
        for p_rank in range(p_tp):
            if map_prefill_rank(p_rank, p_tp, self.config.tp_size).d_rank == self._tp.rank:
                self._claims.claim(source.remote_host, source.remote_port + p_rank, claim)

    def _on_claim_answer(self, conn: str, answer: ClaimAnswer) -> None:
        """A claim's answer (the claim client's thread): a refusal fails the load."""
        if not answer.ok:
            why = f"Prefill rank {conn} refused the claim: {answer.message}"
            with self._lock:
                self._refused.append((answer.request_id, why, answer.code))

    def _on_outcome(self, outcome: Outcome) -> None:
        with self._lock:
            self._outcomes.append(outcome)

    def _on_read(self, record: ReadRecord) -> None:
        with self._lock:
            self._reads.append(record)

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """``(finished_recving, failed_recving)`` of this step (a TP collective)."""
        with self._lock:
            refused, self._refused = self._refused, []
        for ext_id, why, code in refused:
            load = self._loads.get(self._by_ext.get(ext_id, ""))
            if load is not None:
                logger.warning("request %s: %s", load.spec.req_id, why)
                self.stats.record_failure(_error_code(code))
                _LOAD.fire(self, load, L_LOCAL_FAIL, why)
        for req_id in finished_req_ids:
            load = self._loads.get(req_id)
            if load is not None:
                # vLLM finished (aborted) it, maybe while it was loading.
                _LOAD.fire(self, load, L_LOCAL_FAIL, "aborted by vLLM while loading")
        with self._lock:
            outcomes, self._outcomes = self._outcomes, []
        done = [o.ext_req_id for o in outcomes if o.ok]
        failed = [o.ext_req_id for o in outcomes if not o.ok]
        for o in outcomes:
            if not o.ok:
                self.stats.record_failure(o.code or ErrorCode.UNKNOWN)
                logger.warning(
                    "request %s: KV not received on TP rank %d: %s (%s)",
                    self._by_ext.get(o.ext_req_id, o.ext_req_id),
                    self._tp.rank,
                    o.message,
                    (o.code or ErrorCode.UNKNOWN).name,
                )
        gathered = self._tp.all_gather((RankReport(done=done, failed=failed), time.monotonic()))
        result = self.completion.update(
            [report for report, _ in gathered], self._by_ext.get, gathered[0][1]
        )
        for ext in result.dropped:
            logger.warning("request %s: completion given up (no id mapping)", ext)
        for req_id in result.finished:
            load = self._loads.get(req_id)
            if load is None:
                continue
            load.failed = req_id in result.load_errors
            _LOAD.fire(self, load, L_LOCAL_COMPLETED)
        recving: set[str] = set()
        failed_recving: set[str] = set()
        self.last_failed = {}
        for req_id, load in list(self._loads.items()):
            if load.state == LOAD_RELEASE_PENDING:
                if not self.worker.wait_releasable(load.spec.ext_id, 0.0):
                    continue  # a read may still write its blocks
                _LOAD.fire(self, load, L_LOCAL_QUIESCENT)
            if load.state != LOAD_RELEASED:
                continue
            recving.add(req_id)
            del self._loads[req_id]
            if self._by_ext.get(load.spec.ext_id) == req_id:
                del self._by_ext[load.spec.ext_id]
            if load.failed:
                failed_recving.add(req_id)
                main, indexer = self._loaded_blocks(load.spec)
                self.last_failed[req_id] = (main, indexer)
                logger.warning(
                    "request %s: KV load failed; the %d blocks it was to load are reported "
                    "invalid (vLLM recomputes them with kv_load_failure_policy=recompute, "
                    "else fails the request); none enters the prefix cache",
                    req_id,
                    len(main) + len(indexer),
                )
                if self._report_blocks:
                    self._error_blocks.update(main)
                    self._error_blocks.update(indexer)
        return recving, failed_recving

    # -- the effects of VLLM_LOAD ------------------------------------------------------------

    def _fx_report_local(self, load: _Load, exc: ProtocolError) -> None:
        """The endpoint refused it: report that like an endpoint outcome."""
        with self._lock:
            self._outcomes.append(Outcome(load.spec.ext_id, False, exc.code, exc.message))

    def _fx_abort(self, load: _Load, message: str) -> None:
        """A rendezvous failure, or vLLM finished it, while it loads: abort it."""
        self.worker.abort([load.spec.ext_id], message)

    def _fx_release(self, load: _Load) -> None:
        """Every rank ended it: release it in the endpoint; released at once when no read
        can still write its blocks."""
        if self.worker.release(load.spec.ext_id):
            _LOAD.fire(self, load, L_LOCAL_QUIESCENT)

    def _loaded_blocks(self, spec: LoadSpec) -> tuple[list[int], list[int]]:
        """The main and indexer blocks a load was to write: those past the request's
        local prefix hit (whole blocks, valid and possibly shared with other requests)."""
        sizes, groups = self.groups.block_sizes, self.groups
        main = list(spec.main_block_ids[spec.local_tokens // sizes[groups.main] :])
        if spec.indexer_block_ids is None:
            return main, []
        idx_size = sizes[groups.indexer if groups.indexer is not None else groups.main]
        return main, list(spec.indexer_block_ids[spec.local_tokens // idx_size :])

    def take_load_errors(self) -> set[int]:
        """Blocks of failed loads reported this step (single KV-cache group only)."""
        blocks, self._error_blocks = self._error_blocks, set()
        return blocks

    def take_stats(self) -> Rd2hKVConnectorStats | None:
        """This interval's stats (reads per layer, endpoint counters), then reset."""
        with self._lock:
            reads, self._reads = self._reads, []
        for r in reads:
            if r.error is None:
                self.stats.record_read(r.layer_name, r.nbytes, r.descriptors, r.seconds)
        self.stats.record_counters(self._counters.take(self.worker.stats))
        return self.stats.take()

    def close(self) -> None:
        """Close the claim client and the worker (and its backend)."""
        if self._claims is not None:
            self._claims.close()
        self.worker.close()


def _error_code(code: int) -> ErrorCode:
    """A peer's numeric error code as an :class:`ErrorCode` (UNKNOWN for a newer one)."""
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.UNKNOWN


# -- the table drives the action: each declared effect bound to its handler ----------------

_LOAD: Final = VLLM_LOAD.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_REPORT_LOCAL: DecodeSide._fx_report_local,
        EFFECT_ABORT: DecodeSide._fx_abort,
        EFFECT_RELEASE: DecodeSide._fx_release,
    }
)
