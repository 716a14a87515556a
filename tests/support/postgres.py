"""A throwaway PostgreSQL cluster from Debian's ``postgresql`` package, for the tests.

``initdb`` into a fresh folder under /tmp, ``pg_ctl start`` on 127.0.0.1 at a free port
(and a unix socket in that folder), stopped and removed at the end. ``fsync=off``: only an
OS crash could lose a commit, never a stop of the server (commits stay synchronous).
``initdb`` refuses to run as root, so as root (CI) every server command runs as the
package's ``postgres`` user (``runuser``) and the folder is made its own; as any other
user, as that user. Trust authentication on 127.0.0.1 only: the cluster lives as long as
the test session.

Each test gets a database of its own (:meth:`Cluster.new_database`), so nothing leaks from
one test to the next.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.support.net import free_port

USER = "checkflow"
"""The cluster's superuser (the tests connect as it)."""


def bin_dir() -> Path | None:
    """The newest installed ``/usr/lib/postgresql/<version>/bin`` with ``initdb``."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    return Path(found[-1]).parent if found else None


def _version(path: str) -> float:
    try:
        return float(Path(path).parent.parent.name)
    except ValueError:
        return 0.0


@dataclass
class Cluster:
    """A running cluster: its folder, port, and how to reach it."""

    folder: Path
    port: int
    bin: Path
    as_user: list[str]

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A new, empty database; its URL (``postgresql://...``, as ``--db`` takes it)."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.sql(f"CREATE DATABASE {name}")
        return self.url(name)

    def sql(self, statement: str, database: str = "postgres") -> str:
        """Run one statement with ``psql`` (outside any transaction); its output."""
        done = subprocess.run(
            [str(self.bin / "psql"), "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1",
             "-d", self.url(database), "-c", statement],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"psql {statement!r}: {done.stderr.strip()}")
        return done.stdout

    def pg_ctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        data = str(self.folder / "data")
        command = [*self.as_user, str(self.bin / "pg_ctl"), "-D", data, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)

    def start(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.folder} "
            "-c fsync=off -c full_page_writes=off "
            "-c max_connections=200"
        )
        log = str(self.folder / "server.log")
        done = self.pg_ctl("-w", "-t", "120", "-l", log, "-o", options, "start", timeout=150)
        if done.returncode != 0:
            tail = Path(log).read_text()[-2000:] if Path(log).exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {done.stdout}{done.stderr}{tail}")

    def stop(self, mode: str = "fast") -> None:
        self.pg_ctl("-w", "-m", mode, "stop")


def start_cluster() -> Cluster:
    """Make and start a cluster (see the module docstring); the caller stops it."""
    binaries = bin_dir()
    if binaries is None:
        raise RuntimeError("PostgreSQL is not installed: apt-get install postgresql")
    folder = Path(tempfile.mkdtemp(prefix="checkflow-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        who = pwd.getpwnam("postgres")
        os.chown(folder, who.pw_uid, who.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    initdb = [*as_user, str(binaries / "initdb"), "-D", str(folder / "data"), "-U", USER,
              "--auth=trust", "-E", "UTF8", "--no-sync", "--locale=C"]  # fmt: skip
    done = subprocess.run(initdb, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"initdb failed: {done.stderr.strip()}")
    for attempt in range(3):  # a free port can be taken between the pick and the bind
        cluster = Cluster(folder, free_port(), binaries, as_user)
        try:
            cluster.start()
            return cluster
        except RuntimeError:
            if attempt == 2:
                shutil.rmtree(folder, ignore_errors=True)
                raise
    raise AssertionError("unreachable")


def remove_cluster(cluster: Cluster) -> None:
    cluster.stop("immediate")
    shutil.rmtree(cluster.folder, ignore_errors=True)
