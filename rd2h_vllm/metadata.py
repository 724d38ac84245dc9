"""What one scheduler step tells every worker, and which KV-cache group holds what.

:class:`Rd2hConnectorMetadata` is the plain, picklable data the scheduler half
(:mod:`rd2h_vllm.scheduler`) builds once per step and vLLM hands to every worker half
(:mod:`rd2h_vllm.worker`); :class:`CacheGroups` says which vLLM KV-cache group holds
the main KV and which the indexer, for both halves. They are apart from the scheduler
because both halves use them and the workers need nothing else of the scheduler.

The worker-side contract (for ``SfaRemoteD2HConnector``'s worker half):

* Decode: for every :class:`LoadSpec` create the consumer endpoint's request; report the
  request in ``finished_recving`` exactly once, when it completed or failed on this rank
  and no read of it is in flight; failed ones' main and indexer blocks go to
  ``get_block_ids_with_load_errors``. Requests in ``load_failures`` and requests in
  ``finished_req_ids`` (aborted) fail / abort the same way.
* Prefill: publish :class:`SendSpec` chunks; abort every :class:`SendAbort` toward its
  Decode; report the request in ``finished_sending`` exactly once, after vLLM listed it
  in ``finished_req_ids`` and no Decode read of it can happen any more
  (``RequestFinished`` from the producer endpoint, or never published).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from rd2h_protocol.claim import KeptSource
from rd2h_protocol.errors import ConfigError
from rd2h_protocol.rendezvous import Rendezvous

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "CacheGroups",
    "DecodeTarget",
    "LoadFailure",
    "LoadSpec",
    "Rd2hConnectorMetadata",
    "SendAbort",
    "SendSpec",
    "decode_target",
]


# -- metadata (scheduler -> every worker) ---------------------------------------------------


class LoadSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Decode: where one request's remote KV goes, in logical block order.

    ``main_block_ids`` / ``indexer_block_ids`` are the request's FULL block lists of the
    main and indexer KV-cache groups (a chunk's start offsets index into them);
    ``indexer_block_ids`` is None for a model without an indexer. ``local_tokens`` are
    prompt tokens Decode already holds (its prefix-cache hit, posted as
    ``remote_cached_tokens``); ``num_tokens`` are the tokens to receive. ``source`` names
    the Prefill that keeps the KV in the Prefill-first flow (the worker claims it there;
    ``ext_id`` is then the request's id on that Prefill); None in the Decode-first flow.
    """

    req_id: str
    ext_id: str
    main_block_ids: list[int]
    indexer_block_ids: list[int] | None
    local_tokens: int
    num_tokens: int
    source: KeptSource | None = None


class LoadFailure(msgspec.Struct, frozen=True, kw_only=True):
    """Decode: a request that can no longer receive its KV (its rendezvous failed)."""

    req_id: str
    ext_id: str
    code: int
    message: str


class DecodeTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill: the Decode engine a request's KV goes to (from its rendezvous)."""

    engine_id: str
    host: str
    base_port: int
    tp_size: int


class SendAbort(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill: a prompt-list child whose KV will never be sent, to abort toward Decode.

    Its own rendezvous is missing from (or unusable in) the prompt list's batch map, so
    its Decode destinations are unknown; ``target`` is the Decode engine of the list's
    top-level rendezvous (child 0's: every child of a prompt list runs on that Decode).
    ``message`` says why, for the log.
    """

    req_id: str
    ext_id: str
    target: DecodeTarget
    message: str


class SendSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill: one step of one request (chunk bookkeeping for ``chunk_block_range``).

    ``remote_cached_tokens``: held by Decode already; ``transferred_tokens``: published
    by earlier steps (rounded down to the smallest block size); ``computed_tokens``:
    computed once this step has run; ``final``: this step finishes the prompt (its
    partial last block goes too and the request's done signal follows the last layer).
    ``target`` None: a Prefill-first request (no Decode yet): nothing is published while
    it computes, and its final step's blocks are kept for the Decode that claims them.
    """

    req_id: str
    ext_id: str
    target: DecodeTarget | None
    remote_cached_tokens: int
    transferred_tokens: int
    computed_tokens: int
    final: bool
    main_block_ids: list[int]
    indexer_block_ids: list[int] | None


@dataclass
class Rd2hConnectorMetadata(KVConnectorMetadata):
    """What one scheduler step tells every worker (picklable plain data)."""

    loads: list[LoadSpec] = field(default_factory=list)
    load_failures: list[LoadFailure] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    send_aborts: list[SendAbort] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.load_failures or self.sends or self.send_aborts)


# -- KV-cache groups --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CacheGroups:
    """Which vLLM KV-cache group holds the main KV and which the indexer.

    A uniform model has one group for both (main and indexer ids are then the same
    list); a model without indexer layers has ``indexer`` None. ``block_sizes`` are the
    groups' block sizes in group order.
    """

    main: int
    indexer: int | None
    block_sizes: tuple[int, ...]

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: KVCacheConfig) -> CacheGroups:
        main: int | None = None
        indexer: int | None = None
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            names = group.layer_names
            if indexer is None and any("indexer" in name for name in names):
                indexer = index
            if main is None and any("indexer" not in name for name in names):
                main = index
        if main is None:
            raise ConfigError("no KV-cache group holds a main (non-indexer) attention layer")
        sizes = tuple(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups)
        return cls(main=main, indexer=indexer, block_sizes=sizes)

    @property
    def smallest_block_size(self) -> int:
        return min(self.block_sizes)

    def split(self, block_ids: Sequence[Sequence[int]]) -> tuple[list[int], list[int] | None]:
        """(main ids, indexer ids or None) from vLLM's per-group block id lists."""
        main = list(block_ids[self.main])
        return main, None if self.indexer is None else list(block_ids[self.indexer])


def decode_target(rendezvous: Rendezvous) -> DecodeTarget:
    """The Decode engine a rendezvous names."""
    return DecodeTarget(
        engine_id=rendezvous.remote_engine_id,
        host=rendezvous.remote_host,
        base_port=rendezvous.remote_port,
        tp_size=rendezvous.remote_tp_size,
    )
