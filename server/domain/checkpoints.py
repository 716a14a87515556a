"""Rules for checkpoints: per-rank persist reports, the commit, commits found on storage.

A checkpoint is committed once its global manifest is written; exactly one rank writes it:
the one whose report completed the set of ranks.
"""

from __future__ import annotations

from collections.abc import Iterable

from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.errors import Conflict, NotFound
from checkflow_server.domain.generation import restart_schedule
from checkflow_server.domain.ranks import check_rank
from checkflow_server.domain.state import Checkpoint, Job, Part
from checkflow_server.domain.tuning import reached
from checkflow_server.domain.views import checkpoint_public, restore_point

from checkflow.protocol import (
    CheckpointKind,
    CheckpointPublic,
    CheckpointSource,
    CheckpointStatus,
    CheckpointTier,
    CommitReport,
    PartReply,
    PartReport,
    RestoredReport,
    RestorePoint,
    RetentionReport,
)

RAM_STEPS_KEPT = 4
"""RAM-tier steps the coordinator remembers per job (ranks keep 1 or 2 of them)."""

IN_PROGRESS = CheckpointStatus.IN_PROGRESS
COMMITTED = CheckpointStatus.COMMITTED
ABANDONED = CheckpointStatus.ABANDONED


def report_part(
    job: Job, step: int, rank: int, body: PartReport, now: float
) -> tuple[PartReply, Changes]:
    """``rank`` persisted its part of ``step``; the reply says whether it must commit.

    Exactly one rank is told to commit: the one whose report completed the set (asked
    again, it gets True again, so a retried request is safe).

    Raises:
        NotFound: an unknown rank.
        Conflict: a stale generation, or a step abandoned in this generation.
    """
    check_rank(job, rank)
    if body.jit and body.tier == CheckpointTier.RAM and jit_accepted(job, body.generation):
        return _ram_part(job, step, rank, jit=True), Changes()
    if body.generation != job.generation:
        raise Conflict(
            f"generation {body.generation} is not the job's current generation {job.generation}"
        )
    changes = Changes()
    if body.tier == CheckpointTier.RAM:
        job.max_step = max(job.max_step, step)  # a RAM-only step: no storage checkpoint
        return _ram_part(job, step, rank), changes
    ck = job.checkpoints.get(step)
    if ck is not None and ck.status == COMMITTED:
        return _part_reply(job, ck, must_commit=False), changes
    retry = ck is not None and retakes(ck, body.generation, body.manifest_path)
    if ck is not None and ck.status == ABANDONED and not retry:
        raise Conflict(f"checkpoint {step} was abandoned (the job moved on)")
    if ck is None or retry:
        ck = Checkpoint(step=step, generation=body.generation, status=IN_PROGRESS, started=now)
        job.checkpoints[step] = ck
        if retry:
            changes.parts_cleared.append(step)
    old = ck.parts.get(rank)
    ck.nbytes += body.nbytes - (old.nbytes if old else 0)
    part = Part(rank, body.nbytes, body.duration_s, body.manifest_path, now)
    ck.parts[rank] = part
    ck.kind = combined_kind(ck.kind, body.kind)
    ck.persisted = len(ck.parts)
    if len(ck.parts) == job.world_size and ck.committer is None:
        ck.committer = rank
    changes.checkpoint(ck)
    changes.parts.append((step, part))
    changes.job |= reached(job, step)
    return _part_reply(job, ck, must_commit=ck.committer == rank), changes


def retakes(ck: Checkpoint, generation: int, manifest_path: str) -> bool:
    """Whether a part of generation ``generation`` written at ``manifest_path`` starts the
    abandoned checkpoint ``ck``'s step again from scratch: one of a newer generation (the
    restarted group), or one of this generation in another folder than the abandoned
    attempt's parts (a roll-back by ``restore(step=N)`` re-takes the step on a timeline of
    its own, ``step-….tK``). A late part of the abandoned attempt itself is neither."""
    if ck.status != ABANDONED:
        return False
    if ck.generation < generation:
        return True
    old = {part.manifest_path for part in ck.parts.values()}
    return bool(old) and manifest_path not in old


def combined_kind(
    so_far: CheckpointKind | None, part: CheckpointKind | None
) -> CheckpointKind | None:
    """A checkpoint is a delta when any part is one (``write_commit``'s rule for
    ``MANIFEST.json``); a part that does not say leaves what is known."""
    if part is None or so_far == CheckpointKind.DELTA:
        return so_far
    return part


def jit_accepted(job: Job, generation: int) -> bool:
    """A just-in-time copy counts from the current generation (its rank failed before the
    job moved on) or from the one a *failure* just ended, until every rank of the new one
    registered: the survivors write it as they exit. Never after a roll-back or a resize,
    which end a generation on purpose: its newer steps must not become the restore point."""
    if generation == job.generation:
        return True
    failed = job.recovery is not None and job.recovery.kind is not None
    return failed and job.recovering_since is not None and generation == job.generation - 1


def _ram_part(job: Job, step: int, rank: int, *, jit: bool = False) -> PartReply:
    """``rank`` holds its part of ``step`` in node memory: nothing to commit (each rank's RAM
    copy is whole by itself); once every rank holds it, or a just-in-time replica (``jit``)
    stands for them all, it is a restore point. Kept in memory only, the newest
    :data:`RAM_STEPS_KEPT` steps."""
    holders = job.ram.setdefault(step, set())
    holders.add(rank)
    if jit:
        job.jit.add(step)
    for old in sorted(job.ram)[:-RAM_STEPS_KEPT]:
        del job.ram[old]
        job.jit.discard(old)
    whole = len(holders) == job.world_size or step in job.jit
    return PartReply(
        step=step,
        status=COMMITTED if whole else IN_PROGRESS,
        persisted_ranks=len(holders),
        world_size=job.world_size,
        must_commit=False,
    )


def commit(job: Job, step: int, body: CommitReport, now: float) -> tuple[CheckpointPublic, Changes]:
    """The global manifest of ``step`` is written: it is a restore point from now on.

    Fenced: only a checkpoint in progress in the job's current generation is committed, so
    a commit replayed after a roll-back, or one in flight while it happened, never moves the
    restore point past the step rolled back to. A report without a generation (older
    clients, deprecated) is fenced by the checkpoint's own generation alone.

    Raises:
        NotFound: no rank reported a part of ``step``.
        Conflict: a generation other than the job's, a checkpoint abandoned or of an older
            generation, or not every rank has persisted its part.
    """
    if body.generation is not None and body.generation != job.generation:
        raise Conflict(
            f"generation {body.generation} is not the job's current generation {job.generation}"
        )
    ck = job.checkpoints.get(step)
    if ck is None:
        raise NotFound(f"checkpoint {step} of job {job.name!r} not found")
    changes = Changes()
    if ck.status == COMMITTED:
        return checkpoint_public(job, ck), changes
    if ck.status == ABANDONED or ck.generation != job.generation:
        raise Conflict(
            f"checkpoint {step} is {ck.status} in generation {ck.generation}; the job is in "
            f"generation {job.generation} (it rolled back or failed since)"
        )
    if ck.persisted < job.world_size:
        raise Conflict(
            f"checkpoint {step}: only {ck.persisted} of {job.world_size} ranks persisted"
        )
    ck.status = COMMITTED
    ck.committed_at = now
    if body.rank is not None and ck.committer is None:
        ck.committer = body.rank
    changes.checkpoint(ck)
    changes.committed += 1
    changes.job |= reached(job, step)
    return checkpoint_public(job, ck), changes


def restored(job: Job, rank: int, body: RestoredReport, now: float) -> tuple[RestorePoint, Changes]:
    """``rank`` restored ``body.step`` where its registration advised ``body.advised``:
    storage does not confirm the steps committed here above the one restored (their
    ``MANIFEST.json`` is missing or unreadable: a commit accepted but never written). They
    are abandoned, so that the restore point is what storage holds, and the schedule
    restarts from it. A restored step at or above the advised one changes nothing.

    Raises:
        NotFound: an unknown rank.
        Conflict: a generation other than the job's.
    """
    check_rank(job, rank)
    if body.generation != job.generation:
        raise Conflict(
            f"generation {body.generation} is not the job's current generation {job.generation}"
        )
    changes = Changes()
    low = -1 if body.step is None else body.step
    if body.advised is None or low >= body.advised:
        return restore_point(job), changes
    gone = [
        ck
        for ck in job.checkpoints.values()
        if low < ck.step <= body.advised and ck.status == COMMITTED
    ]
    for ck in gone:
        ck.status = ABANDONED
        changes.checkpoint(ck)
    job.ram = {s: holders for s, holders in job.ram.items() if s <= low}
    job.jit = {s for s in job.jit if s <= low}
    base = restart_schedule(job) or 0
    t = job.ranks
    for r in range(job.world_size):
        if t.generation[r] == job.generation and t.start_step[r] > base:
            t.start_step[r] = t.step[r] = base
            changes.rank(r)
    changes.job = True
    detail = {"advised": body.advised, "restored": body.step, "abandoned": len(gone)}
    changes.event(job, EventKind.RESTORE_POINT_CORRECTED, now, rank, detail)
    return restore_point(job), changes


def learn_commits(job: Job, steps: Iterable[int], now: float) -> Changes:
    """Steps found committed on storage (``MANIFEST.json``): storage, not the coordinator,
    is the source of truth for commits (after a lost database, or while it was down).

    A checkpoint abandoned when the previous generation failed is committed after all if
    its manifest is there: its commit was written but its report never arrived (the
    committing rank died). Not after a roll-back, whose abandoned steps stay abandoned.
    """
    changes = Changes()
    for step in steps:
        ck = job.checkpoints.get(step)
        if ck is not None and _committed_before_the_failure(job, ck):
            ck.status = IN_PROGRESS
        if ck is None:
            ck = Checkpoint(
                step=step,
                generation=job.generation,
                status=COMMITTED,
                started=now,
                committed_at=now,
                source=CheckpointSource.STORAGE,
            )
            job.checkpoints[step] = ck
        elif ck.status == IN_PROGRESS:
            ck.status, ck.committed_at = COMMITTED, now
        else:
            continue
        changes.checkpoint(ck)
        changes.committed += 1
        changes.job |= reached(job, step)
    return changes


def _committed_before_the_failure(job: Job, ck: Checkpoint) -> bool:
    """``ck`` was in flight when a failure (not a roll-back or a resize) ended the
    generation before this one."""
    failed = job.recovery is not None and job.recovery.kind is not None
    return (
        failed
        and ck.status == ABANDONED
        and ck.committed_at is None
        and ck.generation == job.generation - 1
    )


def _part_reply(job: Job, ck: Checkpoint, *, must_commit: bool) -> PartReply:
    return PartReply(
        step=ck.step,
        status=ck.status,
        persisted_ranks=ck.persisted,
        world_size=job.world_size,
        must_commit=must_commit,
    )


def retention(job: Job, rank: int, body: RetentionReport, now: float) -> tuple[None, Changes]:
    """``rank`` deleted old checkpoints after committing ``body.step``, or failed to: an
    event either way (the dashboard and ``/metrics`` show the latest). Storage is not read:
    the folders left are the rank's word, and ``checkflow gc`` can delete them later.

    Raises:
        NotFound: an unknown rank.
    """
    check_rank(job, rank)
    changes = Changes()
    kind = EventKind.RETENTION_FAILED if body.failed else EventKind.RETENTION_OK
    detail = {"step": body.step, "failed": body.failed, "permanent": body.permanent}
    changes.event(job, kind, now, rank, {**detail, "error": body.error})
    return None, changes
