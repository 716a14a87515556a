"""``checkflow restore``: write one checkpoint as a file (torch, safetensors) or a DCP
folder, or with ``--coordinator URL --job J`` roll a live job back to a checkpoint.

Outputs are written atomically (``storage.write_file_atomic``): a crash or Ctrl-C never
leaves a partial file, and without ``--force`` an existing file is never replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from checkflow.cli.arguments import (
    Command,
    add_progress,
    add_uri,
    open_root,
    parse_storage_options,
)
from checkflow.cli.describe import jsonable, pickled_leaves
from checkflow.cli.output import EXIT_OK, CliError, human_bytes, line, write_failed
from checkflow.cli.progress import ByteProgress

if TYPE_CHECKING:
    from checkflow.read.reader import CheckpointReader


def configure(parser: argparse.ArgumentParser) -> None:
    add_uri(parser, required=False)
    add_progress(parser)
    parser.add_argument("--step", type=int, help="the step (default: the newest committed)")
    parser.add_argument("--out", metavar="PATH", help="the file to write")
    parser.add_argument(
        "--format",
        choices=("torch", "safetensors", "dcp"),
        default="torch",
        help="torch/safetensors: one file; dcp: a PyTorch Distributed Checkpoint folder",
    )
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument(
        "--trust",
        action="store_true",
        help="unpickle objects stored as pickles (saved with allow_pickle=True, or by an "
        "older checkflow); this runs code from the checkpoint: only for one you trust",
    )
    parser.add_argument(
        "--coordinator",
        metavar="URL[,URL...]",
        help="roll the job back through it (several replicas: tried in order)",
    )
    parser.add_argument("--job", help="the job's name on the coordinator")
    parser.add_argument(
        "--token",
        help="deprecated (every user can read it): use --token-file or $CHECKFLOW_TOKEN",
    )
    parser.add_argument(
        "--token-file", metavar="PATH", help="read the coordinator bearer token from PATH"
    )


def run(args: argparse.Namespace) -> int:
    """Write one consolidated file, or roll a live job back through the coordinator."""
    if args.coordinator or args.job:
        return _roll_back(args)
    if not args.uri:
        raise CliError(
            "restore needs a URI to read from, e.g. 'checkflow restore /ckpt --out model.pt' "
            "(or --coordinator URL --job J to roll a live job back)"
        )
    if not args.out:
        raise CliError(f"restore needs --out PATH, e.g. 'checkflow restore {args.uri} --out m.pt'")
    out = os.path.abspath(args.out)
    if args.format == "dcp":
        return _restore_dcp(args, out)
    return _restore_file(args, out)


def _restore_file(args: argparse.Namespace, out: str) -> int:
    """``--format torch|safetensors``: one file, written atomically."""
    _check_out(out, args.force)
    from checkflow.read.api import resolve_step
    from checkflow.read.reader import CheckpointReader
    from checkflow.storage import write_file_atomic

    storage = open_root(args)
    step = resolve_step(storage, args.step)
    # A safetensors file holds no pickles, so its restore never unpickles, even with --trust.
    reader = CheckpointReader(storage, trust=args.trust and args.format == "torch")
    g = reader.manifest(step)
    with ByteProgress(g.nbytes, f"restore step {step}", enabled=args.progress) as bar:
        reader.progress = bar
        if args.format == "torch":
            write = _torch_writer(reader, step)
        else:
            write = _safetensors_writer(reader, step, args.uri)
    try:
        write_file_atomic(out, write, replace=args.force)
    except FileExistsError:
        raise CliError(f"{out} appeared while restoring; pass --force to replace it") from None
    except OSError as e:
        raise write_failed(out, e) from None
    line(
        f"restored step {step} from {args.uri} to {out} "
        f"({args.format}, {human_bytes(os.path.getsize(out))})"
    )
    return EXIT_OK


def _restore_dcp(args: argparse.Namespace, out: str) -> int:
    """``--format dcp``: a folder that ``torch.distributed.checkpoint.load`` reads."""
    if os.path.isfile(out):
        raise CliError(f"--out {out} is a file; --format dcp writes a folder")
    if os.path.isdir(out) and os.listdir(out) and not args.force:
        raise CliError(f"{out} is not empty; choose another --out or pass --force")
    if not os.path.isdir(os.path.dirname(out)):
        raise CliError(f"the folder of --out {out} does not exist; create it first")
    from checkflow.interop import export_dcp
    from checkflow.read.api import resolve_step

    step = resolve_step(open_root(args), args.step)
    options = parse_storage_options(args.storage_options)
    try:
        written = export_dcp(args.uri, step, out, storage_options=options, trust=args.trust)
    except OSError as e:
        raise write_failed(out, e) from None
    line(f"restored step {written} from {args.uri} to {out} (dcp)")
    return EXIT_OK


def _roll_back(args: argparse.Namespace) -> int:
    """``--coordinator URL --job J``: the job's ranks abort and restore ``--step``."""
    if not (args.coordinator and args.job):
        raise CliError("--coordinator URL and --job NAME go together to roll a live job back")
    if args.uri or args.out:
        raise CliError(
            "with --coordinator, restore rolls the live job back (its ranks reload the "
            "checkpoint themselves); drop URI/--out, or drop --coordinator/--job to write a file"
        )
    if args.step is not None and args.step < 0:
        raise CliError(f"--step must be >= 0, got {args.step}")
    from checkflow.cli.coordinator import connect, recover

    with connect(args.coordinator, args.token, args.token_file) as http:
        reply = recover(http, args.job, args.step)
    target = reply.step
    where = f"step {target}" if target is not None else "the beginning (nothing committed)"
    line(
        f"job {args.job} rolled back to {where}: generation {reply.generation}; running "
        "ranks abort on their next heartbeat (exit 75) and the restarted group restores from "
        "there (checkflow run restarts them without using one of --max-restarts; plain "
        "torchrun counts one)"
    )
    return EXIT_OK


def _check_out(out: str, force: bool) -> None:
    if os.path.isdir(out):
        raise CliError(f"--out {out} is a directory; give a file path")
    if os.path.lexists(out) and not force:
        raise CliError(f"{out} already exists; choose another --out or pass --force to replace it")
    if not os.path.isdir(os.path.dirname(out)):
        raise CliError(f"the folder of --out {out} does not exist; create it first")


def _torch_writer(reader: CheckpointReader, step: int) -> Callable[[str], None]:
    """Every stage's state, in values plain ``torch.load(path)`` reads (``weights_only``)."""
    import torch

    from checkflow.read.torch_file import torch_file
    from checkflow.storage import write_error

    exported = torch_file(reader, step)
    if exported.not_plain:
        line(
            f"{len(exported.not_plain)} object(s) unpickled with --trust are kept as they are "
            f"({', '.join(exported.not_plain)}): this file loads only with "
            "torch.load(PATH, weights_only=False), which runs their code"
        )

    def write(path: str) -> None:
        try:
            with open(path, "wb") as f:  # a file of ours: torch keeps its OSError as context
                torch.save(exported.state, f)
        except RuntimeError as e:
            # torch's zip writer turns ENOSPC/EFBIG into "unexpected pos"; say what happened.
            cause = write_error(e)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror, path) from e

    return write


def _safetensors_writer(reader: CheckpointReader, step: int, uri: str) -> Callable[[str], None]:
    try:
        from safetensors import SafetensorError
        from safetensors.torch import save_file
    except ImportError as e:
        raise CliError(
            "--format safetensors needs the safetensors package: "
            "pip install 'checkflow[safetensors]'"
        ) from e
    from checkflow.read.state_dicts import consolidated_skeleton

    tensors = {k: v.contiguous() for k, v in reader.tensors(step).items()}
    g = reader.manifest(step)
    skeleton = consolidated_skeleton(reader, step, opaque=True)  # every pipeline stage
    left_out = pickled_leaves(skeleton)
    if left_out:
        line(
            f"left out of the safetensors file: {len(left_out)} object(s) stored as pickles "
            f"({', '.join(left_out)}); a safetensors restore never unpickles: use "
            "--format torch --trust to keep them"
        )
    metadata = {
        "format": "pt",
        "checkflow.step": str(step),
        "checkflow.source": uri,
        "checkflow.kind": g.kind,
        "checkflow.world_size": str(g.world_size),
        "checkflow.skeleton": json.dumps(jsonable(skeleton)),
    }

    def write(path: str) -> None:
        try:
            save_file(tensors, path, metadata=metadata)
        except SafetensorError as e:
            # Its Rust writer reports I/O failures as text: "... (os error 28)".
            found = re.search(r"os error (\d+)", str(e))
            if found:
                code = int(found.group(1))
                raise OSError(code, os.strerror(code), path) from e
            raise CliError(f"safetensors cannot write this checkpoint ({e})") from e
        except (ValueError, TypeError, RuntimeError) as e:
            raise CliError(
                f"safetensors cannot store this checkpoint ({e}); use --format torch"
            ) from e

    return write


COMMAND = Command(
    "restore",
    "write a checkpoint as one file, or roll a live job back (--coordinator)",
    configure,
    run,
    description="Write a consolidated checkpoint to --out (torch.save of "
    "{name: state_dict} of every rank's stage, which plain torch.load reads, or a flat "
    "safetensors file), or with --coordinator URL "
    "--job J roll a running job back to a checkpoint.",
)
