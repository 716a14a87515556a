"""The coordinator's wire protocol, defined once: request and reply models, statuses, URL
paths and the checkpoint schedule.

The server (``checkflow_server``), the rank client (:mod:`checkflow.client`) and the CLI all
import it, and parse what they receive with these models. Pure: pydantic only, no torch
and no I/O, so that importing it never pulls in the training runtime.
"""

from __future__ import annotations

from checkflow.protocol import paths
from checkflow.protocol.fields import MAX_INT, MAX_NODE_NAME, MAX_RANK, MAX_SECONDS
from checkflow.protocol.messages import (
    CheckpointList,
    CheckpointPublic,
    CommitReport,
    ErrorBody,
    EventList,
    EventPublic,
    FailureReport,
    FinishRequest,
    Health,
    Heartbeat,
    HeartbeatReply,
    JobCreate,
    JobCreated,
    JobList,
    JobPublic,
    JobToken,
    NodeHeartbeat,
    NodeHeartbeatReply,
    PartReply,
    PartReport,
    RankAction,
    RankHeartbeat,
    RankList,
    RankPublic,
    RecoverRequest,
    RegisterRequest,
    Registration,
    RestoredReport,
    RestorePoint,
    RetentionReport,
)
from checkflow.protocol.schedule import Schedule
from checkflow.protocol.status import (
    Action,
    CheckpointKind,
    CheckpointSource,
    CheckpointStatus,
    CheckpointTier,
    FaultKind,
    IntervalMode,
    RankState,
)

__all__ = [
    "MAX_INT",
    "MAX_NODE_NAME",
    "MAX_RANK",
    "MAX_SECONDS",
    "Action",
    "CheckpointList",
    "CheckpointPublic",
    "CheckpointSource",
    "CheckpointKind",
    "CheckpointTier",
    "CheckpointStatus",
    "CommitReport",
    "ErrorBody",
    "EventList",
    "EventPublic",
    "FailureReport",
    "FaultKind",
    "FinishRequest",
    "Health",
    "Heartbeat",
    "HeartbeatReply",
    "IntervalMode",
    "JobCreate",
    "JobCreated",
    "JobList",
    "JobPublic",
    "JobToken",
    "NodeHeartbeat",
    "NodeHeartbeatReply",
    "PartReply",
    "PartReport",
    "RankAction",
    "RankHeartbeat",
    "RankList",
    "RankPublic",
    "RankState",
    "RecoverRequest",
    "RegisterRequest",
    "Registration",
    "RestoredReport",
    "RetentionReport",
    "RestorePoint",
    "Schedule",
    "paths",
]
