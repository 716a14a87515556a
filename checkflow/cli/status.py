"""``checkflow status [URL] [JOB]``: tables of the coordinator's jobs, or of one job's
ranks, checkpoints and events.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from checkflow.cli.arguments import Command
from checkflow.cli.output import EXIT_OK, cell, fmt_ago, fmt_time, human_bytes, line, table

if TYPE_CHECKING:
    from checkflow.protocol.messages import CheckpointPublic, EventPublic, JobPublic, RankPublic


def configure(parser: argparse.ArgumentParser) -> None:
    from checkflow.cli.coordinator import DEFAULT_URL

    parser.add_argument(
        "url",
        nargs="?",
        default=None,
        help=f"coordinator URL, or URL,URL,... (default $CHECKFLOW_URL or {DEFAULT_URL})",
    )
    parser.add_argument("job", nargs="?", help="job name: show its ranks, checkpoints and events")
    parser.add_argument(
        "--token", help="deprecated (every user can read it): use --token-file or $CHECKFLOW_TOKEN"
    )
    parser.add_argument("--token-file", metavar="PATH", help="read the bearer token from PATH")
    parser.add_argument("--limit", type=int, default=10, help="checkpoints and events to show")


def run(args: argparse.Namespace) -> int:
    """Print tables of the coordinator's jobs, or of one job."""
    from checkflow.cli.coordinator import connect, coordinator_url, job_report, jobs

    url, job = args.url, args.job
    if url and "://" not in url and job is None:
        url, job = None, url  # `checkflow status JOB`: the URL was left out
    with connect(coordinator_url(url), args.token, args.token_file) as http:
        if not job:
            _print_jobs(jobs(http))
            return EXIT_OK
        report = job_report(http, job, args.limit)
    _print_jobs([report.job])
    line()
    _print_ranks(report.ranks)
    line()
    _print_checkpoints(report.checkpoints)
    line()
    _print_events(report.events)
    line()
    _print_recoveries(report.recoveries, args.limit, report.job)
    return EXIT_OK


def _print_jobs(jobs: list[JobPublic]) -> None:
    if not jobs:
        line("no jobs")
        return
    table(
        ["JOB", "STATE", "WORLD", "ALIVE", "GEN", "INTERVAL", "NEXT CKPT", "RESTORE", "FAILURES"],
        [
            [
                j.name,
                j.state,
                j.world_size,
                j.ranks_alive,
                j.generation,
                f"{j.interval} {j.schedule.mode}",
                j.next_checkpoint_step,
                j.restore_step,
                j.failures,
            ]
            for j in jobs
        ],
        right=range(2, 9),
    )


def _print_ranks(ranks: list[RankPublic]) -> None:
    table(
        ["RANK", "STATE", "ALIVE", "GEN", "STEP", "LAST HEARTBEAT", "ITER S", "STALL S", "NODE"],
        [
            [
                r.rank,
                r.state,
                "yes" if r.alive else "no",
                r.generation,
                r.step,
                fmt_ago(r.last_heartbeat),
                r.iteration_s,
                r.stall_s,
                r.node,
            ]
            for r in ranks
        ],
        right={0, 3, 4, 6, 7},
    )


def _print_checkpoints(cks: list[CheckpointPublic]) -> None:
    if not cks:
        line("no checkpoints")
        return
    table(
        ["STEP", "STATUS", "GEN", "RANKS", "SIZE", "COMMITTED"],
        [
            [
                c.step,
                c.status,
                c.generation,
                f"{c.persisted_ranks}/{c.world_size}",
                human_bytes(c.nbytes),
                fmt_time(c.committed_at),
            ]
            for c in cks
        ],
        right={0, 2, 3, 4},
    )


def _print_events(events: list[EventPublic]) -> None:
    if not events:
        line("no events")
        return
    table(
        ["TIME", "EVENT", "GEN", "RANK", "DETAIL"],
        [
            [
                fmt_time(e.time),
                e.kind,
                e.generation,
                e.rank,
                ", ".join(f"{k}={cell(v)}" for k, v in e.detail.items()),
            ]
            for e in events
        ],
        right={2, 3},
    )


def _print_recoveries(
    events: list[EventPublic], limit: int | None = None, job: JobPublic | None = None
) -> None:
    """One row per new generation among ``events`` (the newest ``limit``): the fault that
    started it (``-``: a roll-back or a resize), its detection latency, the restore step,
    and the seconds from the failure (and from the fault) until the job trained again, from
    the generation's ``trained_again`` event (``recovering`` until there is one, or the
    ``job``'s state for its current generation once it has ended: ``stopped``...)."""
    trained = {e.generation: e.detail for e in events if e.kind == "trained_again"}
    started = [e for e in events if e.kind == "generation_started"]
    started = started[-limit:] if limit else started
    if not started:
        line("no recoveries")
        return
    rows = []
    for e in started:
        done = trained.get(e.generation, {})
        rows.append(
            [
                e.generation,
                e.detail.get("kind"),
                e.detail.get("failed_ranks"),
                e.detail.get("detection_s"),
                e.detail.get("restore_step"),
                done.get("recovery_s", _not_trained_yet(e.generation, job)),
                done.get("fault_to_training_s"),
            ]
        )
    table(
        ["GEN", "FAULT", "RANKS", "DETECTED S", "RESTORE", "TRAINING AGAIN S", "FAULT->TRAIN S"],
        rows,
        right={0, 3, 4, 5, 6},
    )


ENDED = ("finished", "stopped", "failed")
"""Job states in which nothing runs (``JobState``): no recovery is under way."""


def _not_trained_yet(generation: int, job: JobPublic | None) -> str:
    """A recovery with no ``trained_again`` yet: ``recovering``, or for the job's current
    generation once the job has ended, its state (a stopped job recovers no more)."""
    if job is not None and generation == job.generation and job.state in ENDED:
        return str(job.state)
    return "recovering"


COMMAND = Command("status", "show jobs, ranks, checkpoints and events", configure, run)
