"""Retries with exponential backoff, for transient storage errors only.

:func:`~checkflow.storage.errors.classify_error` decides: a transient failure is retried, an
access failure is raised at once as :class:`StorageAccessError` (every retry would fail the
same way), a missing object at once as ``FileNotFoundError``, anything else as it is.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from checkflow.storage.errors import (
    ACCESS_FAILURES,
    Failure,
    StorageAccessError,
    StorageError,
    classify_error,
)

# The package's logger, not this module's: users and tests filter retry warnings by the
# name "checkflow.storage", which predates the split into modules.
log = logging.getLogger("checkflow.storage")
T = TypeVar("T")

MAX_BACKOFF_S = 5.0


def call_with_retries(
    what: str,
    fn: Callable[[], T],
    *,
    retries: int,
    backoff_s: float,
    describe_access: Callable[[str, Failure, BaseException], str],
) -> T:
    """``fn()``, retried with exponential backoff while it fails transiently.

    Args:
        what: the operation and its object, for messages ("read s3://b/step-…/MANIFEST.json").
        fn: one attempt.
        retries: attempts in all, at least 1.
        backoff_s: the first pause; each next one doubles, up to ``MAX_BACKOFF_S``.
        describe_access: the message of a :class:`StorageAccessError` (what, failure, error).

    Raises:
        StorageAccessError: at once, for an error no retry can fix (see ``Failure``).
        FileNotFoundError: at once, the object or folder does not exist.
        StorageError: a transient failure outlived ``retries`` attempts.
    """
    delay = backoff_s
    for attempt in range(1, retries + 1):
        try:
            return fn()
        except StorageError:
            raise  # already says what is wrong with the object (truncated…)
        except Exception as e:
            failure = classify_error(e)
            if failure in ACCESS_FAILURES:
                raise StorageAccessError(describe_access(what, failure, e), failure) from e
            if failure is Failure.NOT_FOUND:
                # s3fs says "The specified key does not exist." without naming it.
                missing = f"{what} failed: no such file or object"
                raise FileNotFoundError(errno.ENOENT, missing) from e
            if failure is not Failure.TRANSIENT:
                raise
            if attempt == retries:
                raise StorageError(f"{what} failed after {attempt} attempts: {e}") from e
            log.warning("%s failed (attempt %d/%d): %s; retrying", what, attempt, retries, e)
            time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF_S)
    raise AssertionError("unreachable")
