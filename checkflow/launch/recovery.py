"""What the agent decides from the coordinator's view of its job: pure functions.

A *round* is one start of the local workers. The coordinator's rank table still shows the
previous round's processes until the new ones register, so a rank counts as *of this
round* only once its ``last_heartbeat`` differs from the one seen when the round began
(registering sets it, and every heartbeat moves it; the previous round's processes are
dead by then and cannot). Comparing generations of ranks not yet heard from would restart
healthy workers that are still importing torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from checkflow.client.rank import ABORT_EXIT_CODE
from checkflow.launch.watch import JobView
from checkflow.protocol import RankState

Baseline = Mapping[int, float | None]
"""Each local global rank's ``last_heartbeat`` when the round began."""


def baseline(view: JobView, local_ranks: Iterable[int]) -> dict[int, float | None]:
    """The marks that tell this round's ranks from the previous round's (see module doc)."""
    return {r: _last_heartbeat(view, r) for r in local_ranks}


def heard_this_round(view: JobView, rank: int, marks: Baseline) -> bool:
    """Whether ``rank`` registered or beat since the round began."""
    now = _last_heartbeat(view, rank)
    return now is not None and now != marks.get(rank)


def round_generation(view: JobView, rank: int, marks: Baseline) -> int | None:
    """The generation ``rank``'s process of this round registered in (None: not yet)."""
    return view.ranks[rank].generation if heard_this_round(view, rank, marks) else None


@dataclass(frozen=True, slots=True)
class Stale:
    """Local ranks of this round left behind by the job, and whether one is at fault."""

    ranks: list[int]
    failed_here: bool
    """The coordinator declared one of them failed (silent, hung, crashed): the fault is
    on this node, not elsewhere; a frozen process is not waited for."""


def stale_ranks(view: JobView, marks: Baseline) -> Stale:
    """This round's local ranks whose generation the job has left: they must abort, and
    the agent restarts them if they do not exit by themselves."""
    stale = [
        r
        for r in marks
        if (g := round_generation(view, r, marks)) is not None and g < view.generation
    ]
    return Stale(stale, failed_here(view, marks))


def failed_here(view: JobView, marks: Baseline) -> bool:
    """Whether the coordinator declared one of this round's local ranks failed."""
    return any(
        heard_this_round(view, r, marks) and view.ranks[r].state == RankState.FAILED for r in marks
    )


def failed_ranks(view: JobView, marks: Baseline) -> list[int]:
    """This round's local ranks the coordinator declared failed (silent, hung, crashed)."""
    return [
        r
        for r in marks
        if heard_this_round(view, r, marks) and view.ranks[r].state == RankState.FAILED
    ]


def is_crash(exitcode: int) -> bool:
    """A worker that exited with anything but success or the abort code (a signal too)."""
    return exitcode not in (0, ABORT_EXIT_CODE)


def _last_heartbeat(view: JobView, rank: int) -> float | None:
    public = view.ranks.get(rank)
    return None if public is None else public.last_heartbeat
