"""A restore point storage does not confirm: the coordinator accepted a part and a commit of
step 999999, never written. A real ``Checkpointer`` restarting against a real ``checkflow
serve`` restores the newest step on storage instead, and the coordinator learns it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from checkflow import Checkpointer
from checkflow.protocol import paths
from tests.support.coordinator import TOKEN, ServerProcess

JOB = "unconfirmed"
NEVER_WRITTEN = 999_999


def ckpt_of(server: ServerProcess, root: Path, model: torch.nn.Module) -> Checkpointer:
    return Checkpointer(
        str(root), {"model": model}, every=1, coordinator=server.url, job=JOB, token=TOKEN
    )


def claim_a_commit(c: httpx.Client, step: int) -> None:
    """What a hostile or broken client can do: report a part and commit a step it never
    wrote."""
    generation = c.get(paths.path(paths.JOB, job=JOB)).json()["generation"]
    part = {"generation": generation, "nbytes": 1, "duration_s": 0.1, "manifest_path": "m"}
    r = c.put(paths.path(paths.PART, job=JOB, step=step, rank=0), json=part)
    assert r.status_code == 200 and r.json()["must_commit"], r.text
    r = c.post(paths.path(paths.COMMIT, job=JOB, step=step), json={"rank": 0})
    assert r.status_code == 200 and r.json()["status"] == "committed", r.text


def restore_step(c: httpx.Client) -> int | None:
    step: int | None = c.get(paths.path(paths.RESTORE_POINT, job=JOB)).json()["step"]
    return step


def test_a_never_written_restore_point_falls_back_to_storage_and_is_corrected(
    server: ServerProcess, tmp_path: Path
) -> None:
    root, model = tmp_path / "ckpt", torch.nn.Linear(4, 4)
    with ckpt_of(server, root, model) as ckpt:
        ckpt.step()
        ckpt.step()
        ckpt.wait()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    c = server.http()
    assert restore_step(c) == 2
    claim_a_commit(c, NEVER_WRITTEN)
    assert restore_step(c) == NEVER_WRITTEN

    restarted = torch.nn.Linear(4, 4)
    with ckpt_of(server, root, restarted) as ckpt:
        with pytest.warns(UserWarning, match=f"restore point, step {NEVER_WRITTEN}, is not"):
            assert ckpt.restore() == 2
        assert all(torch.equal(restarted.state_dict()[k], v) for k, v in saved.items())
        assert restore_step(c) == 2  # the coordinator learnt what storage holds
        ckpt.step()  # the schedule restarted from step 2: step 3 is taken and committed
        ckpt.wait()
        assert restore_step(c) == 3
    events = c.get(paths.path(paths.EVENTS, job=JOB)).json()["events"]
    [corrected] = [e for e in events if e["kind"] == "restore_point_corrected"]
    assert corrected["detail"] == {"advised": NEVER_WRITTEN, "restored": 2, "abandoned": 1}
    listed = c.get(paths.path(paths.CHECKPOINTS, job=JOB)).json()["checkpoints"]
    assert {ck["step"]: ck["status"] for ck in listed}[NEVER_WRITTEN] == "abandoned"


def test_a_restored_report_is_fenced_and_cannot_raise_the_restore_point(
    server: ServerProcess, tmp_path: Path
) -> None:
    with ckpt_of(server, tmp_path / "ckpt", torch.nn.Linear(4, 4)) as ckpt:
        ckpt.step()
        ckpt.wait()
    c = server.http()
    url = paths.path(paths.RESTORED, job=JOB, rank=0)
    r = c.post(url, json={"generation": 5, "advised": 1, "step": None})
    assert r.status_code == 409 and "generation 5" in r.json()["detail"], r.text
    r = c.post(url, json={"generation": 1, "advised": 1, "step": 50})  # above: no change
    assert r.status_code == 200 and r.json() == {"generation": 1, "step": 1}, r.text
    body = {"generation": 1, "advised": 1, "step": 0}
    r = c.post(paths.path(paths.RESTORED, job=JOB, rank=9), json=body)
    assert r.status_code == 404 and "rank 9" in r.json()["detail"], r.text
    assert restore_step(c) == 1


def test_an_explicit_step_that_is_not_on_storage_still_raises(
    server: ServerProcess, tmp_path: Path
) -> None:
    from checkflow.restore import NoCheckpointError

    with ckpt_of(server, tmp_path / "ckpt", torch.nn.Linear(4, 4)) as ckpt:
        ckpt.step()
        ckpt.wait()
        with pytest.raises(NoCheckpointError, match="no committed checkpoint at step 7"):
            ckpt.restore(step=7)
