"""The ``checkflow`` command: ls, inspect, verify, restore, gc (and serve, status).

Every command is a thin layer over the library (``restore``, ``persist``, ``storage``):
it parses arguments, calls one or two library functions and formats the answer.

Exit codes: 0 success; 1 a checkpoint failed verification (or an operation failed half
way); 2 bad usage or input (wrong URI, step not committed, refused option). Expected
errors print one line, ``checkflow: error: <what> ; <what to do>``, never a traceback.
Bad input never changes anything on storage or on disk.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from checkflow import __version__
from checkflow.progress import ProgressBar, human_bytes

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
"""A checkpoint failed verification, or an operation failed half way."""
EXIT_USAGE = 2
"""Bad usage or input; nothing was changed."""


class CliError(Exception):
    """An expected failure: printed as one line, exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# -- entry point -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run ``checkflow`` with ``argv`` (``sys.argv[1:]`` by default); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="checkflow: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        _error("interrupted; nothing was left half-written (outputs are written atomically)")
        return 130
    except BrokenPipeError:
        # `checkflow ls URI | head`: the reader left; that is not an error of ours.
        sys.stderr.close()
        return EXIT_OK
    except Exception as e:  # an expected error becomes one line; a bug keeps its traceback
        code, message = _explain(e, args)
        if code is None:
            raise
        _error(message)
        return code


def _explain(e: Exception, args: argparse.Namespace) -> tuple[int | None, str]:
    """(exit code, one-line message) for an expected error; (None, "") for a bug."""
    if isinstance(e, CliError):
        return e.code, str(e)
    # Only a module that is loaded can have raised its error; importing the others here
    # would load torch just to print a usage error.
    ManifestError = _loaded("checkflow.manifest", "ManifestError")
    CorruptCheckpointError = _loaded("checkflow.restore", "CorruptCheckpointError")
    NoCheckpointError = _loaded("checkflow.restore", "NoCheckpointError")
    UntrustedCheckpointError = _loaded("checkflow.restore", "UntrustedCheckpointError")
    StorageError = _loaded("checkflow.storage", "StorageError")
    StorageAccessError = _loaded("checkflow.storage", "StorageAccessError")
    uri = getattr(args, "uri", None) or "URI"
    if isinstance(e, StorageAccessError):
        return EXIT_USAGE, str(e)  # it already names the URI and what to do
    if isinstance(e, CorruptCheckpointError):
        return EXIT_FAILED, (
            f"checkpoint is damaged: {e}; run 'checkflow verify {uri} --all' "
            "and restore an older step with --step"
        )
    if isinstance(e, UntrustedCheckpointError):
        return EXIT_USAGE, str(e)  # it says how to opt in
    if isinstance(e, NoCheckpointError):
        return EXIT_USAGE, f"{e}; check the URI or run 'checkflow ls {uri}'"
    if isinstance(e, ManifestError):
        return EXIT_FAILED, f"{e}; run 'checkflow verify {uri} --all'"
    if isinstance(e, StorageError):
        return EXIT_USAGE, f"{e}; check the URI and any --storage-option values"
    if isinstance(e, ValueError | OSError):
        return EXIT_USAGE, str(e)
    return None, ""


def _loaded(module: str, name: str) -> type[BaseException]:
    """``module.name`` when the module is imported, else a class nothing is an instance of."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else _NeverRaised


class _NeverRaised(Exception):
    pass


def _error(message: str) -> None:
    print(f"checkflow: error: {' '.join(message.split())}", file=sys.stderr)


# -- the parser ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The full ``checkflow`` argument parser; each subcommand sets ``func(args) -> int``."""
    parser = argparse.ArgumentParser(
        prog="checkflow",
        description="Inspect, verify, restore and garbage-collect checkflow checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"checkflow {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what is done")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    uri = _uri_parent(required=True)
    progress = _progress_parent()

    p = sub.add_parser("ls", parents=[uri], help="list committed checkpoints")
    p.add_argument("--all", action="store_true", help="also list uncommitted step folders")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("import-dcp", help="commit a PyTorch Distributed Checkpoint folder into URI")
    p.add_argument("dcp_dir", metavar="DCP_DIR", help="folder written by dcp.save")
    for action in _uri_parent(required=True)._actions:
        p._add_action(action)  # URI and --storage-option, after DCP_DIR
    p.add_argument("--step", type=int, default=0, help="the step to commit it as (default 0)")
    p.set_defaults(func=cmd_import_dcp)

    p = sub.add_parser("inspect", parents=[uri], help="tensors and objects of one checkpoint")
    p.add_argument("--step", type=int, help="the step (default: the newest committed)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "verify", parents=[uri, progress], help="read every chunk, check checksums, decode"
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the step (default: the newest committed)")
    which.add_argument("--all", action="store_true", help="every committed checkpoint")
    p.set_defaults(func=cmd_verify)

    _add_restore_parser(sub, progress)

    p = sub.add_parser("gc", parents=[uri], help="delete all but the newest N checkpoints")
    p.add_argument("--keep", type=int, required=True, metavar="N", help="checkpoints to keep")
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    p.set_defaults(func=cmd_gc)

    _add_coordinator_parsers(sub)
    return parser


def _uri_parent(*, required: bool) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "uri",
        metavar="URI",
        nargs=None if required else "?",
        help="checkpoint root: a local path or fsspec URL (s3://bucket/run, file://, gs://…)",
    )
    parent.add_argument(
        "--storage-option",
        dest="storage_options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option, repeatable; dotted keys nest "
        "(client_kwargs.endpoint_url=http://127.0.0.1:9000); true/false/null/numbers "
        'are parsed, quote a value as JSON ("123") to keep it a string',
    )
    return parent


def _progress_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_mutually_exclusive_group()
    group.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="draw a progress bar on stderr even when it is not a terminal",
    )
    group.add_argument("--no-progress", dest="progress", action="store_false")
    return parent


def _add_restore_parser(sub: Any, progress: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "restore",
        parents=[_uri_parent(required=False), progress],
        help="write a checkpoint as one file, or roll a live job back (--coordinator)",
        description="Write a consolidated checkpoint to --out (torch.save of "
        "{name: state_dict}, or a flat safetensors file), or with --coordinator URL "
        "--job J roll a running job back to a checkpoint.",
    )
    p.add_argument("--step", type=int, help="the step (default: the newest committed)")
    p.add_argument("--out", metavar="PATH", help="the file to write")
    p.add_argument(
        "--format",
        choices=("torch", "safetensors", "dcp"),
        default="torch",
        help="torch/safetensors: one file; dcp: a PyTorch Distributed Checkpoint folder",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument(
        "--trust",
        action="store_true",
        help="unpickle objects stored as pickles (saved with allow_pickle=True, or by an "
        "older checkflow); this runs code from the checkpoint: only for one you trust",
    )
    p.add_argument("--coordinator", metavar="URL", help="roll the job back through it")
    p.add_argument("--job", help="the job's name on the coordinator")
    p.add_argument(
        "--token",
        default=os.environ.get("CHECKFLOW_TOKEN"),
        help="coordinator bearer token (default: $CHECKFLOW_TOKEN)",
    )
    p.set_defaults(func=cmd_restore)


def _add_coordinator_parsers(sub: Any) -> None:
    try:
        from checkflow import cli_coordinator
    except ImportError as e:
        # The coordinator commands need the service's modules; the checkpoint commands
        # must keep working without them, so only these two say what is missing.
        reason = f"the coordinator commands are unavailable in this install ({e})"
        for name in ("serve", "status"):
            p = sub.add_parser(name, help=f"coordinator command (unavailable: {e})")
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(func=_unavailable(reason))
        return
    cli_coordinator.add_serve_parser(sub)
    cli_coordinator.add_status_parser(sub)


def _unavailable(reason: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise CliError(f"{reason}; reinstall checkflow with 'pip install checkflow'")

    return run


# -- shared helpers --------------------------------------------------------------------------
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


def open_root(args: argparse.Namespace) -> Any:
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


def step_folders(storage: Any) -> list[int]:
    from checkflow import manifest as mf

    steps = (mf.parse_step_dir(name) for name in storage.listdir())
    return sorted(s for s in steps if s is not None)


def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """Columns padded to their widest cell; ``right`` holds right-aligned column indexes."""
    right = right or set()
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def fmt_time(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def fmt_steps(steps: Any) -> str:
    return ",".join(str(s) for s in sorted(steps)) or "-"


def fmt_shape(shape: list[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# -- ls --------------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    """Committed checkpoints as a table; uncommitted step folders as a note (or rows)."""
    storage = open_root(args)
    from checkflow.catalog import committed_steps

    steps = committed_steps(storage)
    partial = [s for s in step_folders(storage) if s not in steps]
    if args.json:
        records = [
            {
                "step": s,
                "kind": m.kind,
                "base_steps": m.base_steps,
                "world_size": m.world_size,
                "nbytes": m.nbytes,
                "created": m.created,
            }
            for s, m in steps.items()
        ]
        print(json.dumps({"uri": args.uri, "checkpoints": records, "uncommitted": partial}))
        return EXIT_OK
    if not steps and not partial:
        print(f"no checkpoints in {args.uri}")
        return EXIT_OK
    rows_by_step = {
        s: [str(s), m.kind, fmt_steps(m.base_steps), str(m.world_size), human_bytes(m.nbytes)]
        + [fmt_time(m.created)]
        for s, m in steps.items()
    }
    if args.all:
        rows_by_step.update({s: [str(s), "partial", "-", "-", "-", "-"] for s in partial})
    rows = [rows_by_step[s] for s in sorted(rows_by_step)]
    if rows:
        print(table(["STEP", "KIND", "BASE", "WORLD", "SIZE", "CREATED"], rows, {0, 3, 4}))
    else:
        print(f"no committed checkpoint in {args.uri}")
    if partial:
        print()
        names = ", ".join(str(s) for s in partial)
        hint = "" if args.all else "; --all lists them"
        print(
            f"note: {len(partial)} uncommitted step folder(s) without MANIFEST.json "
            f"(in flight, or abandoned: gc removes those older than the newest commit): "
            f"{names}{hint}"
        )
    return EXIT_OK


# -- inspect ---------------------------------------------------------------------------------
@dataclass(slots=True)
class TensorSummary:
    fqn: str
    dtype: str
    shape: list[int]
    codecs: list[str] = field(default_factory=list)
    base_steps: set[int] = field(default_factory=set)
    nbytes: int = 0
    chunks: int = 0
    ranks: set[int] = field(default_factory=set)


def summarize_tensors(rank_manifests: list[Any]) -> list[TensorSummary]:
    """One summary per tensor over every rank's chunks, in stored order."""
    out: dict[str, TensorSummary] = {}
    for rm in rank_manifests:
        for c in rm.chunks:
            s = out.setdefault(c.fqn, TensorSummary(c.fqn, c.dtype, list(c.global_shape)))
            if c.codec not in s.codecs:
                s.codecs.append(c.codec)
            if c.base_step is not None:
                s.base_steps.add(c.base_step)
            s.nbytes += c.nbytes
            s.chunks += 1
            s.ranks.add(rm.rank)
    return list(out.values())


def object_leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted name, short text) of every non-tensor leaf of a skeleton."""
    from checkflow.state import TensorRef

    if isinstance(value, TensorRef):
        return
    if not prefix and not isinstance(value, Mapping):
        prefix = "*"  # one opaque pickle of every object (an older checkpoint)
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from object_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list | tuple) and len(value) <= 16:
        for i, v in enumerate(value):
            yield from object_leaves(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, _short(value)


def _short(value: Any, limit: int = 60) -> str:
    if isinstance(value, list | tuple):
        return f"<{type(value).__name__} of {len(value)} items>"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:  # numpy arrays (numpy RNG state)
        return f"<{type(value).__name__} {dtype} {tuple(shape)}>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cmd_inspect(args: argparse.Namespace) -> int:
    """Tensors (fqn, dtype, shape, codecs, bases, bytes, chunks) and objects of one step."""
    storage = open_root(args)
    from checkflow.restore import CheckpointReader, CorruptCheckpointError, resolve_step

    step = resolve_step(storage, args.step)
    reader = CheckpointReader(storage)
    g = reader.manifest(step)
    tensors = summarize_tensors(reader.rank_manifests(step))
    try:
        # Opaque: inspect describes pickled objects (type, size) and never unpickles them.
        objects = list(object_leaves(reader.skeleton(step, 0, opaque=True)))
        objects_error = None
    except CorruptCheckpointError as e:
        objects, objects_error = [], str(e)
    if args.json:
        print(json.dumps(_inspect_json(args.uri, g, tensors, objects, objects_error)))
        return EXIT_FAILED if objects_error else EXIT_OK
    print(f"checkpoint step {step} in {args.uri}")
    print(
        f"  kind {g.kind}, base steps {fmt_steps(g.base_steps)}, world size {g.world_size}, "
        f"{human_bytes(g.nbytes)} stored, created {fmt_time(g.created)}"
    )
    if g.meta:
        print(f"  meta {json.dumps(g.meta, sort_keys=True, default=str)}")
    print()
    rows = [
        [t.fqn, t.dtype, fmt_shape(t.shape), ",".join(t.codecs), fmt_steps(t.base_steps)]
        + [human_bytes(t.nbytes), str(t.chunks)]
        for t in tensors
    ]
    headers = ["TENSOR", "DTYPE", "SHAPE", "CODEC", "BASE", "BYTES", "CHUNKS"]
    print(table(headers, rows, {5, 6}))
    elements = sum(math.prod(t.shape) for t in tensors)
    stored = sum(t.nbytes for t in tensors)
    print(f"{len(tensors)} tensors, {elements} elements, {human_bytes(stored)} stored")
    print()
    if objects_error:
        print(f"objects: unreadable: {objects_error}")
        return EXIT_FAILED
    who = "" if g.world_size == 1 else f" (rank 0 of {g.world_size})"
    print(table([f"OBJECT{who}", "VALUE"], [[n, v] for n, v in objects]))
    return EXIT_OK


def _inspect_json(
    uri: str, g: Any, tensors: list[TensorSummary], objects: list[tuple[str, str]], err: Any
) -> dict[str, Any]:
    return {
        "uri": uri,
        "step": g.step,
        "kind": g.kind,
        "base_steps": g.base_steps,
        "world_size": g.world_size,
        "nbytes": g.nbytes,
        "created": g.created,
        "meta": g.meta,
        "tensors": [
            {
                "fqn": t.fqn,
                "dtype": t.dtype,
                "shape": t.shape,
                "codecs": t.codecs,
                "base_steps": sorted(t.base_steps),
                "nbytes": t.nbytes,
                "chunks": t.chunks,
                "ranks": sorted(t.ranks),
            }
            for t in tensors
        ],
        "objects": dict(objects),
        "objects_error": err,
    }


# -- verify ----------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    """Read and decode every chunk of one (or every) committed step; exit 1 on any problem."""
    storage = open_root(args)
    from checkflow import manifest as mf
    from checkflow.catalog import committed_steps
    from checkflow.restore import CheckpointReader, NoCheckpointError, resolve_step

    committed = committed_steps(storage)
    # A MANIFEST.json that exists but cannot be parsed hides its step from the listing;
    # verify must report it rather than pass over it.
    unreadable = [
        s
        for s in step_folders(storage)
        if s not in committed
        and (args.all or s == args.step)
        and storage.exists(f"{mf.step_dir(s)}/{mf.MANIFEST}")
    ]
    if args.all:
        steps = list(committed)
        if not steps and not unreadable:
            raise NoCheckpointError(f"no committed checkpoint in {args.uri}")
    elif unreadable:
        steps = []
    else:
        steps = [resolve_step(storage, args.step)]
    failed = 0
    for s in unreadable:
        print(f"FAIL step {s}: {mf.step_dir(s)}/{mf.MANIFEST} is unreadable (see the warning)")
        failed += 1
    reader = CheckpointReader(storage)
    for step in steps:
        total = committed[step].nbytes
        with ProgressBar(total, f"verify step {step}", enabled=args.progress) as bar:
            reader.progress = bar
            problems = reader.verify(step)
        for p in problems:
            print(f"FAIL {p}")
        if problems:
            failed += 1
        else:
            print(f"step {step}: OK ({human_bytes(total)} read and decoded)")
    if failed:
        n = len(steps) + len(unreadable)
        raise CliError(
            f"verification failed: {failed} of {n} checkpoint(s) have problems; restore an "
            "older step with --step, and remove a damaged newest one before resuming",
            EXIT_FAILED,
        )
    return EXIT_OK


# -- restore ---------------------------------------------------------------------------------
def cmd_restore(args: argparse.Namespace) -> int:
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
    _check_out(out, args.force)
    from checkflow.restore import CheckpointReader, resolve_step

    storage = open_root(args)
    step = resolve_step(storage, args.step)
    reader = CheckpointReader(storage, trust=args.trust)
    g = reader.manifest(step)
    with ProgressBar(g.nbytes, f"restore step {step}", enabled=args.progress) as bar:
        reader.progress = bar
        if args.format == "torch":
            write = _torch_writer(reader.state_dicts(step))
        else:
            write = _safetensors_writer(reader, step, args.uri)
    write_atomic(out, write, force=args.force)
    print(
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
    from checkflow.restore import resolve_step

    step = resolve_step(open_root(args), args.step)
    options = parse_storage_options(args.storage_options)
    written = export_dcp(args.uri, step, out, storage_options=options, trust=args.trust)
    print(f"restored step {written} from {args.uri} to {out} (dcp)")
    return EXIT_OK


def cmd_import_dcp(args: argparse.Namespace) -> int:
    """Commit a PyTorch Distributed Checkpoint folder as a checkflow checkpoint."""
    if not os.path.isfile(os.path.join(args.dcp_dir, ".metadata")):
        raise CliError(f"{args.dcp_dir} is not a DCP checkpoint (no .metadata file in it)")
    from checkflow.catalog import scan
    from checkflow.interop import import_dcp
    from checkflow.storage import Storage

    options = parse_storage_options(args.storage_options)
    if args.step in scan(Storage(args.uri, storage_options=options)).folders:
        raise CliError(f"{args.uri} already has a step {args.step}; pick another --step")
    step = import_dcp(args.dcp_dir, args.uri, step=args.step, storage_options=options)
    print(f"imported {args.dcp_dir} into {args.uri} as step {step}")
    return EXIT_OK


def _roll_back(args: argparse.Namespace) -> int:
    if not (args.coordinator and args.job):
        raise CliError("--coordinator URL and --job NAME go together to roll a live job back")
    if args.uri or args.out:
        raise CliError(
            "with --coordinator, restore rolls the live job back (its ranks reload the "
            "checkpoint themselves); drop URI/--out, or drop --coordinator/--job to write a file"
        )
    try:
        from checkflow.cli_coordinator import roll_back
    except ImportError as e:
        raise CliError(f"rolling a job back needs the coordinator client, missing here: {e}") from e
    return int(roll_back(args.coordinator, args.job, args.step, args.token))


def _check_out(out: str, force: bool) -> None:
    if os.path.isdir(out):
        raise CliError(f"--out {out} is a directory; give a file path")
    if os.path.lexists(out) and not force:
        raise CliError(f"{out} already exists; choose another --out or pass --force to replace it")
    folder = os.path.dirname(out)
    if not os.path.isdir(folder):
        raise CliError(f"the folder of --out {out} does not exist; create it first")


def _torch_writer(state_dicts: dict[str, Any]) -> Callable[[str], None]:
    import torch

    def write(path: str) -> None:
        torch.save(state_dicts, path)

    return write


def _safetensors_writer(reader: Any, step: int, uri: str) -> Callable[[str], None]:
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise CliError(
            "--format safetensors needs the safetensors package: pip install safetensors"
        ) from e
    tensors = {k: v.contiguous() for k, v in reader.tensors(step).items()}
    g = reader.manifest(step)
    metadata = {
        "format": "pt",
        "checkflow.step": str(step),
        "checkflow.source": uri,
        "checkflow.kind": g.kind,
        "checkflow.world_size": str(g.world_size),
        "checkflow.skeleton": json.dumps(jsonable(reader.skeleton(step, 0, opaque=True))),
    }

    def write(path: str) -> None:
        try:
            save_file(tensors, path, metadata=metadata)
        except (ValueError, TypeError, RuntimeError) as e:
            raise CliError(
                f"safetensors cannot store this checkpoint ({e}); use --format torch"
            ) from e

    return write


def jsonable(value: Any) -> Any:
    """A skeleton as JSON: tensors as ``{"$tensor": fqn}``, unknown objects as their repr."""
    from checkflow.state import TensorRef

    if isinstance(value, TensorRef):
        return {"$tensor": value.fqn}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no nan/inf
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return {"$repr": _short(value, 200)}


def write_atomic(out: str, write: Callable[[str], None], *, force: bool) -> None:
    """Write via ``write(tmp)`` next to ``out``, fsync, then move it into place.

    Without ``force`` an ``out`` that appeared meanwhile is not replaced (hard link = an
    atomic create-if-absent); a reader never sees a partial file either way.
    """
    from checkflow.storage import fsync_dir

    folder, name = os.path.split(out)
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, out)
        else:
            _link_no_clobber(tmp, out)
        fsync_dir(folder)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def _link_no_clobber(tmp: str, out: str) -> None:
    try:
        os.link(tmp, out)
    except FileExistsError:
        raise CliError(f"{out} appeared while restoring; pass --force to replace it") from None
    except OSError:
        # Some filesystems have no hard links; fall back to check-then-rename.
        if os.path.lexists(out):
            raise CliError(f"{out} already exists; pass --force to replace it") from None
        os.replace(tmp, out)


# -- gc --------------------------------------------------------------------------------------
def cmd_gc(args: argparse.Namespace) -> int:
    """Keep the ``--keep`` newest committed checkpoints (and the bases they need)."""
    if args.keep < 1:
        raise CliError(
            f"--keep must be at least 1 (got {args.keep}); gc keeps the newest checkpoints, "
            "to delete a whole run remove its folder yourself"
        )
    from checkflow.catalog import apply_retention, committed_steps, retention_plan

    storage = open_root(args)
    steps = committed_steps(storage)
    if not steps:
        raise CliError(
            f"no committed checkpoint in {args.uri}, so nothing to keep; gc deletes nothing "
            f"there; check the URI or run 'checkflow ls {args.uri}'"
        )
    keep, _ = retention_plan(steps, step_folders(storage), args.keep)
    delete = apply_retention(storage, args.keep, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for s in delete:
        what = f"{steps[s].kind}, {human_bytes(steps[s].nbytes)}" if s in steps else "uncommitted"
        print(f"{verb} step {s} ({what})")
    extra = [s for s in keep if s not in sorted(steps)[-args.keep :]]
    needed = f" (bases still needed: {fmt_steps(extra)})" if extra else ""
    print(f"kept {len(keep)} checkpoint(s): {fmt_steps(keep)}{needed}")
    if args.dry_run:
        return EXIT_OK
    remaining = set(step_folders(storage))
    left = [s for s in delete if s in remaining]
    if left:
        raise CliError(
            f"could not delete step(s) {fmt_steps(left)} (see the warnings); run gc again",
            EXIT_FAILED,
        )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
