"""Non-tensor state as typed JSON: stored objects are data, and reading them runs no code.

A checkpoint travels between buckets, teammates and downloads; whoever can write one can
also write its manifest and checksums, so reading it must not execute anything it holds.
Pickle (and ``torch.load(weights_only=False)``) would. This module stores the *skeleton*
(the nesting of every ``state_dict`` with its small values) as a JSON tree whose nodes are:

- ``null``, ``true``/``false``, strings, integers below 2**63 and finite floats as
  themselves (Python's float repr round-trips every finite double, ``-0.0`` included);
- lists as JSON arrays;
- everything else as an object with a type tag ``"T"``: ``int`` (any size, as hex),
  ``float`` (NaN payloads and ±inf, as the IEEE-754 bits), ``tuple``, ``dict`` and
  ``odict`` (``OrderedDict``, with an ``nn.Module``'s ``_metadata``; items as ``[key,
  value]`` pairs so that keys of any storable type keep their type and order), ``bytes``,
  ``ref`` (a tensor stored as chunks), ``tensor`` and ``ndarray`` (small arrays inline:
  dtype, shape, base64 bytes), ``npscalar``, ``dtype``, ``device``, ``size``, and
  ``pickle``.

A ``pickle`` node is the only one whose reading runs code. It is written only when the
user opts in (``Checkpointer(..., allow_pickle=True)``) and read only with ``trust=True``;
otherwise ``decode`` refuses it (``PickleRefusedError``) or, for tools that only describe a
checkpoint, shows it as an ``OpaqueObject`` with its type name and size.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

FORMAT = "checkflow.objects"
VERSION = 1
_INT_LIMIT = 1 << 63
"""Integers at least this large (in magnitude) are stored as hex strings: JSON readers
differ on big numbers, and Python refuses to parse very long decimal ones."""
_NUMPY_DTYPE = re.compile(r"^[<>|=][biufc][0-9]{1,2}$")
"""numpy dtypes stored inline: booleans and numbers, never object arrays."""
_TYPE_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.<>\[\], -]")


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


# -- what is storable ------------------------------------------------------------------------
def _is_plain_tensor(v: Any) -> bool:
    return (
        type(v) in (torch.Tensor, torch.nn.Parameter)
        and v.layout == torch.strided
        and not v.is_quantized
        and v.device.type != "meta"
    )


def _leaf_kind(v: Any) -> str | None:
    """The tag a non-container value is stored under, or None when it is not storable."""
    t = type(v)
    if v is None or t is bool or t is str:
        return "plain"
    if t is int:
        return "plain" if -_INT_LIMIT < v < _INT_LIMIT else "int"
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
    if t is np.ndarray and _NUMPY_DTYPE.match(v.dtype.str):
        return "ndarray"
    if isinstance(v, np.generic) and _NUMPY_DTYPE.match(v.dtype.str):
        return "npscalar"
    return None


def is_storable(value: Any) -> bool:
    """True when a leaf of a skeleton (not a list, tuple or dict) is stored as data."""
    return _leaf_kind(value) is not None


def is_storable_key(key: Any) -> bool:
    """True when a dict key is stored as data (and comes back hashable and equal)."""
    if type(key) is tuple:
        return all(is_storable_key(k) for k in key)
    return _leaf_kind(key) in ("plain", "int", "float", "bytes", "dtype", "device")


# -- encoding --------------------------------------------------------------------------------
def encode(tree: Any, *, allow_pickle: bool = False) -> bytes:
    """The stored form of ``tree``.

    Raises:
        UnstorableObjectError: a value is not storable as data and ``allow_pickle`` is False.
    """
    root = _Encoder(allow_pickle).node(tree, "")
    doc = {"format": FORMAT, "version": VERSION, "root": root}
    return json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class _Encoder:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle

    def node(self, v: Any, path: str) -> Any:
        t = type(v)
        if t is list:
            return [self.node(x, _join(path, i)) for i, x in enumerate(v)]
        if t is tuple:
            return {"T": "tuple", "items": [self.node(x, _join(path, i)) for i, x in enumerate(v)]}
        if t is dict or t is OrderedDict:
            return self.mapping(v, path)
        if t is torch.Size:
            return {"T": "size", "items": [self.node(x, _join(path, i)) for i, x in enumerate(v)]}
        kind = _leaf_kind(v)
        if kind is not None:
            return _leaf(kind, v)
        if self.allow_pickle:
            return {"T": "pickle", "type": type_name(v), "b64": _b64(_pickle(v, path))}
        raise UnstorableObjectError(path or "<root>", v)

    def mapping(self, v: dict[Any, Any], path: str) -> dict[str, Any]:
        items = [
            [self.node(k, f"{_join(path, k)} (a key)"), self.node(x, _join(path, k))]
            for k, x in v.items()
        ]
        out: dict[str, Any] = {"T": "dict" if type(v) is dict else "odict", "items": items}
        metadata = getattr(v, "_metadata", None)
        if metadata is not None:
            out["meta"] = self.node(metadata, _join(path, "_metadata"))
        return out


def _pickle(v: Any, path: str) -> bytes:
    buf = io.BytesIO()
    try:
        torch.save(v, buf)
    except Exception as e:  # pickle raises many types; the user needs the path
        raise TypeError(f"cannot pickle state {path!r} of type {type_name(v)}: {e}") from e
    return buf.getvalue()


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _leaf(kind: str, v: Any) -> Any:
    if kind == "plain":
        return v
    if kind == "int":
        return {"T": "int", "hex": hex(v)}
    if kind == "float":
        return {"T": "float", "bits": struct.pack(">d", v).hex()}
    if kind == "bytes":
        return {"T": "bytes", "b64": _b64(v)}
    if kind == "ref":
        return {"T": "ref", "fqn": v.fqn}
    if kind == "dtype":
        return {"T": "dtype", "name": str(v).removeprefix("torch.")}
    if kind == "device":
        return {"T": "device", "name": str(v)}
    if kind == "tensor":
        # Inline tensors (per-rank state of a multi-rank job) come back on the CPU, like
        # every tensor a restore reads.
        host = v.detach().to("cpu").contiguous().reshape(-1)
        raw = host.view(torch.uint8).numpy().tobytes() if host.numel() else b""
        dtype = str(v.dtype).removeprefix("torch.")
        return {"T": "tensor", "dtype": dtype, "shape": list(v.shape), "b64": _b64(raw)}
    if kind == "ndarray":
        raw = np.ascontiguousarray(v).tobytes()
        return {"T": "ndarray", "dtype": v.dtype.str, "shape": list(v.shape), "b64": _b64(raw)}
    assert kind == "npscalar", kind
    return {"T": "npscalar", "dtype": v.dtype.str, "b64": _b64(v.tobytes())}


# -- decoding --------------------------------------------------------------------------------
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
            return [self.node(x, _join(path, i)) for i, x in enumerate(n)]
        if t is not dict:
            raise ObjectFormatError(f"{path or '<root>'}: unexpected JSON value {n!r:.40}")
        tag = n.get("T")
        if tag == "tuple":
            return tuple(self.node(x, _join(path, i)) for i, x in enumerate(_list(n, "items")))
        if tag in ("dict", "odict"):
            return self.mapping(n, tag, path)
        if tag == "size":
            items = [self.node(x, _join(path, i)) for i, x in enumerate(_list(n, "items"))]
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
            value = self.node(item[1], _join(path, key))
            try:
                out[key] = value
            except TypeError:
                raise ObjectFormatError(f"{path}: unhashable dict key {key!r:.40}") from None
        if "meta" in n:
            if tag != "odict":
                raise ObjectFormatError(f"{path}: only an OrderedDict carries _metadata")
            out._metadata = self.node(n["meta"], _join(path, "_metadata"))  # type: ignore[attr-defined]
        return out

    def pickle(self, n: dict[str, Any], path: str) -> Any:
        name = _TYPE_NAME_CHARS.sub("?", _str(n, "type"))[:120]
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
    if not _NUMPY_DTYPE.match(name):
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
