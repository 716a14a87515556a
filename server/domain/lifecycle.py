"""A job's life: running, recovering, finished, stopped, failed.

Each function below is one transition, ``(state, what happened) -> new state``, pure; the
rules of :mod:`.ranks`, :mod:`.generation` and :mod:`.jobs` call them where the thing
happens and write the job row when the state changed. The state is a column of its own
(not derived from the ranks at each read) because "finished" and "stopped" are facts the
ranks' table cannot tell apart: in both, no rank is alive.

An ended job (finished, stopped, failed) has no rank the failure detector watches, so no
failure can start a generation behind its back; it lives again only when a rank
registers (the job was launched again).
"""

from __future__ import annotations

from checkflow.protocol import JobState, StopReason

RUNNING, RECOVERING = JobState.RUNNING, JobState.RECOVERING
FINISHED, STOPPED, FAILED = JobState.FINISHED, JobState.STOPPED, JobState.FAILED

ENDED = frozenset({FINISHED, STOPPED, FAILED})
"""States in which no process of the job runs."""


def on_new_generation(state: JobState) -> JobState:
    """A failure, a roll-back or a resize started a generation: a live job recovers; an
    ended one stays ended (a roll-back of a finished job only moves its restore point:
    nothing runs to recover until it is launched again)."""
    return state if state in ENDED else RECOVERING


def on_registered(recovering: bool) -> JobState:
    """A rank registered: the job runs (launched again, if it had ended), or still
    recovers while ``recovering`` (not every rank of the generation has registered)."""
    return RECOVERING if recovering else RUNNING


def on_finished(state: JobState, finished: int, world_size: int) -> JobState:
    """A rank ended training normally; the job is finished once all ``world_size`` ranks of
    its current generation have (``finished`` of them so far)."""
    if state in ENDED or finished < world_size:
        return state
    return FINISHED


def on_stopped(state: JobState, reason: StopReason) -> JobState:
    """Its launcher stopped: ``interrupted`` (Ctrl-C, SIGTERM) is stopped, ``gave_up``
    (restarts used up) is failed. A job that had ended already stays as it ended: a
    launcher interrupted after its ranks finished does not undo the finish."""
    if state in ENDED:
        return state
    return STOPPED if reason == StopReason.INTERRUPTED else FAILED


def from_stored(stored: str | None, recovering: bool) -> JobState:
    """The state of a job row; a row of an older coordinator has none (NULL): running, or
    recovering while its generation waits for ranks."""
    if stored is None:
        return RECOVERING if recovering else RUNNING
    return JobState(stored)
