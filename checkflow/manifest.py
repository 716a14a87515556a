"""The on-storage schema, format version 1: versioned dataclasses <-> JSON. Pure; no I/O.

Layout of one checkpoint (docs/ARCHITECTURE.md describes the whole format)::

    <uri>/step-000001200/
        rank-00000-000.chunks   # encoded chunks of rank 0, concatenated (several files)
        rank-00000.json         # RankManifest: entries + checksums
        MANIFEST.json           # GlobalManifest, written LAST = the commit

A *chunk* is a box of a global tensor (``offset`` + ``shape``) encoded by one codec and
stored as one checksummed byte range. Big tensors are split into several chunks along
dim 0, shards of a distributed tensor are chunks with their global offset, so a reader on
any world size can find the boxes it needs.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from checkflow import manifest_json

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
OBJECTS_TREE = "tree-json"
"""``ObjectEntry.encoding`` of objects stored as a typed JSON tree (``checkflow.objects``):
data, read without running code."""
OBJECTS_TORCH_PICKLE = "torch-pickle"
"""Objects stored by ``torch.save``: what format-1 checkpoints written before the
``encoding`` field held. Reading them unpickles, which needs the reader's trust."""
STEP_PREFIX = "step-"
TIMELINE_SUFFIX = ".t"
"""``step-000000002.t1``: step 2 of timeline 1 (a rollback's own folders; timeline 0 has none)."""
# ASCII digits only (``\d`` also matches other scripts' digits); the width and leading zeros
# are checked by the round trip through ``step_dir``.
_STEP_RE = re.compile(r"^step-([0-9]{9,})(?:\.t([0-9]+))?$")


class ManifestError(ValueError):
    """A manifest is missing a field, has the wrong version or cannot be parsed."""


_CHUNK_TYPES = {
    "fqn": "str",
    "dtype": "str",
    "global_shape": "ints",
    "offset": "ints",
    "shape": "ints",
    "codec": "str",
    "params": "dict",
    "file": "str",
    "byte_offset": "int",
    "nbytes": "int",
    "checksum": "str",
    "base_step": "int?",
}
_OBJECT_TYPES = {
    "fqn": "str",
    "file": "str",
    "byte_offset": "int",
    "nbytes": "int",
    "checksum": "str",
    "encoding": "str",
}
_RANK_TYPES = {
    "step": "int",
    "rank": "int",
    "world_size": "int",
    "created": "num",
    "chunks": "list",
    "objects": "list",
    "nbytes": "int",
}
_GLOBAL_TYPES = {
    "step": "int",
    "world_size": "int",
    "created": "num",
    "kind": "str",
    "base_steps": "ints",
    "nbytes": "int",
    "ranks": "strs",
    "meta": "dict",
}


class StepFolder(NamedTuple):
    """What a step folder's name says: the step and the timeline that wrote it."""

    step: int
    timeline: int = 0


def step_dir(step: int, timeline: int = 0) -> str:
    """Folder name of a checkpoint: ``step-000001200`` on timeline 0, the one every root
    starts on; ``step-000001200.t3`` on timeline 3 (``checkflow.timeline``)."""
    if step < 0 or timeline < 0:
        raise ValueError(f"no step folder for step {step} of timeline {timeline}")
    suffix = f"{TIMELINE_SUFFIX}{timeline}" if timeline else ""
    return f"{STEP_PREFIX}{step:09d}{suffix}"


def parse_step_dir(name: str) -> StepFolder | None:
    """The step and timeline of a folder name, or None when it is not a checkpoint folder.

    Only the names ``step_dir`` writes parse: ``step_dir(*parse_step_dir(n)) == n`` for
    every ``n`` that parses. ``step-0000000099`` (not the writer's width), non-ASCII
    digits, ``.t0`` or ``.t01`` are not steps: a reader that took them for one would act on
    a folder that gc then deletes by another name.
    """
    name = name.rstrip("/").rsplit("/", 1)[-1]
    m = _STEP_RE.match(name)
    if m is None:
        return None
    found = StepFolder(int(m.group(1)), int(m.group(2) or 0))
    return found if step_dir(*found) == name else None


def rank_manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def rank_chunks_name(rank: int, index: int) -> str:
    return f"rank-{rank:05d}-{index:03d}.chunks"


def rank_objects_name(rank: int) -> str:
    return f"rank-{rank:05d}.objects"


@dataclass(kw_only=True, slots=True)
class ChunkEntry:
    """One stored box of a tensor."""

    fqn: str
    """State name + state_dict path, e.g. ``model.layer.0.weight``."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix."""
    global_shape: list[int]
    """Shape of the whole (unsharded) tensor."""
    offset: list[int]
    """Index of this box's first element in the global tensor, per dimension."""
    shape: list[int]
    """Shape of this box."""
    codec: str
    params: dict[str, Any] = field(default_factory=dict)
    """Codec parameters needed to decode (JSON-serializable)."""
    file: str
    """Data file name inside the step folder."""
    byte_offset: int
    nbytes: int
    checksum: str
    """xxh3-64 hex digest of the stored bytes."""
    base_step: int | None = None
    """For a delta: the step whose reconstruction this chunk applies to."""


@dataclass(kw_only=True, slots=True)
class ObjectEntry:
    """Non-tensor state (RNG, step counters, sampler position) stored per rank."""

    fqn: str
    file: str
    byte_offset: int
    nbytes: int
    checksum: str
    encoding: str = OBJECTS_TORCH_PICKLE
    """How the bytes encode the objects: ``tree-json`` (data) or ``torch-pickle``. Absent
    in checkpoints written before the field existed, whose objects are pickles."""


@dataclass(kw_only=True, slots=True)
class RankManifest:
    version: int = FORMAT_VERSION
    step: int
    rank: int
    world_size: int
    created: float
    chunks: list[ChunkEntry] = field(default_factory=list)
    objects: list[ObjectEntry] = field(default_factory=list)
    nbytes: int = 0
    """Bytes this rank stored for this step."""

    def to_json(self) -> bytes:
        return _dumps(asdict(self))

    @classmethod
    def from_json(
        cls, data: bytes | bytearray | str, *, where: str = "rank manifest"
    ) -> RankManifest:
        raw = _loads(data, where)
        _check_version(raw, where)
        _typed(raw, _RANK_TYPES, where)
        try:
            raw["chunks"] = [
                ChunkEntry(**_typed(c, _CHUNK_TYPES, f"{where}: chunk {i}"))
                for i, c in enumerate(raw.get("chunks", []))
            ]
            raw["objects"] = [
                ObjectEntry(**_typed(o, _OBJECT_TYPES, f"{where}: object {i}"))
                for i, o in enumerate(raw.get("objects", []))
            ]
            return cls(**raw)
        except TypeError as e:
            raise ManifestError(f"{where}: {e}") from e

    @property
    def base_steps(self) -> set[int]:
        return {c.base_step for c in self.chunks if c.base_step is not None}


@dataclass(kw_only=True, slots=True)
class GlobalManifest:
    """Written last; its presence is what makes a step committed."""

    version: int = FORMAT_VERSION
    step: int
    world_size: int
    created: float
    kind: str = "full"
    """``full`` or ``delta`` (some chunk depends on an older step)."""
    base_steps: list[int] = field(default_factory=list)
    """Steps this checkpoint needs to be restored (direct bases)."""
    nbytes: int = 0
    ranks: list[str] = field(default_factory=list)
    """Rank manifest file names, index = rank."""
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return _dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes | bytearray | str, *, where: str = MANIFEST) -> GlobalManifest:
        raw = _loads(data, where)
        _check_version(raw, where)
        _typed(raw, _GLOBAL_TYPES, where)
        try:
            return cls(**raw)
        except TypeError as e:
            raise ManifestError(f"{where}: {e}") from e


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _loads(data: bytes | bytearray | str, where: str) -> dict[str, Any]:
    """The JSON object of a manifest, parsed within ``manifest_json``'s size and nesting
    caps: a crafted file can neither exhaust memory nor reach a ``RecursionError``."""
    try:
        raw = manifest_json.loads(data)
    except manifest_json.OutOfBoundsError as e:
        raise ManifestError(f"{where} is not a valid manifest ({e}); the file is corrupt") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where} is not valid JSON ({e}); the file is corrupt") from e
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} is not a JSON object")
    return raw


def _typed(raw: Any, spec: manifest_json.Spec, where: str) -> dict[str, Any]:
    """``raw`` itself once every field ``spec`` names has its kind; else ``ManifestError``
    naming the field (a string where a number belongs must not reach arithmetic)."""
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} is not a JSON object")
    try:
        manifest_json.check_types(raw, spec)
    except ValueError as e:
        raise ManifestError(f"{where}: {e}") from None
    return raw


def _check_version(raw: dict[str, Any], where: str) -> None:
    version = raw.get("version")
    if version != FORMAT_VERSION:
        raise ManifestError(
            f"{where} has format version {version!r}; this checkflow reads version "
            f"{FORMAT_VERSION}. Upgrade checkflow to read it."
        )
