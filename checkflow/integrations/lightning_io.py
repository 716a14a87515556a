"""A Lightning ``CheckpointIO`` that stores Lightning checkpoints in checkflow's format.

``Trainer(plugins=[CheckflowCheckpointIO()])`` routes ``trainer.save_checkpoint(path)``,
``ModelCheckpoint``'s exports and ``fit(ckpt_path=path)`` through checkflow's storage: each
path is a checkflow checkpoint folder (one committed step, the Lightning ``global_step``),
on any fsspec URL, with checksummed chunks, tensors as raw bytes and everything else as
data. Loading never runs code from the checkpoint unless the plugin is given
``trust=True``: a value that is not data (an object in ``hyper_parameters``) is refused
when saving, naming where it is, unless ``allow_pickle=True`` (README, "Safe loading").

Lightning calls ``save_checkpoint`` on global rank 0 only, so the checkpoint is written and
committed by this one process, without the process group.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning.fabric.plugins import CheckpointIO

from checkflow.catalog import delete_folders, scan
from checkflow.codec import CodecRules
from checkflow.read.api import load
from checkflow.state import flatten
from checkflow.storage import Storage
from checkflow.write.commit import SingleProcessCommit
from checkflow.write.persist import PersistWorker
from checkflow.write.snapshot import Snapshotter

log = logging.getLogger(__name__)

STATE_NAME = "lightning"
"""The one state name a Lightning checkpoint is stored under."""


class _Checkpoint:
    """A Lightning checkpoint dict as a state object."""

    def __init__(self, checkpoint: dict[str, Any]) -> None:
        self.checkpoint = checkpoint

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checkpoint = state


class CheckflowCheckpointIO(CheckpointIO):
    """Lightning checkpoints as checkflow checkpoints.

    Args:
        codec: checkflow codec name, or ``{glob on fqn: name}`` (fqns start with
            ``lightning.``, e.g. ``lightning.state_dict.layer.weight``).
        storage_options: passed to fsspec (credentials, endpoint); a ``storage_options``
            given to ``save_checkpoint`` wins.
        allow_pickle: store values that are not data as pickles (loading them needs
            ``trust``).
        trust: unpickle such values when loading.
    """

    def __init__(
        self,
        *,
        codec: str | dict[str, str] = "exact",
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        trust: bool = False,
    ) -> None:
        self.codecs = CodecRules(codec)
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self.trust = trust

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` under ``path`` and commit it before returning.

        Raises:
            UnstorableObjectError: a value is not data and ``allow_pickle`` is False.
        """
        step = int(checkpoint.get("global_step", 0))
        options = storage_options if storage_options is not None else self.storage_options
        flat = flatten({STATE_NAME: _Checkpoint(checkpoint)}, allow_pickle=self.allow_pickle)
        flat.skeleton["__checkflow__"] = {"step": step}
        storage = Storage(os.fspath(path), storage_options=options)
        _clear(storage)
        snapshotter = Snapshotter(buffer_sets=1)
        worker = PersistWorker(
            storage,
            codecs=self.codecs,
            commit=SingleProcessCommit(),
            keep=1,
            allow_pickle=self.allow_pickle,
        )
        try:
            pool, _ = snapshotter.buffers.acquire()
            worker.submit(snapshotter.take(step, flat, set(), pool)).result()
        finally:
            worker.close()
            snapshotter.close()
        log.debug("saved Lightning checkpoint at step %d to %s", step, path)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The Lightning checkpoint stored under ``path``, tensors on the CPU.

        ``map_location`` and ``weights_only`` are ``torch.load``'s: Lightning moves the
        tensors when it loads them into the module and optimizers, and nothing here runs
        code from the checkpoint unless the plugin was given ``trust=True``.

        Raises:
            NoCheckpointError: nothing is committed under ``path``.
            UntrustedCheckpointError: a value is a pickle and ``trust`` is False.
        """
        state = load(os.fspath(path), storage_options=self.storage_options, trust=self.trust)
        checkpoint: dict[str, Any] = state[STATE_NAME]
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint folder ``path`` (``ModelCheckpoint`` drops a worse export)."""
        parent, name = _split(os.fspath(path))
        Storage(parent, storage_options=self.storage_options).delete(name)


def _split(path: str) -> tuple[str, str]:
    """``(parent, last part)`` of a local path or URL."""
    head, _, name = str(path).rstrip("/").rpartition("/")
    if not name:
        raise ValueError(f"cannot tell the parent folder of checkpoint path {path!r}")
    return head or ".", name


def _clear(storage: Storage) -> None:
    """Delete every checkpoint under ``path`` before a save there. Lightning saves to one
    path again (``last.ckpt``, a resumed run's ``step=N.ckpt``) and expects the save to
    replace what is there, as its own ``torch.save`` does; a committed folder is never
    rewritten in place (a crash half-way would mix two saves), and ``keep=1`` would keep an
    older save of a higher step over the new one. Markers go first: a half-deleted old save
    is invisible, never read."""
    cat = scan(storage)
    folders = [(s, cat.names.get(s, "")) for s in cat.folders]
    folders += [(-1, name) for name in cat.abandoned]
    failed = delete_folders(storage, [(s, name) for s, name in folders if name])
    if failed:
        raise OSError(f"cannot replace the checkpoint at {storage.uri}: {failed[0].reason}")
