"""What a worker tells the ``checkflow run`` agent that started it: the rank and world size
it runs as.

The agent launches ``WORLD_SIZE`` workers and gives each its ``RANK``, but only the worker
knows what it then runs as. A script that never calls
``torch.distributed.init_process_group`` runs as rank 0 of a world of 1 in every worker:
the workers overwrite each other's checkpoints and, with a coordinator, each registration
of "rank 0" fails the other's, so the job restarts for ever. So each ``Checkpointer``
writes one small claim into the folder the agent exports as :data:`CLAIMS_DIR`, and the
agent compares the claims with the world it launched (``checkflow.launch.world``).

Outside ``checkflow run`` the variable is unset and nothing is written. No checkflow or
torch imports: the runtime writes claims, the launcher reads them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CLAIMS_DIR = "CHECKFLOW_CLAIMS_DIR"
"""The folder, made by the agent for its workers, where each worker writes its claim."""
_PREFIX, _SUFFIX = "claim-", ".json"


@dataclass(frozen=True, slots=True)
class Claim:
    """One worker process's global rank and world size, as its ``Checkpointer`` sees them."""

    rank: int
    world_size: int
    local_rank: int | None
    """The ``LOCAL_RANK`` the agent gave the process (None: not set)."""
    pid: int


def write_claim(rank: int, world_size: int, environ: Mapping[str, str] = os.environ) -> None:
    """Under ``checkflow run``: write this process's claim (replacing its earlier one).

    Never raises: a claim that cannot be written only leaves the agent without the check.
    """
    folder = environ.get(CLAIMS_DIR)
    if not folder:
        return
    local = environ.get("LOCAL_RANK")
    body: dict[str, int | None] = {"rank": rank, "world_size": world_size, "pid": os.getpid()}
    body["local_rank"] = int(local) if local is not None and local.isdigit() else None
    path = os.path.join(folder, f"{_PREFIX}{os.getpid()}{_SUFFIX}")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(body, f)
        os.replace(path + ".tmp", path)  # the agent never reads half a claim
    except OSError as e:
        logger.warning("checkflow: could not tell the launcher this rank's world: %s", e)


def read_claims(folder: str) -> list[Claim]:
    """Every claim in ``folder``, in pid order; unreadable files are skipped."""
    claims = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        if not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                body = json.load(f)
            claims.append(
                Claim(int(body["rank"]), int(body["world_size"]), body["local_rank"], body["pid"])
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(claims, key=lambda c: c.pid)


def clear_claims(folder: str) -> None:
    """Remove the claims of an earlier round (its processes have exited)."""
    for name in os.listdir(folder):
        if name.startswith(_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
