"""How many wrong tokens one client address may try at ``/login``: a token bucket each.

Every address starts with ``capacity`` tries; each wrong token takes one, and one comes
back every ``refill_s`` seconds. With none left, ``/login`` answers 429 with the seconds
to wait, before it reads the form. Pure and clock-driven (``now`` is passed in), so the
rule is tested without sleeping. The table holds at most ``max_addresses`` entries: a
client cycling through addresses cannot grow it without bound (the address that failed
least recently is forgotten first: its bucket is the likeliest to be full again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class LoginLimiter:
    """Per-address buckets of ``/login`` tries (see the module docstring)."""

    capacity: int
    """Wrong tokens an address may send in a burst."""
    refill_s: float
    """Seconds for one more try to come back."""
    max_addresses: int = 10_000
    """Addresses tracked at most; the least recently failed is forgotten first."""
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)
    """address -> (tries left, when that was computed)."""

    def retry_after(self, address: str, now: float) -> int | None:
        """Whole seconds ``address`` must wait before its next try; None: it may try now."""
        left = self._left(address, now)
        if left >= 1:
            return None
        return max(1, math.ceil((1 - left) * self.refill_s))

    def failed(self, address: str, now: float) -> None:
        """``address`` sent a wrong token: take one try from its bucket."""
        left = max(0.0, self._left(address, now) - 1)
        self._buckets.pop(address, None)  # re-insert: the dict keeps recent use at the end
        self._buckets[address] = (left, now)
        while len(self._buckets) > self.max_addresses:
            del self._buckets[next(iter(self._buckets))]  # the least recently failed

    def _left(self, address: str, now: float) -> float:
        entry = self._buckets.get(address)
        if entry is None:
            return float(self.capacity)
        left, then = entry
        return min(float(self.capacity), left + max(0.0, now - then) / self.refill_s)
