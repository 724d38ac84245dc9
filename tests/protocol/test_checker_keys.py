"""The canonical form's per-class tables name classes by path: a moved class must not
silently drop out of them (its skipped attributes would then change the state count)."""

from __future__ import annotations

import importlib

import pytest

from rd2h_protocol.checker import canonical


def _resolve(path: str) -> type:
    module_name, _, qualname = path.rpartition(".")
    value = importlib.import_module(module_name)
    for part in qualname.split("."):
        value = getattr(value, part)
    assert isinstance(value, type), path
    return value


@pytest.mark.parametrize("path", sorted({*canonical._SKIP, *canonical._REFS}))
def test_every_class_the_canonical_form_names_exists_where_it_says(path: str) -> None:
    cls = _resolve(path)
    assert f"{cls.__module__}.{cls.__qualname__}" == path


def _parked_form(ext: str, blocks: list[int], renaming: dict[object, object]) -> object:
    """The canonical form, as ``--symmetry`` writes it under ``renaming``, of the one
    readiness parked by an endpoint that got a readiness for unknown request ``ext``."""
    from test_consumer import endpoint, meta, rr, rrb, send, src_layout

    ep = endpoint()
    send(ep, meta(layouts={"model.layers.0.self_attn": src_layout(num_blocks=4096)}))
    assert send(ep, rrb(0, [rr(ext, blocks)], seq=0)) == []
    (parked,) = ep.state.parked.values()
    assert parked.packed is not None  # the entries are kept packed
    saved = canonical._AS_IS
    canonical._STRUCTS_AS_DATA[0] = True
    canonical._AS_IS = frozenset()
    canonical._RENAME.update(renaming)
    try:
        return canonical._canon(parked)
    finally:
        canonical._RENAME.clear()
        canonical._STRUCTS_AS_DATA[0] = False
        canonical._AS_IS = saved


def test_symmetry_renames_the_ids_inside_a_parked_readiness() -> None:
    # A parked readiness keeps its entries as packed msgpack: a renaming that stopped at
    # the bytes would tell two mirror states apart (or, worse, merge states whose packed
    # entries differ only inside). Swapping r0 and r1 (and their blocks) must map one
    # parked readiness onto the other.
    swap: dict[object, object] = {"r0": "r1", "r1": "r0", 1000: 2000, 1001: 2001}
    swap.update({v: k for k, v in swap.items()})
    r0 = _parked_form("r0", [1000, 1001], swap)
    r1 = _parked_form("r1", [2000, 2001], {})
    assert r0 == r1
    assert _parked_form("r0", [1000, 1001], {}) != r1
