"""``checkflow run`` as a new user runs it, on the repository's examples (issue 32).

Real launcher, real workers, a real coordinator (``checkflow serve``) where one is used:

- ``examples/train.py`` never calls ``init_process_group``: under ``--nproc-per-node=2``
  both workers are rank 0 of a world of 1; the launcher stops at once with one line saying
  what to do and exit 2 (it restarted them for ever, each registration failing the other's);
- ``examples/train_ddp.py`` with one rank SIGKILLed heals and ends bitwise equal to a run
  that was never killed;
- Ctrl-C (SIGINT to the launcher alone, as a terminal sends it: torch starts every worker
  in a session of its own) stops every worker of ``examples/train_fsdp.py`` and exits 130
  without a traceback;
- a job that crashes in every round stops once ``--max-restarts`` ran out, exit 1
  (``_crash_job.py``: simulated ranks without torch, so that restarts, not imports, take
  the time).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.launch._nodes import descendants
from tests.support.coordinator import TOKEN, ServerProcess, served
from tests.support.net import wait_until
from tests.support.paths import EXAMPLES

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAUNCH = [sys.executable, "-m", "checkflow.cli", "run", "--monitor-interval=0.1"]
CRASH_JOB = Path(__file__).with_name("_crash_job.py")


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One coordinator for the module's tests; each test has a job of its own."""
    with served(tmp_path_factory.mktemp("coordinator") / "coordinator.db") as server:
        yield server


def start(tmp_path: Path, *argv: str, name: str = "launcher") -> tuple[subprocess.Popen, Path]:
    """``checkflow run ARGV`` with its output (stdout and stderr) in ``<name>.out``."""
    out = tmp_path / f"{name}.out"
    with out.open("w") as f:
        # Its own session: on a timeout the launcher and every worker are killed together.
        proc = subprocess.Popen(
            [*LAUNCH, *argv],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "CHECKFLOW_TOKEN": TOKEN},
            start_new_session=True,
        )
    return proc, out


def finish(proc: subprocess.Popen, out: Path, timeout: float) -> tuple[int | None, str]:
    """The launcher's exit status (None: still running after ``timeout``, then killed with
    its workers) and its output."""
    try:
        rc: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    return rc, out.read_text(errors="replace")


def launch(tmp_path: Path, *argv: str, timeout: float, name: str = "launcher"):  # noqa: ANN201
    return finish(*start(tmp_path, *argv, name=name), timeout)


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("checkflow: error: ")]


def test_workers_that_do_not_form_the_world_stop_the_launch_with_what_to_do(tmp_path, coordinator):
    """The issue's run: 12 failures and 13 generations in 40 s, for ever, and no word why."""
    began = time.monotonic()
    rc, out = launch(
        tmp_path,
        "--nproc-per-node=2",
        "--max-restarts=3",
        "--no-warm-restarts",
        "--coordinator",
        coordinator.url,
        "--job",
        "not-distributed",
        str(EXAMPLES / "train.py"),
        "--dir",
        str(tmp_path / "ckpt"),
        "--steps",
        "1000000",
        timeout=120,
    )
    took = time.monotonic() - began

    assert rc == 2, f"exit {rc} after {took:.0f} s:\n{out[-3000:]}"
    assert errors(out) == [
        "checkflow: error: 2 workers run as rank 0 of a world of 1, not as ranks of the world "
        "of 2 checkflow run launched; the script must call "
        "torch.distributed.init_process_group() before it creates the Checkpointer "
        "(see examples/train_ddp.py)"
    ]
    assert "Traceback" not in out
    assert "restarting them without using one of --max-restarts" not in out, "no round 2"
    print(f"stopped after {took:.1f} s")


def final_state(path: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(path)
    tensors = {f"model.{k}": v for k, v in saved["model"].items()}
    for index, values in saved["optim"]["state"].items():
        tensors |= {f"optim.{index}.{k}": v for k, v in values.items()}
    return tensors


def test_the_ddp_example_healed_after_a_sigkill_ends_bitwise_equal_to_an_uninterrupted_run(
    tmp_path,
):
    def run(name: str, *extra: str) -> str:
        args = [str(EXAMPLES / "train_ddp.py"), "--dir", str(tmp_path / name), "--steps", "60"]
        args += ["--out", str(tmp_path / f"{name}.pt"), *extra]
        # Cold restarts: spares would import torch beside the workers' own start-up here.
        options = ["--nproc-per-node=2", "--max-restarts=1", "--no-warm-restarts"]
        rc, out = launch(tmp_path, *options, *args, timeout=150)
        assert rc == 0, f"{name}: exit {rc}:\n{out[-3000:]}"
        return out

    run("uninterrupted")
    out = run("killed", "--kill-at", "33")

    starts = [int(line.split()[-1]) for line in out.splitlines() if ": start step " in line]
    assert starts[:2] == [0, 0] and len(starts) == 4, out[-3000:]
    assert starts[2] == starts[3] in (10, 20, 30), "both ranks resume from one checkpoint"
    reference = final_state(tmp_path / "uninterrupted.pt")
    healed = final_state(tmp_path / "killed.pt")
    assert sorted(healed) == sorted(reference) and len(reference) == 4 + 4 * 3
    different = [k for k in reference if not torch.equal(reference[k], healed[k])]
    assert different == [], "bitwise equal after the restart"


def test_ctrl_c_stops_every_worker_and_exits_130_without_a_traceback(tmp_path):
    """On the FSDP2 example, which this also shows training under ``checkflow run``."""
    proc, out = start(
        tmp_path,
        "--nproc-per-node=2",
        "--no-warm-restarts",
        str(EXAMPLES / "train_fsdp.py"),
        "--dir",
        str(tmp_path / "ckpt"),
        "--steps",
        "100000000",
    )
    try:
        wait_until(lambda: "step 100 loss" in out.read_text(), 90, "100 steps of training")
        workers = descendants(proc.pid)
        assert len(workers) >= 2
        proc.send_signal(signal.SIGINT)  # the launcher alone, as a terminal's Ctrl-C
    finally:
        rc, output = finish(proc, out, timeout=60)

    assert rc == 130, output[-3000:]
    assert errors(output) == [
        "checkflow: error: stopped by SIGINT; the workers were stopped, the checkpoints they "
        "committed are kept"
    ]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    left = [pid for pid in workers if Path(f"/proc/{pid}").exists() and not zombie(pid)]
    assert left == [], "no worker (or warm spare) outlives the launcher"


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_job_that_crashes_in_every_round_stops_after_max_restarts(tmp_path, coordinator):
    """Rank 1 exits 1 in every round, rank 0 is then told to abort (exit 75) or stopped:
    with a coordinator too, each such restart counts, and the second crash ends the launch."""
    rc, out = launch(
        tmp_path,
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--no-warm-restarts",
        "--coordinator",
        coordinator.url,
        "--job",
        "crash-every-time",
        str(CRASH_JOB),
        timeout=120,
    )

    assert rc == 1, out[-3000:]
    assert errors(out) == [
        "checkflow: error: rank 1 failed first (exit code 1) and --max-restarts=1 ran out; "
        "its output and traceback are above"
    ]
    registered = [line for line in out.splitlines() if '"event": "registered", "rank": 1' in line]
    assert len(registered) == 2, "two rounds, no third"
    failed = [e for e in coordinator.events("crash-every-time") if e.kind == "rank_failed"]
    assert [(e.rank, e.detail["kind"]) for e in failed] == [(1, "crash"), (1, "crash")]
