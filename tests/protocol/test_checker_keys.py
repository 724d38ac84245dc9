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
