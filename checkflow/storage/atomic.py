"""Atomic writes of local files: a file appears whole under its name, or not at all.

A temporary file next to the target is written, fsynced and renamed (or hard-linked) into
place, then the folder is fsynced so the new name survives a power loss. Used by
:class:`~checkflow.storage.Storage` for local roots and by the CLI for files it writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Callable


def write_file_atomic(target: str, write: Callable[[str], None], *, replace: bool = True) -> None:
    """Make a local file appear whole or not at all: ``write(tmp)`` fills a temporary file
    next to ``target``, which is fsynced and moved into place, then the folder is fsynced.

    ``write`` gets a path rather than a file object because writers such as
    ``safetensors.save_file`` only take paths. A crash leaves at most a hidden
    ``.<name>.tmp-*`` file, never a partial ``target``.

    Args:
        target: the local file to create or replace; its folder must exist.
        write: fills the file at the path it is given.
        replace: replace an existing ``target``. When False an existing (or concurrently
            created) ``target`` is left untouched: a hard link is an atomic
            create-if-absent.

    Raises:
        FileExistsError: ``replace`` is False and ``target`` exists.
    """
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the data is durable before any name points at it
        if replace:
            os.replace(tmp, target)
        else:
            _link_no_clobber(tmp, target)
    finally:
        _remove_quietly(tmp)  # renamed away already, or a hard link's second name
    fsync_dir(folder)


def _link_no_clobber(tmp: str, target: str) -> None:
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise
    except OSError:
        # Some filesystems have no hard links; fall back to check-then-rename.
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "file exists", target) from None
        os.replace(tmp, target)


def write_error(e: BaseException) -> OSError | None:
    """The ``OSError`` (full disk, read-only folder, file too large) behind a failed write.

    Writers in C++ hide it: ``torch.save`` into a Python file turns the file's ``OSError``
    into ``RuntimeError: ... unexpected pos`` and keeps the real one only as its context,
    and DCP wraps that again. The chain is walked iteratively and at most 32 links deep (a
    cycle or a long chain is not followed further); None when no ``OSError`` is in it.
    """
    seen: BaseException | None = e
    for _ in range(32):
        if seen is None or isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable (best effort: not every OS can open a folder)."""
    # The rename is durable only once the folder entry is; not every OS lets us open one.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
