"""Synthetic KV caches shaped like a sparse-attention model, with bytes Decode can verify.

Theory of operation
-------------------
A :class:`SyntheticModel` describes the cache of one layer the way the real connector
sees it: main K and V in one KV-cache group, an indexer (and optionally a LIC8 scale that
follows the indexer's block ids) in another group with a DIFFERENT block size in tokens,
each tensor with its own bytes per block (``block_len * block_size_scale``). On Prefill
the layers may share physical buffers (a reuse ring: :func:`ring_assignment`), exactly
what makes the storage-slot gates necessary.

Every block's bytes are a pure function of ``(request, layer, component, logical block)``
(:func:`block_pattern`), where the logical block is the block's position in the request's
own block list of its group. Prefill writes that pattern into whichever physical block it
allocated; Decode, which allocated its own destination blocks, recomputes the pattern for
every logical block of every layer and component and compares byte for byte
(:meth:`DecodeDestinations.verify`). A block read from the wrong layer, request,
component, position or buffer generation cannot match.

:class:`PrefillRankDriver` runs the compute path of one Prefill TP rank against a
:class:`~rd2h_runtime.prefill.PrefillWorker`: per step, schedule the chunks, then per layer
wait until its storage may be overwritten, write the layer's blocks, publish it.
Everything here is deterministic for a given seed and uses numpy only.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from rd2h_protocol.errors import ConfigError
from rd2h_protocol.topology import chunk_block_range, transferred_tokens_before
from rd2h_protocol.wire.layout import ComponentDest, DestinationLayout, LayerLayout

__all__ = [
    "COMPONENTS",
    "BlockAllocator",
    "ChunkStep",
    "DecodeDestinations",
    "Mismatch",
    "PrefillCache",
    "PrefillRankDriver",
    "RequestSpec",
    "SyntheticModel",
    "block_pattern",
    "chunk_steps",
    "ring_assignment",
]

U8Array = npt.NDArray[np.uint8]
U64Array = npt.NDArray[np.uint64]

#: Component names in tensor order (as :class:`~rd2h_protocol.plan.ComponentAddrs` names them).
COMPONENTS: Final = ("k", "v", "indexer", "scale")
_MAIN: Final = ("k", "v")
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_WORD_STEP: Final = np.uint64(0xD6E8FEB86659FD93)


# -- the byte pattern ----------------------------------------------------------------------


def _key(request: str, layer: int, component: str) -> np.uint64:
    digest = hashlib.blake2b(f"{request}\0{layer}\0{component}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def _mix(x: U64Array) -> U64Array:
    """splitmix64's finaliser, vectorised: a bijection that spreads every input bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def block_pattern(
    request: str,
    layer: int,
    component: str,
    logical_blocks: Sequence[int] | npt.NDArray[np.integer[Any]],
    block_bytes: int,
) -> U8Array:
    """The bytes of the given logical blocks: an array of shape ``(n, block_bytes)``.

    Each block is ``block_bytes / 8`` 64-bit words ``seed ^ (i * step)`` where ``seed`` is
    a hash of ``(request, layer, component, logical block)``, so two different blocks
    differ in every word. ``block_bytes`` must be a multiple of 8.
    """
    if block_bytes % 8:
        raise ConfigError(f"synthetic block_bytes must be a multiple of 8, got {block_bytes}")
    blocks = np.asarray(logical_blocks, dtype=np.uint64).reshape(-1)
    seeds = _mix(_key(request, layer, component) + blocks * _GOLDEN)
    words = np.arange(block_bytes // 8, dtype=np.uint64) * _WORD_STEP
    out: U64Array = seeds[:, None] ^ words[None, :]
    return out.view(np.uint8).reshape(blocks.shape[0], block_bytes)


@functools.lru_cache(maxsize=256)
def range_pattern(
    request: str, layer: int, component: str, start: int, count: int, block_bytes: int
) -> U8Array:
    """:func:`block_pattern` of the logical blocks ``[start, start + count)``, memoised.

    Every Prefill TP rank writes the same blocks of a layer and every Decode rank checks
    the same indexer, at about the same time: computing the pattern once for all of them
    keeps the synthetic compute from dwarfing the transfer it feeds. Read-only.
    """
    out = block_pattern(request, layer, component, range(start, start + count), block_bytes)
    out.flags.writeable = False
    return out


# -- model and ring ------------------------------------------------------------------------


def ring_assignment(
    num_layers: int, num_buffers: int | None, independent: Sequence[int] = ()
) -> list[int]:
    """Physical buffer of each layer: independent layers get their own, the others cycle
    through ``num_buffers`` shared ones (``None``: every layer has its own buffer)."""
    if num_buffers is None:
        return list(range(num_layers))
    if num_buffers < 1:
        raise ConfigError(f"num_buffers must be >= 1, got {num_buffers}")
    out: list[int] = []
    own = {layer: num_buffers + i for i, layer in enumerate(sorted(set(independent)))}
    shared = 0
    for layer in range(num_layers):
        if layer in own:
            out.append(own[layer])
        else:
            out.append(shared % num_buffers)
            shared += 1
    return out


@dataclass(frozen=True)
class SyntheticModel:
    """The cache shape of a sparse-attention model, small enough for tests.

    ``*_block_len`` / ``*_scale`` are bytes per kernel block and kernel blocks per vLLM
    block of each tensor (their product is the bytes one block id covers, a multiple of 8).
    ``main_block_tokens`` / ``indexer_block_tokens`` are the two KV-cache groups' block
    sizes in tokens. ``scale_block_len`` 0 means no LIC8 scale; ``has_indexer`` False means
    a plain K/V model. ``num_buffers`` makes Prefill's layers share physical buffers
    (:func:`ring_assignment`); ``num_blocks`` is the size of every Prefill tensor, in blocks.
    """

    num_layers: int = 4
    main_block_tokens: int = 16
    indexer_block_tokens: int = 64
    k_block_len: int = 512
    k_scale: int = 2
    v_block_len: int = 64
    v_scale: int = 2
    indexer_block_len: int = 128
    indexer_scale: int = 1
    scale_block_len: int = 16
    has_indexer: bool = True
    num_buffers: int | None = None
    independent_layers: tuple[int, ...] = ()
    num_blocks: int = 256

    def __post_init__(self) -> None:
        for comp in self.components:
            if self.block_bytes(comp) % 8:
                raise ConfigError(f"{comp}: bytes per block must be a multiple of 8")
        if self.num_layers < 1 or self.num_blocks < 1:
            raise ConfigError("num_layers and num_blocks must be >= 1")

    @property
    def components(self) -> tuple[str, ...]:
        """The tensors of a layer, in tensor order."""
        if not self.has_indexer:
            return _MAIN
        return COMPONENTS if self.scale_block_len else COMPONENTS[:3]

    def block_len(self, component: str) -> tuple[int, int]:
        """``(block_len, block_size_scale)`` of a component."""
        return {
            "k": (self.k_block_len, self.k_scale),
            "v": (self.v_block_len, self.v_scale),
            "indexer": (self.indexer_block_len, self.indexer_scale),
            "scale": (self.scale_block_len, self.indexer_scale),
        }[component]

    def block_bytes(self, component: str) -> int:
        """Bytes one vLLM block id covers in ``component``."""
        length, scale = self.block_len(component)
        return length * scale

    def block_tokens(self, component: str) -> int:
        """Block size in tokens of the component's KV-cache group."""
        return self.main_block_tokens if component in _MAIN else self.indexer_block_tokens

    def layer_name(self, layer: int) -> str:
        """The main layer name both sides use."""
        return f"model.layers.{layer}.self_attn"

    def blocks_for(self, tokens: int) -> tuple[int, int]:
        """``(main blocks, indexer blocks)`` a prompt of ``tokens`` tokens needs."""
        idx = math.ceil(tokens / self.indexer_block_tokens) if self.has_indexer else 0
        return math.ceil(tokens / self.main_block_tokens), idx

    @property
    def buffers(self) -> list[int]:
        """Physical buffer of each layer on Prefill."""
        return ring_assignment(self.num_layers, self.num_buffers, self.independent_layers)

    def compat(self) -> str:
        """A compat string naming the shape (for the v2 handshake)."""
        sizes = ",".join(f"{c}={self.block_bytes(c)}" for c in self.components)
        return (
            f"synthetic;layers={self.num_layers};blocks={self.main_block_tokens}/"
            f"{self.indexer_block_tokens};{sizes}"
        )


# -- block allocation and chunking ---------------------------------------------------------


class BlockAllocator:
    """Hands out block ids of a pool, shuffled (``contiguous`` False) or in runs."""

    def __init__(self, num_blocks: int, seed: int = 0, *, contiguous: bool = False) -> None:
        self._free = list(range(num_blocks))
        self._contiguous = contiguous
        if not contiguous:
            random.Random(seed).shuffle(self._free)

    @property
    def free_blocks(self) -> int:
        """Blocks still free."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free ids (ConfigError when the pool is too small)."""
        if n > len(self._free):
            raise ConfigError(f"block pool exhausted: {n} wanted, {len(self._free)} free")
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, ids: Sequence[int]) -> None:
        """Give ids back."""
        self._free.extend(ids)
        if self._contiguous:
            self._free.sort()


@dataclass(frozen=True, slots=True)
class ChunkStep:
    """One Prefill step of one request: the block ranges it sends and whether it is final."""

    main: tuple[int, int]  # [start, end) into the request's main block list
    indexer: tuple[int, int]
    final: bool


def chunk_steps(model: SyntheticModel, tokens: int, chunk_tokens: int) -> list[ChunkStep]:
    """The steps of a chunked prefill of ``tokens`` tokens, ``chunk_tokens`` per step.

    Uses the reference chunk rule (:func:`~rd2h_protocol.topology.chunk_block_range`):
    a non-final chunk sends the blocks that became full, the final one the rest, including
    the partial last block of each group.
    """
    if tokens < 1 or chunk_tokens < 1:
        raise ConfigError("tokens and chunk_tokens must be >= 1")
    main_blocks, idx_blocks = model.blocks_for(tokens)
    sizes = [model.main_block_tokens] + ([model.indexer_block_tokens] if model.has_indexer else [])
    steps: list[ChunkStep] = []
    computed = 0
    while computed < tokens:
        before = computed
        computed = min(tokens, computed + chunk_tokens)
        final = computed == tokens
        sent = transferred_tokens_before(before, sizes)
        ranges = []
        for block_size, allocated in (
            (model.main_block_tokens, main_blocks),
            (model.indexer_block_tokens, idx_blocks),
        ):
            ranges.append(
                chunk_block_range(
                    remote_cached_tokens=0,
                    transferred_tokens=sent,
                    computed_tokens=computed,
                    block_size=block_size,
                    allocated_blocks=allocated,
                    final=final,
                )
                if allocated
                else (0, 0)
            )
        steps.append(ChunkStep(ranges[0], ranges[1], final))
    return steps


@dataclass(frozen=True)
class RequestSpec:
    """One request as both engines see it: id, prompt length, chunking."""

    ext_id: str
    tokens: int
    chunk_tokens: int = 1 << 30  # one chunk unless smaller


# -- Prefill source ------------------------------------------------------------------------


class PrefillCache:
    """One Prefill rank's KV cache: one tensor per component per physical buffer."""

    def __init__(self, model: SyntheticModel) -> None:
        self.model = model
        buffers = sorted(set(model.buffers))
        self.tensors: dict[tuple[int, str], U8Array] = {
            (b, comp): np.zeros((model.num_blocks, model.block_bytes(comp)), dtype=np.uint8)
            for b in buffers
            for comp in model.components
        }

    def layers(self) -> list[tuple[str, LayerLayout]]:
        """The MF_META layouts: ``(layer name, layout)`` in layer order."""
        m = self.model
        out = []
        for layer, buf in enumerate(m.buffers):
            comps = m.components
            out.append(
                (
                    m.layer_name(layer),
                    LayerLayout(
                        base_addrs=[self.tensors[(buf, c)].ctypes.data for c in comps],
                        block_len=[m.block_len(c)[0] for c in comps],
                        block_size_scale=[m.block_len(c)[1] for c in comps],
                        tensor_group_idx=[0 if c in _MAIN else 1 for c in comps],
                        num_blocks=m.num_blocks,
                    ),
                )
            )
        return out

    def regions(self) -> list[tuple[int, int]]:
        """Every tensor as ``(addr, length)``."""
        return [(t.ctypes.data, t.nbytes) for t in self.tensors.values()]

    def write(
        self,
        layer: int,
        request: str,
        main_ids: Sequence[int],
        main_start: int,
        indexer_ids: Sequence[int],
        indexer_start: int,
    ) -> None:
        """Write the request's blocks of ``layer``: physical ids, logical offsets."""
        buf = self.model.buffers[layer]
        for comp in self.model.components:
            ids, start = (main_ids, main_start) if comp in _MAIN else (indexer_ids, indexer_start)
            if not len(ids):
                continue
            self.tensors[(buf, comp)][np.asarray(ids)] = range_pattern(
                request, layer, comp, start, len(ids), self.model.block_bytes(comp)
            )


# -- Decode destinations -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A destination block whose bytes are not what Prefill wrote for it."""

    request: str
    layer: int
    component: str
    rank: int  # Decode rank for the indexer/scale; -1 for the shared main pool
    logical_block: int


class DecodeDestinations:
    """One Decode engine's destinations: the TP-shared main pool and per-rank indexers.

    The main K/V pool is one tensor per layer and component shared by all ``d_tp`` ranks
    (each rank writes its share); every rank has its own indexer (and scale) tensors,
    which must each end up complete. Tensors start filled with ``fill`` so an unwritten
    block can never pass for a written one.
    """

    def __init__(
        self, model: SyntheticModel, d_tp: int, num_blocks: int = 256, fill: int = 0xEE
    ) -> None:
        self.model = model
        self.d_tp = d_tp
        self.num_blocks = num_blocks
        self._fill = fill
        self.main: dict[tuple[int, str], U8Array] = {}
        self.local: dict[tuple[int, int, str], U8Array] = {}
        for layer in range(model.num_layers):
            for comp in model.components:
                shape = (num_blocks, model.block_bytes(comp))
                if comp in _MAIN:
                    self.main[(layer, comp)] = np.full(shape, fill, dtype=np.uint8)
                else:
                    for rank in range(d_tp):
                        self.local[(rank, layer, comp)] = np.full(shape, fill, dtype=np.uint8)

    def component(self, rank: int, layer: int, comp: str) -> ComponentDest:
        """Where ``comp`` of ``layer`` lands on rank ``rank``."""
        arr = self.main[(layer, comp)] if comp in _MAIN else self.local[(rank, layer, comp)]
        return ComponentDest(arr.ctypes.data, self.model.block_bytes(comp), self.num_blocks)

    def layers(self, rank: int) -> list[tuple[str, DestinationLayout]]:
        """Rank ``rank``'s destination layouts (ConsumerConfig.layers)."""
        comps = self.model.components
        out = []
        for layer in range(self.model.num_layers):
            out.append(
                (
                    self.model.layer_name(layer),
                    DestinationLayout(
                        main=(self.component(rank, layer, "k"), self.component(rank, layer, "v")),
                        indexer=self.component(rank, layer, "indexer")
                        if "indexer" in comps
                        else None,
                        scale=self.component(rank, layer, "scale") if "scale" in comps else None,
                    ),
                )
            )
        return out

    def regions(self, rank: int) -> list[tuple[int, int]]:
        """The memory rank ``rank`` writes: the shared main pool and its own tensors."""
        out = [(a.ctypes.data, a.nbytes) for a in self.main.values()]
        out += [(a.ctypes.data, a.nbytes) for (r, _, _), a in self.local.items() if r == rank]
        return out

    def verify(
        self,
        request: str,
        main_ids: Sequence[int],
        indexer_ids: Sequence[int],
        layers: Sequence[int] | None = None,
        limit: int = 20,
    ) -> list[Mismatch]:
        """Compare every destination block of ``request`` with the expected pattern.

        ``main_ids`` / ``indexer_ids`` are the request's destination ids in logical order.
        Returns up to ``limit`` mismatches (empty: every byte is right).
        """
        out: list[Mismatch] = []
        m = self.model
        for layer in range(m.num_layers) if layers is None else layers:
            for comp in m.components:
                ids = np.asarray(main_ids if comp in _MAIN else indexer_ids, dtype=np.int64)
                if not ids.size:
                    continue
                want = range_pattern(request, layer, comp, 0, ids.size, m.block_bytes(comp))
                targets = (
                    [(-1, self.main[(layer, comp)])]
                    if comp in _MAIN
                    else [(r, self.local[(r, layer, comp)]) for r in range(self.d_tp)]
                )
                for rank, arr in targets:
                    bad = np.flatnonzero((arr[ids] != want).any(axis=1))
                    for j in bad[: max(0, limit - len(out))]:
                        out.append(Mismatch(request, layer, comp, rank, int(j)))
                    if len(out) >= limit:
                        return out
        return out

    def untouched(self, main_ids: Sequence[int], indexer_ids: Sequence[int]) -> bool:
        """Whether every block of these ids still holds the initial fill (never written)."""
        for arr in self.main.values():
            if main_ids and not (arr[np.asarray(main_ids)] == self._fill).all():
                return False
        for arr in self.local.values():
            if indexer_ids and not (arr[np.asarray(indexer_ids)] == self._fill).all():
                return False
        return True


# -- the Prefill compute path ----------------------------------------------------------------


class _Worker(Protocol):
    """What the driver needs of a PrefillWorker (structural; avoids an import cycle)."""

    def schedule_chunk(
        self,
        ext_req_id: str,
        main_block_ids: Sequence[int],
        indexer_block_ids: Sequence[int],
        main_start_block: int,
        indexer_start_block: int,
        final: bool,
    ) -> None: ...

    def wait_writable(self, layer_idx: int, timeout: float) -> bool: ...

    def layer_written(self, layer_idx: int) -> None: ...

    def end_step(self) -> None: ...


@dataclass
class _Scheduled:
    spec: RequestSpec
    main_ids: list[int]
    indexer_ids: list[int]
    steps: list[ChunkStep]
    next_step: int = 0


@dataclass
class PrefillRankDriver:
    """The compute path of one Prefill TP rank over a synthetic cache.

    ``add`` registers a request with its physical block ids (the engine's scheduler
    allocates them once for all TP ranks); ``run_step`` runs one engine step: schedule every
    request that has a chunk left, then for each layer wait for its storage
    (``gate_timeout_s``), write its blocks, publish it; then end the step.

    ``write_before_wait`` writes a layer BEFORE waiting for its gate (a broken compute path:
    it exists to show that the byte checks catch a buffer overwritten under a read).
    ``on_layer(step, layer)`` runs after each layer is published (tests inject faults
    there).
    """

    worker: _Worker
    cache: PrefillCache
    gate_timeout_s: float = 30.0
    write_before_wait: bool = False
    on_layer: Callable[[int, int], None] | None = None
    requests: dict[str, _Scheduled] = field(default_factory=dict)
    steps_run: int = 0

    def add(self, spec: RequestSpec, main_ids: Sequence[int], indexer_ids: Sequence[int]) -> None:
        """Track a request whose physical block ids are given (logical order)."""
        steps = chunk_steps(self.cache.model, spec.tokens, spec.chunk_tokens)
        self.requests[spec.ext_id] = _Scheduled(spec, list(main_ids), list(indexer_ids), steps)

    @property
    def pending(self) -> bool:
        """Whether a request still has a chunk to run."""
        return any(r.next_step < len(r.steps) for r in self.requests.values())

    def run_step(self) -> None:
        """One engine step over every request with a chunk left.

        Raises TimeoutError when a gate stays closed for ``gate_timeout_s``.
        """
        chunks: list[tuple[str, list[int], int, list[int], int]] = []
        for ext, sched in self.requests.items():
            if sched.next_step >= len(sched.steps):
                continue
            step = sched.steps[sched.next_step]
            sched.next_step += 1
            (ms, me), (is_, ie) = step.main, step.indexer
            main, idx = sched.main_ids[ms:me], sched.indexer_ids[is_:ie]
            self.worker.schedule_chunk(ext, main, idx, ms, is_, step.final)
            chunks.append((ext, main, ms, idx, is_))
        for layer in range(self.cache.model.num_layers):
            if self.write_before_wait:
                self._write(layer, chunks)
            if not self.worker.wait_writable(layer, self.gate_timeout_s):
                raise TimeoutError(
                    f"layer {layer}: storage not writable within {self.gate_timeout_s} s"
                )
            if not self.write_before_wait:
                self._write(layer, chunks)
            self.worker.layer_written(layer)
            if self.on_layer is not None:
                self.on_layer(self.steps_run, layer)
        self.worker.end_step()
        self.steps_run += 1

    def run_all(self) -> None:
        """Run steps until no request has a chunk left."""
        while self.pending:
            self.run_step()

    def _write(self, layer: int, chunks: list[tuple[str, list[int], int, list[int], int]]) -> None:
        for ext, main, ms, idx, is_ in chunks:
            self.cache.write(layer, ext, main, ms, idx, is_)
