"""The one walker over state trees (nested mappings, lists and tuples of a ``state_dict``).

Saving pulls the tensors out of a tree, restoring puts them back, and a rank keeps some
tensors inline: each is a map over the leaves of the same tree. They share one rule for
what is a container (a mapping, a list, a tuple that is not a namedtuple: a namedtuple is
a value of its own) and one place that carries an ``nn.Module`` state_dict's ``_metadata``
(the per-module versions ``load_state_dict`` reads) from the old mapping to the new one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

Leaf = Callable[[Any, str], Any]
"""Called with a leaf and its dotted path; returns what replaces it."""
KeyCheck = Callable[[Any, str], None]
"""Called with each key of a mapping and the mapping's path; raises to refuse the key."""


def is_sequence(value: Any) -> bool:
    """A list or a plain tuple: walked into. A namedtuple is a leaf."""
    return isinstance(value, list) or (isinstance(value, tuple) and not hasattr(value, "_fields"))


def join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def map_tree(
    tree: Any,
    leaf: Leaf,
    path: str = "",
    *,
    keep_type: bool = False,
    check_key: KeyCheck | None = None,
    key: Callable[[Any], Any] | None = None,
) -> Any:
    """A copy of ``tree`` with every leaf replaced by ``leaf(value, path)``.

    Args:
        keep_type: rebuild each mapping as its own type; by default as an ``OrderedDict``
            (what ``load_state_dict`` expects, and what a skeleton stores).
        check_key: called on every key before its value is walked.
        key: what each key becomes in the copy (the key itself by default).
    """

    def walk(node: Any, at: str) -> Any:
        if isinstance(node, Mapping):
            if check_key is not None:
                for k in node:
                    check_key(k, at)
            items = ((k if key is None else key(k), walk(v, join(at, k))) for k, v in node.items())
            result: Any = type(node)(items) if keep_type else OrderedDict(items)  # type: ignore[call-arg]
            return carry_metadata(node, result)
        if is_sequence(node):
            mapped = [walk(v, join(at, i)) for i, v in enumerate(node)]
            return mapped if isinstance(node, list) else tuple(mapped)
        return leaf(node, at)

    return walk(tree, path)


def iter_leaves(
    tree: Any, path: str = "", *, spread: Callable[[Sequence[Any]], bool] | None = None
) -> Iterator[tuple[str, Any]]:
    """``(dotted path, leaf)`` of every leaf, in order.

    Args:
        spread: whether to walk into a list or tuple (always by default); one it refuses
            is yielded as a leaf.
    """
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from iter_leaves(v, join(path, k), spread=spread)
    elif is_sequence(tree) and (spread is None or spread(tree)):
        for i, v in enumerate(tree):
            yield from iter_leaves(v, join(path, i), spread=spread)
    else:
        yield path, tree


def carry_metadata(source: Any, target: Any) -> Any:
    """``target`` with ``source``'s ``_metadata`` when it has one; returns ``target``."""
    metadata = getattr(source, "_metadata", None)
    if metadata is not None:
        target._metadata = metadata
    return target


def metadata_of(mapping: Any) -> dict[str, Any]:
    """A state_dict's ``_metadata`` (empty when it has none)."""
    return dict(getattr(mapping, "_metadata", None) or {})


def with_metadata(mapping: Any, metadata: Mapping[str, Any]) -> Any:
    """``mapping`` (an ``OrderedDict``) carrying ``metadata``; returns it."""
    mapping._metadata = dict(metadata)
    return mapping
