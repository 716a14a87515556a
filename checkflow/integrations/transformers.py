"""Hugging Face ``transformers.Trainer``: frequent asynchronous checkflow checkpoints.

::

    from checkflow.integrations.transformers import CheckflowTrainerCallback

    callback = CheckflowTrainerCallback("s3://bucket/run-42", every=50)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume_point())   # None: a fresh start

Each optimizer step is one ``Checkpointer`` step, counted once the Trainer has logged,
evaluated and saved for it (a checkpoint holds that step's log entry): the model, the
optimizer, the LR scheduler, the ``TrainerState`` (global step, epoch, log history) and
the torch / numpy / Python RNG states go into checkflow, asynchronously. The Trainer's own
``save_strategy`` can stay ``"no"``.

Resuming goes through the Trainer's own resume path, so that the data position is the
Trainer's: ``resume_point()`` reads the newest committed checkpoint and lays out the two
files ``Trainer.train(resume_from_checkpoint=...)`` reads itself into a temporary folder,
``model.safetensors`` (the weights) and ``trainer_state.json``. The Trainer loads the
weights and its state and skips the batches of the current epoch that were already
trained on, as after its own checkpoints. The optimizer, scheduler and RNG states are
restored by this callback from checkflow directly: no pickle is written or read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from checkflow.checkpointer import Checkpointer
from checkflow.read.api import list_checkpoints, load
from checkflow.state import rng_state, set_rng_state

log = logging.getLogger(__name__)


class HFTrainerState:
    """The ``TrainerState`` as a state object: its JSON text, as the Trainer writes it."""

    def __init__(self, state: TrainerState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(dataclasses.asdict(self.state), sort_keys=True)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        # The Trainer loaded the same JSON from trainer_state.json before training began.
        step = json.loads(saved["json"])["global_step"]
        if step != self.state.global_step:
            raise ValueError(
                f"the checkpoint is at global step {step}, the Trainer at "
                f"{self.state.global_step}: pass resume_from_checkpoint=callback.resume_point()"
            )


def _unwrap(obj: Any, attr: str) -> Any:
    """The torch object inside accelerate's wrappers (``AcceleratedOptimizer.optimizer``).

    The wrapper's ``step`` does not run hooks registered on the wrapper, and the
    ``Checkpointer`` waits for its background copy in an optimizer step pre-hook.
    """
    inner = getattr(obj, attr, None)
    return inner if inner is not None else obj


class CheckflowTrainerCallback(TrainerCallback):
    """Checkpoint a ``transformers.Trainer`` with checkflow, and resume it.

    Args:
        uri: where the checkpoints go (a local path or an fsspec URL).
        trust: unpickle objects stored as pickles when restoring (README, "Safe loading").
        **options: the ``Checkpointer``'s options (``every``, ``codec``, ``keep``,
            ``coordinator``, ``job``, ``max_overhead``...). ``rng`` is True by default.
    """

    def __init__(self, uri: str, *, trust: bool = False, **options: Any) -> None:
        self.uri = uri
        self.trust = trust
        self.options = options
        self.checkpointer: Checkpointer | None = None
        self.restored_step = 0
        """The global step the last ``train`` resumed from; 0 when it started fresh."""
        self._resume_step: int | None = None
        self._folder: str | None = None
        self._rng_to_set: dict[str, Any] | None = None
        self._step_pending = False
        self._waiting_for: set[str] = set()

    def resume_point(self) -> str | None:
        """A folder for ``Trainer.train(resume_from_checkpoint=...)``, or None.

        None when ``uri`` holds no committed checkpoint. The folder is temporary: it is
        removed when training ends.
        """
        so = self.options.get("storage_options")
        if not list_checkpoints(self.uri, storage_options=so):
            return None
        saved = load(self.uri, storage_options=so, trust=self.trust)
        step = int(saved["__checkflow__"]["step"])
        folder = Path(tempfile.mkdtemp(prefix=f"checkflow-resume-{step}-"))
        weights = {k: v.contiguous() for k, v in saved["model"].items()}
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "trainer_state.json").write_text(saved["trainer"]["json"])
        self._resume_step, self._folder = step, str(folder)
        log.info("resuming from step %d of %s (through %s)", step, self.uri, folder)
        return str(folder)

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        model, optimizer, scheduler = kwargs["model"], kwargs["optimizer"], kwargs["lr_scheduler"]
        objects = {
            "model": model,
            "optimizer": _unwrap(optimizer, "optimizer"),
            "scheduler": _unwrap(scheduler, "scheduler"),
            "trainer": HFTrainerState(state),
        }
        self.checkpointer = Checkpointer(self.uri, objects, **self.options)
        self.checkpointer.open()
        self.restored_step = 0
        if self._resume_step is None:
            self._refuse_to_overwrite()
            return
        self.restored_step = self.checkpointer.restore(self._resume_step, trust=self.trust)
        per_epoch = _update_steps_per_epoch(kwargs.get("train_dataloader"), args)
        if self.options.get("rng", True) and per_epoch and state.global_step % per_epoch:
            # Mid-epoch, the Trainer creates the epoch's iterator and skips the trained
            # batches after this hook, drawing from the RNGs; the saved states are set
            # again before the next step, where the Trainer restores its own.
            self._rng_to_set = rng_state()

    def _refuse_to_overwrite(self) -> None:
        found = list_checkpoints(self.uri, storage_options=self.options.get("storage_options"))
        if found:
            raise ValueError(
                f"{self.uri} already holds checkpoints (up to step {found[-1].step}) and this "
                "train() starts from step 0, which would replace them: resume with "
                "trainer.train(resume_from_checkpoint=callback.resume_point()), or use a new uri"
            )

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._count_step()  # a step whose log/evaluate/save did not happen after all
        if self._rng_to_set is not None:
            set_rng_state(self._rng_to_set)
            self._rng_to_set = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The step ends for the Trainer after it logs, evaluates and saves (each due one was
        # decided by now); the step is counted, and maybe checkpointed, after the last of
        # them, so that a checkpoint holds its log entry and the RNG states after them.
        due = {"log": control.should_log, "evaluate": control.should_evaluate}
        due["save"] = control.should_save
        self._waiting_for = {name for name, flag in due.items() if flag}
        self._step_pending = True
        if not self._waiting_for:
            self._count_step()

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._done("log")

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._done("evaluate")

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._done("save")

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._count_step()

    def _done(self, what: str) -> None:
        if self._step_pending:
            self._waiting_for.discard(what)
            if not self._waiting_for:
                self._count_step()

    def _count_step(self) -> None:
        if self._step_pending:
            self._step_pending = False
            self._waiting_for = set()
            assert self.checkpointer is not None, "on_train_begin was not called"
            self.checkpointer.step()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._count_step()
        ckpt, self.checkpointer = self.checkpointer, None
        try:
            if ckpt is not None:
                ckpt.close()
        finally:
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = self._resume_step = None


def _update_steps_per_epoch(loader: Any, args: TrainingArguments) -> int | None:
    """Optimizer steps in an epoch, as the Trainer counts them; None without a length."""
    try:
        batches = len(loader)
    except TypeError:
        return None
    accumulate = args.gradient_accumulation_steps
    return max(batches // accumulate + int(batches % accumulate > 0), 1)
