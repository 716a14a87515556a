"""Which checkpoint a restarted job resumes from, read for this rank.

The newest committed step (or the one asked for) that every rank can read: a checkpoint that
fails verification is skipped with a warning and the next older one is tried, and with
several ranks they agree in the job's store on one step, so all resume from the same one.

With a RAM tier (``checkflow.memory``) a step this rank's RAM root holds is read from there;
a RAM copy that cannot be read (damaged, missing) is read from storage instead, with a
warning. When the step asked for (the coordinator's restore point) is in the RAM tier,
storage is not even listed.
"""

from __future__ import annotations

import warnings
from typing import Any

from checkflow import timeline as tl
from checkflow.catalog import committed_steps, marked_after
from checkflow.lineage import write_timeline
from checkflow.memory.copies import RamCopies
from checkflow.memory.tier import RamTier
from checkflow.parallel.adapters import live_state
from checkflow.parallel.agreement import RankSync, restore_point
from checkflow.read.errors import RESTORE_ERRORS, NoCheckpointError
from checkflow.read.reader import CheckpointReader
from checkflow.read.state_dicts import read_state_dicts
from checkflow.storage import Storage
from checkflow.write.persist import PersistWorker


def candidate_steps(storage: Storage, step: int | None, *, advised: bool = False) -> list[int]:
    """Committed steps to try, newest first: all of them, or ``step`` and older ones.

    ``advised``: ``step`` is the coordinator's restore point, not the caller's choice. When
    storage does not confirm it (no readable ``MANIFEST.json``: a commit the coordinator
    accepted but that was never written) the older committed steps are tried, with a
    warning: storage, not the coordinator, is the truth.

    Raises:
        NoCheckpointError: ``step`` was asked for (not advised) and is not committed.
    """
    steps = sorted(committed_steps(storage), reverse=True)
    if step is None:
        return steps
    if step not in steps:
        if not advised:
            raise NoCheckpointError(f"no committed checkpoint at step {step} in {storage.uri}")
        warnings.warn(
            f"the coordinator's restore point, step {step}, is not committed in {storage.uri}; "
            "restoring the newest older committed step instead",
            stacklevel=3,
        )
    return [s for s in steps if s <= step]


def read_newest(
    storage: Storage,
    state: dict[str, Any],
    steps: list[int],
    *,
    rank: int,
    sync: RankSync | None,
    trust: bool,
    ram: RamCopies | None = None,
    tiers: dict[int, str] | None = None,
) -> tuple[int, dict[str, Any]] | None:
    """This rank's state dicts of the newest step in ``steps`` that every rank reads.

    Args:
        ram: this rank's RAM copies, read first for the steps they hold.
        tiers: filled with ``{step: "ram" | "storage"}``: where each read came from.

    Returns:
        ``(step, state_dicts)``, or None when no candidate could be read (with a warning
        when there were candidates).
    """
    live = live_state(state)
    # Bytes bound for XLA devices are read past the page cache (``Storage.read``).
    reader = CheckpointReader(storage, trust=trust, direct=live.on_xla)
    in_ram = ram.steps() if ram is not None else set()
    tiers = tiers if tiers is not None else {}
    failed: list[int] = []

    def read(candidate: int) -> dict[str, Any] | None:
        if ram is not None and candidate in in_ram:
            try:
                tiers[candidate] = "ram"
                return ram.read(candidate, live, trust=trust)
            except RESTORE_ERRORS as e:
                failed.append(candidate)
                warnings.warn(
                    f"the RAM copy of step {candidate} in {ram.root} cannot be restored ({e}); "
                    f"reading step {candidate} from {storage.uri} instead",
                    stacklevel=3,
                )
        try:
            tiers[candidate] = "storage"
            return read_state_dicts(reader, candidate, rank, live)
        except RESTORE_ERRORS as e:
            failed.append(candidate)
            warnings.warn(
                f"checkpoint step {candidate} in {storage.uri} cannot be restored ({e}); "
                "falling back to the next older checkpoint",
                stacklevel=3,
            )
            return None

    found = restore_point(steps, read, sync)
    if found is None and steps:
        _nothing_restored(storage.uri, [s for s in failed if s in live.landed])
    return found


def _nothing_restored(uri: str, landed: list[int]) -> None:
    """Warn that training starts at 0; raise instead when failed reads of the steps
    ``landed`` may have copied tensors into the live model or optimizer already (as they
    are read, ``read_state_dicts``): starting at 0 would train on part of a checkpoint."""
    if landed:
        raise RuntimeError(
            f"no checkpoint in {uri} could be restored, and reading step {landed[0]} may "
            "already have copied some of its tensors into the live model or optimizer; "
            "create them anew before training from step 0"
        )
    warnings.warn(f"no checkpoint in {uri} could be restored; starting at 0", stacklevel=4)


def tiered_candidates(storage: Storage, ram: RamCopies, step: int | None) -> list[int]:
    """Steps to try with a RAM tier, newest first: when ``step`` is in this rank's RAM root,
    it and the older RAM steps (storage is not listed: a damaged copy is read from storage
    by its step); else the committed steps of both tiers (at or below ``step``)."""
    in_ram = ram.steps()
    if step is not None and step in in_ram:
        return sorted((s for s in in_ram if s <= step), reverse=True)
    stored = committed_steps(storage)
    both = set(stored) | in_ram
    return sorted((s for s in both if step is None or s <= step), reverse=True)


def read_tiered(
    storage: Storage,
    state: dict[str, Any],
    step: int | None,
    sync: RankSync | None,
    ram: RamTier | None,
    *,
    rank: int,
    trust: bool,
    advised: bool = False,
    persist: PersistWorker | None = None,
) -> tuple[tuple[int, dict[str, Any]] | None, str]:
    """``read_newest`` over the candidates of both tiers; returns what it read and from which
    tier (``"ram"``, ``"storage"``, or ``""`` when nothing was read).

    When ``step`` was found only in the RAM tier and no RAM copy reads, the committed steps
    of storage are tried as without a RAM tier. Every rank takes the same branches: the
    agreement returns the same result on all of them. ``advised``: ``step`` is the
    coordinator's restore point (see :func:`candidate_steps`). ``persist`` writes to the
    timeline that goes on from what was read (:func:`continue_timeline`), and ``ram``
    forgets its copies of the steps after it.
    """
    tiers: dict[int, str] = {}
    copies = ram.copies() if ram is not None else None
    steps = (
        candidate_steps(storage, step, advised=advised)
        if copies is None
        else tiered_candidates(storage, copies, step)
    )
    found = read_newest(
        storage, state, steps, rank=rank, sync=sync, trust=trust, ram=copies, tiers=tiers
    )
    if found is None and copies is not None:
        # ``step`` may be a RAM-only step (the coordinator's restore point): not an error.
        steps = [s for s in candidate_steps(storage, None) if step is None or s <= step]
        found = read_newest(storage, state, steps, rank=rank, sync=sync, trust=trust, tiers=tiers)
    restored = found[0] if found is not None else None
    if ram is not None:  # its copies of later steps are another timeline's from now on
        ram.forget_after(-1 if restored is None else restored)
    if persist is not None:
        persist.continue_after_restore(lambda: continue_timeline(storage, restored, sync)[0])
    return found, tiers.get(found[0], "") if found is not None else ""


def continue_timeline(
    storage: Storage, restored: int | None, sync: RankSync | None
) -> tuple[int, int | None]:
    """The timeline to write to after restoring ``restored`` (None: nothing was), and the
    step it forked at (None: no rollback, the current timeline goes on).

    A restore older than a committed (or damaged) step of the current lineage is a
    rollback: rank 0 writes the next ``TIMELINE-<K>.json`` (``checkflow.timeline``) and
    tells the other ranks K through the job's store, so the steps taken from now on go to
    folders of their own and no committed folder is ever written again. Every rank calls
    this at the same point: the first persist after a restore (``PersistWorker``), so that
    a restore that writes nothing (an evaluation) records no rollback.
    """

    def decide() -> dict[str, int]:
        lineage, newer = marked_after(storage, restored)  # no manifest read: RAM restores
        if not newer:
            return {"timeline": lineage.current}
        record = tl.next_timeline(lineage, -1 if restored is None else restored)
        write_timeline(storage, record)
        return {"timeline": record.timeline, "forked_at": record.forked_at}

    decided = decide() if sync is None else sync.from_rank0("roll back", decide)
    return int(decided["timeline"]), decided.get("forked_at")
