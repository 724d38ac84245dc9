"""The connector's worker halves: Prefill publishes per layer, Decode pulls and completes.

Theory of operation
-------------------
vLLM 0.32's model runner drives a worker-side connector once per engine step, in this
order (vllm/v1/worker/kv_connector_model_runner_mixin.py)::

    bind_connector_metadata(meta)          # before the forward pass
    per attention layer: wait_for_layer_load(name), attention writes the KV,
                         save_kv_layer(name, ...)   (vllm-ascend: on_kv_cache_written)
    start_load_kv(ctx)                     # after the forward (async loads)
    wait_for_save()
    get_transfer_results(finished_req_ids) / get_finished(...)
    get_block_ids_with_load_errors(), get_kv_connector_stats()
    clear_connector_metadata()

Steps without scheduled tokens run the same sequence without the layer calls.

:class:`PrefillSide` (kv_producer) binds one :class:`~rd2h_runtime.prefill.PrefillWorker`.
Each step's :class:`~rd2h_vllm.metadata.SendSpec` becomes a chunk
(:func:`~rd2h_protocol.topology.chunk_block_range` per KV-cache group) scheduled at
``bind`` time, i.e. before the first layer; ``wait_for_layer_load`` is the slot-reuse
wait (the storage a layer is about to overwrite must no longer be read by any Decode);
``save_kv_layer`` / ``on_kv_cache_written`` publish the layer once its KV is in memory (a
device event recorded on the compute stream; on CPU it is done at once; otherwise a
publisher thread waits for it, keeping every call in order); ``wait_for_save`` ends the
step. A request is reported in ``finished_sending`` once vLLM finished it AND no Decode
read of it can happen any more (the endpoint's ``RequestFinished``, or it never
reached the endpoint). A request vLLM finishes before its final chunk was scheduled
(abort) is aborted toward Decode, and so is a prompt-list child the scheduler found no
usable rendezvous for (:class:`~rd2h_vllm.metadata.SendAbort`), once a publication has
opened the connection to its Decode (a v1 Decode cannot be told). Prefill never raises
for a failed read of a request (``read_failure_policy="isolate"``); the failure is
counted in the metrics.

:class:`DecodeSide` (kv_consumer) binds one :class:`~rd2h_runtime.decode.DecodeWorker`
whose destinations come from a :class:`~rd2h_vllm.destinations.DestinationProvider`.
Each :class:`~rd2h_vllm.metadata.LoadSpec` registers the request's destination blocks;
a :class:`~rd2h_vllm.metadata.LoadFailure` and a request vLLM finished while loading
(``finished_req_ids``) abort it. Every step the rank's newly terminal requests are
gathered over the TP CPU group and fed to
:class:`~rd2h_protocol.completion.CrossRankCompletion` (every rank decides the same, with
rank 0's clock); a request finished on every rank is released in the endpoint and
reported in ``finished_recving`` once no read of it is in flight on this rank (vLLM may
hand its blocks out again right after). A request that failed on any rank is also listed
in ``failed_recving`` and, when the model has one KV-cache group, its main and indexer
blocks in ``get_block_ids_with_load_errors`` (vLLM 0.32 refuses block-level errors with
several groups: there the request-level ``failed_recving`` is the report).

What each half tracks per request changes only by firing the ``vLLM send`` and ``vLLM
load`` machines declared in :mod:`rd2h_vllm.request_machines`, whose effects each half
binds to its handlers.

Modules: :mod:`~rd2h_vllm.worker.prefill` (:class:`PrefillSide`, with
:mod:`~rd2h_vllm.worker.prefill_requests`, what it keeps per request and the blocks a
step sends, and :mod:`~rd2h_vllm.worker.publisher`, its ordered compute-path calls),
:mod:`~rd2h_vllm.worker.decode` (:class:`DecodeSide`) and :mod:`~rd2h_vllm.worker.common`
(the TP group, reading vLLM's KV caches into layouts).
"""

from rd2h_vllm.worker.common import (
    LAYOUT_VERSION,
    SingleRank,
    TpGroup,
    VllmTpGroup,
    compat_string,
    default_tp_group,
    layout_summary,
    prefill_layouts,
    split_kv_caches,
)
from rd2h_vllm.worker.decode import DecodeSide
from rd2h_vllm.worker.prefill import PrefillSide

__all__ = [
    "LAYOUT_VERSION",
    "DecodeSide",
    "PrefillSide",
    "SingleRank",
    "TpGroup",
    "VllmTpGroup",
    "compat_string",
    "default_tp_group",
    "layout_summary",
    "prefill_layouts",
    "split_kv_caches",
]
