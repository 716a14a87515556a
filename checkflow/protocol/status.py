"""The closed sets of words the coordinator API uses, one ``StrEnum`` each.

They serialize as their plain string values (``"alive"``, ``"abort"``), so the JSON on the
wire is what it always was; in code they are checked names instead of bare strings.
"""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10 lacks enum.StrEnum; same behaviour for our use

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)


class Action(StrEnum):
    """What a heartbeat reply tells a rank to do."""

    CONTINUE = "continue"
    ABORT = "abort"
    """The job moved to a new generation: exit so that the group restarts and restores."""


class RankState(StrEnum):
    """Where a rank stands in its job."""

    UNREGISTERED = "unregistered"
    ALIVE = "alive"
    """Registered in some generation and heartbeating; watched by the failure detector."""
    FAILED = "failed"
    """Declared failed: missed heartbeats or re-registered after a crash."""
    ABORTED = "aborted"
    """Was told to abort (its generation ended); no longer watched."""
    FINISHED = "finished"
    """Ended training normally; its silence is not a failure."""


class JobState(StrEnum):
    """Where a job stands in its life (``server/domain/lifecycle.py`` moves it)."""

    RUNNING = "running"
    """Its ranks train (or are starting) in the current generation."""
    RECOVERING = "recovering"
    """A generation started after a failure, a roll-back or a resize; not every rank of
    it has registered yet."""
    FINISHED = "finished"
    """Every rank of the current generation ended training normally (``finish``)."""
    STOPPED = "stopped"
    """Its launcher was stopped (Ctrl-C, SIGTERM): ``POST .../stop``, reason ``interrupted``."""
    FAILED = "failed"
    """Its launcher gave up recovering (``--max-restarts`` used up, or it could not start the
    workers): ``POST .../stop``, reason ``gave_up``."""


class StopReason(StrEnum):
    """Why a launcher stopped its job (``StopRequest.reason``)."""

    INTERRUPTED = "interrupted"
    """Ctrl-C or SIGTERM: the job is stopped."""
    GAVE_UP = "gave_up"
    """Recovery gave up (restarts used up, the workers could not form their world): failed."""


class CheckpointStatus(StrEnum):
    IN_PROGRESS = "in_progress"
    COMMITTED = "committed"
    """Its global manifest is written: a restore point."""
    ABANDONED = "abandoned"
    """Not a restore point of the job: never committed (its generation ended), missing on
    storage, or newer than a roll-back on the timeline the job left (see ``jobs.recover``)."""


class CheckpointSource(StrEnum):
    """How the coordinator learned of a checkpoint."""

    RANKS = "ranks"
    """Reported through the API by the ranks that wrote it."""
    STORAGE = "storage"
    """Found committed (``MANIFEST.json``) when listing the job's storage."""


class CheckpointKind(StrEnum):
    """What a checkpoint stores, as ``MANIFEST.json``'s ``kind`` says."""

    FULL = "full"
    """Every chunk stands alone."""
    DELTA = "delta"
    """Some chunk is a difference from an older step (``delta``/``q8``... incremental codecs)."""


class CheckpointTier(StrEnum):
    """Where a rank's part of a checkpoint is kept (issue 11)."""

    STORAGE = "storage"
    """The job's storage (``storage_uri``): commits are ``MANIFEST.json`` there."""
    RAM = "ram"
    """The rank's node memory (``checkflow.memory``): its own copy of its whole state."""


class FaultKind(StrEnum):
    """Why the coordinator declared a rank failed (the ``kind`` of a ``rank_failed`` event)."""

    CRASH = "crash"
    """Its process exited with an error; reported by its launcher (``checkflow run``)."""
    SILENT = "silent"
    """Its heartbeats stopped for longer than the job's ``heartbeat_timeout_s``."""
    HUNG = "hung"
    """It heartbeats but its step has not advanced for the job's hang timeout."""
    RE_REGISTERED = "re_registered"
    """It registered again while alive: it crashed and restarted before anyone noticed."""


class IntervalMode(StrEnum):
    """Where a job's checkpoint interval comes from (``Schedule.mode``)."""

    FIXED = "fixed"
    """The ranks' ``every=N``: the coordinator shows it and never recomputes it."""
    WARMUP = "warmup"
    """``every="auto"``, not measured yet: each rank applies its own tuner's interval (the
    same on every rank until the first checkpoint is measured)."""
    TUNED = "tuned"
    """``every="auto"``, computed by the coordinator from every rank's measurements; the
    ranks adopt it at their next checkpoint at the latest."""
