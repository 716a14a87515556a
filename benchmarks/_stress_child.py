"""The training process that ``stress_resume.py`` kills and resumes.

The same model, data, optimizer and loop as ``examples/train.py`` (the README's first
command), plus two things the stress test needs:

- ``--kill KIND:STEP[:ARG]`` SIGKILLs this process at a chosen point:
  ``step:K`` right after step K; ``delay:K:MS`` MS milliseconds after the checkpoint due at
  step K was requested (a timer thread, so the kill lands wherever the snapshot, persist or
  training happen to be); ``persist:K:POINT`` from inside the persist thread of the first
  checkpoint at or after step K, just before it writes its data file (``chunks``), its rank
  manifest (``rank``) or ``MANIFEST.json`` (``commit``), or just after the commit
  (``retention``).
- a digest of the whole training state after every step (``D step digest`` lines), so that
  a resumed run that differs can be traced to the first step that differs, and a restore
  can be told apart from a training step that went wrong.

    python benchmarks/_stress_child.py --dir CKPT --steps 150 --every 5 [--kill step:77]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn

from checkflow import Checkpointer, storage

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PERSIST_POINTS = ("chunks", "rank", "commit", "retention")
"""Kill points inside the persist, in the order the persist reaches them."""


def _is_write_of(point: str, relpath: str) -> bool:
    """Whether ``relpath`` is the file whose write starts at kill point ``point``."""
    name = relpath.rsplit("/", 1)[-1]
    if point == "chunks":
        return name.endswith(".chunks")
    if point == "rank":
        return name.startswith("rank-") and name.endswith(".json")
    return point == "commit" and name == "MANIFEST.json"


def _train_module() -> Any:
    spec = importlib.util.spec_from_file_location("checkflow_example_train", EXAMPLES / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def state_digest(model: nn.Module, opt: Any, sched: Any, data: Any) -> str:
    """xxh3 of every tensor and value a bitwise-exact resume must reproduce."""
    h = xxhash.xxh3_64()
    tensors = list(model.state_dict().items())
    for index, per_param in opt.state_dict()["state"].items():
        tensors += [(f"optim.{index}.{k}", v) for k, v in per_param.items()]
    tensors.append(("rng", torch.get_rng_state()))
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    h.update(json.dumps([sched.state_dict(), data.state_dict()], default=str).encode())
    return h.hexdigest()


def kill_inside_persist(step: int, point: str) -> None:
    """SIGKILL this process from the persist thread at ``point`` of the first checkpoint
    at or after ``step`` (fault injection through the one module that writes)."""
    put = storage.Storage.put

    def put_then_maybe_die(self: storage.Storage, relpath: str, parts: Any) -> int:
        folder = relpath.split("/", 1)[0]
        due = folder.startswith("step-") and int(folder[5:]) >= step
        if due and _is_write_of(point, relpath):
            _die()
        written = put(self, relpath, parts)
        if due and point == "retention" and relpath.endswith("MANIFEST.json"):
            _die()
        return written

    storage.Storage.put = put_then_maybe_die  # type: ignore[method-assign]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--codec", default="exact")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--kill", default=None, help="step:K | delay:K:MS | persist:K:POINT")
    p.add_argument("--out", default=None, help="write the final state here (torch.save)")
    p.add_argument("--coordinator", default=None)
    p.add_argument("--job", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    kind, kill_step, arg = None, -1, ""
    if args.kill:
        kind, k, *rest = args.kill.split(":")
        kill_step, arg = int(k), (rest[0] if rest else "")
        if kind == "persist":
            kill_inside_persist(kill_step, arg)
    timer: threading.Timer | None = None
    example = _train_module()
    model, opt, sched = example.build()
    data = example.ShuffledData()
    state = {"model": model, "optim": opt, "sched": sched, "data": data}
    with Checkpointer(
        args.dir,
        state,
        every=args.every,
        codec=args.codec,
        keep=args.keep,
        coordinator=args.coordinator,
        job=args.job,
    ) as ckpt:
        start = ckpt.restore()
        print(f"start {start} {state_digest(model, opt, sched, data)}", flush=True)
        for step in range(start, args.steps):
            x, y = data.next()
            noise = 0.01 * torch.randn_like(x)
            loss = nn.functional.binary_cross_entropy_with_logits(model(x + noise), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            future = ckpt.step()
            print(f"D {step + 1} {state_digest(model, opt, sched, data)}", flush=True)
            if step + 1 == kill_step and kind == "step":
                _die()
            if step + 1 == kill_step and kind == "delay":
                print(f"requested {step + 1} {'taken' if future else 'skipped'}", flush=True)
                timer = threading.Timer(float(arg) / 1000, _die)
                timer.start()
        if kind == "persist":
            # No checkpoint at or after the kill step was taken (all skipped): die now,
            # with whatever persist is in flight.
            print("persist point not reached", flush=True)
            _die()
    if timer is not None:
        timer.join()  # the run ended before the delay did: the kill still comes, now
    if args.out:
        final = {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "sched": sched.state_dict(),
            "data": data.state_dict(),
            "loss": loss.item(),
        }
        torch.save(final, args.out)
    print(f"done {ckpt.stats.committed} committed", flush=True)


if __name__ == "__main__":
    main()
