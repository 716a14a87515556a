"""Manifest JSON with bounds: a size cap, a nesting cap, and field types. Pure; no I/O.

A manifest is input from whoever wrote the checkpoint folder. ``json.loads`` recurses once
per nesting level, so a file of ``[[[[...`` raises ``RecursionError`` (not a ``ValueError``)
in every reader that parses it; it also builds whatever a file of any size describes. The
cheap pre-scan here refuses a manifest nested deeper than :data:`MAX_DEPTH` before
``json.loads`` sees it, and readers refuse a file larger than
``knobs.max_manifest_bytes()`` (``CHECKFLOW_MAX_MANIFEST_BYTES``, 64 MiB) before reading it,
and read at most that many bytes and one more (``catalog.read_manifest_bytes``).

This module imports only ``knobs``, so that ``checkflow.manifest`` can use it without a
cycle; it raises ``ValueError`` and the manifest layer names the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from checkflow import knobs

MAX_DEPTH = 64
"""Deepest JSON nesting accepted; checkflow's own manifests nest under 10 levels."""

_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class OutOfBoundsError(ValueError):
    """A manifest over the size or nesting cap (rather than malformed JSON)."""


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """``json.loads`` of ``data``, refused when it is longer than the cap or nested deeper
    than :data:`MAX_DEPTH` (so no ``RecursionError`` can come out of it).

    Raises:
        OutOfBoundsError: too large or too deep.
        ValueError: not UTF-8 or not JSON.
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > (cap := knobs.max_manifest_bytes()):
        raise OutOfBoundsError(too_large(len(raw), cap))
    if nesting_exceeds(raw, MAX_DEPTH):
        raise OutOfBoundsError(
            f"it nests deeper than {MAX_DEPTH} levels (or its brackets do not match)"
        )
    return json.loads(raw)


def too_large(size: int, cap: int) -> str:
    """Why a manifest of ``size`` bytes is refused."""
    return (
        f"it is {size} bytes, larger than the {cap}-byte cap on manifests "
        "(CHECKFLOW_MAX_MANIFEST_BYTES); no manifest checkflow writes is that large"
    )


def nesting_exceeds(raw: bytes, depth: int) -> bool:
    """Whether the JSON text ``raw`` nests deeper than ``depth`` (or its brackets do not
    pair up). Iterative and in C speed: strings are cut out, then each round removes every
    innermost ``[]``/``{}`` pair, so a text of nesting ``d`` is empty after ``d`` rounds."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if len(brackets) <= 2 * depth:
        return False  # too few brackets to nest that deep; json.loads judges the rest
    for _ in range(depth):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"").replace(b"{}", b"")
    return bool(brackets)


# -- field types -----------------------------------------------------------------------------
Spec = Mapping[str, str]
"""``{field: kind}``; kinds: ``int``, ``int?`` (or null), ``num``, ``str``, ``dict``,
``ints`` (list of int), ``strs`` (list of str), ``list`` (list of JSON objects)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KINDS = {
    "int": (_is_int, "an integer"),
    "int?": (lambda v: v is None or _is_int(v), "an integer or null"),
    "num": (lambda v: _is_int(v) or isinstance(v, float), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "a JSON object"),
    "ints": (lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of integers"),
    "strs": (
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "a list of strings",
    ),
    "list": (lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v), "a list"),
}


def check_types(raw: Mapping[str, Any], spec: Spec) -> None:
    """Raise ``ValueError`` naming the first field of ``raw`` whose value is not of its
    kind in ``spec`` (fields ``spec`` does not name are left to the dataclass)."""
    for name, kind in spec.items():
        if name not in raw:
            continue
        test, what = _KINDS[kind]
        if not test(raw[name]):
            value = raw[name]
            raise ValueError(f"field {name!r} must be {what}, got {type(value).__name__}")
