"""Every export of a 2-stage pipeline checkpoint holds both stages.

Each stage saves only its own layers (rank 0: ``layers.0-1``, rank 1: ``layers.2-3``), so
an export that reads rank 0's objects alone loses half the model: ``--format torch`` did,
while ``load()`` and ``--format dcp`` joined the stages. The checkpoint is written by 2 real
gloo ranks; the exports are made by the ``checkflow`` CLI in a subprocess, and the torch
file is read by plain ``torch.load(path)`` in another.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from checkflow import load
from tests.distributed._launch import run_ranks
from tests.runtime._train import assert_bitwise_equal

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAYERS = {f"model.layers.{i}.{p}" for i in range(4) for p in ("weight", "bias")}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A committed step 2 of a 2-stage pipeline, and both stages' state as the ranks had it."""
    tmp = tmp_path_factory.mktemp("pipeline")
    uri, out = tmp / "run", tmp / "final"
    run_ranks(2, {"scenario": "pipeline", "steps": 2, "every": 2, "uri": str(uri), "out": str(out)})
    state: dict[str, torch.Tensor] = {}
    for rank in range(2):
        part = torch.load(f"{out}.{rank}")
        assert not state.keys() & part.keys(), "two stages hold the same entry"
        state.update(part)
    assert {k for k in state if k.startswith("model.")} == LAYERS
    return uri, state


def _cli(*args: str) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "checkflow.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_load_joins_both_stages(pipeline):
    uri, stages = pipeline
    assert_bitwise_equal(load(str(uri))["stage"], stages, "load()")


def test_the_torch_export_holds_both_stages_and_loads_with_plain_torch_load(pipeline, tmp_path):
    uri, stages = pipeline
    out = tmp_path / "pipeline.pt"
    assert _cli("restore", str(uri), "--out", str(out)).startswith(f"restored step 2 from {uri}")
    plain = subprocess.run(
        [sys.executable, "-c",
         "import json, sys, torch\n"
         "sd = torch.load(sys.argv[1])\n"  # weights_only, torch's default
         "print(json.dumps(sorted(k for k in sd['stage'] if k.startswith('model.'))))",
         str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert set(json.loads(plain.stdout)) == LAYERS
    assert_bitwise_equal(torch.load(out, weights_only=True)["stage"], stages, "--format torch")


def test_the_dcp_export_holds_both_stages(pipeline, tmp_path):
    uri, stages = pipeline
    out = tmp_path / "dcp"
    assert _cli("restore", str(uri), "--out", str(out), "--format", "dcp").startswith(
        f"restored step 2 from {uri} to {out} (dcp)"
    )
    # torch's own reader of a DCP folder, without a process group.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process
        dcp_to_torch_save(out, tmp_path / "dcp.pt")
    got = torch.load(tmp_path / "dcp.pt")["stage"]
    assert {k for k in got if k.startswith("model.")} == LAYERS
    assert_bitwise_equal(
        {k: v for k, v in got.items() if isinstance(v, torch.Tensor)},
        {k: v for k, v in stages.items() if isinstance(v, torch.Tensor)},
        "--format dcp",
    )


def test_the_safetensors_export_holds_both_stages(pipeline, tmp_path):
    from safetensors.torch import load_file

    uri, stages = pipeline
    out = tmp_path / "pipeline.safetensors"
    _cli("restore", str(uri), "--out", str(out), "--format", "safetensors")
    tensors = load_file(out)
    assert {k for k in tensors if k.startswith("stage.model.")} == {f"stage.{k}" for k in LAYERS}
    for key in LAYERS:
        assert torch.equal(tensors[f"stage.{key}"], stages[key]), key
