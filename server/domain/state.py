"""In-memory state of the coordinator: jobs, their ranks (column arrays) and checkpoints.

The ranks of a job are held column-wise (one list per field) so that the hot paths stay
cheap for thousands of ranks: the failure detector takes ``min(watch)`` and the policy
takes ``max(iteration_s)`` in C instead of walking objects. How this maps to database rows
is the repository's business (:mod:`checkflow_server.repository.rows`), not this module's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from checkflow.protocol import (
    CheckpointKind,
    CheckpointSource,
    CheckpointStatus,
    JobState,
    RankState,
    Schedule,
)

UNKNOWN = -1.0
"""Marker for a measurement a rank has not reported yet (all real values are >= 0)."""

ALIVE = RankState.ALIVE
COMMITTED = CheckpointStatus.COMMITTED


class RankTable:
    """The ranks of one job, one list per field, indexed by rank."""

    __slots__ = (
        "generation",
        "state",
        "instance",
        "node",
        "registered_at",
        "last_heartbeat",
        "watch",
        "step",
        "iteration_s",
        "stall_s",
        "persist_s",
        "progress_at",
        "start_step",
    )

    def __init__(self, world_size: int) -> None:
        self.generation = [0] * world_size
        self.state = [RankState.UNREGISTERED] * world_size
        self.instance: list[str | None] = [None] * world_size
        self.node: list[str | None] = [None] * world_size
        self.registered_at: list[float | None] = [None] * world_size
        self.last_heartbeat: list[float | None] = [None] * world_size
        self.watch = [math.inf] * world_size
        """last_heartbeat of watched (alive) ranks, +inf for the others: min() = oldest."""
        self.step = [0] * world_size
        self.iteration_s = [UNKNOWN] * world_size
        self.stall_s = [UNKNOWN] * world_size
        self.persist_s = [UNKNOWN] * world_size
        self.progress_at = [math.inf] * world_size
        """When watched ranks last advanced their step (or said they were paused), +inf
        for the others: min() = the stillest. In memory only: a restarted coordinator
        restarts every clock (see :func:`~checkflow_server.domain.ranks.restarted`)."""
        self.start_step = [0] * world_size
        """The step a rank registered at (its restore step): until it has trained past it,
        the rank is restoring, compiling or warming up, and gets the longer hang grace."""

    def __len__(self) -> int:
        return len(self.state)

    def forget_measurements(self, rank: int) -> None:
        """Measurements of an earlier process of ``rank`` describe another run."""
        self.iteration_s[rank] = self.stall_s[rank] = self.persist_s[rank] = UNKNOWN

    def unwatch(self, rank: int, state: RankState) -> None:
        """``rank`` leaves the alive state: the failure detector stops watching it."""
        self.state[rank] = state
        self.watch[rank] = self.progress_at[rank] = math.inf


@dataclass(slots=True)
class Part:
    """One rank's persisted share of a checkpoint."""

    rank: int
    nbytes: int
    duration_s: float
    manifest_path: str
    reported_at: float


@dataclass(slots=True)
class Checkpoint:
    step: int
    generation: int
    status: CheckpointStatus
    started: float
    committed_at: float | None = None
    committer: int | None = None
    nbytes: int = 0
    source: CheckpointSource = CheckpointSource.RANKS
    kind: CheckpointKind | None = None
    """delta once any rank reported a delta part; full while every reported part is full."""
    persisted: int = 0
    """Ranks that reported their part (kept when ``parts`` is not loaded)."""
    parts: dict[int, Part] = field(default_factory=dict)


@dataclass(slots=True)
class Recovery:
    """What the current generation recovers from, kept until the job trains again."""

    started: float
    """When the failure was declared (the generation started)."""
    kind: str | None
    """The fault kind (:class:`~checkflow.protocol.FaultKind`); None for a roll-back or
    a resize."""
    detection_s: float | None
    """The failure's detection latency (see :func:`..generation.declare_failed`)."""
    ranks: str
    """The ranks declared failed, as a short list ("0, 3")."""


@dataclass(slots=True)
class Job:
    id: int
    """The repository's key; 0 until the job is first written."""
    name: str
    storage_uri: str | None
    world_size: int
    max_overhead: float
    heartbeat_timeout_s: float
    created: float
    generation: int
    generation_started: float
    schedule: Schedule
    max_step: int = 0
    """Furthest step the job reached in the current generation: in heartbeats, finishes,
    checkpoint parts and commits (a commit may be reported before the heartbeat that
    carries its step), or the restore point it started from."""
    failures: int = 0
    recovering_since: float | None = None
    """When the current generation started after a failure, until every rank registered."""
    registered: int = 0
    """Ranks registered in the current generation (recovery completes at world size)."""
    hang_timeout_s: float | None = None
    """Seconds a rank's step may stand still before it is hung; None: derived from the
    step times (:func:`~checkflow_server.domain.progress.hang_timeout`)."""
    paused_at: float = -math.inf
    """Last heartbeat of any rank in a known pause (``paused``): every rank's progress
    clock counts from here at the earliest (the others wait for it in a collective)."""
    recovery: Recovery | None = None
    """The failure (or roll-back) the current generation recovers from, until the job
    trained past its restore step again; None when it has."""
    state: JobState = JobState.RUNNING
    """Where the job stands in its life (:mod:`.lifecycle`)."""
    rollback_step: int | None = None
    """A roll-back of an ended job to this step, pending until the job is launched again:
    the checkpoints above it stay committed (they are on storage) but are no restore point
    (see :func:`.jobs.recover`)."""
    ranks: RankTable = field(init=False)
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)
    ram: dict[int, set[int]] = field(default_factory=dict)
    """RAM tier (issue 11): step -> the ranks whose node memory holds their part of it. In
    memory only: a restarted coordinator restores from storage until ranks report again."""
    jit: set[int] = field(default_factory=set)
    """RAM steps of :attr:`ram` that a surviving replica wrote just in time after a failure
    (``PartReport.jit``): its copy stands for every rank's part."""

    def __post_init__(self) -> None:
        self.ranks = RankTable(self.world_size)

    @property
    def interval(self) -> int:
        return self.schedule.interval

    def restore_step(self) -> int | None:
        """The newest step complete in some tier: committed on storage, or held in node
        memory by every rank; None when there is none."""
        stored, ram = self.stored_step(), self.ram_step()
        return max(stored or 0, ram or 0) if stored is not None or ram is not None else None

    def stored_step(self) -> int | None:
        """The newest checkpoint every rank committed on storage (at most a pending
        :attr:`rollback_step`), or None."""
        cap = self.rollback_step
        committed = [
            c.step
            for c in self.checkpoints.values()
            if c.status == COMMITTED and (cap is None or c.step <= cap)
        ]
        return max(committed) if committed else None

    def ram_step(self) -> int | None:
        """The newest step every rank holds in its RAM tier (or a just-in-time replica
        stands for), or None."""
        whole = [
            s for s, ranks in self.ram.items() if len(ranks) == self.world_size or s in self.jit
        ]
        return max(whole) if whole else None

    def next_checkpoint_step(self) -> int:
        """The next checkpoint step: after every step reached, so after the restore point."""
        return self.schedule.next_after(self.max_step)

    def is_alive(self, rank: int) -> bool:
        """Alive in the job's current generation."""
        t = self.ranks
        return t.state[rank] == ALIVE and t.generation[rank] == self.generation

    def alive_ranks(self) -> int:
        return sum(1 for r in range(self.world_size) if self.is_alive(r))

    def finished_ranks(self) -> int:
        """Ranks that ended training normally in the job's current generation."""
        t, g = self.ranks, self.generation
        return sum(
            1
            for r in range(self.world_size)
            if t.state[r] == RankState.FINISHED and t.generation[r] == g
        )
