"""A small transformers.Trainer run with checkflow, run as its own process by
test_transformers_resume.

    python _transformers_job.py --dir URI --out FILE [--kill-at STEP] [--every N]

A 2-layer GPT-2 built from a config (nothing is downloaded), 2 epochs of 15 optimizer
steps on random token sequences, dropout on, AdamW with a linear schedule and warm-up.
``CheckflowTrainerCallback`` checkpoints every N steps; with ``--kill-at`` the process
SIGKILLs itself after that global step. Run again, it resumes through
``callback.resume_point()``. At the end it writes the final state to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from checkflow.integrations.transformers import CheckflowTrainerCallback  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class KillAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            print(f"killing at global step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--every", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(args.out), "hf-output"),
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=3e-3,
        warmup_steps=3,
        lr_scheduler_type="linear",
        logging_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    ckpt = CheckflowTrainerCallback(args.dir, every=args.every)
    callbacks: list[TrainerCallback] = [ckpt]
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at))
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(60), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=ckpt.resume_point())
    state = trainer.state
    torch.save(
        {
            "restored_step": ckpt.restored_step,
            "global_step": state.global_step,
            "epoch": state.epoch,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": trainer.optimizer.state_dict(),
            "sched": trainer.lr_scheduler.state_dict(),
            "losses": {h["step"]: h["loss"] for h in state.log_history if "loss" in h},
            "rng": torch.get_rng_state(),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
