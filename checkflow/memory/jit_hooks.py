"""The ``Checkpointer``'s side of just-in-time checkpoints (``Checkpointer(jit=True)``).

:mod:`checkflow.memory.jit` says when a copy is whole and how it is written; this module
holds what the ``Checkpointer`` calls at its own hook points (each ``ckpt.step()``, each
optimizer step, a training error, the coordinator's abort), so that the ``Checkpointer``
keeps one line per hook point.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from checkflow.config import CheckpointConfig
from checkflow.determinism import environment
from checkflow.memory.jit import (
    JitCheckpoint,
    JitGuard,
    Marked,
    RestoreHook,
    await_abort,
    capture,
    jit_snapshot,
    on_uncaught_error,
    write_first,
)
from checkflow.write.snapshot import Snapshot

if TYPE_CHECKING:
    from checkflow.memory.tier import RamTier

log = logging.getLogger(__name__)


class CheckpointerJit:
    """One ``Checkpointer``'s just-in-time copy: marks, writes, and the failure paths.

    Args:
        state: the ``Checkpointer``'s state (read live when a copy is written).
        global_names: its names held once per job (``parallel.sharding.global_state_names``).
        ram: the rank's RAM tier; None: a warning, and nothing is ever written.
        config: the ``Checkpointer``'s options (``rng``: the marks capture RNG states too;
            ``allow_pickle``).
        meta_key: the skeleton key of the checkpoint's metadata (step, environment).
        client: the coordinator client, if any (asked whether the job moved on).
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        global_names: set[str],
        ram: RamTier | None,
        config: CheckpointConfig,
        meta_key: str,
        *,
        client: Any = None,
    ) -> None:
        if ram is None:
            log.warning(
                "jit=True without a RAM tier (checkflow run --ram-tier, or ram_dir=): no "
                "just-in-time checkpoint will be written"
            )
        self._state, self._names, self._client = state, global_names, client
        self._rng, allow_pickle = config.rng, config.allow_pickle

        def build(marked: Marked) -> Snapshot:
            meta = {"step": marked.step, "environment": environment()}
            return jit_snapshot(
                state, global_names, marked, (meta_key, meta), allow_pickle=allow_pickle
            )

        self.copy = JitCheckpoint(JitGuard(), ram, build)
        if client is not None:  # the survivors of a failure checkpoint before they exit
            client.on_abort = write_first(self.copy.write, client.on_abort)

    def mark(self, step: int) -> None:
        """The state is whole at ``step`` (``ckpt.step()`` or ``restore()`` ended)."""
        self.copy.guard.mark(step, lambda: capture(self._state, self._names, rng=self._rng))

    def before_update(self) -> None:
        """An optimizer step begins: the live tensors are not whole until the next mark."""
        self.copy.guard.before_update()

    def training_failed(self, exc_type: type[BaseException], exc: BaseException | None) -> None:
        """The training thread raised (a collective with a dead peer?): write the current
        step, then give the coordinator time to say the job moved on."""
        if not issubclass(exc_type, Exception):
            return  # KeyboardInterrupt, SystemExit: stopped on purpose, not a failure
        # On the training thread, which raised outside or inside an update: the guard knows.
        self.copy.write(f"training failed: {exc_type.__name__}: {exc}")
        if self._client is not None:
            await_abort(self._client)  # the launcher's crash report is on its way

    def uncaught_error_hook(self) -> RestoreHook:
        """Without ``with Checkpointer``, an uncaught error still reaches
        :meth:`training_failed` (remove the hook at close)."""
        return on_uncaught_error(self.training_failed)


class NoJit:
    """The hook points of a ``Checkpointer`` without ``jit=True``: nothing to do."""

    def mark(self, step: int) -> None:
        pass

    def before_update(self) -> None:
        pass

    def training_failed(self, exc_type: type[BaseException], exc: BaseException | None) -> None:
        pass
