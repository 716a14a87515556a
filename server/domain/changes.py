"""What one decision changed: the repository writes it, the metrics count it.

A rule changes the job's in-memory state and records here which rows that touched, so that
the repository writes exactly those in one transaction, and the events it produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from checkflow_server.domain.state import Checkpoint, Job, Part

from checkflow.protocol.status import StrEnum


class EventKind(StrEnum):
    """Kinds of the job's event log (``GET /v1/jobs/{job}/events``)."""

    JOB_CREATED = "job_created"
    RESIZED = "resized"
    RANK_FAILED = "rank_failed"
    GENERATION_STARTED = "generation_started"
    RECOVERED = "recovered"
    ROLLBACK_REQUESTED = "rollback_requested"
    INTERVAL_CHANGED = "interval_changed"
    RESTORE_POINT_CORRECTED = "restore_point_corrected"
    """A rank could not read the restore point on storage and restored an older step: the
    checkpoints between were abandoned (see :func:`.checkpoints.restored`)."""
    TRAINED_AGAIN = "trained_again"
    """After a failure (or roll-back), a rank of the new generation trained past its
    restore step: the recovery is over. Its detail has the fault kind, detection latency,
    restore step and the seconds until then."""
    RETENTION_FAILED = "retention_failed"
    """The committing rank could not delete old checkpoints after a commit (``keep=``): its
    detail has the step, how many folders stay, whether retrying can help, and why."""
    RETENTION_OK = "retention_ok"
    """Retention deleted all it should again, after a ``retention_failed``."""
    FINISHED = "job_finished"
    """Every rank of the current generation ended training normally."""
    STOPPED = "job_stopped"
    """Its launcher stopped it (detail: the reason and the job's new state)."""


@dataclass(slots=True)
class Event:
    kind: EventKind
    time: float
    generation: int
    """The job's generation when it happened."""
    rank: int | None
    detail: dict[str, Any]


@dataclass(slots=True)
class Changes:
    """Rows a rule changed (to write) and what it observed (to count)."""

    created: bool = False
    """The job is new: insert it (the repository gives it its id)."""
    job: bool = False
    """The job's own fields changed."""
    ranks_cleared: bool = False
    """Every rank row of the job goes (it was resized); rows in ``ranks`` come after."""
    ranks: dict[int, None] = field(default_factory=dict)
    """Ranks to write whole (an ordered set)."""
    heartbeats: list[int] = field(default_factory=list)
    """Ranks whose heartbeat fields (time, step, measurements, node) changed."""
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)
    """Checkpoints to write, by step."""
    parts_cleared: list[int] = field(default_factory=list)
    """Steps whose reported parts go (a new attempt at the step)."""
    parts: list[tuple[int, Part]] = field(default_factory=list)
    """(step, part) to write."""
    events: list[Event] = field(default_factory=list)
    heartbeats_received: int = 0
    committed: int = 0
    """Checkpoints that became committed."""

    def writes(self) -> bool:
        """Whether anything is to be written."""
        return bool(
            self.created
            or self.job
            or self.ranks_cleared
            or self.ranks
            or self.heartbeats
            or self.checkpoints
            or self.parts_cleared
            or self.parts
            or self.events
        )

    def event(
        self, job: Job, kind: EventKind, now: float, rank: int | None, detail: dict[str, Any]
    ) -> None:
        self.events.append(Event(kind, now, job.generation, rank, detail))

    def rank(self, rank: int) -> None:
        self.ranks[rank] = None

    def checkpoint(self, ck: Checkpoint) -> None:
        self.checkpoints[ck.step] = ck
