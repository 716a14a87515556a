"""The rule that stops a launch whose workers do not form the world it launched, and the
claims the workers write for it (``checkflow.launch.world``, ``checkflow.claims``)."""

from __future__ import annotations

import os

from checkflow.claims import CLAIMS_DIR, Claim, clear_claims, read_claims, write_claim
from checkflow.launch.world import world_problem


def claim(rank: int, world: int, pid: int) -> Claim:
    return Claim(rank=rank, world_size=world, local_rank=None, pid=pid)


def test_workers_of_the_world_launched_fit_even_before_all_have_claimed():
    assert world_problem([claim(0, 2, 10), claim(1, 2, 11)], 2) is None
    assert world_problem([claim(1, 4, 10)], 4) is None
    assert world_problem([], 2) is None


def test_a_script_without_init_process_group_is_told_to_call_it():
    problem = world_problem([claim(0, 1, 10), claim(0, 1, 11)], 2)
    assert problem == (
        "2 workers run as rank 0 of a world of 1, not as ranks of the world of 2 checkflow "
        "run launched; the script must call torch.distributed.init_process_group() before it "
        "creates the Checkpointer (see examples/train_ddp.py)"
    )
    # One wrong claim is enough: the other worker may not have claimed yet.
    assert world_problem([claim(0, 1, 10)], 2).startswith("1 worker runs as rank 0 of a world")


def test_a_rank_or_world_size_of_the_scripts_own_is_told_to_take_the_launchers():
    wrong_world = world_problem([claim(0, 2, 10), claim(3, 4, 11)], 2)
    assert wrong_world is not None and wrong_world.startswith(
        "1 worker runs as rank 3 of a world of 4, not as ranks of the world of 2"
    )
    assert wrong_world.endswith(
        "the script must take its rank and world size from the launcher: "
        "torch.distributed.init_process_group() without rank= or world_size= "
        "(see examples/train_ddp.py)"
    )
    shared = world_problem([claim(1, 2, 10), claim(1, 2, 11)], 2)
    assert shared is not None and shared.startswith("2 workers run as rank 1 of a world of 2")


def test_claims_are_written_only_under_the_launcher_and_read_back(tmp_path):
    write_claim(0, 1, environ={})
    assert list(tmp_path.iterdir()) == []

    write_claim(1, 2, environ={CLAIMS_DIR: str(tmp_path), "LOCAL_RANK": "1"})
    write_claim(1, 2, environ={CLAIMS_DIR: str(tmp_path), "LOCAL_RANK": "1"})  # replaced
    (tmp_path / "claim-1.json").write_text("{not json")  # a stray file is skipped
    assert read_claims(str(tmp_path)) == [Claim(1, 2, 1, os.getpid())]

    clear_claims(str(tmp_path))
    assert read_claims(str(tmp_path)) == []
    assert read_claims(str(tmp_path / "missing")) == []


def test_a_claim_that_cannot_be_written_never_stops_training(tmp_path, caplog):
    write_claim(0, 1, environ={CLAIMS_DIR: str(tmp_path / "missing")})
    assert "could not tell the launcher this rank's world" in caplog.text
