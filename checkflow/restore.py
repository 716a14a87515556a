"""The public face of ``checkflow.read``, kept where users have always imported it
(``checkflow.restore.load``, the error classes). The code lives in ``checkflow.read``.
"""

from __future__ import annotations

from checkflow.read.api import CheckpointInfo, list_checkpoints, load, open_storage, resolve_step
from checkflow.read.errors import (
    RESTORE_ERRORS,
    CorruptCheckpointError,
    NoCheckpointError,
    UntrustedCheckpointError,
)
from checkflow.read.reader import CheckpointReader, Progress

__all__ = [
    "RESTORE_ERRORS",
    "CheckpointInfo",
    "CheckpointReader",
    "CorruptCheckpointError",
    "NoCheckpointError",
    "Progress",
    "UntrustedCheckpointError",
    "list_checkpoints",
    "load",
    "open_storage",
    "resolve_step",
]
