"""The write plan for replicated tensors: pure, deterministic, balanced by bytes."""

from __future__ import annotations

import random

from checkflow.distributed import balanced_writers


def test_every_tensor_gets_one_writer_among_its_holders_and_loads_are_balanced():
    rng = random.Random(0)
    sizes = {f"layer.{i}.weight": rng.randint(1, 10_000) for i in range(200)}
    holders = {fqn: range(4) for fqn in sizes}
    plan = balanced_writers(holders, sizes)
    assert plan.keys() == sizes.keys()
    loads = [sum(sizes[f] for f, r in plan.items() if r == rank) for rank in range(4)]
    share = sum(sizes.values()) / 4
    # Greedy largest-first: no rank exceeds its share by more than the largest tensor.
    assert max(loads) <= share + max(sizes.values())
    assert max(loads) / min(loads) < 1.05


def test_plan_is_the_same_whatever_order_the_ranks_list_tensors_in():
    sizes = {"a": 5, "b": 5, "c": 3, "d": 1}
    holders = {f: [0, 1] for f in sizes}
    shuffled = dict(reversed(list(sizes.items())))
    assert balanced_writers(holders, sizes) == balanced_writers(holders, shuffled)


def test_a_tensor_held_by_some_ranks_only_is_written_by_one_of_them():
    # Pipeline stages: rank 1 alone holds "head"; "emb" is replicated on 0 and 2.
    plan = balanced_writers({"head": [1], "emb": [0, 2]}, {"head": 100, "emb": 10})
    assert plan["head"] == 1
    assert plan["emb"] in (0, 2)


def test_shard_bytes_already_written_count_towards_a_rank_load():
    plan = balanced_writers({"x": [0, 1]}, {"x": 10}, base_load={0: 1_000, 1: 0})
    assert plan == {"x": 1}
