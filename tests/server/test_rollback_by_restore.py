"""``Checkpointer.restore(step=N)`` below the coordinator's restore point is a roll-back:
the steps above are abandoned at the coordinator, so that the new timeline's checkpoints of
the same step numbers are committed (they were answered ``must_commit=False`` forever, and
lost), while the old timeline's folders stay on storage untouched."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from checkflow import Checkpointer, load
from checkflow import manifest as mf
from checkflow.protocol import paths
from tests.support.coordinator import TOKEN, ServerProcess

JOB = "rolled-back"


def ckpt_of(server: ServerProcess, root: Path, model: torch.nn.Module) -> Checkpointer:
    return Checkpointer(
        str(root),
        {"model": model},
        every=1,
        keep=0,
        coordinator=server.url,
        job=JOB,
        token=TOKEN,
    )  # keep=0: retention would delete the abandoned timeline's folders, which are garbage


def train(ckpt: Checkpointer, model: torch.nn.Module, steps: int, delta: float) -> None:
    for _ in range(steps):
        with torch.no_grad():
            model.weight.add_(delta)
        ckpt.step()
    ckpt.wait()


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_restore_to_an_older_step_commits_the_retaken_steps_on_their_own_timeline(
    server: ServerProcess, tmp_path: Path
) -> None:
    root, model = tmp_path / "ckpt", torch.nn.Linear(4, 4)
    with ckpt_of(server, root, model) as ckpt:
        train(ckpt, model, 3, 1.0)
    old = {s: digests(root / mf.step_dir(s)) for s in (2, 3)}
    c = server.http()

    again = torch.nn.Linear(4, 4)
    with ckpt_of(server, root, again) as ckpt:
        assert ckpt.restore(step=1) == 1
        train(ckpt, again, 2, -0.5)  # steps 2 and 3 again, with other weights
        expected = {k: v.clone() for k, v in again.state_dict().items()}

    listed = c.get(paths.path(paths.CHECKPOINTS, job=JOB)).json()["checkpoints"]
    status = {(ck["step"], ck["status"]) for ck in listed}
    assert {(2, "committed"), (3, "committed")} <= status, listed
    assert c.get(paths.path(paths.RESTORE_POINT, job=JOB)).json()["step"] == 3
    for s in (2, 3):
        assert (root / mf.step_dir(s, timeline=1) / mf.MANIFEST).is_file()
        assert digests(root / mf.step_dir(s)) == old[s]  # the old timeline, untouched
    newest = load(str(root))["model"]
    assert all(torch.equal(newest[k], v) for k, v in expected.items())
