"""Local files a checkpoint root holds, opened as if the folder were hostile.

A checkpoint folder may come from another team, a shared volume or a run that crashed half
way, so its entries are not trusted to be what their names say:

- a FIFO or a device named ``MANIFEST.json`` (or standing in for a chunk file) would block
  a plain ``open()`` forever, or stream without end;
- a symbolic link would take a reader (and its "truncated, ends at byte N" message, which
  tells the size of any readable file) or a deletion outside the root.

So readers open only regular files, with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO opens at once
and is then refused by ``fstat``), under a parent folder whose real path lies inside the
root's; deletions never follow a link. Object stores have no such entries: this module is
for ``file://`` roots only.
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import shutil
import stat

from checkflow.storage.errors import StorageError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class NotRegularFileError(StorageError):
    """An entry of the root that a reader refuses: not a regular file, or outside the root.

    A :class:`StorageError` (an ``OSError`` with no errno, so never "not found"): callers that treat
    unreadable commits as damage (the catalog) do so for this one too, and the retry loop
    raises it at once, as it does every error that already says what is wrong.
    """


def entry_kind(path: str) -> str | None:
    """What ``path`` is without following it: "file", "folder", "symbolic link", "FIFO",
    "device", "socket", or None when there is nothing there."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return describe_mode(mode)


def describe_mode(mode: int) -> str:
    """The kind of file an ``st_mode`` says, in words for messages."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def check_inside(root: str, folder: str) -> None:
    """Refuse ``folder`` unless its real path is the root's or lies under it: a step folder
    that is a symbolic link to another run must not be read, written or emptied through.

    Raises:
        NotRegularFileError: it resolves outside the root.
    """
    real_root = os.path.realpath(root)
    real = os.path.realpath(folder)
    if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
        raise NotRegularFileError(
            f"{folder} leads outside the checkpoint root (to {real}); refusing it"
        )


def open_regular(root: str, path: str) -> io.BufferedReader:
    """``path`` opened for reading, only if it is a regular file inside ``root``.

    The checks hold for the file actually opened, not for a name looked at earlier: the
    last component is opened without following a link and without blocking, and ``fstat``
    of that descriptor decides. The parent folders are resolved against the root first.

    Raises:
        FileNotFoundError: there is no such file.
        NotRegularFileError: it is a link, a FIFO, a device or a folder, or lies outside.
    """
    check_inside(root, os.path.dirname(path))
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW on a symbolic link
            raise NotRegularFileError(
                f"{path} is a symbolic link, not a file; refusing to follow it"
            ) from e
        raise
    try:
        check_regular(fd, path)
        # Regular files never block; clear the flag so reads behave as usual.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
        # Through ``open`` so that ``.name`` is the path, as for a plain open.
        return open(path, "rb", opener=lambda _path, _flags: fd)
    except BaseException:
        os.close(fd)
        raise


def check_regular(fd: int, path: str) -> os.stat_result:
    """``fstat`` of ``fd``, refused unless it is a regular file.

    Raises:
        NotRegularFileError: it is a FIFO, a device, a socket or a folder.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(
            f"{path} is a {describe_mode(st.st_mode)}, not a file; refusing it"
        )
    return st


def delete_tree(root: str, path: str) -> None:
    """Delete ``path`` (a file, a folder and all under it, or a link: the link only),
    never following a link and never outside ``root``; missing is not an error.

    Raises:
        NotRegularFileError: the parent folder lies outside the root.
    """
    check_inside(root, os.path.dirname(path))
    kind = entry_kind(path)
    if kind is None:
        return
    if kind == "folder":
        # rmtree does not follow links inside the tree (it unlinks them), and refuses to
        # start on one; its fd-based walk also defeats a link swapped in meanwhile.
        shutil.rmtree(path)
    else:
        os.unlink(path)
