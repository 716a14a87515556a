"""``checkflow verify URI``: read and decode every chunk of one (or every) committed step.

Exits 1 when any checkpoint has a problem, including a commit marker (``MANIFEST.json``)
that exists but cannot be read: the catalog hides such a step from the listing, and verify
must report it rather than pass over it.
"""

from __future__ import annotations

import argparse

from checkflow.cli.arguments import Command, add_progress, add_uri, open_root
from checkflow.cli.output import EXIT_FAILED, EXIT_OK, CliError, human_bytes, line
from checkflow.cli.progress import ByteProgress


def configure(parser: argparse.ArgumentParser) -> None:
    add_uri(parser)
    add_progress(parser)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the step (default: the newest committed)")
    which.add_argument("--all", action="store_true", help="every committed checkpoint")


def run(args: argparse.Namespace) -> int:
    """Verify the chosen steps, one line per step (and per problem); exit 1 on any problem."""
    from checkflow.catalog import scan
    from checkflow.read.api import resolve_step
    from checkflow.read.errors import NoCheckpointError
    from checkflow.read.reader import CheckpointReader

    storage = open_root(args)
    cat = scan(storage)
    damaged = {s: why for s, why in cat.damaged.items() if args.all or s == args.step}
    if args.all:
        steps = list(cat.committed)
        if not steps and not damaged:
            raise NoCheckpointError(f"no committed checkpoint in {args.uri}")
    else:
        steps = [] if damaged else [resolve_step(storage, args.step)]
    for s, why in damaged.items():
        line(f"FAIL step {s}: {why}")  # the catalog's reason names the MANIFEST.json
    failed = len(damaged)
    reader = CheckpointReader(storage)
    for step in steps:
        total = reader.manifest(step).nbytes
        with ByteProgress(total, f"verify step {step}", enabled=args.progress) as bar:
            reader.progress = bar
            problems = reader.verify(step)
        for p in problems:
            line(f"FAIL {p}")
        if problems:
            failed += 1
        else:
            line(f"step {step}: OK ({human_bytes(total)} read and decoded)")
    if failed:
        raise CliError(
            f"verification failed: {failed} of {len(steps) + len(damaged)} checkpoint(s) have "
            "problems; restore an older step with --step, and remove a damaged newest one "
            "before resuming",
            EXIT_FAILED,
        )
    return EXIT_OK


COMMAND = Command("verify", "read every chunk, check checksums, decode", configure, run)
