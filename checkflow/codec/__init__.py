"""Codec registry (fsspec-style: name -> dotted path, imported lazily) and per-tensor rules."""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Mapping
from types import MappingProxyType

import torch

from checkflow.codec.base import Codec, CodecError, Encoded

__all__ = [
    "Codec",
    "CodecError",
    "CodecRules",
    "Encoded",
    "available_codecs",
    "get_codec",
    "register_codec",
]

_registry: dict[str, str] = {
    "exact": "checkflow.codec.raw:RawCodec",
    "zstd": "checkflow.codec.zstd:ZstdCodec",
    "delta": "checkflow.codec.delta:DeltaCodec",
    "q8": "checkflow.codec.quant:Q8Codec",
    "q4": "checkflow.codec.quant:Q4Codec",
    # 2-bit deltas: for embedding tables whose rows change sparsely (1.6x fewer bytes than q4
    # there); on dense optimizer state q4 is the better trade (benchmarks/codec.py).
    "q2": "checkflow.codec.quant:Q2Codec",
}
_instances: dict[str, Codec] = {}
available_codecs: Mapping[str, str] = MappingProxyType(_registry)
"""Read-only view of the registered codec names and their import paths."""


def register_codec(name: str, target: str | type[Codec], *, clobber: bool = False) -> None:
    """Register a codec class (or ``"module:Class"`` path) under ``name``."""
    if name in _registry and not clobber:
        raise ValueError(f"codec {name!r} is already registered; pass clobber=True to replace")
    _instances.pop(name, None)
    if isinstance(target, str):
        _registry[name] = target
    else:
        _registry[name] = f"{target.__module__}:{target.__qualname__}"
        _instances[name] = target()


def get_codec(name: str) -> Codec:
    """The codec registered as ``name``.

    Raises:
        ValueError: the name is unknown or its module cannot be imported.
    """
    codec = _instances.get(name)
    if codec is not None:
        return codec
    path = _registry.get(name)
    if path is None:
        valid = ", ".join(sorted(_registry))
        raise ValueError(f"unknown codec {name!r}; valid codecs: {valid}")
    module_name, _, cls_name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"codec {name!r} ({path}) cannot be imported: {e}. "
            "Reinstall checkflow (pip install -e .) or register the codec again."
        ) from e
    codec = cls()
    _instances[name] = codec
    return codec


class CodecRules:
    """Which codec a tensor gets: a name, or ``{glob on fqn: name}`` where the first match wins.

    Integer and bool tensors are always stored exactly: quantizing a step counter or an index
    would corrupt it, whatever the rules say. Lossy codecs apply only to floating tensors.
    """

    def __init__(self, spec: str | Mapping[str, str] = "exact") -> None:
        rules = {"*": spec} if isinstance(spec, str) else dict(spec)
        if not rules:
            raise ValueError("codec rules are empty; pass a codec name such as 'exact'")
        for pattern, name in rules.items():
            if name not in _registry:
                valid = ", ".join(sorted(_registry))
                raise ValueError(f"unknown codec {name!r} for {pattern!r}; valid codecs: {valid}")
        self.rules = rules

    def name_for(self, fqn: str, tensor: torch.Tensor) -> str:
        name = next((n for p, n in self.rules.items() if fnmatch.fnmatchcase(fqn, p)), "exact")
        if not tensor.dtype.is_floating_point:
            return "exact"
        return name

    @property
    def lossless(self) -> bool:
        """Every tensor is stored bit for bit (no quantizing codec in the rules)."""
        return all(get_codec(n).lossless for n in set(self.rules.values()))

    @property
    def any_incremental(self) -> bool:
        return any(get_codec(n).incremental for n in set(self.rules.values()))
