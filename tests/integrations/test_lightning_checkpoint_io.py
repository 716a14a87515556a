"""``CheckflowCheckpointIO``: Lightning's own checkpoints in checkflow's format.

``trainer.save_checkpoint`` writes a committed checkflow checkpoint, ``fit(ckpt_path=...)``
resumes from it, ``load_checkpoint`` reads it without running code, and a value that is
not data is refused when saving, naming where it is.
"""

from __future__ import annotations

from pathlib import Path

import lightning  # noqa: F401 - in the test extra: missing is an error, not a skip
import lightning.pytorch as pl  # noqa: E402
import pytest
import torch
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from checkflow import list_checkpoints  # noqa: E402
from checkflow.integrations.lightning_io import CheckflowCheckpointIO  # noqa: E402
from checkflow.objects import UnstorableObjectError  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, tag: object = "plain") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _trainer(max_steps: int) -> pl.Trainer:
    return pl.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        plugins=[CheckflowCheckpointIO()],
    )  # fmt: skip


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def test_save_checkpoint_commits_a_checkflow_step_that_fit_ckpt_path_resumes(tmp_path: Path):
    torch.manual_seed(0)
    module = Tiny()
    trainer = _trainer(max_steps=5)
    trainer.fit(module, _data())
    path = tmp_path / "five.ckpt"
    trainer.save_checkpoint(path)

    assert [c.step for c in list_checkpoints(str(path))] == [5]
    loaded = CheckflowCheckpointIO().load_checkpoint(path)
    assert loaded["global_step"] == 5
    for name, value in module.state_dict().items():
        assert torch.equal(loaded["state_dict"][name], value), name
    assert loaded["hyper_parameters"] == {"tag": "plain"}

    again = Tiny()
    resumed = _trainer(max_steps=8)
    resumed.fit(again, _data(), ckpt_path=str(path))
    assert resumed.global_step == 8
    state = resumed.optimizers[0].state_dict()["state"]
    assert int(state[0]["step"]) == 8  # Adam's step count went on from the checkpoint's 5


def test_a_hyper_parameter_that_is_not_data_is_refused_naming_it(tmp_path: Path):
    module = Tiny(tag={1, 2})  # a set: not data, would need a pickle
    trainer = _trainer(max_steps=1)
    trainer.fit(module, _data())
    with pytest.raises(UnstorableObjectError, match=r"lightning\.hyper_parameters\.tag"):
        trainer.save_checkpoint(tmp_path / "bad.ckpt")
    assert list_checkpoints(str(tmp_path / "bad.ckpt")) == []


def test_remove_checkpoint_deletes_the_folder(tmp_path: Path):
    module = Tiny()
    trainer = _trainer(max_steps=1)
    trainer.fit(module, _data())
    path = tmp_path / "gone.ckpt"
    trainer.save_checkpoint(path)
    CheckflowCheckpointIO().remove_checkpoint(path)
    assert not path.exists()
