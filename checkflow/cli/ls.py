"""``checkflow ls URI``: the committed checkpoints under a root, as the catalog sees them."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from checkflow import manifest as mf
from checkflow.cli.arguments import Command, add_uri, open_root
from checkflow.cli.output import EXIT_OK, escape, fmt_steps, fmt_time, human_bytes, line, table

if TYPE_CHECKING:
    from checkflow.catalog import Catalog


def configure(parser: argparse.ArgumentParser) -> None:
    add_uri(parser)
    parser.add_argument(
        "--all",
        action="store_true",
        help="also list uncommitted step folders, rolled-back timelines' and foreign entries",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    """Committed checkpoints as a table; uncommitted and damaged folders as notes (or rows)."""
    from checkflow.catalog import roots_below, scan

    storage = open_root(args)
    cat = scan(storage)
    if args.json:
        line(json.dumps(_as_json(args.uri, cat)))
    elif not cat.folders and not cat.abandoned:
        line(_nothing_here(args.uri, [storage.url(name) for name in roots_below(storage)]))
        if args.all:  # a folder without steps is no root: its other entries are no news
            _print_foreign(cat, show_all=True)
    else:
        _print_table(args.uri, cat, show_all=args.all)
        _print_notes(args.uri, cat, show_all=args.all)
        _print_foreign(cat, show_all=args.all)
    return EXIT_OK


def _nothing_here(uri: str, below: list[str]) -> str:
    """No step folder in ``uri``; where to look when a folder under it has some."""
    if not below:
        return f"no checkpoints in {uri}"
    return (
        f"no checkpoints in {uri}; found some in {', '.join(below)} - run checkflow ls {below[0]}"
    )


def _as_json(uri: str, cat: Catalog) -> dict[str, object]:
    records = [
        {
            "step": s,
            "kind": m.kind,
            "base_steps": m.base_steps,
            "world_size": m.world_size,
            "nbytes": m.nbytes,
            "created": m.created,
        }
        for s, m in cat.committed.items()
    ]
    return {
        "uri": uri,
        "checkpoints": records,
        "uncommitted": cat.partial,
        "damaged": {str(s): why for s, why in cat.damaged.items()},
        "foreign": dict(cat.foreign),
        "timeline": cat.lineage.current,
        "abandoned": cat.abandoned,
        "ignored_timelines": {str(k): why for k, why in cat.lineage.ignored.items()},
    }


def _print_table(uri: str, cat: Catalog, *, show_all: bool) -> None:
    rows: dict[tuple[int, str], list[object]] = {
        (s, ""): [s, m.kind, fmt_steps(m.base_steps), m.world_size, human_bytes(m.nbytes)]
        + [fmt_time(m.created)]
        for s, m in cat.committed.items()
    }
    if show_all:
        rows.update({(s, ""): [s, "partial", "-", "-", "-", "-"] for s in cat.partial})
        rows.update({(s, ""): [s, "damaged", "-", "-", "-", "-"] for s in cat.damaged})
        for name in cat.abandoned:
            folder = mf.parse_step_dir(name)
            assert folder is not None  # the catalog lists only step folders there
            rows[(folder.step, name)] = [folder.step, "abandoned", "-", "-", "-", "-"]
    if rows:
        headers = ["STEP", "KIND", "BASE", "WORLD", "SIZE", "CREATED"]
        table(headers, [rows[k] for k in sorted(rows)], right={0, 3, 4})
    else:
        line(f"no committed checkpoint in {uri}")


def _print_notes(uri: str, cat: Catalog, *, show_all: bool) -> None:
    hint = "" if show_all else "; --all lists them"
    if cat.partial:
        line()
        line(
            f"note: {len(cat.partial)} uncommitted step folder(s) without MANIFEST.json "
            f"(in flight, or abandoned: gc removes those older than the newest commit): "
            f"{', '.join(str(s) for s in cat.partial)}{hint}"
        )
    if cat.abandoned:
        line()
        line(
            f"note: {len(cat.abandoned)} step folder(s) of rolled-back timelines (never "
            f"restored; gc deletes them but damaged ones): "
            f"{', '.join(f'{n} ({state})' for n, state in cat.abandoned.items())}{hint}"
        )
    for k, why in sorted(cat.lineage.ignored.items()):
        line()
        line(f"note: timeline {k} is ignored: {escape(why)}")
    if cat.damaged:
        line()
        line(
            f"note: {len(cat.damaged)} step folder(s) whose MANIFEST.json cannot be read "
            f"(gc leaves them for you to look at; 'checkflow verify {uri} --all' says why): "
            f"{', '.join(str(s) for s in cat.damaged)}{hint}"
        )


def _print_foreign(cat: Catalog, *, show_all: bool) -> None:
    """Entries that are not step folders: never read, counted or deleted, so a look-alike
    name (``step-0000000099``) or a link to another run is shown as what it is."""
    if not cat.foreign:
        return
    line()
    if not show_all:
        line(
            f"note: {len(cat.foreign)} foreign entr{'y' if len(cat.foreign) == 1 else 'ies'}"
            " in the root, not checkpoints (left alone); --all lists them"
        )
        return
    line(
        f"{len(cat.foreign)} foreign entr{'y' if len(cat.foreign) == 1 else 'ies'}, "
        "not checkpoints (never read, counted or deleted):"
    )
    table(["NAME", "WHY"], [[name, why] for name, why in sorted(cat.foreign.items())])


COMMAND = Command("ls", "list committed checkpoints", configure, run)
