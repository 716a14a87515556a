"""torchdata's StatefulDataLoader with worker processes, saved and restored through checkflow.

The dataset draws random noise inside the worker processes (``num_workers=2``) from its
own generator, saved per worker as the dataset's ``state_dict``: the batches after a
restore are bitwise equal to the ones read after the checkpoint only when the sampler's
order, each worker's place and its generator all resume exactly.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchdata  # noqa: F401 - in the test extra: missing is an error, not a skip
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from checkflow import Checkpointer, load

REPO = Path(__file__).resolve().parents[2]


def _example():
    """The example's dataset and helpers: the test checks exactly what the example shows."""
    spec = importlib.util.spec_from_file_location(
        "stateful_dataloader_example", REPO / "examples" / "stateful_dataloader.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the loader's worker processes look classes up by name
    spec.loader.exec_module(module)
    return module


example = _example()


def _loader() -> StatefulDataLoader:
    """24 samples in batches of 4: 6 batches per epoch."""
    return StatefulDataLoader(
        example.Augmented(24), batch_size=4, shuffle=True, num_workers=2,
        worker_init_fn=example._seed_worker, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip


_take = example.batches
_stream = example.epochs


@pytest.mark.slow
def test_stateful_dataloader_with_two_workers_resumes_bitwise_mid_epoch(tmp_path: Path) -> None:
    loader = _loader()
    stream = _stream(loader)
    _take(stream, 6 + 2)  # one epoch (6 batches) and 2 batches of the second
    with Checkpointer(str(tmp_path), state={"data": loader}, every=1000, rng=False) as ckpt:
        ckpt.save().result()
    expected = _take(stream, 4 + 6)  # the rest of epoch 2, then all of epoch 3

    restored = _loader()
    with Checkpointer(str(tmp_path), state={"data": restored}, every=1000, rng=False) as ckpt:
        ckpt.restore()
    assert _take(_stream(restored), 10) == expected

    # Without the restore the same loader reads other batches: the check above has teeth.
    fresh = _loader()
    assert _take(_stream(fresh), 10) != expected
    # The state went in as data: it loads without trust (no pickle inside).
    assert load(str(tmp_path))["data"].keys() == loader.state_dict().keys()


@pytest.mark.slow
def test_stateful_dataloader_example_runs_and_reports_bitwise_equal(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "examples/stateful_dataloader.py", "--dir", str(tmp_path / "c")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "2 workers: bitwise equal" in done.stdout
