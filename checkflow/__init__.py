"""checkflow: frequent, incremental, exact checkpoints for distributed PyTorch training."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkflow.checkpointer import Checkpointer
    from checkflow.config import CheckpointConfig
    from checkflow.restore import CheckpointInfo, list_checkpoints, load

__all__ = ["CheckpointConfig", "Checkpointer", "CheckpointInfo", "list_checkpoints", "load"]
__version__ = "0.1.0"

# Imported lazily (PEP 562): the coordinator shares the pure modules checkflow.interval and
# checkflow.manifest, and importing them must not pull in torch through this package.
_LAZY = {
    "Checkpointer": "checkflow.checkpointer",
    "CheckpointConfig": "checkflow.config",
    "CheckpointInfo": "checkflow.restore",
    "list_checkpoints": "checkflow.restore",
    "load": "checkflow.restore",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'checkflow' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
