"""The write probe: a small file written and deleted at a checkpoint root when it opens."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from checkflow.storage.errors import StorageAccessError, StorageError, root_cause

if TYPE_CHECKING:
    from checkflow.storage.store import Storage

log = logging.getLogger("checkflow.storage")

PROBE_PREFIX = ".checkflow-probe-"
"""The name of the file :func:`check_writable` writes and deletes in the root, before a
random suffix (so that the ranks of a job never probe one name)."""


def check_writable(storage: Storage) -> None:
    """Write a small, uniquely named file in the root and delete it again.

    A root that cannot take checkpoints (``/proc/x``, a path under an existing file, a
    read-only folder, a bucket this key may not write) fails here, at once, rather than
    at every checkpoint in the background while training runs on unprotected. A delete
    that fails is logged, not raised: checkpoints can still be written (retention will
    fail the same way, and says so).

    Raises:
        StorageError: the probe could not be written; the message names the root, the
            reason and what to do.
        StorageAccessError: the store refused the credentials or the access.
    """
    name = f"{PROBE_PREFIX}{uuid.uuid4().hex[:16]}"
    what = f"cannot write checkpoints to {storage.uri}"
    try:
        storage.put(name, [b"checkflow write probe\n"])
    except StorageAccessError as e:
        raise StorageAccessError(f"{what}: {e}", e.failure) from e
    except (OSError, ValueError) as e:
        reason = root_cause(e)
        raise StorageError(
            f"{what}: {reason}; pick a writable folder (or a store and credentials "
            "that may write there)"
        ) from e
    try:
        storage.delete(name)
    except (OSError, StorageAccessError) as e:
        log.warning("wrote %s but cannot delete it: %s", storage.url(name), e)
