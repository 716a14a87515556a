"""``deploy/slurm/checkflow.sbatch`` on a real Slurm, as shipped (issue 32).

``bash .ci/slurm`` starts a one-node Slurm (Debian's slurm-wlm and munge) and runs this
module with ``CHECKFLOW_SLURM=1``; without it the module is skipped, so the default CI run
(``bash .ci/run``) leaves it out. The test submits the script with ``sbatch`` to train
``examples/train_ddp.py`` (2 gloo ranks) against a real coordinator, SIGKILLs every task
of the job's step once a checkpoint is committed (``scancel --signal=KILL JOB.0``: the
agent and its workers die together, as on a lost node), and checks that the script
requeues the job (``scontrol show job``: ``Restarts=1``), that the new allocation resumes
from a committed checkpoint and that its final state is bitwise equal to a run that was
never killed. The command line overrides only what a one-node, no-GPU machine needs:
``--nodes=1`` and the CPUs per task.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checkflow.protocol import CheckpointStatus
from tests.support.coordinator import TOKEN, ServerProcess, served
from tests.support.net import free_port, wait_until
from tests.support.paths import EXAMPLES, REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(
        os.environ.get("CHECKFLOW_SLURM") != "1",
        reason="needs a real Slurm: `bash .ci/slurm` starts one and sets CHECKFLOW_SLURM=1",
    ),
]

SBATCH = REPO / "deploy/slurm/checkflow.sbatch"
STEPS = 1000
KILL_AFTER = 100
"""Kill once a checkpoint at this step or later is committed: 900 steps (about 15 s
here) before the end, so the kill lands inside the first allocation's training."""
JOB = "slurm-requeue"


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[ServerProcess]:
    with served(tmp_path / "coordinator.db") as server:
        yield server


def scontrol_job(job_id: str) -> dict[str, str]:
    """``scontrol show job -o JOB`` as ``{key: value}`` (values without spaces suffice)."""
    line = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], check=True, capture_output=True, text=True
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", line))


def final_state(path: Path) -> dict[str, torch.Tensor]:
    """The example's ``--out`` file as flat tensors: model parameters, optimizer state."""
    saved = torch.load(path)
    tensors = {f"model.{k}": v for k, v in saved["model"].items()}
    for index, values in saved["optim"]["state"].items():
        tensors |= {f"optim.{index}.{k}": v for k, v in values.items()}
    return tensors


def reference_run(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The same training under ``checkflow run`` outside Slurm, never killed."""
    out = tmp_path / "uninterrupted.pt"
    args = ["--dir", str(tmp_path / "uninterrupted"), "--steps", str(STEPS), "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "checkflow.cli", "run", "--nproc-per-node=2"]
        + ["--no-warm-restarts", str(EXAMPLES / "train_ddp.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return final_state(out)


def submit(tmp_path: Path, coordinator: ServerProcess) -> tuple[str, Path]:
    """``sbatch`` the shipped script, as its header says; returns the job id and its log."""
    log = tmp_path / "job.out"
    env = {
        **os.environ,
        "CHECKFLOW_COORDINATOR": coordinator.url,
        "CHECKFLOW_TOKEN": TOKEN,
        "CHECKFLOW_JOB": JOB,
        "NPROC_PER_NODE": "2",
        "CHECKFLOW_RDZV_PORT": str(free_port()),  # the machine is shared: not 29400
    }
    example = [str(EXAMPLES / "train_ddp.py"), "--dir", str(tmp_path / "ckpt")]
    example += ["--steps", str(STEPS), "--out", str(tmp_path / "requeued.pt")]
    sbatch = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", f"--cpus-per-task={os.cpu_count()}"]
        + [f"--output={log}", f"--chdir={REPO}", str(SBATCH), *example],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return sbatch.stdout.strip().split(";")[0], log


def committed_steps(coordinator: ServerProcess) -> list[int]:
    try:
        checkpoints = coordinator.checkpoints(JOB)
    except Exception:  # noqa: BLE001 - the job is not registered yet (404)
        return []
    return [c.step for c in checkpoints if c.status == CheckpointStatus.COMMITTED]


def start_steps(log: Path) -> list[int]:
    """The step each rank started from, in order, across both allocations (the log is
    appended to: ``--open-mode=append``)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [int(line.split()[-1]) for line in lines if ": start step " in line]


def test_the_sbatch_script_requeues_a_killed_job_and_it_resumes_bitwise_equal(
    tmp_path, coordinator
):
    began = time.monotonic()
    job_id, log = submit(tmp_path, coordinator)
    try:
        wait_until(
            lambda: any(s >= KILL_AFTER for s in committed_steps(coordinator)),
            180,
            f"a checkpoint at step {KILL_AFTER} or later",
        )
        assert scontrol_job(job_id)["JobState"] == "RUNNING"
        subprocess.run(["scancel", "--signal=KILL", f"{job_id}.0"], check=True)
        killed = time.monotonic()
        wait_until(lambda: scontrol_job(job_id)["Restarts"] == "1", 60, "the requeue")
        wait_until(lambda: len(start_steps(log)) >= 3, 180, "training in the new allocation")
        resumed = time.monotonic()
        wait_until(
            lambda: scontrol_job(job_id)["JobState"] in ("COMPLETED", "FAILED"),
            300,
            "the requeued job's end",
        )
        ended = time.monotonic()
    finally:
        subprocess.run(["scancel", job_id], check=False)
    output = log.read_text(errors="replace")
    job = scontrol_job(job_id)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), output

    assert f"checkflow: training exited 137; requeueing job {job_id}" in output, output
    starts = start_steps(log)
    assert starts[:2] == [0, 0] and len(starts) == 4, output
    assert starts[2] == starts[3] >= KILL_AFTER, "both ranks resume from one checkpoint"
    assert f"rank 0: done {STEPS} steps" in output

    healed = final_state(tmp_path / "requeued.pt")
    reference = reference_run(tmp_path)
    assert sorted(healed) == sorted(reference) and len(reference) == 4 + 4 * 3
    different = [k for k in reference if not torch.equal(reference[k], healed[k])]
    assert different == [], "bitwise equal after the requeue"
    print(
        f"\nslurm job {job_id}: killed {killed - began:.0f} s after sbatch; training again "
        f"{resumed - killed:.0f} s after the kill, from step {starts[2]}; completed "
        f"{ended - began:.0f} s after sbatch; the reference run took "
        f"{time.monotonic() - ended:.0f} s"
    )
