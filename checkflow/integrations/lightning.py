"""PyTorch Lightning: frequent asynchronous checkflow checkpoints of a ``Trainer``.

Add the callback and call ``fit`` as usual; a run that was killed resumes from the newest
committed checkpoint on the next ``fit``::

    from checkflow.integrations.lightning import CheckflowCallback

    trainer = L.Trainer(callbacks=[CheckflowCallback("s3://bucket/run-42", every=50)])
    trainer.fit(module, datamodule)    # resumes from s3://bucket/run-42 when it holds one

Each checkpoint holds the module, every optimizer and LR scheduler, Lightning's loop state
(fit loop progress: epoch, batch and optimizer-step counters, and the state of a stateful
train dataloader such as torchdata's ``StatefulDataLoader``), the state of the other
callbacks (``ModelCheckpoint``'s best-k bookkeeping among them), the precision plugin's
(AMP scaler) and the RNG states. One ``Checkpointer`` step is one train batch. A
checkpoint is taken at ``on_train_batch_end``, where Lightning itself saves mid-epoch
checkpoints, so its loops know how to restart from there, after every other callback (the
callback moves itself last), so that it holds their work of that batch. A checkpoint at
an epoch's last batch resumes bitwise too: the restored epoch is reopened so that
Lightning ends it and starts the next one as the uninterrupted run did (``_reopen_epoch``).

``ModelCheckpoint`` keeps doing best-k exports: they are Lightning checkpoints, written by
the ``CheckpointIO`` plugin of the Trainer (``checkflow.integrations.lightning_io`` stores
them with checkflow too). A resumed run replays the steps after the restored checkpoint
and makes the same export decisions again; pass ``ModelCheckpoint(...,
enable_version_counter=False)`` so that an export repeated under the same name replaces
the first instead of being written as ``-v1``.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl

from checkflow.checkpointer import Checkpointer
from checkflow.state import rng_state, set_rng_state

log = logging.getLogger(__name__)


class LightningTrainerState:
    """What a Lightning ``Trainer`` keeps outside the module, optimizers and schedulers.

    A state object for the ``Checkpointer``: the fit loop's state (progress counters and
    the train dataloader's state when it has one), the other callbacks' states by their
    ``state_key``, the precision plugin's and the datamodule's.
    """

    def __init__(self, trainer: pl.Trainer, skip: pl.Callback | None = None) -> None:
        self.trainer = trainer
        self.skip = skip
        self.reopened_epoch = False
        """Whether the restored state was saved at an epoch's last batch (see ``_reopen_epoch``)."""

    def _callbacks(self) -> list[pl.Callback]:
        return [cb for cb in self.trainer.callbacks if cb is not self.skip]

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        callbacks = {}
        for cb in self._callbacks():
            state = cb.state_dict()
            if state:
                callbacks[cb.state_key] = state
        out: dict[str, Any] = {
            "fit_loop": trainer.fit_loop.state_dict(),
            "callbacks": callbacks,
            "precision": trainer.precision_plugin.state_dict(),
        }
        if trainer.datamodule is not None:
            out["datamodule"] = trainer.datamodule.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        fit_loop, self.reopened_epoch = _reopen_epoch(state["fit_loop"])
        trainer.fit_loop.load_state_dict(fit_loop)
        for cb in self._callbacks():
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        if state["precision"]:
            trainer.precision_plugin.load_state_dict(state["precision"])
        if trainer.datamodule is not None and "datamodule" in state:
            trainer.datamodule.load_state_dict(state["datamodule"])


def _reopen_epoch(fit_loop: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The fit loop's state to load, and whether it was saved at an epoch's last batch.

    Restarted from ``on_train_batch_end`` of an epoch's last batch, Lightning 2.6 closes
    that epoch in ``FitLoop.reset`` by counting it processed and completed, without running
    what the uninterrupted run runs after that hook: the ``on_train_epoch_end`` hooks of
    the callbacks and the module, the ``on_train_epoch_start`` hooks of the next epoch (its
    progress counters stay one behind), and a new train iterator for it (``iter`` in
    ``_TrainingEpochLoop.on_run_start`` is skipped while resuming, so the next epoch
    iterates the restored, exhausted one). Loaded with ``is_last_batch`` cleared, the fit
    loop restarts inside the epoch instead; the callback ends that epoch's batch loop at
    its first fetch (``CheckflowCallback.on_train_start``), and Lightning then runs the
    epoch's end and the next epoch's start as the uninterrupted run does.
    """
    batches = fit_loop.get("epoch_loop.batch_progress")
    if not batches or not batches.get("is_last_batch"):
        return fit_loop, False
    return {**fit_loop, "epoch_loop.batch_progress": {**batches, "is_last_batch": False}}, True


def trainer_state(trainer: pl.Trainer, skip: pl.Callback | None = None) -> dict[str, Any]:
    """The ``Checkpointer`` state of a ``Trainer`` whose optimizers are set up.

    Names: ``module``, ``optimizer0``…, ``scheduler0``… and ``trainer``. Optimizers are
    handed over as they are, so the ``Checkpointer`` copies their tensors (and the
    parameters) in the background and waits only at the next optimizer step.
    """
    state: dict[str, Any] = {"module": trainer.lightning_module}
    for i, optimizer in enumerate(trainer.optimizers):
        state[f"optimizer{i}"] = optimizer
    for i, config in enumerate(trainer.lr_scheduler_configs):
        state[f"scheduler{i}"] = config.scheduler
    state["trainer"] = LightningTrainerState(trainer, skip)
    return state


class CheckflowCallback(pl.Callback):
    """Checkpoint a Lightning ``fit`` with checkflow, and resume it from the newest one.

    Args:
        uri: where the checkpoints go (a local path or an fsspec URL).
        resume: on ``fit``, restore the newest committed checkpoint of ``uri``. Skipped
            when ``fit`` was given a ``ckpt_path``: Lightning restores from that one.
        trust: unpickle objects stored as pickles when restoring (see the README's
            "Safe loading"); only for checkpoints whose writer you trust.
        **options: the ``Checkpointer``'s options (``every``, ``codec``, ``keep``,
            ``coordinator``, ``job``, ``max_overhead``...). ``rng`` is True by default.
    """

    def __init__(self, uri: str, *, resume: bool = True, trust: bool = False, **options: Any):
        self.uri = uri
        self.resume = resume
        self.trust = trust
        self.options = options
        self.checkpointer: Checkpointer | None = None
        self._rng_to_set: dict[str, Any] | None = None
        self._at_epoch_end = False
        self.restored_step = 0
        """The step (train batches) the last ``fit`` resumed from; 0 when it started fresh."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here the optimizers and schedulers exist, and the fit loop has not started: the
        # same point where Lightning restores the training state from a ckpt_path.
        # Last among the callbacks, so that a checkpoint holds what the others did in the
        # same batch (ModelCheckpoint's export of that step). A new list: the hooks being
        # called now iterate the old one.
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not self] + [self]
        state = trainer_state(trainer, self)
        self.checkpointer = Checkpointer(self.uri, state, **self.options)
        self.checkpointer.open()
        self.restored_step = 0
        self._at_epoch_end = False
        if not self.resume:
            return
        if trainer.ckpt_path:
            log.info("fit(ckpt_path=%s) given: not restoring from %s", trainer.ckpt_path, self.uri)
            return
        self.restored_step = self.checkpointer.restore(trust=self.trust)
        self._at_epoch_end = bool(self.restored_step) and state["trainer"].reopened_epoch
        if self.restored_step and self.options.get("rng", True):
            # Lightning creates the train iterator for the restored loader state after this
            # hook, and a DataLoader draws its base seed from the global torch RNG then: a
            # draw the uninterrupted run did not make after the saved point. The saved
            # states are set again after it: before the next batch (mid-epoch), or at
            # on_train_start (at an epoch's last batch, where the uninterrupted run's next
            # draw is the next epoch's iterator's, which the resumed run makes too).
            self._rng_to_set = rng_state()
        if self.restored_step:
            log.info(
                "resumed from step %d of %s (epoch %d, global step %d)",
                self.restored_step,
                self.uri,
                trainer.current_epoch,
                trainer.global_step,
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._at_epoch_end:
            return
        # Restored from an epoch's last batch, the fit loop restarts inside that epoch
        # (_reopen_epoch). Its batch loop ends at its first fetch, as the uninterrupted
        # run's did after the saved point; then Lightning ends the epoch and starts the
        # next one, with a new train iterator, as that run did.
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is not None:
            fetcher.done = True
        self._set_saved_rng()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._set_saved_rng()

    def _set_saved_rng(self) -> None:
        if self._rng_to_set is not None:
            set_rng_state(self._rng_to_set)
            self._rng_to_set = None

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        assert self.checkpointer is not None, "on_fit_start was not called"
        self.checkpointer.step()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(raise_errors=True)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close(raise_errors=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(raise_errors=True)

    def _close(self, *, raise_errors: bool) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            ckpt.close(raise_errors=raise_errors)
