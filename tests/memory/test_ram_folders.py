"""The RAM tier's folders are the agent's own (issue 31): it makes them with mode 0700, and
refuses one that another user made first (owned by ``nobody``), one that group or others
can write (0777), or a symlink, as the node's, the job's, the root's or the peer store's
folder; ``checkflow run`` then stops with one line and exit code 2, planted files intact.
The tests run as root, which is who would otherwise trust what ``nobody`` planted."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from checkflow.folders import UnsafeFolderError
from checkflow.memory import area
from checkflow.memory.peer import PeerStore
from checkflow.memory.wire import RingKey
from tests.support.net import free_port
from tests.support.paths import REPO

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to nobody needs root")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def plant(path: Path, *, owner: int | None = None, perms: int = 0o700) -> Path:
    path.mkdir(parents=True)
    (path / "rank-00000").mkdir()
    (path / "rank-00000" / "planted").write_text("newer state")
    os.chmod(path, perms)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def test_the_agent_makes_the_root_the_job_and_the_node_folder_with_mode_0700(tmp_path):
    root = tmp_path / "shm" / "checkflow"
    old = os.umask(0)  # whatever the umask: exactly 0700
    try:
        made = area.create(area.node_area(str(root), "job", "n1"), str(root))
    finally:
        os.umask(old)
    assert made == str(root / "job" / "n1")
    assert [mode(p) for p in (root, root / "job", root / "job" / "n1")] == [0o700] * 3
    assert area.create(made, str(root)) == made, "an agent restarting keeps its own folder"


@pytest.mark.parametrize(
    ("planted", "owner", "perms", "reason"),
    [
        ("job/n1", NOBODY, 0o700, "owned by uid 65534"),
        ("job/n1", None, 0o777, "writable by group or others (mode 0777)"),
        ("job/n1", None, 0o770, "writable by group or others (mode 0770)"),
        ("job", NOBODY, 0o755, "owned by uid 65534"),
        ("", None, 0o1777, "writable by group or others (mode 1777)"),
    ],
)
def test_a_planted_folder_is_refused_with_one_line_and_left_as_it_is(
    tmp_path, planted, owner, perms, reason
):
    root = tmp_path / "checkflow"
    folder = plant(root / planted if planted else root, owner=owner, perms=perms)
    with pytest.raises(UnsafeFolderError) as refused:
        area.create(area.node_area(str(root), "job", "n1"), str(root))
    message = str(refused.value)
    assert "\n" not in message and str(folder) in message and reason in message
    assert "remove it" in message
    assert (folder / "rank-00000" / "planted").read_text() == "newer state"
    assert mode(folder) == perms


def test_a_symlinked_node_folder_is_refused(tmp_path):
    root = tmp_path / "checkflow"
    elsewhere = plant(tmp_path / "elsewhere")
    (root / "job").mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)
    (root / "job" / "n1").symlink_to(elsewhere)
    with pytest.raises(UnsafeFolderError, match="is a symbolic link"):
        area.create(area.node_area(str(root), "job", "n1"), str(root))


@pytest.mark.parametrize(("owner", "perms"), [(NOBODY, 0o700), (None, 0o777)])
def test_a_planted_peer_store_folder_is_refused(tmp_path, owner, perms):
    node = area.create(str(tmp_path / "checkflow" / "job" / "n1"), str(tmp_path / "checkflow"))
    peers = plant(Path(node) / "peers", owner=owner, perms=perms)
    with pytest.raises(UnsafeFolderError, match="RAM-tier peer store"):
        PeerStore(("127.0.0.1", 0), node, RingKey.derive(b"s", "job"))
    assert (peers / "rank-00000" / "planted").exists()


def test_the_peer_store_makes_its_folder_with_mode_0700(tmp_path):
    store = PeerStore(("127.0.0.1", 0), str(tmp_path / "node"), RingKey.derive(b"s", "job"))
    store.server_close()
    assert mode(tmp_path / "node" / "peers") == 0o700


def _checkflow_run(
    tmp_path: Path, *options: str, env: dict[str, str]
) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the workers must not start')\n")
    command = [
        sys.executable,
        "-m",
        "checkflow.cli",
        "run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "1",
    ]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    command += ["--rdzv-id", "job"]
    return subprocess.run(
        [*command, *options, str(script)],
        env={**os.environ, "PYTHONPATH": str(REPO), "CHECKFLOW_RAM_NODE": "n1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # two fresh interpreters importing torch
def test_checkflow_run_refuses_a_planted_ram_folder_or_a_ring_without_a_secret(tmp_path):
    root = tmp_path / "shm"
    planted = plant(root / "job" / "n1", owner=NOBODY)
    os.chmod(root, 0o700)
    os.chmod(root / "job", 0o700)
    ram = ["--ram-tier", "--ram-root", str(root)]
    proc = _checkflow_run(tmp_path, *ram, env={})
    assert proc.returncode == 2, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if "checkflow: error" in ln]
    assert str(planted) in line and "owned by uid 65534" in line
    assert "the workers must not start" not in proc.stderr
    assert (planted / "rank-00000" / "planted").read_text() == "newer state"

    ring = ["--ram-root", str(tmp_path / "own"), "--ram-listen", "127.0.0.1:0"]
    proc = _checkflow_run(tmp_path, "--ram-tier", *ring, env={"CHECKFLOW_TOKEN": ""})
    assert proc.returncode == 2, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if "checkflow: error" in ln]
    assert "--ram-secret-file PATH" in line
    assert not (tmp_path / "own").exists(), "nothing made before the refusal"
