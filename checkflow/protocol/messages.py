"""Request and response bodies of the coordinator API (``/v1``).

Requests are strict (an unknown field is a 422: a typo must not pass silently); replies
ignore fields they do not know, so that a newer coordinator can add fields without
breaking older clients.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from checkflow.protocol.fields import (
    MAX_INT,
    MAX_SECONDS,
    DetailValue,
    Generation,
    JobName,
    NoBool,
    RankId,
    Seconds,
    Step,
)
from checkflow.protocol.schedule import Schedule
from checkflow.protocol.status import (
    Action,
    CheckpointKind,
    CheckpointSource,
    CheckpointStatus,
    CheckpointTier,
    FaultKind,
    JobState,
    RankState,
    StopReason,
)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- jobs -------------------------------------------------------------------------------
class JobCreate(Strict):
    name: JobName
    world_size: Annotated[int, Field(ge=1, le=131_072, description="Number of ranks."), NoBool]
    storage_uri: str | None = Field(
        default=None, max_length=4096, description="Where the job's checkpoints are stored."
    )
    max_overhead: Annotated[
        float,
        Field(gt=0, le=1, description="Fraction of training time checkpoints may take."),
        NoBool,
    ] = 0.035
    heartbeat_timeout_s: Annotated[
        float, Field(ge=0.1, le=86400, description="A rank silent this long is failed."), NoBool
    ] = 10.0
    hang_timeout_s: Annotated[
        float | None,
        Field(
            ge=0.1,
            le=MAX_SECONDS,
            description="A rank whose step has not advanced this long is hung; "
            "null: derived from the observed step times.",
        ),
        NoBool,
    ] = None
    every: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_INT,
            description="The ranks' fixed checkpoint interval (every=N), shown as fixed and "
            'never recomputed; null: every="auto", tuned by the coordinator.',
        ),
        NoBool,
    ] = None


class JobPublic(BaseModel):
    name: str
    world_size: int
    storage_uri: str | None
    max_overhead: float
    heartbeat_timeout_s: float
    hang_timeout_s: float | None = Field(
        default=None, description="The job's setting; null: derived from step times."
    )
    created: float
    generation: int
    interval: int
    next_checkpoint_step: int
    schedule: Schedule
    restore_step: int | None
    ranks_alive: int
    failures: int
    recovering: bool
    """``state == "recovering"``; kept for older readers."""
    state: JobState = Field(
        default=JobState.RUNNING,
        description="running, recovering, finished, stopped or failed (default for replies "
        "of older coordinators: running).",
    )


class JobCreated(JobPublic):
    """The reply of ``POST /v1/jobs``: the job, and its token when this call created it."""

    token: str | None = Field(
        default=None,
        description="A token for this job only, returned this once (the coordinator keeps "
        "only its hash); null: the job existed, or the call was made with a job token, or "
        "the coordinator has no token.",
    )


class JobToken(BaseModel):
    """A new token for one job (``POST /v1/jobs/{job}/tokens``, admin token only)."""

    job: str
    token: str = Field(description="Acts on this job only; returned this once.")


class JobList(BaseModel):
    jobs: list[JobPublic]


class RestorePoint(BaseModel):
    generation: int
    step: int | None = Field(
        description="Newest step complete in a tier: committed on storage, or held in node "
        "memory by every rank (RAM tier); null: none."
    )


class RecoverRequest(Strict):
    step: Step | None = Field(default=None, description="Committed step; default the newest.")


class EventPublic(BaseModel):
    id: int
    time: float
    kind: str
    generation: int
    rank: int | None
    detail: dict[str, DetailValue]


class EventList(BaseModel):
    events: list[EventPublic]


# --- ranks ------------------------------------------------------------------------------
class RegisterRequest(Strict):
    instance: str | None = Field(
        default=None, max_length=128, description="Id of this process; a retry reuses it."
    )
    node: str | None = Field(default=None, max_length=256)


class Registration(BaseModel):
    generation: int
    restore_step: int | None = Field(description="Step to resume from; null: start fresh.")
    interval: int
    next_checkpoint_step: int
    schedule: Schedule


class Heartbeat(Strict):
    generation: Generation
    step: Step
    iteration_s: Seconds | None = Field(default=None, description="Median step time.")
    stall_s: Seconds | None = Field(default=None, description="Training time lost per snapshot.")
    persist_s: Seconds | None = Field(default=None, description="Snapshot-to-commit time.")
    paused: StrictBool = Field(
        default=False,
        description="In a known pause (eval, a blocking save): a still step is no hang.",
    )


class HeartbeatReply(BaseModel):
    action: Action
    generation: int
    interval: int
    next_checkpoint_step: int
    schedule: Schedule


class RankHeartbeat(Heartbeat):
    rank: RankId


class NodeHeartbeat(Strict):
    ranks: list[RankHeartbeat] = Field(min_length=1, max_length=1024)


class RankAction(BaseModel):
    rank: int
    action: Action


class NodeHeartbeatReply(BaseModel):
    generation: int
    interval: int
    next_checkpoint_step: int
    schedule: Schedule
    ranks: list[RankAction]


class FinishRequest(Strict):
    generation: Generation
    step: Step | None = Field(default=None, description="The last step trained.")


class StopRequest(Strict):
    """A launcher stops its job (``POST .../stop``): Ctrl-C, or recovery gave up."""

    generation: Generation = Field(description="The newest generation the launcher saw.")
    reason: StopReason
    detail: str = Field(default="", max_length=1024)


class FailureReport(Strict):
    """A launcher saw one of its workers fail (``POST .../ranks/{rank}/failure``)."""

    generation: Generation = Field(description="The generation the failed process was in.")
    kind: Literal[FaultKind.CRASH] = FaultKind.CRASH
    exit_code: Annotated[int | None, Field(ge=-255, le=255), NoBool] = None
    detail: str = Field(default="", max_length=1024)
    seconds_ago: Seconds = Field(default=0.0, description="How long ago the launcher saw it.")


class RankPublic(BaseModel):
    rank: int
    generation: int
    state: RankState
    alive: bool = Field(description="Alive in the job's current generation.")
    step: int
    node: str | None
    last_heartbeat: float | None
    seconds_since_heartbeat: float | None
    iteration_s: float | None
    stall_s: float | None
    persist_s: float | None


class RankList(BaseModel):
    ranks: list[RankPublic]


# --- checkpoints ------------------------------------------------------------------------
class PartReport(Strict):
    generation: Generation
    nbytes: Annotated[int, Field(ge=0, le=MAX_INT), NoBool]
    duration_s: Seconds
    manifest_path: str = Field(max_length=4096)
    tier: CheckpointTier | None = Field(
        default=None,
        description="null or storage: the job's storage. ram: the part is in the rank's node "
        "memory (no commit to write); a step every rank holds there is a restore point too. "
        "Left out for storage, so that a coordinator without tiers takes the report.",
    )
    kind: CheckpointKind | None = Field(
        default=None,
        description="full, or delta when some chunk of this part depends on an older step; "
        "null: not said (a rank of an older checkflow).",
    )
    jit: bool | None = Field(
        default=None,
        description="ram only: a just-in-time copy, written by a surviving rank after a "
        "failure, of a job that declared every rank's state the same (data-parallel "
        "replicas, Checkpointer(jit=True)); it stands for every rank's part of the step. "
        "Taken from the generation the failure ended too. Left out otherwise.",
    )


class PartReply(BaseModel):
    step: int
    status: CheckpointStatus
    persisted_ranks: int
    world_size: int
    must_commit: bool = Field(description="True for exactly one rank: it writes MANIFEST.json.")


class CommitReport(Strict):
    rank: RankId | None = None
    generation: Generation | None = Field(
        default=None,
        description="The committing rank's generation: one older than the job's is refused "
        "(409). Left out (clients before 0.2): accepted only for a checkpoint in progress in "
        "the job's current generation; deprecated.",
    )


class RestoredReport(Strict):
    """What a rank restored when it is not what the coordinator advised."""

    generation: Generation
    advised: Step | None = Field(description="The restore step the registration gave.")
    step: Step | None = Field(description="The step it restored; null: none (step 0).")


class RetentionReport(Strict):
    """What deleting old checkpoints did after a commit (``keep=``): sent by the committing
    rank when it failed, and once when it works again."""

    generation: Generation
    step: Step = Field(description="The commit after which retention ran.")
    failed: Annotated[
        int,
        Field(ge=0, le=MAX_INT, description="Step folders left that it should have deleted."),
        NoBool,
    ]
    permanent: StrictBool = Field(
        default=False, description="The store refuses the deletes: retrying cannot help."
    )
    error: str = Field(default="", max_length=1024, description="Why, in the store's words.")


class CheckpointPublic(BaseModel):
    step: int
    status: CheckpointStatus
    generation: int
    persisted_ranks: int
    world_size: int
    nbytes: int
    started: float
    committed_at: float | None
    committer: int | None
    source: CheckpointSource
    kind: CheckpointKind | None = Field(
        default=None,
        description="delta when some rank's part is one, full when every reported part is "
        "full; null: unknown (found in storage, or reported by older ranks).",
    )


class CheckpointList(BaseModel):
    checkpoints: list[CheckpointPublic]


# --- service ----------------------------------------------------------------------------
class Health(BaseModel):
    status: Literal["ok"]
    jobs: int


class ErrorBody(BaseModel):
    detail: str
