"""In-memory state of the coordinator: jobs, their ranks (column arrays) and checkpoints.

The ranks of a job are held column-wise (one list per field) so that the hot paths stay
cheap for thousands of ranks: the failure detector takes ``min(last_heartbeat)`` and the
policy takes ``max(iteration_s)`` in C instead of walking objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ALIVE = "alive"
"""Registered in some generation and heartbeating; watched by the failure detector."""
UNREGISTERED = "unregistered"
FAILED = "failed"
"""Declared failed: missed heartbeats or re-registered after a crash."""
ABORTED = "aborted"
"""Was told to abort (its generation ended); no longer watched."""
FINISHED = "finished"
"""Ended training normally; its silence is not a failure."""

IN_PROGRESS = "in_progress"
COMMITTED = "committed"
ABANDONED = "abandoned"

UNKNOWN = -1.0
"""Marker for a measurement a rank has not reported yet (all real values are >= 0)."""


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
    )

    def __init__(self, world_size: int) -> None:
        self.generation = [0] * world_size
        self.state = [UNREGISTERED] * world_size
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

    def __len__(self) -> int:
        return len(self.state)

    def row(self, rank: int) -> dict[str, Any]:
        """One rank as a dict of the database's columns."""
        return {
            "rank": rank,
            "generation": self.generation[rank],
            "state": self.state[rank],
            "instance": self.instance[rank],
            "node": self.node[rank],
            "registered_at": self.registered_at[rank],
            "last_heartbeat": self.last_heartbeat[rank],
            "step": self.step[rank],
            "iteration_s": _opt(self.iteration_s[rank]),
            "stall_s": _opt(self.stall_s[rank]),
            "persist_s": _opt(self.persist_s[rank]),
        }

    def load(self, row: dict[str, Any]) -> None:
        r = row["rank"]
        self.generation[r] = row["generation"]
        self.state[r] = row["state"]
        self.instance[r] = row["instance"]
        self.node[r] = row["node"]
        self.registered_at[r] = row["registered_at"]
        self.last_heartbeat[r] = row["last_heartbeat"]
        self.step[r] = row["step"] or 0
        self.iteration_s[r] = _unknown(row["iteration_s"])
        self.stall_s[r] = _unknown(row["stall_s"])
        self.persist_s[r] = _unknown(row["persist_s"])


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
    status: str
    started: float
    committed_at: float | None = None
    committer: int | None = None
    nbytes: int = 0
    source: str = "ranks"
    """``ranks`` (reported through the API) or ``storage`` (found on storage)."""
    persisted: int = 0
    """Ranks that reported their part (kept when ``parts`` is not loaded)."""
    parts: dict[int, Part] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "generation": self.generation,
            "status": self.status,
            "started": self.started,
            "committed_at": self.committed_at,
            "committer": self.committer,
            "nbytes": self.nbytes,
            "source": self.source,
            "persisted": self.persisted,
        }


@dataclass(slots=True)
class Schedule:
    """Checkpoint steps ``anchor + k * interval`` (k >= 0); before ``anchor``, the previous
    schedule still applies, so that ranks that have not seen a change yet agree with those
    that have (the server only moves the anchor far enough ahead of every rank)."""

    anchor: int
    interval: int
    prev_anchor: int | None = None
    prev_interval: int | None = None

    def next_after(self, step: int) -> int:
        """The first checkpoint step strictly after ``step``."""
        if self.prev_anchor is not None and self.prev_interval and step < self.anchor:
            candidate = _next_on(self.prev_anchor, self.prev_interval, step)
            if candidate < self.anchor:
                return candidate
        return _next_on(self.anchor, self.interval, step)

    def first_at_or_after(self, step: int) -> int:
        """The first step of the current schedule that is >= ``step``."""
        return _next_on(self.anchor, self.interval, step - 1)


@dataclass(slots=True)
class Job:
    id: int
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
    """Furthest step reported in the current generation."""
    failures: int = 0
    recovering_since: float | None = None
    """When the current generation started after a failure, until every rank registered."""
    ranks: RankTable = field(init=False)
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ranks = RankTable(self.world_size)

    @property
    def interval(self) -> int:
        return self.schedule.interval

    def restore_step(self) -> int | None:
        """The newest checkpoint every rank committed, or None."""
        committed = [c.step for c in self.checkpoints.values() if c.status == COMMITTED]
        return max(committed) if committed else None

    def next_checkpoint_step(self) -> int:
        return self.schedule.next_after(self.max_step)

    def alive_ranks(self) -> int:
        g, ranks = self.generation, self.ranks
        return sum(
            1
            for r in range(self.world_size)
            if ranks.state[r] == ALIVE and ranks.generation[r] == g
        )

    def row(self) -> dict[str, Any]:
        s = self.schedule
        return {
            "id": self.id,
            "name": self.name,
            "storage_uri": self.storage_uri,
            "world_size": self.world_size,
            "max_overhead": self.max_overhead,
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
            "created": self.created,
            "generation": self.generation,
            "generation_started": self.generation_started,
            "recovering_since": self.recovering_since,
            "interval": s.interval,
            "anchor": s.anchor,
            "prev_interval": s.prev_interval,
            "prev_anchor": s.prev_anchor,
            "max_step": self.max_step,
            "failures": self.failures,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Job:
        schedule = Schedule(
            row["anchor"], row["interval"], row["prev_anchor"], row["prev_interval"]
        )
        return cls(
            id=row["id"],
            name=row["name"],
            storage_uri=row["storage_uri"],
            world_size=row["world_size"],
            max_overhead=row["max_overhead"],
            heartbeat_timeout_s=row["heartbeat_timeout_s"],
            created=row["created"],
            generation=row["generation"],
            generation_started=row["generation_started"],
            schedule=schedule,
            max_step=row["max_step"],
            failures=row["failures"],
            recovering_since=row["recovering_since"],
        )


def _next_on(anchor: int, interval: int, step: int) -> int:
    if step < anchor:
        return anchor
    return anchor + ((step - anchor) // interval + 1) * interval


def _opt(value: float) -> float | None:
    return None if value < 0 else value


def _unknown(value: float | None) -> float:
    return UNKNOWN if value is None else value
