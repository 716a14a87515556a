"""What checkpointing every K steps costs a CPU training loop: checkflow against its peers.

One process, one run, the same model, data and step count for every strategy: no
checkpoints, ``torch.save`` + fsync, ``dcp.save``, ``dcp.async_save`` (thread), DCP
``async_save`` with ``DefaultStager`` async staging, checkflow (one run per codec) and
checkflow ``every="auto"``. Prints overhead, blocking stall, bytes, checkpoints taken of
those due and restore time side by side, then PASS/MISS against the targets.

Every strategy must take every due checkpoint: the table shows taken/due, and a row that
took fewer is marked UNEQUAL and never counts as a PASS (comparing unequal work is
meaningless). With ``--repeats R`` the whole plan runs R times, each time in a rotated
order (interleaved, so slow phases of a shared machine hit every strategy), and the
report gives medians with their spread (min..max over the repeats).

    python benchmarks/overhead.py                 # full run (~10 min on 2 cores)
    python benchmarks/overhead.py --repeats 5     # medians of 5 interleaved repeats
    python benchmarks/overhead.py --quick         # smoke run (~1 min)
    python benchmarks/overhead.py --strategies none,dcp.async-staged,checkflow-q8 --k 5
    python benchmarks/overhead.py --device cuda --params-mib 700 --hidden 4096 --batch 4096

With ``--device cuda`` the model, optimizer and batches live on the GPU, every timed step
ends with ``torch.cuda.synchronize()`` (so a step's time includes the kernels it queued and
any wait a checkpoint added), DCP's async staging copies into pinned memory with
non-blocking copies, and the copy reference is the pinned-copy limit: one non-blocking
device-to-host copy of the whole state into pinned buffers allocated beforehand.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402  (benchmarks/ is not a package)
    dir_bytes,
    fmt_bytes,
    fmt_s,
    median,
    median_time,
    pinned_copy_s,
    plain_copy_s,
    state_tensors,
    table,
    timed,
)

DEFAULT_STRATEGIES = (
    "none,torch.save,dcp.save,dcp.async,dcp.async-staged,checkflow-exact,checkflow-zstd,"
    "checkflow-auto"
)
DCP = ("dcp.save", "dcp.async", "dcp.async-staged")


# -- the workload ----------------------------------------------------------------------------
def build(
    hidden: int, layers: int, seed: int = 0, device: str = "cpu"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    model = nn.Sequential(*mods).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)


def layers_for(params_mib: float, hidden: int) -> int:
    per_layer = (hidden * hidden + hidden) * 4
    return max(1, round(params_mib * 2**20 / per_layer))


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    before_opt_step: Any = None,
) -> None:
    x, y = batch
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if before_opt_step is not None:
        before_opt_step()
    opt.step()
    opt.zero_grad(set_to_none=True)


# -- CPU accounting --------------------------------------------------------------------------
def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every live thread of this process, by thread id, with
    its name: what the background threads of a strategy burn (copy, encode, checksum,
    write, fsync), from ``/proc/self/task/<tid>/stat`` (Linux; empty elsewhere)."""
    out: dict[int, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    # The OS names every Python thread "python": take the names Python gave them.
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name = names.get(int(tid)) or stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


@dataclass
class CpuSample:
    """Process and training-thread CPU clocks, and every thread's, at one moment."""

    process: float
    main: float
    threads: dict[int, tuple[str, float]]

    @classmethod
    def now(cls) -> CpuSample:
        # time.process_time counts every thread, ended ones too; thread_time only the caller.
        return cls(time.process_time(), time.thread_time(), thread_cpu())


@dataclass
class CpuUse:
    """CPU seconds spent between two samples taken on the training thread."""

    process: float
    """Every thread of the process (ended threads included)."""
    main: float
    """The training thread alone (its own checkpoint calls included)."""
    by_thread: dict[str, float]
    """Per thread name, threads other than the training thread (best effort: a thread that
    started and ended between the samples is only in ``process``)."""

    @property
    def background(self) -> float:
        """What threads other than the training thread burned: the strategy's background
        work (copy, encode, checksum, write, fsync, retention)."""
        return self.process - self.main

    @classmethod
    def between(cls, a: CpuSample, b: CpuSample) -> CpuUse:
        main_tid = threading.get_native_id()
        by: dict[str, float] = {}
        for tid, (name, cpu) in b.threads.items():
            if tid == main_tid:
                continue
            spent = cpu - a.threads.get(tid, (name, 0.0))[1]
            if spent > 0:
                # Numbered pool threads (checkflow-copy_0, ...) count under one name.
                key = name.rstrip("0123456789").rstrip("_-") or name
                by[key] = by.get(key, 0.0) + spent
        return cls(b.process - a.process, b.main - a.main, by)


# -- strategies ------------------------------------------------------------------------------
class Strategy:
    """One way of checkpointing. The runner calls, in order: ``open``, ``warm`` (one untimed
    checkpoint, waited for, so buffers and caches exist), then per timed step
    ``before_opt_step`` and ``after_step``, then ``drain`` (timed: waits for what is in
    flight), ``restore`` and ``close``."""

    def __init__(self, name: str, k: int | None, root: str) -> None:
        self.name, self.k, self.root = name, k, root
        self.stalls: list[float] = []
        self.due = 0
        self.taken = 0
        self.waits = 0
        self.ckpt_bytes: list[int] = []
        self.interval: int | None = k
        self.model: nn.Module | None = None
        self.opt: torch.optim.Optimizer | None = None

    def open(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def warm(self) -> None:
        pass

    def steps(self, args: argparse.Namespace) -> int:
        """Timed steps for this strategy."""
        return int(args.steps)

    def before_opt_step(self) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def drain(self) -> None:
        pass

    def restore_once(self) -> None:
        # Only strategies with restorable=True are asked to restore.
        raise RuntimeError(f"{type(self).__name__} does not restore")

    def close(self) -> None:
        pass

    @property
    def restorable(self) -> bool:
        return False

    # helpers for the baselines, which write one folder/file per checkpoint
    def _due(self, step: int) -> bool:
        due = self.k is not None and step % self.k == 0
        self.due += due
        return due

    def _path(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step:09d}")

    def _state_dict(self) -> dict[str, Any]:
        assert self.model is not None and self.opt is not None
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def _load(self, sd: dict[str, Any]) -> None:
        assert self.model is not None and self.opt is not None
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])

    def _retire_older_than(self, keep: str) -> None:
        """Delete the checkpoints before ``keep`` (baselines keep only the newest)."""
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith("step-") and path < keep:
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


class NoCheckpoint(Strategy):
    pass


class TorchSave(Strategy):
    """``torch.save`` of model + optimizer state dicts, fsynced: blocks for the whole write."""

    latest: str | None = None

    def _save(self, step: int) -> None:
        path = self._path(step) + ".pt"
        with open(path, "wb") as f:
            torch.save(self._state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        self.latest = path
        self._retire_older_than(path)

    def warm(self) -> None:
        self._save(0)

    def after_step(self, step: int) -> None:
        if self._due(step):
            self.stalls.append(timed(lambda: self._save(step)))
            self.taken += 1
            assert self.latest is not None
            self.ckpt_bytes.append(os.path.getsize(self.latest))

    @property
    def restorable(self) -> bool:
        return self.latest is not None

    def restore_once(self) -> None:
        assert self.latest is not None
        self._load(torch.load(self.latest))


class DcpSave(Strategy):
    """``torch.distributed.checkpoint.save`` (FileSystemWriter, fsync on), no process group."""

    latest: str | None = None

    def _save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        path = self._path(step)
        dcp.save(self._state_dict(), checkpoint_id=path, no_dist=True)
        self.latest = path
        self._retire_older_than(path)

    def warm(self) -> None:
        self._save(0)

    def after_step(self, step: int) -> None:
        if self._due(step):
            self.stalls.append(timed(lambda: self._save(step)))
            self.taken += 1
            assert self.latest is not None
            self.ckpt_bytes.append(dir_bytes(self.latest))

    @property
    def restorable(self) -> bool:
        return self.latest is not None

    def restore_once(self) -> None:
        import torch.distributed.checkpoint as dcp

        assert self.latest is not None
        # DCP loads in place into the state dict it is given, then the objects take it.
        sd = self._state_dict()
        dcp.load(sd, checkpoint_id=self.latest, no_dist=True)
        self._load(sd)


class DcpAsync(DcpSave):
    """``dcp.async_save`` on a thread. As torchtitan does, a new save first waits for the
    previous upload; that wait, the staging copy and the planning are the stall. With
    ``staged``, a reused ``DefaultStager`` copies on its own thread and the next
    ``opt.step`` waits for that copy (``staging_completion``), like checkflow's hook."""

    def __init__(
        self, name: str, k: int | None, root: str, *, staged: bool, cuda: bool = False
    ) -> None:
        super().__init__(name, k, root)
        self.staged, self.cuda = staged, cuda
        self.stager: Any = None
        self.upload: Any = None
        self.staging: Any = None
        self.in_flight: str | None = None

    def open(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        super().open(model, opt)
        if self.staged:
            self.stager = self._new_stager()

    def _new_stager(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # On the CPU: no pinned memory, no non-blocking copies (they need CUDA). On a GPU:
        # DCP's fastest staging, pinned buffers filled by non-blocking copies. No shared
        # memory: that is for a separate upload process, not used here.
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=self.cuda,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=self.cuda,
            )
        )

    @property
    def reuses_stager(self) -> bool:
        """Whether one stager (and its cached pinned buffers) serves every save. On a GPU
        with torch older than 2.13 it cannot: torch 2.11's stager failed its second pinned,
        non-blocking stage with ``KeyError: <class 'type'>`` (seen on an H200), so there
        each save gets a new stager, as a user of that torch would have to do."""
        return not self.cuda or torch_version() >= (2, 13)

    def _finish_previous(self) -> None:
        if self.upload is not None:
            self.upload.result()
            self.upload = None
            assert self.in_flight is not None
            self.latest = self.in_flight
            self.ckpt_bytes.append(dir_bytes(self.latest))
            self._retire_older_than(self.latest)

    def _save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        self._finish_previous()
        if self.staged and not self.reuses_stager:
            self.stager.close()
            self.stager = self._new_stager()
        path = self._path(step)
        out = dcp.async_save(
            self._state_dict(), checkpoint_id=path, async_stager=self.stager, no_dist=True
        )
        self.in_flight = path
        if self.staged:
            self.staging, self.upload = out.staging_completion, out.upload_completion
        else:
            self.upload = out

    def warm(self) -> None:
        self._save(0)
        self.drain()
        self.ckpt_bytes.clear()

    def after_step(self, step: int) -> None:
        if self._due(step):
            self.stalls.append(timed(lambda: self._save(step)))
            self.taken += 1

    def before_opt_step(self) -> None:
        if self.staging is not None:
            self.stalls[-1] += timed(self.staging.result)
            self.staging = None

    def drain(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        self._finish_previous()

    def close(self) -> None:
        self.drain()
        if self.stager is not None:
            self.stager.close()


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


class Checkflow(Strategy):
    """checkflow's ``Checkpointer`` with one codec for every tensor; ``k=None`` is "auto"."""

    def __init__(
        self, name: str, k: int | None, root: str, *, codec: str, max_overhead: float
    ) -> None:
        super().__init__(name, k, root)
        self.codec = codec
        self.max_overhead = max_overhead
        self.ckpt: Any = None
        self._base = (0, 0, 0, 0, 0, 0)
        self.changes: IntervalLog | None = None
        self.persist_nice: int | None = None
        """CHECKFLOW_PERSIST_NICE for this run (None: the default)."""
        self._saved_nice: str | None = None

    def _checkpointer(self, every: int | str) -> Any:
        from checkflow import Checkpointer

        assert self.model is not None and self.opt is not None
        return Checkpointer(
            self.root,
            {"model": self.model, "optim": self.opt},
            every=every,
            max_overhead=self.max_overhead,
            codec=self.codec,
            rng=False,  # the baselines do not save RNG states either
        )

    def open(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        super().open(model, opt)
        if self.k is None:
            self.changes = IntervalLog()
            self.changes.attach()
        if self.persist_nice is not None:
            # Read by the persist thread when it starts: set for the whole run.
            self._saved_nice = os.environ.get("CHECKFLOW_PERSIST_NICE")
            os.environ["CHECKFLOW_PERSIST_NICE"] = str(self.persist_nice)
        self.ckpt = self._checkpointer(self.k if self.k is not None else "auto")
        self.ckpt.open()

    def warm(self) -> None:
        if self.k is not None:
            self.ckpt.save().result()
        # every="auto" starts cold, as in a real job: its first checkpoints measure what a
        # checkpoint costs, and their cost counts (an untimed warm one would feed the tuner a
        # checkpoint whose persist ran while training was not).
        s = self.ckpt.stats
        self._base = (s.due, s.taken, s.waits, len(s.stalls_s), s.bytes_written, s.committed)

    def steps(self, args: argparse.Namespace) -> int:
        return int(args.auto_steps) if self.k is None else int(args.steps)

    def after_step(self, step: int) -> None:
        self.ckpt.step()

    def drain(self) -> None:
        self.ckpt.wait()
        s = self.ckpt.stats
        due, taken, waits, nstalls, nbytes, committed = self._base
        self.due = s.due - due
        self.taken = s.taken - taken
        self.waits = s.waits - waits
        self.stalls = list(s.stalls_s[nstalls:])
        self.interval = s.interval
        if s.committed > committed:
            per = (s.bytes_written - nbytes) / (s.committed - committed)
            self.ckpt_bytes = [int(per)]

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        if self.changes is not None:
            self.changes.detach()
        if self.persist_nice is not None:
            if self._saved_nice is None:
                os.environ.pop("CHECKFLOW_PERSIST_NICE", None)
            else:
                os.environ["CHECKFLOW_PERSIST_NICE"] = self._saved_nice

    @property
    def restorable(self) -> bool:
        return self.taken > 0

    def restore_once(self) -> None:
        ckpt = self._checkpointer(1)
        try:
            ckpt.restore()
        finally:
            ckpt.close()


class IntervalLog(logging.Handler):
    """Collects the interval changes ``every="auto"`` logs ("checkpoint interval now N
    steps ..."), with the step count at each, for the report."""

    LOGGER = "checkflow.checkpointer"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self._saved: tuple[int, bool] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("checkpoint interval now"):
            self.messages.append(text.removeprefix("checkpoint interval now "))

    def attach(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        self._saved = (logger.level, logger.propagate)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # keep the console quiet; the report prints them
        logger.addHandler(self)

    def detach(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        if self._saved is not None:
            logger.setLevel(self._saved[0])
            logger.propagate = self._saved[1]


def make_strategy(
    name: str, k: int | None, root: str, max_overhead: float, device: str = "cpu"
) -> Strategy:
    if name.startswith("checkflow-") and "+nice" in name:
        # checkflow-exact+nice10: the persist thread at that nice (CHECKFLOW_PERSIST_NICE).
        base, _, nice = name.partition("+nice")
        strat = make_strategy(base, k, root, max_overhead, device)
        assert isinstance(strat, Checkflow)
        strat.name, strat.persist_nice = name, int(nice)
        return strat
    if name == "none":
        return NoCheckpoint(name, None, root)
    if name == "torch.save":
        return TorchSave(name, k, root)
    if name == "dcp.save":
        return DcpSave(name, k, root)
    if name in ("dcp.async", "dcp.async-staged"):
        return DcpAsync(
            name, k, root, staged=name.endswith("staged"), cuda=device.startswith("cuda")
        )
    if name.startswith("checkflow-auto"):
        codec = name.removeprefix("checkflow-auto").removeprefix("-") or "exact"
        return Checkflow(name, None, root, codec=codec, max_overhead=max_overhead)
    if name.startswith("checkflow-"):
        codec = name.removeprefix("checkflow-")
        return Checkflow(name, k, root, codec=codec, max_overhead=max_overhead)
    raise SystemExit(
        f"unknown strategy {name!r}; known: none, torch.save, dcp.save, dcp.async, "
        "dcp.async-staged, checkflow-<codec>[+nice<N>], checkflow-auto[-<codec>]"
    )


def uses_k(name: str) -> bool:
    return name != "none" and not name.startswith("checkflow-auto")


# -- the runner ------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    k: int | None
    loop_s: float
    drain_s: float
    step_s: float
    stalls: list[float]
    due: int
    taken: int
    waits: int
    bytes_per_ckpt: float
    interval: int | None
    base_step_s: float = float("nan")
    """Mean step time of the paired no-checkpoint steps run just before this strategy."""
    restore_s: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)
    cpu: CpuUse | None = None
    """CPU spent over the timed steps and the drain."""
    base_cpu_step: float = float("nan")
    """Process CPU seconds per paired no-checkpoint step."""
    state_bytes: int = 0
    """Bytes of the state one checkpoint holds (before any codec)."""

    @property
    def gib_checkpointed(self) -> float:
        """State bytes of the checkpoints taken, in GiB (codec-independent)."""
        return self.taken * self.state_bytes / 2**30

    @property
    def bg_cpu_per_gib(self) -> float:
        """CPU seconds of every thread but the training thread, per GiB checkpointed."""
        if self.cpu is None or not self.gib_checkpointed:
            return float("nan")
        return self.cpu.background / self.gib_checkpointed

    @property
    def extra_cpu_per_gib(self) -> float:
        """Process CPU beyond what the paired baseline's steps predict, per GiB
        checkpointed: the background work plus the training thread's own checkpoint calls
        and slow-down (noisier: it includes the training thread's cache misses)."""
        if self.cpu is None or not self.gib_checkpointed:
            return float("nan")
        return (self.cpu.process - self.base_cpu_step * self.steps) / self.gib_checkpointed

    @property
    def total_s(self) -> float:
        return self.loop_s + self.drain_s

    @property
    def paired_overhead(self) -> float:
        """Total time over what the paired baseline's mean step predicts for these steps."""
        return self.total_s / (self.base_step_s * self.steps) - 1

    @property
    def steps(self) -> int:
        return int(self.extra["steps"])

    @property
    def equal_work(self) -> bool:
        """Every due checkpoint was taken (the only runs that may be compared)."""
        return self.taken == self.due


def run_one(
    strat: Strategy, args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> Result:
    model, opt = build(args.hidden, args.layers, device=args.device)
    sync = device_sync(args.device)
    for i in range(args.warmup):  # Adam state exists and allocator/caches are warm
        train_step(model, opt, batches[i % len(batches)])
    sync()
    os.makedirs(strat.root, exist_ok=True)
    strat.open(model, opt)
    try:
        strat.warm()
        gc.collect()
        # A paired baseline just before the strategy: other jobs on a shared machine change
        # its speed over minutes, and this tracks that drift (the global baseline cannot).
        base_times = []
        cpu_a = CpuSample.now()
        for i in range(args.baseline_steps):
            ts = time.perf_counter()
            train_step(model, opt, batches[i % len(batches)])
            sync()
            base_times.append(time.perf_counter() - ts)
        base_cpu = CpuUse.between(cpu_a, CpuSample.now())
        step_times = []
        cpu0 = CpuSample.now()
        t0 = time.perf_counter()
        steps = strat.steps(args)
        for i in range(steps):
            ts = time.perf_counter()
            train_step(model, opt, batches[i % len(batches)], strat.before_opt_step)
            strat.after_step(i + 1)
            sync()
            step_times.append(time.perf_counter() - ts)
        loop = time.perf_counter() - t0
        drain = timed(lambda: (strat.drain(), sync()))
        cpu = CpuUse.between(cpu0, CpuSample.now())
        res = Result(
            name=strat.name,
            k=strat.k,
            loop_s=loop,
            drain_s=drain,
            step_s=median(step_times),
            stalls=list(strat.stalls),
            due=strat.due,
            taken=strat.taken,
            waits=strat.waits,
            bytes_per_ckpt=median(strat.ckpt_bytes),
            interval=strat.interval,
            base_step_s=sum(base_times) / len(base_times) if base_times else float("nan"),
            extra={
                "steps": steps,
                "changes": list(strat.changes.messages)
                if isinstance(strat, Checkflow) and strat.changes is not None
                else [],
            },
            cpu=cpu,
            base_cpu_step=base_cpu.process / max(1, args.baseline_steps),
            state_bytes=args.state_bytes,
        )
        if strat.restorable and args.restore_reps:
            # One untimed read first, for every strategy and the reference alike: checkflow
            # writes its chunks with O_DIRECT (nothing left in the page cache), torch.save
            # and DCP through the cache, so a first read would compare disk with memory.
            res.restore_s = median_time(strat.restore_once, args.restore_reps, warmup=1)
    finally:
        strat.close()
        shutil.rmtree(strat.root, ignore_errors=True)
        del model, opt
        gc.collect()
    return res


def reference_restore_s(args: argparse.Namespace, batches: list, root: str) -> float:
    """``torch.load`` + ``load_state_dict`` of the same state, freshly written and fsynced."""
    model, opt = build(args.hidden, args.layers, device=args.device)
    for i in range(args.warmup):
        train_step(model, opt, batches[i % len(batches)])
    s = TorchSave("ref", 1, root)
    os.makedirs(root, exist_ok=True)
    s.open(model, opt)
    s.warm()
    t = median_time(s.restore_once, max(1, args.restore_reps), warmup=1)
    shutil.rmtree(root, ignore_errors=True)
    return t


def reference_copy_s(args: argparse.Namespace, batches: list) -> tuple[float, int]:
    """The floor of a snapshot's copy: a plain ``copy_`` of the whole state on the CPU, the
    pinned-copy limit (device to pinned host buffers, non-blocking, then a sync) on a GPU."""
    model, opt = build(args.hidden, args.layers, device=args.device)
    for i in range(args.warmup):
        train_step(model, opt, batches[i % len(batches)])
    tensors = state_tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if args.device.startswith("cuda"):
        return pinned_copy_s(tensors), nbytes
    return plain_copy_s(tensors), nbytes


def device_sync(device: str) -> Any:
    """What ends a timed step: a device-wide sync on a GPU (a step's time then includes the
    kernels it queued), nothing on the CPU."""
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


# -- report ----------------------------------------------------------------------------------
@dataclass
class Summary:
    """One strategy at one K over every repeat: medians and their spread."""

    runs: list[Result]

    @property
    def first(self) -> Result:
        return self.runs[0]

    @property
    def name(self) -> str:
        return self.first.name

    @property
    def k(self) -> int | None:
        return self.first.k

    @property
    def equal_work(self) -> bool:
        return all(r.equal_work for r in self.runs)

    def med(self, fn: Any) -> float:
        return median([fn(r) for r in self.runs])

    def spread(self, fn: Any) -> tuple[float, float]:
        values = [fn(r) for r in self.runs]
        return min(values), max(values)

    @property
    def overhead(self) -> float:
        """Median paired overhead over the repeats."""
        return self.med(lambda r: r.paired_overhead)

    def overhead_text(self) -> str:
        lo, hi = self.spread(lambda r: r.paired_overhead)
        text = f"{100 * self.overhead:+.1f}%"
        if len(self.runs) > 1:
            text += f" [{100 * lo:+.1f}..{100 * hi:+.1f}]"
        return text

    def ckpts_text(self) -> str:
        if self.name == "none":
            return "-"
        taken = ", ".join(sorted({f"{r.taken}/{r.due}" for r in self.runs}))
        waits = sum(r.waits for r in self.runs)
        text = taken + (f" ({waits} waits)" if waits else "")
        return text if self.equal_work else text + " UNEQUAL"


def combine(results: list[Result]) -> list[Summary]:
    """Group runs by (strategy, K), in first-seen order."""
    groups: dict[tuple[str, int | None], list[Result]] = {}
    for r in results:
        groups.setdefault((r.name, r.k), []).append(r)
    return [Summary(runs) for runs in groups.values()]


def report(summaries: list[Summary], base_s: float, copy_s: float, load_s: float) -> list[str]:
    rows = []
    for g in summaries:
        stall = g.med(lambda r: median(r.stalls) if r.stalls else float("nan"))
        restore = g.med(lambda r: r.restore_s)
        rows.append(
            [
                g.name,
                "-" if g.k is None else str(g.k),
                g.ckpts_text(),
                ", ".join(sorted({str(r.interval) for r in g.runs}))
                if g.name.startswith("checkflow-auto")
                else "",
                fmt_s(g.med(lambda r: r.step_s)),
                fmt_s(g.med(lambda r: r.total_s), "s"),
                g.overhead_text(),
                f"{100 * (g.med(lambda r: r.total_s) / base_s - 1):+.1f}%",
                fmt_s(g.med(lambda r: r.drain_s)),
                fmt_s(stall),
                f"{stall / copy_s:.2f}x" if stall == stall else "-",
                fmt_bytes(g.med(lambda r: r.bytes_per_ckpt)),
                fmt_s(restore, "s"),
                f"{restore / load_s:.2f}x" if restore == restore else "-",
            ]
        )
    headers = [
        "strategy",
        "K",
        "taken/due",
        "interval",
        "step (med)",
        "total",
        "overhead (paired)" + (" [min..max]" if len(summaries[0].runs) > 1 else ""),
        "overhead (vs none)",
        "drain",
        "stall/ckpt (med)",
        "stall/copy",
        "bytes/ckpt",
        "restore",
        "restore/load",
    ]
    return [table(headers, rows)]


def cpu_report(summaries: list[Summary]) -> list[str]:
    """CPU seconds per GiB checkpointed, with the background threads that spent them."""
    rows = []
    for g in summaries:
        if g.name == "none" or not any(r.taken for r in g.runs):
            continue
        names: dict[str, list[float]] = {}
        for r in g.runs:
            assert r.cpu is not None
            for name, spent in r.cpu.by_thread.items():
                names.setdefault(name, []).append(spent / r.gib_checkpointed)
        threads = ", ".join(
            f"{n} {median(v):.2f}"
            for n, v in sorted(names.items(), key=lambda kv: -median(kv[1]))
            if median(v) >= 0.005
        )
        rows.append(
            [
                g.name,
                "-" if g.k is None else str(g.k),
                f"{g.med(lambda r: r.gib_checkpointed):.2f}",
                spread_text(g, lambda r: r.bg_cpu_per_gib, "{:.2f}"),
                spread_text(g, lambda r: r.extra_cpu_per_gib, "{:.2f}"),
                threads or "-",
            ]
        )
    if not rows:
        return []
    headers = [
        "strategy",
        "K",
        "GiB/run",
        "background CPU s/GiB",
        "extra CPU s/GiB",
        "by thread (s/GiB, median)",
    ]
    return [table(headers, rows)]


def spread_text(g: Summary, fn: Any, fmt: str) -> str:
    text = fmt.format(g.med(fn))
    if len(g.runs) > 1:
        lo, hi = g.spread(fn)
        text += f" [{fmt.format(lo)}..{fmt.format(hi)}]"
    return text


def cpu_targets(summaries: list[Summary]) -> list[str]:
    """Background CPU per GiB: checkflow against DCP's ``async_save`` with async staging
    (the DCP setting whose copy, like checkflow's, runs off the training thread)."""
    out = []
    for g in summaries:
        if not g.name.startswith("checkflow-") or g.k is None:
            continue
        peer = next((p for p in summaries if p.name == "dcp.async-staged" and p.k == g.k), None)
        if peer is None:
            continue
        mine, theirs = g.med(lambda r: r.bg_cpu_per_gib), peer.med(lambda r: r.bg_cpu_per_gib)
        extra = g.med(lambda r: r.extra_cpu_per_gib) / peer.med(lambda r: r.extra_cpu_per_gib)
        out.append(
            f"{verdict(mine <= theirs / 2, g, peer)} background CPU {g.name} K={g.k}: "
            f"{spread_text(g, lambda r: r.bg_cpu_per_gib, '{:.2f}')} s/GiB vs "
            f"{peer.name} {spread_text(peer, lambda r: r.bg_cpu_per_gib, '{:.2f}')} s/GiB "
            f"= {mine / theirs:.2f}x (target <= 0.5x; extra CPU incl. the training thread "
            f"{extra:.2f}x)"
        )
    return out


def verdict(ok: bool, *groups: Summary) -> str:
    """PASS/MISS, or UNEQUAL when a compared run skipped due checkpoints."""
    if not all(g.equal_work for g in groups):
        return "UNEQUAL"
    return "PASS" if ok else "MISS"


def paired_ratios(mine: Summary, theirs: Summary) -> list[float]:
    """Overhead ratio per repeat (the two ran back to back in the same repeat)."""
    return [
        a.paired_overhead / b.paired_overhead
        for a, b in zip(mine.runs, theirs.runs, strict=False)
        if b.paired_overhead > 0
    ]


def targets(
    summaries: list[Summary], copy_s: float, load_s: float, max_overhead: float
) -> list[str]:
    out = cpu_targets(summaries)
    flow = [g for g in summaries if g.name.startswith("checkflow-")]
    for g in flow:
        stall = g.med(lambda r: median(r.stalls) if r.stalls else float("nan"))
        if stall != stall:
            continue
        ratio = stall / copy_s
        out.append(
            f"{verdict(ratio <= 2, g)} stall {g.name} K={g.k or 'auto'}: "
            f"{fmt_s(stall)} = {ratio:.2f}x plain copy_ (target <= 2x)"
        )
    for k in sorted({g.k for g in flow if g.k is not None}):
        dcps = [g for g in summaries if g.name in DCP and g.k == k]
        if not dcps:
            continue
        best = min(dcps, key=lambda g: g.overhead)
        for g in (g for g in flow if g.k == k):
            ratios = paired_ratios(g, best)
            if best.overhead > 0:
                ratio = f"{g.overhead / best.overhead:.2f}x"
            else:  # a best DCP overhead at or below zero means the noise swamped it
                ratio = "n/a (DCP within noise)"
            if len(ratios) > 1:
                ratio += (
                    f" (per repeat {median(ratios):.2f}x [{min(ratios):.2f}..{max(ratios):.2f}])"
                )
            out.append(
                f"{verdict(g.overhead <= best.overhead / 2, g, best)} overhead (paired) "
                f"{g.name} K={k}: {g.overhead_text()} vs best DCP ({best.name}) "
                f"{best.overhead_text()} = {ratio} (target <= 0.5x)"
            )
    for g in (g for g in flow if g.name.startswith("checkflow-auto")):
        loop_over = g.med(lambda r: r.loop_s / (r.base_step_s * r.steps) - 1)
        intervals = ", ".join(sorted({str(r.interval) for r in g.runs}))
        out.append(
            f"{verdict(g.overhead <= max_overhead, g)} auto {g.name}: "
            f"paired overhead {g.overhead_text()} incl. final drain, {100 * loop_over:+.1f}% "
            f"without; interval {intervals} steps, {g.ckpts_text()} checkpoints "
            f"(target <= {100 * max_overhead:.0f}%)"
        )
    for g in flow:
        restore = g.med(lambda r: r.restore_s)
        if restore == restore:
            ratio = restore / load_s
            out.append(
                f"{verdict(ratio <= 1.2, g)} restore {g.name} K={g.k or 'auto'}: "
                f"{fmt_s(restore, 's')} = {ratio:.2f}x torch.load (target <= 1.2x)"
            )
    return out


# -- CLI -------------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated")
    p.add_argument("--k", type=int, nargs="+", default=[1, 5], help="checkpoint every K steps")
    p.add_argument("--steps", type=int, default=40, help="timed steps per strategy")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--params-mib", type=float, default=100.0, help="model size; Adam adds 2x")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for training (default 1: leaves a core for the "
        "background copy/persist threads of the async strategies on a 2-core machine)",
    )
    p.add_argument(
        "--baseline-steps",
        type=int,
        default=10,
        help="no-checkpoint steps timed just before each strategy (the paired baseline)",
    )
    p.add_argument("--max-overhead", type=float, default=0.05, help="for checkflow-auto")
    p.add_argument(
        "--auto-steps",
        type=int,
        default=200,
        help="timed steps of checkflow-auto, which starts cold: its measurement checkpoints count",
    )
    p.add_argument("--restore-reps", type=int, default=3)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the whole plan this many times, interleaved in a rotated order; the "
        "report gives medians and their spread",
    )
    p.add_argument("--dir", default=None, help="local folder for checkpoints (default: a tmp dir)")
    p.add_argument("--quick", action="store_true", help="small state, few steps (~1 min)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: train and snapshot on the GPU")
    args = p.parse_args(argv)
    if args.quick:
        args.params_mib, args.hidden, args.steps, args.batch = 16.0, 1024, 12, 32
        args.auto_steps = 40
        args.warmup, args.restore_reps, args.baseline_steps = 2, 1, 4
    args.layers = layers_for(args.params_mib, args.hidden)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    logging.basicConfig(level=logging.ERROR)  # checkflow's wait warnings would interleave
    warnings.filterwarnings("ignore", category=FutureWarning)
    # DCP says once per call that it assumes a single process: that is the point here.
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        # As most GPU jobs run: TF32 matmuls (on the CPU this setting does nothing).
        torch.backends.cuda.matmul.allow_tf32 = True
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    parent = args.dir or tempfile.mkdtemp(prefix="checkflow-bench-")
    os.makedirs(parent, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(args.batch, args.hidden, generator=g).to(args.device),
            torch.randn(args.batch, args.hidden, generator=g).to(args.device),
        )
        for _ in range(4)
    ]
    copy_s, nbytes = reference_copy_s(args, batches)
    args.state_bytes = nbytes
    load_s = reference_restore_s(args, batches, os.path.join(parent, "ref"))
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"state {fmt_bytes(nbytes)} ({args.layers} x Linear({args.hidden}, {args.hidden}) + "
        f"AdamW), batch {args.batch}, {args.steps} timed steps, torch threads {args.threads}, "
        f"device {where}, torch {torch.__version__}, dir {parent}"
    )
    copy_what = "pinned-copy limit (device to pinned host)" if where != "cpu" else "plain copy_"
    print(
        f"reference: {copy_what} of the whole state {fmt_s(copy_s)}; "
        f"torch.load + load_state_dict {fmt_s(load_s, 's')}",
        flush=True,
    )

    plan: list[tuple[str, int | None]] = []
    for name in names:
        plan += [(name, k) for k in args.k] if uses_k(name) else [(name, None)]
    if "none" in names:  # the baseline at both ends too: it shows drift from other load
        plan.append(("none", None))
    results: list[Result] = []
    try:
        for repeat in range(args.repeats):
            for i, (name, k) in enumerate(rotated(plan, repeat)):
                root = os.path.join(parent, f"{repeat}-{i:02d}-{name}")
                strat = make_strategy(name, k, root, args.max_overhead, args.device)
                r = run_one(strat, args, batches)
                results.append(r)
                print(
                    f"  [{repeat + 1}/{args.repeats}] {name:<20} "
                    f"K={k if k is not None else '-':<4} total {r.total_s:6.2f} s, "
                    f"{r.taken}/{r.due} ckpts, {r.waits} waits, "
                    f"stall/ckpt {fmt_s(median(r.stalls)) if r.stalls else '-'}, "
                    f"paired overhead {100 * r.paired_overhead:+.1f}%, "
                    f"background CPU {r.bg_cpu_per_gib:.2f} s/GiB "
                    f"(extra CPU {r.extra_cpu_per_gib:.2f} s/GiB)",
                    flush=True,
                )
                for change in r.extra["changes"]:
                    print(f"      interval now {change}", flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(parent, ignore_errors=True)

    nones = [r for r in results if r.name == "none"]
    if nones:
        base_s = median([r.total_s for r in nones])
        spread = (max(r.total_s for r in nones) / min(r.total_s for r in nones) - 1) * 100
        print(
            f"\nno-checkpoint runs: {', '.join(fmt_s(r.total_s, 's') for r in nones)} "
            f"(spread {spread:.1f}%: the noise floor of every overhead below)"
        )
    else:
        base_s = float("nan")
    summaries = combine(results)
    print()
    for line in report(summaries, base_s, copy_s, load_s):
        print(line)
    print()
    for line in cpu_report(summaries):
        print(line)
    print()
    for line in targets(summaries, copy_s, load_s, args.max_overhead):
        print(line)


def rotated(plan: list[tuple[str, int | None]], repeat: int) -> list[tuple[str, int | None]]:
    """The plan starting ``repeat`` places further on, so no strategy always runs first."""
    if not plan:
        return plan
    n = repeat % len(plan)
    return plan[n:] + plan[:n]


if __name__ == "__main__":
    main()
