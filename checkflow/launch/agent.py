"""torch's ``LocalElasticAgent`` that owns recovery: it follows the job at the coordinator.

What it adds to torch's monitor step (:meth:`CheckflowAgent._monitor_workers`):

- **A short grace everywhere.** torch stops workers with 30 s between SIGTERM and SIGKILL
  whatever ``shutdown_timeout`` says (``_stop_workers`` and the process context's close
  after a failure use their default); a frozen process never obeys SIGTERM, so the
  restart waited for it. Here every stop uses ``shutdown_timeout``.
- **Crash reports.** A worker that exits with anything but 0 or
  :data:`~checkflow.client.ABORT_EXIT_CODE` is reported (``POST`` ``paths.FAILURE``) so
  the coordinator fails the job now instead of after its heartbeat timeout.
- **Restarts the coordinator asks for.** When the job moved to a newer generation than
  the one this round's local workers registered in and they do not exit by themselves
  within :data:`ABORT_GRACE_S` (frozen, or stuck holding the GIL), the local group is
  restarted. This restarts a node whose own ranks look healthy when the fault is on
  another node.

- **Workers that do not form the world launched** (:mod:`checkflow.launch.world`): their
  claims are compared with the world each round; the agent raises ``WorldMismatch``
  instead of restarting workers that would do the same again.
- **Ctrl-C** reaches the workers as SIGTERM, not SIGINT (:meth:`CheckflowAgent._shutdown`).

Restart counting (``--max-restarts``): a restart counts when the fault is on this node:
a worker crashed, or the coordinator declared one of its ranks failed (silent, hung). A
restart because the workers were told to abort for a fault elsewhere or a rollback does
not count, as torch does not count the restart of a node that sees another node rejoin.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from checkflow.claims import clear_claims, read_claims
from checkflow.client.rank import ABORT_EXIT_CODE
from checkflow.launch import recovery, world
from checkflow.launch.warm import WarmPool
from checkflow.launch.watch import CoordinatorWatch, JobView
from checkflow.memory import area

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 3.0
"""Seconds a worker left behind by the job gets to exit by itself (its heartbeat thread
exits with the abort code within about a heartbeat interval) before it is restarted."""


JIT_GRACE_S = 15.0
"""With ``--ram-tier``, a coordinator, and workers that write just-in-time checkpoints
(``Checkpointer(jit=True)`` marks the node's RAM-tier folder): seconds the surviving workers
of a local crash get to exit by themselves (told to abort, they first write their copy:
``checkflow.memory.jit``) before they are stopped. A bound, not a wait: the restart begins
once every worker has exited."""


DEFAULT_SHUTDOWN_TIMEOUT = 30
"""torch's own default, when the caller gives none."""

_TORCH_HAS_SHUTDOWN_TIMEOUT = "shutdown_timeout" in inspect.signature(LocalElasticAgent).parameters
"""torch >= 2.10's agent takes it; 2.9's (the torch that torch_xla 2.9 needs) does not, and
closes its workers with a fixed 30 s grace: :meth:`CheckflowAgent._stop_workers` closes them
with the short one itself there."""


@dataclass(slots=True)
class _Round:
    """One start of the local workers, as the coordinator watch sees it."""

    started: float
    local_ranks: list[int]
    marks: dict[int, float | None] | None = None
    stale_since: float | None = None
    seen_failed: dict[int, tuple[int, float]] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)
    """Crashed ranks already reported to the coordinator."""
    mismatch_since: float | None = None
    """When a worker's claim first did not fit the world launched (``launch.world``)."""
    world_checked: bool = False
    """Every worker claimed, and the claims form the world launched."""


class CheckflowAgent(LocalElasticAgent):
    """``LocalElasticAgent`` plus ``watch``; see the module docstring.

    Args:
        watch: the job at the coordinator; None when no coordinator is configured (then
            only the short grace differs from torch).
        abort_grace_s: see :data:`ABORT_GRACE_S`.
        warm: spare interpreters that restarted workers start in (None: cold starts).
        ram_dir: the node's RAM-tier folder (``--ram-tier``): with a ``watch``, the JIT
            grace applies when its workers marked it (:data:`JIT_GRACE_S`).
        claims_dir: where the workers claim their rank and world size
            (``world.claims_folder``); None: not checked.
        *args, **kwargs: ``LocalElasticAgent``'s.
    """

    def __init__(
        self,
        *args: Any,
        watch: CoordinatorWatch | None = None,
        abort_grace_s: float = ABORT_GRACE_S,
        warm: WarmPool | None = None,
        ram_dir: str | None = None,
        claims_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        timeout = kwargs.pop("shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT)
        if _TORCH_HAS_SHUTDOWN_TIMEOUT:
            kwargs["shutdown_timeout"] = timeout
        super().__init__(*args, **kwargs)
        self._shutdown_timeout = timeout
        self._watch = watch
        self._warm = warm
        self._abort_grace_s = abort_grace_s
        self._ram_dir = ram_dir if watch is not None else None
        self._claims_dir = claims_dir
        self._round = _Round(time.monotonic(), [])

    # --- torch's hooks --------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self._claims_dir is not None:
            clear_claims(self._claims_dir)  # the last round's processes have exited
        with self._warm.handlers() if self._warm else contextlib.nullcontext():
            ids = super()._start_workers(worker_group)
        self._round = _Round(time.monotonic(), [w.global_rank for w in worker_group.workers])
        return ids

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        if not _TORCH_HAS_SHUTDOWN_TIMEOUT and self._pcontext is not None:
            # torch <= 2.9 closes with its 30 s default: close first with the short grace
            # (the second close finds the workers gone).
            self._pcontext.close(signal.SIGTERM, self._shutdown_timeout)
            return super()._shutdown()
        self._shutdown(timeout=self._shutdown_timeout)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args: Any, **kw: Any) -> None:
        # Ctrl-C reaches the agent alone (torch starts each worker in a session of its own),
        # and torch stops the workers with the signal it got: as SIGINT, every Python worker
        # would print a KeyboardInterrupt traceback. SIGTERM stops them as surely, quietly.
        if death_sig == signal.SIGINT:
            death_sig = signal.SIGTERM
        super()._shutdown(death_sig, *args, **kw)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._warm is not None:
            self._warm.tick()
        if self._world_unsettled(worker_group):
            return RunResult(state=WorkerState.HEALTHY)  # waiting for the other claims
        if self._stop_others_after_a_failure(worker_group):
            return RunResult(state=WorkerState.HEALTHY)  # survivors writing their JIT copies
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:
            return self._after_failure(worker_group, result)
        if result.state == WorkerState.HEALTHY and self._watch is not None:
            return self._follow_job(worker_group, result)
        return result

    # --- the world launched ----------------------------------------------------------------
    def _world_unsettled(self, worker_group: WorkerGroup) -> bool:
        """Compare this round's claims with the world launched (:mod:`.world`): True while a
        claim does not fit and other running workers have not claimed yet.

        Raises:
            WorldMismatch: the claims do not form the world launched (no restart helps).
        """
        r = self._round
        if self._claims_dir is None or r.world_checked or self._pcontext is None:
            return False
        handlers = getattr(self._pcontext, "subprocess_handlers", {})
        pids = {h.proc.pid for h in handlers.values()}
        claims = [c for c in read_claims(self._claims_dir) if c.pid in pids]
        running = {h.proc.pid for h in handlers.values() if h.proc.poll() is None}
        unclaimed = running - {c.pid for c in claims}
        problem = world.world_problem(claims, worker_group.workers[0].world_size)
        if problem is None:
            r.world_checked = len(claims) == len(pids)
            return False
        now = time.monotonic()
        r.mismatch_since = r.mismatch_since or now
        if unclaimed and now - r.mismatch_since < world.CLAIM_GRACE_S:
            return True
        raise world.WorldMismatch(problem)

    # --- failures -------------------------------------------------------------------------
    def _stop_others_after_a_failure(self, worker_group: WorkerGroup) -> bool:
        """Note which workers failed by themselves, then stop the rest with the short grace
        (torch's process context would give them 30 s), or, within the JIT grace, report the
        crash now and let them exit by themselves; True while they are given that time."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None)
        if not handlers or self._pcontext is None:
            return False
        codes = {local: h.proc.poll() for local, h in handlers.items()}
        now = time.monotonic()
        for local, code in codes.items():
            rank = worker_group.workers[local].global_rank
            if code not in (None, 0) and rank not in self._round.seen_failed:
                self._round.seen_failed[rank] = (code, now)
        if not self._round.seen_failed or None not in codes.values():
            return False
        if self._jit_grace(now):
            self._report_crashes()
            return True
        self._pcontext.close(signal.SIGTERM, self._shutdown_timeout)
        return False

    def _jit_marked(self) -> bool:
        """This node's workers write just-in-time checkpoints (``Checkpointer(jit=True)``)."""
        return self._ram_dir is not None and area.uses_jit(self._ram_dir)

    def _kill(self, worker_group: WorkerGroup, ranks: list[int]) -> None:
        """SIGKILL the local workers of global ``ranks`` (a frozen one obeys nothing else)."""
        handlers = getattr(self._pcontext, "subprocess_handlers", {})
        for w in worker_group.workers:
            if w.global_rank in ranks and w.local_rank in handlers:
                with contextlib.suppress(ProcessLookupError):
                    handlers[w.local_rank].proc.send_signal(signal.SIGKILL)

    def _jit_grace(self, now: float) -> bool:
        """A worker crashed less than the JIT grace ago (the survivors are told to abort by
        the coordinator, and write their just-in-time checkpoints first)."""
        if not self._jit_marked():
            return False
        crashed = [at for code, at in self._round.seen_failed.values() if recovery.is_crash(code)]
        return bool(crashed) and now - min(crashed) < JIT_GRACE_S

    def _report_crashes(self) -> None:
        """Report each crash seen this round to the coordinator, once."""
        assert self._watch is not None
        for rank, (code, seen_at) in self._round.seen_failed.items():
            if recovery.is_crash(code) and rank not in self._round.reported:
                self._round.reported.add(rank)
                self._watch.report_failure(rank, code, seen_at)

    def _after_failure(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        seen = self._round.seen_failed or {
            rank: (f.exitcode, time.monotonic()) for rank, f in result.failures.items()
        }
        crashes = {r: at for r, (code, at) in seen.items() if recovery.is_crash(code)}
        _name_first(result, seen)
        if self._watch is None:
            return result
        for rank, seen_at in crashes.items():
            if rank not in self._round.reported:
                self._watch.report_failure(rank, seen[rank][0], seen_at)
        if crashes or not self._fault_elsewhere():
            return result  # torch counts it against --max-restarts
        logger.warning(
            "checkflow: local workers %s exited with %d (told to abort by the coordinator: "
            "a fault on another node or a rollback); restarting them without using one of "
            "--max-restarts",
            sorted(seen),
            ABORT_EXIT_CODE,
        )
        self._restart_workers(worker_group)
        return RunResult(state=WorkerState.HEALTHY)

    def _fault_elsewhere(self) -> bool:
        """Every local failure was an abort and the coordinator blames no local rank."""
        assert self._watch is not None
        view = self._watch.refresh()
        marks = self._marks(view)
        return view is not None and marks is not None and not recovery.failed_here(view, marks)

    # --- following the job ----------------------------------------------------------------
    def _follow_job(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        assert self._watch is not None
        view = self._watch.view()
        if self._rdzv_handler.num_nodes_waiting() > 0:
            # Another node is back at the rendezvous, most likely after the coordinator
            # failed the job: torch would restart this node next, as a membership change
            # (not counted). Look now, so that a fault of this node counts as one.
            view = self._watch.refresh() or view
        marks = self._marks(view)
        if view is None or marks is None:
            return result
        stale = recovery.stale_ranks(view, marks)
        r = self._round
        if not stale.ranks:
            r.stale_since = None
            return result
        now = time.monotonic()
        r.stale_since = r.stale_since or now
        if not stale.failed_here and now - r.stale_since < self._abort_grace_s:
            return result
        logger.warning(
            "checkflow: job %s moved to generation %d; local rank(s) %s of an older "
            "generation are still running%s: restarting the local workers",
            self._watch.job,
            view.generation,
            stale.ranks,
            " (declared failed)" if stale.failed_here else f" after {now - r.stale_since:.1f} s",
        )
        if stale.failed_here and self._jit_marked():
            # Only the failed ranks now: the others write their just-in-time copies first
            # (the next looks see a crash, and give them the JIT grace).
            self._kill(worker_group, recovery.failed_ranks(view, marks))
            return result
        if stale.failed_here:
            return self._stopped_as_failed(worker_group)  # counts, like a crash
        self._restart_workers(worker_group)
        return RunResult(state=WorkerState.HEALTHY)

    def _stopped_as_failed(self, worker_group: WorkerGroup) -> RunResult:
        """SIGKILL the workers (a rank the coordinator declared failed is frozen or stuck:
        SIGTERM would only add the grace) and report how each ended."""
        if self._pcontext is not None:
            self._pcontext.close(signal.SIGKILL, self._shutdown_timeout)
        handlers = getattr(self._pcontext, "subprocess_handlers", {})
        failures = {
            w.global_rank: ProcessFailure(
                local_rank=w.local_rank,
                pid=w.id,
                exitcode=handlers[w.local_rank].proc.returncode or -signal.SIGKILL,
                error_file="",
            )
            for w in worker_group.workers
        }
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _marks(self, view: JobView | None) -> dict[int, float | None] | None:
        """This round's baseline, from the first view asked for after the round began."""
        r = self._round
        if r.marks is None and view is not None and view.asked_at >= r.started:
            r.marks = recovery.baseline(view, r.local_ranks)
        return r.marks


def _name_first(result: RunResult, seen: dict[int, tuple[int, float]]) -> None:
    """Order ``result``'s failures so that torch's ``get_first_failure`` (the oldest
    timestamp, in whole seconds: workers the agent stopped tie with the one that crashed)
    names a worker that crashed, then one that exited by itself, then one that was stopped."""
    if not result.failures:
        return

    def order(rank: int) -> tuple[int, float]:
        if rank not in seen:
            return (2, 0.0)
        code, at = seen[rank]
        return (0 if recovery.is_crash(code) else 1, at)

    base = min(f.timestamp for f in result.failures.values())
    for n, rank in enumerate(sorted(result.failures, key=order)):
        result.failures[rank].timestamp = base + n
