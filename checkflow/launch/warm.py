"""Warm restarts: a restarted worker starts in an interpreter that has already imported torch.

After a fault, most of the time to training again is the new workers' start-up, not the
restore: importing torch, ``torch._dynamo`` (which DDP's constructor imports) and
checkflow took 5-25 s here against a restore of 0.1 s. So, once a round's workers are
running, the agent starts one spare interpreter per local rank
(:mod:`checkflow.launch.warmstart`) that imports those modules and waits. When torch's
agent starts the next round, the spare of each local rank becomes that worker: it gets the
round's environment, argv and log files and runs the script as ``python -u`` would.

What a spare can and cannot be used for (:func:`usable`, a pure decision):

- only the usual command, ``python -u SCRIPT ...`` or ``python -u -m MODULE ...`` (other
  interpreter flags, ``--no-python`` and NUMA wrapping start cold);
- only when the round's environment differs from the spare's in the variables torch's
  agent and checkflow set per round (``RANK``, ``MASTER_PORT``, ``TORCHELASTIC_*``,
  ``CHECKFLOW_*``, ...), which nothing reads at import time. A spare starts with the
  previous round's environment of its local rank, so ``OMP_NUM_THREADS`` and other
  variables read when torch loads are the worker's own.

A spare costs one interpreter's memory per local rank (about 0.5-1 GiB with torch and
``torch._dynamo`` imported) and its import CPU once per round, started
:data:`SPARE_AFTER_S` after the round so that it does not slow the workers' own start-up.
The swap of torch's process factory (``get_subprocess_handler`` in
``torch.distributed.elastic.multiprocessing.api``) is scoped to the agent's
``_start_workers`` call; when torch moves it, :meth:`WarmPool.handlers` warns and every
start is cold.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
    SubprocessHandler,
)

logger = logging.getLogger(__name__)

DEFAULT_IMPORTS = ("torch", "torch.distributed", "torch._dynamo", "checkflow.checkpointer")
"""What a spare imports: torch, what DDP's constructor imports, and checkflow's runtime
(``import checkflow`` alone is lazy)."""

SPARE_AFTER_S = 5.0
"""Seconds after a round's workers started before their spares are started."""

ROUND_KEYS = frozenset(
    {
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)
ROUND_PREFIXES = ("TORCHELASTIC_", "CHECKFLOW_")
"""Variables that may differ between the spare's environment and the worker's: set per
round by torch's agent or by checkflow, and read at run time, not when torch loads."""


def usable(
    command: Sequence[str], spare_env: Mapping[str, str], env: Mapping[str, str]
) -> str | None:
    """Why a spare started with ``spare_env`` cannot run ``command`` with ``env``; None
    when it can. ``command`` is the interpreter and its arguments, as torch builds it."""
    if len(command) < 3 or command[0] != sys.executable or command[1] != "-u":
        return f"not a plain `{sys.executable} -u SCRIPT` command"
    if command[2].startswith("-") and command[2] != "-m":
        return f"interpreter option {command[2]}"
    keys = set(spare_env) | set(env)
    differ = sorted(
        k
        for k in keys
        if spare_env.get(k) != env.get(k)
        and k not in ROUND_KEYS
        and not k.startswith(ROUND_PREFIXES)
    )
    if differ:
        return f"environment differs in {', '.join(differ[:5])}"
    return None


@dataclass
class Spare:
    """One waiting interpreter, the environment it started with, and the pipe on which it
    says that its imports are done."""

    proc: subprocess.Popen[bytes]
    env: dict[str, str]
    ready_pipe: int
    started: float
    ready: bool = False

    def poll_ready(self) -> bool:
        """True once, when the spare has just finished its imports."""
        if self.ready:
            return False
        try:
            self.ready = os.read(self.ready_pipe, 1) == b"r"
        except BlockingIOError:
            return False
        if self.ready:
            os.close(self.ready_pipe)
        return self.ready

    def hand_over(self, command: Sequence[str], env: Mapping[str, str], streams: Any) -> None:
        """Send the worker's argv, environment and log files; the spare runs from here."""
        job = {"argv": list(command[2:]), "env": dict(env), **streams}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        self.proc.stdin.close()

    def discard(self) -> None:
        if not self.ready:
            with contextlib.suppress(OSError):
                os.close(self.ready_pipe)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # it exits on an empty stdin
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


class WarmPool:
    """The spares of one agent, one per local rank; see the module docstring.

    Args:
        imports: the modules a spare imports before it waits.
        spare_after_s: see :data:`SPARE_AFTER_S`.
    """

    def __init__(
        self, imports: Sequence[str] = DEFAULT_IMPORTS, spare_after_s: float = SPARE_AFTER_S
    ) -> None:
        self.imports = tuple(imports)
        self.spare_after_s = spare_after_s
        self._spares: dict[int, Spare] = {}
        self._last_env: dict[int, dict[str, str]] = {}
        self._round_started = time.monotonic()
        self.warm_starts = 0
        self.cold_starts = 0

    # --- the agent's side -----------------------------------------------------------------
    @contextlib.contextmanager
    def handlers(self) -> Iterator[None]:
        """While torch's agent starts a round, its workers come from this pool."""
        from torch.distributed.elastic.multiprocessing import api

        original = getattr(api, "get_subprocess_handler", None)
        if original is None:
            logger.warning("checkflow: torch has no get_subprocess_handler; cold restarts")
            yield
            return
        api.get_subprocess_handler = self._handler  # type: ignore[assignment]
        try:
            yield
        finally:
            api.get_subprocess_handler = original
            self._round_started = time.monotonic()

    def tick(self) -> None:
        """Called from the agent's monitor loop: start missing spares when it is time."""
        if time.monotonic() - self._round_started < self.spare_after_s:
            return
        for local_rank, env in self._last_env.items():
            spare = self._spares.get(local_rank)
            if spare is None or spare.proc.poll() is not None:
                self._spares[local_rank] = self._start_spare(env)
            elif spare.poll_ready():
                logger.warning(
                    "checkflow: warm spare for local rank %d ready (imports took %.1f s)",
                    local_rank,
                    time.monotonic() - spare.started,
                )

    def ready_ranks(self) -> set[int]:
        """The local ranks whose spare has finished its imports."""
        return {r for r, spare in self._spares.items() if spare.ready or spare.poll_ready()}

    def close(self) -> None:
        for spare in self._spares.values():
            spare.discard()
        self._spares.clear()

    # --- internals ------------------------------------------------------------------------
    def _start_spare(self, env: dict[str, str]) -> Spare:
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        cmd = [sys.executable, "-u", "-m", "checkflow.launch.warmstart", str(write_end)]
        try:
            proc = subprocess.Popen(
                [*cmd, *self.imports],
                env=env,
                stdin=subprocess.PIPE,
                pass_fds=(write_end,),
                start_new_session=True,
            )
        finally:
            os.close(write_end)
        return Spare(proc, env, read_end, time.monotonic())

    def take(
        self, local_rank: int, command: Sequence[str], env: dict[str, str], streams: Any
    ) -> subprocess.Popen[bytes] | None:
        """The spare of ``local_rank``, now running ``command``; None to start cold."""
        self._last_env[local_rank] = env
        spare = self._spares.pop(local_rank, None)
        if spare is None or spare.proc.poll() is not None:
            self.cold_starts += 1
            return None
        reason = usable(command, spare.env, env)
        if reason is not None:
            logger.warning("checkflow: local rank %d starts cold: %s", local_rank, reason)
            spare.discard()
            self.cold_starts += 1
            return None
        ready = spare.ready or spare.poll_ready()
        if not ready:
            os.close(spare.ready_pipe)
        spare.hand_over(command, env, streams)
        self.warm_starts += 1
        logger.warning(
            "checkflow: local rank %d restarts in its warm spare (pid %d%s)",
            local_rank,
            spare.proc.pid,
            "" if ready else ", still importing",
        )
        return spare.proc

    def _handler(self, **kwargs: Any) -> SubprocessHandler:
        return WarmSubprocessHandler(self, **kwargs)


class WarmSubprocessHandler(SubprocessHandler):
    """torch's handler of one worker process, whose process may be a spare of ``pool``."""

    def __init__(self, pool: WarmPool, **kwargs: Any) -> None:
        self._pool = pool
        self._streams = {"stdout": kwargs.get("stdout"), "stderr": kwargs.get("stderr")}
        super().__init__(**kwargs)

    def _popen(self, args: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen[bytes]:
        proc = self._pool.take(self.local_rank_id, args, env, self._streams)
        return proc if proc is not None else super()._popen(args, env)
