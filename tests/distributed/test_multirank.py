"""Real gloo ranks (child processes): global commit, DDP dedup, FSDP2 shards, SIGKILL resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkflow import list_checkpoints, load
from checkflow.manifest import MANIFEST, RankManifest, step_dir
from tests.distributed._launch import run_ranks
from tests.runtime._train import assert_bitwise_equal, load_final

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _records(outputs: list[str]) -> list[dict]:
    merged = []
    for out in outputs:
        rank: dict = {}
        for line in out.splitlines():
            if line.startswith("{"):
                rank.update(json.loads(line))
        merged.append(rank)
    return merged


def _assert_written_once_and_balanced(step_folder: Path) -> None:
    ranks = [
        RankManifest.from_json((step_folder / f"rank-0000{r}.json").read_bytes()) for r in (0, 1)
    ]
    names = [{c.fqn for c in rm.chunks} for rm in ranks]
    assert not names[0] & names[1], "a replicated tensor was written by both ranks"
    assert len(names[0] | names[1]) == 6 + 6 * 3  # 6 params + Adam's 3 states each
    tensor_bytes = [sum(c.nbytes for c in rm.chunks) for rm in ranks]
    assert max(tensor_bytes) <= 1.25 * min(tensor_bytes), tensor_bytes


def _kill_resume_matches_uninterrupted(tmp_path: Path, kind: str, kill_env: dict) -> None:
    base = {"scenario": "train", "kind": kind, "steps": 8, "every": 2, "wait": True}
    run_ranks(2, {**base, "uri": str(tmp_path / "ref"), "out": str(tmp_path / "ref.pt")})
    if kind == "ddp":
        _assert_written_once_and_balanced(tmp_path / "ref" / step_dir(8))

    uri = str(tmp_path / "run")
    killed = {**base, "uri": uri, "kill": {"rank": 1, "after_step": 6, "delay": 0.3}}
    run_ranks(2, killed, env=kill_env, expect_killed=True)
    assert [c.step for c in list_checkpoints(uri)] == [2, 4]
    assert not (tmp_path / "run" / step_dir(6) / MANIFEST).exists()

    outs = run_ranks(2, {**base, "uri": uri, "out": str(tmp_path / "final.pt")})
    assert [r["restored"] for r in _records(outs)] == [4, 4]
    assert_bitwise_equal(load_final(tmp_path / "final.pt"), load_final(tmp_path / "ref.pt"))


def test_ddp_rank_killed_mid_persist_leaves_step_invisible_and_resume_is_bitwise(tmp_path):
    # Replicated tensors are written once, split by bytes between the ranks (checked on
    # the uninterrupted run). The commit delay holds both ranks between their rank
    # manifest and the commit; rank 1 is SIGKILLed inside that window, so step 6 must
    # never commit and step 4 is restored on every rank.
    _kill_resume_matches_uninterrupted(tmp_path, "ddp", {"CHECKFLOW_TEST_COMMIT_DELAY_S": "1.5"})


def test_fsdp2_sigkill_resume_is_bitwise_equal_to_uninterrupted(tmp_path):
    _kill_resume_matches_uninterrupted(tmp_path, "fsdp", {"CHECKFLOW_TEST_COMMIT_DELAY_S": "1.5"})


def test_every_auto_makes_every_rank_checkpoint_at_the_same_steps(tmp_path):
    uri = tmp_path / "run"
    cfg = {"scenario": "train", "kind": "ddp", "steps": 40, "every": "auto", "slow_rank": 1}
    outs = run_ranks(2, {**cfg, "uri": str(uri)})
    records = _records(outs)
    assert records[0]["checkpoints"], "no checkpoint was taken"
    assert records[0]["checkpoints"] == records[1]["checkpoints"]
    committed = [c.step for c in list_checkpoints(str(uri))]
    assert committed and set(committed) <= set(records[0]["checkpoints"])


def _damage_chunk(step_folder: Path, rank: int, fqn: str) -> None:
    """Flip one byte inside ``rank``'s stored chunk of ``fqn``."""
    rm = RankManifest.from_json((step_folder / f"rank-{rank:05d}.json").read_bytes())
    chunk = next(c for c in rm.chunks if c.fqn == fqn)
    path = step_folder / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.byte_offset + chunk.nbytes // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_fsdp2_rank_with_a_damaged_newest_step_makes_every_rank_restore_the_same_older_step(
    tmp_path,
):
    uri = tmp_path / "run"
    train = {"scenario": "train", "kind": "fsdp", "steps": 6, "every": 2, "wait": True}
    run_ranks(2, {**train, "uri": str(uri)})
    assert [c.step for c in list_checkpoints(str(uri))] == [2, 4, 6]
    # Rows 9..17 of the first layer live only in rank 1's files; rank 0 never reads them,
    # so only rank 1 finds step 6 damaged.
    _damage_chunk(uri / step_dir(6), 1, "model.0.weight")

    out = tmp_path / "restored.pt"
    outs = run_ranks(2, {"scenario": "restore", "kind": "fsdp", "uri": str(uri), "out": str(out)})
    assert [r["restored"] for r in _records(outs)] == [4, 4]
    step4 = load(str(uri), step=4)
    restored = load_final(out)
    assert_bitwise_equal(restored["model"], step4["model"], "model")
    assert_bitwise_equal(restored["optim"], step4["optim"]["state"], "optim")
