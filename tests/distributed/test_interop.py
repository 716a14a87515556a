"""DCP interop: a checkflow checkpoint exported as DCP loads into FSDP2 ranks with
``torch.distributed.checkpoint.load``; a DCP checkpoint imports as a committed step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkflow import Checkpointer, list_checkpoints
from checkflow.interop import export_dcp, import_dcp
from checkflow.restore import load
from tests.distributed import _worker
from tests.distributed._launch import run_ranks
from tests.runtime._train import assert_bitwise_equal, load_final


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _worker.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        x, y = _worker.batch(step, 0)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.slow
@pytest.mark.distributed
def test_exported_dcp_loads_into_fsdp2_ranks_bitwise(tmp_path):
    model, opt = _trained()
    with Checkpointer(str(tmp_path / "ckpt"), {"model": model, "optim": opt}, every=100) as c:
        c.save().result()
    assert export_dcp(str(tmp_path / "ckpt"), None, tmp_path / "dcp") == 0

    out = tmp_path / "loaded.pt"
    cfg = {"scenario": "dcp_load", "kind": "fsdp", "dcp": str(tmp_path / "dcp"), "out": str(out)}
    run_ranks(2, cfg)
    assert_bitwise_equal(load_final(out)["model"], dict(model.state_dict()))


def test_dcp_checkpoint_imports_as_a_committed_step(tmp_path):
    model, opt = _trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))

    uri = str(tmp_path / "imported")
    assert import_dcp(tmp_path / "dcp", uri, step=7) == 7
    assert [c.step for c in list_checkpoints(uri)] == [7]
    restored = load(uri)
    assert_bitwise_equal(dict(restored["model"]), dict(model.state_dict()))
    saved_optim = opt.state_dict()["state"]
    assert_bitwise_equal(dict(restored["optim"]["state"]), saved_optim)
