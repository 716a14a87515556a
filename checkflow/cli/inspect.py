"""``checkflow inspect URI``: the tensors and objects of one checkpoint, from its manifests.

Nothing is unpickled: objects stored as pickles show as their type and size.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from checkflow.cli.arguments import Command, add_uri, open_root
from checkflow.cli.describe import object_leaves
from checkflow.cli.output import (
    EXIT_FAILED,
    EXIT_OK,
    fmt_shape,
    fmt_steps,
    fmt_time,
    human_bytes,
    line,
    table,
)

if TYPE_CHECKING:
    from checkflow.manifest import GlobalManifest, RankManifest


@dataclass(slots=True)
class TensorSummary:
    """One tensor over every rank's chunks."""

    fqn: str
    dtype: str
    shape: list[int]
    codecs: list[str] = field(default_factory=list)
    base_steps: set[int] = field(default_factory=set)
    nbytes: int = 0
    chunks: int = 0
    ranks: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Inspection:
    """What ``inspect`` shows of one step; ``objects_error`` when the objects are unreadable."""

    uri: str
    manifest: GlobalManifest
    tensors: list[TensorSummary]
    objects: list[tuple[str, str]]
    objects_error: str | None


def configure(parser: argparse.ArgumentParser) -> None:
    add_uri(parser)
    parser.add_argument("--step", type=int, help="the step (default: the newest committed)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    """Tensors (fqn, dtype, shape, codecs, bases, bytes, chunks) and objects of one step."""
    seen = _inspect(args)
    if args.json:
        line(json.dumps(_as_json(seen)))
    else:
        _print(seen)
    return EXIT_FAILED if seen.objects_error else EXIT_OK


def summarize_tensors(rank_manifests: list[RankManifest]) -> list[TensorSummary]:
    """One summary per tensor over every rank's chunks, in stored order."""
    out: dict[str, TensorSummary] = {}
    for rm in rank_manifests:
        for c in rm.chunks:
            s = out.setdefault(c.fqn, TensorSummary(c.fqn, c.dtype, list(c.global_shape)))
            if c.codec not in s.codecs:
                s.codecs.append(c.codec)
            if c.base_step is not None:
                s.base_steps.add(c.base_step)
            s.nbytes += c.nbytes
            s.chunks += 1
            s.ranks.add(rm.rank)
    return list(out.values())


def _inspect(args: argparse.Namespace) -> Inspection:
    from checkflow.read.api import resolve_step
    from checkflow.read.errors import CorruptCheckpointError
    from checkflow.read.reader import CheckpointReader

    storage = open_root(args)
    step = resolve_step(storage, args.step)
    reader = CheckpointReader(storage)
    g = reader.manifest(step)
    tensors = summarize_tensors(reader.rank_manifests(step))
    try:
        # Opaque: inspect describes pickled objects (type, size) and never unpickles them.
        objects = list(object_leaves(reader.skeleton(step, 0, opaque=True)))
        objects_error = None
    except CorruptCheckpointError as e:
        objects, objects_error = [], str(e)
    return Inspection(args.uri, g, tensors, objects, objects_error)


def _print(seen: Inspection) -> None:
    g = seen.manifest
    line(f"checkpoint step {g.step} in {seen.uri}")
    line(
        f"  kind {g.kind}, base steps {fmt_steps(g.base_steps)}, world size {g.world_size}, "
        f"{human_bytes(g.nbytes)} stored, created {fmt_time(g.created)}"
    )
    if g.meta:
        line(f"  meta {json.dumps(g.meta, sort_keys=True, default=str)}")
    line()
    tensors = seen.tensors
    rows = [
        [t.fqn, t.dtype, fmt_shape(t.shape), ",".join(t.codecs), fmt_steps(t.base_steps)]
        + [human_bytes(t.nbytes), t.chunks]
        for t in tensors
    ]
    table(["TENSOR", "DTYPE", "SHAPE", "CODEC", "BASE", "BYTES", "CHUNKS"], rows, right={5, 6})
    elements = sum(math.prod(t.shape) for t in tensors)
    stored = sum(t.nbytes for t in tensors)
    line(f"{len(tensors)} tensors, {elements} elements, {human_bytes(stored)} stored")
    line()
    if seen.objects_error:
        line(f"objects: unreadable: {seen.objects_error}")
        return
    who = "" if g.world_size == 1 else f" (rank 0 of {g.world_size})"
    table([f"OBJECT{who}", "VALUE"], seen.objects)


def _as_json(seen: Inspection) -> dict[str, Any]:
    g = seen.manifest
    return {
        "uri": seen.uri,
        "step": g.step,
        "kind": g.kind,
        "base_steps": g.base_steps,
        "world_size": g.world_size,
        "nbytes": g.nbytes,
        "created": g.created,
        "meta": g.meta,
        "tensors": [
            {
                "fqn": t.fqn,
                "dtype": t.dtype,
                "shape": t.shape,
                "codecs": t.codecs,
                "base_steps": sorted(t.base_steps),
                "nbytes": t.nbytes,
                "chunks": t.chunks,
                "ranks": sorted(t.ranks),
            }
            for t in seen.tensors
        ],
        "objects": dict(seen.objects),
        "objects_error": seen.objects_error,
    }


COMMAND = Command("inspect", "tensors and objects of one checkpoint", configure, run)
