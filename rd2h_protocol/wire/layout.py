"""Per-layer tensor layouts: the MF_META inner payload, validation, and storage slots.

Theory of operation
-------------------
Prefill describes the KV cache it will expose once per connection, in the MF_META
handshake. The description is a SECOND msgpack blob inside the MF_META message: a map
keyed by Prefill main layer name whose values are maps with str keys (one
:class:`LayerLayout` each). A layer has up to four tensors, always in this order::

    base_addrs = [K, V, indexer_k?, indexer_scale?]

The first ``main_tensor_count`` are the main KV: 2 (K and V as separate block arrays,
what v1 peers send) or 1 (one block array holding K and V side by side, vLLM 0.32's
layout for most attention backends, or an MLA latent cache); the next one, if present, is
the sparse-attention indexer; the one after that, if present, is the LIC8 scale that follows
the indexer's block ids. Sizes are given per *kernel* block (``block_len``) together with
the number of kernel blocks per vLLM block (``block_size_scale``); the protocol always
speaks vLLM blocks, so the bytes one block id covers are their product.

Decode checks the layout against its own destination (:func:`validate_layer`) before any
byte moves, and the result is the pair of component tuples a
:class:`~rd2h_protocol.plan.ReadPlan` carries. Prefill derives its storage slots (the unit
of buffer-reuse gating) from the same layouts (:func:`assign_storage_slots`).

Compatibility: :func:`encode_layer_metadata` writes exactly the six v1 keys in the order
a v1 Prefill writes them (``base_addrs, block_len, block_size_scale, tensor_group_idx,
main_tensor_count, has_indexer``) and appends the v2 key ``num_blocks`` only when it is
known, so a v1 Decode (plain ``msgpack.unpackb`` and key lookups) accepts our output and
our v1-shaped output equals a v1 Prefill's byte for byte. :func:`decode_layer_metadata`
applies the v1 read-side defaults and ignores keys it does not know (extensions only add
keys).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from rd2h_protocol.errors import (
    ErrorCode,
    FrameTooLarge,
    LayoutMismatch,
    LocalProtocolError,
    MalformedFrame,
    RemoteProtocolError,
    ValueOutOfRange,
)
from rd2h_protocol.plan import ComponentAddrs
from rd2h_protocol.wire.messages import MAX_FRAME_BYTES, MAX_NAME_LEN

# Bounds on what a peer may describe. Generous for any real model, small enough that a
# hostile blob cannot make us allocate much before it is refused.
MAX_LAYERS: Final = 4096
MAX_MAIN_TENSORS: Final = 16
MAX_TENSORS: Final = MAX_MAIN_TENSORS + 2  # main tensors, indexer, scale
MAX_BLOCK_LEN: Final = 1 << 40  # bytes per kernel block
MAX_BLOCK_SIZE_SCALE: Final = 1 << 20  # kernel blocks per vLLM block
MAX_TENSOR_GROUP: Final = (1 << 16) - 1
MAX_NUM_BLOCKS: Final = (1 << 32) - 1
_ADDR_LIMIT: Final = 1 << 64  # addresses are uint64; a tensor must end at or below this

#: The main tensor count a v1 peer sends and assumes when the key is absent (K and V).
MAIN_TENSOR_COUNT: Final = 2

#: Component names, as :class:`~rd2h_protocol.plan.ComponentAddrs` and errors use them.
K: Final = "k"
V: Final = "v"
KV: Final = "kv"  # one main component: K and V side by side per block, or an MLA latent
INDEXER: Final = "indexer"
SCALE: Final = "scale"

# msgpack ints stop at 2**64 - 1 and msgspec bounds must fit an int64, so only the floor.
_Addr = Annotated[int, Meta(ge=0)]
_BlockLen = Annotated[int, Meta(ge=1, le=MAX_BLOCK_LEN)]
_Scale = Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE_SCALE)]
_Group = Annotated[int, Meta(ge=0, le=MAX_TENSOR_GROUP)]
_MainCount = Annotated[int, Meta(ge=1, le=MAX_MAIN_TENSORS)]
_NumBlocks = Annotated[int, Meta(ge=0, le=MAX_NUM_BLOCKS)]

# (key, lower bound, upper bound) of every int list, for checks on local construction
# (msgspec enforces the Meta bounds above only while decoding).
_LIST_BOUNDS: Final = (
    ("base_addrs", 0, _ADDR_LIMIT - 1),
    ("block_len", 1, MAX_BLOCK_LEN),
    ("block_size_scale", 1, MAX_BLOCK_SIZE_SCALE),
    ("tensor_group_idx", 0, MAX_TENSOR_GROUP),
)


class InvalidLayout(LocalProtocolError):
    """A :class:`LayerLayout` is inconsistent or out of range.

    Raised as is when our own code builds a bad layout; :func:`decode_layer_metadata`
    re-raises it as a :class:`RemoteProtocolError` of the same code naming the layer when
    the layout came from the peer. ``key`` is the offending wire key.
    """

    def __init__(self, key: str, message: str, code: ErrorCode = ErrorCode.MALFORMED) -> None:
        super().__init__(f"{key}: {message}", code)
        self.key = key


class LayerLayout(msgspec.Struct, kw_only=True):
    """One layer's tensors as Prefill exposes them (one value of the MF_META inner map).

    Fields are the wire keys. ``None`` in ``block_size_scale`` / ``has_indexer`` means
    "absent" and is replaced at construction by the v1 read-side default (all 1;
    ``len(base_addrs) > main_tensor_count``), so after construction both are set.
    ``num_blocks`` (v2) is the number of vLLM blocks of every tensor of the layer, ``None``
    when the peer did not say. Construction checks lengths, counts and ranges and raises
    :class:`InvalidLayout` naming the offending key.
    """

    base_addrs: Annotated[list[_Addr], Meta(max_length=MAX_TENSORS)]
    block_len: Annotated[list[_BlockLen], Meta(max_length=MAX_TENSORS)]
    block_size_scale: Annotated[list[_Scale], Meta(max_length=MAX_TENSORS)] | None = None
    tensor_group_idx: Annotated[list[_Group], Meta(max_length=MAX_TENSORS)]
    main_tensor_count: _MainCount = MAIN_TENSOR_COUNT
    has_indexer: bool | None = None
    num_blocks: _NumBlocks | None = None  # v2

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Apply the read-side defaults to absent fields, then check the layout.

        Runs at construction and again before encoding (a Struct is mutable). Raises
        :class:`InvalidLayout` naming the offending key.
        """
        n = len(self.base_addrs)
        if self.block_size_scale is None:
            self.block_size_scale = [1] * n
        if self.has_indexer is None:
            self.has_indexer = n > self.main_tensor_count
        count = self.main_tensor_count
        if not 1 <= count <= MAX_MAIN_TENSORS:
            raise InvalidLayout(
                "main_tensor_count",
                f"expected 1..{MAX_MAIN_TENSORS}, got {count}",
                ErrorCode.OUT_OF_RANGE,
            )
        if not count <= n <= count + 2:
            raise InvalidLayout(
                "base_addrs",
                f"expected {count} main tensors plus at most an indexer and a scale "
                f"({count}..{count + 2} addresses), got {n}",
            )
        for key, low, high in _LIST_BOUNDS:
            values: list[int] = getattr(self, key)
            if len(values) != n:
                raise InvalidLayout(
                    key, f"expected {n} entries (one per base address), got {len(values)}"
                )
            for i, value in enumerate(values):
                if not low <= value <= high:
                    raise InvalidLayout(
                        key, f"entry {i} is {value}; expected {low}..{high}", ErrorCode.OUT_OF_RANGE
                    )
        if self.has_indexer != (n > count):
            raise InvalidLayout(
                "has_indexer",
                f"is {self.has_indexer} but the layer has {n - count} tensors after the "
                f"{count} main ones",
            )
        if self.num_blocks is not None:
            self._check_extent(self.num_blocks)

    def _check_extent(self, num_blocks: int) -> None:
        if not 0 <= num_blocks <= MAX_NUM_BLOCKS:
            raise InvalidLayout(
                "num_blocks",
                f"expected 0..{MAX_NUM_BLOCKS}, got {num_blocks}",
                ErrorCode.OUT_OF_RANGE,
            )
        # A tensor that would run past the top of the address space is a lie about the
        # registered memory; refuse it rather than compute wrapped addresses later.
        for i, base in enumerate(self.base_addrs):
            end = base + num_blocks * self.block_bytes(i)
            if end > _ADDR_LIMIT:
                raise InvalidLayout(
                    "num_blocks",
                    f"tensor {i} (base 0x{base:x}, {self.block_bytes(i)} bytes per block) "
                    f"ends past the 64-bit address space with {num_blocks} blocks",
                    ErrorCode.OUT_OF_RANGE,
                )

    # -- derived views -------------------------------------------------------------------

    @property
    def scales(self) -> list[int]:
        """``block_size_scale`` with its default applied (never ``None``)."""
        scales = self.block_size_scale
        assert scales is not None  # filled in __post_init__
        return scales

    def block_bytes(self, i: int) -> int:
        """Bytes one vLLM block id covers in tensor ``i``."""
        return self.block_len[i] * self.scales[i]

    @property
    def has_indexer_tensor(self) -> bool:
        """Whether the layer has an indexer tensor (after the main tensors)."""
        return len(self.base_addrs) > self.main_tensor_count

    @property
    def has_scale(self) -> bool:
        """Whether the layer has a LIC8 scale tensor (after the indexer)."""
        return len(self.base_addrs) > self.main_tensor_count + 1

    @property
    def main_block_bytes(self) -> tuple[int, ...]:
        """Bytes per vLLM block of each main tensor: ``(k, v)`` for a valid layer."""
        return tuple(self.block_bytes(i) for i in range(self.main_tensor_count))

    @property
    def indexer_block_bytes(self) -> int | None:
        """Bytes per vLLM block of the indexer, ``None`` without one."""
        return self.block_bytes(self.main_tensor_count) if self.has_indexer_tensor else None

    @property
    def scale_block_bytes(self) -> int | None:
        """Bytes per vLLM block of the LIC8 scale, ``None`` without one."""
        return self.block_bytes(self.main_tensor_count + 1) if self.has_scale else None

    @property
    def main_bases(self) -> tuple[int, ...]:
        """Base addresses of the main tensors (K, V)."""
        return tuple(self.base_addrs[: self.main_tensor_count])

    @property
    def indexer_bases(self) -> tuple[int, ...]:
        """Base addresses of the indexer and, if present, the scale; empty without one."""
        return tuple(self.base_addrs[self.main_tensor_count :])

    @property
    def main_group(self) -> int:
        """The KV-cache group of the main tensors (the K tensor's group)."""
        return self.tensor_group_idx[0]

    @property
    def indexer_group(self) -> int | None:
        """The KV-cache group of the indexer, ``None`` without one."""
        return self.tensor_group_idx[self.main_tensor_count] if self.has_indexer_tensor else None


# -- the inner blob ----------------------------------------------------------------------

_ENCODER: Final = msgspec.msgpack.Encoder()
_OUTER_DECODER: Final = msgspec.msgpack.Decoder(
    Annotated[
        dict[Annotated[str, Meta(max_length=MAX_NAME_LEN)], msgspec.Raw],
        Meta(max_length=MAX_LAYERS),
    ]
)
_LAYER_DECODER: Final = msgspec.msgpack.Decoder(LayerLayout)


def _wire_dict(layout: LayerLayout) -> dict[str, object]:
    # Insertion order is the v1 key order (msgspec writes dicts in insertion order).
    out: dict[str, object] = {
        "base_addrs": list(layout.base_addrs),
        "block_len": list(layout.block_len),
        "block_size_scale": list(layout.scales),
        "tensor_group_idx": list(layout.tensor_group_idx),
        "main_tensor_count": layout.main_tensor_count,
        "has_indexer": bool(layout.has_indexer),
    }
    if layout.num_blocks is not None:
        out["num_blocks"] = layout.num_blocks
    return out


def encode_layer_metadata(layers: Mapping[str, LayerLayout]) -> bytes:
    """Encode the MF_META inner blob: ``{layer name: layout map}``.

    Every layout is re-checked (they are mutable), so a bad one raises
    :class:`InvalidLayout` naming the layer instead of reaching the peer.
    """
    if len(layers) > MAX_LAYERS:
        raise LocalProtocolError(f"{len(layers)} layers exceed the bound of {MAX_LAYERS}")
    body: dict[str, dict[str, object]] = {}
    for name, layout in layers.items():
        if len(name) > MAX_NAME_LEN:
            raise LocalProtocolError(f"layer name of {len(name)} characters exceeds {MAX_NAME_LEN}")
        try:
            layout.validate()
        except InvalidLayout as exc:
            raise InvalidLayout(exc.key, f"layer {name!r}: {exc.message}", exc.code) from None
        body[name] = _wire_dict(layout)
    return _ENCODER.encode(body)


# msgspec names the failed constraint at the start of its message.
_RANGE_RE: Final = re.compile(r"Expected `int` (?:>=|<=) ")
_LENGTH_RE: Final = re.compile(r"Expected `(?:array|object|str)` of length <= ")


def _peer_error(where: str, exc: Exception) -> RemoteProtocolError:
    """Translate whatever decoding a peer's blob raised into a RemoteProtocolError."""
    if isinstance(exc, InvalidLayout):
        cls = ValueOutOfRange if exc.code == ErrorCode.OUT_OF_RANGE else MalformedFrame
        return cls(f"{where}: {exc.message}")
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        if _RANGE_RE.match(text):
            return ValueOutOfRange(f"{where}: {text}")
        if _LENGTH_RE.match(text):
            return FrameTooLarge(f"{where}: {text}")
        return MalformedFrame(f"{where}: {text}")
    # msgspec.DecodeError (not msgpack), or anything else a hostile blob provokes.
    return MalformedFrame(f"{where}: undecodable msgpack: {text}")


def decode_layer_metadata(blob: bytes | bytearray | memoryview) -> dict[str, LayerLayout]:
    """Decode the MF_META inner blob sent by a v1 or v2 Prefill.

    Applies the v1 read-side defaults and ignores unknown keys. Raises only
    :class:`RemoteProtocolError` subclasses (naming the layer and the key) for anything
    malformed, out of range or too large.
    """
    if len(blob) > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"layer metadata of {len(blob)} bytes exceeds {MAX_FRAME_BYTES}")
    # Two passes (names first, then each layer) so that every error names its layer.
    try:
        raw: dict[str, msgspec.Raw] = _OUTER_DECODER.decode(blob)
    except Exception as exc:
        raise _peer_error("layer metadata", exc) from None
    out: dict[str, LayerLayout] = {}
    for name, value in raw.items():
        try:
            out[name] = _LAYER_DECODER.decode(value)
        except Exception as exc:
            raise _peer_error(f"layer {name!r}", exc) from None
    return out


# -- Decode side: destinations and validation --------------------------------------------


@dataclass(frozen=True, slots=True)
class ComponentDest:
    """Where one component of one layer lands on Decode.

    ``block_bytes`` is the size of one vLLM block; ``num_blocks`` the number of blocks
    the destination holds (destination ids must lie in ``[0, num_blocks)``).
    """

    base: int
    block_bytes: int
    num_blocks: int


def main_component_names(count: int) -> tuple[str, ...]:
    """Names of ``count`` main components: ``("k", "v")``, ``("kv",)``, else numbered."""
    if count == 2:
        return (K, V)
    if count == 1:
        return (KV,)
    return tuple(f"main{i}" for i in range(count))


@dataclass(frozen=True, slots=True)
class DestinationLayout:
    """The Decode side of one layer: its main components and the optional indexer and scale.

    ``main`` is ``(K, V)`` when K and V are separate block arrays, or ``(KV,)`` when one
    block array holds both (vLLM 0.32's own caches) or an MLA latent cache; the count must
    equal the Prefill layout's ``main_tensor_count``.
    """

    main: tuple[ComponentDest, ...]
    indexer: ComponentDest | None = None
    scale: ComponentDest | None = None

    def __post_init__(self) -> None:
        if not 1 <= len(self.main) <= MAX_MAIN_TENSORS:
            raise LocalProtocolError(
                f"a destination needs 1..{MAX_MAIN_TENSORS} main components, got {len(self.main)}"
            )
        if self.scale is not None and self.indexer is None:
            raise LocalProtocolError("a destination with a LIC8 scale needs an indexer")

    def components(self) -> tuple[ComponentDest, ...]:
        """Every component: main ones, then the indexer and the scale when present."""
        return (*self.main, *(c for c in (self.indexer, self.scale) if c is not None))


def _presence(present: bool) -> str:
    return "present" if present else "absent"


def _component(
    layer: str, name: str, src: LayerLayout, i: int, dest: ComponentDest
) -> ComponentAddrs:
    if src.block_bytes(i) != dest.block_bytes:
        raise LayoutMismatch(layer, name, src.block_bytes(i), dest.block_bytes)
    return ComponentAddrs(name, src.base_addrs[i], dest.base, dest.block_bytes)


def validate_layer(
    layer: str, src: LayerLayout, dst: DestinationLayout
) -> tuple[tuple[ComponentAddrs, ...], tuple[ComponentAddrs, ...]]:
    """Check Prefill's layout of ``layer`` against Decode's destination.

    Returns ``(main, indexer)``: the main components (K and V, or one combined KV), and
    the indexer followed by the scale when present (empty without an indexer). Raises
    :class:`LayoutMismatch` naming the layer, the component and both sides' values on the
    first disagreement: main tensor count (2 split K/V against 1 combined is refused, so a
    v1 peer never writes half a block); bytes per block of each main component; indexer
    presence and bytes per block; scale presence and bytes per block.
    """
    count = src.main_tensor_count
    if count != len(dst.main):
        raise LayoutMismatch(layer, "main_tensor_count", count, len(dst.main))
    main = tuple(
        _component(layer, name, src, i, dest)
        for i, (name, dest) in enumerate(zip(main_component_names(count), dst.main, strict=True))
    )
    indexer: list[ComponentAddrs] = []
    optional = ((INDEXER, dst.indexer, src.has_indexer_tensor), (SCALE, dst.scale, src.has_scale))
    for offset, (name, dest, present) in enumerate(optional):
        if present != (dest is not None):
            raise LayoutMismatch(layer, name, _presence(present), _presence(dest is not None))
        if dest is not None:
            indexer.append(_component(layer, name, src, count + offset, dest))
    return main, tuple(indexer)


def check_destination_range(
    ext_req_id: str, component: str, start: int, count: int, allocated: int
) -> tuple[int, int]:
    """Check that ``count`` blocks from logical offset ``start`` fit a request's allocation.

    ``start`` is the offset a readiness entry carries (``main_start_block`` or
    ``indexer_start_block``), ``allocated`` the length of Decode's own destination block
    list for the request and component. Returns ``(start, start + count)``, the slice of
    that list to write. Raises :class:`ValueOutOfRange` with code ``DESTINATION_RANGE``
    (the peer asked for blocks outside the request's destinations), so the endpoint can
    fail this request alone.
    """
    if start < 0 or count < 0 or start + count > allocated:
        raise ValueOutOfRange(
            f"request {ext_req_id!r}, {component}: blocks [{start}, {start + count}) do not fit "
            f"the {allocated} destination blocks allocated",
            ErrorCode.DESTINATION_RANGE,
        )
    return start, start + count


def check_source_blocks(
    layer: str, component: str, block_ids: Sequence[int], num_blocks: int | None
) -> None:
    """Check that Prefill block ids lie in ``[0, num_blocks)`` (v2 layouts say ``num_blocks``).

    A v1 layout (``num_blocks`` ``None``) cannot be checked and passes. Raises
    :class:`ValueOutOfRange` naming the layer, the component and the first bad id.
    """
    if num_blocks is None:
        return
    for block_id in block_ids:
        if not 0 <= block_id < num_blocks:
            raise ValueOutOfRange(
                f"layer {layer!r}, {component}: Prefill block id {block_id} is outside "
                f"[0, {num_blocks})"
            )


# -- Prefill side: storage slots ---------------------------------------------------------


def assign_storage_slots(layers: Sequence[LayerLayout]) -> list[tuple[int, int | None]]:
    """Number the physical storages the layers write, for buffer-reuse gating.

    Every distinct tuple of main base addresses is one slot and every distinct tuple of
    indexer (+scale) base addresses another. Slots share ONE numbering, in first-seen
    order over ``layers`` (index order; the main slot of a layer is numbered before its
    indexer slot), so slot ids are ``0..max`` and a flat list can hold one gate per slot.
    Layers of a reuse ring (the same buffers) get the same slots. Returns, per layer,
    ``(main_slot, indexer_slot)`` with ``None`` for a layer without an indexer.
    """
    slots: dict[tuple[str, tuple[int, ...]], int] = {}
    out: list[tuple[int, int | None]] = []
    for layout in layers:
        main = slots.setdefault(("main", layout.main_bases), len(slots))
        indexer: int | None = None
        if layout.has_indexer_tensor:
            indexer = slots.setdefault(("indexer", layout.indexer_bases), len(slots))
        out.append((main, indexer))
    return out
