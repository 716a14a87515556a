"""The 2-rank DDP job of ``tests/launch/_ddp_job.py`` under ``checkflow run``, and what its
ranks logged: for tests that inject faults and measure the recovery.

:func:`launch` starts the launcher in its own session (so a test that fails kills it and
every worker at once); :class:`Events` parses the ranks' event logs; :func:`recovery`
measures one fault: seconds from the fault to the next trained step, and steps redone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.paths import REPO

JOB = REPO / "tests" / "launch" / "_ddp_job.py"
INTERVAL = 5
"""The job checkpoints every 5 steps (``every=5``)."""


@dataclass(frozen=True)
class Step:
    rank: int
    round: int
    step: int
    time: float


@dataclass(frozen=True)
class Injected:
    """A fault the job injected in itself (``inject`` line)."""

    rank: int
    round: int
    kind: str
    step: int
    time: float


@dataclass
class Events:
    """Everything the ranks logged (``_ddp_job.py`` documents the lines)."""

    steps: list[Step] = field(default_factory=list)
    starts: dict[tuple[int, int], int] = field(default_factory=dict)
    """(rank, round) -> the step it restored."""
    injected: list[Injected] = field(default_factory=list)
    gates: set[tuple[int, int, int]] = field(default_factory=set)
    """(rank, round, step) of every rank held at a gate."""
    states: dict[int, str] = field(default_factory=dict)
    """rank -> digest of its final parameters and optimizer state."""
    phases: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)
    """(rank, round) -> {phase: time}: ``spawned``, ``imported``, ``joined``, ``restored``."""
    warm: set[tuple[int, int]] = field(default_factory=set)
    """(rank, round) of every worker that started in a warm spare of ``checkflow run``."""
    tiers: dict[tuple[int, int], tuple[str, int]] = field(default_factory=dict)
    """(rank, round) -> (tier its restore read, its reads from storage until then)."""

    @classmethod
    def read(cls, folder: Path) -> Events:
        events = cls()
        for path in sorted(folder.glob("rank-*.log")):
            for line in path.read_text().splitlines():
                events._add(line.split())
        return events

    def _add(self, words: list[str]) -> None:
        if not words:
            return
        kind, values = words[0], words[1:]
        if kind == "step" and len(values) == 4:
            r, k, s, t = values
            self.steps.append(Step(int(r), int(k), int(s), float(t)))
        elif kind == "start" and len(values) == 3:
            self.starts[(int(values[0]), int(values[1]))] = int(values[2])
        elif kind == "inject" and len(values) == 5:
            r, k, what, s, t = values
            self.injected.append(Injected(int(r), int(k), what, int(s), float(t)))
        elif kind == "gate" and len(values) == 3:
            self.gates.add((int(values[0]), int(values[1]), int(values[2])))
        elif kind == "warm" and len(values) == 2:
            self.warm.add((int(values[0]), int(values[1])))
        elif kind == "state" and len(values) == 2:
            self.states[int(values[0])] = values[1]
        elif kind == "tier" and len(values) == 4:
            self.tiers[(int(values[0]), int(values[1]))] = (values[2], int(values[3]))
        elif kind == "phase" and len(values) == 4:
            key = (int(values[0]), int(values[1]))
            self.phases.setdefault(key, {})[values[2]] = float(values[3])

    @property
    def rounds(self) -> list[int]:
        """Rounds in which some rank started training (restored and logged ``start``)."""
        return sorted({k for _, k in self.starts})

    def round_at(self, when: float) -> int:
        """The round training was in at ``time.time()`` ``when`` (its last step before)."""
        before = [s for s in self.steps if s.time <= when]
        return max(before, key=lambda s: s.time).round if before else 0

    def longest_pause(self, after: float) -> float:
        """The longest time a rank spent between two steps of one round, after ``after``."""
        gaps = [0.0]
        for rank, round_ in self.starts:
            times = sorted(s.time for s in self.steps if (s.rank, s.round) == (rank, round_))
            gaps += [b - a for a, b in zip(times, times[1:], strict=False) if b > after]
        return max(gaps)

    def last_step(self, round_: int) -> int:
        """The newest step any rank trained in ``round_`` (0: none)."""
        return max((s.step for s in self.steps if s.round == round_), default=0)


@dataclass(frozen=True)
class Recovery:
    """One fault and how the job came back from it."""

    what: str
    seconds: float
    """From the fault to the first step trained after it."""
    redone: int
    """Steps trained before the fault and trained again after it."""
    restored: int | None
    """The step the job restarted from; None: it trained on without a restart."""
    faults: int = 1
    """Faults from this one to the next trained step, this one included: a fault during
    the recovery from another extends that recovery."""
    parts: dict[str, float] = field(default_factory=dict)
    """Where the seconds went, for a restart: until the new workers were spawned (detection
    and stopping the old ones), importing, joining the process group, building the DDP
    model, restoring, and the first step."""

    def line(self) -> str:
        how = "no restart" if self.restored is None else f"resumed at {self.restored}"
        more = f", {self.faults - 1} more fault(s) on the way" if self.faults > 1 else ""
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.parts.items())
        return (
            f"{self.what}: fault -> next trained step {self.seconds:.2f} s, "
            f"{self.redone} steps redone ({how}{more})" + (f" [{parts}]" if parts else "")
        )


def recovery(
    events: Events, what: str, at: float, round_: int, done: int | None = None
) -> Recovery:
    """The recovery from a fault at time ``at`` (``time.time()``) in round ``round_``.

    The next trained step is the first one logged after ``at``, in any round; steps
    redone are those of ``round_`` past the step that next round restored. ``done``: the
    step the faulting rank had finished; a slower peer that logs that step (or an earlier
    one) of the same round after ``at`` trained it before the fault, not after.
    """
    after = [
        s
        for s in events.steps
        if s.time > at and not (done is not None and s.round == round_ and s.step <= done)
    ]
    assert after, f"{what}: no step was trained after the fault"
    first = min(after, key=lambda s: s.time)
    faults = 1 + sum(1 for f in events.injected if at < f.time < first.time)
    if first.round == round_:
        return Recovery(what, first.time - at, 0, None, faults)
    restored = events.starts[(first.rank, first.round)]
    redone = max(0, events.last_step(round_) - restored)
    parts = _restart_parts(events, at, first)
    return Recovery(what, first.time - at, redone, restored, faults, parts)


def _restart_parts(events: Events, at: float, first: Step) -> dict[str, float]:
    """The seconds of each phase of the round that trained ``first``, its slowest rank's."""
    ranks = [p for (_, k), p in events.phases.items() if k == first.round]
    names = ("imported", "joined", "built", "restored")
    if not ranks or any(not set(names) <= set(p) for p in ranks):
        return {}
    ends = {name: max(p[name] for p in ranks) for name in names}
    spawned = min(p["spawned"] for p in ranks)
    return {
        "to spawn": spawned - at,
        "import": ends["imported"] - spawned,
        "join": ends["joined"] - ends["imported"],
        "DDP": ends["built"] - ends["joined"],
        "restore": ends["restored"] - ends["built"],
        "first step": first.time - ends["restored"],
    }


def injected_recoveries(events: Events) -> list[Recovery]:
    """The recovery from every fault the job injected in itself, in order."""
    return [
        recovery(events, f"{f.kind} of rank {f.rank} in round {f.round}", f.time, f.round, f.step)
        for f in sorted(events.injected, key=lambda f: f.time)
    ]


class LaunchedJob:
    """``checkflow run --nproc-per-node=2 ... _ddp_job.py``, started by :func:`launch`."""

    def __init__(self, folder: Path, proc: subprocess.Popen[bytes], output: Path) -> None:
        self.folder = folder
        self.proc = proc
        self.output = output

    def events(self) -> Events:
        return Events.read(self.folder)

    def wait_for(self, predicate: Callable[[Events], object], timeout: float, what: str) -> Events:
        """Poll the event logs until ``predicate`` holds; fail (with the logs) if the
        launcher exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            events = self.events()
            if predicate(events):
                return events
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"launcher exited {self.proc.returncode} before {what}\n" + self.tail()
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached in {timeout} s\n" + self.tail())
            time.sleep(0.02)

    def finish(self, timeout: float) -> Events:
        """Wait for the launcher to exit 0; its events, or an error with the logs' tail."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"checkflow run timed out after {timeout} s\n" + self.tail()
            ) from None
        if rc != 0:
            raise AssertionError(f"checkflow run exited {rc}\n" + self.tail())
        return self.events()

    def kill(self) -> None:
        """SIGKILL the launcher and every worker (they share its session)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self, lines: int = 40) -> str:
        logs = "".join(p.read_text() for p in sorted(self.folder.glob("rank-*.log")))
        launcher = self.output.read_text() if self.output.exists() else ""
        return "\n".join(logs.splitlines()[-12:] + launcher.splitlines()[-lines:])


def launch(
    folder: Path,
    *job_args: str,
    launcher_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> LaunchedJob:
    """Start the job under ``checkflow run`` with its event logs in ``folder``.

    Args:
        folder: created if needed; holds ``rank-<r>.log`` and ``launcher.out``.
        job_args: ``_ddp_job.py``'s options (``--dir`` and ``--events`` are given here
            only when missing: ``--events`` is ``folder``).
        launcher_args: ``checkflow run``'s options before the script (coordinator, job,
            ``--max-restarts``...); ``--nproc-per-node=2`` and ``--monitor-interval=0.1``
            are always given.
        env: added to this process's environment.
    """
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "checkflow.cli", "run", "--nproc-per-node=2"]
    cmd += ["--monitor-interval=0.1", *launcher_args, str(JOB), *job_args]
    cmd += ["--events", str(folder)]
    output = folder / "launcher.out"
    with output.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return LaunchedJob(folder, proc, output)
