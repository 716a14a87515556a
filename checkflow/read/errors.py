"""What goes wrong when reading a checkpoint, and what makes a restore fall back."""

from __future__ import annotations

from checkflow import manifest as mf
from checkflow.codec.base import CodecError
from checkflow.storage import StorageError


class NoCheckpointError(FileNotFoundError):
    """There is no committed checkpoint (at that step)."""


class CorruptCheckpointError(RuntimeError):
    """Stored bytes do not match their checksum, are truncated, or cannot be decoded."""

    def __init__(self, step: int, rank: int, fqn: str, file: str, problem: str) -> None:
        self.step, self.rank, self.fqn, self.file = step, rank, fqn, file
        super().__init__(f"step {step}, rank {rank}, tensor {fqn!r}, file {file}: {problem}")


HOW_TO_TRUST = (
    "unpickling runs code from the checkpoint: if you trust whoever wrote it, pass "
    "trust=True to load() or Checkpointer.restore(), or --trust to 'checkflow restore'"
)


class UntrustedCheckpointError(RuntimeError):
    """Reading would unpickle an object and the caller did not pass ``trust=True``.

    Not a reason to fall back to an older checkpoint: the older ones were written the same
    way, and starting over silently would lose the run.
    """


RESTORE_ERRORS = (
    CorruptCheckpointError,
    mf.ManifestError,
    StorageError,
    CodecError,
    OSError,
    KeyError,
)
"""What makes ``restore`` fall back to an older checkpoint."""
