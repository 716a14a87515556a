"""Recovery from a crash, a freeze and a hang, under ``checkflow run`` and plain ``torchrun``.

The same 2-rank gloo DDP job (``_recovery_job.py``: 20 steps of about 0.3 s, a checkpoint
every 5) and the same fault, injected by rank 1 right after step 13 of the first round,
under three setups:

- ``checkflow-run``: ``checkflow run`` + ``Checkpointer`` reporting to a coordinator;
- ``torchrun+checkflow``: plain ``torchrun`` + the same ``Checkpointer`` and coordinator;
- ``checkflow-run+ram``: ``checkflow run --ram-tier``: each checkpoint also in node memory
  (``/dev/shm``), and the restart restores from there (issue 11);
- ``checkflow-run+ram1``: the same with ``ram_every=1``: a RAM-tier checkpoint every step
  (storage keeps ``--every``), so the restart resumes at the fault's step;
- ``checkflow-run+jit``: ``--ram-tier`` with ``Checkpointer(jit=True)``: the survivor of a
  crash writes the step it is at to the RAM tier before it exits, and the restart resumes
  there (at most one step redone; issue 11);
- ``torchrun+dcp``: plain ``torchrun`` + DCP ``async_save`` / ``load``, no coordinator.
  Its only detector of a freeze or a hang is the process group's timeout, set to the same
  ``--timeout`` as checkflow's hang timeout (torch's default, 30 min, would never recover
  within the deadline).

The coordinator is a real ``checkflow serve`` on 127.0.0.1, started here and stopped at
the end (one job per try). Both launchers run with ``--standalone --nproc-per-node=2
--max-restarts=3`` and torch's defaults otherwise (no ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``
unless ``--fresh-store``). Faults: ``crash`` (SIGKILL), ``freeze`` (SIGSTOP), ``hang`` (a
Python busy loop while the other rank waits in ``all_reduce``).

Per try, from the timestamps the ranks write: **recovered** = both ranks reached the last
step with the final parameters and momentum bitwise equal to an uninterrupted run's, within
``--deadline`` seconds of the fault; **recovery** = fault → first step trained after it;
**redone** = the fault's step − the step the final round resumed from. The target's
**restart** is the job's cold start in the same try (first round: first worker process
created → every rank joined the process group and opened its checkpointer, i.e. ready to
restore); **restore** is the restarted round's restore call (slowest rank). Targets (issue
10): every try recovered; crash ≤ restart + restore + 3 s; freeze and hang ≤ timeout +
restart + restore + 3 s; redone ≤ one checkpoint interval.

    .venv/bin/python benchmarks/recovery.py --tries 1                    # smoke run
    .venv/bin/python benchmarks/recovery.py                              # 10 tries each
    .venv/bin/python benchmarks/recovery.py --faults crash --setups checkflow-run,torchrun+dcp
    .venv/bin/python benchmarks/recovery.py --report results.json        # table of a (partial) run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import contextlib

from coordinator import TOKEN, free_port, start_server  # noqa: E402  (benchmarks/ is not a package)

JOB = Path(__file__).resolve().parent / "_recovery_job.py"
FAULTS = ("crash", "freeze", "hang")
SETUPS = {
    # name: (launcher, checkpointing, coordinator)
    "checkflow-run": ("checkflow", "checkflow", True),
    "checkflow-run+ram": ("checkflow", "checkflow", True),
    "checkflow-run+ram1": ("checkflow", "checkflow", True),
    "checkflow-run+jit": ("checkflow", "checkflow", True),
    "torchrun+checkflow": ("torchrun", "checkflow", True),
    "torchrun+dcp": ("torchrun", "dcp", False),
}
RAM_TIER = {
    # setup: (options of checkflow run, options of the job)
    "checkflow-run+ram": (["--ram-tier"], []),
    "checkflow-run+ram1": (["--ram-tier"], ["--ram-every", "1"]),
    "checkflow-run+jit": (["--ram-tier"], ["--jit"]),
}
"""The RAM-tier setups (issue 11): what they add to ``checkflow-run``."""
REDONE_TARGET = {"checkflow-run+jit": 1}
"""Steps a setup may redo, where not one checkpoint interval (JIT: issue 11's <= 1)."""
MARGIN_S = 3.0
"""What the targets allow on top of restart + restore (+ timeout): detection of a crash, the
launcher's reaction and the first step."""


@dataclass(frozen=True)
class Event:
    kind: str
    rank: int
    round: int
    value: str
    t: float


@dataclass
class Try:
    setup: str
    fault: str
    index: int
    recovered: bool = False
    why: str = ""
    recovery_s: float | None = None
    redone: int | None = None
    rounds: int = 0
    restart_s: float | None = None
    restore_s: float | None = None
    target_s: float | None = None
    timeline: dict[str, float] = field(default_factory=dict)
    """Fault → new workers created (detection + launcher) → torch imported → process group
    joined → DDP model built → checkpointer open → restored → first step, each from the
    one before."""
    seconds: float = 0.0


# --- running one try ----------------------------------------------------------------------
def launcher_cmd(setup: str, job_args: list[str], coord: dict[str, str]) -> list[str]:
    launcher, _, with_coordinator = SETUPS[setup]
    common = ["--standalone", "--nproc-per-node=2", "--max-restarts=3"]
    if launcher == "checkflow":
        cmd = [sys.executable, "-m", "checkflow.cli", "run", *common]
        cmd += RAM_TIER.get(setup, ([], []))[0]
        if with_coordinator:
            cmd += ["--coordinator", coord["url"], "--job", coord["job"], "--token", TOKEN]
        return [*cmd, str(JOB), *job_args]
    cmd = [sys.executable, "-m", "torch.distributed.run", *common, str(JOB), *job_args]
    if with_coordinator:
        cmd += ["--coordinator", coord["url"], "--job", coord["job"], "--token", TOKEN]
    return cmd


def job_args(setup: str, fault: str, folder: Path, args: argparse.Namespace) -> list[str]:
    ckpt = SETUPS[setup][1]
    out = ["--ckpt", ckpt, "--dir", str(folder / "ckpt"), "--events", str(folder / "events")]
    out += ["--steps", str(args.steps), "--every", str(args.every), "--fault", fault]
    out += ["--fault-at", str(args.fault_at), "--step-time", str(args.step_time)]
    out += RAM_TIER.get(setup, ([], []))[1]
    if ckpt == "dcp":
        out += ["--pg-timeout", str(args.timeout)]
    elif ckpt == "checkflow":
        out += ["--hang-timeout", str(args.timeout)]
    return out


def read_events(folder: Path) -> list[Event]:
    events = []
    for path in sorted(folder.glob("rank-*.log")):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:  # a line being written is skipped until it is whole
                kind, rank, rnd, value, t = parts
                events.append(Event(kind, int(rank), int(rnd), value, float(t)))
    return events


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (the launcher's workers are in sessions of their
    own, so a process-group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def stop(proc: subprocess.Popen[bytes], events: list[Event]) -> None:
    """SIGKILL what is left of the try: the launcher, its workers, and workers it orphaned
    (SIGKILL also ends a SIGSTOPped process)."""
    pids = set(process_tree(proc.pid))
    for e in events:
        cmdline = Path(f"/proc/{e.value}/cmdline")
        if (
            e.kind == "exec"
            and cmdline.exists()
            and JOB.name in cmdline.read_text(errors="replace")
        ):
            pids.add(int(e.value))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def watch(proc: subprocess.Popen[bytes], events_dir: Path, args: argparse.Namespace) -> str:
    """Wait until both ranks wrote ``final``, the launcher exited, or the deadline passed."""
    started = time.time()
    while True:
        events = read_events(events_dir)
        if len({e.rank for e in events if e.kind == "final"}) == 2:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                return "finished, launcher did not exit"
            return "finished"
        if proc.poll() is not None:
            return f"launcher exited {proc.returncode}"
        fault = next((e for e in events if e.kind == "fault"), None)
        limit = fault.t + args.deadline if fault else started + args.deadline + 60
        if time.time() > limit:
            return "deadline passed"
        time.sleep(0.25)


def run_try(
    setup: str, fault: str, index: int, args: argparse.Namespace, url: str, reference: str
) -> Try:
    folder = Path(args.work) / f"{index:02d}-{setup}-{fault}"
    (folder / "events").mkdir(parents=True)
    coord = {"url": url, "job": f"recovery-{index}-{fault}-{uuid.uuid4().hex[:8]}"}
    cmd = launcher_cmd(setup, job_args(setup, fault, folder, args), coord)
    env = dict(os.environ)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if args.fresh_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    started = time.time()
    with open(folder / "launcher.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ending = watch(proc, folder / "events", args)
        finally:  # Ctrl-C included: no worker of this try outlives it
            stop(proc, read_events(folder / "events"))
    result = analyse(setup, fault, index, read_events(folder / "events"), reference, args)
    result.seconds = time.time() - started
    if not result.recovered:
        result.why = f"{result.why} ({ending}; logs in {folder})"
    elif not args.keep:
        shutil.rmtree(folder)
    return result


# --- reading a try --------------------------------------------------------------------------
def analyse(
    setup: str,
    fault: str,
    index: int,
    events: list[Event],
    reference: str,
    args: argparse.Namespace,
) -> Try:
    res = Try(setup, fault, index, rounds=len({e.round for e in events}))
    hit = next((e for e in events if e.kind == "fault"), None)
    if hit is None:
        res.why = "the fault was never injected"
        return res
    res.restart_s = cold_start(events)
    later = [e for e in events if e.round > hit.round]
    trained = [e.t for e in later if e.kind == "step" and e.t > hit.t]
    if trained:
        res.recovery_s = min(trained) - hit.t
    last = max((e.round for e in later if e.kind == "start"), default=None)
    if last is not None:
        res.redone = int(hit.value) - max(
            int(e.value) for e in later if e.kind == "start" and e.round == last
        )
        res.restore_s = restore_time(events, last)
        res.timeline = timeline(events, hit, last)
    budget = args.timeout if fault in ("freeze", "hang") else 0.0
    if res.restart_s is not None and res.restore_s is not None:
        res.target_s = budget + res.restart_s + res.restore_s + MARGIN_S
    finals = {e.rank: e for e in events if e.kind == "final"}
    if len(finals) < 2:
        res.why = "did not reach the last step" if trained else "never trained again"
    elif any(e.value != reference for e in finals.values()):
        res.why = "final state differs from the uninterrupted run"
    elif max(e.t for e in finals.values()) > hit.t + args.deadline:
        res.why = "finished after the deadline"
    else:
        res.recovered = True
    return res


def cold_start(events: list[Event]) -> float | None:
    """First round: first worker created → the last rank ready to restore."""
    execs = [e.t for e in events if e.kind == "exec" and e.round == 0]
    ready = [e.t for e in events if e.kind == "ready" and e.round == 0]
    return max(ready) - min(execs) if execs and len(ready) == 2 else None


def restore_time(events: list[Event], rnd: int) -> float | None:
    """The slowest rank's restore call in round ``rnd``."""
    ready = {e.rank: e.t for e in events if e.kind == "ready" and e.round == rnd}
    start = {e.rank: e.t for e in events if e.kind == "start" and e.round == rnd}
    spans = [start[r] - ready[r] for r in start if r in ready]
    return max(spans) if spans else None


def timeline(events: list[Event], hit: Event, rnd: int) -> dict[str, float]:
    def first(kind: str) -> float | None:
        ts = [e.t for e in events if e.kind == kind and e.round == rnd and e.t > hit.t]
        return min(ts) if ts else None

    def last(kind: str) -> float | None:
        ts = [e.t for e in events if e.kind == kind and e.round == rnd]
        return max(ts) if ts else None

    points = [("relaunch", first("exec")), ("import", last("imported"))]
    points += [("join", last("joined")), ("build", last("built")), ("open", last("ready"))]
    points.append(("restore", last("start")))
    points.append(("first step", first("step")))
    out, before = {}, hit.t
    for name, t in points:
        if t is None:
            break
        out[name] = round(t - before, 2)
        before = t
    return out


# --- the report -----------------------------------------------------------------------------
def summarise(tries: list[Try], every: int, timeout: float) -> list[dict[str, Any]]:
    rows = []
    for fault in FAULTS:
        for setup in SETUPS:
            cell = [t for t in tries if t.fault == fault and t.setup == setup]
            if not cell:
                continue
            times = [t.recovery_s for t in cell if t.recovered and t.recovery_s is not None]
            redone = [t.redone for t in cell if t.recovered and t.redone is not None]
            within = [
                t
                for t in cell
                if t.recovered and t.target_s is not None and t.recovery_s <= t.target_s
            ]
            rows.append(
                {
                    "fault": fault,
                    "setup": setup,
                    "tries": len(cell),
                    "recovered": sum(t.recovered for t in cell),
                    "median_s": statistics.median(times) if times else None,
                    "worst_s": max(times) if times else None,
                    "within_target": len(within),
                    "added_within": sum(added_within(t, timeout) for t in cell),
                    "target_median_s": median_of([t.target_s for t in cell]),
                    "relaunch_median_s": median_of([t.timeline.get("relaunch") for t in cell]),
                    "restart_median_s": median_of([t.restart_s for t in cell]),
                    "restore_median_s": median_of([t.restore_s for t in cell]),
                    "redone_median": statistics.median(redone) if redone else None,
                    "redone_max": max(redone) if redone else None,
                    "every": every,
                    "failures": [t.why for t in cell if not t.recovered],
                }
            )
    return rows


def added_within(t: Try, timeout: float) -> bool:
    """Did what a restart adds to a cold start (fault → new workers created, plus the first
    step) stay within the detection budget + the margin? Unlike the target, this does not
    depend on how long the restarted workers' imports took on a loaded machine."""
    budget = timeout if t.fault in ("freeze", "hang") else 0.0
    added = t.timeline.get("relaunch", math.inf) + t.timeline.get("first step", math.inf)
    return t.recovered and added <= budget + MARGIN_S


def median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def fmt(v: float | None, unit: str = " s") -> str:
    """Seconds with one decimal; a count (``unit=""``) as it is."""
    if v is None:
        return "-"
    return f"{v:.1f}{unit}" if unit else f"{v:g}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ["fault", "setup", "recovered", "fault → training (median / worst)", "target (median)"]
    head += ["within target", "fault → new workers (median)", "restart / restore (median)"]
    head += ["steps redone (median / max)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["fault"], r["setup"], f"{r['recovered']}/{r['tries']}"]
        cells += [f"{fmt(r['median_s'])} / {fmt(r['worst_s'])}", fmt(r["target_median_s"])]
        cells += [f"{r['within_target']}/{r['tries']}", fmt(r["relaunch_median_s"])]
        cells += [f"{fmt(r['restart_median_s'])} / {fmt(r['restore_median_s'])}"]
        cells += [f"{fmt(r['redone_median'], '')} / {fmt(r['redone_max'], '')}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(rows: list[dict[str, Any]], timeout: float) -> list[str]:
    out = []
    for r in rows:
        name, n, every = f"{r['fault']} {r['setup']}:", r["tries"], r["every"]
        all_ok = r["recovered"] == n
        out.append(f"{mark(all_ok)} recovered {name} {r['recovered']}/{n} (target {n}/{n})")
        budget = "" if r["fault"] == "crash" else f"timeout {timeout:g} s + "
        out.append(
            f"{mark(r['within_target'] == n)} time {name} {r['within_target']}/{n} within "
            f"{budget}restart + restore + {MARGIN_S:g} s (median target "
            f"{fmt(r['target_median_s'])}; median {fmt(r['median_s'])}, worst {fmt(r['worst_s'])})"
        )
        out.append(
            f"{mark(r['added_within'] == n)} added {name} {r['added_within']}/{n} with fault → "
            f"new workers + first step within {budget}{MARGIN_S:g} s (median fault → new workers "
            f"{fmt(r['relaunch_median_s'])})"
        )
        limit = REDONE_TARGET.get(r["setup"], every)
        redone_ok = all_ok and r["redone_max"] is not None and r["redone_max"] <= limit
        out.append(
            f"{mark(redone_ok)} redone {name} max {fmt(r['redone_max'], '')} steps of the "
            f"recovered tries (target <= {limit}, every try recovered)"
        )
    return out


def mark(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(tries: list[Try], meta: dict[str, Any]) -> None:
    rows = summarise(tries, meta["every"], meta["timeout"])
    print(table(rows))
    print()
    print("\n".join(verdicts(rows, meta["timeout"])))
    for r in rows:
        for why in r["failures"]:
            print(f"failed: {r['fault']} {r['setup']}: {why}")
    print()
    print(json.dumps({"meta": meta, "rows": rows}, indent=1))


# --- main -----------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tries", type=int, default=10, help="per fault and setup")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5, help="checkpoint interval (steps)")
    p.add_argument("--fault-at", type=int, default=13, help="the fault comes after this step")
    p.add_argument("--step-time", type=float, default=0.3, help="seconds per step (paced)")
    p.add_argument("--timeout", type=float, default=10.0, help="hang timeout = DCP's PG timeout")
    p.add_argument("--deadline", type=float, default=90.0, help="seconds from the fault")
    p.add_argument(
        "--fresh-store", action="store_true", help="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    )
    p.add_argument("--work", default=None, help="folder of the tries (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the folders of recovered tries")
    p.add_argument("--out", default=None, help="JSON of every try, rewritten after each")
    p.add_argument("--report", default=None, metavar="JSON", help="print the table of --out")
    args = p.parse_args(argv)
    args.faults = args.faults.split(",")
    args.setups = args.setups.split(",")
    unknown = set(args.faults) - set(FAULTS) | set(args.setups) - set(SETUPS)
    if unknown:
        p.error(f"unknown fault or setup {sorted(unknown)}: faults {FAULTS}, setups {list(SETUPS)}")
    return args


def reference_digest(args: argparse.Namespace) -> str:
    """The final state of an uninterrupted run (plain torchrun, no checkpoints)."""
    folder = Path(args.work) / "reference"
    (folder / "events").mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(JOB), "--ckpt", "none", "--dir", str(folder / "ckpt")]
    cmd += ["--events", str(folder / "events"), "--steps", str(args.steps)]
    cmd += ["--step-time", str(args.step_time)]
    subprocess.run(
        cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300
    )
    finals = {e.value for e in read_events(folder / "events") if e.kind == "final"}
    if len(finals) != 1:
        raise RuntimeError(f"the uninterrupted ranks disagree on their final state: {finals}")
    return finals.pop()


def commit() -> str:
    """The checkout measured (``git describe``; ``-dirty`` when it has uncommitted changes)."""
    git = ["git", "-C", str(JOB.parent), "describe", "--always", "--dirty"]
    return subprocess.run(git, capture_output=True, text=True).stdout.strip() or "unknown"


def has_hang_timeout() -> bool:
    import inspect

    from checkflow import Checkpointer

    return "hang_timeout" in inspect.signature(Checkpointer).parameters


def plan(args: argparse.Namespace) -> list[tuple[int, str, str]]:
    """Every try, interleaved: each round runs every fault under every setup, the setups in
    an order rotated per round (the machine is shared and its load drifts)."""
    out = []
    for i in range(args.tries):
        shift = i % len(args.setups)
        order = args.setups[shift:] + args.setups[:shift]
        out += [(i, fault, setup) for fault in args.faults for setup in order]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    meta = {k: getattr(args, k) for k in ("every", "timeout", "steps", "fault_at", "step_time")}
    meta.update(deadline=args.deadline, fresh_store=args.fresh_store, margin_s=MARGIN_S)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report([Try(**t) for t in saved["tries"]], {**saved["meta"]})
        return 0
    meta.update(commit=commit(), hang_timeout_supported=has_hang_timeout())
    if not meta["hang_timeout_supported"]:
        print("note: this Checkpointer has no hang_timeout: no hang detection in this build")
    args.work = args.work or tempfile.mkdtemp(prefix="checkflow-recovery-")
    out = Path(args.out or Path(args.work) / "results.json")
    reference = reference_digest(args)
    port = free_port()
    server = start_server(Path(args.work) / "coordinator.db", port)
    tries: list[Try] = []
    meta["started"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    try:
        for i, fault, setup in plan(args):
            res = run_try(setup, fault, i, args, f"http://127.0.0.1:{port}", reference)
            tries.append(res)
            state = "recovered" if res.recovered else f"FAILED: {res.why}"
            print(
                f"try {i + 1} {fault:6s} {setup:18s} {state}; fault → training "
                f"{fmt(res.recovery_s)} (target {fmt(res.target_s)}), redone {res.redone}, "
                f"rounds {res.rounds}, {res.timeline} ({res.seconds:.0f} s)",
                flush=True,
            )
            meta["ended"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            out.write_text(json.dumps({"meta": meta, "tries": [asdict(t) for t in tries]}))
    finally:
        server.terminate()
        server.wait(10)
    print(f"\nresults: {out}\n")
    report(tries, meta)
    return 0 if all(t.recovered for t in tries) else 1


if __name__ == "__main__":
    sys.exit(main())
