"""The one validation of a checkpoint's manifests, shared by every reader. Pure; no torch.

``checkflow.manifest`` parses a manifest within size and nesting caps and checks each
field's type; this module checks what the values mean, before any byte of data is read:

- a global manifest: its step is its folder's, a sane ``world_size``, a rank manifest name
  per rank, bases strictly older than the step (so a delta chain can never cycle);
- a rank manifest: it is the rank and step it sits at, and each chunk has a known dtype,
  a box of the tensor's rank inside ``global_shape``, a tensor no larger than
  :data:`MAX_TENSOR_BYTES`, no more than :data:`MAX_EXPANSION` decoded bytes per stored byte,
  a plain file name, and a base the global manifest lists;
- a step's chunks of each tensor: one dtype and shape, no two overlapping, and (for a
  storage checkpoint, which holds every rank) together exactly the whole tensor.

``verify``, ``restore``, ``load``, ``inspect`` and the RAM tier all read through
``read.reader.CheckpointReader`` and ``ls``/``gc`` through ``catalog.scan``, which call these
functions; so ``verify`` passes exactly what a restore accepts. Each check is linear in the
chunks but for the overlap test (a sort and a grid of each tensor's boxes), once per
manifest read.

Together the caps bound what a reader allocates: no tensor is larger than
``MAX_TENSOR_BYTES``, and a step's tensors decode to at most ``MAX_EXPANSION`` times the bytes
its chunks declare stored (plus 1 MiB a chunk), which reads of those bytes must find.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Callable, Iterable

from checkflow import manifest as mf

MAX_WORLD_SIZE = 1 << 20
"""Most ranks a checkpoint may declare."""
MAX_DIMS = 64
"""Most dimensions a tensor may have (torch allows 64)."""
MAX_TENSOR_BYTES = 1 << 42
"""Largest tensor a manifest may declare (4 TiB), whatever its chunks store."""
MAX_EXPANSION = 1 << 16
"""Most decoded bytes per stored byte of a chunk: zstd cannot expand more than ~32,768x
(an RLE block of 128 KiB in 4 bytes); the q codecs store at least 2 bits an element."""
EXPANSION_SLACK = 1 << 20
"""Decoded bytes a chunk may have beyond ``MAX_EXPANSION`` times its stored bytes."""
MAX_DELTA_CHAIN = 4096
"""Longest delta chain a reader follows (a full checkpoint comes every ``full_every``)."""
GRID_BUDGET = 1 << 20
"""Grid cells the overlap test may visit in one step beyond 8 per chunk."""
KINDS = ("full", "delta")

DTYPE_SIZES = {
    **dict.fromkeys(("float64", "double", "int64", "long", "uint64", "complex64", "cfloat"), 8),
    **dict.fromkeys(("float32", "float", "int32", "int", "uint32", "complex32", "chalf"), 4),
    **dict.fromkeys(("float16", "half", "bfloat16", "int16", "short", "uint16"), 2),
    **dict.fromkeys(("int8", "uint8", "bool", "float8_e4m3fn", "float8_e5m2"), 1),
    **dict.fromkeys(("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"), 1),
    **dict.fromkeys(("float4_e2m1fn_x2", "bits8"), 1),
    "bits16": 2,
    **dict.fromkeys(("complex128", "cdouble"), 16),
}
"""Bytes per element of every dtype name a chunk may carry (torch's, without ``torch.``)."""


class DamagedStepError(mf.ManifestError):
    """A step's manifests describe something no checkpoint can be: the step is damaged.
    Names the step, rank, tensor and file, as ``read.errors.CorruptCheckpointError`` does."""

    def __init__(self, step: int, rank: int | str, fqn: str, file: str, problem: str) -> None:
        self.step, self.rank, self.fqn, self.file = step, rank, fqn, file
        super().__init__(f"step {step}, rank {rank}, tensor {fqn!r}, file {file}: {problem}")


def check_global(gm: mf.GlobalManifest, step: int) -> None:
    """Raise ``DamagedStepError`` unless ``gm`` can be the commit of ``step``."""
    problem = _global_problem(gm, step)
    if problem is not None:
        raise DamagedStepError(step, "*", "*", mf.MANIFEST, problem)


def _global_problem(gm: mf.GlobalManifest, step: int) -> str | None:
    if gm.step != step:
        return f"says step {gm.step}, but sits in the folder of step {step}"
    if not 1 <= gm.world_size <= MAX_WORLD_SIZE:
        return f"world_size {gm.world_size} is not between 1 and {MAX_WORLD_SIZE}"
    if gm.ranks and len(gm.ranks) != gm.world_size:
        return f"lists {len(gm.ranks)} rank manifests for world_size {gm.world_size}"
    if gm.kind not in KINDS:
        return f"kind {gm.kind!r:.40} is neither 'full' nor 'delta'"
    if gm.nbytes < 0:
        return f"nbytes {gm.nbytes} is negative"
    if bad := [b for b in gm.base_steps if not 0 <= b < step]:
        return f"base step {bad[0]} is not older than the step itself (a delta chain cycle)"
    return None


def check_rank(rm: mf.RankManifest, gm: mf.GlobalManifest, step: int, rank: int) -> None:
    """Raise ``DamagedStepError`` unless ``rm`` can be rank ``rank``'s part of ``step``
    (committed as ``gm``): its identity, then every chunk and object entry."""
    name = mf.rank_manifest_name(rank)
    if (rm.step, rm.rank, rm.world_size) != (step, rank, gm.world_size):
        raise DamagedStepError(
            step,
            rank,
            "*",
            name,
            f"says step {rm.step}, rank {rm.rank} of {rm.world_size}; expected step {step}, "
            f"rank {rank} of {gm.world_size}",
        )
    for o in rm.objects:
        if (problem := _range_problem(o.file, o.byte_offset, o.nbytes)) is not None:
            raise DamagedStepError(step, rank, o.fqn, o.file, problem)
    bases = set(gm.base_steps)
    for c in rm.chunks:
        problem = _chunk_problem(c) or _base_problem(c.base_step, step, bases)
        if problem is not None:
            raise DamagedStepError(step, rank, c.fqn, c.file, problem)


def _range_problem(file: str, byte_offset: int, nbytes: int) -> str | None:
    if not file or "/" in file or "\\" in file or "\0" in file or file in (".", ".."):
        return f"file name {file!r:.60} is not a plain name inside the step folder"
    if byte_offset < 0 or nbytes < 0:
        return f"byte range {byte_offset}+{nbytes} is negative"
    return None


def _base_problem(base: int | None, step: int, bases: set[int]) -> str | None:
    if base is None:
        return None
    if not 0 <= base < step:
        return f"delta base step {base} is not older than step {step} (a delta chain cycle)"
    if base not in bases:
        return f"delta base step {base} is not among the base_steps of {mf.MANIFEST}"
    return None


def _chunk_problem(c: mf.ChunkEntry) -> str | None:
    """What makes one chunk entry impossible, or None."""
    itemsize = DTYPE_SIZES.get(c.dtype)
    if itemsize is None:
        return f"unknown dtype {c.dtype!r:.40}"
    dims = len(c.global_shape)
    if dims > MAX_DIMS or len(c.offset) != dims or len(c.shape) != dims:
        return (
            f"offset {c.offset} and shape {c.shape} do not both have the "
            f"{dims} dimensions of global_shape"
        )
    if any(n < 0 for n in (*c.global_shape, *c.offset, *c.shape)):
        return f"global_shape {c.global_shape}, offset {c.offset} or shape {c.shape} is negative"
    if any(o + n > g for o, n, g in zip(c.offset, c.shape, c.global_shape, strict=True)):
        return f"box at {c.offset} of shape {c.shape} exceeds global_shape {c.global_shape}"
    if math.prod(c.global_shape) * itemsize > MAX_TENSOR_BYTES:
        return f"global_shape {c.global_shape} is larger than {MAX_TENSOR_BYTES >> 40} TiB"
    decoded = math.prod(c.shape) * itemsize
    if decoded > MAX_EXPANSION * c.nbytes + EXPANSION_SLACK:
        return f"declares {decoded} decoded bytes from {c.nbytes} stored bytes"
    return _range_problem(c.file, c.byte_offset, c.nbytes)


def walk_bases(step: int, manifest: Callable[[int], mf.GlobalManifest]) -> list[int]:
    """Every step the delta chains of ``step`` reach, read with ``manifest`` (which
    validates each commit, and raises when one is damaged or missing). Iterative, and it
    ends: each commit's bases are strictly older than it (:func:`check_global`)."""
    todo, seen = list(manifest(step).base_steps), set()
    while todo:
        if (base := todo.pop()) not in seen:
            seen.add(base)
            todo.extend(manifest(base).base_steps)
    return sorted(seen)


def check_layout(step: int, parts: Iterable[tuple[int, mf.ChunkEntry]], *, complete: bool) -> None:
    """Raise ``DamagedStepError`` unless, for each tensor, the chunks of ``parts`` agree on
    dtype and global shape and no two of them overlap; with ``complete`` (a storage
    checkpoint: every rank's chunks) they must also cover the whole tensor.

    The overlap test is exact: boxes that are inside the tensor and pairwise disjoint cover
    it exactly when their sizes add up to its size (a sum alone lets two chunks of the same
    rows stand for a missing half).
    """
    by_fqn: dict[str, list[tuple[int, mf.ChunkEntry]]] = {}
    for rank, c in parts:
        by_fqn.setdefault(c.fqn, []).append((rank, c))
    budget = GRID_BUDGET + 8 * sum(map(len, by_fqn.values()))
    for fqn, chunks in by_fqn.items():
        budget -= _check_tensor(step, fqn, chunks, budget, complete=complete)


def _check_tensor(
    step: int, fqn: str, chunks: list[tuple[int, mf.ChunkEntry]], budget: int, *, complete: bool
) -> int:
    """``check_layout`` for one tensor; returns the grid cells it visited."""
    rank0, first = chunks[0]
    for rank, c in chunks:
        if c.dtype != first.dtype or c.global_shape != first.global_shape:
            raise DamagedStepError(
                step,
                rank,
                fqn,
                c.file,
                f"a {c.dtype} chunk of global_shape {c.global_shape}, where rank {rank0} "
                f"stored {first.dtype} of {first.global_shape}",
            )
    boxes = _without_replicas([(r, c) for r, c in chunks if math.prod(c.shape) > 0])
    visited = _disjoint(step, fqn, boxes, budget) if len(boxes) > 1 else len(boxes)
    total = math.prod(first.global_shape)
    covered = sum(math.prod(c.shape) for _, c in boxes)
    if complete and covered != total:
        raise DamagedStepError(
            step, rank0, fqn, first.file, f"chunks cover {covered} of {total} elements"
        )
    return visited


def _without_replicas(
    boxes: list[tuple[int, mf.ChunkEntry]],
) -> list[tuple[int, mf.ChunkEntry]]:
    """``boxes`` less the exact replicas of another rank's box: under SPMD each host writes
    the values every device holds (a replicated optimizer step), the same box each. A box
    repeated within one rank is no replica: it stays, and overlaps."""
    first: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    kept = []
    for rank, c in boxes:
        key = (tuple(c.offset), tuple(c.shape))
        if first.setdefault(key, rank) == rank:
            kept.append((rank, c))
    return kept


def _disjoint(step: int, fqn: str, boxes: list[tuple[int, mf.ChunkEntry]], budget: int) -> int:
    """Raise ``DamagedStepError`` if two of ``boxes`` overlap; returns the cells visited.

    The boxes' edges cut the tensor into a grid; each box covers a block of its cells, and
    two boxes overlap exactly when they share a cell. A tensor cut along one dimension (the
    writer's 64 MiB pieces, a shard per rank) has one cell per box.
    """
    dims = len(boxes[0][1].global_shape)
    edges = [
        sorted({c.offset[d] for _, c in boxes} | {c.offset[d] + c.shape[d] for _, c in boxes})
        for d in range(dims)
    ]
    owner: dict[tuple[int, ...], tuple[int, mf.ChunkEntry]] = {}
    for rank, c in boxes:
        spans = [
            range(bisect_left(e, c.offset[d]), bisect_left(e, c.offset[d] + c.shape[d]))
            for d, e in enumerate(edges)
        ]
        for cell in itertools.product(*spans):
            if cell in owner:
                other_rank, other = owner[cell]
                raise DamagedStepError(
                    step,
                    rank,
                    fqn,
                    c.file,
                    f"chunk at {c.offset} of shape {c.shape} overlaps rank {other_rank}'s "
                    f"chunk at {other.offset} of shape {other.shape}",
                )
            owner[cell] = (rank, c)
            if len(owner) > budget:
                raise DamagedStepError(
                    step, rank, fqn, c.file, "chunks cut the tensor into too many pieces to check"
                )
    return len(owner)
