"""A throwaway PostgreSQL for the coordinator benchmarks, from Debian's binaries.

``initdb`` into a temporary folder, ``pg_ctl`` on 127.0.0.1 and a unix socket in that
folder, one database, trust authentication for the local user only; everything is removed
when the context ends. ``initdb`` refuses to run as root, so as root the cluster belongs to
the ``postgres`` system user (the Debian package creates it) and its commands run through
``runuser``.

    with throwaway_postgres() as url:     # postgresql://postgres@127.0.0.1:PORT/checkflow
        ...

    python benchmarks/_postgres.py        # start one, print its URL, stop on Ctrl-C
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

BIN = Path(os.environ.get("CHECKFLOW_PG_BIN", "/usr/lib/postgresql/15/bin"))
DATABASE = "checkflow"


def _owner() -> str | None:
    """The user the cluster runs as: None for this one, ``postgres`` as root."""
    return "postgres" if os.geteuid() == 0 else None


def _run(argv: list[str], owner: str | None, timeout: float = 120) -> None:
    cmd = ["runuser", "-u", owner, "--", *argv] if owner else argv
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(
            f"{Path(argv[0]).name} failed ({done.returncode}): {done.stderr.strip()}"
        )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def throwaway_postgres(settings: dict[str, str] | None = None) -> Iterator[str]:
    """A fresh cluster with one empty database; yields its ``postgresql://`` URL.

    ``settings`` are extra ``postgres -c`` options (``{"max_connections": "500"}``).
    """
    if not (BIN / "initdb").exists():
        raise RuntimeError(
            f"no PostgreSQL at {BIN}: apt-get install postgresql (or set CHECKFLOW_PG_BIN)"
        )
    owner = _owner()
    root = Path(tempfile.mkdtemp(prefix="checkflow-pg-"))
    data, port = root / "data", _free_port()
    user = owner or pwd.getpwuid(os.geteuid()).pw_name
    if owner:
        shutil.chown(root, owner)
    options = {
        "listen_addresses": "127.0.0.1",
        "port": str(port),
        "fsync": "on",
        **(settings or {}),
    }
    options["unix_socket_directories"] = str(root)
    flags = " ".join(f"-c {k}={v}" for k, v in options.items())
    try:
        _run(
            [str(BIN / "initdb"), "-D", str(data), "-U", user, "--auth=trust", "-E", "UTF8"], owner
        )
        _run(
            [
                str(BIN / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(root / "log"),
                "-o",
                flags,
                "-w",
                "start",
            ],
            owner,
        )
        try:
            _run(
                [str(BIN / "createdb"), "-h", str(root), "-p", str(port), "-U", user, DATABASE],
                owner,
            )
            yield f"postgresql://{user}@127.0.0.1:{port}/{DATABASE}"
        finally:
            _run([str(BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], owner)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    with throwaway_postgres() as url:
        print(url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            sys.exit(0)
