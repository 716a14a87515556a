"""Reading a PyTorch DCP folder's pickles without running code from it.

DCP stores its ``.metadata`` as a plain pickle and every non-tensor value (an int, a list,
an optimizer's ``param_groups``) as a ``torch.save`` pickle, and torch's own
``FileSystemReader`` and ``DefaultLoadPlanner`` read both with ``pickle.load`` /
``torch.load(weights_only=False)``: a crafted folder runs whatever its pickles name. Here the
metadata goes through an unpickler that resolves only the classes ``dcp.save`` writes
(checked against torch 2.13: the ``torch.distributed.checkpoint.metadata`` dataclasses,
``filesystem._StorageInfo``, ``torch.Size``, torch dtypes, the layout and memory-format
tags, ``pathlib`` paths), and the values go through ``torch.load(weights_only=True)``.
Anything else raises :class:`RefusedPickleError`; ``trust=True`` restores torch's behaviour.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import IO, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex"}),
    "collections": frozenset({"OrderedDict"}),
}
"""What a ``.metadata`` pickle may name: DCP's own records and plain values, nothing that
runs code when called (``_get_layout`` looks a name up in torch's table of layouts)."""


class RefusedPickleError(pickle.UnpicklingError):
    """A DCP pickle names something outside the allowed set: reading it may run code."""

    def __init__(self, what: str, name: str) -> None:
        super().__init__(f"{what} names {name}, which a DCP checkpoint never holds")
        self.what = what
        self.name = name


class DamagedPickleError(ValueError):
    """A DCP pickle is truncated, garbage, or not what DCP writes there."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedPickleError(".metadata", f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickleError(".metadata", f"persistent id {pid!r:.40}")


def load_metadata(stream: IO[bytes]) -> Metadata:
    """The ``Metadata`` of a ``.metadata`` stream, resolving only DCP's own classes.

    Raises:
        RefusedPickleError: the pickle names anything else.
        DamagedPickleError: the pickle is damaged, or holds no ``Metadata``.
    """
    try:
        metadata = _MetadataUnpickler(stream).load()
    except RefusedPickleError:
        raise
    except Exception as e:  # truncated, garbage, or DCP's classes called with wrong arguments
        raise DamagedPickleError(f".metadata cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise DamagedPickleError(f".metadata holds a {type(metadata).__name__}, not Metadata")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """torch's ``FileSystemReader`` with the metadata read by :func:`load_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(cast(IO[bytes], stream))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` with each non-tensor value read ``weights_only``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's message is a page long; the global it refused is what matters.
            found = re.search(r"GLOBAL (\S+)", str(e))
            name = found.group(1) if found else "something weights_only refuses"
            raise RefusedPickleError(f"value {read_item.dest_index.fqn!r}", name) from e
        super().load_bytes(read_item, _saved(loaded))


def _saved(value: Any) -> io.BytesIO:
    # The parent's load_bytes places what it reads; hand it the checked value, re-saved.
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out
