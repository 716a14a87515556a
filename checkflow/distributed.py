"""The public face of ``checkflow.parallel`` and the resharded reads, kept where users and
the ``Checkpointer`` have always imported them (``from checkflow.distributed import
ModelState``). The code lives in ``checkflow.parallel`` (groups, sharding, agreement,
adapters) and ``checkflow.read.state_dicts``.
"""

from __future__ import annotations

from checkflow.parallel.adapters import (
    ModelState,
    live_layouts,
    live_state,
    local_pointers,
    prepare_snapshot,
)
from checkflow.parallel.agreement import (
    Agreement,
    RankSync,
    RestoreAgreement,
    StoreCommit,
    newest_readable,
    restore_point,
)
from checkflow.parallel.groups import checkpoint_group, rank_and_world, resolve_group
from checkflow.parallel.sharding import (
    Layout,
    LiveState,
    LocalState,
    Shard,
    balanced_writers,
    dtensor_box,
    global_state_names,
    snapshot_inputs,
    split_state,
)
from checkflow.read.state_dicts import consolidated_state_dicts, read_box, read_state_dicts

__all__ = [
    "Agreement",
    "Layout",
    "LiveState",
    "LocalState",
    "ModelState",
    "RankSync",
    "RestoreAgreement",
    "Shard",
    "StoreCommit",
    "balanced_writers",
    "checkpoint_group",
    "consolidated_state_dicts",
    "dtensor_box",
    "global_state_names",
    "live_layouts",
    "live_state",
    "local_pointers",
    "newest_readable",
    "prepare_snapshot",
    "rank_and_world",
    "read_box",
    "read_state_dicts",
    "resolve_group",
    "restore_point",
    "snapshot_inputs",
    "split_state",
]
