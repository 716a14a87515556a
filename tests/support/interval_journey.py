"""Issue 32's journey: a real ``Checkpointer`` training a tiny model with short steps
against a real coordinator, with what the coordinator shows sampled along the way.

Shared by ``tests/runtime/test_interval_journey.py`` (asserts) and
``benchmarks/auto_interval.py`` (prints the figures).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from checkflow import Checkpointer
from checkflow.protocol import JobPublic
from tests.support.coordinator import ServerProcess


@dataclass(slots=True)
class Sample:
    """What the coordinator's API showed for the job at one step."""

    step: int
    interval: int
    mode: str
    next_checkpoint: int
    restore: int | None


@dataclass(slots=True)
class JourneyResult:
    steps: int
    wall_s: float
    """Wall time of the training loop, checkpointing included."""
    blocked_s: float
    """Time the training thread was blocked by checkpoints: every stall (snapshot start,
    waits for a host buffer set, waits in the optimizer pre-hook)."""
    taken: int
    waits: int
    waited_s: float
    checkpoints: list[int] = field(default_factory=list)
    """The step of every checkpoint taken."""
    intervals: list[int] = field(default_factory=list)
    """The interval the rank applied at each step (index 0: step 1)."""
    samples: list[Sample] = field(default_factory=list)
    adopted: int | None = None
    """The interval the rank applied once it and the coordinator agreed (see ``run``)."""
    shown: JobPublic | None = None
    """The job as the coordinator showed it then."""
    extra_steps: int = 0
    """Steps trained after ``steps`` until the rank's interval and the shown one agreed."""
    status: str = ""
    """What ``status`` (the caller's) printed for the job then."""

    @property
    def overhead(self) -> float:
        return self.blocked_s / self.wall_s


def tiny_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def run(
    server: ServerProcess,
    root: Path,
    job: str,
    *,
    every: int | str,
    steps: int,
    step_s: float = 0.003,
    sample_every: int = 100,
    settle_s: float = 20.0,
    status: Callable[[], str] = lambda: "",
) -> JourneyResult:
    """Train ``steps`` steps of ``step_s`` seconds (a sleep: the workload) with ``every``,
    sampling the coordinator's view of the job every ``sample_every`` steps; then train on
    (at most ``settle_s``) until the rank's interval equals the one the coordinator shows:
    the rank hears the coordinator once a heartbeat, so the two may differ for a moment.
    ``status`` is called then, with the rank still alive (a finished rank's last report may
    move the interval again)."""
    model, opt = tiny_model()
    with Checkpointer(
        str(root), {"model": model, "optim": opt}, every=every, coordinator=server.url,
        job=job, token=server.token,
    ) as ckpt:  # fmt: skip
        result = JourneyResult(steps, 0.0, 0.0, 0, 0, 0.0)

        def train_one() -> None:
            time.sleep(step_s)
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if ckpt.step() is not None:
                result.checkpoints.append(ckpt.current_step)
            result.intervals.append(ckpt.stats.interval or 0)

        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            train_one()
            if step % sample_every == 0:
                j = server.job(job)
                s = Sample(
                    step, j.interval, j.schedule.mode, j.next_checkpoint_step, j.restore_step
                )
                result.samples.append(s)
        result.wall_s = time.perf_counter() - t0
        stats = ckpt.stats
        result.blocked_s, result.taken = sum(stats.stalls_s), stats.taken
        result.waits, result.waited_s = stats.waits, stats.waited_s
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            shown = server.job(job)
            if ckpt.stats.interval == shown.interval:
                cell = status()
                # A retune between the two reads (once a second) would make the cell another
                # interval's: kept only when the API still shows the same one after it.
                if server.job(job).interval == shown.interval:
                    result.adopted, result.shown, result.status = shown.interval, shown, cell
                    break
            for _ in range(sample_every):  # one look per sample_every: steps stay short
                train_one()
            result.extra_steps += sample_every
    return result
