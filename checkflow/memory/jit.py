"""Just-in-time checkpoints (issue 11; JIT checkpointing, EuroSys'24): when a rank of a
data-parallel job fails, each surviving rank writes the step it is at to the RAM tier
before it exits, and a survivor's copy stands for the dead rank's, so the restarted job is
at most one step behind.

**When.** A survivor learns of the failure in one of two ways, and both end here:

- its training thread fails (a collective with the dead peer raises): the
  ``Checkpointer``'s ``__exit__`` writes the copy on that thread;
- the coordinator answers ``abort`` to its heartbeat (the launcher reported the crash):
  the heartbeat thread writes it while :meth:`JitGuard.freeze` holds the training thread
  at its next optimizer step or ``ckpt.step()``.

``checkflow run`` gives survivors :data:`checkflow.launch.agent.JIT_GRACE_S` to exit by
themselves after a local crash instead of stopping them at once (after a freeze or hang it
SIGKILLs only the rank the coordinator declared failed); the node's RAM-tier folder tells
it the workers write such copies (``area.JIT_MARKER``). An uncaught error ends up here too
without ``with Checkpointer`` (``on_uncaught_error``).

**Which state.** That of the last ``ckpt.step()``. Module and optimizer tensors are read
live: they change only inside an optimizer step, and the optimizer hooks tell whether one
began since (then the copy waits for the next ``ckpt.step()``, which ends it). Every other
value (RNG states, a data loader's position, schedulers, the step counter) changes before
the next update (fetching a batch moves the loader), so ``ckpt.step()`` captures them
(:meth:`JitGuard.mark`: a small copy per step, taken only with ``jit=True``).

**Why a survivor's copy may stand for a dead rank.** Only because the job said so:
``Checkpointer(jit=True)`` declares every rank's state the same (DDP replicas). Then its RAM
copies say ``replica`` in their manifests, a restarted rank reads another rank's replica
for a step its own RAM root lacks (``RamCopies``), and the JIT step is reported with
``PartReport.jit``, which the coordinator counts for every rank. A sharded DTensor in the
state refuses ``jit=True`` (:func:`check_replicated`): a shard never stands for another.
The dead rank's per-rank values are then the survivor's (its RNG states): the same when the
ranks seed alike, as DDP jobs do; state a forward pass changes in place (BatchNorm's
running statistics) is taken as it is at the failure.
"""

from __future__ import annotations

import copy
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from checkflow.parallel import _compat
from checkflow.state import RNG_KEY, flatten, rng_state
from checkflow.write.snapshot import Snapshot

if TYPE_CHECKING:
    from checkflow.memory.tier import RamTier

log = logging.getLogger(__name__)

UPDATE_WAIT_S = 5.0
"""Longest wait for a weight update in progress to reach ``ckpt.step()``; past it, no copy."""
WRITE_TIMEOUT_S = 60.0
"""Longest wait for the copy to be in the RAM tier (and reported)."""


def check_replicated(state: Mapping[str, Any], optimizers: int) -> None:
    """Refuse ``jit=True`` for a state a survivor's copy cannot stand for.

    Raises:
        ValueError: a tensor is a shard (a DTensor with a ``Shard`` placement), or there is
            no optimizer (its step hooks are what tells a whole state from one mid-update).
    """
    if optimizers == 0:
        raise ValueError(
            "jit=True needs the optimizer in state=: its step hooks tell when the weights "
            "change, so that a just-in-time copy is never taken in the middle of an update"
        )
    t: Any
    for fqn, t in flatten(state, allow_pickle=True).tensors.items():
        if _compat.is_dtensor(t) and any(_compat.is_shard_placement(p) for p in t.placements):
            raise ValueError(
                f"jit=True declares every rank's state the same, but {fqn} is sharded "
                f"({tuple(t.placements)}): a survivor's copy cannot stand for another rank's "
                "shard. Leave jit off for sharded (FSDP, tensor-parallel) state."
            )


@dataclass(frozen=True, slots=True)
class Marked:
    """The per-rank values as ``ckpt.step()`` left them at ``step``."""

    step: int
    values: dict[str, Any]
    """``{name: state_dict}`` of every object that is not a module or optimizer, and the
    RNG states under ``RNG_KEY``: copies, the next step changes the originals."""


def capture(state: Mapping[str, Any], global_names: set[str], *, rng: bool) -> dict[str, Any]:
    """The per-rank part of ``state`` now (see :attr:`Marked.values`). On the training
    thread at every step, so as cheap as can be: state dicts copied, nothing encoded or
    checked (that happens if a copy is ever written); ``rng_state`` returns copies."""
    values = {
        name: copy.deepcopy(obj.state_dict())
        for name, obj in state.items()
        if name not in global_names
    }
    if rng:
        values[RNG_KEY] = rng_state()
    return values


class _Frozen:
    """A captured state dict, as a state object ``flatten`` takes."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value


class JitGuard:
    """Tells when the state is whole, and holds the training thread while it is copied.

    Call order on the training thread: :meth:`before_update` from every optimizer's step
    pre-hook, :meth:`mark` from every ``ckpt.step()``. Any thread: :meth:`freeze`, once.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._marked: Marked | None = None
        self._updating = False
        """An optimizer step began since the last mark: live weights may be newer."""
        self._frozen_by: int | None = None
        self._trainer: int | None = None

    def mark(self, step: int, take: Callable[[], dict[str, Any]]) -> None:
        """``ckpt.step()`` counted ``step``: capture its per-rank values (``take``)."""
        with self._cond:
            self._trainer = threading.get_ident()
            self._marked = Marked(step, take())
            self._updating = False
            self._cond.notify_all()
            self._hold_if_frozen()

    def before_update(self) -> None:
        """An optimizer step is about to change the weights."""
        with self._cond:
            self._trainer = threading.get_ident()
            self._hold_if_frozen()
            self._updating = True

    def freeze(self, timeout_s: float = UPDATE_WAIT_S) -> Marked | None:
        """Stop the training thread from changing the state from now on; returns the marked
        step whose state the live tensors hold, or None when there is none (no step yet,
        or an update that did not reach ``ckpt.step()`` in ``timeout_s``)."""
        me = threading.get_ident()
        with self._cond:
            self._frozen_by = me
            if self._updating and self._trainer == me:
                return None  # the training thread failed inside an update: no whole state
            if not self._cond.wait_for(lambda: not self._updating, timeout_s):
                log.error("a weight update did not end within %.1f s: no JIT checkpoint", timeout_s)
                return None
            return self._marked

    def _hold_if_frozen(self) -> None:
        # The process exits once the copy is written (or failed): the training thread waits.
        while self._frozen_by is not None and self._frozen_by != threading.get_ident():
            self._cond.wait()


def jit_snapshot(
    state: Mapping[str, Any],
    global_names: set[str],
    marked: Marked,
    meta: tuple[str, dict[str, Any]],
    *,
    allow_pickle: bool,
) -> Snapshot:
    """A snapshot of step ``marked.step``: the live module and optimizer tensors (whole:
    sharded state was refused) with the per-rank values ``marked`` holds, and checkflow's
    own ``meta`` entry (``(key, value)``). CPU tensors are not copied (training is held)."""
    objects = {name: obj for name, obj in state.items() if name in global_names}
    objects.update({name: _Frozen(value) for name, value in marked.values.items()})
    live = flatten(objects, allow_pickle=allow_pickle)
    tensors: dict[str, torch.Tensor] = {}
    t: Any
    for fqn, t in live.tensors.items():
        local = t.to_local() if _compat.is_dtensor(t) else t
        tensors[fqn] = local.detach().cpu()
    skeleton = {**live.skeleton, meta[0]: meta[1]}
    return Snapshot(step=marked.step, tensors=tensors, skeleton=skeleton)


class JitCheckpoint:
    """Writes this rank's just-in-time copy at most once, from whichever thread asks first.

    Args:
        guard: the training thread's marks.
        tier: the rank's RAM tier (None: there is none, nothing is written).
        build: the snapshot of a marked step (``jit_snapshot`` with the state bound).
    """

    def __init__(
        self,
        guard: JitGuard,
        tier: RamTier | None,
        build: Callable[[Marked], Snapshot],
    ) -> None:
        self.guard = guard
        self.tier = tier
        self.build = build
        self.written: int | None = None
        """The step written, once written."""
        self._once = threading.Lock()
        self._tried = False

    def write(self, why: str, timeout_s: float = WRITE_TIMEOUT_S) -> int | None:
        """Write the current step to the RAM tier and wait until it is there (and reported
        to the coordinator); the step, or None when there is nothing whole to write. Never
        raises: the process is failing already, and its exit must not change."""
        with self._once:
            if self._tried or self.tier is None:
                return self.written
            self._tried = True
            try:
                return self._write(why, timeout_s)
            except (Exception, FutureTimeout) as e:
                log.error("checkflow: the just-in-time checkpoint failed: %s", e)
                return None

    def _write(self, why: str, timeout_s: float) -> int | None:
        assert self.tier is not None
        t0 = time.perf_counter()
        marked = self.guard.freeze()
        if marked is None:
            return None
        self.tier.jit_steps.add(marked.step)
        future = self.tier.submit(self.build(marked), {}, None)
        future.result(timeout=timeout_s)
        self.written = marked.step
        log.warning(
            "checkflow: just-in-time checkpoint of step %d written to the RAM tier in %.2f s (%s)",
            marked.step,
            time.perf_counter() - t0,
            why,
        )
        return marked.step


ABORT_WAIT_S = 3.0
"""How long a rank whose training failed asks the coordinator whether the job moved on
(a peer died: the launcher's crash report takes a moment) before it fails as a crash."""


class AbortSource(Protocol):
    def exit_if_aborted(self) -> None: ...


def await_abort(client: AbortSource, wait_s: float = ABORT_WAIT_S) -> None:
    """Ask until the client aborts the process (it does not return then) or ``wait_s``
    passed: a training thread failed by a dead peer then exits as told to abort, not as one
    more crash."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        client.exit_if_aborted()
        time.sleep(0.1)


def write_first(jit: Callable[[str], object], then: Callable[[str], None]) -> Callable[[str], None]:
    """An ``on_abort`` that writes the just-in-time checkpoint before ``then`` exits."""

    def on_abort(reason: str) -> None:
        jit(reason)
        then(reason)

    return on_abort


class RestoreHook:
    """Puts ``sys.excepthook`` back (``remove()``, as torch's hook handles)."""

    def __init__(self, hook: Any, previous: Any) -> None:
        self.hook, self.previous = hook, previous

    def remove(self) -> None:
        if sys.excepthook is self.hook:
            sys.excepthook = self.previous


def on_uncaught_error(
    failed: Callable[[type[BaseException], BaseException | None], None],
) -> RestoreHook:
    """Call ``failed`` before the interpreter reports an uncaught error (a training loop
    that does not use ``with Checkpointer``: its ``__exit__`` never sees the error)."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            failed(exc_type, exc)
        finally:
            previous(exc_type, exc, tb)

    sys.excepthook = hook
    return RestoreHook(hook, previous)
