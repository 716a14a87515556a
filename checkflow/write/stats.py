"""One record of what a ``Checkpointer`` did, shared by the training and persist threads.

The training thread counts due, taken, waited and skipped checkpoints and their stalls; the
persist thread counts what this rank stored, committed or failed. Each field has one writer
thread, so no lock is needed; readers see each field's latest value.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CheckpointStats:
    """What the checkpointer did; read it to see waits, stalls and the interval."""

    due: int = 0
    """Checkpoints that fell due (by ``every``, the policy, or ``save()``)."""
    taken: int = 0
    """Snapshots started: equal to ``due`` unless ``when_busy="skip"``."""
    waits: int = 0
    """Due checkpoints that found both buffer sets busy, so training waited for a persist."""
    waited_s: float = 0.0
    """Total time training waited for a buffer set (storage slower than the interval)."""
    skipped: int = 0
    """Due checkpoints not taken (only with ``when_busy="skip"``)."""
    committed: int = 0
    """Checkpoints this rank persisted (the commit itself may be another rank's)."""
    failed: int = 0
    """Checkpoints whose persist failed on this rank."""
    last_error: str = ""
    """Why this rank's newest persist failed (``"storage error: ..."`` when storage refused
    it); empty once a persist succeeds again."""
    interval: int | None = None
    """Current interval in steps (``every`` or the policy's choice)."""
    stalls_s: list[float] = field(default_factory=list)
    """Blocking time per checkpoint: the snapshot start plus waits in the optimizer hook."""
    last_step: int | None = None
    """Newest step this rank persisted."""
    bytes_written: int = 0
    """Bytes this rank stored, over all checkpoints."""
    last_bytes: int = 0
    """Bytes this rank stored for its newest checkpoint."""
    last_persist_s: float = 0.0
    """Wall time of the newest persist, from the start of its encoding to its commit."""
    last_kind: str = ""
    """``"full"`` or ``"delta"``: what this rank stored for its newest checkpoint."""
    persist_times: list[float] = field(default_factory=list)
    """Wall time of every persist, in order."""
    retention_failures: int = 0
    """Retention runs on this rank (after its commits, ``keep=``) that left old steps they
    should have deleted: storage then grows past ``keep``."""
    retention_error: str = ""
    """Why the latest retention left steps behind, and whether retrying can help; empty
    once a retention deleted all it should."""
