"""The child side of a warm restart: import the heavy modules, wait, then become a worker.

``python -u -m checkflow.launch.warmstart FD MODULE...`` imports each ``MODULE``
(``torch``, ``torch._dynamo``, ``checkflow``: 5-15 s of a worker's start-up on a busy CPU),
writes one byte to the pipe ``FD`` and closes it (the agent logs the spare as ready), then
blocks on one JSON line on stdin from the agent (:mod:`checkflow.launch.warm`)::

    {"argv": ["train.py", "--lr", "0.1"] or ["-m", "pkg.train", ...],
     "env": {...}, "stdout": "path" or null, "stderr": "path" or null}

and runs the script in this interpreter as ``python -u`` would: the worker's environment
replaces this one, its stdout/stderr go to the files torch's agent chose, and the script
runs as ``__main__`` (``SystemExit`` and uncaught exceptions end the process as they
would end a cold one). An empty stdin (the agent is gone) ends it with 0.

This module imports nothing heavy itself: what to preload is the agent's choice.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time
from typing import Any

WARM_ENV = "CHECKFLOW_WARM_START"
"""Set in a worker started from a warm interpreter to the ``time.time()`` at which it
became the worker (the process itself is older: for logs and start-up timings)."""


SPARE_NAME = "checkflow-spare"
"""The process name (``/proc/PID/comm``, what ``ps -o comm`` and ``top`` show) of a spare
while it waits; as a worker it takes its script's name."""


def set_process_name(name: str) -> None:
    """Linux's process name (15 bytes at most); elsewhere nothing."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass


def redirect(path: str | None, fd: int) -> None:
    """Point ``fd`` at ``path`` (appended: torch's agent already created it), if given."""
    if not path:
        return
    target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(target, fd)
    os.close(target)


def become(job: dict[str, Any]) -> None:
    """Take the worker's environment, streams and argv, then run its script or module."""
    os.environ.clear()
    os.environ.update(job["env"])
    os.environ[WARM_ENV] = f"{time.time():.3f}"
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    redirect(job.get("stdout"), 1)
    redirect(job.get("stderr"), 2)
    argv: list[str] = job["argv"]
    set_process_name(os.path.basename(argv[1] if argv[0] == "-m" else argv[0]))
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main(ready_fd: int, modules: list[str]) -> None:
    set_process_name(SPARE_NAME)
    for name in modules:
        importlib.import_module(name)
    try:
        os.write(ready_fd, b"r")
        os.close(ready_fd)
    except OSError:
        pass  # handed over before it was ready: the agent closed its end

    line = sys.stdin.readline()
    if not line.strip():
        return  # the agent closed the pool (or died) before it needed this interpreter
    become(json.loads(line))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
