"""Interoperability with PyTorch Distributed Checkpoint (DCP).

``export_dcp`` writes a committed checkflow checkpoint as a DCP checkpoint that
``torch.distributed.checkpoint.load`` reads into any layout (FSDP2, DDP, one process):
DCP reshards full tensors on load. ``import_dcp`` brings a DCP checkpoint in as a committed
checkflow step. Both run in one process and hold the consolidated state in memory.

State names map to DCP's top-level keys: the checkflow state ``{"model": ..., "optim": ...}``
becomes ``{"model": model_sd, "optim": optim_sd}`` in DCP, so load with::

    sd = {"model": get_model_state_dict(fsdp_model)}
    dcp.load(sd, checkpoint_id=out_dir)
    set_model_state_dict(fsdp_model, sd["model"])
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from checkflow.dcp_pickle import (
    DamagedPickleError,
    RefusedPickleError,
    SafeFileSystemReader,
    SafeLoadPlanner,
)
from checkflow.read.api import load
from checkflow.read.errors import UntrustedCheckpointError
from checkflow.storage import write_error

log = logging.getLogger(__name__)

_META_KEY = "__checkflow__"
_RNG_KEY = "rng"


def export_dcp(
    uri: str,
    step: int | None,
    out_dir: str | Path,
    *,
    storage_options: dict[str, Any] | None = None,
    trust: bool = False,
) -> int:
    """Write checkpoint ``step`` (the newest when None) of ``uri`` as DCP into ``out_dir``.

    Per-rank state (RNG) is left out: DCP has no per-rank values. Returns the step written.
    ``trust`` is ``load``'s: unpickle objects stored as pickles.

    Raises:
        NoCheckpointError: nothing is committed (at ``step``).
        UntrustedCheckpointError: an object is a pickle and ``trust`` is False.
    """
    state = load(uri, step, storage_options=storage_options, trust=trust)
    meta = state.pop(_META_KEY, {})
    state.pop(_RNG_KEY, None)
    written = int(meta.get("step", step or 0))
    out = Path(out_dir).absolute()
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        # Into a hidden sibling first: a full disk or a crash leaves no partial folder
        # under the name a user (or dcp.load) would read.
        tmp.mkdir()
        _save(state, tmp)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported step %d of %s as DCP to %s", written, uri, out_dir)
    return written


def _save(state: dict[str, Any], folder: Path) -> None:
    """``dcp.save`` into ``folder``; a write failure (full disk, read-only folder) raises its
    ``OSError`` rather than DCP's ``CheckpointException``, which is not even an
    ``Exception``, around torch's ``RuntimeError: ... unexpected pos``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _one_process():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))
    except CheckpointException as e:
        for failure in _failures(e):
            cause = write_error(failure)
            if cause is not None:
                raise OSError(cause.errno, cause.strerror, str(folder)) from e
        raise


@contextmanager
def _one_process() -> Iterator[None]:
    """Silence DCP's warning that no process group is set up: a single-process export or
    import is what is meant here, and the CLI prints one line, not torch's warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _failures(e: BaseException) -> list[BaseException]:
    """What each rank raised, from DCP's ``CheckpointException`` (rank order)."""
    found = []
    for _, failure in sorted(getattr(e, "failures", {}).items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, BaseException):
            found.append(cause)
    return found


def _cause(e: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first ``kind`` among the ranks' failures of DCP's ``CheckpointException``."""
    return next((f for f in _failures(e) if isinstance(f, kind)), None)


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished folder ``tmp`` to ``out``; an old ``out`` (``--force``) is moved
    aside first and removed only once the new one is in place."""
    old = None
    if out.exists() and any(out.iterdir()):
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(out, old)
    elif out.exists():
        out.rmdir()  # empty: nothing to keep
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def import_dcp(
    dcp_dir: str | Path,
    uri: str,
    *,
    step: int = 0,
    storage_options: dict[str, Any] | None = None,
    trust: bool = False,
) -> int:
    """Read the DCP checkpoint in ``dcp_dir`` and commit it as ``step`` under ``uri``.

    Each top-level DCP key becomes a state name (``model``, ``optim``...). Returns ``step``.

    Args:
        trust: read DCP's pickles as torch does (``pickle.load``), which runs any code they
            name. Without it only DCP's own metadata classes and ``weights_only`` values are
            read (``checkflow.dcp_pickle``).

    Raises:
        UntrustedCheckpointError: a pickle names anything else, and ``trust`` is False.
        ValueError: ``.metadata`` is damaged or holds no DCP metadata (``trust`` False).
    """
    try:
        return _import_dcp(dcp_dir, uri, step, storage_options, trust)
    except RefusedPickleError as e:
        raise UntrustedCheckpointError(
            f"{dcp_dir} is refused: its {e.what} names {e.name:.200}, which dcp.save never "
            "writes, and unpickling it could run code; if you trust whoever wrote it, pass "
            "--trust to 'checkflow import-dcp' (trust=True to import_dcp())"
        ) from None
    except DamagedPickleError as e:
        raise ValueError(
            f"{dcp_dir} is not a readable DCP checkpoint: its {e}; import the folder "
            "dcp.save wrote, whole"
        ) from None


def _import_dcp(
    dcp_dir: str | Path,
    uri: str,
    step: int,
    storage_options: dict[str, Any] | None,
    trust: bool,
) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if trust:
        reader, planner = dcp.FileSystemReader(str(dcp_dir)), None
    else:
        reader, planner = SafeFileSystemReader(str(dcp_dir)), SafeLoadPlanner()
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            flat[key] = None  # bytes entries (ints, lists) are filled in by load
    try:
        with _one_process():
            dcp.load(flat, storage_reader=reader, planner=planner)
    except CheckpointException as e:  # DCP wraps what each rank raised, ours included
        refused = _cause(e, RefusedPickleError)
        if refused is None:
            raise
        raise refused from None
    paths = metadata.planner_data or {}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        _set_path(nested, tuple(paths.get(key, (key,))), value)
    _commit_state(nested, uri, step, storage_options)
    log.info("imported DCP %s into %s as step %d", dcp_dir, uri, step)
    return step


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    # DCP writes dict keys as strings; optimizer state is keyed by parameter index.
    path = tuple(int(p) if isinstance(p, str) and p.isdigit() else p for p in path)
    node = root
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


class _Holder:
    """A plain state_dict presented as a state object."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def _commit_state(
    state: dict[str, Any], uri: str, step: int, storage_options: dict[str, Any] | None
) -> None:
    from checkflow.codec import CodecRules
    from checkflow.state import flatten
    from checkflow.storage import Storage
    from checkflow.write.commit import SingleProcessCommit
    from checkflow.write.persist import PersistWorker
    from checkflow.write.snapshot import Snapshotter

    flat = flatten({name: _Holder(sd) for name, sd in state.items()})
    flat.skeleton[_META_KEY] = {"step": step}
    snapshotter = Snapshotter(buffer_sets=1)
    pool, _ = snapshotter.buffers.acquire()
    worker = PersistWorker(
        Storage(uri, storage_options=storage_options),
        codecs=CodecRules("exact"),
        commit=SingleProcessCommit(),
        keep=0,
    )
    try:
        worker.submit(snapshotter.take(step, flat, set(), pool)).result()
    finally:
        worker.close()
        snapshotter.close()
