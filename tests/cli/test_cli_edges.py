"""The edges of the ``checkflow`` command a new user meets, each run as a real subprocess.

- exit codes of their own: 3 when the coordinator cannot be reached, 4 when it does not
  know the job (both were 1, which the README keeps for a failed verification);
- ``checkflow ls`` of a run's work folder points at the folder below that holds the steps;
- ``--format torch`` writes what plain ``torch.load(path)`` (``weights_only``) reads;
- without safetensors, ``--format safetensors`` names the extra to install;
- in the coordinator image (no torch, no numpy), the commands that need them say so in one
  line, exit 5, instead of a ``No module named 'numpy'`` traceback.

The missing packages are made missing by ``tests/support/blocked_imports``: a
``sitecustomize`` that makes their import fail in the child, as where they are not
installed. ``tests/deploy`` runs the same commands in a real coordinator-only venv.
"""

from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from checkflow import Checkpointer, load
from tests.runtime._models import small_state, train_step
from tests.support.coordinator import served
from tests.support.net import free_port
from tests.support.paths import REPO

BLOCKER = REPO / "tests" / "support" / "blocked_imports"


def run_cli(*args: str, block: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    """``checkflow ARGS`` in a child; ``block``: packages whose import fails there."""
    child = {k: v for k, v in os.environ.items() if not k.startswith("CHECKFLOW_")}
    child.update(env)
    if block:
        child.update(PYTHONPATH=f"{BLOCKER}{os.pathsep}{REPO}", CHECKFLOW_TEST_BLOCK_IMPORTS=block)
    return subprocess.run(
        [sys.executable, "-m", "checkflow.cli", *args],
        capture_output=True, text=True, timeout=180, env=child,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A work folder ``run/`` whose checkpoints (steps 1 and 2) are in ``run/ckpt``."""
    work = tmp_path_factory.mktemp("work") / "run"
    state = small_state()
    with Checkpointer(str(work / "ckpt"), state, every=1, rng=True) as ck:
        for _ in range(2):
            train_step(state)
            ck.step()
    (work / "train.log").write_text("a file beside the checkpoints\n")
    return work


# -- exit codes ------------------------------------------------------------------------------
def test_an_unreachable_coordinator_exits_3_with_one_line():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for argv in (["status", url], ["restore", "--coordinator", url, "--job", "j"]):
        res = run_cli(*argv)
        assert res.returncode == 3, argv
        assert res.stderr.startswith(f"checkflow: error: cannot reach the coordinator at {url}")
        assert res.stderr.rstrip().endswith("is `checkflow serve` running there?")
        assert len(res.stderr.splitlines()) == 1


def test_a_job_the_coordinator_does_not_know_exits_4_naming_it_and_where_to_look(tmp_path):
    with served(tmp_path / "c.db") as server:
        token = {"CHECKFLOW_TOKEN": server.token or ""}
        for argv in (
            ["status", server.url, "nope"],
            ["restore", "--coordinator", server.url, "--job", "nope"],
        ):
            res = run_cli(*argv, **token)
            assert (res.returncode, res.stderr) == (
                4,
                f"checkflow: error: job 'nope' not found on the coordinator at {server.url}; "
                f"`checkflow status {server.url}` lists the jobs it knows\n",
            ), argv


# -- ls of a work folder ---------------------------------------------------------------------
def test_ls_of_a_work_folder_points_at_the_folder_that_holds_the_steps(run_root):
    res = run_cli("ls", str(run_root))
    ckpt = run_root / "ckpt"
    assert (res.returncode, res.stdout) == (
        0,
        f"no checkpoints in {run_root}; found some in {ckpt} - run checkflow ls {ckpt}\n",
    )
    assert run_cli("ls", str(ckpt)).stdout.splitlines()[0].split() == [
        "STEP", "KIND", "BASE", "WORLD", "SIZE", "CREATED",
    ]  # fmt: skip


def test_ls_of_an_empty_folder_says_only_that(tmp_path):
    (tmp_path / "logs").mkdir()
    res = run_cli("ls", str(tmp_path))
    assert (res.returncode, res.stdout) == (0, f"no checkpoints in {tmp_path}\n")


# -- exports ---------------------------------------------------------------------------------
def test_a_torch_export_loads_with_plain_torch_load_and_its_numpy_rng_is_a_tensor(
    run_root, tmp_path
):
    out = tmp_path / "m.pt"
    res = run_cli("restore", str(run_root / "ckpt"), "--out", str(out))
    assert res.returncode == 0, res.stderr
    # Plain torch.load in a process of its own: weights_only, torch's default since 2.6.
    plain = subprocess.run(
        [sys.executable, "-c",
         "import sys, numpy, torch\n"
         "sd = torch.load(sys.argv[1])\n"
         "name, keys, *rest = sd['rng']['numpy']\n"
         "numpy.random.set_state((name, keys.numpy(), *rest))\n"
         "print(type(keys).__name__, keys.dtype, sorted(sd))",
         str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert (
        plain.stdout == "Tensor torch.uint32 ['__checkflow__', 'model', 'optim', 'rng', 'sched']\n"
    )
    exported = torch.load(out)
    saved = load(str(run_root / "ckpt"))["rng"]["numpy"]
    assert isinstance(saved[1], np.ndarray)
    assert np.array_equal(exported["rng"]["numpy"][1].numpy(), saved[1])
    assert exported["rng"]["numpy"][2:] == tuple(saved[2:])


def test_a_torch_export_with_trusted_pickles_says_it_needs_weights_only_false(tmp_path):
    class Holder:
        def __init__(self) -> None:
            self.value = {"ratio": Fraction(1, 3)}

        def state_dict(self) -> dict:
            return self.value

        def load_state_dict(self, sd: dict) -> None:
            self.value = sd

    root, out = tmp_path / "run", tmp_path / "m.pt"
    state = {**small_state(), "extra": Holder()}
    with Checkpointer(str(root), state, every=1, rng=False, allow_pickle=True) as ck:
        ck.save().result()
    res = run_cli("restore", str(root), "--out", str(out), "--trust")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == (
        "1 object(s) unpickled with --trust are kept as they are (extra.ratio "
        "(fractions.Fraction)): this file loads only with torch.load(PATH, "
        "weights_only=False), which runs their code"
    )
    assert torch.load(out, weights_only=False)["extra"]["ratio"] == Fraction(1, 3)


def test_safetensors_missing_names_the_extra_and_writes_nothing(run_root, tmp_path):
    out = tmp_path / "m.safetensors"
    res = run_cli(
        "restore", str(run_root / "ckpt"), "--out", str(out), "--format", "safetensors",
        block="safetensors",
    )  # fmt: skip
    assert (res.returncode, res.stderr) == (
        2,
        "checkflow: error: --format safetensors needs the safetensors package: "
        "pip install 'checkflow[safetensors]'\n",
    )
    assert not out.exists()


# -- the coordinator image -------------------------------------------------------------------
RUNTIME = "torch numpy zstandard xxhash"


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{ckpt}"],
        ["inspect", "{ckpt}"],
        ["verify", "{ckpt}"],
        ["restore", "{ckpt}", "--out", "{tmp}/m.pt"],
        ["gc", "{ckpt}", "--keep", "1"],
        ["run", "train.py"],
    ],
    ids=lambda argv: argv[0],
)
def test_without_torch_and_numpy_a_command_that_needs_them_says_so_in_one_line(
    run_root, tmp_path, argv
):
    args = [a.format(ckpt=run_root / "ckpt", tmp=tmp_path) for a in argv]
    res = run_cli(*args, block=RUNTIME)
    assert res.returncode == 5
    assert res.stderr.startswith(
        f"checkflow: error: checkflow {argv[0]} needs the full install: "
        "pip install 'checkflow[full]' (this is a coordinator-only install, without "
    )
    assert len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr
    assert sorted(p.name for p in (run_root / "ckpt").iterdir())[-1] == "step-000000002"
    assert not (tmp_path / "m.pt").exists()


def test_without_torch_and_numpy_status_and_serve_still_work(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    assert run_cli("status", url, block=RUNTIME).returncode == 3  # it ran: nothing there
    assert run_cli("serve", "--help", block=RUNTIME).returncode == 0
