"""``POST /v1/jobs/{job}/ranks/{rank}/retention``: a rank's word that deleting old
checkpoints failed, or works again; an event, and two series of ``/metrics``. Hostile
reports get a 4xx and change nothing."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.server.test_routes import make_job, register_all

FAILED = {"generation": 0, "step": 7, "failed": 2, "permanent": True, "error": "AccessDenied"}


def _series(c: TestClient, job: str) -> list[str]:
    text = c.get("/metrics").text
    return [line for line in text.splitlines() if "retention" in line and f'"{job}"' in line]


def test_a_failure_then_a_recovery_are_events_and_metrics(client: TestClient) -> None:
    make_job(client, "r", world=2)
    register_all(client, "r", 2)
    r = client.post("/v1/jobs/r/ranks/1/retention", json=FAILED)
    assert r.status_code == 200 and r.json()["name"] == "r"
    assert _series(client, "r") == [
        'checkflow_retention_failures_total{checkflow_job="r"} 1',
        'checkflow_retention_failing{checkflow_job="r"} 1',
    ]
    ok = {"generation": 0, "step": 8, "failed": 0}
    assert client.post("/v1/jobs/r/ranks/1/retention", json=ok).status_code == 200
    assert _series(client, "r") == [
        'checkflow_retention_failures_total{checkflow_job="r"} 1',
        'checkflow_retention_failing{checkflow_job="r"} 0',
    ]
    events = [e for e in client.get("/v1/jobs/r/events").json()["events"] if e["rank"] == 1]
    assert [(e["kind"], e["detail"]) for e in events[-2:]] == [
        ("retention_failed", {"step": 7, "failed": 2, "permanent": True, "error": "AccessDenied"}),
        ("retention_ok", {"step": 8, "failed": 0, "permanent": False, "error": ""}),
    ]


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/jobs/nojob/ranks/0/retention", FAILED, 404),
        ("/v1/jobs/r/ranks/2/retention", FAILED, 404),  # world size 2
        ("/v1/jobs/r/ranks/0/retention", {**FAILED, "failed": -1}, 422),
        ("/v1/jobs/r/ranks/0/retention", {**FAILED, "failed": True}, 422),
        ("/v1/jobs/r/ranks/0/retention", {**FAILED, "error": "x" * 1025}, 422),
        ("/v1/jobs/r/ranks/0/retention", {**FAILED, "extra": 1}, 422),
        ("/v1/jobs/r/ranks/0/retention", {"generation": 0, "step": 7}, 422),
    ],
)
def test_hostile_reports_are_refused_and_change_nothing(
    client: TestClient, path: str, body: dict, status: int
) -> None:
    make_job(client, "r", world=2)
    before = client.get("/v1/jobs/r/events").json()["events"]
    assert client.post(path, json=body).status_code == status
    assert client.get("/v1/jobs/r/events").json()["events"] == before
    assert _series(client, "r") == [  # every known job has both series, at 0
        'checkflow_retention_failures_total{checkflow_job="r"} 0',
        'checkflow_retention_failing{checkflow_job="r"} 0',
    ]
