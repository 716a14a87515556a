"""Counters of the coordinator and their Prometheus text exposition (format 0.0.4)."""

from __future__ import annotations

from dataclasses import dataclass, field

from checkflow_server.domain.changes import Changes, EventKind

RECOVERY_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
DETECTION_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


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

    def render(self, *, jobs: int, ranks_alive: dict[str, int]) -> str:
        """The Prometheus text format of these counters plus the given gauges."""
        out = [
            "# HELP checkflow_jobs Jobs known to the coordinator.",
            "# TYPE checkflow_jobs gauge",
            f"checkflow_jobs {jobs}",
            "# HELP checkflow_ranks_alive Ranks alive in their job's current generation.",
            "# TYPE checkflow_ranks_alive gauge",
        ]
        out += [f'checkflow_ranks_alive{{job="{_label(j)}"}} {n}' for j, n in ranks_alive.items()]
        out += _counter("checkflow_heartbeats_total", "Rank heartbeats received.", self.heartbeats)
        out += _counter(
            "checkflow_checkpoints_committed_total",
            "Checkpoints committed.",
            self.checkpoints_committed,
        )
        out += _counter(
            "checkflow_failures_detected_total", "Ranks declared failed.", self.failures_detected
        )
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
