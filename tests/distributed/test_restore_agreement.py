"""RestoreAgreement: ranks (threads here) agree through a real c10d store on the step to restore."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

from checkflow.distributed import RestoreAgreement, newest_readable

STEPS = [2, 4, 6, 8]


def _agree(readable: list[set[int]], steps: list[int] = STEPS) -> tuple[list, list[list[int]], int]:
    """Run ``agree`` on one thread per rank; rank r reads the steps in ``readable[r]``.

    Returns each rank's result, the steps each rank read, and the keys left in the store.
    """
    store = dist.HashStore()
    world = len(readable)
    reads: list[list[int]] = [[] for _ in range(world)]

    def rank_main(rank: int) -> tuple[int, str] | None:
        def read(step: int) -> str | None:
            reads[rank].append(step)
            return f"rank {rank} step {step}" if step in readable[rank] else None

        return RestoreAgreement(store, rank, world).agree(steps, read)

    with ThreadPoolExecutor(world) as pool:
        results = list(pool.map(rank_main, range(world)))
    return results, reads, store.num_keys()


def test_every_rank_restores_the_newest_step_that_every_rank_reads():
    # Rank 1's part of step 8 is damaged: rank 0 reads 8 but must take 6 like rank 1.
    results, reads, _ = _agree([{2, 4, 6, 8}, {2, 4, 6}])
    assert results == [(6, "rank 0 step 6"), (6, "rank 1 step 6")]
    assert reads == [[8, 6], [8, 6]]


def test_a_rank_that_cannot_read_the_smallest_proposal_sends_everyone_further_back():
    # Proposals 8, 6, 8 -> 6, which rank 0 cannot read; then 4 on every rank.
    results, reads, _ = _agree([{2, 4, 8}, {4, 6}, {4, 6, 8}])
    assert [r[0] if r else None for r in results] == [4, 4, 4]
    assert results[1] == (4, "rank 1 step 4")
    assert all(len(r) == len(set(r)) for r in reads), f"a step was read twice: {reads}"


def test_when_a_rank_reads_no_step_every_rank_starts_from_scratch():
    results, _, _ = _agree([{2, 4, 6, 8}, set()])
    assert results == [None, None]


def test_ranks_that_see_different_step_lists_still_agree():
    # Rank 1 lists step 8 (a late commit it saw), rank 0 does not: 8 cannot be agreed on.
    store = dist.HashStore()

    def rank_main(rank: int, steps: list[int]) -> tuple[int, int] | None:
        return RestoreAgreement(store, rank, 2).agree(steps, lambda s: s)

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(rank_main, 0, [2, 4, 6])
        b = pool.submit(rank_main, 1, [2, 4, 6, 8])
        assert (a.result(), b.result()) == ((6, 6), (6, 6))


def test_agreement_leaves_no_key_in_the_store():
    _, _, keys = _agree([{2, 4, 8}, {4, 6}, {4, 6, 8}])
    assert keys == 0


def test_one_rank_alone_takes_its_newest_readable_step():
    assert newest_readable(STEPS, lambda s: f"step {s}" if s != 8 else None) == (6, "step 6")
    assert newest_readable(STEPS, lambda s: None) is None
    assert newest_readable([], lambda s: s) is None
