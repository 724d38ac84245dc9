"""A world as bytes: the snapshots the explorer keeps, and what a state pickle leaves out.

:meth:`World.snapshot <rd2h_protocol.checker.world.World.snapshot>` pickles the whole
world with :data:`DISPATCH` as the pickler's dispatch table. Counters that never
influence behaviour are left out (they come back as zeros), configurations and layouts
are shared rather than copied (every snapshot refers to one object kept here), and plain
dataclasses are rebuilt positionally (fast), so that states reached along different paths
merge and a snapshot stays small. Snapshots are read back in the process that wrote them
(the shared objects live in this module), with :func:`load_world`, which finds each class a
snapshot names in a table instead of importing its module again (the import machinery that
``pickle.loads`` runs for every class was 5 % of the explorer's instructions).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import operator
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final, TypeAlias

import msgspec

import rd2h_protocol.completion as completion_module
import rd2h_protocol.consumer as consumer_module
import rd2h_protocol.consumer.records as consumer_records_module
import rd2h_protocol.plan as plan_module
import rd2h_protocol.producer as producer_module
import rd2h_protocol.producer.records as producer_records_module
from rd2h_protocol.checker.model import (
    Addr,
    Frame,
    Rank,
    Read,
    Req,
    RequestSpec,
    Static,
    WorldConfig,
)
from rd2h_protocol.completion import CompletionStats
from rd2h_protocol.consumer import ConsumerConfig, ConsumerEndpoint, ConsumerStats
from rd2h_protocol.consumer.endpoint import endpoint_of
from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.producer import ProducerConfig, ProducerStats
from rd2h_protocol.wire.layout import DestinationLayout, LayerLayout
from rd2h_protocol.wire.messages import MfMeta

# Objects shared by every snapshot instead of copied into each: index -> object.
_SHARED: list[object] = []
_SHARED_INDEX: dict[object, int] = {}  # ("id", id) or (type name, encoded value) -> index
_SHARED_BY_ID: dict[int, int] = {}  # id of a shared object -> index (they live forever)


def _shared(index: int) -> object:
    return _SHARED[index]


def share(key: object, obj: object) -> int:
    index = _SHARED_INDEX.get(key)
    if index is None:
        index = _SHARED_INDEX[key] = len(_SHARED)
        _SHARED.append(obj)
    shared = _SHARED[index]
    _SHARED_BY_ID[id(shared)] = index
    return index


def _by_identity(obj: object) -> tuple[Callable[..., object], tuple[object, ...]]:
    # Configurations are created once per world and never change: share them. The
    # registry keeps them alive, so an id is never reused for another object.
    index = _SHARED_BY_ID.get(id(obj))
    if index is None or _SHARED[index] is not obj:
        index = share(("id", id(obj)), obj)
    return _shared, (index,)


def _by_content(obj: object) -> tuple[Callable[..., object], tuple[object, ...]]:
    # Layouts decoded from each handshake are equal but distinct objects: share by value.
    # Once shared, an object is found by its id (snapshots hand back the shared one).
    index = _SHARED_BY_ID.get(id(obj))
    if index is None or _SHARED[index] is not obj:
        index = share((type(obj).__name__, msgspec.msgpack.encode(obj)), obj)
    return _shared, (index,)


def _fresh(obj: object) -> tuple[Callable[..., object], tuple[object, ...]]:
    return type(obj), ()


_Reducer: TypeAlias = Callable[[Any], tuple[Callable[..., object], tuple[object, ...]]]


def _positional(cls: type) -> _Reducer | None:
    """A reducer that rebuilds a plain dataclass with its own ``__init__`` (fast, unlike
    the generic path of slotted dataclasses), or None when ``__init__`` cannot do it."""
    if not dataclasses.is_dataclass(cls) or hasattr(cls, "__post_init__"):
        return None
    fields = dataclasses.fields(cls)
    if not fields or any(not f.init for f in fields):
        return None
    get = operator.attrgetter(*(f.name for f in fields))
    if len(fields) == 1:
        return lambda obj: (cls, (get(obj),))
    return lambda obj: (cls, get(obj))


class _DispatchTable(dict[type, _Reducer]):
    """The snapshot pickler's reducers; a struct class made at run time (the consumer
    builds bounded decoders that way) cannot be looked up by name, so it is written as its
    nearest importable base class."""

    def __missing__(self, cls: type) -> _Reducer:
        if issubclass(cls, type):
            raise KeyError(cls)  # classes are pickled by name
        if not issubclass(cls, msgspec.Struct) or _importable(cls):
            # The default way, remembered: a miss costs an exception every time.
            self[cls] = _default_reduce
            return _default_reduce
        base = next(c for c in cls.__mro__[1:] if _importable(c))

        def reducer(obj: Any) -> tuple[Callable[..., object], tuple[object, ...]]:
            return _make_struct, (base, msgspec.structs.asdict(obj))

        self[cls] = reducer
        return reducer


def _default_reduce(obj: Any) -> tuple[Callable[..., object], tuple[object, ...]]:
    reduced: tuple[Callable[..., object], tuple[object, ...]] = obj.__reduce_ex__(
        pickle.HIGHEST_PROTOCOL
    )
    return reduced


def _importable(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    return module is not None and getattr(module, cls.__qualname__, None) is cls


def _make_struct(cls: type, fields: dict[str, object]) -> object:
    return cls(**fields)


def _ordered_dict(obj: OrderedDict[Any, Any]) -> tuple[Callable[..., object], tuple[object, ...]]:
    # The default way asks copyreg (Python) for the slot names of OrderedDict every time.
    return OrderedDict, (list(obj.items()),)


def _consumer_endpoint(obj: ConsumerEndpoint) -> tuple[Callable[..., object], tuple[object, ...]]:
    # Its state alone (ConsumerEndpoint.__reduce__, without the lookup of it).
    return endpoint_of, (obj.state,)


def _enum_member(obj: enum.Enum) -> tuple[Callable[..., object], tuple[object, ...]]:
    # Looked up by name when read back (getattr, in C), not through EnumType.__call__.
    return getattr, (type(obj), obj._name_)


def _frame(obj: Frame) -> tuple[Callable[..., object], tuple[object, ...]]:
    # tuple.__new__ (C) instead of the NamedTuple's own __new__ and __getnewargs__.
    return tuple.__new__, (Frame, tuple(obj))


def _dispatch_table() -> dict[type, _Reducer]:
    table = _DispatchTable(
        {
            ProducerConfig: _by_identity,
            ConsumerConfig: _by_identity,
            WorldConfig: _by_identity,
            Static: _by_identity,
            MfMeta: _by_content,
            LayerLayout: _by_content,
            DestinationLayout: _by_content,
            ProducerStats: _fresh,
            ConsumerStats: _fresh,
            ConsumerEndpoint: _consumer_endpoint,
            CompletionStats: _fresh,
            OrderedDict: _ordered_dict,
            ErrorCode: _enum_member,
            Frame: _frame,
        }
    )
    for module in (
        producer_module,
        producer_records_module,
        consumer_module,
        consumer_records_module,
        completion_module,
        plan_module,
    ):
        for value in vars(module).values():
            if isinstance(value, type) and value not in table:
                reducer = _positional(value)
                if reducer is not None:
                    table[value] = reducer
    for cls in (Req, Rank, Read, RequestSpec):
        reducer = _positional(cls)
        assert reducer is not None
        table[cls] = reducer
    return table


DISPATCH: Final = _dispatch_table()


def connection_of(frame: Frame) -> tuple[Addr, Addr]:
    return frame.src, frame.dst


_CLASSES: dict[tuple[str, str], Any] = {}  # (module, qualified name) -> what it names


class _Loader(pickle.Unpickler):
    def find_class(self, module: str, name: str, /) -> Any:
        found = _CLASSES.get((module, name))
        if found is None:
            found = _CLASSES[(module, name)] = super().find_class(module, name)
        return found


def load_world(data: bytes) -> Any:
    """Read back a snapshot (:meth:`World.snapshot
    <rd2h_protocol.checker.world.World.snapshot>`) written in this process."""
    return _Loader(io.BytesIO(data)).load()
