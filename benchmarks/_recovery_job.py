"""One rank of ``benchmarks/recovery.py``'s job: 2-rank gloo DDP, checkpoints, one fault.

Trains a small MLP under DDP for ``--steps`` steps of about ``--step-time`` seconds (the
compute is tiny; a sleep before each step stands in for loading data, so that progress is
visible without taking the shared CPUs). Checkpoints every ``--every`` steps with checkflow
(``--ckpt checkflow``) or with DCP ``async_save`` + ``load`` (``--ckpt dcp``), or not at all
(``--ckpt none``: the uninterrupted reference). In the first round
(``TORCHELASTIC_RESTART_COUNT=0``) rank 1 injects ``--fault`` right after step
``--fault-at``: ``crash`` (SIGKILL of itself), ``freeze`` (SIGSTOP of itself: every thread
stops, heartbeats included) or ``hang`` (a Python busy loop on the main thread while its
other threads live on; rank 0 then waits in DDP's ``all_reduce`` of the next step).

Events go to ``<--events>/rank-<rank>.log``, one line each, ``<kind> <rank> <round> <value>
<unix time>``: ``exec`` (the process's start, read from ``/proc``, or when a warm spare
became it), ``imported`` (torch imported), ``joined`` (``init_process_group`` returned),
``built`` (the DDP model and optimizer exist: DDP's first construction imports
``torch._dynamo``, seconds under load), ``ready`` (checkpointer open: about to restore),
``start`` (restored; value = the step training resumes from), ``step`` (value = steps done),
``fault`` (value = the step after which the fault comes; written before it is injected) and
``final`` (value = digest of the final parameters and optimizer state).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO


def process_start_time() -> float:
    """When this process was created (by the launcher), as a unix time, from ``/proc``.

    Counted back from now with ``/proc/uptime`` (10 ms resolution), not from ``btime``
    (whole seconds: up to 1 s off, which put restarts before the faults that caused them).
    """
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


# A worker that `checkflow run` started in a warm spare (torch already imported) became
# this worker at CHECKFLOW_WARM_START; the process itself is older.
EXEC_TIME = float(os.environ.get("CHECKFLOW_WARM_START") or process_start_time())

import torch  # noqa: E402 - the start time is read before the slow import
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

IMPORTED_TIME = time.time()


class Events:
    """Appends ``<kind> <rank> <round> <value> <time>`` lines, each written at once."""

    def __init__(self, folder: str, rank: int, restart: int) -> None:
        self.rank, self.restart = rank, restart
        self.file: TextIO = open(os.path.join(folder, f"rank-{rank}.log"), "a", buffering=1)  # noqa: SIM115

    def __call__(self, kind: str, value: object = "-", at: float | None = None) -> None:
        stamp = time.time() if at is None else at
        self.file.write(f"{kind} {self.rank} {self.restart} {value} {stamp:.3f}\n")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", choices=["checkflow", "dcp", "none"], required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.3)
    p.add_argument("--fault", choices=["none", "crash", "freeze", "hang"], default="none")
    p.add_argument("--fault-at", type=int, default=13)
    p.add_argument("--pg-timeout", type=float, default=None, help="seconds; torch's default")
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--coordinator", default=None)
    p.add_argument("--job", default=None)
    p.add_argument("--token", default=None)
    p.add_argument("--ram-every", type=int, default=None, help="Checkpointer(ram_every=)")
    p.add_argument("--jit", action="store_true", help="Checkpointer(jit=True)")
    return p.parse_args()


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    model = nn.parallel.DistributedDataParallel(net)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    data = torch.Generator().manual_seed(step * 2 + rank)
    x, y = torch.randn(32, 64, generator=data), torch.randn(32, 1, generator=data)
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def inject(fault: str) -> None:
    if fault == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault == "hang":
        while True:  # the main thread spins in Python; the GIL still lets other threads run
            pass


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        h.update(opt.state[p]["momentum_buffer"].numpy().tobytes())
    return h.hexdigest()[:16]


class Saver:
    """The checkpointing under test: ``open`` → ``restore`` → ``after_step`` → ``close``."""

    def __init__(self, args: argparse.Namespace, model: nn.Module, opt: Any) -> None:
        self.args, self.model, self.opt = args, model, opt

    def restore(self) -> int:
        return 0

    def after_step(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class CheckflowSaver(Saver):
    def __init__(self, args: argparse.Namespace, model: nn.Module, opt: Any) -> None:
        super().__init__(args, model, opt)
        import inspect

        from checkflow import Checkpointer

        options: dict[str, Any] = {"every": args.every, "keep": 3}
        if args.coordinator:
            options.update(coordinator=args.coordinator, job=args.job, token=args.token)
        if args.hang_timeout and "hang_timeout" in inspect.signature(Checkpointer).parameters:
            options["hang_timeout"] = args.hang_timeout
        if args.ram_every is not None:
            options["ram_every"] = args.ram_every
        if args.jit:
            options["jit"] = True
        self.ckpt = Checkpointer(args.dir, {"model": model, "optim": opt}, **options)
        self.ckpt.open()

    def restore(self) -> int:
        return self.ckpt.restore()

    def after_step(self, step: int) -> None:
        self.ckpt.step()

    def close(self) -> None:
        self.ckpt.close()


class DcpSaver(Saver):
    """DCP as torchtitan uses it: ``async_save`` on a gloo group of its own (its collectives
    run on a thread and must not interleave with DDP's), the previous save waited for before
    the next one, ``.metadata`` (written last, by the coordinator rank) marks a complete one."""

    def __init__(self, args: argparse.Namespace, model: nn.Module, opt: Any) -> None:
        super().__init__(args, model, opt)
        timeout = timedelta(seconds=args.pg_timeout) if args.pg_timeout else None
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.pending: Any = None

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def restore(self) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        newest = [0]
        if dist.get_rank() == 0:
            done = [p for p in Path(self.args.dir).glob("step-*") if (p / ".metadata").exists()]
            newest[0] = max((int(p.name[5:]) for p in done), default=0)
        dist.broadcast_object_list(newest, src=0)
        if newest[0] == 0:
            return 0
        state = self._state()
        dcp.load(state, checkpoint_id=self._path(newest[0]), process_group=self.group)
        set_state_dict(
            self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        return int(newest[0])

    def after_step(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if step % self.args.every:
            return
        if self.pending is not None:
            self.pending.result()
        self.pending = dcp.async_save(
            self._state(), checkpoint_id=self._path(step), process_group=self.group
        )

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()

    def _path(self, step: int) -> str:
        return os.path.join(self.args.dir, f"step-{step:06d}")


SAVERS = {"checkflow": CheckflowSaver, "dcp": DcpSaver, "none": Saver}


def main() -> None:
    args = parse()
    rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    event = Events(args.events, rank, restart)
    event("exec", os.getpid(), at=EXEC_TIME)
    event("imported", at=IMPORTED_TIME)
    timeout = timedelta(seconds=args.pg_timeout) if args.pg_timeout else None
    dist.init_process_group("gloo", timeout=timeout)
    event("joined")
    torch.set_num_threads(1)
    model, opt = build()
    event("built")
    saver = SAVERS[args.ckpt](args, model, opt)
    event("ready")
    start = saver.restore()
    event("start", start)
    for step in range(start, args.steps):
        time.sleep(args.step_time)
        train_step(model, opt, step, rank)
        saver.after_step(step + 1)
        event("step", step + 1)
        if restart == 0 and rank == 1 and step + 1 == args.fault_at and args.fault != "none":
            event("fault", step + 1)
            inject(args.fault)
    saver.close()
    event("final", digest(model, opt))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
