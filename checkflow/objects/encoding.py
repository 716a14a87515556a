"""Encoding: a state skeleton to its stored JSON form (format: :mod:`checkflow.objects`)."""

from __future__ import annotations

import base64
import io
import json
import struct
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from checkflow.objects.schema import (
    FORMAT,
    VERSION,
    UnstorableObjectError,
    join_path,
    leaf_kind,
    type_name,
)


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
            return [self.node(x, join_path(path, i)) for i, x in enumerate(v)]
        if t is tuple:
            return {
                "T": "tuple",
                "items": [self.node(x, join_path(path, i)) for i, x in enumerate(v)],
            }
        if t is dict or t is OrderedDict:
            return self.mapping(v, path)
        if t is torch.Size:
            return {
                "T": "size",
                "items": [self.node(x, join_path(path, i)) for i, x in enumerate(v)],
            }
        kind = leaf_kind(v)
        if kind is not None:
            return _leaf(kind, v)
        if self.allow_pickle:
            return {"T": "pickle", "type": type_name(v), "b64": _b64(_pickle(v, path))}
        raise UnstorableObjectError(path or "<root>", v)

    def items(self, v: list[Any] | tuple[Any, ...], path: str) -> list[Any]:
        return [self.node(x, join_path(path, i)) for i, x in enumerate(v)]

    def mapping(self, v: dict[Any, Any], path: str) -> dict[str, Any]:
        items = [
            [self.node(k, f"{join_path(path, k)} (a key)"), self.node(x, join_path(path, k))]
            for k, x in v.items()
        ]
        out: dict[str, Any] = {"T": "dict" if type(v) is dict else "odict", "items": items}
        metadata = getattr(v, "_metadata", None)
        if metadata is not None:
            out["meta"] = self.node(metadata, join_path(path, "_metadata"))
        return out


def _pickle(v: Any, path: str) -> bytes:
    buf = io.BytesIO()
    try:
        torch.save(v, buf)
    except Exception as e:  # pickle raises many types; the user needs the path
        raise TypeError(f"cannot pickle state {path!r} of type {type_name(v)}: {e}") from e
    return buf.getvalue()


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
