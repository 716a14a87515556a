"""``checkflow gc URI --keep N``: delete all but the newest N committed checkpoints.

It prints the library's retention plan (``catalog.plan_retention``), the same one the
``Checkpointer``'s ``keep=`` carries out: bases a kept delta reads stay, uncommitted folders
above the newest commit (perhaps still being written) stay, damaged ones stay.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from checkflow.cli.arguments import Command, add_uri, open_root
from checkflow.cli.output import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    escape,
    fmt_steps,
    human_bytes,
    line,
)

if TYPE_CHECKING:
    from checkflow.catalog import Catalog, DeleteFailure, RetentionPlan


def configure(parser: argparse.ArgumentParser) -> None:
    add_uri(parser)
    parser.add_argument("--keep", type=int, required=True, metavar="N", help="checkpoints to keep")
    parser.add_argument("--dry-run", action="store_true", help="only print what would be deleted")


def run(args: argparse.Namespace) -> int:
    """Print the plan, carry it out unless ``--dry-run``; exit 1 if a deletion failed and
    may pass when run again, 2 if the store refuses deletes (then it says what to fix)."""
    if args.keep < 1:
        raise CliError(
            f"--keep must be at least 1 (got {args.keep}); gc keeps the newest checkpoints, "
            "to delete a whole run remove its folder yourself"
        )
    from checkflow.catalog import delete_folders, plan_retention, retention_targets, scan

    storage = open_root(args)
    cat = scan(storage)
    if not cat.committed:
        raise CliError(
            f"no committed checkpoint in {args.uri}, so nothing to keep; gc deletes nothing "
            f"there; check the URI or run 'checkflow ls {args.uri}'"
        )
    plan = plan_retention(cat, args.keep)
    targets = retention_targets(cat, plan)
    failures = [] if args.dry_run else delete_folders(storage, targets)
    _print_plan(args.uri, cat, plan, dry_run=args.dry_run, failed=[f.step for f in failures])
    for name in [] if failures else plan.abandoned:
        line(f"{'would delete' if args.dry_run else 'deleted'} {name} (a rolled-back timeline's)")
    if failures:
        raise _failed(failures)
    return EXIT_OK


def _failed(failures: list[DeleteFailure]) -> CliError:
    """What to do about steps left: run gc again only when that can help."""
    steps = fmt_steps([f.step for f in failures])
    permanent = [f for f in failures if f.permanent]
    if permanent:
        return CliError(
            f"could not delete step(s) {steps}: {permanent[0].reason}; the store refuses it, "
            "so running gc again will not help until that is fixed (every kept checkpoint "
            "still reads)",
            EXIT_USAGE,
        )
    return CliError(
        f"could not delete step(s) {steps} ({failures[0].reason}); the store failed "
        "transiently: run gc again",
        EXIT_FAILED,
    )


def _print_plan(
    uri: str, cat: Catalog, plan: RetentionPlan, *, dry_run: bool, failed: list[int]
) -> None:
    verb = "would delete" if dry_run else "deleted"
    for s in plan.delete:
        if s in failed:
            continue
        m = cat.committed.get(s)
        what = "uncommitted" if m is None else f"{m.kind}, {human_bytes(m.nbytes)}"
        line(f"{verb} step {s} ({what})")
    needed = f" (bases still needed: {fmt_steps(plan.needed_bases)})" if plan.needed_bases else ""
    line(f"kept {len(plan.keep)} checkpoint(s): {fmt_steps(plan.keep)}{needed}")
    if plan.held:
        line(
            f"deleted nothing: {escape(plan.held)} cannot be used, so which steps are the "
            f"run's is unsure; run 'checkflow ls {uri}', then repair or remove the file"
        )
    if plan.damaged:
        line(
            f"left step(s) {fmt_steps(plan.damaged)} alone: their MANIFEST.json cannot be "
            f"read; run 'checkflow verify {uri} --all' and look at them"
        )
    if cat.foreign:
        n = len(cat.foreign)
        line(
            f"left {n} foreign entr{'y' if n == 1 else 'ies'} alone (not step folders: "
            f"'checkflow ls {uri} --all' lists them)"
        )


COMMAND = Command("gc", "delete all but the newest N checkpoints", configure, run)
