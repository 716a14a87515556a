"""Counters of the coordinator, gauges of its jobs, and their Prometheus text exposition
(format 0.0.4).

Per-job series carry the label ``checkflow_job``, not ``job``: Prometheus gives every
scraped series its own ``job`` label (the scrape job's name), and a target's ``job`` label
that collides is stored as ``exported_job``, so a query or a Grafana legend on ``job``
would read the scrape job instead of the training job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.state import COMMITTED, Job

from checkflow.protocol import RankState

FINISHED = RankState.FINISHED
JOB_LABEL = "checkflow_job"
RECOVERY_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
DETECTION_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True, slots=True)
class JobGauges:
    """What ``/metrics`` shows of one job (see :func:`job_gauges`)."""

    name: str
    world_size: int
    ranks_alive: int
    ranks_finished: int
    """Ranks of the current generation that ended training normally: neither alive nor
    lost, so an alert on lost ranks can tell a finished job from a dead one."""
    step: int
    interval: int
    checkpoint_step: int | None
    """The newest committed checkpoint's step; None: none committed yet."""
    checkpoint_at: float | None
    """Unix time that checkpoint was committed."""


def job_gauges(job: Job) -> JobGauges:
    """The gauges of ``job`` now (pure: reads the job, changes nothing)."""
    t, g = job.ranks, job.generation
    finished = sum(
        1 for s, sg in zip(t.state, t.generation, strict=True) if s == FINISHED and sg == g
    )
    newest = max(
        (c for c in job.checkpoints.values() if c.status == COMMITTED),
        key=lambda c: c.step,
        default=None,
    )
    return JobGauges(
        name=job.name,
        world_size=job.world_size,
        ranks_alive=job.alive_ranks(),
        ranks_finished=finished,
        step=job.max_step,
        interval=job.interval,
        checkpoint_step=None if newest is None else newest.step,
        checkpoint_at=None if newest is None else (newest.committed_at or newest.started),
    )


JOB_GAUGES: tuple[tuple[str, str, Callable[[JobGauges], float | None]], ...] = (
    ("checkflow_world_size", "Ranks the job runs (its world size).", lambda j: j.world_size),
    (
        "checkflow_ranks_alive",
        "Ranks alive in their job's current generation.",
        lambda j: j.ranks_alive,
    ),
    (
        "checkflow_ranks_finished",
        "Ranks of the job's current generation that ended training normally.",
        lambda j: j.ranks_finished,
    ),
    (
        "checkflow_job_step",
        "Furthest step a rank of the job reported in its current generation.",
        lambda j: j.step,
    ),
    (
        "checkflow_checkpoint_interval_steps",
        "Steps between the job's storage checkpoints (its current schedule).",
        lambda j: j.interval,
    ),
    (
        "checkflow_latest_checkpoint_step",
        "Step of the job's newest committed checkpoint (absent until one is).",
        lambda j: j.checkpoint_step,
    ),
    (
        "checkflow_latest_checkpoint_timestamp_seconds",
        "Unix time the job's newest committed checkpoint was committed.",
        lambda j: j.checkpoint_at,
    ),
)
"""Per-job gauges: name, help, value (None: no sample for that job)."""


@dataclass(slots=True)
class Metrics:
    heartbeats: int = 0
    """Rank heartbeats received (a node heartbeat counts one per rank it carries)."""
    checkpoints_committed: int = 0
    failures_detected: int = 0
    """Ranks declared failed."""
    recovery_durations: list[float] = field(default_factory=list)
    """Seconds from a failure to every rank registered in the new generation."""
    detection_latencies: list[float] = field(default_factory=list)
    """Seconds from each rank's fault to its declaration (see ``declare_failed``)."""
    trained_again: list[float] = field(default_factory=list)
    """Seconds from a declared failure to the job's first step past its restore step."""
    retention_failures: dict[str, int] = field(default_factory=dict)
    """Per job: times its retention started failing (storage grows past ``keep``); a job
    that never reported shows 0, as does every series of a job it knows."""
    retention_failing: dict[str, bool] = field(default_factory=dict)
    """Per job: whether its latest retention report was a failure (none: no)."""

    def retention_reported(self, job: str, *, failed: bool) -> None:
        """Count a rank's retention report (``POST .../retention``)."""
        self.retention_failures[job] = self.retention_failures.get(job, 0) + failed
        self.retention_failing[job] = failed

    def observe(self, changes: Changes) -> None:
        """Count what one decision did."""
        self.heartbeats += changes.heartbeats_received
        self.checkpoints_committed += changes.committed
        for event in changes.events:
            if event.kind == EventKind.RANK_FAILED:
                self.failures_detected += 1
                if event.detail.get("detection_s") is not None:
                    self.detection_latencies.append(event.detail["detection_s"])
            elif event.kind == EventKind.RECOVERED:
                self.recovery_durations.append(event.detail["duration_s"])
            elif event.kind == EventKind.TRAINED_AGAIN:
                self.trained_again.append(event.detail["recovery_s"])

    def render(self, jobs: Sequence[JobGauges]) -> str:
        """The Prometheus text format of these counters plus the gauges of ``jobs``."""
        out = [
            "# HELP checkflow_jobs Jobs known to the coordinator.",
            "# TYPE checkflow_jobs gauge",
            f"checkflow_jobs {len(jobs)}",
        ]
        for name, help_text, value in JOB_GAUGES:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            for j in jobs:
                if (v := value(j)) is not None:
                    out.append(f'{name}{{{JOB_LABEL}="{_label(j.name)}"}} {v!r}')
        out += _counter("checkflow_heartbeats_total", "Rank heartbeats received.", self.heartbeats)
        out += _counter(
            "checkflow_checkpoints_committed_total",
            "Checkpoints committed.",
            self.checkpoints_committed,
        )
        out += _counter(
            "checkflow_failures_detected_total", "Ranks declared failed.", self.failures_detected
        )
        out += [
            "# HELP checkflow_retention_failures_total Times a job's retention started failing.",
            "# TYPE checkflow_retention_failures_total counter",
        ]
        out += [
            f'checkflow_retention_failures_total{{{JOB_LABEL}="{_label(j.name)}"}} '
            f"{self.retention_failures.get(j.name, 0)}"
            for j in jobs
        ]
        out += [
            "# HELP checkflow_retention_failing 1 while a job's latest retention failed.",
            "# TYPE checkflow_retention_failing gauge",
        ]
        out += [
            f'checkflow_retention_failing{{{JOB_LABEL}="{_label(j.name)}"}} '
            f"{int(self.retention_failing.get(j.name, False))}"
            for j in jobs
        ]
        out += _histogram(
            "checkflow_recovery_duration_seconds",
            "Time from a failure to every rank registered again.",
            self.recovery_durations,
            RECOVERY_BUCKETS,
        )
        out += _histogram(
            "checkflow_detection_latency_seconds",
            "Time from a rank's fault to the coordinator declaring it failed.",
            self.detection_latencies,
            DETECTION_BUCKETS,
        )
        out += _histogram(
            "checkflow_recovery_seconds",
            "Time from a declared failure to the job training past its restore step.",
            self.trained_again,
            RECOVERY_BUCKETS,
        )
        return "\n".join(out) + "\n"


def _histogram(
    name: str, help_text: str, values: list[float], buckets: tuple[float, ...]
) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for bound in buckets:
        lines.append(f'{name}_bucket{{le="{bound}"}} {sum(1 for v in values if v <= bound)}')
    lines.append(f'{name}_bucket{{le="+Inf"}} {len(values)}')
    lines.append(f"{name}_sum {sum(values)}")
    lines.append(f"{name}_count {len(values)}")
    return lines


def _counter(name: str, help_text: str, value: int) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
