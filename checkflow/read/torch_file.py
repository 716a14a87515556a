"""What ``checkflow restore --format torch`` writes: the whole job's state dicts, in values
that plain ``torch.load(path)`` reads.

``torch.load`` unpickles with ``weights_only=True`` by default since torch 2.6: tensors,
numbers, strings, bytes, dtypes, devices and plain containers, nothing else. A checkpoint's
objects are data of a few more kinds (``checkflow.objects``), of which only numpy values
fall outside that (the numpy RNG state is ``(name, uint32 array, pos, has_gauss,
cached)``): arrays become tensors, numpy scalars Python numbers. What is still not plain
(an object unpickled with ``--trust``) is kept and named, so the CLI can say that this file
needs ``weights_only=False``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from checkflow.read.reader import CheckpointReader
from checkflow.read.state_dicts import consolidated_state_dicts
from checkflow.tree import map_tree

PLAIN_TYPES: tuple[type, ...] = (
    torch.Tensor,
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    type(None),
    torch.dtype,
    torch.device,
)
"""The leaves ``torch.load(weights_only=True)`` reads (the containers are walked into)."""


@dataclass(slots=True)
class TorchFile:
    """What goes into the file: ``torch.save(torch_file.state, f)``."""

    state: dict[str, Any]
    """``{name: state_dict}`` of the whole job (every pipeline stage), full tensors."""
    not_plain: list[str] = field(default_factory=list)
    """``"path (type)"`` of each leaf plain ``torch.load`` refuses (unpickled objects)."""


def torch_file(reader: CheckpointReader, step: int) -> TorchFile:
    """The consolidated state of ``step`` (all ranks' stages joined), made plain."""
    state, not_plain = plain_values(consolidated_state_dicts(reader, step))
    return TorchFile(state, not_plain)


def plain_values(tree: Any) -> tuple[Any, list[str]]:
    """A copy of ``tree`` with numpy arrays as tensors and numpy scalars as Python numbers,
    and the paths of the leaves that are still not plain.

    Every mapping comes back as an ``OrderedDict`` (what ``load_state_dict`` expects, and a
    type ``weights_only`` allows); a namedtuple is a leaf of its own type, so it is named.
    """
    not_plain: list[str] = []

    def leaf(value: Any, path: str) -> Any:
        if isinstance(value, np.ndarray):
            try:
                return torch.from_numpy(np.ascontiguousarray(value).copy())
            except TypeError:  # a dtype torch has not (strings, objects, datetimes)
                pass
        elif isinstance(value, np.generic):
            return value.item()
        if not isinstance(value, PLAIN_TYPES):
            not_plain.append(f"{path} ({type(value).__module__}.{type(value).__qualname__})")
        return value

    return map_tree(tree, leaf), not_plain
