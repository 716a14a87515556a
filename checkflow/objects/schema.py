"""What a stored object tree may hold: the format's name, its node kinds and its errors.

Shared by :mod:`~checkflow.objects.encoding` and :mod:`~checkflow.objects.decoding`; the
format itself is described in :mod:`checkflow.objects`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

FORMAT = "checkflow.objects"
VERSION = 1
INT_LIMIT = 1 << 63
"""Integers at least this large (in magnitude) are stored as hex strings: JSON readers
differ on big numbers, and Python refuses to parse very long decimal ones."""
NUMPY_DTYPE = re.compile(r"^[<>|=][biufc][0-9]{1,2}$")
"""numpy dtypes stored inline: booleans and numbers, never object arrays."""
TYPE_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.<>\[\], -]")


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Stands in a skeleton where a tensor was; the tensor is stored as chunks."""

    fqn: str


@dataclass(frozen=True, slots=True)
class OpaqueObject:
    """A stored pickle shown without unpickling it (``checkflow inspect``, ``verify``)."""

    type_name: str
    """The pickled object's type as the writer named it (not verified: it is not read)."""
    nbytes: int

    def __repr__(self) -> str:
        return f"<{self.nbytes}-byte pickle of {self.type_name}>"


class UnstorableObjectError(TypeError):
    """A value of the state is not data checkflow stores without pickle."""

    def __init__(self, path: str, value: Any) -> None:
        self.path = path
        self.type_name = type_name(value)
        super().__init__(
            f"cannot store state {path!r} of type {self.type_name}: checkflow stores "
            "non-tensor state as data (None, bool, int, float, str, bytes, list, tuple, dict, "
            "tensors, numpy arrays) so that reading a checkpoint never runs code; make "
            "state_dict() return such data, or pass Checkpointer(..., allow_pickle=True) to "
            "store it as a pickle (loading it back then needs trust=True)"
        )


class ObjectFormatError(ValueError):
    """Stored objects are not a valid tree (corrupt, or written by a newer checkflow)."""


class PickleRefusedError(Exception):
    """Reading would unpickle an object, and the reader did not opt in with ``trust``."""

    def __init__(self, path: str, type_name: str) -> None:
        self.path = path
        self.type_name = type_name
        super().__init__(f"object {path!r} ({type_name}) is stored as a pickle")


def type_name(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _is_plain_tensor(v: Any) -> bool:
    return (
        type(v) in (torch.Tensor, torch.nn.Parameter)
        and v.layout == torch.strided
        and not v.is_quantized
        and v.device.type != "meta"
    )


def leaf_kind(v: Any) -> str | None:
    """The tag a non-container value is stored under, or None when it is not storable."""
    t = type(v)
    if v is None or t is bool or t is str:
        return "plain"
    if t is int:
        return "plain" if -INT_LIMIT < v < INT_LIMIT else "int"
    if t is float:
        return "plain" if math.isfinite(v) else "float"
    if t is bytes:
        return "bytes"
    if t is TensorRef:
        return "ref"
    if t is torch.dtype:
        return "dtype"
    if t is torch.device:
        return "device"
    if _is_plain_tensor(v):
        return "tensor"
    if t is np.ndarray and NUMPY_DTYPE.match(v.dtype.str):
        return "ndarray"
    if isinstance(v, np.generic) and NUMPY_DTYPE.match(v.dtype.str):
        return "npscalar"
    return None


def is_storable(value: Any) -> bool:
    """True when a leaf of a skeleton (not a list, tuple or dict) is stored as data."""
    return leaf_kind(value) is not None


def is_storable_key(key: Any) -> bool:
    """True when a dict key is stored as data (and comes back hashable and equal)."""
    if type(key) is tuple:
        return all(is_storable_key(k) for k in key)
    return leaf_kind(key) in ("plain", "int", "float", "bytes", "dtype", "device")


def join_path(path: str, key: Any) -> str:
    """The dotted path of ``key`` under ``path``, for messages ("optim.state.0.step")."""
    return f"{path}.{key}" if path else str(key)
