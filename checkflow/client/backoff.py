"""How long a rank's heartbeat thread waits before it tries an unreachable coordinator
again: doubling, capped, with jitter so that thousands of ranks don't return in lockstep."""

from __future__ import annotations

import random

MAX_BACKOFF_S = 4.0
"""Longest wait between retries while the coordinator is unreachable: below its default
heartbeat timeout (10 s), so a restarted coordinator hears from every rank in its grace."""

_jitter = random.Random()
"""The backoff jitter's own generator: the global one would shift the training's ``random``
sequence (saved in checkpoints) by the number of retries, so no run would repeat another."""


def next_delay(delay: float, interval_s: float) -> float:
    """The wait after a failed try that followed a wait of ``delay``."""
    return min(MAX_BACKOFF_S, max(delay, interval_s) * 2) * _jitter.uniform(0.75, 1.0)
