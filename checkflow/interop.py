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
from pathlib import Path
from typing import Any

import torch

from checkflow.restore import load

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
    import torch.distributed.checkpoint as dcp

    state = load(uri, step, storage_options=storage_options, trust=trust)
    meta = state.pop(_META_KEY, {})
    state.pop(_RNG_KEY, None)
    written = int(meta.get("step", step or 0))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out_dir)))
    log.info("exported step %d of %s as DCP to %s", written, uri, out_dir)
    return written


def import_dcp(
    dcp_dir: str | Path,
    uri: str,
    *,
    step: int = 0,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Read the DCP checkpoint in ``dcp_dir`` and commit it as ``step`` under ``uri``.

    Each top-level DCP key becomes a state name (``model``, ``optim``...). Returns ``step``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(dcp_dir))
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            flat[key] = None  # bytes entries (ints, lists) are filled in by load
    dcp.load(flat, storage_reader=reader)
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
