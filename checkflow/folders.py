"""Private folders: made by this process's user with mode 0700, refused when planted.

A folder whose name anyone can compute (``/dev/shm/checkflow/<job>/<node>``, the kernel
cache under ``~/.cache`` or a shared ``$CHECKFLOW_CACHE_DIR``) may already exist, made by
another user who can then read what is written there or plant files that are loaded as
ours (issue 31). So each folder of the path that this process would create is created here
with mode 0700, and one that already exists is used only when it is a real folder (not a
symlink: ``lstat``), owned by this user, and writable by no group or other user. No
checkflow imports: the codecs and the RAM tier both use it.
"""

from __future__ import annotations

import os
import stat


class UnsafeFolderError(PermissionError):
    """A folder exists that another user owns or can write, or that is not a folder."""


def unsafe_reason(st: os.stat_result) -> str | None:
    """Why a folder with this ``lstat`` cannot be trusted as private; None when it can."""
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.geteuid():
        return (
            f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}), mode {mode:04o}"
        )
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {mode:04o})"
    return None


def check_private(path: str, what: str = "folder") -> None:
    """Raise :class:`UnsafeFolderError` unless ``path`` is a trusted private folder.

    Raises:
        UnsafeFolderError: one line naming the folder, why, and what to do.
        FileNotFoundError: there is no such folder.
    """
    reason = unsafe_reason(os.lstat(path))
    if reason is not None:
        raise UnsafeFolderError(
            f"{what} {path} {reason}: another user may read or plant files there; remove "
            f"it, or chown it to this user and chmod 0700, or choose another folder"
        )


def private_folder(path: str, *, under: str | None = None, what: str = "folder") -> str:
    """Create ``path`` (mode 0700) and the folders above it up to ``under``, or check the
    ones that exist; ``path`` itself, and every folder between ``under`` (exclusive: the
    system's, such as ``/dev/shm``) and it, must be private (:func:`check_private`).

    Args:
        path: the folder wanted.
        under: an existing folder above ``path`` that is not checked (default: the parent
            of ``path``, so only ``path`` is).
        what: names the folder in the error.

    Raises:
        UnsafeFolderError: a folder of the path exists and is not private.
    """
    path = os.path.abspath(path)
    top = os.path.abspath(under) if under is not None else os.path.dirname(path)
    chain = []
    folder = path
    while folder != top and os.path.dirname(folder) != folder:
        chain.append(folder)
        folder = os.path.dirname(folder)
    if folder != top:
        raise ValueError(f"{path} is not inside {top}")
    os.makedirs(top, exist_ok=True)
    for folder in reversed(chain):
        try:
            os.mkdir(folder, 0o700)
            os.chmod(folder, 0o700)  # exactly 0700 whatever the umask
        except FileExistsError:
            pass
        check_private(folder, what)
    return path
