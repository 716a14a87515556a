"""The wire format of the coordinator protocol: field names, string statuses, strictness."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from checkflow.protocol import (
    Action,
    Heartbeat,
    HeartbeatReply,
    IntervalMode,
    JobCreate,
    PartReply,
    RankPublic,
    RankState,
    Schedule,
    paths,
)


def test_statuses_serialize_as_their_plain_strings() -> None:
    reply = HeartbeatReply(
        action=Action.ABORT,
        generation=2,
        interval=10,
        next_checkpoint_step=20,
        schedule=Schedule(anchor=20, interval=10, mode=IntervalMode.TUNED),
    )
    assert json.loads(reply.model_dump_json()) == {
        "action": "abort",
        "generation": 2,
        "interval": 10,
        "next_checkpoint_step": 20,
        "schedule": {
            "anchor": 20,
            "interval": 10,
            "mode": "tuned",
        },
    }
    assert RankState("alive") is RankState.ALIVE and str(RankState.ALIVE) == "alive"


def test_requests_refuse_unknown_fields_and_booleans_as_numbers() -> None:
    with pytest.raises(ValidationError, match="extra"):
        Heartbeat.model_validate({"generation": 1, "step": 2, "stpe": 3})
    with pytest.raises(ValidationError, match="boolean"):
        Heartbeat.model_validate({"generation": True, "step": 2})
    with pytest.raises(ValidationError, match="name"):
        JobCreate(name="a/b", world_size=1)


def test_replies_ignore_fields_a_newer_coordinator_adds() -> None:
    raw = {
        "step": 10,
        "status": "committed",
        "persisted_ranks": 2,
        "world_size": 2,
        "must_commit": False,
        "added_later": 1,
    }
    assert PartReply.model_validate(raw).status == "committed"


def test_an_unknown_status_in_a_reply_is_refused() -> None:
    raw = {
        "rank": 0,
        "generation": 1,
        "state": "sleeping",
        "alive": False,
        "step": 0,
        "node": None,
        "last_heartbeat": None,
        "seconds_since_heartbeat": None,
        "iteration_s": None,
        "stall_s": None,
        "persist_s": None,
    }
    with pytest.raises(ValidationError, match="state"):
        RankPublic.model_validate(raw)


def test_paths_are_filled_in_quoted_and_matched_back() -> None:
    assert paths.path(paths.PART, job="run-1", step=20, rank=3) == (
        "/v1/jobs/run-1/checkpoints/20/ranks/3"
    )
    assert (
        paths.path(paths.NODE_HEARTBEAT, job="j", node="a/b") == "/v1/jobs/j/nodes/a%2Fb/heartbeat"
    )
    m = paths.pattern(paths.NODE_HEARTBEAT).match("/v1/jobs/j/nodes/host-1/heartbeat")
    assert m is not None and m.groups() == ("j", "host-1")
    assert paths.pattern(paths.RANK_HEARTBEAT).match("/v1/jobs/j/nodes/h/heartbeat") is None
