"""A job without torch for ``checkflow run`` whose last rank crashes in every round.

Each worker is a simulated rank (``tests/support/simulated_rank.py``: a real coordinator client
that registers, beats and steps) in the rank and world the launcher gave it; the last rank
exits 1 at step 3 of every round. Workers start in a fraction of a second (no torch), so a
test of restart counting spends its time on the restarts, not on imports.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.support

from tests.support.simulated_rank import simulate_rank  # noqa: E402

if __name__ == "__main__":
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    argv = ["--url", os.environ["CHECKFLOW_COORDINATOR"], "--job", os.environ["CHECKFLOW_JOB"]]
    argv += ["--rank", str(rank), "--world-size", str(world), "--steps", "100000"]
    argv += ["--token", os.environ["CHECKFLOW_TOKEN"]]
    if rank == world - 1:
        argv += ["--crash-at", "3"]
    sys.exit(simulate_rank(argv))
