"""A small Lightning fit with checkflow, run as its own process by test_lightning_resume.

    python _lightning_job.py --dir URI --exports DIR --out FILE [--kill-at STEP]

It trains 2 epochs of 15 batches (a StatefulDataLoader over shuffled data, dropout, Adam,
a per-step LR scheduler), checkpoints every 4 batches with ``CheckflowCallback``, and
exports the best 2 by ``train_loss`` every 3 steps with ``ModelCheckpoint`` through
``CheckflowCheckpointIO``. With ``--kill-at`` it SIGKILLs itself after that global step;
run again, it resumes. At the end it writes the final state to ``--out`` (torch.save).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import zlib

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from checkflow.integrations.lightning import CheckflowCallback
from checkflow.integrations.lightning_io import CheckflowCheckpointIO


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, tuple[float, int, float, float]] = {}
        """Per global step, before the forward pass: the batch's sum, a checksum of the RNG
        state's bytes (not their sum: two states a few draws apart can have the same sum),
        the parameters' sum and the learning rate."""
        self.epoch_hooks: list[tuple[str, int, int]] = []
        """The epoch hooks called: (hook, epoch, global step)."""
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen[self.trainer.global_step] = (
            x.sum().item(),
            zlib.crc32(torch.get_rng_state().numpy().tobytes()),
            sum(p.double().sum().item() for p in self.parameters()),
            self.trainer.optimizers[0].param_groups[0]["lr"],
        )
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_start(self):
        self.epoch_hooks.append(("start", self.current_epoch, self.global_step))

    def on_train_epoch_end(self):
        self.epoch_hooks.append(("end", self.current_epoch, self.global_step))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class KillAt(pl.Callback):
    """SIGKILL this process right after global step ``step``: no cleanup, no flush."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            print(f"killing at global step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--exports", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--every", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(60, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(60, 1, generator=g)
    loader = StatefulDataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    ckpt = CheckflowCallback(args.dir, every=args.every)
    callbacks: list[pl.Callback] = [
        ckpt,
        ModelCheckpoint(
            dirpath=args.exports,
            filename="{step}",
            monitor="train_loss",
            save_top_k=2,
            every_n_train_steps=3,
            enable_version_counter=False,
        ),
    ]
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at))
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        plugins=[CheckflowCheckpointIO()],
    )
    module = Regressor()
    trainer.fit(module, train_dataloaders=loader)
    best = trainer.checkpoint_callback
    assert isinstance(best, ModelCheckpoint)
    torch.save(
        {
            "restored_step": ckpt.restored_step,
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "optim": trainer.optimizers[0].state_dict(),
            "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "best_k": {os.path.basename(k): float(v) for k, v in best.best_k_models.items()},
            "exports": sorted(os.listdir(args.exports)),
            "rng": torch.get_rng_state(),
            "seen": module.seen,
            "epoch_hooks": module.epoch_hooks,
            "loops": trainer.fit_loop.state_dict(),
        },
        args.out,
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
