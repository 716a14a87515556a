"""Exact resume on XLA:CPU: a run SIGKILLed and resumed ends bitwise equal to one that never
stopped (parameters, AdamW state, the XLA device's RNG seed that dropout draws from).

What torch_xla does not expose, and so is not saved: its RNG is one integer seed per
device, and the per-graph random-op counter is reset by each ``sync()``; resuming after a
``sync()`` (checkflow snapshots only there) needs nothing more.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.runtime._train import assert_bitwise_equal, load_final, run_train, run_until_killed

TRAIN = Path(__file__).with_name("_xla_train.py")


def _run(*args: str, env: dict[str, str] | None = None) -> str:
    return run_train(*args, env=env, script=TRAIN, timeout=600)


@pytest.mark.parametrize(
    "mesh, devices",
    [(None, "1"), ("4", "4"), ("2,2", "4")],
    ids=["one-device", "spmd-1d-mesh", "spmd-2d-mesh"],
)
def test_xla_run_sigkilled_and_resumed_ends_bitwise_equal_to_uninterrupted(
    tmp_path: Path, mesh: str | None, devices: str
) -> None:
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": devices}
    spmd = ["--mesh", mesh] if mesh else []
    common = ["--steps", "16", "--every", "3", *spmd]
    _run("--dir", str(tmp_path / "straight"), *common, "--out", str(tmp_path / "a.pt"), env=env)

    killed = run_until_killed(
        "--dir",
        str(tmp_path / "killed"),
        *common,
        "--step-sleep",
        "0.5",
        kill_after_step=5,
        env={**os.environ, **env},
        script=TRAIN,
        timeout=600,
    )
    assert 5 <= killed < 16
    out = _run("--dir", str(tmp_path / "killed"), *common, "--out", str(tmp_path / "b.pt"), env=env)
    restored = int(out.splitlines()[0].split()[1])
    assert restored in (3, 6, 9, 12, 15) and restored <= killed, out

    a, b = load_final(tmp_path / "a.pt"), load_final(tmp_path / "b.pt")
    assert_bitwise_equal(a, b)
    assert a["xla_rng"] == b["xla_rng"]
