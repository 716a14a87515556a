"""checkflow: frequent, incremental, exact checkpoints for distributed PyTorch training."""

from __future__ import annotations

from checkflow.checkpointer import Checkpointer
from checkflow.restore import CheckpointInfo, list_checkpoints, load

__all__ = ["Checkpointer", "CheckpointInfo", "list_checkpoints", "load"]
__version__ = "0.1.0"
