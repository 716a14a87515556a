"""Which checkpoint a restarted job resumes from, read for this rank.

The newest committed step (or the one asked for) that every rank can read: a checkpoint that
fails verification is skipped with a warning and the next older one is tried, and with
several ranks they agree in the job's store on one step, so all resume from the same one.
"""

from __future__ import annotations

import warnings
from typing import Any

from checkflow import distributed
from checkflow.catalog import committed_steps
from checkflow.restore import RESTORE_ERRORS, CheckpointReader, NoCheckpointError
from checkflow.storage import Storage


def candidate_steps(storage: Storage, step: int | None) -> list[int]:
    """Committed steps to try, newest first: all of them, or ``step`` and older ones.

    Raises:
        NoCheckpointError: ``step`` was asked for and is not committed.
    """
    steps = sorted(committed_steps(storage), reverse=True)
    if step is None:
        return steps
    if step not in steps:
        raise NoCheckpointError(f"no committed checkpoint at step {step} in {storage.uri}")
    return [s for s in steps if s <= step]


def read_newest(
    storage: Storage,
    state: dict[str, Any],
    steps: list[int],
    *,
    rank: int,
    sync: distributed.RankSync | None,
    trust: bool,
) -> tuple[int, dict[str, Any]] | None:
    """This rank's state dicts of the newest step in ``steps`` that every rank reads.

    Returns:
        ``(step, state_dicts)``, or None when no candidate could be read (with a warning
        when there were candidates).
    """
    reader = CheckpointReader(storage, trust=trust)
    live = distributed.live_state(state)

    def read(candidate: int) -> dict[str, Any] | None:
        try:
            return distributed.read_state_dicts(reader, candidate, rank, live)
        except RESTORE_ERRORS as e:
            warnings.warn(
                f"checkpoint step {candidate} in {storage.uri} cannot be restored ({e}); "
                "falling back to the next older checkpoint",
                stacklevel=3,
            )
            return None

    found = distributed.restore_point(steps, read, sync)
    if found is None and steps:
        warnings.warn(
            f"no checkpoint in {storage.uri} could be restored; starting at 0", stacklevel=3
        )
    return found
