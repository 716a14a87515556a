"""Stress the exact resume: SIGKILL a training run at random points, resume it, compare bitwise.

Each cycle runs ``_stress_child.py`` (the model and loop of ``examples/train.py``) against a
fresh checkpoint folder, SIGKILLs it at a random point, resumes it from the newest
committed checkpoint, and compares the final parameters, optimizer state, scheduler, data
position and loss bit for bit with an uninterrupted reference run. Kill points, drawn from
``--seed``:

- ``step``     right after a random step;
- ``delay``    a random delay after a checkpoint was requested (lands in the snapshot copy,
               the encode, a write, the commit, retention or later training);
- ``persist``  from inside the persist thread, just before the data file, the rank
               manifest or ``MANIFEST.json`` is written, or just after the commit;
- ``external`` from this process once the child reported a random step, as the first demo
               did: the child runs on until the signal lands, wherever that is.

``--resume-threads N`` resumes with ``OMP_NUM_THREADS=N``: the one change found that
reproduces the inexact resume of issue 8 §5 (the restored state is exact, the arithmetic
after it is not), and the restore then warns (``ResumeNotExactWarning``).

Meanwhile ``--load`` other processes keep every CPU busy. By default the runs talk to a
coordinator (``checkflow serve``), like the README's demo.

    python benchmarks/stress_resume.py [--cycles 50] [--seed 0] [--load 2] [--no-coordinator]

Exit code 0 when every cycle is bitwise equal; 1 on any mismatch or failed check (the
cycle's folder is kept and named).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CHILD = Path(__file__).resolve().parent / "_stress_child.py"
PERSIST_POINTS = ("chunks", "rank", "commit", "retention")
BURN = "import time\nwhile True:\n    sum(range(10000))\n"


@dataclass(slots=True)
class Run:
    """What one child process did: exit code, start step, per-step digests."""

    code: int
    start: int | None
    digests: dict[int, str]
    lines: list[str]
    seconds: float
    restored: str | None = None
    warnings: list[str] = field(default_factory=list)
    """stderr lines of a ``ResumeNotExactWarning`` (the resume cannot be bitwise exact)."""


@dataclass(slots=True)
class Cycle:
    index: int
    kill: str
    killed: Run
    resumed: Run
    observed: str
    equal: bool
    restored_exact: bool
    """The state right after the restore is bitwise the reference's state at that step."""
    lagged: bool
    """The coordinator's restore point was older than the newest commit on storage (the
    kill came between MANIFEST.json and the report of the commit)."""
    problems: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_coordinator(work: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """``checkflow serve`` in its own process (it must not share the training's CPU time)."""
    port = free_port()
    cmd = [sys.executable, "-m", "checkflow.cli", "serve", "--port", str(port)]
    cmd += ["--db", str(work / "coordinator.db"), "--log-level", "error"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/healthz", timeout=1).close()
            return url, proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"checkflow serve exited with {proc.returncode}") from None
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("checkflow serve did not answer /healthz within 60 s")


def run_child(
    args: argparse.Namespace,
    ckpt: Path,
    *extra: str,
    kill_after: int | None = None,
    env: dict[str, str] | None = None,
) -> Run:
    """Run the child to its end; with ``kill_after`` SIGKILL it from here once it reports
    that step (the child runs on meanwhile, as under a real scheduler's kill)."""
    cmd = [sys.executable, str(CHILD), "--dir", str(ckpt), "--steps", str(args.steps)]
    cmd += ["--every", str(args.every), "--codec", args.codec, *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None and proc.stderr is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if kill_after is not None and line.startswith(f"D {kill_after} "):
            proc.kill()
    stderr = proc.stderr.read()
    proc.wait()
    run = Run(proc.returncode, None, {}, lines, time.perf_counter() - t0)
    for line in lines:
        word, *rest = line.split()
        if word == "start":
            run.start, run.restored = int(rest[0]), rest[1]
        elif word == "D":
            run.digests[int(rest[0])] = rest[1]
    if proc.returncode not in (0, -signal.SIGKILL):
        run.lines += ["stderr: " + t for t in stderr.strip().splitlines()[-5:]]
    run.warnings = [t for t in stderr.splitlines() if "ResumeNotExactWarning" in t]
    return run


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def draw_kill(rng: random.Random, args: argparse.Namespace) -> tuple[str, int]:
    """A kill spec for the child and the step it refers to."""
    kind = rng.choice(("step", "delay", "persist", "external"))
    last = args.steps - args.every  # leave the resumed run some steps to take
    if kind in ("step", "external"):
        k = rng.randint(1, last)
        return f"{kind}:{k}", k
    k = args.every * rng.randint(1, last // args.every)
    if kind == "delay":
        return f"delay:{k}:{rng.uniform(0, args.max_delay_ms):.1f}", k
    return f"persist:{k}:{rng.choice(PERSIST_POINTS)}", k


def observe(ckpt: Path) -> tuple[list[int], str]:
    """Committed steps, and what the kill left of the newest uncommitted step folder."""
    committed, partial = [], []
    for folder in sorted(ckpt.glob("step-*")):
        step = int(folder.name[5:])
        if (folder / "MANIFEST.json").exists():
            committed.append(step)
        else:
            partial.append((step, folder))
    newest = max(committed, default=0)
    after = [(s, f) for s, f in partial if s > newest]
    if not after:
        return committed, "nothing in flight"
    files = {p.name for p in after[-1][1].iterdir()}
    if any(".tmp-" in f for f in files):
        return committed, "mid-write (temp file)"
    if any(f.endswith(".json") for f in files):
        return committed, "rank manifest written, not committed"
    if any(f.endswith(".chunks") for f in files):
        return committed, "data written, no rank manifest"
    return committed, "empty step folder"


def first_difference(reference: dict[int, str], run: Run) -> int | None:
    for step in sorted(run.digests):
        if reference.get(step) != run.digests[step]:
            return step
    return None


def check(
    kill: str, kill_step: int, committed: list[int], killed: Run, resumed: Run, coord: bool
) -> tuple[list[str], bool]:
    """What went wrong around the kill and the restore; and whether the coordinator's
    restore point lagged behind storage."""
    problems = []
    if killed.code != -signal.SIGKILL:
        problems.append(f"the killed run exited with {killed.code}, not by SIGKILL")
    if resumed.code != 0:
        problems.append(f"the resumed run failed with exit code {resumed.code}")
    start, newest = resumed.start or 0, max(committed, default=0)
    if start and start not in committed:
        problems.append(f"resumed from step {start}, which was not committed ({committed})")
    if kill.startswith("step:") and start > kill_step:  # an external kill lands later
        problems.append(f"resumed from step {start}, after the kill step {kill_step}")
    if start < newest and not coord:
        problems.append(f"resumed from step {start}, newest committed is {newest}")
    return problems, coord and start < newest


def one_cycle(
    index: int,
    args: argparse.Namespace,
    work: Path,
    ref: Run,
    ref_final: dict[str, Any],
    coord: list[str],
    rng: random.Random,
) -> Cycle:
    kill, kill_step = draw_kill(rng, args)
    ckpt = work / f"cycle-{index:03d}"
    job = ["--job", f"stress-{index}"] if coord else []
    if kill.startswith("external:"):
        killed = run_child(args, ckpt, *coord, *job, kill_after=kill_step)
    else:
        killed = run_child(args, ckpt, "--kill", kill, *coord, *job)
    committed, observed = observe(ckpt)
    if "persist point not reached" in killed.lines:
        observed = "persist point not reached: " + observed
    out = work / f"resumed-{index:03d}.pt"
    threads = {"OMP_NUM_THREADS": str(args.resume_threads)} if args.resume_threads else None
    resumed = run_child(args, ckpt, "--out", str(out), *coord, *job, env=threads)
    problems, lagged = check(kill, kill_step, committed, killed, resumed, bool(coord))
    start = resumed.start or 0
    restored_exact = start == 0 or ref.digests.get(start) == resumed.restored
    same = resumed.code == 0 and equal(ref_final, torch.load(out, weights_only=False))
    if not same:
        problems.append(
            f"MISMATCH: restored state at step {start} "
            f"{'equals' if restored_exact else 'DIFFERS FROM'} the reference; the resumed run "
            f"first differs after step {first_difference(ref.digests, resumed)}, the killed "
            f"run after step {first_difference(ref.digests, killed)}"
        )
    elif not restored_exact:
        problems.append(f"the state restored at step {start} differs from the reference's")
    cycle = Cycle(index, kill, killed, resumed, observed, same, restored_exact, lagged, problems)
    if not problems:
        shutil.rmtree(ckpt, ignore_errors=True)
        out.unlink(missing_ok=True)
    return cycle


def start_load(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes that keep a CPU busy each (pure Python loops)."""
    return [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(n)]


def counts(items: list[str]) -> str:
    return ", ".join(f"{k} {n}" for k, n in collections.Counter(items).most_common())


def kill_step_histogram(cycles: list[Cycle], steps: int) -> str:
    width = max(1, -(-steps // 5))
    bins = collections.Counter(int(c.kill.split(":")[1]) // width for c in cycles)
    return ", ".join(f"{b * width}-{min(steps, (b + 1) * width - 1)}: {bins[b]}" for b in range(5))


def report(cycles: list[Cycle], seconds: float, args: argparse.Namespace) -> None:
    n = len(cycles)
    delays = sorted(float(c.kill.split(":")[2]) for c in cycles if c.kill.startswith("delay"))
    redone = [int(c.kill.split(":")[1]) - (c.resumed.start or 0) for c in cycles]
    child_s = [c.killed.seconds + c.resumed.seconds for c in cycles]
    print(
        f"\n{n} cycles in {seconds:.0f} s ({statistics.median(child_s):.1f} s per cycle, "
        f"median) with {args.load} CPU-burning processes"
    )
    print("kill kinds:      " + counts([c.kill.split(":")[0] for c in cycles]))
    persist = [c.kill.split(":")[2] for c in cycles if c.kill.startswith("persist")]
    print("persist points:  " + counts(persist))
    if delays:
        print(
            f"delays (ms):     min {delays[0]:.0f}, median {statistics.median(delays):.0f}, "
            f"max {delays[-1]:.0f}"
        )
    print("kill steps:      " + kill_step_histogram(cycles, args.steps))
    print("found at kill:   " + counts([c.observed for c in cycles]))
    print(f"steps redone:    median {statistics.median(redone):.0f}, max {max(redone)}")
    print(
        f"restored states equal to the reference's at their step: "
        f"{sum(c.restored_exact for c in cycles)} of {n}"
    )
    if not args.no_coordinator:
        print(
            f"coordinator restore point older than the newest commit on storage: "
            f"{sum(c.lagged for c in cycles)} of {n}"
        )
    warned = sum(bool(c.resumed.warnings) for c in cycles)
    print(f"resumes that warned they cannot be exact: {warned} of {n}")
    print(
        f"bitwise equal:   {sum(c.equal for c in cycles)} of {n}; "
        f"cycles with a failed check: {sum(bool(c.problems) for c in cycles)}"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--codec", default="exact")
    p.add_argument(
        "--load",
        type=int,
        default=os.cpu_count() or 2,
        help="CPU-burning processes running meanwhile (default: one per CPU)",
    )
    p.add_argument(
        "--max-delay-ms",
        type=float,
        default=300.0,
        help="longest delay after a checkpoint request for 'delay' kills",
    )
    p.add_argument("--no-coordinator", action="store_true")
    p.add_argument(
        "--resume-threads",
        type=int,
        default=None,
        help="resume with OMP_NUM_THREADS=N: shows what another thread count does (the "
        "restored state is exact, the arithmetic after it is not, and the restore warns)",
    )
    p.add_argument("--work", default=None, help="work folder (default: a temporary one)")
    args = p.parse_args(argv)
    if args.steps <= args.every:
        p.error("--steps must be larger than --every")
    return args


def reference(args: argparse.Namespace, work: Path) -> tuple[Run, dict[str, Any]] | None:
    """Two uninterrupted runs; the first is the reference, the second proves that training
    itself is deterministic here (else no resume could be bitwise equal)."""
    ref = run_child(args, work / "reference", "--out", str(work / "reference.pt"))
    again = run_child(args, work / "reference-2", "--out", str(work / "reference-2.pt"))
    if ref.code or again.code:
        print(f"reference runs failed: exit {ref.code}, {again.code}", *ref.lines[-5:], sep="\n")
        return None
    ref_final = torch.load(work / "reference.pt", weights_only=False)
    if not equal(ref_final, torch.load(work / "reference-2.pt", weights_only=False)):
        print(
            "two uninterrupted runs differ: training itself is not deterministic here "
            f"(first difference after step {first_difference(ref.digests, again)})"
        )
        return None
    print(
        f"reference: {args.steps} steps, every {args.every}, {ref.seconds:.1f} s; a second "
        "uninterrupted run is bitwise equal",
        flush=True,
    )
    return ref, ref_final


def run_cycles(args: argparse.Namespace, work: Path, coord: list[str]) -> list[Cycle] | None:
    references = reference(args, work)
    if references is None:
        return None
    ref, ref_final = references
    rng = random.Random(args.seed)
    cycles = []
    for i in range(args.cycles):
        c = one_cycle(i, args, work, ref, ref_final, coord, rng)
        cycles.append(c)
        status = "equal" if c.equal else "DIFFERENT"
        print(
            f"{i:3d} kill {c.kill:<22} {c.observed:<38} resumed at {c.resumed.start}: "
            f"{status}" + "".join(f"\n      {p}" for p in c.problems),
            flush=True,
        )
    return cycles


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="checkflow-stress-"))
    work.mkdir(parents=True, exist_ok=True)
    load = start_load(args.load)
    server = None
    try:
        coord: list[str] = []
        if not args.no_coordinator:
            url, server = start_coordinator(work)
            coord = ["--coordinator", url]
        t0 = time.perf_counter()
        cycles = run_cycles(args, work, coord)
        if cycles is not None:
            report(cycles, time.perf_counter() - t0, args)
    finally:
        for proc in [*load, *([server] if server else [])]:
            proc.kill()
            proc.wait()
    if cycles is None or any(c.problems for c in cycles):
        print(f"kept the work folder {work}")
        return 1
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
