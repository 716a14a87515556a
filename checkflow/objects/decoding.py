"""Decoding: a stored JSON tree back to data, running no code unless the reader trusts it."""

from __future__ import annotations

import base64
import io
import json
import math
import struct
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from checkflow.objects.schema import (
    FORMAT,
    NUMPY_DTYPE,
    TYPE_NAME_CHARS,
    VERSION,
    ObjectFormatError,
    OpaqueObject,
    PickleRefusedError,
    TensorRef,
    join_path,
)


def decode(
    data: bytes | bytearray | memoryview, *, trust: bool = False, opaque: bool = False
) -> Any:
    """The tree stored in ``data``.

    Args:
        trust: unpickle ``pickle`` nodes (runs code from the checkpoint).
        opaque: without ``trust``, return ``pickle`` nodes as ``OpaqueObject`` instead of
            refusing them.

    Raises:
        ObjectFormatError: ``data`` is not a tree this checkflow reads.
        PickleRefusedError: a ``pickle`` node, and neither ``trust`` nor ``opaque``.
    """
    try:
        doc = json.loads(bytes(data), parse_constant=_no_constant)
    except RecursionError:
        raise ObjectFormatError("objects are nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ObjectFormatError(f"objects are not valid JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ObjectFormatError(f"objects are not a {FORMAT} document")
    if doc.get("version") != VERSION:
        raise ObjectFormatError(
            f"objects have version {doc.get('version')!r}; this checkflow reads version "
            f"{VERSION}: upgrade checkflow to read them"
        )
    try:
        return _Decoder(trust, opaque).node(doc.get("root"), "")
    except RecursionError:
        raise ObjectFormatError("objects are nested too deeply") from None


def _no_constant(name: str) -> Any:
    raise ObjectFormatError(f"objects hold the bare JSON constant {name}")


class _Decoder:
    def __init__(self, trust: bool, opaque: bool) -> None:
        self.trust = trust
        self.opaque = opaque

    def node(self, n: Any, path: str) -> Any:
        t = type(n)
        if n is None or t is bool or t is str or t is float:
            return n
        if t is int:
            return n
        if t is list:
            return [self.node(x, join_path(path, i)) for i, x in enumerate(n)]
        if t is not dict:
            raise ObjectFormatError(f"{path or '<root>'}: unexpected JSON value {n!r:.40}")
        tag = n.get("T")
        if tag == "tuple":
            return tuple(self.node(x, join_path(path, i)) for i, x in enumerate(_list(n, "items")))
        if tag in ("dict", "odict"):
            return self.mapping(n, tag, path)
        if tag == "size":
            items = [self.node(x, join_path(path, i)) for i, x in enumerate(_list(n, "items"))]
            if not all(type(x) is int for x in items):
                raise ObjectFormatError(f"{path}: torch.Size of non-integers")
            return torch.Size(items)
        if tag == "pickle":
            return self.pickle(n, path)
        return _decode_leaf(tag, n, path)

    def mapping(self, n: dict[str, Any], tag: str, path: str) -> dict[Any, Any]:
        out: dict[Any, Any] = {} if tag == "dict" else OrderedDict()
        for item in _list(n, "items"):
            if type(item) is not list or len(item) != 2:
                raise ObjectFormatError(f"{path}: a dict item is not a [key, value] pair")
            key = self.node(item[0], f"{path} (a key)")
            value = self.node(item[1], join_path(path, key))
            try:
                out[key] = value
            except TypeError:
                raise ObjectFormatError(f"{path}: unhashable dict key {key!r:.40}") from None
        if "meta" in n:
            if tag != "odict":
                raise ObjectFormatError(f"{path}: only an OrderedDict carries _metadata")
            out._metadata = self.node(n["meta"], join_path(path, "_metadata"))  # type: ignore[attr-defined]
        return out

    def pickle(self, n: dict[str, Any], path: str) -> Any:
        name = TYPE_NAME_CHARS.sub("?", _str(n, "type"))[:120]
        raw = _bytes(n, "b64", path)
        if self.trust:
            # The one place a stored object may run code: the reader opted in.
            return torch.load(io.BytesIO(raw), weights_only=False)
        if self.opaque:
            return OpaqueObject(name, len(raw))
        raise PickleRefusedError(path or "<root>", name)


def _decode_leaf(tag: Any, n: dict[str, Any], path: str) -> Any:
    try:
        if tag == "int":
            return int(_str(n, "hex"), 16)
        if tag == "float":
            return struct.unpack(">d", bytes.fromhex(_str(n, "bits")))[0]
        if tag == "bytes":
            return _bytes(n, "b64", path)
        if tag == "ref":
            return TensorRef(_str(n, "fqn"))
        if tag == "dtype":
            return _torch_dtype(_str(n, "name"))
        if tag == "device":
            return torch.device(_str(n, "name"))
        if tag == "tensor":
            return _tensor(n, path)
        if tag == "ndarray":
            return _ndarray(n, path)
        if tag == "npscalar":
            return _ndarray({**n, "shape": []}, path)[()]
    except (ValueError, RuntimeError, struct.error) as e:
        if isinstance(e, ObjectFormatError):
            raise
        raise ObjectFormatError(f"{path or '<root>'}: bad {tag} node ({e})") from e
    raise ObjectFormatError(f"{path or '<root>'}: unknown node type {tag!r:.40}")


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ObjectFormatError(f"unknown torch dtype {name!r:.40}")
    return dtype


def _shape(n: dict[str, Any], path: str) -> list[int]:
    shape = _list(n, "shape")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise ObjectFormatError(f"{path}: a shape holds something other than sizes")
    return shape


def _tensor(n: dict[str, Any], path: str) -> torch.Tensor:
    dtype = _torch_dtype(_str(n, "dtype"))
    shape = _shape(n, path)
    raw = _bytes(n, "b64", path)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != math.prod(shape) * itemsize:
        raise ObjectFormatError(f"{path}: {len(raw)} bytes for a {dtype} tensor of {shape}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _ndarray(n: dict[str, Any], path: str) -> Any:
    name = _str(n, "dtype")
    if not NUMPY_DTYPE.match(name):
        raise ObjectFormatError(f"{path}: numpy dtype {name!r:.40} is not stored inline")
    dtype = np.dtype(name)
    shape = _shape(n, path)
    raw = _bytes(n, "b64", path)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise ObjectFormatError(f"{path}: {len(raw)} bytes for a {name} array of {shape}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _str(n: dict[str, Any], key: str) -> str:
    value = n.get(key)
    if type(value) is not str:
        raise ObjectFormatError(f"a {n.get('T')!r:.20} node has no string {key!r}")
    return value


def _list(n: dict[str, Any], key: str) -> list[Any]:
    value = n.get(key)
    if type(value) is not list:
        raise ObjectFormatError(f"a {n.get('T')!r:.20} node has no list {key!r}")
    return value


def _bytes(n: dict[str, Any], key: str, path: str) -> bytes:
    try:
        return base64.b64decode(_str(n, key), validate=True)
    except ValueError as e:
        raise ObjectFormatError(f"{path or '<root>'}: bad base64 ({e})") from e
