"""``checkflow run [torchrun's options] SCRIPT [ARGS]``: torchrun whose restarts reconnect.

Takes every option of ``torchrun`` (they are torchrun's own parser's) plus the coordinator
the workers report to. See :mod:`checkflow.launch.launcher` for what differs from torchrun.
"""

from __future__ import annotations

import argparse

from checkflow.cli.arguments import Command
from checkflow.cli.output import EXIT_FAILED, EXIT_OK, TOKEN_ON_COMMAND_LINE, CliError, warning


def configure(parser: argparse.ArgumentParser) -> None:
    # torchrun's options come from torchrun's own parser, which imports torch; building it
    # here would make every `checkflow` command wait for torch. So this parser takes the
    # rest of the line as it is (no argument counts as an option of its own), and `run`
    # parses it with the full parser. `checkflow run --help` is answered there too.
    parser.prefix_chars = "\0"
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="[torchrun's options] SCRIPT")


def full_parser() -> argparse.ArgumentParser:
    """torchrun's parser plus the coordinator options, as ``checkflow run``."""
    from checkflow.launch.launcher import torchrun_parser
    from checkflow.launch.warm import DEFAULT_IMPORTS

    parser = torchrun_parser()
    parser.prog = "checkflow run"
    parser.description = COMMAND.description
    group = parser.add_argument_group("coordinator (exported to the workers)")
    group.add_argument("--coordinator", metavar="URL[,URL...]", help="or CHECKFLOW_COORDINATOR")
    group.add_argument("--job", metavar="NAME", help="or CHECKFLOW_JOB")
    group.add_argument("--token", help="deprecated: use --token-file or CHECKFLOW_TOKEN")
    group.add_argument("--token-file", metavar="PATH", help="read the token from PATH")
    warm = parser.add_argument_group("warm restarts (see checkflow.launch.warm)")
    warm.add_argument(
        "--no-warm-restarts",
        dest="warm_restarts",
        action="store_false",
        help="start restarted workers in a fresh interpreter (default: in a spare that "
        "already imported --warm-imports, one per local rank)",
    )
    warm.add_argument(
        "--warm-imports",
        default=",".join(DEFAULT_IMPORTS),
        metavar="MODULES",
        help="comma-separated modules a spare imports before it waits (default: %(default)s)",
    )
    ram = parser.add_argument_group("RAM tier (checkflow.memory)")
    ram.add_argument(
        "--ram-tier",
        action="store_true",
        help="keep each rank's newest checkpoints in node memory too; a restart reads them "
        "from there (exported to the workers as CHECKFLOW_RAM_DIR)",
    )
    ram.add_argument(
        "--ram-root",
        default="/dev/shm/checkflow",
        metavar="DIR",
        help="where the node's RAM-tier folders go (a tmpfs; default: %(default)s)",
    )
    ram.add_argument(
        "--ram-listen",
        metavar="HOST:PORT",
        help="hold the RAM-tier copies the previous node of the ring sends here (this "
        "node's address, or 0.0.0.0:PORT; a bare PORT means 127.0.0.1 and is deprecated)",
    )
    ram.add_argument(
        "--ram-peer",
        metavar="HOST:PORT",
        help="the next node of the ring (its --ram-listen): this node's RAM tier is copied "
        "there, and fetched back from there when this node starts without it",
    )
    ram.add_argument(
        "--ram-secret-file",
        metavar="PATH",
        help="the secret the ring's messages are signed with (HMAC-SHA256), the same file on "
        "every node; default: the job's coordinator token (CHECKFLOW_TOKEN). "
        "The ring does not start without one",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Launch; exit 0 when the workers succeeded, 1 when restarts ran out, 2 when the
    workers do not form the world launched, 128 + N when stopped by signal N (130: Ctrl-C)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from checkflow.folders import UnsafeFolderError
    from checkflow.launch.launcher import coordinator_settings, launch
    from checkflow.launch.world import WorldMismatch
    from checkflow.memory.wire import NoSecretError

    options = full_parser().parse_args(args.argv)
    if options.token is not None:
        warning(TOKEN_ON_COMMAND_LINE)
    if options.token is None and options.token_file is not None:
        from checkflow.cli.coordinator import read_token_file

        options.token = read_token_file(options.token_file)
    try:
        settings = coordinator_settings(options)
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        launch(options, settings)
    except (NoSecretError, UnsafeFolderError, WorldMismatch) as e:
        raise CliError(str(e)) from None
    except SignalException as e:
        # torch's agent turns SIGINT/SIGTERM into this and has stopped the workers by now.
        raise CliError(
            f"stopped by {e.sigval.name}; the workers were stopped, the checkpoints they "
            "committed are kept",
            128 + int(e.sigval),
        ) from None
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = (
            f"killed by {failure.signal_name()}"
            if failure.exitcode < 0
            else f"exit code {failure.exitcode}"
        )
        raise CliError(
            f"rank {rank} failed first ({how}) and --max-restarts="
            f"{options.max_restarts} ran out; its output and traceback are above",
            EXIT_FAILED,
        ) from None
    return EXIT_OK


COMMAND = Command(
    "run",
    "launch a training script like torchrun, with restarts that always reconnect",
    configure,
    run,
    description="Launch SCRIPT on every rank like torchrun (same options), restart the "
    "workers on failure with a fresh rendezvous store each time, and export the "
    "coordinator settings to them. With --coordinator, the agent also reports crashed "
    "workers and restarts its workers when the job moved on (a fault on another node, a "
    "roll-back). 'checkflow run --help' lists torchrun's options.",
)
