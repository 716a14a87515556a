"""Whether a node's workers form the world ``checkflow run`` launched: a pure decision.

Each worker's ``Checkpointer`` claims the global rank and world size it runs as
(:mod:`checkflow.claims`). One node's claims do not form the launched world when

- a claim's world size is not the world launched (``--nproc-per-node`` x nodes), or
- two workers claim one rank.

Most often the script never called ``torch.distributed.init_process_group``, so every
worker is rank 0 of a world of 1. No restart can help (every round would be the same, and
with a coordinator each registration of the one rank fails the other's, so the rounds never
end), so the agent stops the job and ``checkflow run`` exits 2 with the line
:func:`world_problem` returns. A script that makes no ``Checkpointer`` claims nothing and is
not checked.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Sequence

from checkflow.claims import CLAIMS_DIR, Claim

CLAIM_GRACE_S = 3.0
"""Seconds the agent waits, after the first claim that does not fit, for the claims of the
node's other running workers, so that the line it prints counts them all."""

EXAMPLE = "examples/train_ddp.py"


class WorldMismatch(Exception):
    """The workers do not form the world launched; the message says what to do."""


def world_problem(claims: Sequence[Claim], world_size: int) -> str | None:
    """Why ``claims`` (one node's workers) do not fit a world of ``world_size``; None when
    they do, so far."""
    per_rank = Counter(c.rank for c in claims)
    wrong = [c for c in claims if c.world_size != world_size or per_rank[c.rank] > 1]
    if not wrong:
        return None
    groups = Counter((c.rank, c.world_size) for c in wrong)
    said = ", ".join(
        f"{n} workers run as rank {rank} of a world of {size}"
        if n > 1
        else f"1 worker runs as rank {rank} of a world of {size}"
        for (rank, size), n in sorted(groups.items())
    )
    if all(c.world_size == 1 for c in wrong):
        hint = (
            "the script must call torch.distributed.init_process_group() before it creates "
            f"the Checkpointer (see {EXAMPLE})"
        )
    else:
        hint = (
            "the script must take its rank and world size from the launcher: "
            f"torch.distributed.init_process_group() without rank= or world_size= (see {EXAMPLE})"
        )
    return f"{said}, not as ranks of the world of {world_size} checkflow run launched; {hint}"


def claims_folder() -> str:
    """A new private folder for this agent's workers' claims, exported to them."""
    folder = tempfile.mkdtemp(prefix="checkflow-claims-")  # mode 0700
    os.environ[CLAIMS_DIR] = folder  # workers inherit the agent's environment
    return folder
