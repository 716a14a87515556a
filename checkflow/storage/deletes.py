"""Deleting a folder of a checkpoint root, and checking that the store really did.

Local roots are deleted by :func:`~checkflow.storage.local.delete_tree` (never through a
link). Elsewhere it is ``fs.rm(recursive=True)``, and object stores need more care, because
a delete there can fail without an error:

- s3fs ignores the per-key errors of a batch delete (``DeleteObjects`` answers 200 and
  lists them), and a read-only JuiceFS gateway answers every delete 204 while it keeps the
  objects; so after a delete the folder is listed again, and what is left is deleted one
  object at a time, whose errors do reach us (``AccessDenied``…);
- a gateway over a file system (JuiceFS) keeps emptied folders as ``step/`` objects, which
  that second pass removes too (deepest first: a folder goes only once it is empty), or a
  last delete of the folder's own key when nothing else is left;
- a server that refuses batch deletes outright (:mod:`~checkflow.storage.s3compat`) gets
  one request per object from then on.

What is still there after both passes is reported, never hidden: retention and
``checkflow gc`` then say so.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from checkflow import knobs
from checkflow.storage.errors import Failure, classify_error
from checkflow.storage.s3compat import batch_delete_refused, send_content_md5

log = logging.getLogger("checkflow.storage")

DELETE_THREADS = 8
"""Concurrent single-object deletes (a server that refuses batches, or leftovers)."""


class TreeDeleter:
    """Deletes folders and objects on one non-local fsspec filesystem (one per ``Storage``).

    Args:
        fs: the filesystem (an object store, or ``memory://``).
        name: the root's URI, for the log.
    """

    def __init__(self, fs: Any, *, name: str) -> None:
        self.fs = fs
        self.name = name
        self.one_by_one = False
        """The server refused a batch delete: one object per request from then on."""

    def delete(self, target: str) -> list[str]:
        """Delete ``target`` (a file, or a folder and all under it); missing is no error.

        Returns:
            The paths still there afterwards (empty: all gone).
        """
        try:
            self._delete_tree(target)
        except FileNotFoundError as e:
            if classify_error(e) is not Failure.NOT_FOUND:
                raise
        if self._left(target):
            self._delete_each(target)
        else:
            # The emptied folder a gateway over a file system keeps; it lists only in its
            # parent, so delete it blindly: elsewhere a missing key is a 204 and no error.
            self._delete_object(target)
        return self._left(target)

    def _delete_tree(self, target: str) -> None:
        if self.one_by_one:
            self._delete_each(target)
            return
        send_content_md5(self.fs, knobs.s3_delete_md5())
        try:
            self.fs.rm(target, recursive=True)
        except OSError as e:
            if not batch_delete_refused(e):
                raise
            log.warning("%s refuses batch deletes (%s); deleting one by one", self.name, e)
            self.one_by_one = True
            self._delete_each(target)

    def _left(self, target: str) -> list[str]:
        # Not the listing cache: it still holds what this process listed before the delete.
        self.fs.invalidate_cache(target)
        return sorted(self.fs.find(target, withdirs=True))

    def _delete_each(self, target: str) -> None:
        """One request per object under ``target`` (and ``target``), deepest first."""
        by_depth: dict[int, list[str]] = {}
        for path in {target, *self._left(target)}:
            by_depth.setdefault(path.rstrip("/").count("/"), []).append(path)
        with ThreadPoolExecutor(DELETE_THREADS) as pool:
            for depth in sorted(by_depth, reverse=True):
                list(pool.map(self._delete_object, sorted(by_depth[depth])))
        self.fs.invalidate_cache(target)

    def _delete_object(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError as e:
            if classify_error(e) is not Failure.NOT_FOUND:
                raise
