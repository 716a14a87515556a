"""The ``checkflow`` entry point: the parser of every subcommand, and how a run ends.

Each command is a module of this package with a ``COMMAND``; this module only collects
them, sets up logging and turns an expected error into one line and an exit code
(``checkflow.cli.output``). Command modules import the library lazily, inside ``run``, so
that ``checkflow --help`` or a usage error never waits for torch.
"""

from __future__ import annotations

import argparse
import logging
import sys

from checkflow import __version__
from checkflow.cli import gc, import_dcp, inspect, ls, restore, serve, status, verify
from checkflow.cli import run as run_command
from checkflow.cli.arguments import Command
from checkflow.cli.output import (
    EXIT_INTERRUPTED,
    EXIT_NEEDS_FULL_INSTALL,
    EXIT_OK,
    StderrHandler,
    error,
    explain,
    needs_full_install,
)

COMMANDS: tuple[Command, ...] = (
    ls.COMMAND,
    import_dcp.COMMAND,
    inspect.COMMAND,
    verify.COMMAND,
    restore.COMMAND,
    gc.COMMAND,
    serve.COMMAND,
    status.COMMAND,
    run_command.COMMAND,
)
"""Every subcommand, in the order ``checkflow --help`` lists them."""


def main(argv: list[str] | None = None) -> int:
    """Run ``checkflow`` with ``argv`` (``sys.argv[1:]`` by default); returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="checkflow: %(levelname)s: %(message)s",
        handlers=[StderrHandler()],
    )
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        error("interrupted; nothing was left half-written (outputs are written atomically)")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `checkflow ls URI | head`: the reader left; that is not an error of ours.
        sys.stderr.close()
        return EXIT_OK
    except ModuleNotFoundError as e:  # the coordinator image has no torch, no numpy
        message = needs_full_install(args.command, e)
        if message is None:
            raise
        error(message)
        return EXIT_NEEDS_FULL_INSTALL
    except Exception as e:  # an expected error becomes one line; a bug keeps its traceback
        code, message = explain(e, getattr(args, "uri", None))
        if code is None:
            raise
        error(message)
        return code


def build_parser() -> argparse.ArgumentParser:
    """The full ``checkflow`` argument parser; each subcommand sets ``run(args) -> int``."""
    parser = argparse.ArgumentParser(
        prog="checkflow",
        description="Inspect, verify, restore and garbage-collect checkflow checkpoints; "
        "run or query the coordinator.",
    )
    parser.add_argument("--version", action="version", version=f"checkflow {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what is done")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(
            command.name, help=command.help, description=command.description or command.help
        )
        command.configure(p)
        p.set_defaults(run=command.run)
    return parser
