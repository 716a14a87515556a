"""Describing a checkpoint's skeleton (its non-tensor state) without unpickling anything:
as named one-line leaves for ``inspect``, and as JSON for the metadata of a safetensors
export.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from checkflow import tree

_SPREAD_ITEMS = 16
"""Lists and tuples up to this long show one row per item; longer ones one summary row."""


def object_leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted name, short text) of every non-tensor leaf of a skeleton."""
    from checkflow.state import TensorRef

    if not prefix and not isinstance(value, Mapping | TensorRef):
        prefix = "*"  # one opaque pickle of every object (an older checkpoint)
    for name, leaf in tree.iter_leaves(value, prefix, spread=lambda s: len(s) <= _SPREAD_ITEMS):
        if not isinstance(leaf, TensorRef):
            yield name, short(leaf)


def pickled_leaves(value: Any) -> list[str]:
    """Dotted names of the leaves of a skeleton read ``opaque`` that are stored pickles
    (``*`` when the whole skeleton is one, as an older checkflow wrote it)."""
    from checkflow.objects import OpaqueObject

    if isinstance(value, OpaqueObject):
        return ["*"]
    return [name for name, leaf in tree.iter_leaves(value, "") if isinstance(leaf, OpaqueObject)]


def short(value: Any, limit: int = 60) -> str:
    """One line of at most ``limit`` characters that says what ``value`` is."""
    if isinstance(value, list | tuple):
        return f"<{type(value).__name__} of {len(value)} items>"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:  # numpy arrays (numpy RNG state)
        return f"<{type(value).__name__} {dtype} {tuple(shape)}>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def jsonable(value: Any) -> Any:
    """A skeleton as JSON: tensors as ``{"$tensor": fqn}``, unknown objects as their repr."""
    return tree.map_tree(value, _json_leaf, key=str)


def _json_leaf(value: Any, _path: str) -> Any:
    from checkflow.state import TensorRef

    if isinstance(value, TensorRef):
        return {"$tensor": value.fqn}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no nan/inf
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return {"$repr": short(value, 200)}
