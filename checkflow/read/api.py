"""Reading checkpoints from outside a training job: list them, pick a step, load one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from checkflow import manifest as mf
from checkflow.catalog import committed_steps, scan
from checkflow.read.errors import NoCheckpointError
from checkflow.read.reader import CheckpointReader, Progress
from checkflow.read.state_dicts import consolidated_state_dicts
from checkflow.storage import Storage


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    step: int
    created: float
    nbytes: int
    kind: str
    base_steps: tuple[int, ...]
    world_size: int


def open_storage(uri: str | Storage, storage_options: dict[str, Any] | None = None) -> Storage:
    return uri if isinstance(uri, Storage) else Storage(uri, storage_options=storage_options)


def list_checkpoints(
    uri: str | Storage, *, storage_options: dict[str, Any] | None = None
) -> list[CheckpointInfo]:
    """Committed checkpoints under ``uri``, oldest first."""
    storage = open_storage(uri, storage_options)
    return [
        CheckpointInfo(
            step=s,
            created=m.created,
            nbytes=m.nbytes,
            kind=m.kind,
            base_steps=tuple(m.base_steps),
            world_size=m.world_size,
        )
        for s, m in committed_steps(storage).items()
    ]


def resolve_step(storage: Storage, step: int | None) -> int:
    """``step`` itself when committed, else the newest committed step.

    Raises:
        NoCheckpointError: nothing is committed (at that step).
        ManifestError: ``step`` was asked for and its commit is damaged (says how).
    """
    cat = scan(storage)
    steps = cat.committed
    if step is not None and step in cat.damaged:
        raise mf.ManifestError(f"step {step} is damaged: {cat.damaged[step]}")
    if step is None:
        if not steps:
            raise NoCheckpointError(f"no committed checkpoint in {storage.uri}")
        return max(steps)
    if step not in steps:
        have = ", ".join(str(s) for s in steps) or "none"
        raise NoCheckpointError(
            f"no committed checkpoint at step {step} in {storage.uri} (have: {have})"
        )
    return step


def load(
    uri: str | Storage,
    step: int | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    trust: bool = False,
) -> dict[str, Any]:
    """``{name: state_dict}`` of a checkpoint, consolidated on CPU; the newest by default.

    Args:
        trust: unpickle objects stored as pickles (saved with ``allow_pickle=True``, or by
            a checkflow older than objects stored as data). Unpickling runs code from the
            checkpoint: only for checkpoints whose writer you trust.

    Raises:
        NoCheckpointError: nothing is committed (at ``step``).
        CorruptCheckpointError: a chunk fails its checksum or cannot be decoded.
        UntrustedCheckpointError: an object is a pickle and ``trust`` is False.
    """
    storage = open_storage(uri, storage_options)
    reader = CheckpointReader(storage, progress, trust=trust)
    # Pipeline stages each saved their own modules: the consolidated view joins them.
    return consolidated_state_dicts(reader, resolve_step(storage, step))
