"""A 2-rank gloo DDP job for ``checkflow run``: trains, checkpoints every 5 steps, resumes.

In the first round (``TORCHELASTIC_RESTART_COUNT=0``) rank 1 SIGKILLs itself after step
``--kill-at``, once the checkpoint before it has committed. Lines it appends to
``<--events>/rank-<rank>.log`` (not stdout, where the ranks' lines can interleave):
``env <rank> <round> <coordinator> <job>``, ``start <rank> <round> <step>``,
``fault <time>``, ``step <rank> <round> <step> <time>``, ``final <rank> <digest>``.

Fault injection for ``tests/launch/test_faults.py`` (``--fault ROUND:RANK:STEP:KIND``,
repeatable; any ``--fault`` turns ``--kill-at`` off): in round ROUND, rank RANK, once step
STEP is trained and the checkpoint before it committed, ``kill`` SIGKILLs itself, ``stop``
SIGSTOPs itself (frozen: its heartbeat thread stops too), ``spin`` busy-loops in Python on
the main thread (a hang: its threads stay alive) while the other rank waits in the next
``all_reduce``; ``restore-kill`` SIGKILLs itself inside ``ckpt.restore()`` of that round
(STEP is ignored), after the model is loaded and before the optimizer is. Each fault logs
``inject <rank> <round> <kind> <step> <time>`` first. ``--gate STEP:PATH`` (repeatable)
holds every rank after step STEP until PATH exists, logging ``gate <rank> <round> <step>``.
``--pg-timeout`` (30 s) bounds every collective and store wait of the process group.
``phase <rank> <round> <name> <time>`` lines say when the process was ``spawned``, had
``imported`` torch and checkflow, ``joined`` the process group, ``built`` the DDP model
(its constructor imports ``torch._dynamo``: as long as importing torch), and ``restored``;
a worker that started in a warm spare of ``checkflow run`` logs ``warm <rank> <round>`` and
counts as ``spawned`` when the spare became it.
The last line, ``state <rank> <digest>``, hashes the parameters and the optimizer state.
``tier <rank> <round> <tier> <reads>`` says where ``restore()`` read its step (``ram``,
``storage``, ``-`` for none) and how many reads it made from storage (RAM tier, issue 11).
``--ram-every N`` checkpoints every N steps to the RAM tier alone (``checkflow run
--ram-tier``); a fault then waits until the coordinator's restore point is its step, i.e.
every rank's RAM copy of it was reported. ``--jit``: ``Checkpointer(jit=True)``, the
survivors of a fault write a just-in-time checkpoint to the RAM tier (issue 11).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from checkflow import Checkpointer
from checkflow.catalog import committed_steps

FAULT_KINDS = ("kill", "stop", "spin", "restore-kill")


def fault_spec(text: str) -> tuple[int, int, int, str]:
    """``ROUND:RANK:STEP:KIND`` -> ``(round, rank, step, kind)``."""
    round_, rank, step, kind = text.split(":")
    if kind not in FAULT_KINDS:
        raise argparse.ArgumentTypeError(f"fault kind {kind!r} is not one of {FAULT_KINDS}")
    return int(round_), int(rank), int(step), kind


def gate_spec(text: str) -> tuple[int, str]:
    """``STEP:PATH`` -> ``(step, path)``."""
    step, path = text.split(":", 1)
    return int(step), path


def wait_for_commit(ckpt: Checkpointer, step: int) -> None:
    """Until checkpoint ``step`` committed on every rank (this rank's part is not enough:
    another rank may still be persisting), so that a fault now must resume from it."""
    ckpt.wait()
    deadline = time.monotonic() + 60
    with ckpt.paused():  # a known wait, not a hang
        while max(committed_steps(ckpt.storage), default=0) < step:
            assert time.monotonic() < deadline, f"step {step} never committed"
            time.sleep(0.05)


def wait_for_restore_point(step: int) -> None:
    """Until the coordinator's restore point is ``step`` (every rank reported its RAM copy)."""
    import httpx

    from checkflow.protocol import RestorePoint, paths

    url = os.environ["CHECKFLOW_COORDINATOR"] + paths.path(
        paths.RESTORE_POINT, job=os.environ["CHECKFLOW_JOB"]
    )
    headers = {"Authorization": f"Bearer {os.environ.get('CHECKFLOW_TOKEN', '')}"}
    deadline = time.monotonic() + 60
    while RestorePoint.model_validate(httpx.get(url, headers=headers).json()).step != step:
        assert time.monotonic() < deadline, f"step {step} never became the restore point"
        time.sleep(0.05)


def inject(kind: str, log: Callable[[str], None], rank: int, round_: int, step: int) -> None:
    """The fault ``kind``, now, in this process."""
    log(f"inject {rank} {round_} {kind} {step} {time.time():.3f}")
    if kind in ("kill", "restore-kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "spin":
        while True:  # stuck in Python: the GIL is released now and then, threads run
            pass


class RestoreProbe:
    """A state entry that SIGKILLs its process when a restore loads it (``restore-kill``)."""

    def __init__(self, fault: Callable[[], None] | None) -> None:
        self.fault = fault

    def state_dict(self) -> dict[str, int]:
        return {"probe": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.fault is not None:
            self.fault()


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha1 of every parameter's bytes, then of every tensor of the optimizer state."""
    digest = hashlib.sha1()
    for t in model.parameters():
        digest.update(t.detach().numpy().tobytes())
    for index, values in sorted(opt.state_dict()["state"].items()):
        for name, value in sorted(values.items()):
            digest.update(f"{index}.{name}".encode())
            if isinstance(value, torch.Tensor):
                digest.update(value.detach().numpy().tobytes())
            else:
                digest.update(repr(value).encode())
    return digest.hexdigest()


def process_start_time() -> float:
    """``time.time()`` when this process started (Linux: from ``/proc``, to 10 ms; the boot
    time in ``/proc/stat`` is whole seconds, so it is taken from ``/proc/uptime`` instead)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    imported = time.time()
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-at", type=int, default=13)
    p.add_argument("--events", required=True, help="folder of the per-rank event logs")
    p.add_argument("--fault", type=fault_spec, action="append", default=[])
    p.add_argument("--gate", type=gate_spec, action="append", default=[])
    p.add_argument("--hang-timeout", type=float, help="Checkpointer(hang_timeout=)")
    p.add_argument("--pg-timeout", type=float, default=30, help="of collectives and the store")
    p.add_argument("--ram-every", type=int, help="Checkpointer(ram_every=)")
    p.add_argument("--jit", action="store_true", help="Checkpointer(jit=True)")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    joined = time.time()
    rank = dist.get_rank()
    log = open(os.path.join(args.events, f"rank-{rank}.log"), "a", buffering=1)  # noqa: SIM115

    def print(line: str, flush: bool = True) -> None:  # noqa: A001 - one line per event
        log.write(line + "\n")

    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    coordinator = os.environ.get("CHECKFLOW_COORDINATOR", "-")
    print(f"env {rank} {restart} {coordinator} {os.environ.get('CHECKFLOW_JOB', '-')}", flush=True)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    built = time.time()
    mine = [(at, kind) for r, k, at, kind in args.fault if (r, k) == (restart, rank)]
    gates = dict(args.gate)
    restore_kill = any(kind == "restore-kill" for _, kind in mine)
    probe = RestoreProbe(
        (lambda: inject("restore-kill", print, rank, restart, -1)) if restore_kill else None
    )
    state = {"model": model, "probe": probe, "optim": opt}
    options: dict[str, float | bool] = {}
    if args.hang_timeout is not None:
        options["hang_timeout"] = args.hang_timeout
    if args.ram_every is not None:
        options["ram_every"] = args.ram_every
    if args.jit:
        options["jit"] = True
    with Checkpointer(args.dir, state, every=5, keep=0, **options) as ckpt:
        start = ckpt.restore()
        print(f"start {rank} {restart} {start}", flush=True)
        print(f"tier {rank} {restart} {ckpt.restored_from or '-'} {ckpt.storage.reads}")
        warm = os.environ.get("CHECKFLOW_WARM_START")  # handed over to a warm spare at
        if warm:
            print(f"warm {rank} {restart}", flush=True)
        spawned = float(warm) if warm else process_start_time()
        phases = {"spawned": spawned, "imported": imported, "joined": joined}
        phases["built"] = built
        for name, at in {**phases, "restored": time.time()}.items():
            print(f"phase {rank} {restart} {name} {at:.3f}", flush=True)
        for step in range(start, args.steps):
            data = torch.Generator().manual_seed(step * 2 + rank)
            x = torch.randn(8, 16, generator=data)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
            print(f"step {rank} {restart} {step + 1} {time.time():.3f}", flush=True)
            for at, kind in mine:
                if kind != "restore-kill" and step + 1 == at:
                    wait_for_commit(ckpt, at // 5 * 5)
                    if args.ram_every:
                        wait_for_restore_point(at)
                    inject(kind, print, rank, restart, at)
            if step + 1 in gates:
                print(f"gate {rank} {restart} {step + 1}", flush=True)
                while not os.path.exists(gates[step + 1]):
                    time.sleep(0.02)
            if not args.fault and restart == 0 and rank == 1 and step + 1 >= args.kill_at:
                # The fault comes once the newest checkpoint has committed on every rank (this
                # rank's part is not enough: rank 0 may still be persisting), so the restart
                # must resume from it.
                ckpt.wait()
                newest = args.kill_at // 5 * 5
                deadline = time.monotonic() + 20
                while max(committed_steps(ckpt.storage), default=0) < newest:
                    assert time.monotonic() < deadline, f"step {newest} never committed"
                    time.sleep(0.05)
                print(f"fault {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    weights = b"".join(t.detach().numpy().tobytes() for t in model.parameters())
    print(f"final {rank} {hashlib.sha1(weights).hexdigest()}", flush=True)
    print(f"state {rank} {state_digest(model, opt)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
