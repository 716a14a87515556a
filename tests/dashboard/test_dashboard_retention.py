"""A store that refuses deletes, end to end: a real Checkpointer with ``keep=1`` writes to the
JuiceFS S3 gateway through a bucket policy that lets anyone read, write and list but not
delete (the gateway enforces it: ``AccessDenied``). Every checkpoint commits; the old ones
stay, and that shows in the Checkpointer's ``stats``, in the coordinator's events and
``/metrics``, and on the dashboard, until the store lets deletes through again."""

from __future__ import annotations

import json
import uuid
from typing import Any

from playwright.sync_api import BrowserContext, expect

from checkflow import Checkpointer
from checkflow.manifest import step_dir
from checkflow.storage.probe import PROBE_PREFIX
from tests.runtime._models import small_state, train_step
from tests.support.coordinator import TOKEN, ServerProcess
from tests.support.juicefs import Gateway
from tests.support.s3 import s3_options

READ_WRITE_LIST = ["s3:GetObject", "s3:PutObject", "s3:ListBucket", "s3:GetBucketLocation"]


def _policy(bucket: str, actions: list[str]) -> str:
    resources = [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]
    allow = {"Effect": "Allow", "Principal": {"AWS": ["*"]}, "Action": actions}
    return json.dumps({"Version": "2012-10-17", "Statement": [{**allow, "Resource": resources}]})


def _train(uri: str, options: dict[str, Any], server: ServerProcess, job: str, steps: int) -> Any:
    state = small_state()
    coordinator = {"coordinator": server.url, "job": job, "token": TOKEN}
    with Checkpointer(uri, state, every=1, keep=1, storage_options=options, **coordinator) as ck:
        for _ in range(ck.restore(), steps):
            train_step(state)
            ck.step()
            ck.wait()
    return ck.stats


def _steps(client: Any, bucket: str) -> list[str]:
    answer = client.list_objects_v2(Bucket=bucket, Prefix="run/")
    names = {o["Key"].split("/")[1] for o in answer.get("Contents", [])}
    # A store that refuses deletes keeps the write probe of each Checkpointer.open() too.
    return sorted(n for n in names if not n.startswith(PROBE_PREFIX))


def test_refused_deletes_show_in_stats_metrics_and_the_dashboard_until_they_work(
    server: ServerProcess, browser: BrowserContext, juicefs_gateway: Gateway
) -> None:
    client = juicefs_gateway.client()
    bucket, job = f"checkflow-{uuid.uuid4().hex[:12]}", f"retention-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    client.put_bucket_policy(Bucket=bucket, Policy=_policy(bucket, READ_WRITE_LIST))
    anonymous = s3_options(juicefs_gateway.endpoint, anon=True)
    uri = f"s3://{bucket}/run"

    stats = _train(uri, anonymous, server, job, steps=3)

    assert stats.committed == 3 and stats.failed == 0
    assert stats.retention_failures == 2  # after steps 2 and 3; step 1 had nothing to delete
    assert stats.retention_error.startswith("could not delete step(s) 1, 2: delete ")
    assert "access denied (AccessDenied: Access Denied.)" in stats.retention_error
    assert stats.retention_error.endswith("(the store refuses it; retrying will not help)")
    assert _steps(client, bucket) == [step_dir(1), step_dir(2), step_dir(3)]
    told = [e for e in server.events(job) if e.kind.startswith("retention")]
    assert [(e.kind, e.rank, e.detail["step"], e.detail["failed"]) for e in told] == [
        ("retention_ok", 0, 1, 0),  # the first outcome: nothing to delete yet
        ("retention_failed", 0, 2, 1),  # once, when it started failing
    ]
    assert told[1].detail["permanent"] is True and "AccessDenied" in str(told[1].detail["error"])
    metrics = server.http().get("/metrics").text
    assert f'checkflow_retention_failures_total{{checkflow_job="{job}"}} 1' in metrics.splitlines()
    assert f'checkflow_retention_failing{{checkflow_job="{job}"}} 1' in metrics.splitlines()

    browser.set_extra_http_headers({"Authorization": f"Bearer {TOKEN}"})
    page = browser.pages[0]
    page.goto(f"{server.url}/#job={job}")
    warning = page.locator("#retention-failing")
    expect(warning).to_contain_text(
        "Retention failing: after step 2, 1 old checkpoint folder(s) were not deleted"
    )
    expect(warning).to_contain_text("AccessDenied")
    expect(warning).to_contain_text("The store refuses the deletes")

    # The store lets deletes through again: the next run's retention clears it everywhere.
    client.put_bucket_policy(
        Bucket=bucket, Policy=_policy(bucket, [*READ_WRITE_LIST, "s3:DeleteObject"])
    )
    stats = _train(uri, anonymous, server, job, steps=4)
    assert stats.retention_failures == 0 and stats.retention_error == ""
    assert _steps(client, bucket) == [step_dir(4)]
    # The newest retention event (the job's end, "job_finished", comes after it).
    told = [e for e in server.events(job) if e.kind.startswith("retention")]
    assert told[-1].kind == "retention_ok"
    metrics = server.http().get("/metrics").text
    assert f'checkflow_retention_failing{{checkflow_job="{job}"}} 0' in metrics.splitlines()
    page.reload()
    expect(page.locator("#job-name")).to_have_text(job)  # rendered with the new events
    expect(warning).to_have_count(0)
