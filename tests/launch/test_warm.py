"""Warm restarts (``checkflow.launch.warm``): which spare may become which worker, and a
spare really becoming one: argv, environment, log files and exit code as a cold start's.

The end-to-end case (a SIGKILLed DDP job restarting in its spares, bitwise equal to an
uninterrupted run) is in ``test_faults.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from checkflow.launch.warm import WarmPool, usable
from checkflow.launch.warmstart import SPARE_NAME

ENV = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "RANK": "0", "MASTER_PORT": "1234"}


def test_a_spare_takes_the_usual_command_when_only_per_round_variables_differ():
    command = (sys.executable, "-u", "train.py", "--lr", "0.1")
    next_round = {**ENV, "RANK": "1", "MASTER_PORT": "999", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert usable(command, ENV, next_round) is None
    assert usable((sys.executable, "-u", "-m", "pkg.train"), ENV, ENV) is None


@pytest.mark.parametrize(
    ("command", "env", "why"),
    [
        (("/other/python", "-u", "t.py"), ENV, "not a plain"),
        ((sys.executable, "t.py"), ENV, "not a plain"),
        ((sys.executable, "-u", "-X", "dev", "t.py"), ENV, "interpreter option -X"),
        ((sys.executable, "-u", "t.py"), {**ENV, "OMP_NUM_THREADS": "4"}, "OMP_NUM_THREADS"),
        ((sys.executable, "-u", "t.py"), {**ENV, "CUDA_VISIBLE_DEVICES": "1"}, "CUDA_VISIBLE"),
    ],
)
def test_a_spare_is_refused_for_other_commands_or_variables_read_at_import(command, env, why):
    reason = usable(command, ENV, env)
    assert reason is not None and why in reason


SCRIPT = """
import os, sys
print("argv", sys.argv)
print("rank", os.environ["RANK"], "warm", "CHECKFLOW_WARM_START" in os.environ)
print("json loaded before the script", "json" in sys.modules)
print("name", open("/proc/self/comm").read().strip())
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def started_spare(tmp_path: Path) -> tuple[WarmPool, dict[str, str]]:
    """A pool whose local rank 0 ran once cold, with its spare ready (imports ``json``)."""
    pool = WarmPool(imports=("json",), spare_after_s=0.0)
    env = {**ENV, "PATH": "/usr/bin:/bin"}
    cold = pool.take(0, (sys.executable, "-u", "t.py"), env, {})
    assert cold is None, "no spare yet: the first round starts cold"
    deadline = time.monotonic() + 30
    while 0 not in pool.ready_ranks():
        assert time.monotonic() < deadline, "the spare never got ready"
        pool.tick()
        time.sleep(0.05)
    return pool, env


def test_a_spare_becomes_the_worker_with_its_argv_env_log_files_and_exit_code(tmp_path):
    pool, env = started_spare(tmp_path)
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    out.touch()
    err.touch()
    spare = pool._spares[0].proc
    assert Path(f"/proc/{spare.pid}/comm").read_text().strip() == SPARE_NAME
    try:
        command = (sys.executable, "-u", str(script), "--x", "1")
        proc = pool.take(0, command, {**env, "RANK": "7"}, {"stdout": str(out), "stderr": str(err)})
        assert proc is not None, "the ready spare is used"
        assert proc.wait(30) == 3
    finally:
        pool.close()
    lines = out.read_text().splitlines()
    assert lines == [
        f"argv [{str(script)!r}, '--x', '1']",
        "rank 7 warm True",
        "json loaded before the script True",
        "name worker.py",
    ]
    assert err.read_text() == "to stderr\n"
    assert pool.warm_starts == 1


def test_a_spare_whose_environment_no_longer_fits_is_discarded_and_the_start_is_cold(tmp_path):
    pool, env = started_spare(tmp_path)
    spare = pool._spares[0].proc
    try:
        changed = {**env, "OMP_NUM_THREADS": "8"}
        assert pool.take(0, (sys.executable, "-u", "t.py"), changed, {}) is None
        assert spare.wait(10) == 0, "the discarded spare exits on its closed stdin"
    finally:
        pool.close()
    assert (pool.warm_starts, pool.cold_starts) == (0, 2)
