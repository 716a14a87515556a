"""What the commands share on the command line: the checkpoint URI with its storage
options, the progress switch, and :class:`Command`, the shape of one subcommand.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from checkflow.cli.output import CliError

if TYPE_CHECKING:
    from checkflow.storage import Storage


@dataclass(frozen=True, slots=True)
class Command:
    """One subcommand: ``checkflow <name>``. Each command module defines one, ``COMMAND``."""

    name: str
    help: str
    """One line in ``checkflow --help``."""
    configure: Callable[[argparse.ArgumentParser], None]
    """Adds the command's arguments to its parser."""
    run: Callable[[argparse.Namespace], int]
    """Does the work; returns the exit code or raises (see ``checkflow.cli.output``)."""
    description: str | None = None
    """The longer text of ``checkflow <name> --help``; ``help`` when None."""


def add_uri(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """The checkpoint root ``URI`` and its repeatable ``--storage-option KEY=VALUE``."""
    parser.add_argument(
        "uri",
        metavar="URI",
        nargs=None if required else "?",
        help="checkpoint root: a local path or fsspec URL (s3://bucket/run, file://, gs://…)",
    )
    parser.add_argument(
        "--storage-option",
        dest="storage_options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option, repeatable; dotted keys nest "
        "(client_kwargs.endpoint_url=http://127.0.0.1:9000); true/false/null/numbers "
        'are parsed, quote a value as JSON ("123") to keep it a string',
    )


def add_progress(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress``; neither: a bar only on a terminal."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="draw a progress bar on stderr even when it is not a terminal",
    )
    group.add_argument("--no-progress", dest="progress", action="store_false")


def parse_storage_options(items: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``.

    Raises:
        CliError: an item is not ``key=value`` or two items conflict.
    """
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise CliError(
                f"--storage-option {item!r} is not KEY=VALUE; "
                "e.g. --storage-option client_kwargs.endpoint_url=http://127.0.0.1:9000"
            )
        *parents, leaf = key.split(".")
        node = options
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise CliError(f"--storage-option {item!r} conflicts with {part}={child!r}")
            node = child
        if isinstance(node.get(leaf), dict):
            raise CliError(f"--storage-option {item!r} conflicts with the nested {key}.* options")
        node[leaf] = _option_value(raw)
    return options


def _option_value(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none"):
        return None
    if raw[:1] in ('"', "{", "["):
        try:
            return json.loads(raw)
        except ValueError as e:
            raise CliError(f"storage option value {raw!r} is not valid JSON: {e}") from None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def open_root(args: argparse.Namespace) -> Storage:
    """The ``Storage`` of ``args.uri``, which must exist (a typo must not look empty)."""
    options = parse_storage_options(args.storage_options)
    from checkflow.storage import Storage

    storage = Storage(args.uri, storage_options=options)
    if not storage.exists(""):
        raise CliError(
            f"{args.uri} does not exist; check the URI (a local path, or an fsspec URL "
            "such as s3://bucket/run with --storage-option for credentials or endpoint)"
        )
    return storage
