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

from checkflow.objects.decoding import decode
from checkflow.objects.encoding import encode
from checkflow.objects.schema import (
    FORMAT,
    VERSION,
    ObjectFormatError,
    OpaqueObject,
    PickleRefusedError,
    TensorRef,
    UnstorableObjectError,
    is_storable,
    is_storable_key,
    type_name,
)

__all__ = [
    "FORMAT",
    "VERSION",
    "ObjectFormatError",
    "OpaqueObject",
    "PickleRefusedError",
    "TensorRef",
    "UnstorableObjectError",
    "decode",
    "encode",
    "is_storable",
    "is_storable_key",
    "type_name",
]
