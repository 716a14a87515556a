"""Restoring an SPMD checkpoint, each stand-in host reads from storage only the chunks of
its own shards, and the shards placed on the devices are bitwise the saved state.

The checkpoint is written by stand-in hosts {0, 1} and {2, 3} of a 2 x 2 virtual mesh
(``_spmd_hosts``), into fsspec's in-memory filesystem; reads go through the same filesystem
under a protocol that records each byte range (``_spmd_host_reads``). Exact codec, so a
chunk's bytes are its elements' bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).with_name("_spmd_host_reads.py")


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _written_by(stored: list[list[Any]], rank: int) -> Counter[tuple[str, int]]:
    """The sharded chunks (not the scalar ``step`` each host also wrote) of ``rank``."""
    return Counter((f, n) for r, f, n in stored if r == rank and not f.endswith(".step"))


@pytest.mark.parametrize("mesh", ["same_mesh", "other_mesh"])
def test_each_stand_in_host_reads_only_the_chunks_of_its_own_shards_once(
    report: dict[str, Any], mesh: str
) -> None:
    run = report[mesh]
    total = sum(n for _r, f, n in run["stored"] if not f.endswith(".step"))
    for host in ("0", "1"):
        reads = run["hosts"][host]
        assert reads["other"] == [], f"host {host} read bytes that are no chunk: {reads['other']}"
        assert reads["objects"] == 0
        got = Counter((f, n) for _r, f, n in reads["chunks"])
        assert {r for r, _f, _n in reads["chunks"]} == {int(host)}, "read another host's shards"
        # every chunk its devices' boxes overlap, each once (on the 1-D mesh two devices'
        # boxes overlap the same chunk: it is still read once)
        assert got == _written_by(run["stored"], int(host))
        assert sum(n for _r, _f, n in reads["chunks"]) == total // 2


@pytest.mark.parametrize("mesh", ["same_mesh", "other_mesh"])
def test_the_shards_placed_on_the_devices_are_bitwise_the_saved_state(
    report: dict[str, Any], mesh: str
) -> None:
    assert report[mesh]["equal"], "the union of the hosts' shards differs from the saved state"
    assert report[mesh]["same_sharding"], "placed tensors are not sharded as the live ones"


def test_a_process_restore_reads_every_chunk_once_and_keeps_the_sharding(
    report: dict[str, Any],
) -> None:
    run = report["process"]
    assert run["restored"] == 3
    assert run["equal"], "restored state differs from the saved state"
    assert run["reads"]["other"] == []
    stored = report["same_mesh"]["stored"]
    assert Counter(map(tuple, run["reads"]["chunks"])) == Counter(map(tuple, stored))
    assert run["param_sharding_kept"], run["param_specs"]
    for name, spec in run["optim_specs"].items():
        param = run["param_order"][int(name.split(".")[0])]
        assert spec == run["param_specs"][param], (name, spec)
