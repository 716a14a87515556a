"""Where the RAM tier lives: one folder per node (the agent's) and one checkpoint root per
rank inside it. No torch: the launcher and ``checkflow ls`` use it.

A rank's root holds only that rank's state, *all* of it (replicated tensors included, which
storage holds once for the whole job), as a checkpoint of world size 1: the rank reads it
back alone, with no other rank's or node's files.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from collections.abc import Mapping

from checkflow.client.env import setting
from checkflow.folders import private_folder

log = logging.getLogger(__name__)

RAM_DIR = "CHECKFLOW_RAM_DIR"
"""The node's RAM-tier folder, exported by ``checkflow run --ram-tier`` to its workers."""
RAM_NODE = "CHECKFLOW_RAM_NODE"
"""This node's name in the RAM-tier path (default: the host name). Two agents on one
machine standing in for two nodes need two names."""
TIER = "ram"
"""The tier's name in its manifests' ``meta`` and in reports to the coordinator."""
REPLICA = "replica"
"""``meta`` key of a RAM step whose rank declared its state the same as every other rank's
(``Checkpointer(jit=True)``): another rank of the job may restore from it."""
JIT_MARKER = "jit"
"""A file in the node's folder: a worker of this node writes just-in-time checkpoints
(``Checkpointer(jit=True)``), so the agent lets the survivors of a crash exit by themselves."""
DEFAULT_ROOT = "/dev/shm/checkflow"
"""tmpfs: memory that outlives the worker processes and is gone at reboot."""


def node_name(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(RAM_NODE) or socket.gethostname()


def node_area(root: str, job: str, node: str) -> str:
    """The folder of one node's RAM tier for one job."""
    return os.path.join(root, _safe(job), _safe(node))


def rank_root(ram_dir: str, rank: int) -> str:
    """The checkpoint root of ``rank`` inside a node's RAM-tier folder."""
    return os.path.join(ram_dir, f"rank-{rank:05d}")


def ram_dir_setting(given: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The RAM-tier folder: ``ram_dir=`` when given, else ``CHECKFLOW_RAM_DIR`` (what
    ``checkflow run --ram-tier`` exports), else None (no RAM tier); the one order of
    :func:`checkflow.client.env.setting`."""
    return setting(given, RAM_DIR, environ)


def create(path: str, root: str) -> str:
    """Make the node's folder ``path`` inside the RAM root ``root`` (kept when it exists: an
    agent that restarts on a node whose memory survived finds its ranks' checkpoints there).

    ``root``, the job's folder and the node's are made with mode 0700, or, when they exist,
    must be this user's and writable by no one else: the names can be computed, so another
    user could have made them first to read the copies or plant newer ones (issue 31).

    Raises:
        UnsafeFolderError: one of them exists and is not private.
    """
    return private_folder(
        path, under=os.path.dirname(os.path.abspath(root)), what="RAM-tier folder"
    )


def mark_jit(ram_dir: str) -> None:
    """Tell the node's agent that workers here write just-in-time checkpoints."""
    os.makedirs(ram_dir, mode=0o700, exist_ok=True)
    with open(os.path.join(ram_dir, JIT_MARKER), "a"):
        pass


def uses_jit(ram_dir: str) -> bool:
    return os.path.exists(os.path.join(ram_dir, JIT_MARKER))


def remove(path: str) -> None:
    """Free the node's RAM tier (the job ended); a folder already gone is fine."""
    shutil.rmtree(path, ignore_errors=True)
    log.info("removed the RAM tier %s", path)


def _safe(name: str) -> str:
    """A path component: no separators, no climbing out."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return cleaned.strip(".") or "_"
