"""``checkflow import-dcp DCP_DIR URI``: commit a PyTorch Distributed Checkpoint folder as
a checkflow checkpoint."""

from __future__ import annotations

import argparse
import os

from checkflow.cli.arguments import Command, add_uri, parse_storage_options
from checkflow.cli.output import EXIT_OK, CliError, line


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dcp_dir", metavar="DCP_DIR", help="folder written by dcp.save")
    add_uri(parser)  # after DCP_DIR: data flows from the first to the second
    parser.add_argument("--step", type=int, default=0, help="the step to commit it as (default 0)")
    parser.add_argument(
        "--trust",
        action="store_true",
        help="read DCP's pickles as torch does, even those naming classes dcp.save never "
        "writes; this runs code from the folder: only for one you trust",
    )


def run(args: argparse.Namespace) -> int:
    """Refuse a folder that is not DCP, or a step the root already has; then import."""
    if not os.path.isfile(os.path.join(args.dcp_dir, ".metadata")):
        raise CliError(f"{args.dcp_dir} is not a DCP checkpoint (no .metadata file in it)")
    from checkflow.catalog import scan
    from checkflow.interop import import_dcp
    from checkflow.storage import Storage

    options = parse_storage_options(args.storage_options)
    if args.step in scan(Storage(args.uri, storage_options=options)).folders:
        raise CliError(f"{args.uri} already has a step {args.step}; pick another --step")
    step = import_dcp(
        args.dcp_dir, args.uri, step=args.step, storage_options=options, trust=args.trust
    )
    line(f"imported {args.dcp_dir} into {args.uri} as step {step}")
    return EXIT_OK


COMMAND = Command(
    "import-dcp", "commit a PyTorch Distributed Checkpoint folder into URI", configure, run
)
