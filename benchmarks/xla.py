"""checkflow on XLA (torch_xla's PJRT CPU backend) against torch_xla's own async checkpointing.

The 288 MiB MLP + AdamW of ``overhead.py`` on one XLA:CPU device, in one process: no
checkpoints, checkflow (``every=K``) and torch_xla's ``CheckpointManager.save_async``
(``chkpt_on_preemption=False``, as off-TPU it must be; a one-process gloo group, which it
requires). Each repeat runs every strategy once, in a rotated order (interleaved, so slow
phases of a shared machine hit each of them); the report gives medians with their spread
(min..max over repeats):

Each step waits for its own graph (``xm.wait_device_ops()`` after ``torch_xla.sync()``), in
every strategy: torch_xla runs one graph at a time and the next ``sync()`` waits for the one
in flight, so without it a checkpoint's stall would include finishing the step's own graph
(work the next step waits for anyway), for both sides. ``--pipelined`` leaves the wait out.

- stall per checkpoint: how long training was blocked by a checkpoint (checkflow: ``take``
  plus the optimizer step's wait for the transfer; save_async: the call, which moves the
  state to the host before it returns);
- excess per checkpoint: what the checkpoint step and the step after it took together
  over two typical steps of the same run (the median of the steps no checkpoint touched).
  On XLA:CPU the "device" is this machine's CPUs, so work that does not block training
  (checkflow's device copy and transfer) still slows the steps it overlaps: this column
  counts it, the stall does not;
- overhead at K: the run's wall time over the run without checkpoints, minus one;
- restore: the newest checkpoint back into the live model and optimizer on the device, its
  files first dropped from the page cache (both strategies read from the disk, as on a
  restarted node; checkflow writes with O_DIRECT and leaves nothing cached, save_async
  writes through the page cache, so without this they would not read alike).

Targets (issue 12): checkflow's stall <= 1/5 of save_async's, its overhead <= 1/2 of
save_async's, its restore <= 1.2x save_async's.

Run it in the XLA lane's venv (``bash .ci/xla`` makes it):

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla.py                 # 288 MiB, K=5
    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla.py --quick         # 32 MiB smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import evict, fmt_s, median, table  # noqa: E402

STRATEGIES = ("none", "checkflow", "xla.save_async")


def build(hidden: int, layers: int, device: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    model = nn.Sequential(*mods).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)


class Run:
    """One strategy's run: per-step hooks, and what it measured."""

    def __init__(self, name: str, k: int, root: str, model: nn.Module, opt: Any) -> None:
        self.name, self.k, self.root, self.model, self.opt = name, k, root, model, opt
        self.stalls: list[float] = []
        self.restore_s = float("nan")
        self.ckpt: Any = None
        self.mgr: Any = None
        self.warm_stalls = 0

    def open(self) -> None:
        if self.name == "checkflow":
            from checkflow import Checkpointer

            state = {"model": self.model, "optim": self.opt}
            self.ckpt = Checkpointer(self.root, state, every=self.k, keep=2, rng=False)
            self.ckpt.open()
        elif self.name == "xla.save_async":
            from torch_xla.experimental.distributed_checkpoint import CheckpointManager

            self.mgr = CheckpointManager(
                self.root, save_interval=self.k, max_to_keep=2, chkpt_on_preemption=False
            )

    def warm(self) -> None:
        """One untimed checkpoint, waited for, so buffers and caches exist (as overhead.py)."""
        if self.ckpt is not None:
            self.ckpt.save().result()
            self.warm_stalls = len(self.ckpt.stats.stalls_s)
        elif self.mgr is not None:
            self.mgr.save_async(0, self._xla_state(), force=True)
            self.mgr.join()

    def after_step(self, step: int) -> None:
        if self.ckpt is not None:
            self.ckpt.step()
        elif self.mgr is not None and step % self.k == 0:
            t0 = time.perf_counter()
            assert self.mgr.save_async(step, self._xla_state())
            self.stalls.append(time.perf_counter() - t0)

    def _xla_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def drain(self) -> None:
        if self.ckpt is not None:
            self.ckpt.wait()
            # take() plus the optimizer step's wait, per checkpoint
            self.stalls = list(self.ckpt.stats.stalls_s)[self.warm_stalls :]
        elif self.mgr is not None:
            self.mgr.join()

    def restore(self) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm

        evict(self.root)  # both strategies read from the disk, as on a restarted node
        t0 = time.perf_counter()
        if self.ckpt is not None:
            self.ckpt.restore()
        elif self.mgr is not None:
            state = self._xla_state()
            self.mgr.restore(max(self.mgr.all_steps()), state)
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optim"])
        else:
            return
        torch_xla.sync()
        xm.wait_device_ops()
        self.restore_s = time.perf_counter() - t0

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()


def one_run(name: str, args: argparse.Namespace, model: nn.Module, opt: Any) -> dict[str, Any]:
    import torch_xla
    import torch_xla.core.xla_model as xm

    root = tempfile.mkdtemp(prefix=f"xla-bench-{name}-", dir=args.dir)
    run = Run(name, args.k, root, model, opt)
    run.open()
    run.warm()
    device = torch_xla.device()
    x = torch.randn(args.batch, args.hidden).to(device)
    step_times = []
    xm.wait_device_ops()
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        nn.functional.mse_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()
        if not args.pipelined:
            xm.wait_device_ops()
        run.after_step(step)
        step_times.append(time.perf_counter() - t0)
    run.drain()
    xm.wait_device_ops()
    total = time.perf_counter() - t_start
    run.restore()
    run.close()
    shutil.rmtree(root, ignore_errors=True)
    return {
        "total": total,
        "step": median(step_times),
        "excess": excess(step_times, args.k),
        "stall": median(run.stalls),
        "taken": len(run.stalls),
        "restore": run.restore_s,
    }


def excess(step_times: list[float], k: int) -> float:
    """Median over checkpoints of (its step + the next) minus two untouched steps."""
    touched = {i for s in range(k, len(step_times), k) for i in (s - 1, s)}
    rest = [t for i, t in enumerate(step_times) if i not in touched]
    typical = median(rest) if rest else float("nan")
    pairs = [step_times[s - 1] + step_times[s] for s in range(k, len(step_times), k)]
    return median([p - 2 * typical for p in pairs]) if pairs else float("nan")


def spread(values: list[float], unit: str = "ms") -> str:
    vals = [v for v in values if v == v]
    if not vals:
        return "-"
    return f"{fmt_s(median(vals), unit)} ({fmt_s(min(vals), unit)}..{fmt_s(max(vals), unit)})"


def pct(values: list[float]) -> str:
    return f"{median(values):.1%} ({min(values):.1%}..{max(values):.1%})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-mib", type=float, default=288)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (K divides it)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--pipelined",
        action="store_true",
        help="no wait for each step's graph: stalls then include finishing it",
    )
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="32 MiB, 10 steps, 2 repeats")
    args = p.parse_args()
    if args.quick:
        args.params_mib, args.steps, args.repeats = 32, 10, 2

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch.distributed as dist
    import torch_xla

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("gloo", rank=0, world_size=1)  # CheckpointManager needs one

    layers = max(1, round(args.params_mib * 2**20 / ((args.hidden**2 + args.hidden) * 4)))
    model, opt = build(args.hidden, layers, torch_xla.device())
    mib = sum(t.numel() * t.element_size() for t in model.parameters()) / 2**20
    print(
        f"# {mib:.0f} MiB of parameters ({layers} x {args.hidden}), AdamW, XLA:CPU, "
        f"K={args.k}, {args.steps} steps x {args.repeats} repeats, torch {torch.__version__}"
        + (", pipelined" if args.pipelined else ", each step waits for its graph")
    )
    one_run("none", argparse.Namespace(**{**vars(args), "steps": 2 * args.k}), model, opt)  # warm
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in STRATEGIES}
    for r in range(args.repeats):
        order = STRATEGIES[r % 3 :] + STRATEGIES[: r % 3]
        for name in order:
            results[name].append(one_run(name, args, model, opt))
            print(f"  repeat {r + 1} {name}: {results[name][-1]}", flush=True)
    report(results, args)


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    base = results["none"]
    rows = []
    over: dict[str, list[float]] = {}
    for name, runs in results.items():
        over[name] = [r["total"] / b["total"] - 1 for r, b in zip(runs, base, strict=True)]
        rows.append(
            [
                name,
                spread([r["step"] for r in runs]),
                spread([r["stall"] for r in runs]),
                "-" if name == "none" else spread([r["excess"] for r in runs]),
                "-" if name == "none" else pct(over[name]),
                spread([r["restore"] for r in runs], "s"),
                f"{runs[0]['taken']}",
            ]
        )
    print()
    print(
        table(
            [
                "strategy",
                "step",
                "stall / ckpt",
                "excess / ckpt",
                f"overhead K={args.k}",
                "restore",
                "ckpts/run",
            ],
            rows,
        )
    )
    cf, xs = results["checkflow"], results["xla.save_async"]
    stall_cf, stall_x = median([r["stall"] for r in cf]), median([r["stall"] for r in xs])
    rest_cf, rest_x = median([r["restore"] for r in cf]), median([r["restore"] for r in xs])
    o_cf, o_x = median(over["checkflow"]), median(over["xla.save_async"])
    print()
    for what, ok in [
        (
            f"stall {fmt_s(stall_cf)} <= 1/5 of save_async's {fmt_s(stall_x)}",
            stall_cf <= stall_x / 5,
        ),
        (f"overhead {o_cf:.1%} <= 1/2 of save_async's {o_x:.1%}", o_cf <= o_x / 2),
        (
            f"restore {fmt_s(rest_cf, 's')} <= 1.2x save_async's {fmt_s(rest_x, 's')}",
            rest_cf <= 1.2 * rest_x,
        ),
    ]:
        print(f"{'PASS' if ok else 'MISS'}  {what}")


if __name__ == "__main__":
    main()
