"""An SPMD checkpoint written by stand-in hosts: each writes only its devices' shards, at
their global offsets, and the union restores whole on the CPU and onto another mesh.

A 4-device virtual mesh (2 x 2, ``CPU_NUM_DEVICES=4``) split into hosts {0, 1} and {2, 3};
the mesh's first axis runs across the hosts, so each host's shards are the upper or the
lower half of every tensor (biases: partially replicated, written once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("_spmd_hosts.py")


def test_stand_in_hosts_write_only_their_shards_and_the_union_restores_whole(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    halves = {"0": 0, "1": 1}
    for host, boxes in report["written"].items():
        assert boxes, f"host {host} wrote no shard"
        for fqn, offset, shape in boxes:
            # dim 0 is split over the mesh's first axis, which runs across the hosts
            rows = shape[0] * 2
            assert offset[0] == halves[host] * shape[0], (host, fqn, offset, rows)
    ours = {(f, tuple(o)) for f, o, _ in report["written"]["0"]}
    theirs = {(f, tuple(o)) for f, o, _ in report["written"]["1"]}
    assert not ours & theirs, "a shard was written by both hosts"
    assert report["cpu_equal"], "the union read on the CPU differs from the trained state"
    assert report["mesh_equal"], "restored onto a 1-D mesh, the state differs"
    assert report["restored"] == 3
