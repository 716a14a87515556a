"""The demo's own checks: it fails loudly unless the kill and the resume are what it says.

The children here are tiny Python processes (no torch, no checkpoints), so each case runs
in well under a second; the whole demo is what the README's first command runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.paths import EXAMPLES, load_example


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    return load_example("demo")


def child(body: str) -> list[str]:
    """A process that reads ``--kill-at N`` like train.py and then runs ``body``."""
    script = (
        "import os, signal, sys\n"
        "kill_at = int(sys.argv[sys.argv.index('--kill-at') + 1])\n"
        "sys.stderr.write('a warning on stderr\\n')\n" + body
    )
    return [sys.executable, "-c", script]


def test_a_child_that_kills_itself_at_the_step_passes(demo: ModuleType, tmp_path: Path) -> None:
    cmd = child(
        "for step in range(1, 10):\n"
        "    print(f'step {step} loss 0.5', flush=True)\n"
        "    if step == kill_at:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert demo.run_killed(cmd, 4, tmp_path / "killed.log") == (4, -9)
    assert (tmp_path / "killed.log").read_text() == "a warning on stderr\n"


def test_a_child_that_finishes_before_the_kill_fails_the_demo(
    demo: ModuleType, tmp_path: Path
) -> None:
    # What the old demo reported as "SIGKILLed after step 173 (exit 0)".
    cmd = child("for step in range(1, 10):\n    print(f'step {step} loss 0.5', flush=True)\n")
    with pytest.raises(demo.DemoFailed, match=r"die of SIGKILL after step 4.*code 0 after step 9"):
        demo.run_killed(cmd, 4, tmp_path / "killed.log")


def test_a_child_killed_by_another_signal_or_at_another_step_fails_the_demo(
    demo: ModuleType, tmp_path: Path
) -> None:
    terminated = child("print('step 4 loss 0.5', flush=True)\nos.kill(os.getpid(), 15)\n")
    with pytest.raises(demo.DemoFailed, match=r"code -15 after step 4; the end of .*killed\.log"):
        demo.run_killed(terminated, 4, tmp_path / "killed.log")
    early = child("print('step 3 loss 0.5', flush=True)\nos.kill(os.getpid(), 9)\n")
    with pytest.raises(demo.DemoFailed, match="SIGKILLed after step 3, not 4"):
        demo.run_killed(early, 4, tmp_path / "killed.log")


@pytest.mark.parametrize(
    ("first_line", "problem"),
    [
        ("start step 0", "started at step 0"),  # nothing was restored
        ("start step 173", "started at step 173"),
        ("start step 290", "started at step 290"),  # the old demo's resume after a late kill
        ("step 1 loss 0.5", "did not report its start step"),
    ],
)
def test_a_resume_not_from_a_checkpoint_below_the_kill_fails_the_demo(
    demo: ModuleType, first_line: str, problem: str
) -> None:
    with pytest.raises(demo.DemoFailed, match=problem):
        demo.resumed_from([first_line, "done 300 steps"], kill_at=173)


def test_a_resume_from_below_the_kill_gives_its_start_step(demo: ModuleType) -> None:
    assert demo.resumed_from(["start step 170", "step 171 loss 0.1"], kill_at=173) == 170


def test_a_failing_run_fails_the_demo_with_the_end_of_its_stderr(
    demo: ModuleType, tmp_path: Path
) -> None:
    cmd = [sys.executable, "-c", "import sys; sys.exit('no checkpoint URI')"]
    with pytest.raises(
        demo.DemoFailed, match=r"(?s)resumed run exited with code 1.*no checkpoint URI"
    ):
        demo.run(cmd, "resumed run", tmp_path / "resumed.log")


def test_the_demo_refuses_a_kill_step_outside_the_run() -> None:
    res = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--steps", "100", "--kill-at", "100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert "--kill-at must be above 10 (the first checkpoint) and below --steps 100" in res.stderr


def test_the_demo_keeps_its_checkpoints_in_dir_and_says_where(tmp_path: Path) -> None:
    """A short demo, as a user runs it: its last line names the checkpoints it kept, and
    ``checkflow ls`` of the work folder points at them. The kill comes after step 30, whose
    snapshot needed a host buffer set free: step 10 was committed by then, however slow the
    machine (a kill at 15 found nothing committed on a loaded one)."""
    work = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--steps", "40", "--kill-at", "35",
         "--dir", str(work)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[2] == (
        f"2. second run killed itself with SIGKILL after step 35 (exit -9); "
        f"committed in {work / 'ckpt'}:"
    )
    assert lines[-1] == f"5. checkpoints kept in {work / 'ckpt'}: checkflow ls {work / 'ckpt'}"
    listed = subprocess.run(
        [sys.executable, "-m", "checkflow.cli", "ls", str(work)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (listed.returncode, listed.stdout) == (
        0,
        f"no checkpoints in {work}; found some in {work / 'ckpt'}, {work / 'reference'} - "
        f"run checkflow ls {work / 'ckpt'}\n",
    )
    assert sorted(p.name for p in (work / "ckpt").iterdir())[-1] == "step-000000040"


def test_the_demo_refuses_a_dir_holding_files_it_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "thesis.tex").write_text("years of work\n")
    res = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.splitlines()[-1] == (
        f"demo.py: error: --dir {tmp_path} holds files the demo did not write (thesis.tex); "
        "choose a new or empty folder"
    )
    assert (tmp_path / "thesis.tex").read_text() == "years of work\n"


def test_without_dir_the_last_line_says_the_checkpoints_went_with_the_folder(
    demo: ModuleType,
) -> None:
    assert demo.where_checkpoints(Path("/tmp/checkflow-demo-x/ckpt"), kept=False) == (
        "5. checkpoints were in /tmp/checkflow-demo-x/ckpt, deleted with the work folder "
        "(--dir DIR keeps them)"
    )
    assert demo.foreign_files(Path("/nonexistent/i32")) == []
