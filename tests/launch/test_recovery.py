"""The agent's decisions from the coordinator's view (:mod:`checkflow.launch.recovery`):
which local ranks the job left behind, whether the fault is on this node, what a crash is."""

from __future__ import annotations

from checkflow.launch import recovery
from checkflow.launch.watch import JobView
from checkflow.protocol import RankPublic, RankState


def rank(r: int, generation: int, state: RankState, last_heartbeat: float | None) -> RankPublic:
    return RankPublic(
        rank=r,
        generation=generation,
        state=state,
        alive=state == RankState.ALIVE,
        step=0,
        node=None,
        last_heartbeat=last_heartbeat,
        seconds_since_heartbeat=None,
        iteration_s=None,
        stall_s=None,
        persist_s=None,
    )


def view(generation: int, *ranks: RankPublic) -> JobView:
    return JobView(generation, {r.rank: r for r in ranks}, asked_at=0.0)


def test_a_rank_not_heard_from_this_round_is_never_stale():
    # The previous round's process of rank 1 registered in generation 1 at t=100; the
    # job is in generation 2 and this round's process is still importing torch.
    before = view(2, rank(1, 1, RankState.FAILED, 100.0))
    marks = recovery.baseline(before, [1])

    assert recovery.stale_ranks(before, marks).ranks == []
    assert recovery.round_generation(before, 1, marks) is None
    assert not recovery.failed_here(before, marks)


def test_a_rank_that_registered_this_round_in_an_older_generation_is_stale():
    marks = recovery.baseline(view(1, rank(0, 1, RankState.ALIVE, 100.0)), [0])
    # It beat at t=105 in generation 1; then another node's rank failed: generation 2.
    now = view(2, rank(0, 1, RankState.ALIVE, 105.0))

    stale = recovery.stale_ranks(now, marks)
    assert stale.ranks == [0]
    assert not stale.failed_here, "the fault is elsewhere: this node's rank is only behind"


def test_a_local_rank_the_coordinator_declared_failed_puts_the_fault_here():
    marks = recovery.baseline(view(1), [0, 1])  # neither registered yet when the round began
    now = view(2, rank(0, 1, RankState.ALIVE, 105.0), rank(1, 1, RankState.FAILED, 104.0))

    stale = recovery.stale_ranks(now, marks)
    assert stale.ranks == [0, 1]
    assert stale.failed_here


def test_ranks_registered_in_the_current_generation_are_not_stale():
    marks = recovery.baseline(view(1, rank(0, 1, RankState.ABORTED, 100.0)), [0])
    now = view(2, rank(0, 2, RankState.ALIVE, 110.0))

    assert recovery.stale_ranks(now, marks).ranks == []
    assert recovery.round_generation(now, 0, marks) == 2


def test_only_exit_codes_other_than_success_and_abort_are_crashes():
    assert not recovery.is_crash(0)
    assert not recovery.is_crash(75)  # told to abort by the coordinator
    assert recovery.is_crash(1)
    assert recovery.is_crash(-9)  # killed by a signal (the OOM killer, a SIGKILL)
