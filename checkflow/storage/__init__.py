"""The only package that talks to fsspec: put / get ranges / list / delete, atomic writes, retries.

It knows paths and bytes, never tensors. Its modules, each one concern:

- :mod:`~checkflow.storage.store`: the :class:`Storage` class, one checkpoint root;
- :mod:`~checkflow.storage.errors`: what a store's exception means (:func:`classify_error`)
  and the errors raised to callers;
- :mod:`~checkflow.storage.retry`: exponential backoff for transient errors only;
- :mod:`~checkflow.storage.atomic`: local files that appear whole or not at all;
- :mod:`~checkflow.storage.direct`: local files written around the page cache (O_DIRECT).
- :mod:`~checkflow.storage.probe`: the write probe ``Checkpointer.open()`` makes at a root;
- :mod:`~checkflow.storage.local`: a local root's entries opened as hostile (regular files
  inside the root only: no FIFO, device or link out of it; deletes never follow a link).

Transient errors (a dropped connection, a timeout, a 5xx or a throttling answer from S3) are
retried with exponential backoff. Errors that no retry can fix (no credentials, credentials the
store rejects, access denied, no such bucket) fail at once as :class:`StorageAccessError`.
Retry warnings are logged as ``checkflow.storage``.
"""

from checkflow.storage.atomic import fsync_dir, write_error, write_file_atomic
from checkflow.storage.errors import Failure, StorageAccessError, StorageError, classify_error
from checkflow.storage.store import DEFAULT_BACKOFF_S, DEFAULT_RETRIES, Storage

__all__ = [
    "DEFAULT_BACKOFF_S",
    "DEFAULT_RETRIES",
    "Failure",
    "Storage",
    "StorageAccessError",
    "StorageError",
    "classify_error",
    "fsync_dir",
    "write_error",
    "write_file_atomic",
]
