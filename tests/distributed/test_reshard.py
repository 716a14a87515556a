"""Save on 4 FSDP2 ranks, restore on 1, 2 (DDP), 3 and 8: the same full tensors, bitwise."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.distributed._launch import run_ranks
from tests.runtime._train import assert_bitwise_equal, load_final

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _local_rows(outputs: list[str]) -> list[int]:
    rows = []
    for out in outputs:
        # The worker prints JSON records; torch 2.9's gloo also prints a line of its own.
        for line in out.splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if "local_rows" in record:
                rows.append(record["local_rows"])
    return rows


def _restore(tmp_path: Path, uri: Path, world: int, kind: str, **extra: str) -> tuple:
    out = tmp_path / f"restored-{world}-{kind}.pt"
    cfg = {"scenario": "restore", "kind": kind, "uri": str(uri), "out": str(out), **extra}
    outputs = run_ranks(world, cfg, timeout=400)
    return load_final(out), _local_rows(outputs)


def test_fsdp2_checkpoint_of_4_ranks_restores_bitwise_on_1_2_3_and_8_ranks(tmp_path):
    uri = tmp_path / "fsdp4"
    cfg = {"scenario": "train", "kind": "fsdp", "steps": 3, "every": 3, "wait": True}
    run_ranks(4, {**cfg, "uri": str(uri), "out": str(tmp_path / "ref.pt")}, timeout=400)
    reference = load_final(tmp_path / "ref.pt")

    # 18 rows of the first layer: 5,5,5,3 saved; 18 / 6,6,6 / 3,3,3,3,3,3,0,0 restored.
    state, rows = _restore(tmp_path, uri, 1, "single")
    assert rows == [18]
    assert_bitwise_equal(state, reference, "1 rank")

    # FSDP2 -> DDP, and that DDP checkpoint back into FSDP2 on 3 ranks.
    ddp_uri = tmp_path / "ddp2"
    state, _ = _restore(tmp_path, uri, 2, "ddp", resave_uri=str(ddp_uri))
    assert_bitwise_equal(state, reference, "2 DDP ranks")
    state, rows = _restore(tmp_path, ddp_uri, 3, "fsdp")
    assert rows == [6, 6, 6]
    assert_bitwise_equal(state, reference, "DDP -> 3 FSDP2 ranks")

    state, rows = _restore(tmp_path, uri, 3, "fsdp")
    assert rows == [6, 6, 6]
    assert_bitwise_equal(state, reference, "3 ranks")

    state, rows = _restore(tmp_path, uri, 8, "fsdp")
    assert rows == [3, 3, 3, 3, 3, 3, 0, 0]
    assert_bitwise_equal(state, reference, "8 ranks")


def test_2d_mesh_dtensors_store_each_element_once_and_restore_whole(tmp_path):
    from checkflow.manifest import RankManifest, step_dir
    from tests.distributed._worker import mesh_tensors

    uri = tmp_path / "mesh"
    run_ranks(4, {"scenario": "mesh2d", "uri": str(uri), "save": True}, timeout=400)
    stored: dict[str, int] = {}
    for r in range(4):
        rm = RankManifest.from_json((uri / step_dir(0) / f"rank-{r:05d}.json").read_bytes())
        for c in rm.chunks:
            stored[c.fqn] = stored.get(c.fqn, 0) + math.prod(c.shape)
    # "b" lives on all 4 ranks as 2 replicas of 2 shards: written once, not twice.
    assert stored == {"model.a": 70, "model.b": 9}

    out = tmp_path / "mesh.pt"
    run_ranks(1, {"scenario": "mesh2d", "uri": str(uri), "out": str(out)})
    assert_bitwise_equal(load_final(out)["model"], mesh_tensors())
