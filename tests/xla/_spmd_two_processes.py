"""One of two processes that try to share one SPMD mesh on XLA:CPU (PJRT_DEVICE=CPU).

Each process is started with the environment a multi-host launch gives (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``PJRT_LOCAL_PROCESS_RANK``,
``PJRT_LOCAL_PROCESS_COUNT``, ``MASTER_ADDR``, ``XLA_COORDINATOR_PORT``) and
``CPU_NUM_DEVICES=2``; it reports how many processes and devices torch_xla's runtime sees,
and what happens when it builds a mesh over the 4 devices of both. Prints one JSON line.
"""

from __future__ import annotations

import json

import numpy as np
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr


def main() -> None:
    xr.use_spmd()
    report = {
        "process_index": xr.process_index(),
        "process_count": xr.process_count(),
        "global_devices": xr.global_runtime_device_count(),
        "addressable_devices": xr.addressable_runtime_device_count(),
        "mesh_error": None,
    }
    try:
        xs.Mesh(np.arange(4), (4,), ("x",))
    except Exception as e:  # whatever torch_xla raises is the finding
        report["mesh_error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(report))


if __name__ == "__main__":
    main()
