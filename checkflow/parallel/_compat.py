"""Every private torch function checkflow's runtime calls, in one place (the launcher's
overrides of torch's elastic agent are ``checkflow.launch.agent`` and ``checkflow.launch.warm``:
they subclass torch's classes, so they cannot go through functions here).

torch may rename or move these between releases; when it does, this module is the only one
to change in the runtime. Each function says what it stands for, so a caller never names a
private path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_shape_and_offset(
    global_shape: Any, mesh: Any, placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of a tensor laid out on ``mesh``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(shape), tuple(offset)


def default_store() -> Any:
    """The c10d store of the default process group (the one ``init_process_group`` made)."""
    return dist.distributed_c10d._get_default_store()


def is_shard_placement(placement: Any) -> bool:
    from torch.distributed.tensor import Shard as ShardPlacement

    return isinstance(placement, ShardPlacement)


def dtensor_from_local(
    local: torch.Tensor, mesh: Any, placements: tuple[Any, ...], global_shape: tuple[int, ...]
) -> Any:
    """A DTensor of ``global_shape`` whose shard on this rank is ``local`` (no collective)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(global_shape),
        stride=torch.empty(global_shape, device="meta").stride(),
    )
